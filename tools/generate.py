"""Writes the files that are read off the code, so that no list is kept by hand.

    python tools/generate.py           # rewrite them
    python tools/generate.py --check   # exit 1 naming each file that is out of date

* ``stablejax/configs/default.json``: the config dataclasses' defaults (every registered defence's
  section; the model section of the default family, without ``vocab_size``, which the data sets);
* ``stablejax/__init__.py``'s imports for type checkers, one per public name of its
  ``_EXPORTS`` (the one list of the public names);
* the tables of docs/trainer.md (the stability sections, the model families) and of
  docs/monitoring.md (the monitor's rates, the stability score's budgets, the troubleshooting
  rows), between ``<!-- generated: NAME -->`` and ``<!-- end generated: NAME -->``, from the
  defence, model-family and metric declarations.

A new defence or model family is its module and its test; running this afterwards adds it here
(``tests/test_generated.py`` fails until then).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = ROOT / "stablejax" / "configs" / "default.json"
TRAINER_DOC = ROOT / "docs" / "trainer.md"
PACKAGE_FRONT = ROOT / "stablejax" / "__init__.py"
SECTIONS = ROOT / "stablejax" / "training" / "config" / "sections.py"
MONITORING_DOC = ROOT / "docs" / "monitoring.md"


def default_config() -> str:
  """The text of ``stablejax/configs/default.json``."""
  from stablejax.training.config import Config, to_dict
  values = to_dict(Config())
  del values["model"]["vocab_size"]  # left to the data (a prepared folder's vocabulary)
  return json.dumps(values, indent=2) + "\n"


def _value(v: Any) -> str:
  return json.dumps(v)


def _keys(section: Any, skip: tuple[str, ...] = ("enabled",)) -> str:
  return ", ".join(f"`{f.name}` {_value(getattr(section, f.name))}"
                   for f in dataclasses.fields(section) if f.name not in skip)


def _table(headers: list[str], rows: list[list[str]]) -> str:
  lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
  lines += ["| " + " | ".join(row) + " |" for row in rows]
  return "\n".join(lines)


def stability_table() -> str:
  """The chain's shape and one row per section of ``stability``."""
  from stablejax.training.config import Config
  from stablejax.transforms import defence
  stability = Config().stability
  declared = defence.registered()
  inner = [d.name for d in declared if d.position is not defence.Position.WRAPPER]
  at = {d.name: d.position for d in declared}
  chain = ([n for n in inner if at[n] is defence.Position.GRADIENT] + ["optimizer"]
           + [n for n in inner if at[n] is defence.Position.UPDATE] + ["lr scale"]
           + [n for n in inner if at[n] is defence.Position.FINAL])
  shape = f"chain({', '.join(chain)})"
  for d in declared:
    if d.position is defence.Position.WRAPPER:
      shape = f"{d.name}({shape})"
  rows = []
  for d in declared:
    section = d.section(stability)
    rows.append([f"`stability.{d.name}`", "yes" if section.enabled else "no", _keys(section),
                 d.label])
  rows.append(["`stability.z_loss`", "", _value(stability.z_loss),
               "PaLM's z-loss weight (0: off)"])
  rows.append(["`stability.loss_scale`", "fp16", _keys(stability.loss_scale, ()),
               "dynamic loss scale"])
  rows.append(["`stability.recovery`", "yes" if stability.recovery.enabled else "no",
               _keys(stability.recovery), "[automatic recovery](recovery.md)"])
  rows.append(["`stability.determinism`", "yes" if stability.determinism.check_every else "no",
               _keys(stability.determinism, ()),
               "[determinism check](recovery.md#determinism-check) (0: off)"])
  rows.append(["`stability.replicas`", "several devices", _keys(stability.replicas, ()),
               "[replica fingerprints](recovery.md#replica-fingerprints) (0: off)"])
  rows.append(["`stability.watchdog`", "yes" if stability.watchdog.enabled else "no",
               _keys(stability.watchdog), "[progress watchdog](recovery.md#progress-watchdog)"])
  return (f"The chain, in this order: `{shape}`.\n\n"
          + _table(["section", "on", "keys (defaults)", "what"], rows))


def families_table() -> str:
  """One row per model family."""
  from stablejax.modeling import family
  rows = []
  for f in family.registered():
    section = family.section_class(f)()
    rows.append([f"`{f.name}`", _keys(section, ("family",)), f.label])
  return _table(["`model.family`", "keys (defaults)", "what"], rows)


def rates_table() -> str:
  """The monitor's rates: what each counts and where it comes from."""
  from stablejax.monitor import specs
  rows = []
  for spec, rate in specs.rates():
    source = (f"`{spec.key(rate.counter)}` differences, else `{spec.key(rate.flag)}`"
              if rate.counter else f"`{spec.key(rate.flag)}` (per logged step)")
    rows.append([f"`{rate.name}`", rate.label + (" (skipped steps)" if rate.skip else ""),
                 source])
  for spec in specs.metric_specs():
    if spec.threshold:
      rows.append([f"`{spec.prefix}_threshold`",
                   "the clip value in effect at the latest record (not a rate)",
                   f"`{spec.key(spec.threshold)}`"])
  rows.append([f"`{specs.SKIP_RATE}`", "the sum of the skipped-step rates (all skipped steps)",
               ""])
  rows.append([f"`{specs.ROLLBACKS}`", "rollbacks recorded in the window", "`record_rollback`"])
  return _table(["key", "meaning", "from"], rows)


