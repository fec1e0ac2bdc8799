"""Gram Newton-Schulz: the Newton-Schulz iterations run on the small Gram matrix ``X X^T``.

Zhang, Amsel, Chen and Dao, "Gram Newton-Schulz: A Fast, Hardware-Aware Newton-Schulz Algorithm
for Muon" (Dao AI Lab, 2026, https://dao-ailab.github.io/blog/2026/gram-newton-schulz/). Every
quintic step ``X' = a X + (b A + c A^2) X`` with ``A = X X^T`` multiplies ``X`` on the left by
``P = a I + b A + c A^2``, a polynomial in ``A``. So after ``t`` steps ``X_t = Q_t X_0`` with
``Q_t = P_{t-1} ... P_0``, and ``A_t = X_t X_t^T = P_{t-1} A_{t-1} P_{t-1}``: the whole iteration
can run on ``n x n`` matrices (``n <= m`` the short side of an ``n x m`` matrix) and touch ``X``
twice, once for ``R_0 = X_0 X_0^T`` and once for ``Q X_0`` at the end. Per step::

    Z  = b R + c R R                      (1 n x n x n product)
    Q  = Q (a I + Z)                      (1; the first step of a run: Q = a I + Z)
    RZ = R (a I + Z)                      (1; not after the last step of a run)
    R  = (a I + Z) RZ                     (1; idem)

against ``2 n^2 m + n^3`` multiply-adds for a standard step. All of ``R``, ``Z``, ``Q`` are
polynomials in ``R_0``, so they are symmetric and commute, and the products use that (``Q Z^T``
for ``Q Z``; the kernels' ``NT`` form, ``lhs @ rhs^T``), except ``(a I + Z) RZ``: rounding leaves
``RZ`` slightly asymmetric, and its transpose there compounds (with the ``polar_express``
coefficients in bfloat16, to 2.5x to 3x the distance from the standard iteration).

**Rounding.** Errors in ``R`` compound through the ``P R P`` updates, and the polynomials amplify
them in the directions of small singular values. Two things hold them back. ``R`` is made exactly
symmetric after each update (``(R + R^T) / 2``, an elementwise pass): its asymmetric part is pure
rounding, and without this the float32 iteration drifts from the standard one by up to 2e-3
(relative Frobenius) on matrices with decaying spectra; with it, by at most 5e-4 with the
standard coefficients. A **restart** materialises ``X = Q X`` and recomputes ``R = X X^T`` before a
step (two ``n^2 m`` products), which resets the error: bfloat16 needs it (without one the result
is off by orders of magnitude on a decaying spectrum; with one before step 2, as the reference
implementation restarts, it is as far from the float32 result as the standard bfloat16 iteration
is). :func:`default_restarts`: for 16-bit dtypes before step 2 and every third step after it, for
float32 none (errors measured in docs/kernels.md).

**When it pays.** Without a restart, 5 steps cost ``2 n^2 m + 17 n^3`` multiply-adds against
``5 (2 n^2 m + n^3)``; with one, ``4 n^2 m + 14 n^3``: fewer only when ``m > 1.5 n`` either way.
:func:`uses_gram` compares the counts of both (:func:`flops`), and
:func:`stablejax.newton_schulz` with ``method="gram"`` runs the standard iteration on shapes where
Gram would cost more (square attention matrices, for instance). Both compute the same polynomial
of ``X``; only the rounding differs.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional, Sequence

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

# fused(lhs, rhs, addend, *, alpha, beta, trans_rhs) = alpha * addend + beta * lhs @ op(rhs),
# accumulated in float32 and rounded to lhs.dtype: the XLA form below, or the Pallas kernel.
FusedMatmul = Callable[..., jax.Array]
# (x, gram) -> (x, gram): a rescaling of X and its Gram matrix before the first step (AOL).
Precondition = Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]


def xla_matmul(lhs: jax.Array, rhs: jax.Array, addend: Optional[jax.Array], *, alpha: float,
               beta: float, trans_rhs: bool) -> jax.Array:
  """``alpha * addend + beta * lhs @ op(rhs)`` batched over leading axes: f32 accumulation, one
  rounding to ``lhs.dtype`` (the arithmetic of :func:`stablejax.muon._pallas_ns.fused_matmul`)."""
  batch = tuple(range(lhs.ndim - 2))
  contract = ((lhs.ndim - 1,), (rhs.ndim - 1 if trans_rhs else rhs.ndim - 2,))
  out = jax.lax.dot_general(lhs, rhs, (contract, (batch, batch)),
                            preferred_element_type=jnp.float32)
  if beta != 1.0:
    out = beta * out
  if addend is not None:
    out = out + alpha * addend.astype(jnp.float32)
  return out.astype(lhs.dtype)


def default_restarts(steps: int, dtype: DTypeLike = jnp.float32) -> tuple[int, ...]:
  """The steps before which the iteration restarts: for a 16-bit (or narrower) ``dtype`` 2, 5,
  8, ... below ``steps``; none for float32 and wider (see the module docstring)."""
  if jnp.dtype(dtype).itemsize > 2:
    return ()
  return tuple(range(2, steps, 3))


def _symmetrise(r: jax.Array) -> jax.Array:
  rf = r.astype(jnp.float32)
  return (0.5 * (rf + jnp.swapaxes(rf, -1, -2))).astype(r.dtype)


def check_restarts(restarts: Iterable[int], steps: int) -> tuple[int, ...]:
  """``restarts`` as a sorted tuple of step indices in ``1 .. steps - 1``, or a clear error."""
  try:
    found = tuple(sorted({int(i) for i in restarts}))
  except (TypeError, ValueError):
    raise ValueError(f"gram_restarts must be a sequence of step indices, got {restarts!r}"
                     ) from None
  if any(isinstance(i, bool) for i in restarts) or any(not 1 <= i < steps for i in found):
    raise ValueError(f"gram_restarts {restarts!r}: each restart is a step index from 1 to "
                     f"steps - 1 = {steps - 1} (step 0 is the start itself)")
  return found


def flops(n: int, m: int, steps: int, restarts: Sequence[int] = (), method: str = "gram") -> int:
  """FLOPs (2 per multiply-add) of ``steps`` iterations on one ``n x m`` matrix, ``n <= m``.

  ``method="standard"``: ``2 n^2 m + n^3`` multiply-adds per step. ``"gram"``: the products of
  the module docstring (``n^2 m`` for ``R_0`` and for the final ``Q X``, two per restart, and the
  ``n^3`` ones), the symmetry of ``R``, ``Z`` and ``Q`` not discounted. Elementwise work not
  counted.

  Example:
    >>> from stablejax.muon.gram import flops
    >>> flops(768, 3072, 5) / flops(768, 3072, 5, method="standard")  # 25 / 45
    0.5555555555555556
    >>> flops(768, 3072, 5, (2,)) / flops(768, 3072, 5, method="standard")  # a restart: 30 / 45
    0.6666666666666666
  """
  if method == "standard":
    return 2 * steps * (2 * n * n * m + n**3)
  if steps == 0:
    return 0
  starts = {0, *restarts}
  macs = 2 * n * n * m + 2 * n * n * m * len(starts - {0})  # R_0, final Q X; X and R per restart
  for i in range(steps):
    macs += n**3  # Z
    if i not in starts:
      macs += n**3  # Q (a I + Z)
    if i + 1 < steps and i + 1 not in starts:
      macs += 2 * n**3  # R (a I + Z), then (a I + Z) RZ
  return 2 * macs


def uses_gram(n: int, m: int, steps: int, restarts: Sequence[int]) -> bool:
  """Whether the Gram iteration takes fewer FLOPs than the standard one on ``n x m``."""
  return steps > 0 and flops(n, m, steps, restarts) < flops(n, m, steps, method="standard")


def iterations(x: jax.Array, coeffs: Sequence[Sequence[float]], restarts: Sequence[int],
               matmul: FusedMatmul = xla_matmul,
               precondition: Optional[Precondition] = None) -> jax.Array:
  """Gram Newton-Schulz on a normalised ``[..., n, m]`` array (``n <= m``).

  Args:
    x: the normalised input in the compute dtype.
    coeffs: one ``(a, b, c)`` per step.
    restarts: steps before which ``X = Q X`` and ``R = X X^T`` are recomputed.
    matmul: the fused product (:func:`xla_matmul`, or the Pallas kernel with the same signature
      and arithmetic); every ``R``, ``Z``, ``Q`` is rounded to ``x.dtype`` as it is produced.
    precondition: applied to ``(X, R_0)`` before the first step (Turbo-Muon's AOL).

  Returns:
    The iterate after ``len(coeffs)`` steps, same shape and dtype as ``x``.
  """
  if not coeffs:
    return x
  dtype = x.dtype
  steps = len(coeffs)
  eye = jnp.eye(x.shape[-2], dtype=jnp.float32)
  r = matmul(x, x, None, alpha=0.0, beta=1.0, trans_rhs=True)
  if precondition is not None:
    x, r = precondition(x, r)
  q: Optional[jax.Array] = None
  for i, (a, b, c) in enumerate(coeffs):
    if i in restarts and q is not None:
      x = matmul(q, x, None, alpha=0.0, beta=1.0, trans_rhs=False)
      r = matmul(x, x, None, alpha=0.0, beta=1.0, trans_rhs=True)
      q = None
    z = matmul(r, r, r, alpha=b, beta=c, trans_rhs=True)
    if q is None:
      q = (z.astype(jnp.float32) + a * eye).astype(dtype)
    else:
      q = matmul(q, z, q, alpha=a, beta=1.0, trans_rhs=True)
    if i + 1 < steps and i + 1 not in restarts:
      rz = matmul(r, z, r, alpha=a, beta=1.0, trans_rhs=True)
      r = _symmetrise(matmul(z, rz, rz, alpha=a, beta=1.0, trans_rhs=False))
  assert q is not None
  return matmul(q, x, None, alpha=0.0, beta=1.0, trans_rhs=False)
