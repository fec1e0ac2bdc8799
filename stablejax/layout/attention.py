"""Which kernels make an attention layer, and what each of them projects.

The layout analysis (:func:`stablejax.layout.analysis.analyse`) finds the attention layers here;
:mod:`stablejax.layout.heads` turns them into the public :class:`~stablejax.layout.heads.
AttentionLayer` (where each layer's query and key heads lie) and into per-head matrices for Muon.

**By shapes** (kernels of 3+ axes, or metadata naming their heads axes): an attention layer is at
least three input projections (query, key, value; a leading axis of size 3 or 2 counts as that
many fused projections) sharing the head size of at most one output projection ``[H, hd, D]``,
with key heads dividing query heads. Such a layer also confirms its kernels' shape readings, the
einsum kernels with ``D`` in the middle among them (Gemma's ``q_einsum [H, D, hd]``,
``kv_einsum [2, K, D, hd]``, ``qkv_einsum [3, H, D, hd]``). The query is told from the key by
name, by position in a fused kernel, or as the projection with the most heads.

**By names** (2-D kernels ``[D, H*hd]`` or ``[H*hd, D]``): the projections of one module named
like a query and a key (``q_proj``, ``k_proj``; a fused ``c_attn`` / ``kv`` kernel counts with
its parts); the head size then comes from a query/key norm gain beside them, if any.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Optional, Sequence

from stablejax.layout.leaves import OUT_IN, Leaf
from stablejax.layout.names import (BIAS_NAMES, FUSED, HEAD_DIM, HEADS, MODEL, STACK,
                                    is_qk_norm_name, projection_name, projection_path)
from stablejax.layout.orientation import (FusedDimensionNumbers, KernelLayout, ShapeReading,
                                          reading_layout, shape_reading, stack_axes_of)

# What each axis of each leaf is by its metadata (None: no usable metadata).
Kinds = Sequence[Optional[tuple[Optional[str], ...]]]


@dataclasses.dataclass
class Projection:
  """One projection of an attention layer (a kernel, its bias, and what it projects to)."""
  role: Optional[str]          # query/key/value/out/kv/qkv, None while undecided
  kernel: int                  # leaf index
  bias: Optional[int]
  heads: Optional[int]         # heads of this projection (None: 2-D kernel, unknown yet)
  head_dim: Optional[int]
  head_axis: Optional[int]     # negative axis of the kernel that indexes heads
  fused: int = 1               # projections fused along fused_axis
  fused_axis: Optional[int] = None
  width: int = 0               # heads * head_dim (the non-D side of the matrix)
  parts: Optional[tuple[int, ...]] = None  # 2-D fused kernel: its parts' sizes along head_axis


@dataclasses.dataclass
class AttentionGroup:
  """An attention layer found by the analysis (leaf indices; converted by ``heads.py``)."""
  name: str
  projections: list[Projection]
  stack_ndim: int
  head_dim: Optional[int]
  qk_norm_dim: Optional[int]
  leading_stack: bool = True   # the stacked-layer axes lead every parameter


def attention_groups(leaves: Sequence[Leaf], stack_axis: Sequence[Optional[int]], kinds: Kinds,
                     d_model: Optional[int], layouts: dict[int, KernelLayout],
                     readings: dict[int, ShapeReading], roles: dict[int, str],
                     orient: Sequence[Optional[str]]) -> list[AttentionGroup]:
  """The attention layers among ``leaves``, one per module holding their projections.

  Args:
    leaves: every parameter.
    stack_axis: each leaf's stacked-layer axis, or None.
    kinds: each leaf's axis kinds by metadata, or None.
    d_model: the model width, if known.
    layouts: the kernels' recognised matrices; a layer found by shapes marks its members'
      shape readings ``"attention"`` here.
    readings: the shape readings of the 3+-axis kernels against ``d_model``.
    roles: leaf index -> projection role given by the user, winning over the names (``"none"``:
      not a projection).
    orient: each leaf's storage (``"out_in"`` or None).
  """
  by_path = {leaf.names: i for i, leaf in enumerate(leaves) if not leaf.masked}
  members: dict = collections.defaultdict(list)
  for i, leaf in enumerate(leaves):
    if (leaf.masked or len(leaf.shape) < 2 or leaf.lower[-1] in BIAS_NAMES
        or roles.get(i) == "none"):
      continue
    proj = projection_path(leaf)
    if len(proj) >= 1:
      members[proj[:-1]].append(i)
  groups = []
  for parent, idx in members.items():
    group = None
    for d in _widths_to_try(leaves, stack_axis, idx, d_model):
      group_readings = dict(readings) if d == d_model else {
          i: r for i in idx
          if (r := shape_reading(leaves[i], stack_axes_of(leaves[i], stack_axis[i]), d))}
      group = _group_from_shapes(leaves, stack_axis, kinds, d, layouts, group_readings, by_path,
                                 parent, idx, roles)
      if group is not None:
        break
    if group is None:
      group = _group_from_names(leaves, stack_axis, d_model, by_path, parent, idx, roles,
                                layouts, orient)
    if group is not None:
      groups.append(group)
  return groups


def _bias_of(leaves: Sequence[Leaf], by_path: dict, kernel: Leaf) -> Optional[int]:
  proj = projection_path(kernel)
  if proj == kernel.names:
    return None
  for name in BIAS_NAMES:
    j = by_path.get(proj + (name,))
    if j is not None:
      return j
  return None


def _widths_to_try(leaves: Sequence[Leaf], stack_axis: Sequence[Optional[int]], idx: list,
                   d_model: Optional[int]) -> list[int]:
  """The model width, or without one, every first or last axis size of the group's kernels."""
  if d_model is not None:
    return [d_model]
  sizes: set = set()
  for i in idx:
    leaf = leaves[i]
    axes = [a for a in range(len(leaf.shape)) if a not in stack_axes_of(leaf, stack_axis[i])]
    if len(axes) >= 3:
      sizes.update((leaf.shape[axes[0]], leaf.shape[axes[-1]]))
  return sorted(sizes, reverse=True)


