"""A defence declared in a module of the user's (tests/plugins/scale_updates.py), with SPAM, optax's
Muon and a Mistral-style family (tests/plugins), trains through
``python -m stablejax train --plugin``, and shows up in metrics.jsonl, TensorBoard, the report and
config.json; a resume, ``sample`` and ``report`` import the plugin again from the run's record
(docs/development.md, "Adding a defence")."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from helpers import PLUGINS, ROOT, load_plugin, read_metrics, sets, slow


@pytest.fixture
def declared():
  from stablejax.transforms import defence, metrics
  module = load_plugin("scale_updates")
  yield module
  defence.unregister("scale_updates")
  metrics.unregister_state_metrics(module.ScaleUpdatesState)


# ----------------------------------------------------------------------------- reading TensorBoard


def tensorboard_tags(folder: Path) -> dict[str, list[float]]:
  """Scalar tags and values of the event files in ``folder`` (TFRecord of tensorboardX's Event
  protos: length, its CRC, the record, its CRC)."""
  from tensorboardX.proto import event_pb2
  tags: dict[str, list[float]] = {}
  for path in sorted(folder.glob("events.out.tfevents.*")):
    data, i = path.read_bytes(), 0
    while i + 12 <= len(data):
      (length,) = struct.unpack("<Q", data[i:i + 8])
      event = event_pb2.Event.FromString(data[i + 12:i + 12 + length])
      i += 12 + length + 4
      for value in event.summary.value:
        tags.setdefault(value.tag, []).append(value.simple_value)
  return tags


# ----------------------------------------------------------------------------- the declaration


def test_the_declaration_gives_the_config_section_its_validation_and_the_chain(declared):
  from stablejax.training.config import ConfigError, ineffective_keys, load_config
  from stablejax.training.optim import build_optimizer
  cfg = load_config(None, ["stability.scale_updates.enabled=true", "optimizer.name=adamw",
                           "train.steps=10", "train.warmup_steps=1"])
  assert cfg.stability.scale_updates == declared.ScaleUpdatesConfig(enabled=True, factor=0.5)
  with pytest.raises(ConfigError, match=r"stability.scale_updates.factor=2.0 must lie in"):
    load_config(None, ["stability.scale_updates.enabled=true", "stability.scale_updates.factor=2"])
  off = load_config(None, ["stability.scale_updates.factor=0.25"])
  assert ineffective_keys(off) == ["stability.scale_updates.factor=0.25 has no effect with "
                                   "stability.scale_updates.enabled=false"]
  # In the chain at its position: after the optimizer, before the learning-rate scale, inside
  # the skip wrappers; the update is half of the chain's without it (the factory got the
  # section's factor without the declaration restating it).
  params = {"w": jnp.ones(4)}
  grads = {"w": jnp.full(4, 0.5)}
  with_it, without = build_optimizer(cfg), build_optimizer(load_config(
      None, ["optimizer.name=adamw", "train.steps=10", "train.warmup_steps=1"]))
  state_a, state_b = with_it.init(params), without.init(params)
  # Each chain's update jitted, as the trainer runs it (one program, not one per operation).
  update_a, update_b = jax.jit(with_it.update), jax.jit(without.update)
  for _ in range(2):  # the warmup's first rate is 0
    a, state_a = update_a(grads, state_a, params, loss=jnp.float32(1.0))
    b, state_b = update_b(grads, state_b, params, loss=jnp.float32(1.0))
  assert float(a["w"][0]) == pytest.approx(0.5 * float(b["w"][0]), rel=1e-6) != 0.0
  # skip_nonfinite(skip_spikes(chain(zclip, adamw, scale_updates, lr scale))), keyed by name
  assert sorted(state_a) == ["lr_scale", "optimizer", "scale_updates", "skip_nonfinite",
                             "skip_spikes", "zclip"]
  from stablejax.transforms import metrics
  assert metrics.stability_metrics(state_a)["scale_updates/steps"] == 2


def test_without_the_plugin_the_key_is_unknown():
  from stablejax.training.config import ConfigError, load_config
  with pytest.raises(ConfigError, match="scale_updates"):
    load_config(None, ["stability.scale_updates.enabled=true"])


def test_a_plugin_that_cannot_be_imported_is_one_line(tmp_path):
  from stablejax.training.config import ConfigError, load_config
  with pytest.raises(ConfigError, match=r"^plugin 'no_such_plugin_module' \(from --plugin\) "
                                        r"cannot be imported \(ModuleNotFoundError"):
    load_config(None, [], plugins=["no_such_plugin_module"])
  broken = tmp_path / "broken_plugin.py"
  broken.write_text("raise RuntimeError('the plugin failed')\n")
  with pytest.raises(ConfigError, match=r"cannot be imported \(RuntimeError: the plugin failed\)"):
    load_config(None, [], plugins=[str(broken)])


# ----------------------------------------------------------------------------- the programs


def _program(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  return subprocess.run([sys.executable, "-m", "stablejax", *args], cwd=cwd, env=env,
                        capture_output=True, text=True, timeout=timeout)


@slow
def test_a_plugin_defence_trains_from_the_command_line_and_every_program_reads_the_run(tmp_path):
  workdir = tmp_path / "work"
  workdir.mkdir()
  shutil.copy(PLUGINS / "scale_updates.py", workdir / "mydefs.py")  # the user's own modules
  # A defence that reads and resets the optimizer's moments, an optimizer and a model family
  # (Llama with a sliding window): one file each, all in one run.
  shutil.copy(PLUGINS / "spam.py", workdir / "myspam.py")
  shutil.copy(PLUGINS / "optax_muon.py", workdir / "myoptimizer.py")
  shutil.copy(PLUGINS / "mistral.py", workdir / "mymodel.py")
  out = workdir / "run"
  steps = ("train.steps=8", "train.warmup_steps=2", "train.eval_every=8", "checkpoint.every=4",
           "stability.spam.enabled=true", "stability.spam.reset_every=3",
           "optimizer.name=optax_muon", "model.family=mistral", "model.sliding_window=4")
  done = _program("train", "--plugin", "mydefs", "--plugin", "myspam", "--plugin", "myoptimizer",
                  "--plugin", "mymodel", *sets("stability.scale_updates.enabled=true", *steps),
                  "--out", str(out), cwd=workdir)
  assert done.returncode == 0, done.stderr[-2000:]
  assert "Mistral" in done.stdout and "sliding window 4" in done.stdout  # the banner's model
  config = json.loads((out / "config.json").read_text())
  assert config["plugins"] == ["mydefs", "myspam", "myoptimizer", "mymodel"]
  assert config["stability"]["scale_updates"] == {"enabled": True, "factor": 0.5}
  assert config["optimizer"]["name"] == "optax_muon" and config["optimizer"]["nesterov"] is True
  assert config["model"]["family"] == "mistral" and config["model"]["sliding_window"] == 4
  train = [r for r in read_metrics(out) if "loss" in r and "event" not in r]
  assert [r["scale_updates/steps"] for r in train] == [r["step"] for r in train]  # every update
  tags = tensorboard_tags(out / "tensorboard")
  assert tags["stability/scale_updates/steps"] == [float(r["step"]) for r in train]
  assert tags["stability/rate/scale_updates_rate"][-1] == 1.0

  # The report imports the recorded plugin: its rate is known.
  report = _program("report", str(out), cwd=workdir)
  assert report.returncode == 0, report.stderr[-2000:]
  assert "scale_updates_rate 1" in report.stdout
  assert "spam_clip_rate" in report.stdout  # the moment-reading defence's rate, by name
  assert [r["spam/resets"] for r in train][-1] == 2  # steps 3 and 6
  # A resume without --plugin imports it from the run's record, and goes on.
  resumed = _program("train", *sets("stability.scale_updates.enabled=true", *steps,
                                    "train.steps=12"), "--out", str(out), cwd=workdir)
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  assert max(r["step"] for r in read_metrics(out) if "scale_updates/steps" in r) == 12
  # sample reads the run's config, which names the plugin's section.
  sample = _program("sample", str(out), "--max-new-tokens", "4", cwd=workdir)
  assert sample.returncode == 0, sample.stderr[-2000:]
  # From a folder where the plugin cannot be imported: one line naming it.
  elsewhere = _program("sample", str(out), "--max-new-tokens", "4", cwd=tmp_path)
  lines = elsewhere.stderr.strip().splitlines()
  assert elsewhere.returncode == 2 and len(lines) == 1, elsewhere.stderr
  assert "plugin 'mydefs'" in lines[0] and "cannot be imported" in lines[0]


def test_a_declaration_is_checked_when_it_is_registered(declared):
  import dataclasses
  from stablejax.transforms import defence
  ok = dict(config=declared.ScaleUpdatesConfig, position=defence.Position.UPDATE)
  for name in ("optimizer", "lr_scale", "not a name"):  # the trainer's own keys, and no section
    with pytest.raises(ValueError, match="must be an identifier other than optimizer, lr_scale"):
      defence.register(defence.Defence(name=name, factory=declared.scale_updates, **ok))
  with pytest.raises(ValueError, match="exactly one of factory="):
    defence.register(defence.Defence(name="both_missing", **ok))

  @dataclasses.dataclass
  class NoSwitch:
    factor: float = 0.5
  with pytest.raises(ValueError, match="no 'enabled' field"):
    defence.register(defence.Defence(name="no_switch", config=NoSwitch,
                                     position=defence.Position.UPDATE,
                                     factory=declared.scale_updates))
  assert defence.get("both_missing") is None and defence.get("no_switch") is None


# ----------------------------------------------------------------------------- refused declarations


DEFENCE_PLUGIN = '''
import dataclasses
import optax
from stablejax.transforms import defence


@dataclasses.dataclass
class Section:
  {fields}


DECLARED = defence.Defence(name={name!r}, config=Section, position=defence.Position.UPDATE,
                           factory=optax.scale)
'''

FAMILY_PLUGIN = '''
import dataclasses
from stablejax.modeling.family import ModelFamily


@dataclasses.dataclass
class Section:
  vocab_size: int = 256
  {fields}


DECLARED = ModelFamily(name={name!r}, config=Section, build=lambda section, run: None)
'''

ENABLED = "enabled: bool = False\n  step_size: float = 0.5"


def _plugin(folder: Path, stem: str, template: str, name: str, fields: str) -> str:
  path = folder / f"{stem}.py"
  path.write_text(template.format(name=name, fields=fields))
  return str(path)


def test_a_name_declared_twice_is_refused_naming_both_modules(tmp_path):
  from stablejax.modeling import family
  from stablejax.training.config import ConfigError, load_config
  from stablejax.transforms import defence
  first = _plugin(tmp_path, "first_decl", DEFENCE_PLUGIN, "declared_twice", ENABLED)
  second = _plugin(tmp_path, "second_decl", DEFENCE_PLUGIN, "declared_twice", ENABLED)
  try:
    with pytest.raises(ConfigError) as e:
      load_config(None, [], plugins=[first, second])
    assert f"defence 'declared_twice' is declared twice, by {first} and by {second}" in str(
        e.value)
    assert defence.get("declared_twice").config.__module__ == "stablejax_plugin_first_decl"
  finally:
    defence.unregister("declared_twice")
  # Named like a built-in, with the config leaving its keys out: refused; the built-in stays.
  builtins = defence.get("zclip"), family.get("gpt")
  zclip = _plugin(tmp_path, "own_zclip", DEFENCE_PLUGIN, "zclip", ENABLED)
  with pytest.raises(ConfigError, match="defence 'zclip' is declared twice, by "
                                        f"stablejax.transforms.zclip and by {zclip}"):
    load_config(None, [], plugins=[zclip])
  gpt = _plugin(tmp_path, "own_gpt", FAMILY_PLUGIN, "gpt", "max_seq_len: int = 64")
  with pytest.raises(ConfigError, match="model family 'gpt' is declared twice, by "
                                        f"stablejax.modeling.gpt and by {gpt}"):
    load_config(None, [], plugins=[gpt])
  assert (defence.get("zclip"), family.get("gpt")) == builtins


# What the registries refuse, whichever program imports the plugin.
REFUSED = {
    "named like a built-in": (DEFENCE_PLUGIN, "zclip", ENABLED, "declared twice"),
    "no enabled": (DEFENCE_PLUGIN, "no_switch_decl", "step_size: float = 0.5",
                   "has no 'enabled' field"),
    "a reserved name": (DEFENCE_PLUGIN, "optimizer", ENABLED, "must be an identifier other than"),
    "no max_seq_len": (FAMILY_PLUGIN, "no_max_len", "d_model: int = 8",
                       "must have the fields vocab_size and max_seq_len"),
    "a field without a default": (DEFENCE_PLUGIN, "bare_field",
                                  "step_size: float\n  enabled: bool = False",
                                  "has no default for step_size"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_a_refused_declaration_is_one_line_in_every_program(case, tmp_path, capsys):
  from stablejax.cli import quantize_eval, report, sample, train
  template, name, fields, problem = REFUSED[case]
  plugin = _plugin(tmp_path, f"refused_{name}", template, name, fields)
  run = tmp_path / "run"  # a run that recorded the plugin, as far as the programs read it
  run.mkdir()
  (run / "config.json").write_text(json.dumps({"plugins": [plugin]}))
  (run / "run.json").write_text(json.dumps({"program": "stablejax train",
                                            "written": ["config.json"]}))
  programs = {"train": (train.main, ["--plugin", plugin, "--out", str(tmp_path / "new")]),
              "sample": (sample.main, [str(run)]), "report": (report.main, [str(run)]),
              "quantize-eval": (quantize_eval.main, [str(run)])}
  for program, (main, argv) in programs.items():
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, (program, err)
    assert err[0].startswith("error: ") and f"plugin {plugin!r}" in err[0] and problem in err[0]
  assert not (tmp_path / "new").exists()


def test_a_plugin_that_exits_at_import_is_one_line(tmp_path, capsys):
  from stablejax.cli import train
  plugin = tmp_path / "exits_at_import.py"
  plugin.write_text("import sys\nsys.exit(0)\n")
  assert train.main(["--plugin", str(plugin), "--out", str(tmp_path / "run")]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "called sys.exit(0) while it was imported" in err[0], err


def test_a_recorded_plugin_is_named_as_the_runs(tmp_path, capsys):
  from stablejax.cli import train
  run = tmp_path / "run"
  run.mkdir()
  (run / "config.json").write_text(json.dumps({"plugins": ["no_such_recorded_plugin"]}))
  (run / "run.json").write_text(json.dumps({"program": "stablejax train",
                                            "written": ["config.json"]}))
  assert train.main(["--out", str(run)]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "plugin 'no_such_recorded_plugin'" in err[0], err
  assert f"(from {run / 'config.json'})" in err[0] and "--plugin" not in err[0]


def test_a_module_added_to_the_transforms_is_a_built_in_defence_the_report_reads(tmp_path):
  """A new built-in defence is its module and nothing else: put in stablejax/transforms/ (here a
  folder of that package's path), the registry declares it and the monitor, the score and the
  report read its rates, in a fresh process that never imports it by name."""
  folder = tmp_path / "more_transforms"
  folder.mkdir()
  shutil.copy(PLUGINS / "scale_updates.py", folder / "scale_updates.py")
  run = tmp_path / "run"
  run.mkdir()
  with open(run / "metrics.jsonl", "w") as f:
    for step in range(1, 21):  # every other step scaled
      f.write(json.dumps({"step": step, "loss": 3.0 - step / 100, "grad_norm": 1.0,
                          "scale_updates/steps": step // 2,
                          "scale_updates/scaled": step % 2 == 0}) + "\n")
  code = (
      "import sys, stablejax.transforms\n"
      f"stablejax.transforms.__path__.append({str(folder)!r})\n"
      "from stablejax.transforms import defence\n"
      "print([d.name for d in defence.registered() if d.name == 'scale_updates'])\n"
      "from stablejax.cli.report import main\n"
      f"sys.exit(main([{str(run)!r}, '--out', {str(tmp_path / 'report.png')!r}]))\n")
  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = proc.stdout.splitlines()
  assert lines[0] == "['scale_updates']"
  (rates,) = [line for line in lines if line.startswith("rates (last window):")]
  assert "scale_updates_rate 0.5" in rates
