"""Tests for stablejax.monitor: health levels, window rates, score, advice, movement, tags."""

import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import stablejax
from stablejax import monitor as mon
from stablejax.monitor import HealthThresholds, StabilityMonitor


# ---------------------------------------------------------------- health levels

@pytest.mark.parametrize("norm, level", [
    (0.0, "healthy"), (0.3, "healthy"), (5.0, "healthy"), (5.0001, "high"), (10.0, "high"),
    (10.0001, "critical"), (1e6, "critical"), (float("nan"), "exploded"),
    (float("inf"), "exploded"), (None, "exploded"), (np.float32(7.0), "high"),
])
def test_grad_health_level_defaults(norm, level):
  assert stablejax.grad_health_level(norm) == level


def test_grad_health_level_custom_thresholds_and_low():
  t = HealthThresholds(high=1.0, critical=2.0, low=0.5)
  assert [stablejax.grad_health_level(g, t) for g in (0.4, 0.5, 1.5, 2.5)] == [
      "low", "healthy", "high", "critical"]


@pytest.mark.parametrize("kwargs", [dict(high=10.0, critical=5.0), dict(high=5.0, critical=5.0),
                                    dict(high=-1.0),
                                    dict(low=6.0), dict(critical=float("inf")),
                                    dict(window=0), dict(min_history=0), dict(window=2.5),
                                    dict(relative="yes")])
def test_health_thresholds_reject_bad_values(kwargs):
  with pytest.raises(ValueError):
    HealthThresholds(**kwargs)


def test_grad_health_level_relative_to_a_reference():
  # the boundaries are multiples of the reference: 5 and 10 times 3.0
  assert [stablejax.grad_health_level(g, reference=3.0) for g in (15.0, 15.1, 30.0, 30.1)] == [
      "healthy", "high", "high", "critical"]
  assert stablejax.grad_health_level(float("inf"), reference=3.0) == "exploded"
  with pytest.raises(ValueError, match="reference"):
    stablejax.grad_health_level(1.0, reference=0.0)


ABSOLUTE = HealthThresholds(relative=False)


def test_level_warnings_on_entry_only():
  m = StabilityMonitor(window=100, thresholds=ABSOLUTE)
  norms = [1.0, 0.3, 6.0, 7.0, 12.0, float("nan"), 2.0, 2.0]
  lines = {step: m.update(step, {"loss": 1.0, "grad_norm": g}) for step, g in enumerate(norms, 1)}
  assert {s for s, warned in lines.items() if warned} == {3, 5, 6, 7}
  assert "gradient health high" in lines[3][0] and "6" in lines[3][0]
  assert "gradient health critical" in lines[5][0]
  assert "gradient health exploded" in lines[6][0]
  assert "back to healthy" in lines[7][0]
  assert m.level == "healthy"
  assert m.summary()["level_counts"] == {"healthy": 4, "high": 2, "critical": 1, "exploded": 1}
  assert m.summary()["max_grad_norm"] == 12.0


def test_non_finite_loss_is_exploded_and_low_level_optional():
  m = StabilityMonitor(thresholds=HealthThresholds(low=0.5, relative=False))
  assert m.update(1, {"loss": float("nan"), "grad_norm": 1.0})[0].startswith(
      "step 1: gradient health exploded")
  assert "gradient health low" in m.update(2, {"loss": 1.0, "grad_norm": 0.1})[0]
  # a non-finite skip is exploded even though the state's norm is the last good step's
  assert "exploded" in m.update(3, {"zclip/grad_norm": 1.0, "skip_nonfinite/skipped": True})[0]
  assert m.update(4, {"loss": 1.0}) == [] and m.level == "exploded"  # no norm: level unchanged


def test_relative_levels_follow_the_median_of_the_window():
  # Reference: the median of the finite norms logged in the previous `window` steps, once
  # `min_history` of them are there; the boundaries are 5 and 10 times it. Re-derived here with
  # numpy from that definition.
  m = StabilityMonitor(window=100)
  norms = [56.0, 30.0, 12.0, 8.0, 6.0, 5.0, 4.5, 4.0, 4.2, 66.0, 4.1, 40.0, 4.0]
  got = [m.update(10 * i, {"loss": 3.0, "grad_norm": g}) for i, g in enumerate(norms, 1)]
  history, levels = [], []
  for i, g in enumerate(norms, 1):
    recent = [x for step, x in history if step > 10 * i - 200]
    ref = float(np.median(recent)) if len(recent) >= 3 else None
    ratio = None if ref is None else g / ref
    levels.append("healthy" if ratio is None or ratio <= 5 else
                  "high" if ratio <= 10 else "critical")
    history.append((10 * i, g))
  assert levels[:9] == ["healthy"] * 9  # the fall from the value at initialisation
  assert levels[9:] == ["critical", "healthy", "high", "healthy"]  # 66 / 6, 40 / 6
  assert [i for i, lines in enumerate(got) if lines] == [9, 10, 11, 12]
  assert got[9] == ["step 100: gradient health critical (grad norm 66; grad norm > 10 x 6, "
                    "the median grad norm of the last 200 steps)"]
  assert "back to healthy" in got[10][0] and "gradient health high" in got[11][0]
  assert m.summary()["level_counts"] == {"healthy": 11, "critical": 1, "high": 1}
  # the absolute rule would have warned from the first step on
  a = StabilityMonitor(window=100, thresholds=ABSOLUTE)
  assert "critical" in a.update(10, {"loss": 3.0, "grad_norm": 56.0})[0]


