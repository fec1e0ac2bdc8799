"""stability_metrics: exact keys, any optax wrapper tree, jit, registry."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import stablejax

ZCLIP = {"grad_norm", "clipped_grad_norm", "z", "threshold", "ema_mean",
         "ema_std", "was_clipped", "is_spike", "spike_count", "clip_count"}
ADAGC = {"clipped_fraction", "grad_norm", "clipped_grad_norm"}
SKIP = {"skipped", "total_skips", "consecutive_skips", "needs_rollback", "rollback_requests"}
SPIKES = SKIP | {"loss_mean", "grad_norm_mean", "grad_norm"}


def _keys(prefix, names):
  return {f"{prefix}/{n}" for n in names}


def _toy_params():
  return {"w": jnp.ones((3, 4)), "b": jnp.zeros(4)}


def _grads(t):
  rng = np.random.default_rng(t)
  return {"w": jnp.asarray(rng.normal(0, 1, (3, 4)), jnp.float32),
          "b": jnp.asarray(rng.normal(0, 1, 4), jnp.float32)}


def _steps(tx, n=4, **extra):
  params = _toy_params()
  state = tx.init(params)
  update = jax.jit(tx.update)
  for t in range(n):
    _, state = update(_grads(t), state, params, **extra)
  return state


def _check_scalars(metrics):
  for key, value in metrics.items():
    assert isinstance(value, jax.Array), key
    assert value.shape == (), key
    assert value.dtype in (jnp.float32, jnp.int32, jnp.bool_), key


def test_full_stack_keys_exact_and_values_from_state():
  tx = stablejax.skip_nonfinite(
      stablejax.skip_spikes(
          optax.chain(stablejax.zclip(warmup_steps=2),
                      stablejax.adagc(warmup_steps=2), optax.adam(1e-3)),
          window=8, min_history=2),
      max_consecutive=3)
  state = _steps(tx, loss=jnp.float32(2.0))
  metrics = jax.jit(stablejax.stability_metrics)(state)
  assert set(metrics) == (_keys("zclip", ZCLIP) | _keys("adagc", ADAGC)
                          | _keys("skip_nonfinite", SKIP)
                          | _keys("skip_spikes", SPIKES))
  _check_scalars(metrics)
  spikes = state.inner_state
  z_state, a_state, _ = spikes.inner_state
  assert float(metrics["zclip/grad_norm"]) == float(z_state.grad_norm)
  np.testing.assert_allclose(metrics["zclip/ema_std"],
                             np.sqrt(z_state.ema_var), rtol=1e-6)
  assert float(metrics["adagc/clipped_fraction"]) == float(
      a_state.clipped_fraction)
  assert float(metrics["skip_spikes/loss_mean"]) == pytest.approx(2.0)
  np.testing.assert_allclose(
      metrics["skip_spikes/grad_norm_mean"],
      np.mean([optax.tree.norm(_grads(t)) for t in range(4)]), rtol=1e-5)
  assert float(metrics["skip_spikes/grad_norm"]) == pytest.approx(
      float(optax.tree.norm(_grads(3))), rel=1e-6)
  assert metrics["zclip/spike_count"].dtype == jnp.int32
  assert metrics["zclip/was_clipped"].dtype == jnp.bool_


def test_duplicate_prefix_gets_suffix():
  tx = optax.chain(stablejax.zclip(warmup_steps=1), stablejax.zclip(),
                   stablejax.zclip())
  state = _steps(tx, n=2)
  metrics = stablejax.stability_metrics(state)
  assert set(metrics) == (_keys("zclip", ZCLIP) | _keys("zclip_1", ZCLIP)
                          | _keys("zclip_2", ZCLIP))
  assert float(metrics["zclip_1/grad_norm"]) == float(state[1].grad_norm)


def test_hybrid_clip_state_found():
  state = _steps(optax.chain(stablejax.hybrid_clip(), optax.sgd(0.1)), n=2)
  assert isinstance(state[0], stablejax.HybridClipState)
  metrics = stablejax.stability_metrics(state)
  assert set(metrics) == _keys("zclip", ZCLIP) | _keys("adagc", ADAGC)


def test_inside_multisteps():
  inner = stablejax.skip_nonfinite(optax.chain(
      stablejax.zclip(warmup_steps=1), optax.sgd(0.1)))
  tx = optax.MultiSteps(inner, every_k_schedule=2)
  params = _toy_params()
  state = tx.init(params)
  update = jax.jit(tx.update)
  _, state = update(_grads(0), state, params, loss=jnp.float32(1.0))
  # Mid-accumulation: the inner state has not moved yet.
  assert float(stablejax.stability_metrics(state)["zclip/grad_norm"]) == 0.0
  _, state = update(_grads(1), state, params, loss=jnp.float32(1.0))
  metrics = jax.jit(stablejax.stability_metrics)(state)
  assert set(metrics) == _keys("zclip", ZCLIP) | _keys("skip_nonfinite", SKIP)
  mean_grads = jax.tree.map(lambda a, b: (a + b) / 2, _grads(0), _grads(1))
  np.testing.assert_allclose(metrics["zclip/grad_norm"],
                             optax.tree.norm(mean_grads), rtol=1e-5)


def test_inside_inject_hyperparams():
  tx = optax.chain(
      optax.inject_hyperparams(stablejax.zclip)(alpha=0.9, warmup_steps=2),
      optax.inject_hyperparams(stablejax.adagc)(beta=0.9),
      optax.inject_hyperparams(optax.sgd)(learning_rate=0.1))
  state = _steps(tx)
  metrics = stablejax.stability_metrics(state)
  assert set(metrics) == _keys("zclip", ZCLIP) | _keys("adagc", ADAGC)
  _check_scalars(metrics)


def test_inside_masked_and_partition():
  params = _toy_params()
  masked = optax.chain(
      optax.masked(stablejax.adagc(warmup_steps=1), {"w": True, "b": False}),
      optax.sgd(0.1))
  part = optax.partition(
      {"clip": optax.chain(stablejax.zclip(warmup_steps=1), optax.sgd(0.1)),
       "plain": optax.sgd(0.1)},
      {"w": "clip", "b": "plain"})
  # Either way the clipping transform sees "w" alone: its metrics, and the norm of w.
  for tx, prefix, fields in ((masked, "adagc", ADAGC), (part, "zclip", ZCLIP)):
    state = tx.init(params)
    _, state = jax.jit(tx.update)(_grads(0), state, params)
    metrics = stablejax.stability_metrics(state)
    assert set(metrics) == _keys(prefix, fields)
    np.testing.assert_allclose(metrics[f"{prefix}/grad_norm"],
                               optax.tree.norm(_grads(0)["w"]), rtol=1e-6)


class _CustomState(NamedTuple):
  hits: jax.Array
  inner_state: object


def test_register_custom_state_and_nesting():
  def metrics_fn(s):
    return {"hits": s.hits, "rate": s.hits.astype(jnp.float32) / 10}

  stablejax.register_state_metrics(_CustomState, "custom", metrics_fn)
  inner = optax.chain(stablejax.zclip(), optax.sgd(0.1))
  state = _CustomState(jnp.int32(3), inner.init(_toy_params()))
  wrapped = optax.MultiSteps(optax.sgd(0.1), 2).init(_toy_params())
  metrics = jax.jit(stablejax.stability_metrics)((wrapped, {"x": state}))
  assert set(metrics) == {"custom/hits", "custom/rate"} | _keys("zclip", ZCLIP)
  assert int(metrics["custom/hits"]) == 3
  np.testing.assert_allclose(metrics["custom/rate"], 0.3)


def test_empty_and_plain_states():
  assert stablejax.stability_metrics(optax.adam(1e-3).init(_toy_params())) == {}
  assert stablejax.stability_metrics(None) == {}


@pytest.mark.parametrize("args,match", [
    (("notatype", "x", lambda s: {}), "state_type"),
    ((_CustomState, "", lambda s: {}), "prefix"),
    ((_CustomState, "x/", lambda s: {}), "prefix"),
    ((_CustomState, "x", None), "fn"),
])
def test_register_validation(args, match):
  with pytest.raises(ValueError, match=match):
    stablejax.register_state_metrics(*args)


def test_zclip_counters_and_means_against_hand_counts():
  # Two warmup steps of norm 5 are clipped to the 1.0 ceiling (clip_count 2, no spike); a quiet
  # step of norm 0.5 after them is neither clipped nor a spike.
  tx = stablejax.zclip(warmup_steps=2, max_grad_norm=1.0)
  state = tx.init({"w": jnp.zeros(2)})
  for g in ([3.0, 4.0], [3.0, 4.0], [0.3, 0.4]):
    _, state = tx.update({"w": jnp.array(g)}, state)
  m = stablejax.stability_metrics(state)
  assert int(m["zclip/clip_count"]) == 2 and int(m["zclip/spike_count"]) == 0
  assert float(m["zclip/grad_norm"]) == pytest.approx(0.5)


def test_skip_spikes_grad_norm_mean_without_a_loss():
  tx = stablejax.skip_spikes(optax.sgd(0.1), window=4, min_history=2, watch=("grad_norm",))
  params = {"w": jnp.zeros(2)}
  state = tx.init(params)
  for g in ([3.0, 0.0], [0.0, 4.0]):
    _, state = tx.update({"w": jnp.array(g)}, state, params)
  m = stablejax.stability_metrics(state)
  assert float(m["skip_spikes/grad_norm_mean"]) == pytest.approx(3.5)
  assert float(m["skip_spikes/loss_mean"]) == 0.0  # empty window


def test_a_subclass_of_a_registered_state_is_found():
  class MyZClipState(stablejax.ZClipState):
    pass

  state = stablejax.zclip().init({"w": jnp.zeros(2)})
  metrics = stablejax.stability_metrics((MyZClipState(*state),))
  assert set(metrics) == _keys("zclip", ZCLIP)


def test_a_registered_rate_reaches_the_monitor_and_the_score():
  # A state registered with a rate (budget 0.1): the monitor keeps it over its window, the
  # score counts it and the troubleshooting table names it; forgotten again, it is gone.
  from typing import NamedTuple

  from stablejax.transforms.metrics import Rate, register_state_metrics, unregister_state_metrics

  class CountState(NamedTuple):
    hits: jax.Array
    hit: jax.Array

  register_state_metrics(CountState, "counted", lambda s: {"hits": s.hits, "hit": s.hit},
                         rates=(Rate("counted_rate", flag="hit", counter="hits", budget=0.1,
                                     advice="counted rate {value:.3g} > 0.1: look"),))
  try:
    monitor = stablejax.StabilityMonitor(window=100)
    monitor.update(0, {"counted/hits": 0})
    monitor.update(10, {"counted/hits": 1})   # one event in 10 steps: the budget exactly
    assert monitor.rates()["counted_rate"] == pytest.approx(0.1)
    assert monitor.score() == pytest.approx(0.8)
    monitor.update(20, {"counted/hits": 4})   # 4 events in 20 steps
    assert "counted rate 0.2 > 0.1: look" in monitor.advice()
  finally:
    unregister_state_metrics(CountState)
  assert "counted_rate" not in stablejax.StabilityMonitor().rates()
