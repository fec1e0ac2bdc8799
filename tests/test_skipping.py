"""skip_nonfinite / skip_spikes: exact no-op skips, counters, rolling-window rules."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import stablejax


def _inner():
  """A realistic inner chain whose state would be poisoned by a bad step."""
  return optax.chain(
      stablejax.hybrid_clip(zclip_warmup_steps=3, adagc_warmup_steps=3),
      optax.adamw(1e-2, weight_decay=0.1))


def _toy_params():
  return {"w": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4),
          "b": jnp.zeros(4, jnp.float32)}


def _grads(t):
  rng = np.random.default_rng(t)
  return {"w": jnp.asarray(rng.normal(0, 0.3, (3, 4)), jnp.float32),
          "b": jnp.asarray(rng.normal(0, 0.1, 4), jnp.float32)}


def _loss(t):
  return jnp.float32(3.0 - 0.01 * t + 0.01 * np.sin(t))


_JITTED = {}


def _train(tx, steps, key=None):
  """Runs (grads, loss) steps through a jitted update; returns params, state.

  ``key`` reuses one compiled update for transforms built the same way.
  """
  params = _toy_params()
  state = tx.init(params)
  if key is None:
    update = jax.jit(tx.update)
  else:
    update = _JITTED.setdefault(key, jax.jit(tx.update))
  for grads, loss in steps:
    updates, state = update(grads, state, params, loss=loss)
    params = optax.apply_updates(params, updates)
  return params, state


def _assert_trees_identical(a, b):
  leaves_a, tree_a = jax.tree.flatten(a)
  leaves_b, tree_b = jax.tree.flatten(b)
  assert tree_a == tree_b
  for x, y in zip(leaves_a, leaves_b):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _nan_grads(t):
  g = _grads(t)
  return {"w": g["w"].at[1, 2].set(jnp.nan), "b": g["b"]}


@pytest.mark.parametrize("bad", ["nan_grads", "inf_grads", "inf_loss",
                                 "nan_loss"])
def test_skip_nonfinite_bad_step_is_exact_noop(bad):
  good = [(_grads(t), _loss(t)) for t in range(12)]
  if bad == "nan_grads":
    bad_step = (_nan_grads(99), _loss(6))
  elif bad == "inf_grads":
    bad_step = ({"w": _grads(99)["w"], "b": jnp.full(4, jnp.inf)}, _loss(6))
  elif bad == "inf_loss":
    bad_step = (_grads(99), jnp.float32(jnp.inf))
  else:
    bad_step = (_grads(99), jnp.float32(jnp.nan))
  with_bad = good[:6] + [bad_step] + good[6:]
  tx = stablejax.skip_nonfinite(_inner(), max_consecutive=4)
  p_ref, s_ref = _train(tx, good, key="nonfinite")
  p_bad, s_bad = _train(tx, with_bad, key="nonfinite")
  _assert_trees_identical(p_bad, p_ref)
  _assert_trees_identical(s_bad.inner_state, s_ref.inner_state)
  assert int(s_bad.total_skips) == 1 and int(s_ref.total_skips) == 0
  assert int(s_bad.consecutive_skips) == 0 and not bool(s_bad.skipped)


def test_skip_nonfinite_step_outputs_zero_updates_same_dtype():
  tx = stablejax.skip_nonfinite(optax.adam(1e-3))
  params = {"w": jnp.ones((2, 2), jnp.bfloat16), "b": jnp.ones(2)}
  state = tx.init(params)
  grads = {"w": jnp.full((2, 2), jnp.nan, jnp.bfloat16), "b": jnp.ones(2)}
  updates, new_state = jax.jit(tx.update)(grads, state, params)
  assert updates["w"].dtype == jnp.bfloat16 and updates["b"].dtype == jnp.float32
  assert not np.any(np.asarray(updates["w"], np.float32))
  assert not np.any(np.asarray(updates["b"]))
  assert bool(new_state.skipped)
  _assert_trees_identical(new_state.inner_state, state.inner_state)


def test_fifty_nan_steps_in_a_row_keep_params_finite_and_raise_rollback():
  tx = stablejax.skip_nonfinite(_inner(), max_consecutive=16)
  params = _toy_params()
  state = tx.init(params)
  update = jax.jit(tx.update)
  for t in range(5):
    updates, state = update(_grads(t), state, params, loss=_loss(t))
    params = optax.apply_updates(params, updates)
  before = jax.tree.map(np.asarray, params)
  for i in range(50):
    updates, state = update(_nan_grads(i), state, params, loss=_loss(i))
    params = optax.apply_updates(params, updates)
    assert int(state.consecutive_skips) == i + 1
    assert bool(state.needs_rollback) == (i + 1 >= 16)
  assert all(np.all(np.isfinite(p)) for p in jax.tree.leaves(params))
  _assert_trees_identical(params, before)
  assert int(state.total_skips) == 50
  metrics = stablejax.stability_metrics(state)
  assert bool(metrics["skip_nonfinite/needs_rollback"])
  # One good step resets the run of skips.
  updates, state = update(_grads(7), state, params, loss=_loss(7))
  assert not bool(state.needs_rollback) and int(state.consecutive_skips) == 0
  assert int(state.total_skips) == 50


@pytest.mark.parametrize("wrapper", ["nonfinite", "spikes"])
def test_rollback_request_is_latched_between_reads(wrapper):
  """A burst of max_consecutive skips that ends before the next read is still seen.

  The loop reads the state every 10 steps; the level ``needs_rollback`` is
  already back to False by then, the request counter is not. A longer burst,
  or two steps short of the limit, count once and not at all.
  """
  if wrapper == "nonfinite":
    tx = stablejax.skip_nonfinite(optax.sgd(0.1), max_consecutive=3)
  else:
    tx = stablejax.skip_spikes(optax.sgd(0.1), window=8, min_history=4,
                               watch=("grad_norm",), max_consecutive=3)
  params = {"w": jnp.zeros(4)}
  good = {"w": jnp.ones(4)}
  bad = {"w": jnp.full(4, jnp.nan)}
  # steps 4-6: a burst of 3 (one request); 12-13: 2 skips (none);
  # 20-26: a burst of 7 (one request, not five)
  bad_steps = {4, 5, 6, 12, 13, *range(20, 27)}
  update = jax.jit(tx.update)
  state = tx.init(params)
  seen = []
  for t in range(30):
    _, state = update(bad if t in bad_steps else good, state, params)
    if t % 10 == 9:  # a read every 10 steps, as a trainer logs
      seen.append((bool(state.needs_rollback), int(state.rollback_requests)))
  assert seen == [(False, 1), (False, 1), (False, 2)]
  inner_only = stablejax.skip_nonfinite(optax.sgd(0.1))  # no limit: never
  s = inner_only.init(params)
  for _ in range(5):
    _, s = inner_only.update(bad, s, params)
  assert int(s.rollback_requests) == 0
  metrics = stablejax.stability_metrics(state)
  prefix = "skip_nonfinite" if wrapper == "nonfinite" else "skip_spikes"
  assert int(metrics[f"{prefix}/rollback_requests"]) == 2


def _nan_from_finite():
  """An inner transform that turns finite gradients into a NaN update."""

  def update_fn(updates, state, params=None):
    del params
    return jax.tree.map(lambda u: u / jnp.zeros_like(u) * 0.0, updates), state

  return optax.GradientTransformation(lambda p: optax.EmptyState(), update_fn)


def test_nonfinite_inner_update_is_skipped():
  tx = stablejax.skip_nonfinite(optax.chain(optax.adam(1e-3),
                                            _nan_from_finite()))
  params = {"w": jnp.ones(3)}
  state = tx.init(params)
  updates, new_state = tx.update({"w": jnp.ones(3)}, state, params,
                                 loss=jnp.float32(1.0))
  assert bool(new_state.skipped)
  np.testing.assert_array_equal(updates["w"], np.zeros(3))
  _assert_trees_identical(new_state.inner_state, state.inner_state)


def _recording_extra_args():
  """ExtraArgs inner that scales updates by the `factor=` extra argument."""

  def update_fn(updates, state, params=None, *, factor=1.0, **extra_args):
    del params, extra_args
    return jax.tree.map(lambda u: u * factor, updates), state

  return optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(),
                                               update_fn)


@pytest.mark.parametrize("wrap", ["nonfinite", "spikes"])
def test_extra_args_are_forwarded_and_plain_inner_ignores_them(wrap):
  def make(inner):
    if wrap == "nonfinite":
      return stablejax.skip_nonfinite(inner)
    return stablejax.skip_spikes(inner, window=4, min_history=2)

  params = {"w": jnp.ones(2)}
  g = {"w": jnp.full(2, 2.0)}
  tx = make(_recording_extra_args())
  updates, _ = tx.update(g, tx.init(params), params, loss=jnp.float32(1.0),
                         factor=3.0)
  np.testing.assert_allclose(updates["w"], [6.0, 6.0])
  # A plain GradientTransformation (and a chain mixing both) just works.
  tx = make(optax.chain(optax.scale(-1.0), _recording_extra_args()))
  updates, _ = tx.update(g, tx.init(params), params, loss=jnp.float32(1.0),
                         factor=0.5)
  np.testing.assert_allclose(updates["w"], [-1.0, -1.0])
  assert isinstance(tx, optax.GradientTransformationExtraArgs)


def _spiky_steps(kind, n=40, at=30):
  steps = [(_grads(t), _loss(t)) for t in range(n)]
  if kind == "grad_spike":
    spike = (jax.tree.map(lambda g: g * 1000.0, _grads(99)), _loss(at))
  else:
    spike = (_grads(99), jnp.float32(50.0))
  return steps, steps[:at] + [spike] + steps[at:]


@pytest.mark.parametrize("kind", ["grad_spike", "loss_spike"])
def test_skip_spikes_bad_step_is_exact_noop(kind):
  good, with_bad = _spiky_steps(kind)
  tx = stablejax.skip_spikes(_inner(), window=16, min_history=8)
  p_ref, s_ref = _train(tx, good, key="spikes")
  p_bad, s_bad = _train(tx, with_bad, key="spikes")
  _assert_trees_identical(p_bad, p_ref)
  _assert_trees_identical(s_bad.inner_state, s_ref.inner_state)
  assert int(s_bad.total_skips) == 1 and int(s_ref.total_skips) == 0


def test_skip_spikes_inside_skip_nonfinite_handles_both():
  good, with_bad = _spiky_steps("loss_spike")
  with_bad = with_bad[:10] + [(_nan_grads(3), _loss(3))] + with_bad[10:]
  tx = stablejax.skip_nonfinite(
      stablejax.skip_spikes(_inner(), window=16, min_history=8))
  p_ref, s_ref = _train(tx, good)
  p_bad, s_bad = _train(tx, with_bad)
  _assert_trees_identical(p_bad, p_ref)
  _assert_trees_identical(s_bad.inner_state.inner_state,
                          s_ref.inner_state.inner_state)
  metrics = stablejax.stability_metrics(s_bad)
  assert int(metrics["skip_nonfinite/total_skips"]) == 1
  assert int(metrics["skip_spikes/total_skips"]) == 1


def reference_skip_spikes(losses, norms, window, min_history, sigma, factor,
                          watch, max_consecutive):
  """Plain-Python rolling-window spike rule (float64)."""
  hist = {"loss": collections.deque(maxlen=window),
          "grad_norm": collections.deque(maxlen=window)}
  consecutive, out = 0, []
  for loss, norm in zip(losses, norms):
    skip = False
    for name, value in (("loss", loss), ("grad_norm", norm)):
      if name not in watch:
        continue
      h = hist[name]
      active = len(h) >= min_history
      threshold = np.inf
      if active:
        mean, std = np.mean(h), np.std(h)
        if sigma is not None:
          threshold = min(threshold, mean + sigma * std)
        if factor is not None:
          threshold = min(threshold, factor * mean)
      if not np.isfinite(value):
        skip = True
        continue
      if value > threshold:
        skip = True
      h.append(min(value, threshold))
    consecutive = consecutive + 1 if skip else 0
    out.append(dict(
        skipped=skip, consecutive=consecutive,
        rollback=max_consecutive is not None and consecutive >= max_consecutive,
        loss_mean=np.mean(hist["loss"]) if hist["loss"] else 0.0,
        grad_norm_mean=np.mean(hist["grad_norm"]) if hist["grad_norm"] else 0.0))
  return out


@pytest.mark.parametrize("sigma,factor,watch", [
    (6.0, None, ("loss", "grad_norm")),
    (None, 3.0, ("loss", "grad_norm")),
    (4.0, 2.5, ("loss", "grad_norm")),
    (5.0, None, ("grad_norm",)),
    (None, 1.5, ("loss",)),
])
def test_skip_spikes_matches_reference(sigma, factor, watch):
  steps, window, min_history = 300, 32, 16
  rng = np.random.default_rng(11)
  losses = 3.0 - np.arange(steps) / 300 + 0.02 * rng.standard_normal(steps)
  norms = 1.0 + 0.1 * rng.standard_normal(steps)
  losses[[5, 40, 100, 101, 102, 103, 220]] *= 4.0   # early one: inactive
  norms[[8, 70, 150, 151, 152, 153, 260]] *= 12.0
  losses[[60, 61]] = np.nan
  norms[[90]] = np.inf
  norms[200:] *= 2.0  # a lasting change of scale
  losses, norms = losses.astype(np.float32), norms.astype(np.float32)
  direction = np.ones(4, np.float32) / 2.0  # unit norm
  grads = {"w": norms[:, None] * direction[None, :]}

  tx = stablejax.skip_spikes(optax.sgd(1.0), window=window,
                             min_history=min_history, sigma=sigma,
                             factor=factor, watch=watch, max_consecutive=3)
  params = {"w": jnp.zeros(4)}

  def body(state, x):
    g, loss = x
    updates, state = tx.update(g, state, params, loss=loss)
    return state, (updates, state, stablejax.stability_metrics(state))

  _, (updates, states, metrics) = jax.jit(
      lambda s, x: jax.lax.scan(body, s, x))(tx.init(params), (grads, losses))
  ref = reference_skip_spikes(losses.astype(np.float64),
                              np.sqrt((grads["w"].astype(np.float64)**2).sum(1)),
                              window, min_history, sigma, factor, watch, 3)
  skipped = np.array([r["skipped"] for r in ref])
  np.testing.assert_array_equal(states.skipped, skipped)
  assert 5 <= skipped.sum() < 60
  np.testing.assert_array_equal(states.consecutive_skips,
                                [r["consecutive"] for r in ref])
  np.testing.assert_array_equal(states.needs_rollback,
                                [r["rollback"] for r in ref])
  np.testing.assert_array_equal(states.total_skips, np.cumsum(skipped))
  np.testing.assert_allclose(metrics["skip_spikes/loss_mean"],
                             [r["loss_mean"] for r in ref], rtol=1e-5)
  np.testing.assert_allclose(metrics["skip_spikes/grad_norm_mean"],
                             [r["grad_norm_mean"] for r in ref], rtol=1e-5)
  # Skipped steps apply nothing; the others are plain SGD.
  expected = np.where(skipped[:, None], 0.0, -grads["w"])
  np.testing.assert_array_equal(updates["w"], expected)
  # Windows never hold a non-finite value; the scale change was absorbed.
  assert np.all(np.isfinite(states.loss_history))
  assert np.all(np.isfinite(states.grad_norm_history))
  if "grad_norm" in watch and sigma is not None:
    assert skipped[200:215].any()
  assert not skipped[265:].any()


def test_skip_spikes_inactive_before_min_history():
  tx = stablejax.skip_spikes(optax.sgd(1.0), window=8, min_history=4,
                             watch=("loss",))
  params = {"w": jnp.zeros(2)}
  state = tx.init(params)
  for loss in (1.0, 1000.0, 1.0, 1.0):  # a spike before the window is ready
    _, state = tx.update({"w": jnp.ones(2)}, state, params,
                         loss=jnp.float32(loss))
    assert not bool(state.skipped)
  _, state = tx.update({"w": jnp.ones(2)}, state, params,
                       loss=jnp.float32(5000.0))
  assert bool(state.skipped)


def test_skip_spikes_requires_loss_when_watching_it():
  params = {"w": jnp.zeros(2)}
  tx = stablejax.skip_spikes(optax.sgd(1.0), watch=("loss", "grad_norm"))
  with pytest.raises(ValueError, match="loss="):
    tx.update({"w": jnp.ones(2)}, tx.init(params), params)
  tx = stablejax.skip_spikes(optax.sgd(1.0), watch=("grad_norm",))
  tx.update({"w": jnp.ones(2)}, tx.init(params), params)  # no loss needed


def test_skip_spikes_default_watches_the_loss_only_when_given():
  """watch=None: without loss= (TrainState.apply_gradients) the gradient norm alone decides and
  the loss window stays empty; with loss= a loss spike under a normal gradient is skipped."""
  params = {"w": jnp.zeros(2)}
  tx = stablejax.skip_spikes(optax.sgd(1.0), window=8, min_history=4)
  step = jax.jit(tx.update)
  state = tx.init(params)
  for scale in (1.0, 1.1, 0.9, 1.0):
    _, state = step({"w": jnp.full(2, scale)}, state, params)
  updates, state = step({"w": jnp.full(2, 1.05)}, state, params)
  assert not bool(state.skipped) and int(state.loss_count) == 0
  np.testing.assert_allclose(updates["w"], -1.05)
  _, state = step({"w": jnp.full(2, 500.0)}, state, params)
  assert bool(state.skipped) and int(state.grad_norm_count) == 6
  state = tx.init(params)
  for loss in (2.0, 2.1, 1.9, 2.0):
    _, state = step({"w": jnp.ones(2)}, state, params, loss=jnp.float32(loss))
  updates, state = step({"w": jnp.ones(2)}, state, params, loss=jnp.float32(40.0))
  assert bool(state.skipped) and int(state.loss_count) == 5
  np.testing.assert_array_equal(updates["w"], 0.0)


@pytest.mark.parametrize("kwargs,match", [
    (dict(window=0), "window"),
    (dict(window=8.0), "window"),
    (dict(window=8, min_history=9), "min_history"),
    (dict(sigma=None, factor=None), "sigma and factor"),
    (dict(sigma=-1.0), "sigma"),
    (dict(factor=0.0), "factor"),
    (dict(watch=("accuracy",)), "watch"),
    (dict(watch=()), "watch"),
    (dict(max_consecutive=0), "max_consecutive"),
    (dict(statistics="maxtext"), "statistics"),
    (dict(window=16, statistics="olmo_core"), "olmo_core"),
])
def test_skip_spikes_bad_arguments_raise(kwargs, match):
  with pytest.raises(ValueError, match=match):
    stablejax.skip_spikes(optax.sgd(1.0), **kwargs)


def test_skip_nonfinite_bad_arguments_raise():
  with pytest.raises(ValueError, match="max_consecutive"):
    stablejax.skip_nonfinite(optax.sgd(1.0), max_consecutive=0)


def reference_olmo_core(losses, norms, window=128, sigma=6.0):
  """OLMo-core's SkipStepOptimizer.get_step_factor rule, re-derived in float64.

  OLMo-core keeps the last ``window + 1`` values including the current one, and
  once it holds ``max(20, window // 2)`` of them judges the current value against
  the previous ones: skip when ``value - mean > sigma * std`` with torch's default
  unbiased std, for the loss or the gradient norm. Every value enters the window
  raw, skipped or not. One deliberate difference: a non-finite value skips the
  step and stays out of the window (in OLMo-core it enters it, the mean becomes
  NaN and the next ``window + 1`` steps are all skipped).
  Returns (skipped, margins): margins is ``|value - threshold| / threshold``
  per judged value, to check that float32 cannot flip a decision.
  """
  hist = {"loss": [], "grad_norm": []}
  skipped, margins = [], []
  for loss, norm in zip(losses, norms):
    skip = False
    for name, value in (("loss", loss), ("grad_norm", norm)):
      h = hist[name]
      if not np.isfinite(value):
        skip = True
        continue
      h.append(value)
      del h[:-(window + 1)]
      if len(h) >= max(20, window // 2):
        previous = np.array(h[:-1])
        threshold = previous.mean() + sigma * previous.std(ddof=1)
        margins.append(abs(value - threshold) / threshold)
        skip = skip or value - previous.mean() > sigma * previous.std(ddof=1)
    skipped.append(skip)
  return np.array(skipped), np.array(margins)


def _olmo_sequence(steps=400):
  rng = np.random.default_rng(5)
  losses = 3.0 - np.arange(steps) / 4000 + 0.02 * rng.standard_normal(steps)
  norms = 1.0 + 0.05 * rng.standard_normal(steps)
  losses[63] += 0.2    # 63 earlier values: OLMo-core already judges this step
  losses[150] += 2.0   # a large spike ...
  losses[160] += 0.3   # ... then a moderate one, hidden by the first in a raw window
  norms[200] *= 3.0
  losses[300] = np.nan
  norms[330:] *= 1.6   # a lasting change of scale
  return losses.astype(np.float32), norms.astype(np.float32)


def _skip_decisions(tx, losses, norms):
  params = {"w": jnp.zeros(1)}

  def body(state, x):
    norm, loss = x
    _, state = tx.update({"w": norm[None]}, state, params, loss=loss)
    return state, state.skipped

  return np.asarray(jax.jit(lambda s, x: jax.lax.scan(body, s, x)[1])(
      tx.init(params), (jnp.asarray(norms), jnp.asarray(losses))))


def test_skip_spikes_olmo_core_statistics_match_olmo_core_rule():
  losses, norms = _olmo_sequence()
  ref, margins = reference_olmo_core(losses.astype(np.float64), norms.astype(np.float64))
  assert margins.min() > 1e-4   # no decision within float32 rounding of its threshold
  olmo = stablejax.skip_spikes(optax.sgd(1.0), statistics="olmo_core")  # window 128, sigma 6
  np.testing.assert_array_equal(_skip_decisions(olmo, losses, norms), ref)
  assert ref[[63, 150, 200, 300]].all() and not ref[160]
  # The default (winsorised) rule differs exactly where the README says it does.
  default = _skip_decisions(stablejax.skip_spikes(optax.sgd(1.0)), losses, norms)
  assert not default[63]   # it needs 64 earlier values
  assert default[160]      # the spike at 150 entered its window clipped, not raw


def test_skip_spikes_factor_rule_alone():
  # Seed 004's rule: skip a batch whose gradient norm is more than 10x the average.
  tx = stablejax.skip_spikes(optax.sgd(1.0), window=16, min_history=4, sigma=None, factor=10.0,
                             watch=("grad_norm",))
  history = [1.0, 1.1, 0.9, 1.0, 1.05]
  for last, skip in ((5.0, False), (11.0, True)):   # 5.0 is ~60 sigma but only 5x the mean
    norms = np.array(history + [last], np.float32)
    skipped = _skip_decisions(tx, np.zeros_like(norms), norms)
    np.testing.assert_array_equal(skipped, [False] * 5 + [skip])


def test_skip_spikes_olmo_core_std_is_unbiased():
  # 19 earlier values (OLMo-core judges from there on at window 32): a value between the
  # thresholds of the unbiased (torch's default) and the population std tells the two apart.
  history = np.array([1.0, 1.2] * 9 + [1.1], np.float64)
  mean, biased, unbiased = history.mean(), history.std(ddof=0), history.std(ddof=1)
  tx = stablejax.skip_spikes(optax.sgd(1.0), window=32, sigma=6.0, watch=("grad_norm",),
                             statistics="olmo_core")
  for last, skip in ((mean + 3.0 * (biased + unbiased), False),  # above the biased threshold
                     (mean + 6.0 * unbiased * 1.01, True)):
    norms = np.array(list(history) + [last], np.float32)
    skipped = _skip_decisions(tx, np.zeros_like(norms), norms)
    np.testing.assert_array_equal(skipped, [False] * 19 + [skip])


def _loss_steps(tx, losses, grads=None):
  """Feeds losses (and ones as gradients) one step at a time; returns the state after each."""
  params = {"w": jnp.ones(2)}
  state = tx.init(params)
  states = []
  for i, loss in enumerate(losses):
    g = {"w": jnp.ones(2)} if grads is None else grads[i]
    _, state = tx.update(g, state, params, loss=jnp.asarray(loss, jnp.float32))
    states.append(state)
  return states


@pytest.mark.parametrize("held,skipped", [(3, False), (4, True)])
def test_skip_spikes_default_min_history_is_half_the_window(held, skipped):
  # Documented: skipping starts after window // 2 values, 4 at window 8.
  tx = stablejax.skip_spikes(optax.sgd(0.1), window=8, sigma=None, factor=2.0, watch=("loss",))
  states = _loss_steps(tx, [1.0] * held + [100.0])
  assert [bool(s.skipped) for s in states] == [False] * held + [skipped]


def test_skip_spikes_averages_a_non_scalar_loss():
  tx = stablejax.skip_spikes(optax.sgd(0.1), window=4, min_history=2, watch=("loss",))
  (state,) = _loss_steps(tx, [[1.0, 3.0, 8.0]])
  assert float(state.loss_history[0]) == 4.0 and int(state.loss_count) == 1


def test_no_rollback_flag_without_max_consecutive():
  for tx in (stablejax.skip_nonfinite(optax.sgd(0.1), max_consecutive=None),
             stablejax.skip_spikes(optax.sgd(0.1), window=4, min_history=1, watch=("loss",),
                                   max_consecutive=None)):
    states = _loss_steps(tx, [1.0] + [jnp.nan] * 5)
    assert [bool(s.skipped) for s in states] == [False] + [True] * 5
    assert int(states[-1].consecutive_skips) == 5
    assert not any(bool(s.needs_rollback) for s in states)
    assert int(states[-1].rollback_requests) == 0


def test_skip_nonfinite_looks_at_the_gradients_themselves():
  # An inner transform that turns a NaN gradient into a finite update must not hide it.
  tx = stablejax.skip_nonfinite(optax.set_to_zero())
  (state,) = _loss_steps(tx, [1.0], grads=[{"w": jnp.array([jnp.nan, 1.0])}])
  assert bool(state.skipped) and int(state.total_skips) == 1
