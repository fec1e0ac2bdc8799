"""Fast checks of the bench scripts' own logic: each scenario x defence cell builds the optimizer
it claims to test, the spike counter counts what its docstring says, and the shared helpers.

The bench scripts themselves take minutes on a CPU (compilation dominates), so they are not run
here; their `--quick` paths are the smoke runs (see bench/*.py).
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from bench import _common, scenarios
from bench.scaling import per_device_bytes
from helpers import gpt_params, optax_lr, read_metrics
from stablejax.training.config import config_from_dict
from stablejax.training.optim import build_optimizer, main_optimizer
from stablejax.transforms import defence as defence_lib

ROOT = Path(__file__).resolve().parent.parent

PARAMS = {"tok_embed": {"embedding": jnp.zeros((8, 4))},
          "blocks": {"attn": {"kernel": jnp.zeros((2, 4, 4))}, "norm": {"scale": jnp.ones((2, 4))}},
          "lm_head": {"kernel": jnp.zeros((4, 8))}}


def _state_types(tx, cfg=None) -> set[str]:
  """The state types of ``tx`` initialised on the parameters of ``cfg``'s GPT (shapes only:
  QK-clip looks for the attention layers in them), or on PARAMS."""
  state = tx.init(PARAMS) if cfg is None else jax.eval_shape(
      tx.init, gpt_params(cfg.model, abstract=True))
  found = set()

  def visit(node):
    found.add(type(node).__name__)
    children = node.values() if isinstance(node, dict) else node if isinstance(node, tuple) else ()
    for child in children:
      visit(child)
  visit(state)
  return found


# The baselines and stacks of bench/scenarios.py: (state types that must be present, that must
# be absent). Each declared defence alone is checked from its declaration (below).
EXPECTED = {
    "none": ({"ScaleByAdamState"}, {"ClipByGlobalNormState", "ZClipState", "AdaGCState",
                                    "SkipNonFiniteState", "SkipSpikesState", "ApplyIfFiniteState"}),
    "apply_if_finite": ({"ApplyIfFiniteState", "ScaleByAdamState"},
                        {"ZClipState", "AdaGCState", "SkipNonFiniteState", "SkipSpikesState"}),
    "stablejax": ({"SkipNonFiniteState", "SkipSpikesState", "ZClipState", "ScaleByAdamState"},
                  {"OutlierSafeMuonState", "ApplyIfFiniteState", "AdaGCState", "HybridClipState"}),
    "stablejax_adagc": ({"SkipNonFiniteState", "SkipSpikesState", "ZClipState", "AdaGCState",
                         "ScaleByAdamState"}, {"OutlierSafeMuonState", "ApplyIfFiniteState"}),
    "stablejax+muon": ({"SkipNonFiniteState", "SkipSpikesState", "ZClipState",
                        "OutlierSafeMuonState"}, {"ApplyIfFiniteState", "AdaGCState",
                                                  "HybridClipState"}),
}
_STACK = EXPECTED["stablejax"]
EXPECTED.update({
    "stablejax+update_zclip": (_STACK[0] | {"ZClipUpdateNormState"},
                               _STACK[1] | {"ClipUpdateRmsState"}),
    "stablejax+update_rms": (_STACK[0] | {"ClipUpdateRmsState"},
                             _STACK[1] | {"ZClipUpdateNormState"}),
    # the stack with Hyperball: its state next to the stack's (bench/stress.py --hyperball)
    "stablejax_hyperball": (_STACK[0] | {"HyperballState"}, _STACK[1]),
    # with bf16 parameters (below): the stack compensates unless told not to
    "stablejax_uncompensated": (_STACK[0], _STACK[1] | {"CompensatedUpdatesState"}),
    "stablejax+stochastic_rounding": (_STACK[0] | {"CompensatedUpdatesState"}, _STACK[1]),
})
# Presets that act on bf16 parameters only are checked on the bf16 scenario.
BF16_DEFENCES = ("stablejax_uncompensated", "stablejax+stochastic_rounding")


def _tx(defence: str, scenario: str = "clean"):
  cfg = config_from_dict(scenarios.scenario_config(scenario, defence, steps=100, garbage_every=10))
  swap = scenarios.TX_SWAPS.get(defence)
  return cfg, (swap(cfg, main_optimizer(cfg)) if swap else build_optimizer(cfg))


@pytest.mark.parametrize("defence", sorted(set(EXPECTED) & set(scenarios.DEFENCES)))
def test_each_defence_builds_the_chain_it_names(defence):
  cfg, tx = _tx(defence, "bf16_params" if defence in BF16_DEFENCES else "clean")
  present, absent = EXPECTED[defence]
  types = _state_types(tx, cfg)
  assert present <= types, present - types
  assert not (absent & types), absent & types


@pytest.mark.parametrize("name", [d.name for d in defence_lib.registered()])
def test_each_declared_defence_alone_builds_its_own_entry(name):
  # Its scenario preset (bench/scenarios.py, from the declarations): the defence's state under
  # its name and no other defence's, around AdamW; bf16 parameters, so every defence has
  # something to do (the compensated update leaves float32 parameters alone).
  cfg, tx = _tx("clip1" if name == "clip" else name, "bf16_params")
  state = jax.eval_shape(tx.init, gpt_params(cfg.model, abstract=True))
  declared = {d.name for d in defence_lib.registered()}
  assert set(state) & declared == {name}
  assert "adamw" in state["optimizer"]


def test_the_bf16_row_compensates_as_its_defence_says():
  for defence, compensated, method in (("stablejax", True, "kahan"),
                                       ("stablejax+stochastic_rounding", True,
                                        "stochastic_rounding"),
                                       ("stablejax_uncompensated", False, "kahan")):
    cfg, tx = _tx(defence, "bf16_params")
    assert cfg.model.param_dtype == "bfloat16"
    assert cfg.stability.compensated_updates.enabled == compensated
    assert cfg.stability.compensated_updates.method == method
    assert ("CompensatedUpdatesState" in _state_types(tx)) == compensated, defence


def _updates(tx, steps=3):
  state = tx.init(PARAMS)
  for i in range(steps):
    key = jax.random.key(i)
    grads = jax.tree.map(lambda p, key=key: 10.0 * jax.random.normal(key, p.shape), PARAMS)
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
    assert cfg.stability.recovery.enabled == name.startswith("stablejax"), name


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
  assert (cfg.model.compute_dtype, cfg.stability.loss_scale.init,
          cfg.stability.loss_scale.growth_factor, cfg.stability.loss_scale.growth_interval) == (
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


# ----------------------------------------------------------------------------- bench/stress.py

from bench import stress  # noqa: E402


def _result(loss, init=5.5, status="ok", **kw):
  return {"val_loss": loss, "init_loss": init, "status": status, **kw}


def test_lr_sensitivity_matches_a_hand_computed_example():
  # Clamped losses min(l, l0) over a 4-rate grid with l0 = 5.5: a normal run, the best run, a
  # worse one, and a run that ended above its init loss (counted as 5.5).
  runs = [_result(3.0), _result(2.0), _result(2.5), _result(7.0)]
  curve = [stress.clamped_loss(r) for r in runs]
  assert curve == [3.0, 2.0, 2.5, 5.5]
  # best 2.0; deviations 1.0, 0, 0.5, 3.5; mean 5.0 / 4
  assert stress.lr_sensitivity(curve) == pytest.approx(1.25)
  # NaN, a run the trainer gave up on, and a crash all count as the loss at init
  assert stress.clamped_loss(_result(float("nan"), status="nan")) == 5.5
  assert stress.clamped_loss(_result(2.0, status="gave_up")) == 5.5
  assert stress.clamped_loss(_result(None, status="crashed")) == 5.5
  assert stress.lr_sensitivity([2.0, 2.0, 2.0]) == 0.0


def _cell(defence, factor, seed, loss, rollbacks=0, diverged=None, init=5.0):
  status = "ok" if math.isfinite(loss) else "nan"
  return {"model": "preln", "defence": defence, "lr_factor": factor, "seed": seed,
          "lr": 1e-3 * factor, "val_loss": loss, "init_loss": init, "status": status,
          "diverged": (status != "ok" or loss >= init) if diverged is None else diverged,
          "rollbacks": rollbacks, "spikes": 0, "skipped": 0, "warnings": 0, "error": "",
          "events": []}


def test_summary_headline_numbers_by_hand():
  # clip1: seed means 3.0 (1x), 2.0 (10x), 5.0 (100x: one NaN seed counts as init 5.0)
  # stack: 3.2, 2.1, 2.6 with one rollback at 10x, seed 1 (clip1 survived there: a false one)
  results = [
      _cell("clip1", 1, 0, 2.9), _cell("clip1", 1, 1, 3.1),
      _cell("clip1", 10, 0, 1.9), _cell("clip1", 10, 1, 2.1),
      _cell("clip1", 100, 0, 5.0), _cell("clip1", 100, 1, float("nan")),
      _cell("stack", 1, 0, 3.2), _cell("stack", 1, 1, 3.2),
      _cell("stack", 10, 0, 2.0), _cell("stack", 10, 1, 2.2, rollbacks=1),
      _cell("stack", 100, 0, 2.5), _cell("stack", 100, 1, 2.7),
  ]
  rows = {r["defence"]: r for r in stress.summarize(results, ["preln"], ["clip1", "stack"],
                                                    [1, 10, 100], [0, 1])}
  clip, stack = rows["clip1"], rows["stack"]
  assert clip["best_factor"] == 10 and clip["best_mean"] == pytest.approx(2.0)
  assert clip["best_sd"] == pytest.approx(np.std([1.9, 2.1], ddof=1))
  assert clip["sensitivity"] == pytest.approx((1.0 + 0.0 + 3.0) / 3)
  # per seed: seed 0 (2.9, 1.9, 5.0) -> (1.0 + 0 + 3.1) / 3; seed 1 (3.1, 2.1, 5.0) -> 3.9 / 3
  assert clip["sensitivity_sd"] == pytest.approx(np.std([4.1 / 3, 3.9 / 3], ddof=1))
  assert clip["diverged"] == 2  # the run at its init loss and the NaN run
  assert stack["best_factor"] == 10 and stack["best_mean"] == pytest.approx(2.1)
  assert stack["sensitivity"] == pytest.approx((1.1 + 0.0 + 0.5) / 3)
  assert stack["sensitivity_ratio"] == pytest.approx((1.6 / 3) / (4.0 / 3))
  assert stack["gap_at_base_best"] == pytest.approx(0.1)
  assert stack["base_se"] == pytest.approx(np.std([1.9, 2.1], ddof=1) / math.sqrt(2))
  assert stack["rollbacks"] == 1 and stack["false_rollbacks"] == 1
  assert stack["extra_divergences"] == 0


def test_qk_recovery_is_read_where_qk_norm_is_better_beyond_the_seed_noise():
  # The no-QK-norm model ("long") with clip 1.0 and QK-clip, its QK-norm twin ("long_qk") with
  # clip 1.0; two seeds at 1x, 10x, 100x. QK-norm's advantage over clip 1.0 (seed means): 1x
  # none, 10x 3.0 - 2.0 = 1.0 (both seeds alike), 100x 4.1 - 3.9 = 0.2 with clip 1.0's seeds
  # at 3.8 and 4.4: sd 0.424, standard error of the difference sqrt(0.18 / 2) = 0.3, so 0.2 is
  # noise and the top rate with an advantage is 10x: share (3.0 - 2.4) / 1.0 = 0.6.
  def cell(model, defence, factor, seed, loss):
    return {**_cell(defence, factor, seed, loss), "model": model}
  results = []
  for seed, (c100, q100) in enumerate([(3.8, 4.0), (4.4, 4.0)]):
    results += [cell("long", "clip1", 1, seed, 2.0), cell("long", "clip1", 10, seed, 3.0),
                cell("long", "clip1", 100, seed, c100),
                cell("long_qk", "clip1", 1, seed, 2.0), cell("long_qk", "clip1", 10, seed, 2.0),
                cell("long_qk", "clip1", 100, seed, 3.9),
                cell("long", "stablejax_qkclip100", 1, seed, 2.0),
                cell("long", "stablejax_qkclip100", 10, seed, 2.4),
                cell("long", "stablejax_qkclip100", 100, seed, q100)]
  rows = {(r["model"], r["defence"]): r for r in stress.summarize(
      results, ["long", "long_qk"], ["clip1", "stablejax_qkclip100"], [1, 10, 100], [0, 1])}
  qk = rows[("long", "stablejax_qkclip100")]
  assert qk["top_factor"] == 10
  assert qk["qk_recovery"] == pytest.approx(0.6)
  assert rows[("long", "clip1")]["qk_recovery"] == pytest.approx(0.0)
  assert qk["sensitivity_ratio"] == pytest.approx((0.4 / 3 + 2.0 / 3) / ((1.0 + 2.1) / 3))
  # a defence run at some of its baseline's rates only: no sensitivity ratio (other grid)
  part = stress.summarize([r for r in results if r["lr_factor"] != 1 or r["defence"] == "clip1"],
                          ["long"], ["clip1", "stablejax_qkclip100"], [1, 10, 100], [0, 1])
  assert next(r for r in part if r["defence"] != "clip1")["sensitivity_ratio"] is None
  # one seed: no spread to judge by, the fixed floor alone (100x: 0.2 > 0.05 counts)
  one = stress.summarize([r for r in results if r["seed"] == 1], ["long", "long_qk"],
                         ["clip1", "stablejax_qkclip100"], [1, 10, 100], [1])
  one_qk = next(r for r in one if (r["model"], r["defence"]) == ("long", "stablejax_qkclip100"))
  assert one_qk["top_factor"] == 100
  assert one_qk["qk_recovery"] == pytest.approx((4.4 - 4.0) / (4.4 - 3.9))


def test_runs_file_survives_a_sweep_killed_mid_write(tmp_path):
  # A killed sweep leaves its last line cut short; the resumed sweep appends after it. Both whole
  # runs must read back, the fragment is dropped, and a later line of the same cell wins.
  path = tmp_path / "runs.jsonl"
  first = _cell("clip1", 1.0, 0, 2.5)
  stress.append_run(path, first)
  with open(path, "a") as f:
    f.write('{"model": "preln", "defence": "clip1", "lr_fac')   # killed here
  second = _cell("clip1", 10.0, 0, 2.0)
  stress.append_run(path, second)
  stress.append_run(path, {**first, "val_loss": 2.4})
  runs = {(r["lr_factor"], r["seed"]): r["val_loss"] for r in stress.read_runs(path)}
  assert runs == {(1.0, 0): 2.4, (10.0, 0): 2.0}
  # the fragment is kept as a line of its own (nothing the sweep wrote is rewritten)
  assert len(path.read_text().splitlines()) == 4


def test_reused_runs_are_the_cells_of_the_same_length(tmp_path):
  # --reuse takes a cell of an earlier file only at the run length of this sweep: a recorded
  # `steps`, or for runs from before it was recorded, the model's own length (long-horizon
  # models) or the last logged step; a later file's run of a cell wins.
  old, new = tmp_path / "old.jsonl", tmp_path / "new.jsonl"
  short = {**_cell("clip1", 1.0, 0, 2.5), "curve": [[100, 2.6]]}        # preln at 100 steps
  other = {**_cell("clip1", 10.0, 0, 2.0), "curve": [[200, 2.1]]}       # preln at 200 steps
  long = {**_cell("clip1", 1.0, 0, 1.5), "model": "long", "curve": [[10, 3.0]]}  # cut short
  recorded = {**_cell("clip1", 1.0, 1, 2.4), "steps": 200}
  for r in (short, other, long, recorded):
    stress.append_run(old, r)
  stress.append_run(new, {**long, "val_loss": 1.4})
  cells = [("preln", "clip1", 1.0, 0), ("preln", "clip1", 10.0, 0), ("long", "clip1", 1.0, 0),
           ("preln", "clip1", 1.0, 1), ("preln", "stablejax", 1.0, 0)]
  found = stress.reusable_runs([old, new], cells, steps=100)
  assert set(found) == {("preln", "clip1", 1.0, 0), ("long", "clip1", 1.0, 0)}
  assert found[("long", "clip1", 1.0, 0)]["val_loss"] == 1.4
  found = stress.reusable_runs([old], cells, steps=200)
  assert set(found) == {("preln", "clip1", 10.0, 0), ("long", "clip1", 1.0, 0),
                        ("preln", "clip1", 1.0, 1)}


def _stress_tx(defence, variants=None):
  raw, kind = stress.cell_config("preln", defence, seed=0, steps=100, variants=variants or {})
  cfg = config_from_dict(raw)
  tx = stress.build_tx(kind, cfg)
  return cfg, kind, (tx if tx is not None else build_optimizer(cfg))


@pytest.mark.parametrize("defence",
                         [d for d in stress.DEFENCES if d not in ("clip1", "muon_clip1")])
def test_each_stress_defence_builds_the_chain_it_names(defence):
  cfg, kind, tx = _stress_tx(defence)
  stack = "stablejax+muon" if "muon" in defence else "stablejax"
  declared = {d.name for d in defence_lib.registered()}
  if defence in declared:  # one declared defence alone, its entry in the keyed state
    state = jax.eval_shape(tx.init, gpt_params(cfg.model, abstract=True))
    # the sweep's models keep float32 parameters: the compensated update has nothing to do
    assert set(state) & declared == (set() if defence == "compensated_updates" else {defence})
  elif "qkclip" in defence:  # the stack with QK-clip at the end, at the tau its name says
    present, absent = EXPECTED[stack]
    present = present | {"QKClipState"}
    tau = {"stablejax_qkclip": stress.QK_TAU, "stablejax_muon_qkclip": stress.QK_TAU}.get(
        defence, float(defence.rsplit("qkclip", 1)[1] or 0))
    assert cfg.stability.qk_clip.enabled and cfg.stability.qk_clip.tau == tau
  else:
    variant = defence.startswith("stablejax_muon_")  # per-head Muon, NorMuon: the Muon stack
    present, absent = EXPECTED[stack if defence == "stablejax_muon" or variant else defence]
    if defence in ("stablejax", "stablejax_muon") or variant:
      absent = absent | {"QKClipState"}
    if variant:
      assert cfg.optimizer.per_head == ("perhead" in defence)
      if "normuon" in defence:
        present = present | {"NorMuonState"}
      else:
        absent = absent | {"NorMuonState"}
      if "hyperball" in defence:
        present = present | {"HyperballState"}
    if defence in BF16_DEFENCES:  # the sweep's models keep float32 parameters: nothing to do
      present, absent = present - {"CompensatedUpdatesState"}, absent | {
          "CompensatedUpdatesState"}
  if defence not in declared:
    types = _state_types(tx, cfg)
    assert present <= types, present - types
    assert not (absent & types), absent & types
  # Every stablejax chain is the trainer's own (built from the config by build_optimizer).
  assert (kind is None) == (defence != "apply_if_finite")
  assert cfg.stability.recovery.enabled == defence.startswith("stablejax")
  assert cfg.model.n_layers >= 8


def test_stress_clip1_is_plain_optax():
  cfg, _, tx = _stress_tx("clip1")
  want = _updates(_common.plain_adamw_chain(cfg, 1.0))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9),
               _updates(tx), want)


def test_stress_muon_clip1_is_clip_then_optax_muon_on_the_stacked_matrices():
  from optax.contrib import MuonDimensionNumbers
  from stablejax.training.optim import lr_schedule
  cfg, _, tx = _stress_tx("muon_clip1")
  o = cfg.optimizer
  dims = {"tok_embed": {"embedding": None},
          "blocks": {"attn": {"kernel": MuonDimensionNumbers(1, 2)}, "norm": {"scale": None}},
          "lm_head": {"kernel": None}}
  plain = optax.contrib.muon(
      lr_schedule(cfg, o.learning_rate), adam_learning_rate=lr_schedule(cfg, o.adam_learning_rate),
      adam_b2=o.b2, consistent_rms=o.consistent_rms, muon_weight_dimension_numbers=dims)
  reference = optax.chain(plain, optax.scale(1.0))

  def updates(chain, scale):
    state = chain.init(PARAMS)
    for i in range(2):
      key = jax.random.key(i)
      grads = jax.tree.map(lambda p, key=key: scale * jax.random.normal(key, p.shape), PARAMS)
      out, state = chain.update(grads, state, PARAMS)
    return out
  # gradients of norm < 1: the clip is idle and the chain is optax's Muon with this routing
  small_got, small_want = updates(tx, 0.01), updates(reference, 0.01)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8),
               small_got, small_want)
  # large gradients: clipped to norm 1 first, so AdamW's moments (embedding, head) differ
  big_got, big_want = updates(tx, 100.0), updates(reference, 100.0)
  assert not np.allclose(big_got["lm_head"]["kernel"], big_want["lm_head"]["kernel"])


def _scaled_rates(raw, factor):
  raw = copy.deepcopy(raw)
  for key in ("learning_rate", "adam_learning_rate", "embedding_learning_rate",
              "head_learning_rate"):
    if raw["optimizer"].get(key) is not None:
      raw["optimizer"][key] *= factor
  return raw


@pytest.mark.parametrize("defence", ["stablejax", "stablejax_muon"])
def test_lr_factor_multiplier_equals_a_larger_configured_rate(defence):
  factor = 3.162
  cfg, _, tx = _stress_tx(defence)
  tx = _common.with_lr_factor(tx)
  raw, _ = stress.cell_config("preln", defence, seed=0, steps=100, variants={})
  tx_big = build_optimizer(config_from_dict(_scaled_rates(raw, factor)))

  def run(chain, f):
    state = chain.init(PARAMS)
    if f is not None:
      state = _common.set_lr_factor(state, f)
    for i in range(3):
      key = jax.random.key(i)
      grads = jax.tree.map(lambda p, key=key: jax.random.normal(key, p.shape), PARAMS)
      out, state = chain.update(grads, state, PARAMS, loss=jnp.float32(3.0))
    return out
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-9),
               run(tx, factor), run(tx_big, None))
  assert not np.allclose(run(tx, None)["lm_head"]["kernel"], run(tx_big, None)["lm_head"]["kernel"])


@pytest.mark.slow
def test_bench_run_lr_factor_equals_a_larger_configured_rate_in_the_trainer(tmp_path):
  # The trainer rewrites its own LR scale every step (the recovery's backoff), so the factor must
  # survive a real train step, not only a chain update.
  from stablejax.training.loop.trainer import Trainer
  factor = 3.162
  raw, _ = stress.cell_config("preln", "stablejax", seed=0, steps=4, variants={})
  raw = _common.deep_merge(raw, {
      "model": {"d_model": 32, "n_layers": 2, "n_heads": 2, "max_seq_len": 32},
      "train": {"seq_len": 32, "batch_size": 4, "eval_every": 100, "eval_batches": 1,
                "warmup_steps": 1, "log_every": 1},
      "checkpoint": {"every": 100}, "logging": {"sample_every": 0}})
  bench = _common.trainer_run_class()(config_from_dict(raw), tmp_path / "factor", fresh=True)
  bench.lr_factor = factor
  assert bench.train() == 0
  big = Trainer(config_from_dict(_scaled_rates(raw, factor)), tmp_path / "big", fresh=True)
  assert big.train() == 0
  close = jax.tree.map(lambda a, b: np.allclose(a, b, rtol=2e-4, atol=1e-6),
                       bench.state.params, big.state.params)
  assert all(jax.tree.leaves(close))
  # ...and the larger configured rate is the factor times the bench's own (a run at the bench's
  # rate, with its other parameters, would have trained other parameters).
  applied = [(r["step"], r["lr"]) for r in read_metrics(tmp_path / "big")
             if "lr" in r and "event" not in r]
  assert [s for s, _ in applied] == [1, 2, 3, 4]
  for step, lr in applied:
    assert lr == pytest.approx(optax_lr(config_from_dict(raw), step - 1, lr_scale=factor),
                               rel=1e-5)
  assert applied[-1][1] > 0


def test_stress_variants_and_diagnosis_configs():
  name, base, overrides = stress.parse_variant(
      "lam2=stablejax:stability.adagc.lambda_rel=2.0,stability.recovery.enabled=false")
  assert (name, base) == ("lam2", "stablejax")
  raw, _ = stress.cell_config("postln", "lam2", seed=1, steps=100,
                              variants={name: (base, overrides)})
  cfg = config_from_dict(raw)
  assert cfg.stability.adagc.lambda_rel == 2.0 and not cfg.stability.recovery.enabled
  assert cfg.model.post_ln and cfg.train.seed == 1 and cfg.stability.zclip.enabled
  with pytest.raises(ValueError, match="unknown base defence"):
    stress.parse_variant("x=nonsense:stability.adagc.enabled=false")
  with pytest.raises(ValueError, match="section.key=value"):
    stress.parse_variant("x=stablejax:adagc")
  for vname, (base, text) in stress.DIAGNOSIS.items():
    overrides = stress.parse_overrides(text)
    assert overrides and base in ("stablejax", "stablejax_adagc", "stablejax_muon"), vname
    base_cfg = config_from_dict(stress.cell_config("preln", base, 0, 100, {})[0])
    raw, _ = stress.cell_config("preln", vname, 0, 100, {vname: (base, overrides)})
    cfg = config_from_dict(raw)
    for dotted, value in _leaves(overrides):   # each variant changes what it names
      assert _get(cfg, dotted) == value != _get(base_cfg, dotted), (vname, dotted)


def _leaves(tree: dict, prefix: str = ""):
  for key, value in tree.items():
    dotted = f"{prefix}.{key}" if prefix else key
    if isinstance(value, dict):
      yield from _leaves(value, dotted)
    else:
      yield dotted, value


def _get(cfg, dotted: str):
  for part in dotted.split("."):
    cfg = getattr(cfg, part)
  return cfg


def test_stress_models_are_the_named_variants():
  def model_cfg(name):
    return config_from_dict(stress.cell_config(name, "clip1", 0, 100, {})[0])
  assert not model_cfg("preln").model.post_ln and not model_cfg("preln").model.qk_norm
  assert model_cfg("preln_qk").model.qk_norm
  assert model_cfg("postln").model.post_ln and not model_cfg("postln").model.qk_norm
  assert model_cfg("postln_qk").model.post_ln and model_cfg("postln_qk").model.qk_norm
  assert model_cfg("preln_nowarmup").train.warmup_steps == 0
  assert model_cfg("preln").train.warmup_steps > 0
  assert model_cfg("preln_fp16").model.compute_dtype == "float16"
  assert all(model_cfg(m).model.n_layers >= 8 for m in stress.MODELS)
  # the grid spans at least 1/3x .. 30x in half-decade steps
  f = stress.LR_FACTORS
  assert min(f) <= 1 / 3 and max(f) >= 30
  assert np.allclose(np.diff(np.log10(f)), 0.5, atol=1e-3)


def test_stress_csv_round_trip(tmp_path):
  results = [dict(_cell("clip1", 1, 0, 2.9), events=["step 50: a; restored step 0"]),
             _cell("clip1", 10, 0, float("nan")), _cell("stack", 1, 0, 3.1234567)]
  header = {"machine": ["machine: x", "jax y"], "setting": "s", "timing": "t",
            "command": "python -m bench.stress --quick"}
  stress.write_csv(results, tmp_path / "r.csv", header["machine"] + ["s", "t",
                   "command: python -m bench.stress --quick"])
  back, back_header = stress.read_csv(tmp_path / "r.csv")
  assert back_header == header
  for want, got in zip(results, back):
    for key in ("model", "defence", "lr_factor", "seed", "status", "diverged", "rollbacks",
                "events", "init_loss"):
      assert got[key] == want[key], key
  assert back[2]["val_loss"] == pytest.approx(3.1234567)
  assert math.isnan(back[1]["val_loss"]) and back[1]["diverged"]


def test_scenario_summary_mean_sd_and_one_standard_error_check():
  def r(defence, seed, val, status="ok"):
    return {"scenario": "clean", "defence": defence, "seed": seed, "status": status,
            "val_loss": val, "skipped": 1, "rollbacks": 0, "warnings": 0}
  results = [r("clip1", 0, 2.0), r("clip1", 1, 2.2), r("clip1", 2, 2.4),
             r("none", 0, 3.0), r("none", 1, 3.0), r("none", 2, float("nan"), "nan"),
             r("stablejax", 0, 2.3), r("stablejax", 1, 2.3), r("stablejax", 2, 2.3)]
  st = scenarios.cell_stats(results[:3])
  assert st["mean"] == pytest.approx(2.2) and st["sd"] == pytest.approx(0.2)
  assert st["se"] == pytest.approx(0.2 / 3 ** 0.5)
  text = scenarios.summary_markdown(results)
  assert "2.200 +/- 0.200" in text and "3.000 +/- 0.000 (2/3 ok)" in text
  # stablejax 2.3 is 0.1 above clip1's 2.2, inside one SE (0.115)
  assert "stablejax +0.100 (within 1 SE 0.115)" in text
  results[-1]["val_loss"] = 2.6   # mean 2.4: 0.2 above, outside
  assert "outside 1 SE" in scenarios.summary_markdown(results)


def test_compile_time_counts_distinct_loop_kernels():
  from bench.compile_time import kernel_counts
  # five identical elementwise leaves compile one kernel; a sum goes to a reduction fusion, which
  # is not a loop kernel; a different elementwise function is a second kernel
  same = jax.jit(lambda xs: [jnp.sin(x) * 2 for x in xs]).lower([jnp.ones((8, 8))] * 5).compile()
  assert kernel_counts(same) == (5, 1)
  mixed = jax.jit(lambda x: [jnp.sin(x) * 2, jnp.cos(x) * 3, jnp.sum(x * x)]).lower(
      jnp.ones((64, 64))).compile()
  fusions, kernels = kernel_counts(mixed)
  assert kernels == 2 and fusions >= 3


def test_compile_time_counts_equations_inside_calls_and_reads_xla_phases():
  from bench.compile_time import XLA_PHASES, count_equations, phase_seconds
  # gt, then jnp.where's jit (convert, broadcast, select_n: counted in its place), reduce_sum
  jaxpr = jax.make_jaxpr(lambda x: jnp.where(x > 0, x, 0).sum())(jnp.ones(3)).jaxpr
  assert count_equations(jaxpr) == 5
  # a phase named with and without the module's name: the outer (larger) event; absent: 0
  got = phase_seconds({"Codegen": 1.5, "HLO passes after layout assignment (jit_step)": 2.0,
                       "HLO passes after layout assignment": 0.5, "copy-insertion x": 9.0})
  assert got["Codegen"] == 1.5 and got["HLO passes after layout assignment"] == 2.0
  assert got["copy-insertion"] == 0.0 and set(got) == set(XLA_PHASES)


def test_the_peer_loop_is_sized_to_the_trainer_by_its_parameter_count():
  # bench.peer_step's arithmetic against the peer model's own parameters, and the MLP width it
  # picks: the multiple of 64 whose count is nearest the trainer's (the default model: 1,869,888
  # parameters; 4 x 192 = 768 gives 1,844,928, 832 gives 1,943,232).
  from bench import peer_step
  from stablejax.modeling.gpt import GPT, count_params
  cfg = _common.trainer_config("default")
  trainer = count_params(jax.eval_shape(lambda: GPT(cfg.model).init(
      jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))["params"])
  assert trainer == 1_869_888
  width = peer_step.peer_mlp_width(cfg, trainer)
  assert width == 768
  peer = jax.eval_shape(lambda: peer_step.peer_model(cfg, width).init(
      jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))["params"]
  assert count_params(peer) == peer_step.peer_param_count(cfg, width) == 1_844_928
  # 6 N + 12 L D T with N the blocks' matmuls and the tied head
  d, layers, t = 192, 4, 128
  n = layers * (4 * d * d + 2 * d * width) + d * 256
  assert peer_step.peer_flops_per_token(cfg, width) == 6 * n + 12 * layers * d * t


def test_the_profile_groups_op_time_by_pass_and_module_without_the_layer_index():
  from bench.peer_step import _where
  assert _where("jit(train_step)/while/body/closed_call/transpose(jvp(GPT))/block_2/mlp/"
                "jit(silu)/mul", 2) == "backward block/mlp"
  assert _where("jit(step)/jvp(PeerGPT)/PeerBlock_3/Dense_0/dot_general", 2) == \
      "forward PeerBlock/Dense_0"
  assert _where("jit(train_step)/jvp(GPT)/closed_call/blocks/attn/k_norm/mul", 3) == \
      "forward blocks/attn/k_norm"
  assert _where("jit(train_step)/dot_general", 2) == "optimizer and metrics: products"
  assert _where("jit(train_step)/add", 2) == "optimizer and metrics: other"