def test_relative_levels_need_history_and_forget_old_steps():
  t = HealthThresholds(window=30, min_history=2)
  m = StabilityMonitor(window=100, thresholds=t)
  assert "exploded" in m.update(1, {"loss": 3.0, "grad_norm": float("nan")})[0]  # at once
  assert "back to healthy" in m.update(2, {"loss": 3.0, "grad_norm": 100.0})[0]
  assert m.update(3, {"loss": 3.0, "grad_norm": 1.0}) == []  # one finite norm: no reference
  assert "critical" in m.update(4, {"loss": 3.0, "grad_norm": 600.0})[0]  # 600 / median(100, 1)
  # 30 steps later the norms of steps 1-4 have left the window: the reference refills
  assert "back to healthy" in m.update(40, {"loss": 3.0, "grad_norm": 50.0})[0]
  m.update(41, {"loss": 3.0, "grad_norm": 50.0})
  m.update(60, {"loss": 3.0, "grad_norm": 50.0})
  assert m.level == "healthy"
  assert "critical" in m.update(62, {"loss": 3.0, "grad_norm": 600.0})[0]  # 600 / 50


def test_relative_levels_wait_for_min_history_norms_of_the_window():
  def norm(g):
    return {"loss": 3.0, "grad_norm": g}
  m = StabilityMonitor(window=100, thresholds=HealthThresholds(min_history=3))
  m.update(1, norm(1.0))
  m.update(2, norm(1.0))
  assert m.update(3, norm(30.0)) == [] and m.level == "healthy"  # two norms before it: no level
  m.update(4, norm(1.0))
  assert "critical" in m.update(5, norm(30.0))[0]  # 30 / median(1, 1, 30, 1)
  # Only the norms of the last `window` steps set the reference: the five norms of 100 are more
  # than 10 steps old at step 22, so 30 is 30 times median(1, 1), not 0.3 times 100.
  m = StabilityMonitor(window=100, thresholds=HealthThresholds(window=10, min_history=1))
  for step in range(1, 6):
    m.update(step, norm(100.0))
  m.update(20, norm(1.0))
  m.update(21, norm(1.0))
  assert "critical" in m.update(22, norm(30.0))[0]


def test_relative_reference_survives_state_dict():
  a = StabilityMonitor(window=100)
  for step, g in enumerate([9.0, 3.0, 2.0, 2.0], 1):
    a.update(step, {"loss": 3.0, "grad_norm": g})
  b = StabilityMonitor(window=100)
  b.load_state_dict(json.loads(json.dumps(a.state_dict())))
  assert b.update(5, {"loss": 3.0, "grad_norm": 30.0}) == a.update(
      5, {"loss": 3.0, "grad_norm": 30.0})
  assert b.level == a.level == "critical"  # 30 / median(9, 3, 2, 2) = 12


# ---------------------------------------------------------------- rates

def _rec(spikes, clips, skips, is_spike=False, was_clipped=False, skipped=False, **extra):
  r = {"loss": 1.0, "grad_norm": 1.0, "zclip/spike_count": spikes, "zclip/clip_count": clips,
       "zclip/is_spike": is_spike, "zclip/was_clipped": was_clipped,
       "skip_nonfinite/total_skips": skips, "skip_nonfinite/skipped": skipped}
  r.update(extra)
  return r


def test_rates_from_counter_differences():
  m = StabilityMonitor(window=100)
  # first record: no baseline, the per-step flags count as one step (clipped, no spike, no skip)
  m.update(10, _rec(0, 1, 0, was_clipped=True, **{"zclip/threshold": 1.5}))
  # +2 spikes, +3 clips, +1 skip in 10 steps
  m.update(20, _rec(2, 4, 1, **{"zclip/threshold": 2.0}))
  m.update(30, _rec(2, 5, 1))                              # +0, +1, +0 in 10 steps
  r = m.rates()
  assert r["zclip_spike_rate"] == pytest.approx(2 / 21)
  assert r["zclip_clip_rate"] == pytest.approx(5 / 21)
  assert r["skip_nonfinite_rate"] == pytest.approx(1 / 21)
  assert r["skip_rate"] == pytest.approx(1 / 21)
  assert r["zclip_threshold"] == 2.0  # latest seen
  assert r["rollbacks"] == 0.0
  assert "muon_outlier_rate" not in r and "adagc_clip_rate" not in r  # no such keys were logged
  # score by hand: 1 - 0.2 * (spike/0.2 + skip/0.05); routine clips are not scored
  assert m.score() == pytest.approx(1 - (2 / 21 + 4 * 1 / 21))