def _qk_norm_dim(leaves: Sequence[Leaf], parent: tuple, stack: int) -> Optional[int]:
  dims = set()
  for leaf in leaves:
    if leaf.masked or leaf.names[:len(parent)] != parent or len(leaf.names) != len(parent) + 2:
      continue
    if is_qk_norm_name(leaf.lower[len(parent)]) and len(leaf.shape) - stack == 1:
      dims.add(leaf.shape[-1])
  return dims.pop() if len(dims) == 1 else None


def _group_from_shapes(leaves: Sequence[Leaf], stack_axis: Sequence[Optional[int]], kinds: Kinds,
                       d_model: Optional[int], layouts: dict[int, KernelLayout],
                       readings: dict[int, ShapeReading], by_path: dict, parent: tuple,
                       idx: list, roles: dict[int, str]) -> Optional[AttentionGroup]:
  """An attention layer recognised from 3+-axis kernels (metadata or shapes)."""
  ins: list[Projection] = []
  outs: list[Projection] = []
  for i in idx:
    leaf = leaves[i]
    nd = len(leaf.shape)
    lay = layouts.get(i)
    k = kinds[i]
    if lay is not None and lay.source == "metadata" and k is not None:
      heads_axes = [a for a in range(nd) if k[a] == HEADS]
      hd_axes = [a for a in range(nd) if k[a] == HEAD_DIM]
      model = k.index(MODEL)
      if len(heads_axes) != 1 or len(hd_axes) != 1:
        continue
      fused_axes = [a for a in range(nd) if k[a] == FUSED]
      h, hd = leaf.shape[heads_axes[0]], leaf.shape[hd_axes[0]]
      is_out = model > max(heads_axes[0], hd_axes[0])
      p = Projection(None, i, _bias_of(leaves, by_path, leaf), h, hd, heads_axes[0] - nd,
                     leaf.shape[fused_axes[0]] if fused_axes else 1,
                     fused_axes[0] - nd if fused_axes else None, h * hd)
      (outs if is_out else ins).append(p)
      continue
    r = readings.get(i)
    if r is None or len(r.others) != 2:
      continue
    h_ax, hd_ax = r.others
    h, hd = leaf.shape[h_ax], leaf.shape[hd_ax]
    fused = 1 if r.fused is None else leaf.shape[r.fused]
    p = Projection(None, i, _bias_of(leaves, by_path, leaf), h, hd, h_ax - nd, fused,
                   None if r.fused is None else r.fused - nd, h * hd)
    (outs if r.position == "last" else ins).append(p)
  if not ins:
    return None
  head_dims = {p.head_dim for p in ins + outs}
  n_in = sum(p.fused for p in ins)
  if len(head_dims) != 1 or n_in < 3 or len(outs) > 1:
    return None
  in_heads = [p.heads or 1 for p in ins]  # every projection here has a heads axis
  q_heads = (outs[0].heads or 1) if outs else max(in_heads)
  if any(q_heads % h for h in in_heads) or q_heads < max(in_heads):
    return None
  if any(p.fused not in (1, 2, 3) for p in ins):
    return None
  for p in ins + outs:  # confirmed: every member's layout is the attention reading
    found = readings.get(p.kernel)
    if found is not None:
      layouts[p.kernel] = reading_layout(leaves[p.kernel], found, "attention")
  for p in outs:
    p.role = "out"
  _assign_roles(leaves, ins, q_heads)
  for p in ins:
    if p.kernel in roles and p.fused == 1:
      p.role = roles[p.kernel]
  first = kinds[ins[0].kernel]
  if first is not None and layouts[ins[0].kernel].source == "metadata":
    axes = tuple(a for a, kind in enumerate(first) if kind == STACK)
  else:
    axes = stack_axes_of(leaves[ins[0].kernel], stack_axis[ins[0].kernel])
  return AttentionGroup("/".join(parent), ins + outs, len(axes), head_dims.pop(), None,
                        axes == tuple(range(len(axes))))


