"""Newton-Schulz: reference numerics, optax parity, Pallas kernels (interpret mode), export
lowering."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from optax.contrib._muon import orthogonalize_via_newton_schulz

import stablejax
from stablejax.muon import _pallas_ns
from stablejax.muon import newton_schulz as ns_mod
from stablejax.muon.newton_schulz import POLAR_EXPRESS_COEFFS, STANDARD_COEFFS, resolve_coeffs

TRITON_CALL = "__gpu$xla.gpu.triton"

# The reference iterations, stablejax's and optax's, jitted once for the module (options static):
# eagerly, each of their operations compiles on its own for every new shape. The tests of
# warnings and argument errors call stablejax.newton_schulz itself.
_ns = jax.jit(stablejax.newton_schulz, static_argnames=(
    "steps", "coeffs", "eps", "backend", "interpret", "method", "preconditioning",
    "gram_restarts"))
_optax_ns = jax.jit(orthogonalize_via_newton_schulz, static_argnames=(
    "ns_steps", "preconditioning", "eps", "dimension_numbers"))
# The kernels' iterations the same way: a jax.jit of a new lambda per test would trace and lower
# the interpret-mode kernels again (seconds each) for a program the module already has.
_kernel_ns = jax.jit(_pallas_ns.ns_iterations, static_argnames=("coeffs", "platform",
                                                                 "interpret"))
_iterate = jax.jit(ns_mod._iterate, static_argnums=(1, 2, 3))


def _normalised(x):
  """``x`` divided by each matrix's Frobenius norm (+ 1e-7), computed in numpy."""
  x = np.asarray(x)
  return jnp.asarray(x / (np.linalg.norm(x, axis=(-2, -1), keepdims=True) + 1e-7))


def _matrix(shape, seed=0, dtype=jnp.float32):
  # numpy draws: jax.random.normal compiles a program for each new shape
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(np.float32), dtype)


def _numpy_ns(x, coeffs, eps=1e-7, norm_factor=1.0):
  """Float64 numpy re-derivation, independent of the jax code."""
  x = np.asarray(x, np.float64)
  tall = x.shape[0] > x.shape[1]
  if tall:
    x = x.T
  x = x / (np.linalg.norm(x) * norm_factor + eps)
  for a, b, c in coeffs:
    gram = x @ x.T
    x = a * x + (b * gram + c * gram @ gram) @ x
  return x.T if tall else x


def test_singular_values_after_five_standard_steps():
  # Gaussian 96x192: condition number ~5.8, a reasonable spectrum for a gradient matrix.
  x = _matrix((96, 192), seed=1)
  out = _ns(x, backend="xla")
  s = np.linalg.svd(np.asarray(out, np.float64), compute_uv=False)
  assert s.min() > 0.66 and s.max() < 1.15, (s.min(), s.max())
  # The singular vectors are those of the input: U^T out V is diagonal.
  u, _, vt = np.linalg.svd(np.asarray(x, np.float64), full_matrices=False)
  proj = u.T @ np.asarray(out, np.float64) @ vt.T
  off = proj - np.diag(np.diag(proj))
  assert np.abs(off).max() < 1e-3


@pytest.mark.parametrize("shape", [(64, 128), (128, 48), (3, 32, 40)])
def test_reference_matches_numpy_and_optax(shape):
  x = _matrix(shape, seed=2)
  out = _ns(x, backend="xla", eps=1e-8)
  if len(shape) == 2:
    expected = _numpy_ns(x, [STANDARD_COEFFS] * 5, eps=1e-8)
    optax_out = _optax_ns(x, jnp.asarray(STANDARD_COEFFS), 5, eps=1e-8)
  else:
    expected = np.stack([_numpy_ns(s, [STANDARD_COEFFS] * 5, eps=1e-8) for s in x])
    dims = __import__("optax").contrib.MuonDimensionNumbers(reduction_axis=1, output_axis=2)
    optax_out = _optax_ns(
        x, jnp.asarray(STANDARD_COEFFS), 5, eps=1e-8, dimension_numbers=dims)
  np.testing.assert_allclose(out, expected, atol=2e-5)
  np.testing.assert_allclose(out, optax_out, atol=2e-5)