def test_window_drops_old_intervals():
  m = StabilityMonitor(window=20)
  m.update(10, _rec(0, 0, 0, is_spike=True))  # clock 1: flag spike
  m.update(20, _rec(5, 0, 0))                 # clock 11: 5 spikes
  m.update(30, _rec(6, 0, 0))                 # clock 21: 1 spike
  m.update(40, _rec(6, 0, 0))                 # clock 31: 0 spikes; window (11, 31]
  assert m.rates()["zclip_spike_rate"] == pytest.approx(1 / 20)


def test_counter_going_back_uses_flags_after_rollback():
  m = StabilityMonitor(window=100)
  m.update(10, _rec(0, 0, 0))                  # 0 / 1 (flag)
  m.update(20, _rec(3, 0, 0))                  # 3 / 10
  m.record_rollback(20, "loss spike")
  m.update(15, _rec(1, 0, 0, is_spike=True))   # step went back: flag, 1 / 1
  m.update(25, _rec(1, 0, 0))                  # 0 / 10
  r = m.rates()
  assert r["zclip_spike_rate"] == pytest.approx(4 / 22)
  assert r["rollbacks"] == 1.0
  assert m.summary()["rollbacks"] == [{"step": 20, "cause": "loss spike"}]


def test_sampled_rates_and_muon_fallbacks():
  m = StabilityMonitor(window=100)
  seq = [
      (10, {"adagc/clipped_fraction": 0.5, "muon/outlier_rate": 0.02,
            "muon/ns_instability_rate": 0.0, "muon/fallback_rate": 0.0,
            "muon/fallback_count": 0}),
      (20, {"adagc/clipped_fraction": 0.25, "muon/outlier_rate": float("nan"),
            "muon/ns_instability_rate": 0.1, "muon/fallback_rate": 0.5, "muon/fallback_count": 4}),
      (30, {"adagc/clipped_fraction": 0.0, "muon/outlier_rate": 0.04,
            "muon/ns_instability_rate": 0.2, "muon/fallback_rate": 0.0, "muon/fallback_count": 4}),
  ]
  for step, rec in seq:
    m.update(step, rec)
  r = m.rates()
  assert r["adagc_clip_rate"] == pytest.approx(0.25)
  assert r["muon_outlier_rate"] == pytest.approx(0.03)        # the NaN sample is ignored
  assert r["muon_ns_instability_rate"] == pytest.approx(0.1)
  assert r["muon_fallback_rate"] == pytest.approx(4 / 21)     # 0 (flag, 1 step) + 4 in 10 + 0 in 10
  assert "zclip_spike_rate" not in r
  expected = 1 - 0.2 * (0.03 / 0.05 + 0.1 / 0.05 + (4 / 21) / 0.01)  # AdaGC not scored
  assert m.score() == pytest.approx(max(0.0, expected))


def test_both_skip_wrappers_add_up():
  m = StabilityMonitor(window=100)
  m.update(0, {"skip_nonfinite/total_skips": 0, "skip_spikes/total_skips": 0})
  m.update(10, {"skip_nonfinite/total_skips": 1, "skip_spikes/total_skips": 2})
  r = m.rates()  # the first record has no flags, so only the 10-step interval counts
  assert r["skip_nonfinite_rate"] == pytest.approx(1 / 10)
  assert r["skip_spikes_rate"] == pytest.approx(2 / 10)
  assert r["skip_rate"] == pytest.approx(3 / 10)


def test_a_muon_fallback_flag_is_one_event_whatever_the_fraction() -> None:
  # rates(): the first record's flag `muon/fallback_rate > 0` counts as one event in one step.
  m = StabilityMonitor(window=100)
  m.update(10, {"muon/fallback_rate": 0.25})
  assert m.rates()["muon_fallback_rate"] == 1.0


def test_skip_rate_is_skipped_steps_per_step_even_when_both_wrappers_skip() -> None:
  # A NaN step is skipped by both wrappers at once: one skipped step, not two.
  m = StabilityMonitor(window=100)
  m.update(1, {"skip_nonfinite/skipped": True, "skip_spikes/skipped": True})
  r = m.rates()
  assert r["skip_nonfinite_rate"] == 1.0 and r["skip_spikes_rate"] == 1.0
  assert r["skip_rate"] == 1.0


def test_event_rates_are_at_most_one_per_step() -> None:
  # zclip_spike_rate is "events per step": a counter that jumped by more than the steps (a
  # restored optimizer state) still gives at most one spike per step.
  m = StabilityMonitor(window=100)
  m.update(0, _rec(0, 0, 0))
  m.update(10, _rec(15, 0, 0))
  assert m.rates()["zclip_spike_rate"] == 1.0


