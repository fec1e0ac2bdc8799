"""The monitor's update-norm indicator and the hold on single-step transitions a defence handled,
against hand-computed sequences; the spike skip's log-norm rule against a numpy re-derivation."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import stablejax
from stablejax.monitor.update_norm import UpdateNormThresholds


def _record(update_norm, lr=0.01, **extra):
  return {"loss": 3.0, "grad_norm": 1.0, "lr": lr, "update_norm": update_norm, **extra}


def test_update_norm_rule_warns_at_the_growth_factor_once_per_episode():
  monitor = stablejax.StabilityMonitor(update_norm=UpdateNormThresholds(growth=3.0,
                                                                        min_records=4))
  # Before the learning rate the norms are 2.0 whatever the warmup does: no warning.
  lines = [monitor.update(s, _record(2.0 * lr, lr=lr)) for s, lr in
           enumerate((0.001, 0.002, 0.004, 0.008, 0.01), start=1)]
  assert lines == [[]] * 5
  assert monitor.update(6, _record(2.0 * 0.01 * 2.9)) == []   # x2.9 < 3
  first = monitor.update(7, _record(2.0 * 0.01 * 3.5, **{"update_norm/layer_0": 0.001,
                                                         "update_norm/layer_1": 0.07}))
  assert len(first) == 1 and first[0].startswith("step 7: update norm spike: x3.5")
  assert monitor.update(8, _record(2.0 * 0.01 * 4.0)) == []   # the same episode
  assert monitor.update(9, _record(2.0 * 0.01)) == []
  assert len(monitor.update(10, _record(2.0 * 0.01 * 3.2))) == 1   # a new one


def test_update_norm_rule_ignores_skipped_steps_and_a_zero_rate():
  early = stablejax.StabilityMonitor(update_norm=UpdateNormThresholds(min_records=2))
  early.update(1, _record(0.02))
  assert early.update(2, _record(0.2)) == []               # one earlier record: too few
  monitor = stablejax.StabilityMonitor(update_norm=UpdateNormThresholds(min_records=2))
  for step in range(1, 4):
    assert monitor.update(step, _record(0.02)) == []
  for step in (4, 5, 6):
    assert monitor.update(step, _record(0.0)) == []       # skipped steps apply nothing...
  assert monitor.update(7, _record(5.0, lr=0.0)) == []     # ...nor does a rate of 0
  assert monitor.update(8, _record(float("nan"))) == []
  # ...so the median is still 2 (0.02 / 0.01), not 1 with the zeros in: x1.5 is no spike
  assert monitor.update(9, _record(0.03)) == []
  assert len(monitor.update(10, _record(0.1))) == 1


# The hold is checked against the absolute health levels (their lines are fixed numbers).
ABSOLUTE = stablejax.HealthThresholds(relative=False)


def test_a_handled_single_step_transition_is_not_a_warning():
  monitor = stablejax.StabilityMonitor(thresholds=ABSOLUTE, update_norm=None)
  handled = {"zclip/was_clipped": True}
  assert monitor.update(10, {"loss": 3.0, "grad_norm": 1.0}) == []
  assert monitor.update(11, {"loss": 3.0, "grad_norm": 40.0, **handled}) == []
  assert monitor.update(12, {"loss": 3.0, "grad_norm": 1.0}) == []   # back: neither is news
  assert monitor.summary()["level_counts"] == {"healthy": 2, "critical": 1}
  # Two handled steps out of range (a spike spans two steps through the momentum): the same.
  assert monitor.update(13, {"loss": 3.0, "grad_norm": 40.0, **handled}) == []
  assert monitor.update(14, {"loss": 3.0, "grad_norm": 9.0, **handled}) == []
  assert monitor.update(15, {"loss": 3.0, "grad_norm": 1.0}) == []
  # Three are no spike: the held lines come out, late, with the third.
  for step in (16, 17):
    assert monitor.update(step, {"loss": 3.0, "grad_norm": 40.0, **handled}) == []
  assert monitor.update(18, {"loss": 3.0, "grad_norm": 40.0, **handled}) == [
      "step 16: gradient health critical (grad norm 40; grad norm > 10)"]
  assert monitor.update(19, {"loss": 3.0, "grad_norm": 1.0}) == [
      "step 19: gradient health back to healthy (grad norm 1)"]
  # A step no defence acted on ends the hold: the held line comes out with it.
  assert monitor.update(20, {"loss": 3.0, "grad_norm": 7.0, **handled}) == []
  assert monitor.update(21, {"loss": 3.0, "grad_norm": 12.0}) == [
      "step 20: gradient health high (grad norm 7; 5 < grad norm <= 10)",
      "step 21: gradient health critical (grad norm 12; grad norm > 10)"]
  # A transition no defence acted on is emitted at once.
  plain = stablejax.StabilityMonitor(thresholds=ABSOLUTE, update_norm=None)
  plain.update(1, {"loss": 3.0, "grad_norm": 1.0})
  assert plain.update(2, {"loss": 3.0, "grad_norm": 40.0}) == [
      "step 2: gradient health critical (grad norm 40; grad norm > 10)"]


def test_the_held_transition_and_the_update_history_survive_a_checkpoint():
  monitor = stablejax.StabilityMonitor(thresholds=ABSOLUTE,
                                       update_norm=UpdateNormThresholds(min_records=2))
  for step in (1, 2, 3):
    monitor.update(step, _record(0.02))
  monitor.update(4, {**_record(0.02), "grad_norm": 40.0, "skip_spikes/skipped": True})
  restored = stablejax.StabilityMonitor(thresholds=ABSOLUTE,
                                        update_norm=UpdateNormThresholds(min_records=2))
  restored.load_state_dict(monitor.state_dict())
  for m in (monitor, restored):
    assert m.update(5, {**_record(0.02), "grad_norm": 30.0}) == [
        "step 4: gradient health critical (grad norm 40; grad norm > 10)"]
    back, spike = m.update(6, _record(0.2))
    assert back.startswith("step 6: gradient health back") and "update norm spike: x10" in spike


# ----------------------------------------------------------------------------- the spike skip


def reference_log_norm_skips(norms, window, min_history, sigma):
  """The winsorized window with the sigma rule on log(norm) (float64): skip flags."""
  hist, out = collections.deque(maxlen=window), []
  for g in norms:
    skip, threshold = False, np.inf
    if len(hist) >= min_history:
      logs = np.log(np.asarray(hist))
      threshold = np.exp(logs.mean() + sigma * logs.std())
    if not np.isfinite(g):
      out.append(True)
      continue
    skip = g > threshold
    hist.append(min(g, threshold))
    out.append(skip)
  return np.array(out)


def test_log_norm_statistics_match_numpy_and_spare_multiplicative_noise():
  rng = np.random.default_rng(5)
  steps = 400
  # Log-normal norms with a slow drift, blips of 2x to 2.8x on 3% of the steps (what clean
  # Muon runs show) and a few real spikes of 20x.
  norms = np.exp(0.2 * rng.standard_normal(steps)) * np.linspace(1.0, 0.5, steps)
  blips = rng.choice(np.arange(40, steps), 12, replace=False)
  norms[blips] *= rng.uniform(2.0, 2.8, 12)
  norms[[100, 250, 251, 330]] *= 20.0
  norms[[180]] = np.nan
  norms = norms.astype(np.float32)
  grads = {"w": norms[:, None] * np.ones((1, 4), np.float32) / 2.0}
  losses = np.full(steps, 2.0, np.float32)

  def run(statistics):
    tx = stablejax.skip_spikes(optax.sgd(1.0), window=64, min_history=32, sigma=6.0,
                               watch=("grad_norm",), statistics=statistics, max_consecutive=None)
    params = {"w": jnp.zeros(4)}

    def body(state, x):
      _, state = tx.update(x[0], state, params, loss=x[1])
      return state, state.skipped
    return np.asarray(jax.lax.scan(body, tx.init(params), ({"w": grads["w"]}, losses))[1])

  skipped = run("log_norm")
  expected = reference_log_norm_skips(np.sqrt((grads["w"].astype(np.float64) ** 2).sum(1)),
                                      64, 32, 6.0)
  np.testing.assert_array_equal(skipped, expected)
  assert skipped[[100, 250, 330, 180]].all()         # 20x spikes and the NaN
  linear = run("winsorized")
  assert skipped[blips].sum() < linear[blips].sum()  # the linear rule skips more of the blips


def test_log_norm_threshold_uses_the_population_std_of_the_window():
  # Norms 1, 2, 4, 8: logs k * ln 2 (k = 0..3), mean 1.5 ln 2, population std sqrt(1.25) ln 2, so
  # at sigma 2 the threshold is 2 ** (1.5 + 2 sqrt(1.25)) = 13.3 (16.9 with the sample std).
  from stablejax.transforms.spike_skip import log_sigma_threshold
  history = jnp.array([1.0, 2.0, 4.0, 8.0, 1e6, 1e6], jnp.float32)  # entries past count ignored
  expected = 2.0 ** (1.5 + 2.0 * np.sqrt(1.25))
  np.testing.assert_allclose(float(log_sigma_threshold(history, jnp.array(4), 2.0)), expected,
                             rtol=1e-5)
  # A norm of 15 lies between the two thresholds: the rule skips it.
  tx = stablejax.skip_spikes(optax.sgd(1.0), window=4, min_history=4, sigma=2.0,
                             watch=("grad_norm",), statistics="log_norm", max_consecutive=None)
  params, skipped = {"w": jnp.zeros(4)}, []
  state = tx.init(params)
  for norm in (1.0, 2.0, 4.0, 8.0, 15.0):
    _, state = tx.update({"w": jnp.full(4, norm / 2.0)}, state, params, loss=jnp.float32(2.0))
    skipped.append(bool(state.skipped))
  assert skipped == reference_log_norm_skips(np.array([1.0, 2.0, 4.0, 8.0, 15.0]), 4, 4,
                                             2.0).tolist() == [False] * 4 + [True]


def test_the_trainer_uses_the_log_norm_rule():
  from stablejax.training.config import load_config
  assert load_config(None, []).stability.skip_spikes.statistics == "log_norm"
  with pytest.raises(Exception, match="log_norm"):
    load_config(None, ["stability.skip_spikes.statistics=\"maxtext\""])


def test_the_rule_reads_the_update_the_optimizer_produced_where_a_state_says_it_differs():
  # compensated bf16 updates move each parameter by whole steps of its resolution: the applied
  # norm jumps about; the one the optimizer produced ("compensated/update_norm") does not.
  monitor = stablejax.StabilityMonitor(update_norm=UpdateNormThresholds(min_records=3))
  for step, applied in enumerate((0.02, 0.01, 0.03, 0.02, 0.09), start=1):
    assert monitor.update(step, {**_record(applied), "compensated/update_norm": 0.02}) == []
  assert len(monitor.update(6, {**_record(0.02), "compensated/update_norm": 0.08})) == 1


def test_the_attention_rate_rule_warns_at_the_first_logged_step():
  # Logits x230 in the first update (a learning rate that breaks the model at once), measured
  # from the initial parameters' telemetry; a healthy first update (x1.5) says nothing, and the
  # trend rule's floor (200) keeps quiet about both.
  def monitor(initial):
    m = stablejax.StabilityMonitor(update_norm=None)
    m.observe_initial({"attn_logit_max": initial})
    return m
  broken = monitor(0.13)
  line, = broken.update(1, {"loss": 5.6, "grad_norm": 1.0, "attn_logit_max": 30.0})
  assert line.startswith("step 1: attention logits growing: max pre-softmax logit 30 "
                         "(x231 in 1 step)")
  assert monitor(0.13).update(1, {"loss": 5.6, "grad_norm": 1.0, "attn_logit_max": 0.2}) == []
  healthy = monitor(8.0)
  assert healthy.update(1, {"loss": 5.6, "grad_norm": 1.0, "attn_logit_max": 12.0}) == []
  # Per step over the logged interval: x3 per step for 10 steps is a rate of 3 (< 4)...
  assert healthy.update(11, {"loss": 5.0, "grad_norm": 1.0, "attn_logit_max": 12.0 * 3 ** 10
                             / 1e4}) == []
  # ...and it survives a checkpoint.
  restored = stablejax.StabilityMonitor(update_norm=None)
  restored.load_state_dict(healthy.state_dict())
  for m in (healthy, restored):
    assert len(m.update(12, {"loss": 5.0, "grad_norm": 1.0, "attn_logit_max": 12.0 * 3 ** 10
                             / 1e4 * 5})) == 1
