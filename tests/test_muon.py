"""outlier_safe_muon: parity with optax.contrib.muon, convergence, outlier clamp, NS fallback, metrics."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import stablejax
from stablejax.muon import muon as muon_mod
from stablejax.muon import newton_schulz as ns_mod

STANDARD = (3.4445, -4.7750, 2.0315)
CONTRACT_KEYS = {
    "muon/outlier_rate", "muon/ns_instability_rate", "muon/fallback_rate", "muon/outlier_count",
    "muon/fallback_count", "muon/update_rms/muon", "muon/update_rms/adam",
    "muon/update_rms/embedding", "muon/update_rms/head",
}


def _normal(key, shape, scale=1.0):
  return scale * jax.random.normal(jax.random.key(key), shape, jnp.float32)


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


def _first_step_nesterov_input(g, beta=0.95):
  # Step 1 of optax's bias-corrected Nesterov momentum: mu = (1 - b) g, count = 1.
  mu = (1 - beta) * g
  return beta * mu / (1 - beta**2) + (1 - beta) * g / (1 - beta)


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
  updates, state = tx.update({"w": jnp.asarray(g)}, tx.init(params), params)
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
  raw, _ = _single_matrix_tx(outlier_method=None).update({"w": jnp.asarray(g)},
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
  clamped, n = muon_mod.clamp_outliers(jnp.asarray(g), "iqr", 5.0)
  q1, q3 = np.quantile(g, [0.25, 0.75])
  hi_exact = q3 + 2.5 * (q3 - q1)
  assert 1 <= int(n) <= 3  # the outlier, plus at most a tail entry or two of a Gaussian
  np.testing.assert_allclose(float(clamped[50, 60]), hi_exact, rtol=0.1)


def test_zero_spread_matrix_is_not_clamped():
  x = jnp.zeros((32, 32)).at[0, 0].set(1.0)  # IQR is zero: no clamping instead of zeroing
  out, n = muon_mod.clamp_outliers(x, "iqr", 5.0)
  assert int(n) == 0 and np.array_equal(out, x)


def test_planted_nan_in_ns_triggers_fallback(monkeypatch):
  real = ns_mod.newton_schulz

  def poisoned(x, **kw):
    out = real(x, **kw)
    return out.at[..., 0, 0].set(jnp.nan) if x.shape == (32, 48) else out

  monkeypatch.setattr(ns_mod, "newton_schulz", poisoned)
  params = {"a": jnp.zeros((32, 48)), "b": jnp.zeros((48, 16))}
  g = {"a": _normal(5, (32, 48)), "b": _normal(6, (48, 16))}
  tx = _single_matrix_tx(outlier_method=None)
  updates, state = tx.update(g, tx.init(params), params)
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


def test_nonfinite_gradient_gives_zero_update_and_counts_fallback_not_instability():
  params = {"w": jnp.zeros((16, 16)), "v": jnp.zeros((16, 32))}
  g = {"w": _normal(8, (16, 16)).at[3, 3].set(jnp.nan), "v": _normal(9, (16, 32))}
  tx = _single_matrix_tx()
  updates, state = tx.update(g, tx.init(params), params)
  assert np.all(np.asarray(updates["w"]) == 0) and np.all(np.isfinite(updates["v"]))
  metrics = stablejax.stability_metrics(state)
  np.testing.assert_allclose(metrics["muon/fallback_rate"], 0.5)
  np.testing.assert_allclose(metrics["muon/ns_instability_rate"], 0.0)
  assert metrics["muon/outlier_count"] == 0


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
  for k in range(4):
    grads = jax.tree.map(lambda x, k=k: _normal(20 + k, x.shape), params)
    u, s = tx.update(grads, s, p)
    u_ref, s_ref = ref.update(grads["embed"], s_ref, p_ref)
    np.testing.assert_allclose(u["embed"], u_ref, rtol=1e-5, atol=1e-9)
    p, p_ref = optax.apply_updates(p, u), optax.apply_updates(p_ref, u_ref)
  # Norm scales get no weight decay: same as adamw without decay.
  ref_nodecay = optax.adam(sched, b1=0.9, b2=0.95)
  g0 = _normal(20, (8,))
  u0, _ = ref_nodecay.update(g0, ref_nodecay.init(params["norm"]["scale"]))
  u1, _ = tx.update({"embed": jnp.zeros((20, 8)), "norm": {"scale": g0}, "w": jnp.zeros((8, 8))},
                    tx.init(params), params)
  np.testing.assert_allclose(u1["norm"]["scale"], u0, rtol=1e-6)


def test_pallas_interpret_backend_inside_muon_matches_xla(monkeypatch):
  params = {"w": jnp.zeros((2, 64, 64))}
  g = {"w": _normal(11, (2, 64, 64))}
  tx_xla = stablejax.outlier_safe_muon(0.02, ns_backend="xla")
  want = tx_xla.update(g, tx_xla.init(params), params)[0]["w"]
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
  # The whole optimizer update, lowered on this CPU machine for CUDA / TPU, carries the kernel.
  params = {"mlp": {"kernel": jnp.zeros((2, 128, 256))}, "ln": {"scale": jnp.ones(128)}}
  tx = stablejax.outlier_safe_muon(2e-3)
  state = tx.init(params)
  exported = jax.export.export(
      jax.jit(tx.update), platforms=[platform],
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
  )(params, state, params)
  assert exported.mlir_module().count(f"custom_call @{call}(") == 15  # 5 steps x 3 products