def test_rollbacks_count_only_inside_the_window() -> None:
  m = StabilityMonitor(window=10)
  m.update(1, _rec(0, 0, 0))
  m.record_rollback(1, "loss spike")
  assert m.rates()["rollbacks"] == 1.0
  for step in range(2, 13):
    m.update(step, _rec(0, 0, 0))
  assert m.rates()["rollbacks"] == 0.0
  assert m.summary()["rollbacks_total"] == 1


def test_a_flat_loss_is_a_plateau() -> None:
  # "the mean loss of the last window is not below that of the window before"
  m = StabilityMonitor(window=10)
  lines = []
  for step in range(1, 31):
    lines += m.update(step, {"loss": 2.0, "grad_norm": 1.0})
  assert any("warmup" in line for line in lines)


# ---------------------------------------------------------------- score

def test_score_edge_cases():
  assert stablejax.stability_score({}) == 1.0
  assert StabilityMonitor().score() == 1.0                         # no data
  zeros = {k: 0.0 for k in mon.SCORE_BUDGETS}
  assert stablejax.stability_score(zeros) == 1.0
  maxed = {k: 1.0 for k in mon.SCORE_BUDGETS}
  assert stablejax.stability_score(maxed) == 0.0
  assert stablejax.stability_score({"zclip_spike_rate": float("nan")}) == 1.0
  assert stablejax.stability_score({"zclip_spike_rate": None, "skip_rate": -1.0}) == 1.0
  assert stablejax.stability_score({"skip_rate": float("inf")}) == 0.0
  assert stablejax.stability_score({"unrelated": 5.0, "zclip_threshold": 9.0}) == 1.0


@pytest.mark.parametrize("key, budget", list(mon.SCORE_BUDGETS.items()))
def test_each_signal_at_its_budget_gives_the_target(key, budget):
  assert stablejax.stability_score({key: budget}) == pytest.approx(0.8)
  assert stablejax.stability_score({key: budget / 2}) == pytest.approx(0.9)


def test_score_adds_signals():
  # 1 - 0.2 * (0.1 / 0.2 + 0.025 / 0.05) = 0.8
  assert stablejax.stability_score({"zclip_spike_rate": 0.1, "skip_rate": 0.025}) == \
      pytest.approx(0.8)
  # 1 - 0.2 * (0.3 / 0.2 + 0.1 / 0.05) = 0.3
  assert stablejax.stability_score({"zclip_spike_rate": 0.3,
                                    "muon_ns_instability_rate": 0.1}) == pytest.approx(0.3)
  # 1 - 0.2 * (0.5 / 0.2 + 0.2 / 0.05) = -0.3, clamped
  assert stablejax.stability_score({"zclip_spike_rate": 0.5,
                                    "muon_ns_instability_rate": 0.2}) == 0.0


def test_routine_clipping_is_not_scored():
  # ZClip's warmup/ceiling clips and AdaGC's per-tensor clips happen on most steps of healthy runs
  assert stablejax.stability_score({"zclip_clip_rate": 1.0, "adagc_clip_rate": 0.97}) == 1.0
  assert mon.troubleshooting_advice({"zclip_clip_rate": 1.0, "adagc_clip_rate": 0.97}) == []
  m = stablejax.StabilityMonitor(window=4)
  lines = []
  for step in range(1, 13):  # every step clipped at the ceiling, every tensor clipped by AdaGC
    lines += m.update(step, {"grad_norm": 2.0, "zclip/clip_count": float(step),
                             "zclip/spike_count": 0.0, "adagc/clipped_fraction": 1.0})
  assert m.rates()["zclip_clip_rate"] == 1.0 and m.score() == 1.0
  assert not any("stability score" in line for line in lines)


def test_troubleshooting_rows():
  advice = mon.troubleshooting_advice({"zclip_spike_rate": 0.25, "zclip_clip_rate": 0.6,
                                       "muon_ns_instability_rate": 0.06}, loss_plateau=True)
  assert len(advice) == 3
  assert "lower the learning rates by 20%" in advice[0]
  assert "fewer NS steps" in advice[1]
  assert "warmup" in advice[2]
  assert mon.troubleshooting_advice({"zclip_spike_rate": 0.2}) == []  # the limit itself is fine


def test_advice_is_rate_limited():
  m = StabilityMonitor(window=10)
  advice_steps = []
  for step in range(1, 26):  # a spike every step
    lines = m.update(step, _rec(step, step, 0, is_spike=True, was_clipped=True))
    if any("stability score" in line for line in lines):
      advice_steps.append(step)
      assert "< target 0.80" in lines[-1] and "lower the learning rates by 20%" in lines[-1]
  assert advice_steps == [10, 20]  # none before a full window of data, then once per window
  assert m.score() == 0.0


def test_loss_plateau_adds_warmup_advice():
  m = StabilityMonitor(window=10)
  lines = []
  for step in range(1, 31):
    lines += m.update(step, {"loss": 2.0 + 0.001 * step, "grad_norm": 1.0})
  assert any("warmup" in line for line in lines)
  m2 = StabilityMonitor(window=10)
  assert not any(m2.update(s, {"loss": 5.0 - 0.1 * s, "grad_norm": 1.0}) for s in range(1, 31))


