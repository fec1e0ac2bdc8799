"""The matrices of a Muon leaf: dimension numbers, and cutting a leaf into matrices and back.

A leaf's matrix is described by an ``optax.contrib.MuonDimensionNumbers`` (reduction axes =
fan-in, output axes = fan-out, every other axis a batch axis, as in ``optax.contrib.muon``), or
by a :class:`stablejax.FusedDimensionNumbers` whose fused axis holds several projections, each
its own matrix. By default a leaf is its last two axes ``[..., fan_in, fan_out]`` (Flax
``Dense`` kernels are ``[in, out]``; a scan-stacked ``[L, in, out]`` kernel is ``L`` matrices).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from stablejax.layout import analysis as layout
from stablejax.layout.analysis import FusedDimensionNumbers

MuonDimensionNumbers: Any = optax.contrib.MuonDimensionNumbers  # Any: usable in isinstance
# What a leaf's matrix layout may be: optax's dimension numbers, or fused parts of one axis.
DIMENSION_TYPES: tuple[type, ...] = (MuonDimensionNumbers, FusedDimensionNumbers)
Dims = Union[optax.contrib.MuonDimensionNumbers, FusedDimensionNumbers]

LAST_TWO_AXES = MuonDimensionNumbers(reduction_axis=-2, output_axis=-1)
ATTENTION_QKV = MuonDimensionNumbers(reduction_axis=-3, output_axis=(-2, -1))


def normalize_axes(dims: MuonDimensionNumbers, ndim: int) -> tuple[tuple, tuple]:
  def norm(axes: Any) -> tuple:
    axes = (axes,) if isinstance(axes, (int, np.integer)) else tuple(axes)
    return tuple(int(a) % ndim if -ndim <= int(a) < ndim else None for a in axes)
  return norm(dims.reduction_axis), norm(dims.output_axis)


def check_dims(dims: object, shape: Sequence[int], path: str) -> None:
  """Raises a clear error when ``dims`` does not describe a matrix of a ``shape`` leaf."""
  if not isinstance(dims, DIMENSION_TYPES):
    raise ValueError(f"weight_dimension_numbers for {path} must be an "
                     "optax.contrib.MuonDimensionNumbers, a stablejax.FusedDimensionNumbers or "
                     f"None, got {dims!r}")
  red, out = normalize_axes(dims, len(shape))
  if None in red or None in out or not red or not out or set(red) & set(out) \
      or len(set(red)) != len(red) or len(set(out)) != len(out):
    raise ValueError(f"weight_dimension_numbers {dims} do not fit {path} of shape {shape}: "
                     "reduction and output axes must be non-empty, disjoint and within its "
                     f"{len(shape)} axes")
  if isinstance(dims, FusedDimensionNumbers):
    ndim = len(shape)
    axis = int(dims.fused_axis) % ndim if -ndim <= int(dims.fused_axis) < ndim else None
    if axis is None or axis not in red + out:
      raise ValueError(f"weight_dimension_numbers {dims} do not fit {path} of shape {shape}: "
                       "fused_axis must be one of its reduction or output axes")
    try:
      dims.part_sizes(shape)
    except ValueError as e:
      raise ValueError(f"{path}: {e}") from None


def matrix_shape(dims: MuonDimensionNumbers, shape: Sequence[int]) -> tuple[tuple, int, int]:
  """``(batch_shape, fan_in, fan_out)`` of the matrices ``dims`` cut out of a ``shape`` leaf
  (for fused parts: of the whole kernel; see :func:`part_shapes`)."""
  red, out = normalize_axes(dims, len(shape))
  batch = tuple(shape[a] for a in range(len(shape)) if a not in red and a not in out)
  return batch, math.prod(shape[a] for a in red), math.prod(shape[a] for a in out)



def to_matrices(x: jax.Array, dims: Dims) -> tuple[jax.Array, Callable[[jax.Array], jax.Array]]:
  """``x`` as ``[*batch, fan_in, fan_out]`` per ``dims``, and the function that undoes it."""
  red, out = normalize_axes(dims, x.ndim)
  batch = [a for a in range(x.ndim) if a not in red and a not in out]
  perm = tuple(batch) + red + out
  permuted_shape = tuple(x.shape[a] for a in perm)
  shape = (tuple(x.shape[a] for a in batch) + (math.prod(x.shape[a] for a in red),
                                               math.prod(x.shape[a] for a in out)))
  inverse = tuple(sorted(range(x.ndim), key=perm.__getitem__))
  identity = perm == tuple(range(x.ndim))

  def back(m: jax.Array) -> jax.Array:
    m = m.reshape(permuted_shape)
    return m if identity else jnp.transpose(m, inverse)

  return (x if identity else jnp.transpose(x, perm)).reshape(shape), back


def split_fused(x: jax.Array, dims: Dims
                ) -> tuple[list[tuple[jax.Array, Dims]], Callable[[list[jax.Array]], jax.Array]]:
  """The matrices of a leaf as ``[(piece, dims)]`` and the function that joins their results.

  Plain dimension numbers: the leaf itself. A :class:`stablejax.FusedDimensionNumbers` kernel:
  equal parts become one more batch axis (``[D, 3W]`` -> ``[D, 3, W]``: one batched NS call);
  parts of different sizes (grouped-query ``[D, (H + 2K) hd]``) are sliced apart.
  """
  if not isinstance(dims, FusedDimensionNumbers):
    return [(x, dims)], lambda outs: outs[0]
  red, out = normalize_axes(dims, x.ndim)
  axis = int(dims.fused_axis) % x.ndim
  sizes = dims.part_sizes(x.shape)
  plain = MuonDimensionNumbers(red, out)
  if len(set(sizes)) == 1:  # [..., k * W, ...] -> [..., k, W, ...]: the k axis is a batch axis
    k = len(sizes)
    shape = x.shape[:axis] + (k, sizes[0]) + x.shape[axis + 1:]

    def shift(axes: tuple) -> tuple:
      return tuple(a + 1 if a >= axis else a for a in axes)
    return ([(x.reshape(shape), MuonDimensionNumbers(shift(red), shift(out)))],
            lambda outs: outs[0].reshape(x.shape))
  cuts = list(np.cumsum(sizes)[:-1])
  pieces = jnp.split(x, cuts, axis=axis)
  return [(p, plain) for p in pieces], lambda outs: jnp.concatenate(outs, axis=axis)


def part_shapes(dims: Dims, shape: Sequence[int]) -> list[tuple[tuple, int, int]]:
  """``(batch_shape, fan_in, fan_out)`` of each matrix part of a ``shape`` leaf: one entry for
  plain dimension numbers, one per part of a fused kernel."""
  if not isinstance(dims, FusedDimensionNumbers):
    return [matrix_shape(dims, shape)]
  axis = int(dims.fused_axis) % len(shape)
  out = []
  for size in dims.part_sizes(shape):
    part = list(shape)
    part[axis] = size
    out.append(matrix_shape(dims, part))
  return out


def layout_name(dims: MuonDimensionNumbers, shape: Sequence[int]) -> str:
  names = []
  for batch, fan_in, fan_out in part_shapes(dims, shape):
    n = math.prod(batch)
    names.append(f"{n} x {fan_in}x{fan_out}" if n > 1 else f"{fan_in}x{fan_out}")
  if len(names) > 1 and len(set(names)) == 1:
    return f"{len(names)} x {names[0]}" if " x " not in names[0] else \
        f"{len(names)} parts of {names[0]}"
  return " + ".join(names)


def batch_ndim(a: layout.Analysis, i: int) -> int:
  """How many axes of leaf ``i`` are batch axes (stacked layers, experts, fused parts)."""
  kinds = a.kinds[i]
  if kinds is not None:
    return sum(1 for k in kinds if k in layout._BATCH_KINDS)
  return 1 if a.stacked[i] else 0
