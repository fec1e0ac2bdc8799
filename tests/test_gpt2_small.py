"""The packaged gpt2_small config: the size its docs state, QK-norm, and a first stretch of
training that the gradient health levels leave alone."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import stablejax
from stablejax.modeling.gpt import GPT, count_params
from stablejax.training.config import load_config

ROOT = Path(__file__).resolve().parent.parent
FIRST_STEPS = ROOT / "tests" / "data" / "gpt2_small_first_steps.json"


def _param_shapes(cfg):
  return jax.eval_shape(lambda: GPT(cfg.model).init(
      jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))["params"]


def test_builds_the_parameter_count_the_docs_state():
  stated = re.search(r"`gpt2_small` \((\d+)M parameters",
                     (ROOT / "docs" / "trainer.md").read_text())
  assert stated, "docs/trainer.md no longer states gpt2_small's size"
  cfg = load_config("gpt2_small")
  n = count_params(_param_shapes(cfg))
  assert round(n / 1e6) == int(stated.group(1)), n
  # GPT-2 small's arithmetic: the tied 50304 x 768 embedding, 12 blocks of attention (4 d^2),
  # SwiGLU (3 d f with f = 2048), two norm gains and the QK-norm gains of one head (2 x 64), and
  # the final norm gain
  d, f, v, head_dim = 768, 2048, 50304, 64
  assert n == v * d + 12 * (4 * d * d + 3 * d * f + 2 * d + 2 * head_dim) + d


def test_has_qk_norm_and_a_tied_head():
  cfg = load_config("gpt2_small")
  assert cfg.model.qk_norm and cfg.model.tie_embeddings
  shapes = _param_shapes(cfg)
  assert "lm_head" not in shapes
  assert cfg.optimizer.head_learning_rate is None  # no head to give a rate of its own


def test_first_steps_raise_no_health_level():
  # The first 20 steps of the config's own train step (its model, stack and schedule) at batch
  # 2 x 256 on a CPU, on the embedded corpus, as `python -m bench.health_first_steps` ran them
  # (the command is in the file). The norm starts far above the absolute boundaries and falls.
  recorded = json.loads(FIRST_STEPS.read_text())
  assert recorded["config"] == "gpt2_small" and len(recorded["steps"]) == 20
  assert recorded["command"].startswith("python -m bench.health_first_steps")
  relative = stablejax.StabilityMonitor()
  absolute = stablejax.StabilityMonitor(thresholds=stablejax.HealthThresholds(relative=False))
  warned_relative, warned_absolute = [], []
  for row in recorded["steps"]:
    record = {"loss": row["loss"], "grad_norm": row["grad_norm"]}
    warned_relative += relative.update(row["step"], record)
    warned_absolute += absolute.update(row["step"], record)
    assert row["relative"] == relative.level  # what the bench saw is what the rule gives
  assert warned_relative == recorded["warnings"]["relative"] == []
  assert warned_absolute == recorded["warnings"]["absolute"] and warned_absolute  # as before
  assert recorded["steps"][0]["grad_norm"] > 10  # critical as an absolute norm


@pytest.mark.parametrize("factor, level", [(4.0, "healthy"), (7.0, "high"), (12.0, "critical")])
def test_a_spike_after_the_first_steps_still_raises_its_level(factor, level):
  recorded = json.loads(FIRST_STEPS.read_text())
  monitor = stablejax.StabilityMonitor()
  for row in recorded["steps"]:
    monitor.update(row["step"], {"loss": row["loss"], "grad_norm": row["grad_norm"]})
  norms = sorted(row["grad_norm"] for row in recorded["steps"])
  median = (norms[9] + norms[10]) / 2  # the 20 norms are all inside the 200-step window
  monitor.update(21, {"loss": 3.0, "grad_norm": factor * median})
  assert monitor.level == level
