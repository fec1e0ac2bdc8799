"""outlier_safe_muon: parity with optax.contrib.muon, convergence, outlier clamp, NS fallback,
metrics."""

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import stablejax
from stablejax.muon import direction as direction_mod
from stablejax.muon import outliers as outliers_mod
from stablejax.muon import newton_schulz as ns_mod

STANDARD = (3.4445, -4.7750, 2.0315)
CONTRACT_KEYS = {
    "muon/outlier_rate", "muon/ns_instability_rate", "muon/fallback_rate", "muon/outlier_count",
    "muon/fallback_count", "muon/nonfinite_count", "muon/nonfinite_rate",
    "muon/update_rms/muon", "muon/update_rms/adam",
    "muon/update_rms/embedding", "muon/update_rms/head",
}


def _normal(key, shape, scale=1.0):
  # numpy draws: jax.random.normal compiles a program for each new shape
  return jnp.asarray((scale * np.random.default_rng(key).standard_normal(shape)).astype(np.float32))


def _np_ns(x, steps=5, eps=1e-8):
  x = np.asarray(x, np.float64)
  tall = x.shape[0] > x.shape[1]
  if tall:
    x = x.T
  x = x / (np.linalg.norm(x) + eps)
  a, b, c = STANDARD
  for _ in range(steps):
    gram = x @ x.T
    x = a * x + (b * gram + c * gram @ gram) @ x
  return x.T if tall else x


# The clamp jitted once for the module (method and threshold static): eagerly, each of its
# operations compiles on its own for every new shape.
_clamp = jax.jit(outliers_mod.clamp_outliers, static_argnums=(1, 2))


def _first_step_nesterov_input(g, beta=0.95):
  # Step 1 of optax's bias-corrected Nesterov momentum: mu = (1 - b) g, count = 1.
  mu = (1 - beta) * g
  return beta * mu / (1 - beta**2) + (1 - beta) * g / (1 - beta)


@pytest.mark.filterwarnings("ignore:outlier_safe_muon")  # "stack" is an unrecognised 3-axis leaf
@pytest.mark.parametrize("consistent_rms", [0.2, None])
def test_muon_branch_matches_optax_contrib_muon(consistent_rms):
  params = {"w1": _normal(0, (16, 32)), "w2": _normal(1, (24, 16)), "stack": _normal(2, (3, 8, 12))}
  lr = optax.linear_schedule(0.02, 0.01, 10)
  ours = stablejax.outlier_safe_muon(
      lr, weight_decay=0.1, consistent_rms=consistent_rms, adam_learning_rate=1e-3,
      outlier_method=None, ns_backend="xla")
  dims = {"w1": optax.contrib.MuonDimensionNumbers(), "w2": optax.contrib.MuonDimensionNumbers(),
          "stack": optax.contrib.MuonDimensionNumbers(reduction_axis=1, output_axis=2)}
  ref = optax.contrib.muon(lr, ns_coeffs=STANDARD, ns_steps=5, beta=0.95, eps=1e-8,
                           weight_decay=0.1, nesterov=True, consistent_rms=consistent_rms,
                           muon_weight_dimension_numbers=dims)
  s_ours, s_ref = ours.init(params), ref.init(params)
  p_ours = p_ref = params
  update_ours, update_ref = jax.jit(ours.update), jax.jit(ref.update)
  for step in range(3):
    grads = jax.tree.map(lambda p, k=step: _normal(10 + k, p.shape), params)
    u_ours, s_ours = update_ours(grads, s_ours, p_ours)
    u_ref, s_ref = update_ref(grads, s_ref, p_ref)
    for name in params:
      np.testing.assert_allclose(u_ours[name], u_ref[name], rtol=2e-4, atol=1e-6)
    p_ours = optax.apply_updates(p_ours, u_ours)
    p_ref = optax.apply_updates(p_ref, u_ref)


def test_converges_on_regression():
  x = _normal(0, (256, 16))
  w_true = _normal(1, (16, 8))
  y = x @ w_true + 0.5
  params = {"dense": {"kernel": jnp.zeros((16, 8)), "bias": jnp.zeros(8)}}

  def loss_fn(p):
    return jnp.mean((x @ p["dense"]["kernel"] + p["dense"]["bias"] - y) ** 2)

  tx = stablejax.outlier_safe_muon(
      optax.cosine_decay_schedule(0.05, 300), consistent_rms=None,
      adam_learning_rate=optax.cosine_decay_schedule(0.05, 300))
  state = tx.init(params)

  @jax.jit
  def step(p, s):
    loss, g = jax.value_and_grad(loss_fn)(p)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s, loss

  first = None
  for _ in range(300):
    params, state, loss = step(params, state)
    first = loss if first is None else first
  final = loss_fn(params)
  assert final < 1e-3 * first, (first, final)
  metrics = stablejax.stability_metrics(state)
  assert metrics["muon/fallback_count"] == 0


def _single_matrix_tx(**kw):
  kw.setdefault("ns_backend", "xla")
  return stablejax.outlier_safe_muon(0.02, **kw)