def test_loss_plateau_is_not_flagged_in_the_decay_phase():
  # The same flat loss late in a cosine schedule (lr below half its peak) is expected: no advice
  # (the long-horizon sweep's clean runs all got it at step 700 of 800 before this rule).
  def lines_with(lr_of_step):
    m = StabilityMonitor(window=10)
    out = []
    for step in range(1, 41):
      out += m.update(step, {"loss": 2.0 + 0.001 * step, "grad_norm": 1.0,
                             "lr": lr_of_step(step)})
    return [line for line in out if "plateau" in line]
  assert lines_with(lambda s: 1e-3)                                # constant rate: flagged
  assert not lines_with(lambda s: 1e-3 if s < 10 else 4e-4)        # decayed below half: not
  m = StabilityMonitor(window=10)
  for step in range(1, 41):
    m.update(step, {"loss": 2.0, "lr": 1e-3 if step < 10 else 4e-4})
  b = StabilityMonitor(window=10)
  b.load_state_dict(json.loads(json.dumps(m.state_dict())))
  assert b.state_dict() == m.state_dict() and b.advice() == m.advice() == []


def test_missing_and_nonfinite_keys_are_tolerated():
  m = StabilityMonitor()
  assert m.update(1, {}) == []
  assert m.update(2, {"zclip/spike_count": float("nan"), "adagc/clipped_fraction": "n/a"}) == []
  assert m.level is None
  assert m.score() == 1.0
  assert m.rates() == {"rollbacks": 0.0}


def test_state_dict_round_trip_through_json():
  a = StabilityMonitor(window=30)
  b = StabilityMonitor(window=30)
  recs = [_rec(s // 7, s // 3, s // 20, **{"adagc/clipped_fraction": 0.1 * (s % 3),
                                           "zclip/threshold": 1.0 + s})
          for s in range(0, 120, 5)]
  for i, r in enumerate(recs[:12]):
    a.update(5 * i, {**r, "grad_norm": 6.0 if i == 7 else 1.0})
  a.record_rollback(55, "test")
  b.load_state_dict(json.loads(json.dumps(a.state_dict())))
  assert b.rates() == a.rates() and b.summary() == a.summary()
  for i, r in enumerate(recs[12:], 12):
    assert a.update(5 * i, r) == b.update(5 * i, r)
  assert b.state_dict() == a.state_dict()
  with pytest.raises(ValueError):
    b.load_state_dict({"version": 99})


@pytest.mark.parametrize("kwargs", [dict(window=0), dict(score_target=1.5), dict(advice_every=0),
                                    dict(thresholds=(5, 10))])
def test_monitor_rejects_bad_arguments(kwargs):
  with pytest.raises(ValueError):
    StabilityMonitor(**kwargs)


# ---------------------------------------------------------------- parameter movement

def test_param_movement_against_numpy():
  prev = {"a": jnp.array([1.0, 2.0]), "b": {"kernel": jnp.array([[3.0]])},
          "c": jnp.array([1.0, 1.0], jnp.bfloat16), "n": jnp.array([1, 2])}
  new = {"a": jnp.array([1.5, 2.0]), "b": {"kernel": jnp.array([[3.0]])},
         "c": jnp.array([1.0, 2.0], jnp.bfloat16), "n": jnp.array([5, 5])}
  labels = {"a": "g", "b": {"kernel": "g"}, "c": "h", "n": "h"}
  out = jax.jit(functools.partial(mon.param_movement, labels=labels))(prev, new)
  assert set(out) == {"g", "h"}
  g = out["g"]
  assert float(g["rel_change"]) == pytest.approx(0.5 / math.sqrt(14), rel=1e-6)
  rms_d, rms_p = math.sqrt(0.25 / 3), math.sqrt(14 / 3)
  assert float(g["resolution_ratio"]) == pytest.approx(rms_d / (2.0 ** -23 * rms_p), rel=1e-5)
  assert float(g["resolution_ratio_bf16"]) == pytest.approx(rms_d / (2.0 ** -7 * rms_p), rel=1e-5)
  assert float(g["frozen_fraction"]) == pytest.approx(2 / 3)
  assert float(g["param_rms"]) == pytest.approx(math.sqrt((2.25 + 4 + 9) / 3), rel=1e-6)
  h = out["h"]  # the int leaf is ignored; bf16 resolution is the group's own
  assert float(h["rel_change"]) == pytest.approx(1 / math.sqrt(2), rel=1e-6)
  assert float(h["resolution_ratio"]) == pytest.approx(float(h["resolution_ratio_bf16"]))
  by_callable = mon.param_movement(prev, new, labels=lambda p: "all")
  assert float(by_callable["all"]["rel_change"]) == pytest.approx(
      math.sqrt(1.25) / math.sqrt(16), rel=1e-6)
  with pytest.raises(ValueError):
    mon.param_movement({"a": prev["a"]}, new)


