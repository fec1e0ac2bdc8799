"""Fast checks of the bench scripts' own logic: each scenario x defence cell builds the optimizer
it claims to test, the spike counter counts what its docstring says, and the shared helpers.

The bench scripts themselves take minutes on a CPU (compilation dominates), so they are not run
here; their `--quick` paths are the smoke runs (see bench/*.py).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench import _common, scenarios  # noqa: E402
from bench.scaling import per_device_bytes  # noqa: E402

from stablejax.training.config import config_from_dict  # noqa: E402
from stablejax.training.optim import build_optimizer, main_optimizer  # noqa: E402

PARAMS = {"tok_embed": {"embedding": jnp.zeros((8, 4))},
          "blocks": {"attn": {"kernel": jnp.zeros((2, 4, 4))}, "norm": {"scale": jnp.ones((2, 4))}},
          "lm_head": {"kernel": jnp.zeros((4, 8))}}


def _state_types(tx) -> set[str]:
  state = tx.init(PARAMS)
  found = set()

  def visit(node):
    found.add(type(node).__name__)
    children = node.values() if isinstance(node, dict) else node if isinstance(node, tuple) else ()
    for child in children:
      visit(child)
  visit(state)
  return found


# (defence, state types that must be present, state types that must be absent)
EXPECTED = {
    "none": ({"ScaleByAdamState"}, {"ClipByGlobalNormState", "ZClipState", "AdaGCState",
                                    "SkipNonFiniteState", "SkipSpikesState", "ApplyIfFiniteState"}),
    "apply_if_finite": ({"ApplyIfFiniteState", "ScaleByAdamState"},
                        {"ZClipState", "AdaGCState", "SkipNonFiniteState", "SkipSpikesState"}),
    "zclip": ({"ZClipState", "ScaleByAdamState"}, {"AdaGCState", "SkipNonFiniteState",
                                                   "SkipSpikesState", "HybridClipState"}),
    "adagc": ({"AdaGCState", "ScaleByAdamState"}, {"ZClipState", "SkipNonFiniteState",
                                                   "SkipSpikesState", "HybridClipState"}),
    "spike_skip": ({"SkipSpikesState", "ScaleByAdamState"},
                   {"ZClipState", "AdaGCState", "SkipNonFiniteState", "HybridClipState"}),
    "stablejax": ({"SkipNonFiniteState", "SkipSpikesState", "HybridClipState", "ScaleByAdamState"},
                  {"OutlierSafeMuonState", "ApplyIfFiniteState"}),
    "stablejax+muon": ({"SkipNonFiniteState", "SkipSpikesState", "HybridClipState",
                        "OutlierSafeMuonState"}, {"ApplyIfFiniteState"}),
}


def _tx(defence: str, scenario: str = "clean"):
  cfg = config_from_dict(scenarios.scenario_config(scenario, defence, steps=100, garbage_every=10))
  swap = scenarios.TX_SWAPS.get(defence)
  return cfg, (swap(cfg, main_optimizer(cfg)) if swap else build_optimizer(cfg))


@pytest.mark.parametrize("defence", sorted(EXPECTED))
def test_each_defence_builds_the_chain_it_names(defence):
  _, tx = _tx(defence)
  present, absent = EXPECTED[defence]
  types = _state_types(tx)
  assert present <= types, present - types
  assert not (absent & types), absent & types


def _updates(tx, steps=3):
  state = tx.init(PARAMS)
  for i in range(steps):
    grads = jax.tree.map(lambda p: 10.0 * jax.random.normal(jax.random.key(i), p.shape), PARAMS)
    updates, state = tx.update(grads, state, PARAMS, loss=jnp.float32(3.0))
  return updates


@pytest.mark.parametrize("defence,max_norm", [("none", None), ("clip1", 1.0)])
def test_none_and_clip1_equal_plain_optax(defence, max_norm):
  cfg, tx = _tx(defence)
  want = _updates(_common.plain_adamw_chain(cfg, max_norm))
  got = _updates(tx)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9), got, want)
  other = _updates(_common.plain_adamw_chain(cfg, 1.0 if max_norm is None else None))
  assert not np.allclose(got["lm_head"]["kernel"], other["lm_head"]["kernel"])


def test_only_the_stablejax_defences_roll_back():
  for name in scenarios.DEFENCES:
    cfg = config_from_dict(scenarios.scenario_config("clean", name, 100, 10))
    assert cfg.stability.recovery == name.startswith("stablejax"), name


def test_every_cell_is_a_valid_config_and_the_scenario_is_applied():
  for scenario in scenarios.SCENARIOS:
    for defence in scenarios.SCENARIO_DEFENCES.get(scenario, scenarios.DEFENCES):
      raw = scenarios.scenario_config(scenario, defence, steps=150, garbage_every=15)
      cfg = config_from_dict(raw)
      base_lr = scenarios.MUON_LR if defence == "stablejax+muon" else scenarios.LR
      factor = {"lr10x": 10.0, "bf16_params": 0.1, "fp32_small_lr": 0.1}.get(scenario, 1.0)
      assert math.isclose(cfg.optimizer.learning_rate, base_lr * factor), (scenario, defence)
      assert cfg.train.seed == 0 and cfg.train.steps == 150
  cfg = config_from_dict(scenarios.scenario_config("garbage", "none", 150, 15))
  assert cfg.faults.garbage_batch_steps == list(range(30, 150, 15))
  cfg = config_from_dict(scenarios.scenario_config("nan_grads", "none", 150, 15))
  assert len(set(cfg.faults.nan_grad_steps)) == 6
  assert all(15 <= s < 150 for s in cfg.faults.nan_grad_steps)
  cfg = config_from_dict(scenarios.scenario_config("fp16_aggressive", "none", 150, 15))
  assert (cfg.model.compute_dtype, cfg.stability.loss_scale_init,
          cfg.stability.loss_scale_growth_factor, cfg.stability.loss_scale_growth_interval) == (
              "float16", 65536.0, 2.0, 100)
  cfg = config_from_dict(scenarios.scenario_config("postln_deep", "none", 150, 15))
  assert cfg.model.post_ln and cfg.model.n_layers == 6
  cfg = config_from_dict(scenarios.scenario_config("bf16_params", "none", 150, 15))
  assert cfg.model.param_dtype == "bfloat16"


def test_count_spikes():
  flat = [(i, 3.0) for i in range(25)]
  assert scenarios.count_spikes(flat, set()) == 0
  # one spike of two steps (counts once), then a recovery, then a second spike
  losses = flat + [(25, 4.0), (26, 4.5), (27, 3.0), (28, 3.1), (29, 3.9)]
  assert scenarios.count_spikes(losses, set()) == 2
  # 3.7 is not above 1.25 x 3.0
  assert scenarios.count_spikes(flat + [(25, 3.7)], set()) == 0
  # a spike on an injected-fault step does not count
  assert scenarios.count_spikes(flat + [(25, 9.0), (26, 3.0)], {25}) == 0
  # a run that goes NaN for good is one event, even before the window fills
  assert scenarios.count_spikes([(0, 5.0), (1, float("nan")), (2, float("nan"))], set()) == 1


def test_paired_ratio_and_quartiles():
  num, den = [2.0, 4.0, 6.0, 100.0], [1.0, 2.0, 3.0, 10.0]
  assert _common.paired_ratio(num, den)[0] == pytest.approx(float(np.median([2, 2, 2, 10])))
  assert _common.quartiles([1.0, 2.0, 3.0, 4.0, 5.0]) == (2.0, 4.0)


def test_per_device_bytes_counts_shards():
  x = jnp.zeros((4, 8), jnp.float32)
  bytes_by_device = per_device_bytes({"a": x, "b": jnp.zeros(3, jnp.int32), "c": None})
  assert bytes_by_device == {jax.devices()[0].id: 4 * 8 * 4 + 3 * 4}


def test_interleaved_alternates_runners():
  calls = []
  times = _common.interleaved({"a": lambda: calls.append("a") or 1.0,
                               "b": lambda: calls.append("b") or 2.0}, rounds=3, warmup=1)
  assert calls == ["a", "b"] * 4
  assert times == {"a": [1.0] * 3, "b": [2.0] * 3}