def test_stacked_equals_per_slice():
  x = _matrix((4, 48, 32), seed=3)
  out = _ns(x, backend="xla")
  for i in range(x.shape[0]):
    np.testing.assert_allclose(out[i], _ns(x[i], backend="xla"), atol=1e-6)


def test_coefficient_presets_and_lists():
  per_step, factor = resolve_coeffs("standard", 3)
  assert per_step == (STANDARD_COEFFS,) * 3 and factor == 1.0
  per_step, factor = resolve_coeffs("polar_express", 10)
  assert factor == 1.01 and len(per_step) == 10
  # Paper, Algorithm 1: first triple 8.287.../1.01, ..., and the last one (1.875, -1.25, 0.375).
  np.testing.assert_allclose(per_step[0], (8.28721201814563 / 1.01, -23.595886519098837 / 1.01**3,
                                           17.300387312530933 / 1.01**5))
  assert per_step[7] == per_step[9] == (1.875, -1.25, 0.375)
  custom = [(2.0, -1.5, 0.5), (1.875, -1.25, 0.375)]
  assert resolve_coeffs(custom, 4)[0] == ((2.0, -1.5, 0.5),) + ((1.875, -1.25, 0.375),) * 3
  x = _matrix((40, 72), seed=4)
  out = jax.jit(lambda y: stablejax.newton_schulz(y, steps=4, coeffs=custom, backend="xla"))(x)
  np.testing.assert_allclose(out, _numpy_ns(x, resolve_coeffs(custom, 4)[0]), atol=2e-5)
  pe = _ns(x, steps=8, coeffs="polar_express", backend="xla")
  np.testing.assert_allclose(pe, _numpy_ns(x, POLAR_EXPRESS_COEFFS, norm_factor=1.01), atol=5e-5)
  # Polar Express converges to the polar factor: singular values close to 1 after 8 steps.
  s = np.linalg.svd(np.asarray(pe), compute_uv=False)
  assert np.abs(s - 1).max() < 0.02
  with pytest.raises(ValueError, match="coeffs"):
    stablejax.newton_schulz(x, coeffs="bogus")
  with pytest.raises(ValueError, match="triple"):
    stablejax.newton_schulz(x, coeffs=[(1.0, 2.0)])
  with pytest.raises(ValueError, match="backend"):
    stablejax.newton_schulz(x, backend="cuda")
  with pytest.raises(ValueError, match="ndim"):
    stablejax.newton_schulz(jnp.ones(5))


def test_zero_input_stays_zero():
  out = _ns(np.zeros((16, 32), np.float32), backend="xla")
  assert np.all(np.asarray(out) == 0)


@pytest.mark.parametrize("platform", ["triton", "mosaic"])
@pytest.mark.parametrize("shape", [(64, 128), (2, 64, 64), (128, 64)])
# Interpret mode is slow on CPU: small shapes, 3 steps, jitted.
def test_kernel_interpret_matches_reference_f32(platform, shape):
  x = _matrix(shape, seed=5)
  xx = _normalised(x if shape[-2] <= shape[-1] else np.swapaxes(x, -1, -2))
  flat = xx.reshape((-1,) + xx.shape[-2:])
  assert _pallas_ns.ns_tileable(*flat.shape[-2:], platform)
  want = _ns(xx, steps=3, backend="xla").reshape(flat.shape)
  got = _kernel_ns(flat, coeffs=(STANDARD_COEFFS,) * 3, platform=platform, interpret=True)
  np.testing.assert_allclose(got, want, atol=5e-6, rtol=1e-5)


def test_public_pallas_interpret_f32_and_bf16():
  x = _matrix((2, 64, 128), seed=6)
  kernel = functools.partial(_ns, backend="pallas", interpret=True)
  np.testing.assert_allclose(kernel(x), _ns(x, backend="xla"), atol=5e-6,
                             rtol=1e-5)
  xb = x.astype(jnp.bfloat16)
  got = kernel(xb)
  want = _ns(xb, backend="xla")
  assert got.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=3e-2)
  # bf16 stays close to the f32 result too (input dtype compute, f32 accumulation).
  np.testing.assert_allclose(np.asarray(got, np.float32), _ns(x, backend="xla"),
                             atol=3e-2)