def _mlp_params(dtype, key=0):
  k1, k2 = jax.random.split(jax.random.PRNGKey(key))
  return {
      "mlp": {"fc1": {"kernel": jax.random.normal(k1, (4, 16)), "bias": jnp.zeros(16)},
              "fc2": {"kernel": jax.random.normal(k2, (16, 1)), "bias": jnp.zeros(1)}},
      "norm": {"scale": jnp.ones(16)},
  } if dtype is None else jax.tree.map(lambda x: x.astype(dtype), _mlp_params(None, key))


def _train(params, lr, steps=3):
  """A 2-layer MLP with a norm-like scale, trained with optax.adam; returns the final params."""
  x = jax.random.normal(jax.random.PRNGKey(1), (32, 4))
  y = jnp.sin(x.sum(axis=1, keepdims=True))
  tx = optax.adam(lr)

  def loss_fn(p):
    h = jnp.tanh(x @ p["mlp"]["fc1"]["kernel"] + p["mlp"]["fc1"]["bias"]) * p["norm"]["scale"]
    return jnp.mean((h @ p["mlp"]["fc2"]["kernel"] + p["mlp"]["fc2"]["bias"] - y) ** 2)

  @jax.jit
  def run(p):
    def body(carry, _):
      p, s = carry
      g = jax.grad(loss_fn)(p)
      u, s = tx.update(g, s, p)
      return (optax.apply_updates(p, u), s), None
    (p, _), _ = jax.lax.scan(body, (p, tx.init(p)), None, length=steps)
    return p
  return run(params)


def _check(params, lr):
  new = _train(params, lr)
  move = jax.device_get(jax.jit(mon.param_movement)(params, new))
  return move, stablejax.movement_warnings(move, dtypes=stablejax.param_dtypes(new), step=3)


def test_movement_flags_tiny_learning_rate():
  move, lines = _check(_mlp_params(None), 1e-9)
  assert len(lines) == 1
  line = lines[0]
  assert line.startswith("step 3: parameters are not moving:")
  assert "learning rate too low" in line
  assert "mlp" in line and "norm scales stuck at 1.000" in line
  assert move["norm"]["rel_change"] < 1e-6


def test_movement_flags_bf16_parameters_with_small_learning_rate():
  move, lines = _check(_mlp_params(jnp.bfloat16), 1e-5)
  assert len(lines) == 1
  assert "parameters are not moving" in lines[0]
  assert "underflow the low-precision parameters" in lines[0]
  assert "norm scales stuck at 1.000" in lines[0]
  assert move["norm"]["frozen_fraction"] == 1.0       # every update rounded away
  assert move["norm"]["resolution_ratio"] < 1.0
  # the same learning rate on fp32 parameters moves; only the bf16 what-if ratio is below 1
  move32, lines32 = _check(_mlp_params(None), 1e-5)
  assert lines32 == []
  assert move32["norm"]["frozen_fraction"] == 0.0
  assert move32["norm"]["resolution_ratio"] > 1.0 > move32["norm"]["resolution_ratio_bf16"]


def test_movement_normal_learning_rate_is_not_flagged():
  move, lines = _check(_mlp_params(None), 1e-2)
  assert lines == []
  assert all(m["rel_change"] > 1e-4 for m in move.values())
  assert set(stablejax.movement_record(move)) >= {"param_move/mlp", "param_move/norm",
                                                  "param_move/mlp/resolution_ratio_bf16"}


def test_movement_warnings_nonfinite_and_without_dtypes():
  lines = stablejax.movement_warnings({"mlp": {"rel_change": float("nan")},
                                       "head": {"rel_change": 0.0, "resolution_ratio": 0.0}})
  assert len(lines) == 2
  assert "head" in lines[0] and "or updates underflowing" in lines[0]
  assert "non-finite" in lines[1] and "mlp" in lines[1]


@pytest.mark.parametrize("path, group", [
    ("tok_embed/embedding", "embedding"), ("lm_head/kernel", "head"),
    ("blocks/attn/q_proj/kernel", "attention"), ("blocks/attn_norm/scale", "norm"),
    ("blocks/attn/q_norm/scale", "norm"), ("final_norm/scale", "norm"),
    ("blocks/mlp/gate_proj/kernel", "mlp"), ("h/ln_1/scale", "norm"), ("foo/bar", "other"),
])
def test_default_groups(path, group):
  assert mon.default_group(path) == group


# ---------------------------------------------------------------- per-layer grad norms

