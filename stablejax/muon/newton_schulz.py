"""Newton-Schulz orthogonalisation: XLA reference, Pallas kernels, and a per-platform dispatcher.

Muon (Jordan et al., https://github.com/KellerJordan/modded-nanogpt; Liu et al., arXiv 2502.16982)
replaces a momentum matrix ``M`` by an approximation of its polar factor ``U V^T`` computed with a
few quintic Newton-Schulz iterations ``X <- a X + (b A + c A A) X`` with ``A = X X^T``.

Coefficient presets:

* ``"standard"``: Jordan's fixed quintic (3.4445, -4.7750, 2.0315). It does not converge to
  ``U V^T``; it maps each singular value ``s`` of the Frobenius-normalised input (``s =
  sigma / ||X||_F``, so the ``s`` of a matrix sum to at most 1 in squares) on its own, and after
  5 steps: ``s >= 0.0052`` lands in [0.68, 1.13] (what Muon wants, a cheap, coarse polar factor);
  ``0.0015 <= s < 0.0052`` overshoots up to 1.21; smaller ``s`` stays below 0.68, about
  ``480 s`` (so directions far weaker than the rest are not blown up to 1). A matrix of rank ``r``
  with equal singular values has ``s = 1 / sqrt(r)``, inside the first range up to ``r`` of
  about 37,000. Measured by iterating the scalar polynomial; ``newton_schulz`` follows it to
  about 1e-6 in float32 and 0.03 in bfloat16 (tests/test_newton_schulz.py).
* ``"polar_express"``: the per-iteration optimal coefficients of Amsel et al., "The Polar Express:
  Optimal Matrix Sign Methods and Their Application to the Muon Algorithm", arXiv 2505.16932,
  Algorithm 1 (degree 5): the eight published triples, each but the last divided by the paper's
  safety factor (a / 1.01, b / 1.01^3, c / 1.01^5); iterations past the eighth repeat the last
  triple (1.875, -1.25, 0.375), and the input is normalised by ``1.01 * ||X||_F`` as in the paper.

* ``"dion"``: the five per-step triples that ``optax.contrib.muon(ns_coeffs="dion")`` ships
  (Ahn et al., "Dion: Distributed Orthonormalized Updates", arXiv 2504.05295), with the input
  divided by ``||X||_F`` as the standard preset; steps past the fifth repeat the last triple
  (optax refuses ``ns_steps`` below 5 for this preset and runs the five triples for any more).

Methods (``method=``): ``"standard"`` iterates on ``X``; ``"gram"`` runs the same polynomial on
the small Gram matrix ``X X^T`` and applies it to ``X`` once (Gram Newton-Schulz,
:mod:`stablejax.muon.gram`), with restarts for low-precision stability, on the shapes where that
takes fewer FLOPs (``m > 1.5 n`` for 5 steps; the standard iteration on the others).

Preconditioning (``preconditioning=``): ``"frobenius"`` divides the input by its Frobenius
norm; ``"aol"`` (Turbo-Muon, Boissin et al., arXiv 2512.04632, as ``optax.contrib.muon(...,
preconditioning="aol")``) then rescales the rows of ``X`` by ``1 / sqrt(sum_j |A_ij|)`` with ``A
= X X^T`` (the "almost orthogonal layer" bound: the spectral norm becomes at most 1, most
singular values far larger than after the Frobenius division), inside the first step, which
reuses that ``A``. A coefficient list longer than ``steps`` is then used from its end: Turbo-Muon
runs AOL with the last four of the ``"dion"`` triples, the start AOL gives needing no first,
most aggressive step. How close that comes to the orthogonality of five steps without AOL is
measured in docs/kernels.md.

Backends: ``"xla"`` is the plain ``jnp`` reference, ``"pallas"`` the kernels of
:mod:`stablejax.muon._pallas_ns`, and ``"auto"`` the kernel of the machine's accelerator: on a
GPU or TPU host the Triton (CUDA) or Mosaic (TPU) kernel, chosen at lowering time with
``jax.lax.platform_dependent`` (the reference for other lowering targets and for any shape the
kernel cannot tile); on a host without one (CPU) the reference alone, so no kernel is traced
for nothing. ``"pallas"`` traces both kernels, so a function jitted on a CPU machine and exported
with ``jax.export`` for ``platforms=["cuda"]`` or ``["tpu"]`` carries the kernel for that
platform.
"""

from __future__ import annotations

import functools
import math
import types
import warnings
from typing import NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from stablejax.muon import gram as _gram
from stablejax.muon import sharding as _sharding