def _assign_roles(leaves: Sequence[Leaf], ins: list[Projection], q_heads: int) -> None:
  """Query/key/value roles of the input projections: fused ones by position, others by name."""
  for p in ins:
    if p.fused == 3:
      p.role = "qkv"
    elif p.fused == 2:
      p.role = "kv"
    else:
      p.role = projection_name(leaves[p.kernel].names[-2] if projection_path(leaves[p.kernel])
                               != leaves[p.kernel].names else leaves[p.kernel].names[-1])
  singles = [p for p in ins if p.fused == 1]
  if any(p.fused == 2 for p in ins) and len(singles) == 1 and singles[0].role is None:
    singles[0].role = "query"  # q_einsum next to a fused kv_einsum
  named = [p.role for p in singles]
  if len(set(named)) != len(named) or any(r not in ("query", "key", "value") for r in named):
    by_heads = [p for p in singles if p.heads == q_heads]
    if len(singles) == 3 and len(by_heads) == 1:  # GQA: only the query has all heads
      for p in singles:
        if p is by_heads[0]:
          p.role = "query"
        elif p.role not in ("key", "value"):
          p.role = None
    else:
      for p in singles:
        if named.count(p.role) > 1 or p.role not in ("query", "key", "value"):
          p.role = None


def _group_from_names(leaves: Sequence[Leaf], stack_axis: Sequence[Optional[int]],
                      d_model: Optional[int], by_path: dict, parent: tuple, idx: list,
                      roles: dict[int, str], layouts: dict[int, KernelLayout],
                      orient: Sequence[Optional[str]]) -> Optional[AttentionGroup]:
  """An attention layer of 2-D ``[D, H*hd]`` (or ``[H*hd, D]``) kernels, recognised by its
  projections' names; a fused query/key/value or key/value kernel counts with its parts."""
  if d_model is None:
    return None
  projs = []
  for i in idx:
    leaf = leaves[i]
    stack = len(stack_axes_of(leaf, stack_axis[i]))
    if len(leaf.shape) - stack != 2 or stack_axis[i] not in (None, 0):
      continue
    comp = leaf.names[-2] if projection_path(leaf) != leaf.names else leaf.names[-1]
    role = roles.get(i) or projection_name(comp) or ("out" if comp.lower() == "c_proj" else None)
    if role is None:
      continue
    out_in = orient[i] == OUT_IN if i < len(orient) else False
    fan_in, fan_out = (leaf.shape[-1], leaf.shape[-2]) if out_in else leaf.shape[-2:]
    head_axis = -2 if out_in else -1
    parts = None
    if role == "out":
      if fan_out != d_model:
        continue
      width = fan_in
    else:
      if fan_in != d_model:
        continue
      width = fan_out
      if role in ("kv", "qkv"):
        dims = layouts[i].dims if i in layouts else None
        if not isinstance(dims, FusedDimensionNumbers):
          continue  # a fused kernel whose parts are unknown: no head can be located in it
        parts = dims.part_sizes(leaf.shape)
        if len(parts) != (3 if role == "qkv" else 2):
          continue
    projs.append(Projection(role, i, _bias_of(leaves, by_path, leaf), None, None, head_axis, 1,
                            None, width, parts))
  found = [p.role for p in projs]
  has_query = "query" in found or "qkv" in found
  has_key = "key" in found or "qkv" in found or "kv" in found
  if not has_query or not has_key or len(set(found)) != len(found):
    return None
  stack = len(stack_axes_of(leaves[projs[0].kernel], stack_axis[projs[0].kernel]))
  return AttentionGroup("/".join(parent), projs, stack, None,
                        _qk_norm_dim(leaves, parent, stack))