def test_untileable_shape_warns_and_falls_back():
  x = _matrix((24, 40), seed=7)  # 24 is not a multiple of 16/128: no kernel tiling
  assert not _pallas_ns.ns_tileable(24, 40, "triton")
  with pytest.warns(UserWarning, match="does not tile"):
    # jitted: the warning comes as it is traced (eagerly, each operation compiles on its own)
    out = jax.jit(functools.partial(stablejax.newton_schulz, backend="pallas",
                                    interpret=True))(x)
  np.testing.assert_allclose(out, _ns(x, backend="xla"), atol=1e-6)


def test_pallas_without_accelerator_warns_on_cpu():
  x = _matrix((64, 64), seed=8)
  with pytest.warns(UserWarning, match="interpret=True"):
    out = jax.jit(functools.partial(stablejax.newton_schulz, backend="pallas"))(x)
  np.testing.assert_allclose(out, _ns(x, backend="xla"), atol=1e-6)


def test_auto_on_cpu_is_the_reference_without_warning():
  x = _matrix((64, 128), seed=9)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    out = jax.jit(stablejax.newton_schulz)(x)
  np.testing.assert_allclose(out, _ns(x, backend="xla"), atol=1e-6)
  text = jax.export.export(jax.jit(stablejax.newton_schulz), platforms=["cpu"])(x).mlir_module()
  assert TRITON_CALL not in text and "tpu_custom_call" not in text


def _export(platform, shape, dtype=jnp.float32):
  # backend="pallas" carries both kernels ("auto" on this CPU host traces the reference only).
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "no kernel for the 'cpu' backend": this host is a CPU
    exported = jax.export.export(
        jax.jit(functools.partial(stablejax.newton_schulz, backend="pallas")),
        platforms=[platform],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)],
    )(jax.ShapeDtypeStruct(shape, dtype))
  return exported.mlir_module()


def test_auto_on_a_cpu_host_traces_no_kernel():
  # The default backend traces the kernels only where they can run: exported for CUDA from this
  # CPU host, "auto" carries the reference (compile time), "pallas" the kernel.
  exported = jax.export.export(jax.jit(stablejax.newton_schulz), platforms=["cuda"])(
      jax.ShapeDtypeStruct((2, 256, 384), jnp.float32))
  assert TRITON_CALL not in exported.mlir_module()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_export_cuda_embeds_triton_kernel(dtype):
  text = _export("cuda", (2, 256, 384), dtype)
  assert TRITON_CALL in text
  assert "tpu_custom_call" not in text
  # 5 steps x 3 fused products.
  assert text.count(f"custom_call @{TRITON_CALL}(") == 15


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_export_tpu_embeds_mosaic_kernel(dtype):
  text = _export("tpu", (768, 384), dtype)  # tall: transposed to 384 x 768 before the kernel
  assert "tpu_custom_call" in text
  assert TRITON_CALL not in text
  assert text.count("custom_call @tpu_custom_call(") == 15


def test_export_untileable_shape_uses_reference_on_cuda():
  text = _export("cuda", (24, 40))
  assert TRITON_CALL not in text


def _scalar_ns(s, steps=5):
  a, b, c = STANDARD_COEFFS
  for _ in range(steps):
    s = a * s + b * s**3 + c * s**5
  return s


@pytest.mark.parametrize("dtype,atol", [(jnp.float32, 1e-5), (jnp.bfloat16, 0.03)])
def test_output_range_depends_on_normalised_singular_value(dtype, atol):
  # The docstring's ranges: NS maps each normalised singular value s = sigma / ||X||_F on its
  # own; [0.68, 1.13] holds for s >= 0.0052 only, smaller ones overshoot (to 1.21) or stay small.
  n = 96
  u = np.linalg.qr(np.random.default_rng(0).normal(size=(n, n)))[0]
  v = np.linalg.qr(np.random.default_rng(1).normal(size=(2 * n, 2 * n)))[0][:n]
  s = np.geomspace(1.0, 1e-5, n)
  s /= np.linalg.norm(s)
  out = _ns(jnp.asarray((u * s) @ v, dtype), eps=0.0, backend="xla")
  got = np.diag(u.T @ np.asarray(out.astype(jnp.float32), np.float64) @ v.T)  # same vectors
  np.testing.assert_allclose(got, _scalar_ns(s), atol=atol)
  grid = np.geomspace(1e-6, 1.0, 200_001)
  mapped = _scalar_ns(grid)
  high = grid >= 0.0052
  assert 0.68 <= mapped[high].min() and mapped[high].max() <= 1.135
  assert 1.19 < mapped.max() <= 1.21 and grid[mapped.argmax()] < 0.0052
  assert mapped[grid < 0.0015].max() < 0.68
  np.testing.assert_allclose(mapped[grid < 1e-4] / grid[grid < 1e-4], 485, rtol=0.01)


