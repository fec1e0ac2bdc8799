"""Outlier clamping of matrices: entries far outside a matrix's own spread are clamped back.

One exploding entry of a matrix dominates its Frobenius norm; in Muon, whose Newton-Schulz input
is normalised by that norm, it flattens every other direction of the update. Clamping the entries
that are statistical outliers of their own matrix (a z-score bound, or Tukey's inter-quartile
fences) back to the boundary keeps the matrix's shape and every other entry.
:func:`stablejax.outlier_safe_muon` clamps its Newton-Schulz input this way
(:func:`clamp_matrices`).
"""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp

OUTLIER_METHODS = (None, "zscore", "iqr")
# Above this many entries per matrix, IQR quartiles come from a strided subsample.
IQR_EXACT_MAX = 4096


def _strided_sample(x2: jax.Array, size: int) -> jax.Array:
  """``x2`` is ``[..., r, c]``; returns ``[..., k]`` with k <= IQR_EXACT_MAX entries."""
  r, c = x2.shape[-2:]
  flat = x2.reshape(x2.shape[:-2] + (r * c,))
  if size <= IQR_EXACT_MAX:
    return flat
  stride = -(-size // IQR_EXACT_MAX)
  while math.gcd(stride, c) != 1:  # coprime with the row length: visits every column
    stride += 1
  return flat[..., ::stride]


def clamp_outliers(x: jax.Array, method: Optional[str],
                   threshold: float) -> tuple[jax.Array, jax.Array]:
  """Clamps outlier entries of each matrix (last two axes) back to the boundary.

  Args:
    x: float array ``[..., rows, cols]``.
    method: ``"zscore"``: outside ``mean +- threshold * std``; ``"iqr"``: outside
      ``[Q1 - k IQR, Q3 + k IQR]`` with ``k = threshold / 2``; None: unchanged.
      Statistics are per matrix (per slice of a stacked tensor) and computed in float32.
      IQR quartiles are exact (``jnp.quantile``, a sort) up to 4096 entries; above that they come
      from a deterministic strided subsample of about 4096 entries (stride coprime with the row
      length), which keeps the per-step cost at one small sort per matrix instead of sorting
      millions of entries; quartiles of a 4096-sample are within a few percent of the exact
      ones, far below the ``k * IQR`` margin.
    threshold: see ``method``.

  Returns:
    ``(clamped, n_clamped)``: same shape and dtype as ``x``, and an int32 count of changed
    entries. A matrix with zero spread (std or IQR of 0, e.g. mostly-zero momentum) or with
    non-finite statistics is left unchanged.
  """
  clamped, per_matrix = clamp_matrices(x, method, threshold)
  return clamped, jnp.sum(per_matrix, dtype=jnp.int32)


def clamp_matrices(x: jax.Array, method: Optional[str],
           threshold: float) -> tuple[jax.Array, jax.Array]:
  """:func:`clamp_outliers` with the count per matrix (shape ``x.shape[:-2]``)."""
  if method is None:
    return x, jnp.zeros(x.shape[:-2], jnp.int32)
  xf = x.astype(jnp.float32)
  axes = (-2, -1)
  if method == "zscore":
    mean = jnp.mean(xf, axis=axes, keepdims=True)
    # jnp.std's own arithmetic (mean of squared deviations, square root), reusing the mean.
    std = jnp.sqrt(jnp.mean(jnp.square(xf - mean), axis=axes, keepdims=True))
    lo, hi = mean - threshold * std, mean + threshold * std
    spread = std
  elif method == "iqr":
    size = x.shape[-2] * x.shape[-1]
    sample = _strided_sample(xf, size)
    q1, q3 = jnp.quantile(sample, jnp.array([0.25, 0.75]), axis=-1)
    q1 = q1[..., None, None]
    q3 = q3[..., None, None]
    spread = q3 - q1
    k = threshold / 2.0
    lo, hi = q1 - k * spread, q3 + k * spread
  else:
    raise ValueError(f"outlier_method must be one of {OUTLIER_METHODS}, got {method!r}")
  active = (spread > 0) & jnp.isfinite(lo) & jnp.isfinite(hi)
  clamped = jnp.where(active, jnp.clip(xf, lo, hi), xf)
  # Counted as a float32 sum of ones (exact up to 2**24 per matrix, per row beyond): an int32
  # reduction is a separate tree of kernels on XLA:CPU for every matrix, a float sum is not.
  moved = ((clamped != xf) & jnp.isfinite(xf)).astype(jnp.float32)
  if x.shape[-2] * x.shape[-1] <= 2**24:
    n = jnp.sum(moved, axis=axes).astype(jnp.int32)
  else:
    n = jnp.sum(jnp.sum(moved, axis=-1).astype(jnp.int32), axis=-1)
  return clamped.astype(x.dtype), n