@pytest.mark.parametrize("method", ["zscore", "iqr"])
def test_planted_outlier_is_clamped_and_counted(method):
  g = np.array(_normal(3, (64, 64)))
  g[5, 7] = 1e4 * np.abs(g).max()
  params = {"w": jnp.zeros((64, 64))}
  tx = _single_matrix_tx(outlier_method=method, outlier_threshold=5.0)
  updates, state = jax.jit(tx.update)({"w": jnp.asarray(g)}, tx.init(params), params)
  # numpy re-derivation: clamp the NS input, NS, Moonlight scale, -lr.
  m = _first_step_nesterov_input(g.astype(np.float64))
  if method == "zscore":
    lo, hi = m.mean() - 5 * m.std(), m.mean() + 5 * m.std()
  else:
    q1, q3 = np.quantile(m, [0.25, 0.75])
    lo, hi = q1 - 2.5 * (q3 - q1), q3 + 2.5 * (q3 - q1)
  clipped = np.clip(m, lo, hi)
  expected_count = int(np.sum(clipped != m))
  assert expected_count >= 1 and clipped[5, 7] == hi
  expected = -0.02 * 0.2 * 64**0.5 * _np_ns(clipped)
  np.testing.assert_allclose(updates["w"], expected, rtol=1e-3, atol=1e-6)
  metrics = stablejax.stability_metrics(state)
  assert metrics["muon/outlier_count"] == expected_count
  np.testing.assert_allclose(metrics["muon/outlier_rate"], expected_count / 64**2)
  # Without clamping the outlier entry dominates the update and squashes every other direction.
  raw, _ = jax.jit(_single_matrix_tx(outlier_method=None).update)({"w": jnp.asarray(g)},
                                                                   tx.init(params), params)

  def dominance(u):
    u = np.abs(np.asarray(u))
    return u[5, 7] / np.max(np.where(np.arange(u.size).reshape(u.shape) == 5 * 64 + 7, 0, u))

  sv = np.linalg.svd(np.asarray(raw["w"]), compute_uv=False)
  sv_safe = np.linalg.svd(np.asarray(updates["w"]), compute_uv=False)
  assert dominance(raw["w"]) > 10 and sv[1] < 0.5 * sv[0]
  assert dominance(updates["w"]) < 3 and sv_safe[1] > 0.9 * sv_safe[0]


def test_iqr_on_large_matrix_uses_subsample_and_still_clamps():
  g = np.array(_normal(4, (96, 128)))  # 12288 entries > IQR_EXACT_MAX: strided subsample
  g[50, 60] = 1e5
  clamped, n = _clamp(jnp.asarray(g), "iqr", 5.0)
  q1, q3 = np.quantile(g, [0.25, 0.75])
  hi_exact = q3 + 2.5 * (q3 - q1)
  assert 1 <= int(n) <= 3  # the outlier, plus at most a tail entry or two of a Gaussian
  np.testing.assert_allclose(float(clamped[50, 60]), hi_exact, rtol=0.1)


def test_outlier_clamp_transform_clamps_each_matrix_in_any_chain():
  # A stacked [2, 16, 24] kernel (two matrices), a plain matrix and a vector, each matrix with
  # planted outliers; re-derived in numpy per matrix (z-score with the population std).
  g = {"stack": np.array(_normal(1, (2, 16, 24))), "w": np.array(_normal(2, (16, 16))),
       "b": np.array(_normal(3, (16,)))}
  g["stack"][0, 3, 4], g["stack"][1, 7, 8], g["w"][2, 2], g["b"][0] = 50.0, -80.0, 30.0, 1e3
  tx = optax.chain(stablejax.clamp_outlier_entries(threshold=3.0), optax.scale(-1.0))
  updates, state = jax.jit(tx.update)(jax.tree.map(jnp.asarray, g), tx.init(g))
  want, n = {}, 0
  for k in ("stack", "w"):
    mats = g[k].reshape((-1,) + g[k].shape[-2:])
    out = []
    for m in mats:
      lo, hi = m.mean() - 3.0 * m.std(), m.mean() + 3.0 * m.std()
      out.append(np.clip(m, lo, hi))
      n += int(np.sum(out[-1] != m))
    want[k] = -np.stack(out).reshape(g[k].shape)
  for k in ("stack", "w"):
    np.testing.assert_allclose(updates[k], want[k], rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(updates["b"], -g["b"])  # a vector passes through
  assert n >= 3 and int(state[0].outlier_count) == n
  np.testing.assert_allclose(float(state[0].outlier_rate), n / (2 * 16 * 24 + 16 * 16))
  assert stablejax.stability_metrics(state)["outlier_clamp/outlier_count"] == n
  # The same rule as the Muon branch's clamp of its NS input.
  clamped, count = _clamp(jnp.asarray(g["w"]), "zscore", 3.0)
  np.testing.assert_array_equal(-clamped, updates["w"])


def test_zero_spread_matrix_is_not_clamped():
  x = jnp.zeros((32, 32)).at[0, 0].set(1.0)  # IQR is zero: no clamping instead of zeroing
  out, n = _clamp(x, "iqr", 5.0)
  assert int(n) == 0 and np.array_equal(out, x)


def test_planted_nan_in_ns_triggers_fallback(monkeypatch):
  real = ns_mod.newton_schulz_given_norm

  def poisoned(x, *args):
    out = real(x, *args)
    return out.at[..., 0, 0].set(jnp.nan) if x.shape[-2:] == (32, 48) else out

  monkeypatch.setattr(ns_mod, "newton_schulz_given_norm", poisoned)
  params = {"a": jnp.zeros((32, 48)), "b": jnp.zeros((48, 16))}
  g = {"a": _normal(5, (32, 48)), "b": _normal(6, (48, 16))}
  tx = _single_matrix_tx(outlier_method=None)
  updates, state = jax.jit(tx.update)(g, tx.init(params), params)
  assert np.all(np.isfinite(updates["a"]))
  m = _first_step_nesterov_input(np.asarray(g["a"], np.float64))
  expected = -0.02 * 0.2 * 48**0.5 * m / np.linalg.norm(m)  # Frobenius-normalised momentum
  np.testing.assert_allclose(updates["a"], expected, rtol=1e-4, atol=1e-8)
  # The healthy tensor is untouched by the fallback.
  np.testing.assert_allclose(updates["b"], -0.02 * 0.2 * 48**0.5 * _np_ns(
      _first_step_nesterov_input(np.asarray(g["b"], np.float64))), rtol=1e-3, atol=1e-6)
  metrics = stablejax.stability_metrics(state)
  assert metrics["muon/fallback_count"] == 1
  np.testing.assert_allclose(metrics["muon/fallback_rate"], 0.5)
  np.testing.assert_allclose(metrics["muon/ns_instability_rate"], 0.5)


def test_diverging_coefficients_fall_back_per_slice():
  # Coefficients that blow up: every slice overflows to inf -> fallback, update stays finite.
  params = {"stack": jnp.zeros((3, 16, 16))}
  tx = _single_matrix_tx(outlier_method=None, ns_coeffs=(1e30, 0.0, 0.0))
  g = {"stack": _normal(7, (3, 16, 16))}
  updates, state = jax.jit(tx.update)(g, tx.init(params), params)
  assert np.all(np.isfinite(updates["stack"]))
  metrics = stablejax.stability_metrics(state)
  assert metrics["muon/fallback_count"] == 3
  np.testing.assert_allclose(metrics["muon/fallback_rate"], 1.0)
  for i in range(3):
    m = np.asarray(g["stack"][i], np.float64)
    np.testing.assert_allclose(np.linalg.norm(updates["stack"][i]), 0.02 * 0.2 * 4.0, rtol=1e-4)
    cos = np.sum(np.asarray(updates["stack"][i]) * -m) / (
        np.linalg.norm(updates["stack"][i]) * np.linalg.norm(m))
    assert cos > 0.9999


def _muon_state(state):
  found = [x for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(
      x, stablejax.OutlierSafeMuonState)) if isinstance(x, stablejax.OutlierSafeMuonState)]
  assert len(found) == 1
  return found[0]