def score_table() -> str:
  """The signals the stability score counts, with their budgets."""
  from stablejax.monitor import specs
  rows = [[rate.label, f"`{rate.name}`", _value(rate.budget)]
          for _, rate in specs.rates() if rate.budget is not None]
  rows.append(["skipped steps per step", f"`{specs.SKIP_RATE}`", _value(specs.SKIP_RATE_BUDGET)])
  rows.append(["rollbacks in the window", f"`{specs.ROLLBACKS}`",
               _value(specs.ROLLBACKS_BUDGET)])
  return _table(["signal", "key", "budget `b_i`"], rows)


def advice_table() -> str:
  """The troubleshooting rows: each scored rate over its budget, and the loss plateau."""
  from stablejax.monitor import score
  rows = []
  for name, budget, advice in score.TROUBLESHOOTING:
    rows.append([f"`{name} > {_value(budget)}`", advice.split(": ", 1)[-1]])
  rows.append(["loss plateau: the last window's mean loss is not below the previous window's, "
               "while the logged `lr` is at least half its peak (in a schedule's decay phase a "
               "flatter loss is expected)", score.PLATEAU_ADVICE.split(": ", 1)[-1]])
  return _table(["condition", "advice"], rows)


BLOCKS: dict[Path, dict[str, Callable[[], str]]] = {
    TRAINER_DOC: {"stability-sections": stability_table, "model-families": families_table},
    MONITORING_DOC: {"rates": rates_table, "score-budgets": score_table,
                     "troubleshooting": advice_table},
}


def _with_blocks(text: str, blocks: dict[str, Callable[[], str]], path: Path) -> str:
  for name, make in blocks.items():
    pattern = re.compile(rf"(<!-- generated: {re.escape(name)} .*?-->\n)(.*?)"
                         rf"(<!-- end generated: {re.escape(name)} -->)", re.S)
    if not pattern.search(text):
      raise SystemExit(f"{path}: no block '{name}' (<!-- generated: {name} ... --> ... "
                       f"<!-- end generated: {name} -->)")
    text = pattern.sub(lambda m, table=make(): m.group(1) + table + "\n" + m.group(3), text)
  return text


def package_front() -> str:
  """``stablejax/__init__.py`` with the type checkers' imports of the public names, one
  ``from MODULE import NAME as NAME`` per entry of ``_EXPORTS`` (an explicit re-export)."""
  import stablejax
  text = PACKAGE_FRONT.read_text()
  begin, end = "  # <!-- generated: public-names", "  # <!-- end generated: public-names -->"
  head, rest = text.split(begin, 1)
  marker, rest = rest.split("\n", 1)
  _, tail = rest.split(end, 1)
  lines = [f"  from {module} import {name} as {name}"
           for name, module in stablejax._EXPORTS.items()]
  return head + begin + marker + "\n" + "\n".join(lines) + "\n" + end + tail


def _replace_block(text: str, name: str, indent: str, lines: list[str]) -> str:
  """``text`` with the lines between ``# <!-- generated: NAME ...-->`` and its end replaced."""
  begin, end = f"{indent}# <!-- generated: {name}", f"{indent}# <!-- end generated: {name} -->"
  head, rest = text.split(begin, 1)
  marker, rest = rest.split("\n", 1)
  _, tail = rest.split(end, 1)
  return head + begin + marker + "\n" + "".join(line + "\n" for line in lines) + end + tail


def stability_sections() -> str:
  """``training/config/sections.py`` with ``StabilitySections``' static types of the built-in
  defences' sections (``cfg.stability.zclip: ZClipConfig``), from the registry."""
  from stablejax.transforms import defence
  declared = defence.registered()
  text = _replace_block(SECTIONS.read_text(), "stability-section-types", "  ",
                        [f"  from {d.config.__module__} import {d.config.__qualname__}"
                         for d in declared])
  return _replace_block(text, "stability-sections", "    ",
                        [f"    {d.name}: {d.config.__qualname__}" for d in declared])


def generated() -> dict[Path, str]:
  """Every generated file's expected text."""
  out = {DEFAULT_CONFIG: default_config(), PACKAGE_FRONT: package_front(),
         SECTIONS: stability_sections()}
  for path, blocks in BLOCKS.items():
    out[path] = _with_blocks(path.read_text(), blocks, path)
  return out


def stale() -> list[Path]:
  """The generated files whose text differs from what the code says."""
  return [path for path, text in generated().items() if path.read_text() != text]


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--check", action="store_true", help="only say which files are stale")
  args = parser.parse_args(argv)
  if args.check:
    out_of_date = stale()
    for path in out_of_date:
      print(f"{path.relative_to(ROOT)} is out of date: run python tools/generate.py")
    return 1 if out_of_date else 0
  for path, text in generated().items():
    if path.read_text() != text:
      path.write_text(text)
      print(f"wrote {path.relative_to(ROOT)}")
  return 0


if __name__ == "__main__":
  sys.path.insert(0, str(ROOT))
  sys.exit(main())
