"""tools/mutation.py (run by hand, not here): its mutants still apply to the current source."""

import importlib.util
from pathlib import Path

TOOL = Path(__file__).resolve().parent.parent / "tools" / "mutation.py"


def test_every_mutant_applies_once_to_the_current_source():
  spec = importlib.util.spec_from_file_location("mutation", TOOL)
  mutation = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mutation)
  assert mutation.check() == []
  paths = {m.path for m in mutation.MUTANTS}
  assert paths == {mutation.RECOVERY, mutation.CHECKPOINT, mutation.SKIPPING}
  for m in mutation.MUTANTS:
    assert m.tests and m.what