def _adam_mu(state, group="adam"):
  guard = state.inner_state.inner_states[group].inner_state  # partition -> masked -> guard
  return guard.inner_state[0].mu  # optax.adam = chain(scale_by_adam, scale_by_learning_rate)


def test_nonfinite_gradient_never_enters_momentum():
  # Issue: one NaN entered the Muon momentum, and from then on the health check fell back to an
  # all-zero update every step: the matrix was frozen for good, silently.
  params = {"w": jnp.zeros((16, 16)), "v": jnp.zeros((16, 32)), "b": jnp.zeros(16)}
  good = {"w": _normal(8, (16, 16)), "v": _normal(9, (16, 32)), "b": _normal(10, (16,))}
  bad = dict(good, w=good["w"].at[3, 3].set(jnp.nan), b=good["b"].at[0].set(jnp.inf))
  tx = _single_matrix_tx()
  update = jax.jit(tx.update)
  clean_updates, _ = update(good, tx.init(params), params)
  updates, state = update(bad, tx.init(params), params)
  # The bad tensors: zero update, momentum and Adam moments untouched; the good one: as if clean.
  assert np.all(np.asarray(updates["w"]) == 0) and np.all(np.asarray(updates["b"]) == 0)
  np.testing.assert_array_equal(updates["v"], clean_updates["v"])
  assert np.all(np.asarray(_muon_state(state).mu["w"]) == 0)
  assert np.all(np.asarray(_adam_mu(state)["b"]) == 0)
  metrics = stablejax.stability_metrics(state)
  assert metrics["muon/nonfinite_count"] == 2
  np.testing.assert_allclose(metrics["muon/nonfinite_rate"], 2 / 3)
  assert metrics["muon/fallback_count"] == 0 and metrics["muon/ns_instability_rate"] == 0
  # The next finite step trains the matrix normally.
  updates, state = update(good, state, params)
  w = np.asarray(updates["w"], np.float64)
  sv = np.linalg.svd(w / (0.02 * 0.2 * 4.0), compute_uv=False)  # lr * Moonlight scale
  assert np.all(np.isfinite(w)) and 0.6 < sv.min() and sv.max() < 1.25
  assert np.all(np.isfinite(np.asarray(updates["b"]))) and np.any(np.asarray(updates["b"]) != 0)
  metrics = stablejax.stability_metrics(state)
  assert metrics["muon/nonfinite_count"] == 2 and metrics["muon/nonfinite_rate"] == 0


def test_nonfinite_tensor_keeps_the_state_it_had_before_the_step() -> None:
  # The docstring: a tensor whose gradient is not finite "keeps its optimizer state (momentum,
  # Adam moments)". Two finite steps first, so that kept and overwritten state differ (from
  # init both would be zero).
  params = {"w": jnp.zeros((16, 16)), "v": jnp.zeros((16, 32)), "b": jnp.zeros(16)}
  good = {"w": _normal(8, (16, 16)), "v": _normal(9, (16, 32)), "b": _normal(10, (16,))}
  bad = dict(good, w=good["w"].at[3, 3].set(jnp.nan), b=good["b"].at[0].set(jnp.inf))
  tx = _single_matrix_tx()
  update = jax.jit(tx.update)
  state = tx.init(params)
  for _ in range(2):
    _, state = update(good, state, params)
  guard = state.inner_state.inner_states["adam"].inner_state
  mu = _muon_state(state).mu
  before = {"w": np.asarray(mu["w"]), "v": np.asarray(mu["v"]),
            "b_mu": np.asarray(guard.inner_state[0].mu["b"]),
            "b_nu": np.asarray(guard.inner_state[0].nu["b"])}
  assert np.all(before["w"] != 0) and np.all(before["b_nu"] > 0)
  _, state = update(bad, state, params)
  guard = state.inner_state.inner_states["adam"].inner_state
  np.testing.assert_array_equal(_muon_state(state).mu["w"], before["w"])
  np.testing.assert_array_equal(guard.inner_state[0].mu["b"], before["b_mu"])
  np.testing.assert_array_equal(guard.inner_state[0].nu["b"], before["b_nu"])
  # The finite tensor updates normally: mu = 0.95 mu + 0.05 g.
  np.testing.assert_allclose(_muon_state(state).mu["v"],
                             0.95 * before["v"] + 0.05 * np.asarray(good["v"]), rtol=1e-6)


