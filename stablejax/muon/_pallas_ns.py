"""Pallas kernels for one Newton-Schulz iteration (Triton on CUDA, Mosaic on TPU).

This module is the only place that imports Pallas, so the GPU backend can move from Triton to
Mosaic GPU (the Triton backend is deprecated in newer jax) without touching the callers.

One quintic Newton-Schulz iteration on ``X`` of shape ``[batch, n, m]`` with ``n <= m``::

    A  = X X^T                  (n x n, symmetric)
    B  = b A + c A A^T          (A A == A A^T because A is symmetric)
    X' = a X + B X

is run as three calls of a single tiled kernel, ``out = alpha * addend + beta * lhs @ op(rhs)``
with ``op`` either the identity ("NN") or the transpose ("NT"), so each matrix product has its
scale-and-add epilogue fused in (no separate elementwise pass over ``A``, ``B`` or ``X``):

* ``A = X X^T``: NT product of ``X`` with itself, no addend.
* ``B = b A + c A A^T``: because ``A`` is symmetric, ``A A`` is computed as the NT product of ``A``
  with itself, the same kernel and the same memory access pattern as the Gram product, and no
  transposed copy of ``A`` is ever formed. The epilogue adds ``b A`` from the tile already in
  fast memory.
* ``X' = a X + B X``: NN product, epilogue adds ``a X``.

Each program computes one ``(bm, bn)`` output tile for one batch element; the contraction runs
over ``bk``-wide chunks with an f32 accumulator and the result is cast to the input dtype, which is
exactly the rounding the XLA reference in :mod:`stablejax.muon.newton_schulz` performs. The grid
is ``(batch, n // bm, cols // bn)`` with every axis parallel, so scan-stacked layers become extra
programs of the same launch.

Not exploited yet: computing only the upper-triangular tiles of the symmetric outputs ``A`` and
``B`` (half the Gram flops). That needs each program to write a tile and its mirror, which the
BlockSpec output model does not express; it is left for a Mosaic-GPU version of this module.

Tiling rules (a shape that does not satisfy them is reported as untileable and the caller uses
the XLA reference):

* Triton: tiles of 64, 32 or 16 (power of two, at least 16 for ``tl.dot``) that divide the
  dimension; contraction chunks of 32 or 16. Operands stay in global memory, only the chunks in
  flight are loaded, so there is no size limit.
* Mosaic: output tiles that are multiples of 128 lanes (or the whole dimension), contraction
  chunks of 512/256/128 (or the whole dimension); the ``(tile, K)`` operand strips are copied to
  VMEM, so their double-buffered size is capped at 12 MiB (f32 up to K = 6144 with 128-row tiles).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

PLATFORMS = ("triton", "mosaic")

_TRITON_TILES = (64, 32, 16)
_TRITON_CHUNKS = (32, 16)
_MOSAIC_TILES = (256, 128)
_MOSAIC_CHUNKS = (512, 256, 128)
_MOSAIC_VMEM_BUDGET = 12 * 1024 * 1024
_MOSAIC_MAX_FULL_DIM = 2048


def _first_divisor(dim: int, candidates: Sequence[int]) -> Optional[int]:
  for c in candidates:
    if dim % c == 0:
      return c
  return None


def _mosaic_tile(dim: int, candidates: Sequence[int], align: int) -> Optional[int]:
  tile = _first_divisor(dim, candidates)
  if tile is None and dim <= _MOSAIC_MAX_FULL_DIM and dim % align == 0:
    tile = dim  # a block equal to the full dimension is always legal on TPU
  return tile


def matmul_tiles(m: int, n: int, k: int, platform: str,
                 itemsize: int = 4) -> Optional[tuple[int, int, int]]:
  """Tile sizes ``(bm, bn, bk)`` for an ``[m, k] x [k, n]`` product, or None if untileable."""
  if platform == "triton":
    bm = _first_divisor(m, _TRITON_TILES)
    bn = _first_divisor(n, _TRITON_TILES)
    bk = _first_divisor(k, _TRITON_CHUNKS)
    if bm is None or bn is None or bk is None:
      return None
    return bm, bn, bk
  if platform == "mosaic":
    bm = _mosaic_tile(m, _MOSAIC_TILES[1:], 8)  # 128 rows keeps the K strips small
    bn = _mosaic_tile(n, _MOSAIC_TILES, 8)
    bk = _mosaic_tile(k, _MOSAIC_CHUNKS, 8)
    if bm is None or bn is None or bk is None:
      return None
    # Double-buffered operand strips (bm x K and bn x K or K x bn) plus addend and output tiles.
    vmem = 2 * itemsize * (bm * k + bn * k + 2 * bm * bn)
    if vmem > _MOSAIC_VMEM_BUDGET:
      return None
    return bm, bn, bk
  raise ValueError(f"unknown Pallas platform {platform!r}; use one of {PLATFORMS}")


def ns_tileable(n: int, m: int, platform: str, itemsize: int = 4) -> bool:
  """Whether one NS iteration on an ``[n, m]`` matrix (``n <= m``) tiles on ``platform``."""
  return (
      matmul_tiles(n, n, m, platform, itemsize) is not None  # A = X X^T
      and matmul_tiles(n, n, n, platform, itemsize) is not None  # B = b A + c A A^T
      and matmul_tiles(n, m, n, platform, itemsize) is not None  # X' = a X + B X
  )


def _fused_matmul_kernel(lhs_ref: Any, rhs_ref: Any, *rest: Any, alpha: float, beta: float,
                         trans_rhs: bool, bk: int, nk: int) -> None:
  if len(rest) == 2:
    add_ref, out_ref = rest
  else:
    (out_ref,) = rest
    add_ref = None
  bm, bn = out_ref.shape

  def body(kk: jax.Array, acc: jax.Array) -> jax.Array:
    start = pl.multiple_of(kk * bk, bk)
    lhs = lhs_ref[:, pl.ds(start, bk)]
    if trans_rhs:
      rhs = rhs_ref[:, pl.ds(start, bk)]
      dims = (((1,), (1,)), ((), ()))
    else:
      rhs = rhs_ref[pl.ds(start, bk), :]
      dims = (((1,), (0,)), ((), ()))
    return acc + jax.lax.dot_general(lhs, rhs, dims, preferred_element_type=jnp.float32)

  acc = jax.lax.fori_loop(0, nk, body, jnp.zeros((bm, bn), jnp.float32))
  out = acc if beta == 1.0 else beta * acc
  if add_ref is not None:
    out = out + alpha * add_ref[...].astype(jnp.float32)
  out_ref[...] = out.astype(out_ref.dtype)


def fused_matmul(lhs: jax.Array, rhs: jax.Array, addend: Optional[jax.Array], *, alpha: float,
                 beta: float, trans_rhs: bool, platform: str,
                 interpret: bool = False) -> jax.Array:
  """``alpha * addend + beta * lhs @ op(rhs)`` batched over the leading axis, f32 accumulation.

  Args:
    lhs: ``[B, M, K]``.
    rhs: ``[B, N, K]`` when ``trans_rhs`` (NT product) else ``[B, K, N]``.
    addend: ``[B, M, N]`` or None.
    alpha, beta: Python floats baked into the kernel.
    trans_rhs: contract the last axis of both operands.
    platform: "triton" or "mosaic" (selects tiles and compiler parameters).
    interpret: run the kernel in Pallas interpret mode (any platform, including CPU).

  Returns:
    ``[B, M, N]`` in ``lhs.dtype``.
  """
  batch, m, k = lhs.shape
  n = rhs.shape[1] if trans_rhs else rhs.shape[2]
  tiles = matmul_tiles(m, n, k, platform, lhs.dtype.itemsize)
  if tiles is None:
    raise ValueError(f"shape {(m, n, k)} does not tile on {platform}; check ns_tileable first")
  bm, bn, bk = tiles
  grid = (batch, m // bm, n // bn)
  in_specs = [pl.BlockSpec((None, bm, k), lambda b, i, j: (b, i, 0))]
  if trans_rhs:
    in_specs.append(pl.BlockSpec((None, bn, k), lambda b, i, j: (b, j, 0)))
  else:
    in_specs.append(pl.BlockSpec((None, k, bn), lambda b, i, j: (b, 0, j)))
  args = [lhs, rhs]
  if addend is not None:
    in_specs.append(pl.BlockSpec((None, bm, bn), lambda b, i, j: (b, i, j)))
    args.append(addend)
  compiler_params: Any
  if platform == "triton":
    compiler_params = plgpu.CompilerParams(num_warps=4, num_stages=3)
  else:
    compiler_params = pltpu.CompilerParams(
        dimension_semantics=("parallel", "parallel", "parallel"))
  kernel = functools.partial(
      _fused_matmul_kernel, alpha=float(alpha), beta=float(beta), trans_rhs=trans_rhs,
      bk=bk, nk=k // bk)
  return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((batch, m, n), lhs.dtype),
      grid=grid,
      in_specs=in_specs,
      out_specs=pl.BlockSpec((None, bm, bn), lambda b, i, j: (b, i, j)),
      compiler_params=compiler_params,
      interpret=interpret,
      name=f"stablejax_ns_{'nt' if trans_rhs else 'nn'}_{platform}",
  )(*args)


def ns_iterations(x: jax.Array, coeffs: Sequence[Sequence[float]], *, platform: str,
                  interpret: bool = False, precondition: Optional[Callable[..., Any]] = None
                  ) -> jax.Array:
  """Runs the NS iterations on a normalised ``[B, n, m]`` array with ``n <= m``.

  Args:
    x: normalised input, ``[B, n, m]``, ``n <= m``, already in the compute dtype.
    coeffs: sequence of ``(a, b, c)`` Python floats, one per iteration.
    platform: "triton" or "mosaic".
    interpret: Pallas interpret mode.
    precondition: ``(X, A) -> (X, A)`` applied to the first step's ``X`` and ``A = X X^T``
      (Turbo-Muon's AOL rescaling, elementwise, in XLA between the kernels).

  Returns:
    The iterate after ``len(coeffs)`` steps, same shape and dtype as ``x``.
  """
  mm = functools.partial(fused_matmul, platform=platform, interpret=interpret)
  for i, (a, b, c) in enumerate(coeffs):
    gram = mm(x, x, None, alpha=0.0, beta=1.0, trans_rhs=True)
    if i == 0 and precondition is not None:
      x, gram = precondition(x, gram)
    poly = mm(gram, gram, gram, alpha=b, beta=c, trans_rhs=True)
    x = mm(poly, x, x, alpha=a, beta=1.0, trans_rhs=False)
  return x