def test_per_layer_grad_norms_splits_stacked_layers():
  w = np.arange(12, dtype=np.float32).reshape(3, 2, 2)
  grads = {"blocks": {"mlp": {"kernel": jnp.asarray(w)}}, "lm_head": {"kernel": jnp.ones((2, 3))},
           "step": jnp.array(3)}
  out = jax.jit(stablejax.per_layer_grad_norms)(grads)
  assert set(out) == {"blocks/0/mlp/kernel", "blocks/1/mlp/kernel", "blocks/2/mlp/kernel",
                      "lm_head/kernel"}
  for i in range(3):
    assert float(out[f"blocks/{i}/mlp/kernel"]) == pytest.approx(np.linalg.norm(w[i]), rel=1e-6)
  assert float(out["lm_head/kernel"]) == pytest.approx(math.sqrt(6), rel=1e-6)
  flat = stablejax.per_layer_grad_norms(grads, stacked_names=())
  assert float(flat["blocks/mlp/kernel"]) == pytest.approx(np.linalg.norm(w), rel=1e-6)
  # An unrolled list of layers (h/0/..., as in GPT-2 ports) is not a stacked leaf.
  unrolled = stablejax.per_layer_grad_norms({"h": {"0": {"kernel": jnp.asarray(w[0])}}})
  assert set(unrolled) == {"h/0/kernel"}
  assert float(unrolled["h/0/kernel"]) == pytest.approx(np.linalg.norm(w[0]), rel=1e-6)


# ---------------------------------------------------------------- TensorBoard tags

def test_tensorboard_scalars_mapping():
  rec = {"step": 5, "loss": 2.5, "lr": 1e-3, "grad_norm": 1.2, "tokens_per_sec": 100.0,
         "zclip/grad_norm": 1.2, "zclip/was_clipped": True, "muon/update_rms/adam": 0.01,
         "health": "critical", "stability_score": 0.7, "param_move/norm": 1e-4,
         "param_move/norm/resolution_ratio": 3.0, "act_rms": 1.0, "logit_max": 20.0,
         "lambda": 0.5, "note": "text", "mystery": 3}
  tags = stablejax.tensorboard_scalars(rec, rates={"zclip_spike_rate": 0.1})
  assert tags == {
      "train/loss": 2.5, "train/lr": 1e-3, "train/grad_norm": 1.2, "train/tokens_per_sec": 100.0,
      "stability/zclip/grad_norm": 1.2, "stability/zclip/was_clipped": 1.0,
      "stability/muon/update_rms/adam": 0.01, "health/level": 2.0, "stability/score": 0.7,
      "movement/norm": 1e-4, "movement/norm/resolution_ratio": 3.0, "activations/rms": 1.0,
      "activations/logit_max": 20.0, "train/quant_lambda": 0.5, "other/mystery": 3.0,
      "stability/rate/zclip_spike_rate": 0.1}
  assert stablejax.tensorboard_scalars({"step": 50, "val_loss": 2.0}) == {"eval/loss": 2.0}
  assert stablejax.tensorboard_scalars({"step": 50, "event": "rollback", "cause": "x"}) == {
      "events/rollback": 1.0}


# ---------------------------------------------------------------- with the real transforms

def test_monitor_reads_real_stability_metrics():
  tx = stablejax.skip_nonfinite(optax.chain(stablejax.zclip(warmup_steps=3), optax.sgd(0.1)))
  params = {"w": jnp.ones(4)}
  state = tx.init(params)
  update = jax.jit(tx.update)
  m = StabilityMonitor(window=100)
  lines = {}
  for step in range(1, 11):
    g = {"w": jnp.full(4, jnp.nan if step == 5 else 0.25)}  # norm 0.5 < max_grad_norm 1
    _, state = update(g, state, params)
    if step % 3 == 1:  # logged at 1, 4, 7, 10: the NaN step 5 falls between two records
      rec = {k: v.item() for k, v in jax.device_get(stablejax.stability_metrics(state)).items()}
      lines[step] = m.update(step, {"loss": 1.0, **rec})
  r = m.rates()
  assert r["skip_nonfinite_rate"] == pytest.approx(1 / 10)  # 1 skip over 1 (flag) + 3 * 3 steps
  assert r["zclip_spike_rate"] == 0.0 and r["zclip_clip_rate"] == 0.0
  assert m.level == "healthy"  # the NaN step itself was not a logged step
  assert lines[1] == lines[4] == lines[10] == []
  assert lines[7] == []  # advice waits for a full window (100 steps) of data


MONITOR_NAMES = (
    "HEALTH_LEVELS", "HealthThresholds", "PLATEAU_ADVICE", "SCORE_BUDGETS",
    "SCORE_PENALTY_AT_BUDGET", "STACKED_NAMES", "StabilityMonitor", "TROUBLESHOOTING",
    "default_group", "grad_health_level", "health_code", "movement_record", "movement_warnings",
    "param_dtypes", "param_movement", "path_str", "per_layer_grad_norms", "stability_score",
    "tensorboard_scalars", "troubleshooting_advice", "_as_float")


@pytest.mark.parametrize("name", MONITOR_NAMES)
def test_names_of_the_former_module_import_from_the_package(name):
  # stablejax.monitor was one module; it is a package now and keeps every name at the top.
  namespace = {}
  exec(f"from stablejax.monitor import {name}", namespace)
  assert namespace[name] is getattr(mon, name)


# ---------------------------------------------------------------- attention-logit growth