@pytest.mark.parametrize("shape", [(3, 40, 50), (4097, 4097)])
def test_clamp_count_matches_numpy_below_and_above_2_24_entries(shape):
  # The count is a float32 sum of ones per matrix up to 2**24 entries and per row above: both
  # give numpy's count of moved entries (planted spikes in both signs, every slice its own).
  rng = np.random.default_rng(0)
  x = rng.standard_normal(shape).astype(np.float32)
  flat = x.reshape(-1, *shape[-2:])
  for i in range(flat.shape[0]):
    flat[i, 0, : i + 2] = 1e3
    flat[i, -1, -1] = -1e3
  clamped, n = _clamp(jnp.asarray(x), "zscore", 5.0)
  m = flat.astype(np.float64)
  mean = m.mean(axis=(-2, -1), keepdims=True)
  std = m.std(axis=(-2, -1), keepdims=True)
  moved = (m < mean - 5 * std) | (m > mean + 5 * std)
  assert int(n) == int(moved.sum()) == sum(i + 3 for i in range(flat.shape[0]))
  np.testing.assert_array_equal(np.asarray(clamped) != x, moved.reshape(shape))


def test_negative_outlier_is_clamped_to_the_lower_boundary() -> None:
  # "entries ... that are statistical outliers are clamped back to the boundary": both sides.
  g = np.array(_normal(5, (32, 32)), np.float64)
  g[2, 3] = -1e3
  g[20, 9] = 1e3
  out, n = _clamp(jnp.asarray(g, jnp.float32), "zscore", 5.0)
  lo, hi = g.mean() - 5 * g.std(), g.mean() + 5 * g.std()
  assert lo < -1 and hi > 1
  np.testing.assert_allclose(float(out[2, 3]), lo, rtol=1e-4)
  np.testing.assert_allclose(float(out[20, 9]), hi, rtol=1e-4)
  assert int(n) == 2
  out, n = _clamp(jnp.asarray(g, jnp.float32), "iqr", 5.0)
  q1, q3 = np.quantile(g, [0.25, 0.75])
  np.testing.assert_allclose(float(out[2, 3]), q1 - 2.5 * (q3 - q1), rtol=1e-4)
  assert int(n) == 2


def test_health_check_rejects_outputs_outside_its_documented_bounds() -> None:
  # ns_health: healthy when finite and 0.1 ||M|| / (||M|| + eps) <= ||O||_F <= 2 sqrt(rank).
  mom = _normal(6, (16, 16))
  mom_fro = float(jnp.linalg.norm(mom))
  low = 0.1 * mom_fro / (mom_fro + 1e-8)
  direction = _normal(7, (16, 16))
  direction = direction / jnp.linalg.norm(direction)
  for fro, healthy in [(0.9 * low, False), (1.1 * low, True), (7.9, True), (8.1, False)]:
    got, mom_finite, _ = direction_mod.ns_health(direction * fro, mom, 1e-8)
    assert bool(got) == healthy, fro
    assert bool(mom_finite)
  got, mom_finite, _ = direction_mod.ns_health(direction, mom.at[0, 0].set(jnp.nan), 1e-8)
  assert not bool(got) and not bool(mom_finite)


def test_nonfinite_momentum_falls_back_to_a_zero_update() -> None:
  # Module docstring: the emergency fallback is the normalised momentum, "zero if the momentum
  # itself is non-finite" (here the Muon direction alone, without the per-tensor guard).
  g = np.array(_normal(11, (16, 16)))
  g[4, 4] = np.nan
  tx = direction_mod.scale_by_outlier_safe_muon(ns_backend="xla")
  updates: Any
  state: Any
  updates, state = jax.jit(tx.update)({"w": jnp.asarray(g)}, tx.init({"w": jnp.zeros((16, 16))}))
  assert np.all(np.asarray(updates["w"]) == 0)
  assert int(state.fallback_count) == 1 and int(state.instability_count) == 0


def test_adam_groups_rates_default_to_the_adamw_rate_and_norms_are_never_decayed() -> None:
  # outlier_safe_muon: embedding/head rates default to adam_learning_rate; the "adam" group
  # (norm gains, biases, scalars) is never decayed, the embedding and head are.
  params = {"tok_embed": jnp.ones((50, 16)), "ln": {"scale": jnp.ones(16)},
            "lm_head": {"kernel": jnp.ones((16, 50))}, "w": jnp.ones((16, 16))}
  tx = stablejax.outlier_safe_muon(0.02, adam_learning_rate=1e-3, adam_weight_decay=0.1)
  grads = jax.tree.map(jnp.zeros_like, params)
  updates: Any
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  np.testing.assert_array_equal(updates["ln"]["scale"], 0.0)  # zero gradient, no decay
  # A zero gradient leaves AdamW's decay alone: -lr * wd * param, at the AdamW rate.
  np.testing.assert_allclose(updates["tok_embed"], -1e-3 * 0.1, rtol=1e-5)
  np.testing.assert_allclose(updates["lm_head"]["kernel"], -1e-3 * 0.1, rtol=1e-5)