def _pallas() -> types.ModuleType:
  """The Pallas kernels (:mod:`stablejax.muon._pallas_ns`), imported when a kernel is traced:
  importing Pallas adds about 0.1 s to every start, and a run on CPU never uses it."""
  from stablejax.muon import _pallas_ns
  return _pallas_ns


STANDARD_COEFFS = (3.4445, -4.7750, 2.0315)

# arXiv 2505.16932, Algorithm 1 (degree-5 Polar Express), before the safety factor.
_POLAR_EXPRESS_RAW = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)
_PE_SAFETY = 1.01
POLAR_EXPRESS_COEFFS = tuple(
    (a / _PE_SAFETY, b / _PE_SAFETY**3, c / _PE_SAFETY**5) for a, b, c in _POLAR_EXPRESS_RAW[:-1]
) + (_POLAR_EXPRESS_RAW[-1],)

# optax.contrib's _DION_NS_COEFFS (optax 0.2.8), the "dion" preset of optax.contrib.muon.
DION_COEFFS = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)

CoeffsSpec = Union[str, Sequence[float], Sequence[Sequence[float]]]
BACKENDS = ("auto", "xla", "pallas")
METHODS = ("standard", "gram")
PRECONDITIONINGS = ("frobenius", "aol")
# optax.contrib's floor on the AOL row sums (its _aol_first_newton_schulz_iteration default).
AOL_EPS = 1e-8
_ACCELERATORS = ("gpu", "cuda", "tpu")


Triple = tuple[float, float, float]


def resolve_coeffs(coeffs: CoeffsSpec, steps: int,
                   from_end: bool = False) -> tuple[tuple[Triple, ...], float]:
  """Turns a ``coeffs`` argument into one ``(a, b, c)`` triple per step and a norm factor.

  Args:
    coeffs: "standard", "polar_express", "dion", one triple (used at every step), or a list of
      triples (step ``i`` uses entry ``i``; steps beyond the list repeat its last entry).
    steps: number of iterations (>= 0).
    from_end: a list longer than ``steps`` is used from its end (its last ``steps`` triples), as
      Turbo-Muon does with AOL, whose start needs none of the first, most aggressive triples.

  Returns:
    ``(per_step_coeffs, norm_factor)``; the input is divided by ``norm_factor * ||X||_F``.
  """
  if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
    raise ValueError(f"steps must be a non-negative int, got {steps!r}")
  norm_factor = 1.0
  table: tuple[tuple[float, ...], ...]
  if isinstance(coeffs, str):
    if coeffs == "standard":
      table = (STANDARD_COEFFS,)
    elif coeffs == "polar_express":
      table = POLAR_EXPRESS_COEFFS
      norm_factor = _PE_SAFETY
    elif coeffs == "dion":
      table = DION_COEFFS
    else:
      raise ValueError(f"unknown coeffs preset {coeffs!r}; use 'standard', 'polar_express', "
                       "'dion' or (a, b, c) tuples")
  else:
    try:
      seq = [float(v) for v in coeffs]  # type: ignore[arg-type]  # a single triple
      table = (tuple(seq),)
    except TypeError:
      table = tuple(tuple(float(v) for v in triple)  # type: ignore[union-attr]
                    for triple in coeffs)
    if not table or any(len(t) != 3 for t in table):
      raise ValueError(
          f"coeffs must be one (a, b, c) triple or a non-empty list of triples, got {coeffs!r}")
  if from_end and 0 < steps < len(table):
    table = table[-steps:]
  per_step = tuple(_triple(table[min(i, len(table) - 1)]) for i in range(steps))
  return per_step, norm_factor


def _triple(t: Sequence[float]) -> Triple:
  return (t[0], t[1], t[2])


def frobenius_norm(x: jax.Array) -> jax.Array:
  """float32 Frobenius norm of each matrix (last two axes) of ``x``, shape ``x.shape[:-2]``."""
  xf = x.astype(jnp.float32)
  return jnp.sqrt(jnp.sum(xf * xf, axis=(-2, -1)))


def _normalise(x: jax.Array, eps: float, norm_factor: float,
               norm: Optional[jax.Array] = None) -> jax.Array:
  """Frobenius-normalises the last two axes, computing the norm in f32 (unless given)."""
  xf = x.astype(jnp.float32)
  norm = frobenius_norm(x) if norm is None else norm
  return (xf / (norm[..., None, None] * norm_factor + eps)).astype(x.dtype)