def _attn_run(values, every=10, **kwargs):
  """Feeds attn_logit_max values at steps every, 2*every, ...; returns [(step, line)]."""
  m = StabilityMonitor(**kwargs)
  out = []
  for i, v in enumerate(values, 1):
    rec = {"loss": 2.0, "grad_norm": 1.0, "attn_logit_max": v,
           "attn_logit_max/layer_0": v / 2, "attn_logit_max/layer_1": v}
    out += [(i * every, line) for line in m.update(i * every, rec) if "attention" in line]
  return out, m


def test_attention_rule_level_warns_once_with_advice_and_layer():
  rule = mon.AttentionLogitThresholds(high=1000.0, growth=8.0, growth_window=100,
                                      growth_floor=200.0)
  # A healthy ramp from 5 to 900 within the growth limit, then above the level.
  values = [5.0 * 1.1 ** i for i in range(55)] + [1500.0, 1600.0, 2000.0]
  assert max(values[:55]) < 1000
  lines, m = _attn_run(values, attention=rule)
  assert len(lines) == 1 and lines[0][0] == 560
  assert "above 1000" in lines[0][1] and "layer_1" in lines[0][1]
  assert "qk_norm" in lines[0][1] and "stability.qk_clip.enabled" in lines[0][1]
  assert any("attention logits" in a for a in m.advice())
  # Ten times further: one more warning.
  more = m.update(590, {"attn_logit_max": 20001.0})
  assert len(more) == 1 and "logit 2e+04" in more[0]


def test_attention_rule_trend_warns_below_the_level_and_floor_blocks_early_growth():
  rule = mon.AttentionLogitThresholds(high=1e4, growth=8.0, growth_window=100,
                                      growth_floor=200.0)
  # x10 within 100 steps but below the floor: no warning; then 50 -> 450 in 100 steps: warning.
  early = [1.0, 2.0, 5.0, 10.0, 20.0, 40.0] + [50.0] * 12          # steps 10 .. 180
  lines, _ = _attn_run(early + [100.0, 150.0, 250.0, 350.0, 450.0], attention=rule)
  assert len(lines) == 1 and lines[0][0] == 230                     # 450 / 50 = 9 >= 8
  assert "x9 within 100 steps" in lines[0][1]


def test_attention_rule_quiet_on_flat_or_slow_series_and_off_with_none():
  flat = [250.0 + 10 * math.sin(i) for i in range(80)]
  assert _attn_run(flat)[0] == []
  slow = [10.0 * 1.02 ** i for i in range(150)]          # x1.22 per 100 steps, up to ~195
  assert _attn_run(slow)[0] == []
  assert _attn_run([10.0, 1e6], attention=None)[0] == []
  with pytest.raises(ValueError):
    mon.AttentionLogitThresholds(growth=1.0)
  with pytest.raises(ValueError):
    StabilityMonitor(attention=(1000.0,))


def test_attention_rule_state_survives_a_checkpoint():
  a = StabilityMonitor()
  for i, v in enumerate([10.0, 20.0, 40.0, 100.0], 1):
    a.update(10 * i, {"attn_logit_max": v})
  b = StabilityMonitor()
  b.load_state_dict(json.loads(json.dumps(a.state_dict())))
  assert a.update(50, {"attn_logit_max": 900.0}) == b.update(50, {"attn_logit_max": 900.0})
  assert b.state_dict() == a.state_dict()
  old = a.state_dict()
  for key in ("attn", "attn_warned", "attn_active"):   # a state saved before the rule existed
    old.pop(key)
  StabilityMonitor().load_state_dict(old)


def test_tensorboard_tags_of_the_logit_telemetry():
  tags = stablejax.tensorboard_scalars({
      "step": 10, "attn_logit_max": 300.0, "attn_logit_max/layer_2": 300.0,
      "attn_logit_max/layer_2/head_1": 299.0, "output_logit_max": 9.0,
      "output_log_z_mean": 5.0, "output_log_z_max": 7.0, "qk_clip/heads_clipped": 3})
  assert tags == {"attention/max_logit": 300.0, "attention/max_logit/layer_2": 300.0,
                  "attention/max_logit/layer_2/head_1": 299.0, "output_logits/max": 9.0,
                  "output_logits/log_z_mean": 5.0, "output_logits/log_z_max": 7.0,
                  "stability/qk_clip/heads_clipped": 3.0}


def test_a_score_just_below_the_target_is_printed_below_it() -> None:
  # 0.7996 printed to two decimals read "stability score 0.80 < target 0.80".
  m = StabilityMonitor(window=10, loss_plateau_check=False)
  lines = []
  for step in range(1, 21):  # a skip rate of 0.05 * 1.002: score 1 - 0.2 * 1.002 = 0.7996
    lines += m.update(step, {"skip_spikes/total_skips": 0.0501 * step, "loss": 2.0})
  scores = [line for line in lines if "stability score" in line]
  assert scores and "stability score 0.800 < target 0.800" not in scores[0]
  assert "stability score 0.7996 < target 0.8000" in scores[0], scores