def test_counters_saturate_at_int32_max() -> None:
  # OutlierSafeMuonState.outlier_count "saturates at int32 max" rather than wrapping negative.
  int32_max = 2**31 - 1
  g = np.array(_normal(3, (16, 16)))
  g[1, 1] = 1e4
  tx = direction_mod.scale_by_outlier_safe_muon(ns_backend="xla")
  state: Any = tx.init({"w": jnp.zeros((16, 16))})
  state = state._replace(outlier_count=jnp.int32(int32_max - 1))
  update = jax.jit(tx.update)
  _, state = update({"w": jnp.asarray(g)}, state)
  assert int(state.outlier_count) == int32_max
  _, state = update({"w": jnp.asarray(g)}, state)
  assert int(state.outlier_count) == int32_max


def test_near_zero_momentum_is_not_a_unit_norm_update_nor_an_instability():
  # Issue: a momentum of Frobenius norm ~1e-12 failed the health check (NS output below 0.1),
  # counted as an NS instability, and the fallback turned it into a unit-norm update.
  params = {"w": jnp.zeros((16, 16))}
  g = _normal(12, (16, 16))
  g = {"w": g * (1e-12 / jnp.linalg.norm(g))}
  tx = _single_matrix_tx(outlier_method=None)
  updates, state = jax.jit(tx.update)(g, tx.init(params), params)
  ref = optax.contrib.muon(0.02, ns_coeffs=STANDARD, eps=1e-8, consistent_rms=0.2)
  want, _ = jax.jit(ref.update)(g, ref.init(params), params)
  np.testing.assert_allclose(updates["w"], want["w"], rtol=1e-4, atol=1e-12)
  unit = 0.02 * 0.2 * 4.0  # the Frobenius norm of a fallback (unit-norm direction) update
  assert np.linalg.norm(updates["w"]) < 0.1 * unit
  metrics = stablejax.stability_metrics(state)
  assert metrics["muon/ns_instability_rate"] == 0 and metrics["muon/fallback_count"] == 0


def test_health_check_bounds_hold_for_ns_of_any_spectrum():
  # The check must never flag a healthy NS output: singular values from 1 down to 1e-6 (relative
  # to the Frobenius norm), ranks 1 to 64, and a zero matrix.
  # NS and the check jitted, the spectra built in numpy: eagerly, each operation would compile
  # on its own for each rank.
  def healthy_ns(x, **kw):
    return direction_mod.ns_health(ns_mod.newton_schulz(x, **kw), x, 1e-8)[0]

  check = jax.jit(lambda x: healthy_ns(x, eps=1e-8, backend="xla"))
  rng = np.random.default_rng(0)
  u = np.linalg.qr(rng.standard_normal((64, 64)))[0]
  v = np.linalg.qr(rng.standard_normal((96, 96)))[0]
  for rank, s_min in [(1, 1.0), (4, 1e-6), (64, 1e-3), (64, 1.0)]:
    s = np.zeros(64)
    s[:rank] = np.geomspace(1.0, s_min, rank)
    m = (u * s) @ v[:64]
    for scale in (1.0, 1e-9, 1e-12):
      x = jnp.asarray(m * scale, jnp.float32)
      assert bool(check(x)), (rank, s_min, scale)
  zero = jnp.zeros((8, 8))
  assert bool(jax.jit(healthy_ns)(zero))


@pytest.mark.filterwarnings("ignore:outlier_safe_muon")  # "attn" is an unrecognised 3-axis leaf
def test_metrics_keys_and_group_rms():
  params = {"tok_embed": _normal(0, (50, 16)), "attn": {"kernel": _normal(1, (2, 16, 16))},
            "ln": {"scale": jnp.ones(16)}, "lm_head": {"kernel": _normal(2, (16, 50))}}
  tx = stablejax.outlier_safe_muon(2e-3, adam_learning_rate=1e-3, embedding_learning_rate=5e-3,
                                   head_learning_rate=2e-4, weight_decay=0.1)
  state = tx.init(params)
  grads = jax.tree.map(lambda p: jnp.ones_like(p) * 0.1, params)
  updates, state = jax.jit(tx.update)(grads, state, params)
  metrics = stablejax.stability_metrics(state)
  assert set(metrics) == CONTRACT_KEYS
  for group, leaf in [("embedding", updates["tok_embed"]), ("muon", updates["attn"]["kernel"]),
                      ("adam", updates["ln"]["scale"]), ("head", updates["lm_head"]["kernel"])]:
    rms = np.sqrt(np.mean(np.asarray(leaf, np.float64) ** 2))
    np.testing.assert_allclose(metrics[f"muon/update_rms/{group}"], rms, rtol=1e-5)
  # First AdamW step moves every entry by about the learning rate (update = -lr * sign).
  np.testing.assert_allclose(metrics["muon/update_rms/embedding"], 5e-3, rtol=1e-3)
  np.testing.assert_allclose(metrics["muon/update_rms/head"], 2e-4, rtol=1e-3)
  assert metrics["muon/update_rms/muon"].dtype == jnp.float32
  assert metrics["muon/outlier_count"].dtype == jnp.int32