def _mm(lhs: jax.Array, rhs: jax.Array, trans_rhs: bool) -> jax.Array:
  """``lhs @ rhs`` (``rhs^T`` with ``trans_rhs``) over the last two axes, batched over the rest,
  accumulated in f32: the ``dot_general`` that ``einsum("...ik,...jk->...ij")`` lowers to, bound
  directly (a Muon step makes 15 of them per matrix; einsum's parsing dominated their tracing)."""
  batch = tuple(range(lhs.ndim - 2))
  contract = ((lhs.ndim - 1,), (rhs.ndim - 1 if trans_rhs else rhs.ndim - 2,))
  return jax.lax.dot_general(lhs, rhs, (contract, (batch, batch)),
                             preferred_element_type=jnp.float32)


def aol_precondition(x: jax.Array, gram: jax.Array,
                     eps: float = AOL_EPS) -> tuple[jax.Array, jax.Array]:
  """Turbo-Muon's AOL rescaling of ``X`` and its Gram matrix ``A = X X^T`` (arXiv 2512.04632).

  Row ``i`` of ``X`` is multiplied by ``s_i = 1 / sqrt(max(sum_j |A_ij|, eps))`` and ``A`` by
  ``s_i s_j``, so ``A`` stays the Gram matrix of the rescaled ``X`` without a new product (as
  ``optax.contrib``'s ``_aol_first_newton_schulz_iteration``). The rescaled ``X`` has spectral
  norm at most 1 (Prach and Lampert's almost-orthogonal-layer bound) and, for a matrix that is
  not already row-scaled, singular values much closer to 1 than after a Frobenius division.

  Args:
    x: ``[..., n, m]``.
    gram: ``x x^T``, ``[..., n, n]``.
    eps: floor on the row sums (a zero row stays zero).

  Returns:
    ``(x, gram)`` rescaled, in their own dtypes (scaled in float32, rounded once).
  """
  rows = jnp.sum(jnp.abs(gram.astype(jnp.float32)), axis=-1)
  scale = jax.lax.rsqrt(jnp.maximum(rows, eps))
  x = (x.astype(jnp.float32) * scale[..., :, None]).astype(x.dtype)
  gram = (gram.astype(jnp.float32) * scale[..., :, None] * scale[..., None, :]).astype(gram.dtype)
  return x, gram


def reference_iterations(x: jax.Array, coeffs: Sequence[Sequence[float]],
                         precondition: Optional[_gram.Precondition] = None) -> jax.Array:
  """XLA reference of the iterations on a normalised ``[..., n, m]`` array (``n <= m``).

  Every product accumulates in f32; ``A``, ``B`` and ``X`` are rounded to the input dtype after
  each fused ``scale + product`` exactly as the Pallas kernel does. ``precondition`` rescales
  the first step's ``X`` and ``A`` (:func:`aol_precondition`).
  """
  dtype = x.dtype
  for i, (a, b, c) in enumerate(coeffs):
    gram = _mm(x, x, True).astype(dtype)
    if i == 0 and precondition is not None:
      x, gram = precondition(x, gram)
    poly = (b * gram.astype(jnp.float32) + c * _mm(gram, gram, True)).astype(dtype)
    x = (a * x.astype(jnp.float32) + _mm(poly, x, False)).astype(dtype)
  return x


class Iteration(NamedTuple):
  """How the iterations run: one ``(a, b, c)`` per step, the method, AOL, the Gram restarts."""
  per_step: tuple
  method: str = "standard"
  aol: bool = False
  restarts: tuple = ()


def resolve_iteration(coeffs: CoeffsSpec, steps: int, method: str = "standard",
                      preconditioning: str = "frobenius",
                      gram_restarts: Optional[Sequence[int]] = None,
                      dtype: DTypeLike = jnp.float32) -> tuple[Iteration, float]:
  """Validates the arguments of :func:`newton_schulz`: ``(Iteration, norm_factor)``; the Gram
  restarts default to those of ``dtype`` (the compute dtype, the input's)."""
  per_step, norm_factor = resolve_coeffs(coeffs, steps, from_end=preconditioning == "aol")
  if method not in METHODS:
    raise ValueError(f"method must be one of {METHODS}, got {method!r}")
  if preconditioning not in PRECONDITIONINGS:
    raise ValueError(f"preconditioning must be one of {PRECONDITIONINGS}, got "
                     f"{preconditioning!r}")
  restarts = (_gram.default_restarts(steps, dtype) if gram_restarts is None
              else _gram.check_restarts(gram_restarts, steps))
  return Iteration(per_step, method, preconditioning == "aol", restarts), norm_factor


