"""Outlier clamping of matrices: entries far outside a matrix's own spread are clamped back.

One exploding entry of a matrix dominates its Frobenius norm; in Muon, whose Newton-Schulz input
is normalised by that norm, it flattens every other direction of the update. Clamping the entries
that are statistical outliers of their own matrix (a z-score bound, or Tukey's inter-quartile
fences) back to the boundary keeps the matrix's shape and every other entry.

:func:`clamp_outlier_entries` is the transform, for any optax chain (before an optimizer it
clamps the gradient; after one, the update). :func:`stablejax.outlier_safe_muon` clamps its
Newton-Schulz input with the same rule, :func:`clamp_matrices`, inside its Muon branch (the input
is the bias-corrected momentum, which no chain element sees), and counts what it clamped in its
own state.

References:
  J. W. Tukey, *Exploratory Data Analysis* (Addison-Wesley, 1977): the fences
  ``[Q1 - k IQR, Q3 + k IQR]``.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from stablejax.muon import routing
from stablejax.muon.matrices import split_fused, to_matrices
from stablejax.transforms._common import saturating_add
from stablejax.transforms.metrics import register_state_metrics

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
                   threshold: float | jax.Array) -> tuple[jax.Array, jax.Array]:
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
                   threshold: float | jax.Array) -> tuple[jax.Array, jax.Array]:
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


class OutlierClampState(NamedTuple):
  """State of :func:`clamp_outlier_entries` (arrays only).

  Attributes:
    outlier_count: int32 total number of entries clamped (saturates at int32 max).
    outlier_rate: float32 fraction of the matrix entries clamped at the last step.

  Example:
    >>> import jax.numpy as jnp, stablejax
    >>> grads = {"w": jnp.ones((8, 8)).at[0, 0].set(1e4)}
    >>> tx = stablejax.clamp_outlier_entries(threshold=5.0)
    >>> _, state = tx.update(grads, tx.init(grads))
    >>> int(state.outlier_count), round(float(state.outlier_rate), 4)  # 1 of 64 entries
    (1, 0.0156)
  """
  outlier_count: jax.Array
  outlier_rate: jax.Array


def clamp_outlier_entries(threshold: float = 5.0, method: str = "zscore",
                          weight_dimension_numbers: routing.DimensionNumbersOrFn = None
                          ) -> optax.GradientTransformation:
  """Clamps the outlier entries of every matrix of the updates back to the boundary.

  Each leaf of two or more axes is cut into its matrices (see ``weight_dimension_numbers``);
  per matrix, entries outside ``mean +- threshold * std`` (``"zscore"``) or outside Tukey's
  fences ``[Q1 - k IQR, Q3 + k IQR]`` with ``k = threshold / 2`` (``"iqr"``) are clamped to the
  bound, as :func:`clamp_outliers` does. Vectors and scalars pass through; so does a matrix
  with zero spread or non-finite statistics. This is the clamp :func:`stablejax.outlier_safe_muon`
  applies to its Newton-Schulz input, as a transform of its own.

  Args:
    threshold: z threshold for ``"zscore"``; ``2 k`` for ``"iqr"``.
    method: ``"zscore"`` or ``"iqr"``.
    weight_dimension_numbers: which axes of each leaf form its matrices, as
      :func:`stablejax.outlier_safe_muon` takes them; None: the layouts
      :func:`stablejax.muon_dimension_numbers` reads (Flax attention kernels as one matrix,
      otherwise the last two axes).

  Returns:
    An ``optax.GradientTransformation`` whose state is :class:`OutlierClampState`.

  References:
    J. W. Tukey, *Exploratory Data Analysis* (1977), the inter-quartile fences.

  Example:
    >>> import jax.numpy as jnp, optax, stablejax
    >>> grads = {"w": jnp.ones((8, 8)).at[0, 0].set(1e4), "b": jnp.ones(8)}
    >>> tx = optax.chain(stablejax.clamp_outlier_entries(threshold=5.0), optax.sgd(0.1))
    >>> updates, state = tx.update(grads, tx.init(grads))
    >>> float(updates["w"][0, 0]) > -1e3, int(state[0].outlier_count)
    (True, 1)
  """
  if method not in OUTLIER_METHODS or method is None:
    raise ValueError(f"method must be 'zscore' or 'iqr', got {method!r}")
  if isinstance(threshold, (int, float)) and not threshold > 0:
    raise ValueError(f"threshold must be > 0, got {threshold!r}")

  def init_fn(params: optax.Params) -> OutlierClampState:
    del params
    return OutlierClampState(jnp.zeros((), jnp.int32), jnp.zeros((), jnp.float32))

  def update_fn(updates: optax.Updates, state: OutlierClampState,
                params: Optional[optax.Params] = None
                ) -> tuple[optax.Updates, OutlierClampState]:
    del params
    treedef: Any  # jaxlib ships no type stub for PyTreeDef: its methods are unknown to mypy
    leaves, treedef = jax.tree.flatten(updates)
    layouts = routing.matrix_layouts(updates, weight_dimension_numbers)
    new_leaves, counts, n_entries = [], [], 0
    for u, dims in zip(leaves, (d for d in layouts if d is not None)):
      if u.ndim < 2:
        new_leaves.append(u)
        continue
      pieces, join = split_fused(u, dims)
      outs = []
      for piece, piece_dims in pieces:
        x, back = to_matrices(piece, piece_dims)
        clamped, n = clamp_matrices(x, method, threshold)
        outs.append(back(clamped))
        counts.append(jnp.sum(n, dtype=jnp.int32))
        n_entries += x.size
      new_leaves.append(join(outs))
    n_out = sum(counts, jnp.zeros((), jnp.int32))
    return treedef.unflatten(new_leaves), OutlierClampState(
        saturating_add(state.outlier_count, n_out),
        n_out.astype(jnp.float32) / max(1, n_entries))

  return optax.GradientTransformation(init_fn, update_fn)  # type: ignore[arg-type]


register_state_metrics(OutlierClampState, "outlier_clamp",
                       lambda s: {"outlier_count": s.outlier_count,
                                  "outlier_rate": s.outlier_rate}, order=80)