def test_adam_groups_are_optax_adamw_with_schedules():
  params = {"embed": _normal(0, (20, 8)), "norm": {"scale": jnp.ones(8)}, "w": _normal(1, (8, 8))}
  sched = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 3, 20)
  tx = stablejax.outlier_safe_muon(0.02, adam_learning_rate=sched, embedding_learning_rate=sched,
                                   adam_weight_decay=0.1, adam_b2=0.95)
  ref = optax.adamw(sched, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
  s, s_ref = tx.init(params), ref.init(params["embed"])
  p, p_ref = params, params["embed"]
  update, update_ref = jax.jit(tx.update), jax.jit(ref.update)
  for k in range(4):
    grads = jax.tree.map(lambda x, k=k: _normal(20 + k, x.shape), params)
    u, s = update(grads, s, p)
    u_ref, s_ref = update_ref(grads["embed"], s_ref, p_ref)
    np.testing.assert_allclose(u["embed"], u_ref, rtol=1e-5, atol=1e-9)
    p, p_ref = optax.apply_updates(p, u), optax.apply_updates(p_ref, u_ref)
  # Norm scales get no weight decay: same as adamw without decay.
  ref_nodecay = optax.adam(sched, b1=0.9, b2=0.95)
  g0 = _normal(20, (8,))
  u0, _ = jax.jit(ref_nodecay.update)(g0, ref_nodecay.init(params["norm"]["scale"]))
  u1, _ = update({"embed": jnp.zeros((20, 8)), "norm": {"scale": g0}, "w": jnp.zeros((8, 8))},
                 tx.init(params), params)
  np.testing.assert_allclose(u1["norm"]["scale"], u0, rtol=1e-6)


MDN = optax.contrib.MuonDimensionNumbers


def _compare_with_optax(params, dims, ours_dims, steps=2, rtol=2e-4):
  """Muon updates of outlier_safe_muon(weight_dimension_numbers=ours_dims) vs optax's (dims)."""
  ours = stablejax.outlier_safe_muon(0.02, weight_decay=0.1, outlier_method=None, ns_backend="xla",
                                     param_labels=jax.tree.map(lambda _: "muon", params),
                                     weight_dimension_numbers=ours_dims)
  ref = optax.contrib.muon(0.02, ns_coeffs=STANDARD, eps=1e-8, weight_decay=0.1,
                           consistent_rms=0.2, muon_weight_dimension_numbers=dims)
  s_ours, s_ref = ours.init(params), ref.init(params)
  update_ours, update_ref = jax.jit(ours.update), jax.jit(ref.update)
  for step in range(steps):
    grads = jax.tree.map(lambda p, k=step: _normal(30 + k + p.size, p.shape), params)
    u_ours, s_ours = update_ours(grads, s_ours, params)
    u_ref, s_ref = update_ref(grads, s_ref, params)
    flat_ours = jax.tree_util.tree_flatten_with_path(u_ours)[0]
    for (path, a), b in zip(flat_ours, jax.tree.leaves(u_ref)):
      np.testing.assert_allclose(a, b, rtol=rtol, atol=1e-6, err_msg=jax.tree_util.keystr(path))
  return u_ours


def test_weight_dimension_numbers_as_optax_takes_them():
  params = {"conv": _normal(0, (3, 3, 4, 8)), "q": _normal(1, (8, 2, 4)),
            "o": _normal(2, (2, 4, 8)), "stack": _normal(3, (3, 8, 12)), "w": _normal(4, (16, 32))}
  dims = {"conv": MDN((0, 1, 2), 3), "q": MDN(0, (1, 2)), "o": MDN((0, 1), 2),
          "stack": MDN(1, 2), "w": MDN()}
  _compare_with_optax(params, dims, dims)                      # a tree
  _compare_with_optax(params, dims, lambda p: dims)            # a callable
  # A None entry keeps the default layout (here the last two axes of "stack" and "w").
  _compare_with_optax(params, dims, dict(dims, stack=None, w=None), steps=1)
  with pytest.raises(ValueError, match="do not fit conv of shape"):
    stablejax.outlier_safe_muon(0.02, weight_dimension_numbers=dict(dims, conv=MDN(0, 4))).init(
        params)


def _mha_params(d_model=16, heads=4, head_dim=8, scan=0):
  import flax.linen as nn
  x = np.zeros((1, 4, d_model), np.float32)
  mha = nn.MultiHeadDotProductAttention(num_heads=heads, qkv_features=heads * head_dim)
  p = jax.jit(mha.init)(jax.random.key(0), x)["params"]  # eagerly, a program per initialiser
  if scan:  # the layout nn.scan gives: every leaf stacked on a leading layer axis
    p = jax.tree.map(lambda a: np.stack([np.asarray(a)] * scan), p)
  return p


@pytest.mark.parametrize("scan", [0, 2])
def test_flax_attention_kernels_are_one_matrix_by_default(scan):
  # Flax's q/k/v kernels are [D, H, hd] and the output kernel [H, hd, D]: by default they are the
  # [D, H*hd] and [H*hd, D] matrices, the same update as optax.contrib.muon with those dims.
  params = {"attn": _mha_params(scan=scan),
            "norm": {"scale": np.ones((scan, 16) if scan else 16, np.float32)}}
  labels = stablejax.label_params(params)
  for name in ("query", "key", "value", "out"):
    assert labels["attn"][name] == {"kernel": "muon", "bias": "adam"}
  qkv, out = MDN(-3, (-2, -1)), MDN((-3, -2), -1)
  dims = {"attn": {n: {"kernel": out if n == "out" else qkv, "bias": None}
                   for n in ("query", "key", "value", "out")}, "norm": {"scale": None}}
  muon_params = {"attn": {n: {"kernel": params["attn"][n]["kernel"]}
                          for n in ("query", "key", "value", "out")}}
  muon_dims = {"attn": {n: {"kernel": dims["attn"][n]["kernel"]} for n in muon_params["attn"]}}
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # recognised layouts: no warning
    updates = _compare_with_optax(muon_params, muon_dims, None, steps=1)
    stablejax.outlier_safe_muon(0.02).init(params)
  # The matrix the update is orthogonal as: the [D, H*hd] one (update = -lr (scale O + wd p)).
  u, p = updates["attn"]["query"]["kernel"], muon_params["attn"]["query"]["kernel"]
  ortho = (-np.asarray(u) / 0.02 - 0.1 * np.asarray(p)) / (0.2 * 32**0.5)
  for mat in ortho.reshape((-1, 16, 32)):
    sv = np.linalg.svd(mat, compute_uv=False)
    assert 0.6 < sv.min() and sv.max() < 1.25, sv


def test_unrecognised_layout_warns_at_init_with_the_fix():
  params = {"conv": {"kernel": _normal(0, (3, 3, 4, 8)), "bias": jnp.zeros(8)}}
  tx = stablejax.outlier_safe_muon(0.02)
  with pytest.warns(UserWarning, match=r"1 kernel of 3\+ axes match no layout rule .* 1 x "
                                       r"\(3, 3, 4, 8\) as 9 x 4x8 \(conv/kernel\).*"
                                       r"muon_dimension_numbers\(p, overrides="
                                       r"\{'conv/kernel': optax.contrib.MuonDimensionNumbers"):
    tx.init(params)
  dims = stablejax.muon_dimension_numbers(params, overrides={"conv/kernel": MDN((0, 1, 2), 3)})
  assert dims == {"conv": {"kernel": MDN((0, 1, 2), 3), "bias": None}}
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    stablejax.outlier_safe_muon(0.02, weight_dimension_numbers=dims).init(params)
  table = stablejax.describe_routing(params, stablejax.outlier_safe_muon(0.02))
  assert any(line.startswith("warning: 1 kernel of 3+ axes") and "(conv/kernel)" in line
             for line in table.splitlines())


def test_update_with_other_parameters_than_init_is_a_clear_error():
  params = {"w": jnp.zeros((4, 4)), "b": jnp.zeros(4)}
  tx = stablejax.outlier_safe_muon(0.02)
  state = tx.init(params)
  other = {"w": jnp.zeros((4, 4)), "c": jnp.zeros(4)}
  with pytest.raises(ValueError, match="the updates hold c"):
    tx.update(other, state, params)
  with pytest.raises(ValueError, match="differ from the ones its state was initialised with"):
    tx.update({"v": jnp.zeros((4, 4)), "w": jnp.zeros((4, 4)), "b": jnp.zeros(4)}, state)


def test_inside_optax_masked():
  # The routed tree then holds optax.MaskedNode leaves: labels and group RMS must skip them.
  params = {"w": _normal(0, (8, 8)), "frozen": _normal(1, (8, 8)), "b": jnp.zeros(8)}
  mask = {"w": True, "frozen": False, "b": True}
  tx = optax.masked(stablejax.outlier_safe_muon(0.02, adam_learning_rate=1e-3), mask)
  alone = stablejax.outlier_safe_muon(0.02, adam_learning_rate=1e-3)
  grads = jax.tree.map(lambda p: _normal(p.size, p.shape), params)
  updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
  sub = {"w": params["w"], "b": params["b"]}
  want, _ = jax.jit(alone.update)({"w": grads["w"], "b": grads["b"]}, alone.init(sub), sub)
  np.testing.assert_allclose(updates["w"], want["w"], rtol=1e-5, atol=1e-8)
  np.testing.assert_allclose(updates["b"], want["b"], rtol=1e-6)
  np.testing.assert_array_equal(updates["frozen"], grads["frozen"])  # optax.masked passes it on
  rms = np.sqrt(np.mean(np.asarray(want["b"], np.float64) ** 2))
  np.testing.assert_allclose(stablejax.stability_metrics(state)["muon/update_rms/adam"], rms,
                             rtol=1e-5)
  assert "frozen" not in stablejax.describe_routing(params, tx)


def test_inject_hyperparams_gives_the_same_updates():
  params = {"embed": _normal(0, (20, 8)), "w": _normal(1, (8, 16)), "ln": {"scale": jnp.ones(8)}}
  kw = dict(adam_learning_rate=1e-3, weight_decay=0.1, adam_weight_decay=0.1)
  plain = stablejax.outlier_safe_muon(0.02, **kw)
  # As written in optax's docs: no static_args, the integer ns_steps stays static by default.
  injected = optax.inject_hyperparams(stablejax.outlier_safe_muon)(learning_rate=0.02, **kw)
  explicit = optax.inject_hyperparams(stablejax.outlier_safe_muon, static_args=("ns_steps",))(
      learning_rate=0.02, ns_steps=5, **kw)
  s1, s2, s3 = plain.init(params), injected.init(params), explicit.init(params)
  for k in range(2):
    grads = jax.tree.map(lambda p, k=k: _normal(40 + k, p.shape), params)
    u1, s1 = jax.jit(plain.update)(grads, s1, params)
    u2, s2 = jax.jit(injected.update)(grads, s2, params)
    u3, s3 = jax.jit(explicit.update)(grads, s3, params)
    for a, b, c in zip(jax.tree.leaves(u1), jax.tree.leaves(u2), jax.tree.leaves(u3)):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8)
      np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-8)
  assert set(s2.hyperparams) >= {"learning_rate", "momentum"} and "ns_steps" not in s2.hyperparams
  # An explicit integer is a number to inject_hyperparams: one line says how to keep it static.
  with pytest.raises(ValueError, match="static_args=\\('ns_steps',\\)"):
    optax.inject_hyperparams(stablejax.outlier_safe_muon)(learning_rate=0.02,
                                                          ns_steps=5).init(params)