def _iterate(x: jax.Array, it: Iteration, platform: Optional[str] = None,
             interpret: bool = False) -> jax.Array:
  """The iterations on a normalised ``[..., n, m]`` array: XLA (``platform=None``) or the
  Pallas kernels of ``platform``."""
  n, m = x.shape[-2:]
  precondition = aol_precondition if it.aol else None
  gram = it.method == "gram" and _gram.uses_gram(n, m, len(it.per_step), it.restarts)
  if platform is None:
    if gram:
      return _gram.iterations(x, it.per_step, it.restarts, _gram.xla_matmul, precondition)
    return reference_iterations(x, it.per_step, precondition)
  flat = x.reshape((math.prod(x.shape[:-2]),) + x.shape[-2:])
  if gram:
    kernel = functools.partial(_pallas().fused_matmul, platform=platform, interpret=interpret)
    out = _gram.iterations(flat, it.per_step, it.restarts, kernel, precondition)
  else:
    out = _pallas().ns_iterations(flat, it.per_step, platform=platform, interpret=interpret,
                                  precondition=precondition)
  return out.reshape(x.shape)


def _interpret_platform() -> str:
  return "mosaic" if jax.default_backend() == "tpu" else "triton"


def newton_schulz(x: jax.Array, steps: int = 5, coeffs: CoeffsSpec = "standard",
                  eps: float = 1e-7, backend: str = "auto", interpret: bool = False, *,
                  method: str = "standard", preconditioning: str = "frobenius",
                  gram_restarts: Optional[Sequence[int]] = None) -> jax.Array:
  """Approximate polar factor ``U V^T`` of the last two axes of ``x`` by Newton-Schulz.

  Leading axes are batch axes: a scan-stacked ``[L, in, out]`` kernel is ``L`` independent
  matrices and each slice is orthogonalised on its own (by every backend). A tall matrix is
  transposed so the Gram matrix is built on the small side. The input is divided by its
  Frobenius norm (per slice), then each step computes ``A = X X^T``, ``B = b A + c A A``,
  ``X' = a X + B X`` in the input dtype with f32 accumulation.

  Args:
    x: array with ``ndim >= 2``; float32 or bfloat16 (any float dtype works with ``"xla"``).
      Under explicit sharding (``jax.set_mesh`` with ``AxisType.Explicit`` axes) a sharded
      ``x`` is gathered once, orthogonalised whole on every device and given its sharding back.
    steps: number of iterations.
    coeffs: "standard" (3.4445, -4.7750, 2.0315), "polar_express" (arXiv 2505.16932), "dion"
      (optax's five triples), one ``(a, b, c)`` tuple for every step, or a list of per-step
      tuples (the last one repeats).
    eps: added to the Frobenius norm before dividing (a zero input maps to zero).
    backend: "auto" (on a GPU/TPU host, its Pallas kernel, the XLA reference for shapes the
      kernel cannot tile, with a warning; on a CPU host, the reference), "xla" (reference), or
      "pallas" (the CUDA and TPU kernels, chosen at lowering time, e.g. for ``jax.export`` from a
      CPU host; warns and uses the reference for an untileable shape or when no GPU/TPU backend
      is present and ``interpret`` is False).
    interpret: run the Pallas kernel in interpret mode (works on CPU; slow, for testing).
      Implies the kernel for ``backend="pallas"`` and ``"auto"``.
    method: "standard", or "gram": Gram Newton-Schulz (:mod:`stablejax.muon.gram`) on shapes
      where it takes fewer FLOPs (``m > 1.5 n`` for 5 steps), the standard iteration on the
      others. The same polynomial of ``x``: float32 results agree to 5e-4 (relative Frobenius)
      or better with the standard coefficients; docs/kernels.md has the measured errors, bfloat16
      included, and times.
    preconditioning: "frobenius" (divide by the Frobenius norm) or "aol" (then Turbo-Muon's
      row rescaling inside the first step, :func:`aol_precondition`; about one step fewer for
      the same orthogonality).
    gram_restarts: the steps before which the Gram iteration restarts from ``X``; None: for a
      16-bit ``x`` step 2 and every third step after it, for float32 none
      (:func:`stablejax.muon.gram.default_restarts`).

  Returns:
    Array of the same shape and dtype as ``x``.

  Example:
    >>> import jax, jax.numpy as jnp, stablejax
    >>> g = jax.random.normal(jax.random.key(0), (256, 512))
    >>> o = stablejax.newton_schulz(g)
    >>> s = jnp.linalg.svd(o, compute_uv=False)  # in [0.68, 1.13]: g's spectrum is not tiny
    >>> wide = jax.random.normal(jax.random.key(1), (64, 256))
    >>> gram = stablejax.newton_schulz(wide, method="gram")  # 4x as wide: Gram takes fewer FLOPs
    >>> rel = jnp.linalg.norm(gram - stablejax.newton_schulz(wide)) / jnp.linalg.norm(gram)
    >>> bool(rel < 1e-3)
    True
  """
  x = jnp.asarray(x)
  if x.ndim < 2:
    raise ValueError(f"newton_schulz needs an array with ndim >= 2, got shape {x.shape}")
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
  it, norm_factor = resolve_iteration(coeffs, steps, method, preconditioning, gram_restarts,
                                      x.dtype)
  # Under explicit sharding the matrix axes must be whole on each device: one gather here, not a
  # collective (or a ShardingTypeError) in every product; the kernels then only see such arrays.
  x, restore = _sharding.gather(x)
  return restore(_newton_schulz(x, it, norm_factor, eps, backend, interpret))


