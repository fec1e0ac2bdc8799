"""Where the attention heads are: the query and key projections of each attention layer.

Two parts of the library need to know which parameters are a layer's query and key projections
and along which axis their heads lie: the routing (:mod:`stablejax.muon.routing`), which reads it
from Flax partitioning metadata, shapes and names to give Muon each projection as one matrix, and
QK-clip (Kimi K2, arXiv 2507.20534), which rescales the query and key weights of single heads.
Both speak the types of this module, so a layout is recognised in one place.

A layer's per-head quantities (for example its maximum pre-softmax attention logit) are arrays of
shape ``[*stack, num_heads]``, where ``stack`` is the sizes of the layer's leading stacked-layer
axes (``nn.scan`` / ``nnx.scan``: one ``L`` axis; none for an unstacked layer), and are keyed by
:attr:`AttentionLayer.name`.
"""

from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True)
class HeadParam:
  """One parameter (kernel or bias) of a query or key projection, and where its heads lie.

  Attributes:
    path: the parameter's ``/``-joined path in the params tree, as
      :func:`stablejax.describe_routing` prints it (``"blocks/attn/q_proj/kernel"``).
    head_axis: the axis of the parameter that indexes heads (negative values count from the
      end). Its size is either the number of heads (a ``[D, H, hd]`` ``DenseGeneral`` kernel:
      axis ``-2``) or ``num_heads * head_dim``, split head-major as ``reshape(..., H, hd)`` does
      (a ``[D, H*hd]`` ``Dense`` kernel: axis ``-1``).
    select: for a fused projection, ``(axis, index)`` of the slice that is this projection
      (Gemma's ``qkv_einsum`` ``[3, H, D, hd]``: the query is ``(0, 0)``, the key ``(0, 1)``;
      axes count in the full parameter); None when the parameter is this projection alone.
  """
  path: str
  head_axis: int
  select: Optional[tuple[int, int]] = None


@dataclasses.dataclass(frozen=True)
class AttentionLayer:
  """The query and key projections of one attention layer (or one stack of layers).

  Attributes:
    name: the ``/``-joined path of the module holding the projections
      (``"blocks/attn"``); per-head arrays of this layer are keyed by it.
    num_heads: query heads ``H``.
    num_kv_heads: key heads ``K``: ``H`` for multi-head attention, ``H / G`` for grouped-query
      attention with groups of ``G`` query heads, 1 for multi-query attention. Query head ``h``
      attends with key head ``h // (H // K)``.
    query: the query projection's parameters (its kernel, and its bias if it has one).
    key: the key projection's parameters.
    stack_ndim: how many leading axes of every parameter of the layer are stacked-layer axes
      (``nn.scan`` / ``nnx.scan``): 0 for one layer, 1 for ``[L, ...]`` parameters.
  """
  name: str
  num_heads: int
  num_kv_heads: int
  query: tuple[HeadParam, ...]
  key: tuple[HeadParam, ...]
  stack_ndim: int = 0

  def __post_init__(self) -> None:
    if self.num_heads < 1 or self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
      raise ValueError(f"attention layer {self.name!r}: num_heads={self.num_heads} must be a "
                       f"positive multiple of num_kv_heads={self.num_kv_heads}")
    if not self.query or not self.key:
      raise ValueError(f"attention layer {self.name!r} needs at least one query and one key "
                       "parameter")
    if self.stack_ndim < 0:
      raise ValueError(f"attention layer {self.name!r}: stack_ndim={self.stack_ndim} must be >= 0")