def test_pallas_interpret_backend_inside_muon_matches_xla(monkeypatch):
  params = {"w": jnp.zeros((2, 64, 64))}
  g = {"w": _normal(11, (2, 64, 64))}
  tx_xla = stablejax.outlier_safe_muon(0.02, ns_backend="xla")
  want = jax.jit(tx_xla.update)(g, tx_xla.init(params), params)[0]["w"]
  real = ns_mod.newton_schulz
  monkeypatch.setattr(ns_mod, "newton_schulz", lambda x, **kw: real(x, **kw, interpret=True))
  tx = stablejax.outlier_safe_muon(0.02, ns_backend="pallas")
  got = jax.jit(tx.update)(g, tx.init(params), params)[0]["w"]
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-7)


def test_bad_arguments_raise_value_error():
  with pytest.raises(ValueError, match="outlier_method"):
    stablejax.outlier_safe_muon(0.02, outlier_method="mad")
  with pytest.raises(ValueError, match="adam_learning_rate is required"):
    stablejax.outlier_safe_muon(0.02, consistent_rms=None)
  with pytest.raises(ValueError, match="unknown group"):
    stablejax.outlier_safe_muon(0.02, param_labels={"w": "sgd"})
  with pytest.raises(ValueError, match="ns_backend"):
    stablejax.outlier_safe_muon(0.02, ns_backend="triton")
  tx = stablejax.outlier_safe_muon(0.02, param_labels=lambda p: {"v": "muon"})
  with pytest.raises(ValueError, match="label it 'adam'"):
    tx.init({"v": jnp.zeros(4)})


