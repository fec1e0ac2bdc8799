"""tools/mutation.py (run by hand, not here): its mutants still apply to the current source, and
every selection it runs names tests that exist."""

from pathlib import Path

from helpers import load_tool

ROOT = Path(__file__).resolve().parent.parent


def _tool():
  return load_tool("mutation")


def test_every_mutant_applies_once_to_the_current_source():
  mutation = _tool()
  assert mutation.check() == []
  ids = [m.id for m in mutation.MUTANTS]
  assert sorted(i for i in set(ids) if ids.count(i) > 1) == []  # --only names one mutant
  paths = {m.path for m in mutation.MUTANTS}
  assert paths == set(mutation.AREA_TESTS)  # every module with a test area has mutants
  for m in mutation.MUTANTS:
    assert m.tests and m.what
    assert m.module == m.path.removeprefix("stablejax/").removesuffix(".py")
    for item in m.tests:
      if item.startswith(("tests/", "stablejax/")):
        assert (ROOT / item).is_file(), f"{m.id}: {item} does not exist"


def test_each_module_has_several_mutants_and_equivalents_say_why():
  mutation = _tool()
  per_module = {}
  for m in mutation.MUTANTS:
    per_module[m.module] = per_module.get(m.module, 0) + 1
    if m.equivalent:
      assert len(m.equivalent) > 20, m.id
  assert min(per_module.values()) >= 4, per_module


def test_module_and_id_selection():
  mutation = _tool()
  zclip = mutation.select(mutation.MUTANTS, modules=["zclip"])
  assert zclip and {m.module for m in zclip} == {"transforms/zclip"}
  assert mutation.select(mutation.MUTANTS, modules=["transforms/zclip.py"]) == zclip
  assert [m.id for m in mutation.select(mutation.MUTANTS, only=["R3", "C9"])] == ["R3", "C9"]
  assert mutation.select(mutation.MUTANTS, only=["R3"], modules=["zclip"]) == []
  lines = mutation.rate_table([(zclip[0], True), (zclip[1], False)])
  assert lines[1].split() == ["transforms/zclip", "2", "1", "0", "50%"]
