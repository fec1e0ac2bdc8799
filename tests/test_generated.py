"""The files read off the code (tools/generate.py) are up to date: the packaged default config and
the docs' tables of defences, model families and monitor rates."""

import json
from pathlib import Path

from helpers import load_tool

ROOT = Path(__file__).resolve().parent.parent


def _tool():
  return load_tool("generate")


def test_every_generated_file_is_what_the_code_says():
  stale = [str(p.relative_to(ROOT)) for p in _tool().stale()]
  assert stale == [], f"run python tools/generate.py: {stale} out of date"


def test_the_default_config_lists_every_declared_section():
  from stablejax.modeling import family
  from stablejax.transforms import defence
  written = json.loads((ROOT / "stablejax" / "configs" / "default.json").read_text())
  assert set(written["stability"]) >= {d.name for d in defence.registered()}
  assert written["model"]["family"] == family.DEFAULT_FAMILY
  assert "vocab_size" not in written["model"]  # left to the data


def test_the_docs_tables_name_every_declaration():
  from stablejax.modeling import family
  from stablejax.monitor import specs
  from stablejax.transforms import defence
  trainer = (ROOT / "docs" / "trainer.md").read_text()
  monitoring = (ROOT / "docs" / "monitoring.md").read_text()
  for d in defence.registered():
    assert f"| `stability.{d.name}` |" in trainer
  for f in family.registered():
    assert f"| `{f.name}` |" in trainer
  for _, rate in specs.rates():
    assert f"| `{rate.name}` |" in monitoring