def test_polar_express_input_is_divided_by_1_01_times_its_norm():
  # arXiv 2505.16932, Algorithm 1: X0 = X / (1.01 ||X||_F); checked before the iterations wash it
  # out (after 0 and 1 step), against the paper's first triple with the safety factor.
  x = _matrix((24, 40), seed=7)
  x64 = np.asarray(x, np.float64)
  x0 = x64 / (1.01 * np.linalg.norm(x64))
  out = _ns(x, steps=0, coeffs="polar_express", backend="xla")
  np.testing.assert_allclose(out, x0, rtol=1e-5, atol=1e-7)
  a, b, c = 8.28721201814563 / 1.01, -23.595886519098837 / 1.01**3, 17.300387312530933 / 1.01**5
  gram = x0 @ x0.T
  x1 = a * x0 + (b * gram + c * gram @ gram) @ x0
  out = _ns(x, steps=1, coeffs="polar_express", backend="xla")
  np.testing.assert_allclose(out, x1, atol=2e-5 * np.abs(x1).max())
  # The standard preset divides by the norm alone.
  out = _ns(x, steps=0, backend="xla")
  np.testing.assert_allclose(out, x64 / np.linalg.norm(x64), rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------ Gram Newton-Schulz, AOL, dion


def _decaying(shape, seed=0, power=1.5):
  """Random singular vectors, singular values 1 / k^power: a gradient-like spectrum."""
  rng = np.random.default_rng(seed)
  r, c = shape
  k = min(r, c)
  u = np.linalg.qr(rng.standard_normal((r, k)))[0]
  v = np.linalg.qr(rng.standard_normal((c, k)))[0]
  return jnp.asarray((u / np.arange(1, k + 1) ** power) @ v.T, jnp.float32)


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


def _numpy_gram(x, coeffs, restarts=(), eps=1e-7):
  """Float64 numpy Gram iteration written from the algorithm: X_t = Q_t X_0 with
  Q_{t+1} = Q_t P_t, R_{t+1} = P_t R_t P_t, P_t = a I + b R_t + c R_t^2; a restart sets
  X = Q X, R = X X^T, Q = I."""
  x = np.asarray(x, np.float64)
  tall = x.shape[0] > x.shape[1]
  x = (x.T if tall else x) / (np.linalg.norm(x) + eps)
  eye = np.eye(x.shape[0])
  r, q = x @ x.T, eye
  for i, (a, b, c) in enumerate(coeffs):
    if i in restarts:
      x, q = q @ x, eye
      r = x @ x.T
    p = a * eye + b * r + c * r @ r
    q, r = q @ p, p @ r @ p
  x = q @ x
  return x.T if tall else x


def test_gram_algorithm_is_the_standard_polynomial_in_float64():
  # The numpy re-derivation: without rounding, Gram's Q_t X_0 is the standard iterate.
  x = _decaying((48, 160), seed=1)
  for coeffs in ([STANDARD_COEFFS] * 5, POLAR_EXPRESS_COEFFS[:5]):
    want = _numpy_ns(x, coeffs)
    for restarts in ((), (2,), (2, 4)):
      np.testing.assert_allclose(_numpy_gram(x, coeffs, restarts), want, atol=1e-10)


@pytest.mark.parametrize("shape,kind", [((64, 256), "gauss"), ((96, 320), "decaying"),
                                        ((320, 96), "decaying"), ((3, 48, 160), "gauss")])
def test_gram_equals_standard_in_float32(shape, kind):
  # Done-when of the method: the standard iteration's output to 1e-3 (relative Frobenius) in
  # float32, with the same coefficients and steps; measured up to 5e-4 on decaying spectra.
  x = _decaying(shape, seed=2) if kind == "decaying" else _matrix(shape, seed=2)
  for coeffs in ("standard", "dion"):
    gram = _ns(x, coeffs=coeffs, method="gram", backend="xla")
    standard = _ns(x, coeffs=coeffs, backend="xla")
    assert _rel(gram, standard) < 1e-3, (coeffs, _rel(gram, standard))
  if len(shape) == 2:
    want = _numpy_gram(x, [STANDARD_COEFFS] * 5)
    got = _ns(x, method="gram", backend="xla")
    assert _rel(got, want) < 1e-3


def test_gram_without_symmetrising_r_drifts():
  # Why R is symmetrised after each update: the same iteration without it ends farther from the
  # standard one on a decaying spectrum. How much farther depends on the CPU's matmul kernels:
  # measured 1.2e-3 against 4.5e-4 (2.7x) on an AVX-512 host, 1.34e-3 against 8.4e-4 (1.6x) on an
  # AVX2 one (the standard iterate is within 1e-5 of float64 numpy on both).
  from stablejax.muon import gram
  x = _decaying((256, 1024), seed=3)
  xn = _normalised(x)
  standard = _ns(x, backend="xla")
  # each jitted by a jax.jit of its own: traced with and without _symmetrise
  with_sym = jax.jit(lambda y: gram.iterations(y, (STANDARD_COEFFS,) * 5, ()))(xn)
  assert _rel(with_sym, standard) < 1e-3
  original = gram._symmetrise
  try:
    gram._symmetrise = lambda r: r
    without = jax.jit(lambda y: gram.iterations(y, (STANDARD_COEFFS,) * 5, ()))(xn)
  finally:
    gram._symmetrise = original
  assert _rel(without, standard) > 1.25 * _rel(with_sym, standard)


def test_gram_bfloat16_restart_keeps_it_as_close_as_the_standard_iteration():
  # The documented bfloat16 tolerance: Gram's distance to the float32 result is at most 2.5x
  # the standard bfloat16 iteration's own (measured up to 2.5x over Gaussian, decaying and
  # low-rank inputs, 1.5x here), and within 0.03 of the standard bfloat16 result on a Gaussian
  # matrix. Without the restart it is off by more than the result's own norm.
  x = _decaying((64, 256), seed=4)
  ref32 = _ns(x, backend="xla")
  xb = x.astype(jnp.bfloat16)
  standard = _ns(xb, backend="xla")
  gram = _ns(xb, method="gram", backend="xla")
  assert gram.dtype == jnp.bfloat16
  assert _rel(gram, ref32) <= 2.5 * _rel(standard, ref32)
  unrestarted = _ns(xb, method="gram", backend="xla", gram_restarts=())
  assert _rel(unrestarted, ref32) > 1.0
  g = _matrix((64, 256), seed=5, dtype=jnp.bfloat16)
  assert _rel(_ns(g, method="gram", backend="xla"),
              _ns(g, backend="xla")) < 0.03


def test_gram_bfloat16_polar_express_on_a_low_rank_matrix():
  # The hardest case measured: bfloat16, the large first polar_express coefficients, a spectrum
  # of 8 directions and noise at 1e-4. Gram stays within 0.36 of the standard bfloat16 result
  # (RZ not transposed in R's update; transposed, 1.1).
  rng = np.random.default_rng(0)
  u = np.linalg.qr(rng.standard_normal((128, 128)))[0]
  v = np.linalg.qr(rng.standard_normal((512, 128)))[0]
  s = np.concatenate([np.geomspace(1, 0.1, 8), np.full(120, 1e-4)])
  x = jnp.asarray((u * s) @ v.T, jnp.bfloat16)
  gram = _ns(x, coeffs="polar_express", method="gram", backend="xla")
  assert _rel(gram, _ns(x, coeffs="polar_express", backend="xla")) < 0.5


def test_gram_runs_where_it_saves_flops_and_its_flop_count():
  from stablejax.muon import gram
  n, m = 64, 256
  # Hand counts (multiply-adds): standard 5 (2 n^2 m + n^3); Gram without restart n^2 m twice,
  # Z 5x, Q 4x, the R update 4x2; with a restart before step 2 two more n^2 m, one Q and one
  # R update fewer.
  assert gram.flops(n, m, 5, method="standard") == 2 * 5 * (2 * n * n * m + n**3)
  assert gram.flops(n, m, 5) == 2 * (2 * n * n * m + 17 * n**3)
  assert gram.flops(n, m, 5, (2,)) == 2 * (4 * n * n * m + 14 * n**3)
  assert gram.uses_gram(64, 256, 5, ()) and gram.uses_gram(64, 256, 5, (2,))
  assert not gram.uses_gram(64, 64, 5, ()) and not gram.uses_gram(64, 96, 5, (2,))
  assert gram.default_restarts(5, jnp.bfloat16) == (2,)
  assert gram.default_restarts(8, jnp.float16) == (2, 5)
  assert gram.default_restarts(5, jnp.float32) == ()
  square = _matrix((64, 64), seed=6)
  np.testing.assert_array_equal(_ns(square, method="gram", backend="xla"),
                                _ns(square, backend="xla"))
  with pytest.raises(ValueError, match="method"):
    stablejax.newton_schulz(square, method="fast")
  with pytest.raises(ValueError, match="step index"):
    stablejax.newton_schulz(square, method="gram", gram_restarts=(0,))
  with pytest.raises(ValueError, match="preconditioning"):
    stablejax.newton_schulz(square, preconditioning="spectral")


@pytest.mark.parametrize("shape", [(64, 128), (128, 48), (3, 32, 40)])
def test_aol_matches_optax(shape):
  x = _matrix(shape, seed=7)
  dims = None if len(shape) == 2 else __import__("optax").contrib.MuonDimensionNumbers(1, 2)
  for steps in (4, 5):
    want = _optax_ns(x, jnp.asarray(STANDARD_COEFFS), steps,
                                           preconditioning="aol", dimension_numbers=dims)
    got = _ns(x, steps=steps, preconditioning="aol", backend="xla")
    np.testing.assert_allclose(got, want, atol=2e-5)
    gram = _ns(x, steps=steps, preconditioning="aol", method="gram",
                                   backend="xla")
    assert _rel(gram, want) < 1e-3


def test_aol_rescales_rows_by_their_absolute_gram_sums():
  # Turbo-Muon's first step against numpy: X <- D^-1/2 X with D = diag(sum_j |X X^T|_ij); the
  # spectral norm is then at most 1 (almost-orthogonal-layer bound).
  from stablejax.muon.newton_schulz import aol_precondition
  x = np.asarray(_decaying((40, 72), seed=8)) * np.linspace(0.1, 3.0, 40, dtype=np.float32)[:, None]
  x64 = np.asarray(x, np.float64)
  gram = x64 @ x64.T
  scaled = x64 / np.sqrt(np.abs(gram).sum(axis=1))[:, None]
  precondition = jax.jit(aol_precondition)  # eagerly, each operation compiles on its own
  got_x, got_gram = precondition(x, x @ x.T)
  np.testing.assert_allclose(got_x, scaled, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(got_gram, scaled @ scaled.T, rtol=1e-4, atol=1e-7)
  assert np.linalg.norm(scaled, 2) <= 1.0 + 1e-12
  zero_x, _ = precondition(np.zeros((4, 8), np.float32), np.zeros((4, 4), np.float32))
  assert np.all(np.asarray(zero_x) == 0)


def test_dion_coefficients_match_optax():
  from optax.contrib._muon import _DION_NS_COEFFS
  per_step, factor = resolve_coeffs("dion", 7)
  assert per_step[:5] == tuple(tuple(t) for t in _DION_NS_COEFFS) and factor == 1.0
  assert per_step[5] == per_step[6] == per_step[4]
  x = _matrix((64, 160), seed=9)
  want = _optax_ns(x, jnp.asarray(_DION_NS_COEFFS), 5, eps=1e-8)
  np.testing.assert_allclose(_ns(x, coeffs="dion", eps=1e-8, backend="xla"),
                             want, atol=2e-5)
  aol = _optax_ns(x, jnp.asarray(_DION_NS_COEFFS), 5,
                                        preconditioning="aol")
  np.testing.assert_allclose(_ns(x, coeffs="dion", preconditioning="aol",
                                                     backend="xla"), aol, atol=2e-5)


def _polar_error(x, o):
  u, _, vt = np.linalg.svd(np.asarray(x, np.float64), full_matrices=False)
  return np.linalg.norm(np.asarray(o, np.float64) - u @ vt) / np.linalg.norm(u @ vt)


def test_turbo_muon_four_steps_beat_five_standard_steps_on_a_random_matrix():
  # Turbo-Muon's setup (AOL, the last four "dion" triples) against Jordan's 5 steps: a lower
  # polar error ||O - U V^T|| / ||U V^T|| on a Gaussian matrix (docs/kernels.md measures GPT-2
  # shapes, decaying spectra and real gradients, where it is not always so).
  from stablejax.muon.newton_schulz import DION_COEFFS
  assert resolve_coeffs("dion", 4, from_end=True)[0] == DION_COEFFS[1:]
  assert resolve_coeffs("dion", 4)[0] == DION_COEFFS[:4]
  x = _matrix((96, 384), seed=10)
  five = _polar_error(x, _ns(x, steps=5, backend="xla"))
  turbo = _ns(x, steps=4, coeffs="dion", preconditioning="aol",
                                  backend="xla")
  np.testing.assert_allclose(turbo, _ns(
      x, steps=4, coeffs=DION_COEFFS[1:], preconditioning="aol", backend="xla"), atol=0)
  assert _polar_error(x, turbo) < 0.5 * five, (_polar_error(x, turbo), five)


@pytest.mark.parametrize("platform", ["triton", "mosaic"])
def test_gram_and_aol_kernels_interpret_match_reference(platform):
  x = _matrix((2, 64, 256), seed=11)
  for method, precond in (("gram", "frobenius"), ("gram", "aol"), ("standard", "aol")):
    if platform == "mosaic":  # the dispatcher interprets the machine's kernel; call Mosaic's
      it, _ = ns_mod.resolve_iteration("standard", 3, method, precond)
      xn = _normalised(x)
      got, want = _iterate(xn, it, "mosaic", True), _iterate(xn, it, None, False)
    else:
      got = _ns(x, steps=3, backend="pallas", interpret=True, method=method,
                preconditioning=precond)
      want = _ns(x, steps=3, backend="xla", method=method,
                                     preconditioning=precond)
    np.testing.assert_allclose(got, want, atol=1e-4 * float(np.abs(np.asarray(want)).max()))
  xb = x.astype(jnp.bfloat16)
  got = _ns(xb, backend="pallas", interpret=True, method="gram")
  want = _ns(xb, backend="xla", method="gram")
  assert got.dtype == jnp.bfloat16
  assert np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32)).max() < 0.05


def _export_gram(platform, shape, dtype, **kw):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    exported = jax.export.export(
        jax.jit(functools.partial(stablejax.newton_schulz, backend="pallas", method="gram", **kw)),
        platforms=[platform],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)],
    )(jax.ShapeDtypeStruct(shape, dtype))
  return exported.mlir_module()


@pytest.mark.parametrize("platform,call", [("cuda", f"custom_call @{TRITON_CALL}("),
                                           ("tpu", "custom_call @tpu_custom_call(")])
def test_export_gram_kernels_for_cuda_and_tpu(platform, call):
  # One kernel per product: float32 (no restart) R_0, 3 + 4 + 4 + 4 + 2 per step, Q X: 19;
  # bfloat16 (restart before step 2): 18. AOL adds none (its rescaling is elementwise).
  assert _export_gram(platform, (2, 256, 1024), jnp.float32).count(call) == 19
  assert _export_gram(platform, (1024, 256), jnp.bfloat16).count(call) == 18
  assert _export_gram(platform, (256, 1024), jnp.float32, preconditioning="aol").count(call) == 19
  other = "tpu_custom_call" if platform == "cuda" else TRITON_CALL
  assert other not in _export_gram(platform, (256, 1024), jnp.float32)