def newton_schulz_given_norm(x: jax.Array, norm: jax.Array, steps: int, coeffs: CoeffsSpec,
                             eps: float, backend: str, method: str = "standard",
                             preconditioning: str = "frobenius") -> jax.Array:
  """:func:`newton_schulz` of matrices whose Frobenius norms (``frobenius_norm(x)``) the caller
  already has (Muon's health check needs them too): one reduction per matrix instead of two."""
  it, norm_factor = resolve_iteration(coeffs, steps, method, preconditioning, None, x.dtype)
  return _newton_schulz(x, it, norm_factor, eps, backend, False, norm)


def _newton_schulz(x: jax.Array, it: Iteration, norm_factor: float, eps: float,
                   backend: str, interpret: bool, norm: jax.Array | None = None) -> jax.Array:
  steps = len(it.per_step)
  transposed = x.shape[-2] > x.shape[-1]
  if transposed:
    x = jnp.swapaxes(x, -1, -2)
  n, m = x.shape[-2:]
  x = _normalise(x, eps, norm_factor, norm)
  itemsize = x.dtype.itemsize

  def ref(y: jax.Array) -> jax.Array:
    return _iterate(y, it)

  def kernel_or_ref(platform: str, y: jax.Array) -> jax.Array:
    if _pallas().ns_tileable(n, m, platform, itemsize) and steps > 0:
      return _iterate(y, it, platform)
    return ref(y)

  if backend == "xla" or steps == 0:
    out = ref(x)
  elif interpret:
    platform = _interpret_platform()
    if _pallas().ns_tileable(n, m, platform, itemsize):
      out = _iterate(x, it, platform, True)
    else:
      if backend == "pallas":
        warnings.warn(f"newton_schulz: shape {(n, m)} does not tile for the {platform} kernel; "
                      "using the XLA reference", stacklevel=3)
      out = ref(x)
  elif backend == "auto" and jax.default_backend() not in _ACCELERATORS:
    # No GPU/TPU here: only the reference is traced. Tracing the kernels for other platforms
    # (a Pallas call per product, per matrix) roughly doubled the optimizer's compile time on
    # CPU; backend="pallas" still carries them into a jax.export for CUDA or TPU.
    out = ref(x)
  else:
    current = jax.default_backend()
    if current in _ACCELERATORS:
      platform = "mosaic" if current == "tpu" else "triton"
      if not _pallas().ns_tileable(n, m, platform, itemsize):
        warnings.warn(f"newton_schulz: shape {(n, m)} does not tile for the {platform} kernel; "
                      "using the XLA reference", stacklevel=3)
    elif backend == "pallas":
      warnings.warn(f"newton_schulz: backend='pallas' has no kernel for the {current!r} backend "
                    "(pass interpret=True to run it in interpret mode); the XLA reference is "
                    "used unless the function is lowered for CUDA or TPU", stacklevel=3)
    # The kernel of the platform the function is lowered for, chosen at lowering time; with
    # backend="auto" on an accelerator, only that accelerator's kernel is traced.
    kernels = {}
    if backend == "pallas" or current in ("gpu", "cuda"):
      kernels["cuda"] = functools.partial(kernel_or_ref, "triton")
    if backend == "pallas" or current == "tpu":
      kernels["tpu"] = functools.partial(kernel_or_ref, "mosaic")
    out = jax.lax.platform_dependent(x, **kernels, default=ref)
  if transposed:
    out = jnp.swapaxes(out, -1, -2)
  return out