@pytest.mark.parametrize("platform,call", [("cuda", "__gpu$xla.gpu.triton"),
                                           ("tpu", "tpu_custom_call")])
def test_optimizer_step_exported_for_accelerators_embeds_ns_kernel(platform, call):
  # The whole optimizer update, lowered on this CPU machine for CUDA / TPU, carries the kernel
  # (ns_backend="pallas": "auto" on a CPU host traces the reference only).
  params = {"mlp": {"kernel": jnp.zeros((2, 128, 256))}, "ln": {"scale": jnp.ones(128)}}
  tx = stablejax.outlier_safe_muon(2e-3, ns_backend="pallas")
  state = tx.init(params)
  exported = jax.export.export(
      jax.jit(tx.update), platforms=[platform],
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
  )(params, state, params)
  assert exported.mlir_module().count(f"custom_call @{call}(") == 15  # 5 steps x 3 products


@pytest.mark.parametrize("consistent_rms", [0.2, None])
def test_fused_kernel_is_optax_muon_on_each_part(consistent_rms):
  """A fused [D, 3D] kernel (equal parts, one batched NS call) and a grouped-query
  [(H + 2K) hd, D] kernel stored [out, in] (parts of different sizes, sliced apart): each part's
  update is optax.contrib.muon's on that part alone, scale and all."""
  d = 16
  fdn = stablejax.FusedDimensionNumbers
  params = {"qkv": _normal(0, (d, 3 * d)), "gqa": _normal(1, (16 + 4 + 4, d)),
            "stack": _normal(2, (2, d, 2 * 8))}
  dims = {"qkv": fdn(-2, -1, -1, 3), "gqa": fdn(-1, -2, -2, (16, 4, 4)),
          "stack": fdn(-2, -1, -1, 2)}
  ours = stablejax.outlier_safe_muon(0.02, consistent_rms=consistent_rms, adam_learning_rate=1e-3,
                                     outlier_method=None, ns_backend="xla",
                                     weight_dimension_numbers=dims)
  grads = jax.tree.map(lambda p: _normal(p.size, p.shape), params)
  got = jax.jit(ours.update)(grads, ours.init(params), params)[0]
  g = grads
  parts = {"q": g["qkv"][:, :d], "k": g["qkv"][:, d:2 * d], "v": g["qkv"][:, 2 * d:],
           "gq": g["gqa"][:16], "gk": g["gqa"][16:20], "gv": g["gqa"][20:],
           "s0": g["stack"][..., :8], "s1": g["stack"][..., 8:]}
  part_dims = {k: MDN(-1, -2) if k.startswith("g") else MDN(-2, -1) for k in parts}
  ref = optax.contrib.muon(0.02, consistent_rms=consistent_rms, eps=1e-8,
                           muon_weight_dimension_numbers=part_dims)
  want = jax.jit(ref.update)(parts, ref.init(parts), parts)[0]
  np.testing.assert_allclose(got["qkv"], np.concatenate([want["q"], want["k"], want["v"]], 1),
                             rtol=2e-4, atol=1e-7)
  np.testing.assert_allclose(got["gqa"], np.concatenate([want["gq"], want["gk"], want["gv"]], 0),
                             rtol=2e-4, atol=1e-7)
  np.testing.assert_allclose(got["stack"], np.concatenate([want["s0"], want["s1"]], -1),
                             rtol=2e-4, atol=1e-7)
