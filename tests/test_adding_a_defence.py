"""A defence declared in this file alone trains through the trainer's own path and shows up in
metrics.jsonl, TensorBoard and the report, with no other file edited (docs/development.md,
"Adding a defence")."""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
import pytest

from stablejax.transforms import defence, metrics
from helpers import read_metrics, run_inprocess, slow


# ----------------------------------------------------------------------------- the defence
# Everything a new defence needs: its transform and state (optax's shape), its metrics, its
# config section and its declaration.


class ScaleUpdatesState(NamedTuple):
  steps: jax.Array    # int32 updates scaled so far
  scaled: jax.Array   # bool: this step's update was scaled


def scale_updates(factor: float) -> optax.GradientTransformation:
  """Multiplies every update by ``factor`` (a stand-in for a real defence's rule)."""
  def init(params):
    return ScaleUpdatesState(jnp.zeros([], jnp.int32), jnp.zeros([], bool))

  def update(updates, state, params=None):
    return (jax.tree.map(lambda u: u * factor, updates),
            ScaleUpdatesState(state.steps + 1, jnp.asarray(True)))
  return optax.GradientTransformation(init, update)


@dataclasses.dataclass
class ScaleUpdatesConfig:
  enabled: bool = False
  factor: float = 0.5

  def validate(self, where, ctx):
    if not 0 < self.factor <= 1:
      raise ValueError(f"{where}.factor={self.factor} must lie in (0, 1]")


def _register():
  metrics.register_state_metrics(
      ScaleUpdatesState, "scale_updates", lambda s: {"steps": s.steps, "scaled": s.scaled},
      rates=(metrics.Rate("scale_updates_rate", flag="scaled", counter="steps",
                          label="scaled updates"),))
  defence.register(defence.Defence(
      name="scale_updates", config=ScaleUpdatesConfig, position=defence.Position.UPDATE,
      build=lambda section, ctx: scale_updates(section.factor), label="scale every update"))


@pytest.fixture
def declared():
  _register()
  yield
  defence.unregister("scale_updates")
  metrics.unregister_state_metrics(ScaleUpdatesState)


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


# ----------------------------------------------------------------------------- the tests


def test_the_declaration_gives_the_config_section_its_validation_and_the_chain(declared):
  from stablejax.training.config import ConfigError, ineffective_keys, load_config
  from stablejax.training.optim import build_optimizer
  cfg = load_config(None, ["stability.scale_updates.enabled=true", "optimizer.name=adamw",
                           "train.steps=10", "train.warmup_steps=1"])
  assert cfg.stability.scale_updates == ScaleUpdatesConfig(enabled=True, factor=0.5)
  with pytest.raises(ConfigError, match=r"stability.scale_updates.factor=2.0 must lie in"):
    load_config(None, ["stability.scale_updates.enabled=true", "stability.scale_updates.factor=2"])
  off = load_config(None, ["stability.scale_updates.factor=0.25"])
  assert ineffective_keys(off) == ["stability.scale_updates.factor=0.25 has no effect with "
                                   "stability.scale_updates.enabled=false"]
  # In the chain at its position: after the optimizer, before the learning-rate scale, inside
  # the skip wrappers; the update is half of the chain's without it.
  params = {"w": jnp.ones(4)}
  grads = {"w": jnp.full(4, 0.5)}
  with_it, without = build_optimizer(cfg), build_optimizer(load_config(
      None, ["optimizer.name=adamw", "train.steps=10", "train.warmup_steps=1"]))
  state_a, state_b = with_it.init(params), without.init(params)
  for _ in range(2):  # the warmup's first rate is 0
    a, state_a = with_it.update(grads, state_a, params, loss=jnp.float32(1.0))
    b, state_b = without.update(grads, state_b, params, loss=jnp.float32(1.0))
  assert float(a["w"][0]) == pytest.approx(0.5 * float(b["w"][0]), rel=1e-6) != 0.0
  # skip_nonfinite(skip_spikes(chain(zclip, adamw, scale_updates, lr scale)))
  chain = state_a.inner_state.inner_state
  assert [type(s).__name__ for s in chain] == ["ZClipState", "tuple", "ScaleUpdatesState",
                                               "InjectStatefulHyperparamsState"]
  assert metrics.stability_metrics(state_a)["scale_updates/steps"] == 2


def test_without_the_declaration_the_key_is_unknown():
  from stablejax.training.config import ConfigError, load_config
  with pytest.raises(ConfigError, match="scale_updates"):
    load_config(None, ["stability.scale_updates.enabled=true"])


@slow
def test_it_trains_through_the_trainer_and_shows_up_everywhere(declared, tmp_path):
  from stablejax.monitor.report import make_report
  out = tmp_path / "run"
  steps = 8
  assert run_inprocess(out, "stability.scale_updates.enabled=true", f"train.steps={steps}",
                       "train.warmup_steps=2", "train.eval_every=8", "checkpoint.every=8") == 0
  train = [r for r in read_metrics(out) if "loss" in r and "event" not in r]
  assert [r["scale_updates/steps"] for r in train] == [r["step"] for r in train]  # every update
  assert all(r["scale_updates/scaled"] for r in train)
  tags = tensorboard_tags(out / "tensorboard")
  assert tags["stability/scale_updates/steps"] == [float(r["step"]) for r in train]
  assert tags["stability/rate/scale_updates_rate"][-1] == 1.0
  _, text = make_report(out)
  assert "scale_updates_rate 1" in text
  assert json.loads((out / "config.json").read_text())["stability"]["scale_updates"] == {
      "enabled": True, "factor": 0.5}
