"""Which axes of each kernel make its matrix: stacked layers, the input and output sides, fused
parts.

**Stacks.** Scan-stacked subtrees (``nn.scan`` / ``nnx.scan``: every parameter with the same
leading axis, stacked matrices next to stacked vectors) add a batch axis (:func:`stack_axes`);
repeated blocks are found beside them (:func:`block_flags`).

**Kernels of 3+ axes.** Metadata names give the matrix directly: the model axis on one side, the
other non-batch axes together on the other, stacked, expert and fused axes as batch. A model axis
whose size disagrees with the model width ``D`` is not trusted. Without metadata, a kernel with
exactly one axis of size ``D`` is the ``D`` axis against its other axes: ``[D, H, hd]`` is
``D x H*hd``, ``[H, hd, D]`` is ``H*hd x D`` (:func:`shape_reading`); a ``D`` axis in the middle
(Gemma's einsum kernels) is read so only inside an attention layer
(:mod:`stablejax.layout.attention`). A leading axis of size 2 or 3 in front of the heads is a batch
axis (three or two separate matrices).

**2-D kernels.** Which side is the input (:func:`orientations`): the module type when the tree
carries it (``eqx.nn.Linear``), else the model's own convention read from its kernels whose names
say which side is ``D``. A kernel named like a fused projection is cut into its parts
(:class:`FusedDimensionNumbers`).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import NamedTuple, Optional, Sequence, Union

import numpy as np
import optax

from stablejax.layout.leaves import OUT_IN, Leaf
from stablejax.layout.names import (BATCH_KINDS, FUSED, FUSED_FEATURES, HEADS, MODEL,
                                    component_name, fused_parts_of_name, fused_role, io_side,
                                    is_block_name, is_expert_name, projection_name,
                                    projection_path)

MuonDimensionNumbers = optax.contrib.MuonDimensionNumbers
# Axes of a matrix side, as optax takes them: one axis or several.
Axes = Union[int, tuple[int, ...]]


class FusedDimensionNumbers(NamedTuple):
  """The matrix of a kernel that concatenates several projections along one axis.

  A fused query/key/value kernel (GPT-2's ``c_attn``, ``[D, 3D]``; ``[3D, D]`` in Hugging Face's
  Flax ``Conv1D``), a fused key/value or a fused gate/up kernel holds several matrices side by
  side. Muon orthogonalises each part as its own matrix (as modded-nanogpt, Moonlight and Kimi
  orthogonalise each projection), which ``optax.contrib.MuonDimensionNumbers`` cannot say.

  Attributes:
    reduction_axis: as in ``optax.contrib.MuonDimensionNumbers`` (fan-in axes).
    output_axis: likewise (fan-out axes).
    fused_axis: the axis whose entries are the parts, one after the other; one of the reduction
      or output axes (negative values count from the end).
    parts: the number of equal parts, or the size of each part along ``fused_axis`` (a grouped
      query/key/value kernel: ``(H * hd, K * hd, K * hd)``).

  Example:
    >>> import jax.numpy as jnp, stablejax
    >>> qkv = stablejax.FusedDimensionNumbers(reduction_axis=-2, output_axis=-1, fused_axis=-1,
    ...                                       parts=3)   # a [D, 3D] kernel: three D x D matrices
    >>> qkv.part_sizes((64, 192))
    (64, 64, 64)
  """
  reduction_axis: Union[int, Sequence[int]]
  output_axis: Union[int, Sequence[int]]
  fused_axis: int
  parts: Union[int, Sequence[int]]

  def part_sizes(self, shape: Sequence[int]) -> tuple[int, ...]:
    """The size of each part along ``fused_axis`` for a kernel of ``shape``."""
    size = shape[self.fused_axis]
    if isinstance(self.parts, (int, np.integer)):
      parts = int(self.parts)
      if parts < 1 or size % parts:
        raise ValueError(f"FusedDimensionNumbers: axis {self.fused_axis} of a {tuple(shape)} "
                         f"kernel (size {size}) does not split into {parts} equal parts")
      return (size // parts,) * parts
    sizes = tuple(int(n) for n in self.parts)
    if not sizes or min(sizes) < 1 or sum(sizes) != size:
      raise ValueError(f"FusedDimensionNumbers: part sizes {sizes} must be positive and add up "
                       f"to axis {self.fused_axis} of a {tuple(shape)} kernel (size {size})")
    return sizes


# A kernel's matrix: optax's dimension numbers, or fused parts of one axis.
MatrixDims = Union[optax.contrib.MuonDimensionNumbers, FusedDimensionNumbers]


# ------------------------------------------------------------------ stacks and blocks

def stack_axes(leaves: Sequence[Leaf]) -> list[Optional[int]]:
  """The stacked-layer axis of each leaf in a scan-stacked subtree (``nn.scan`` / ``nnx.scan``).

  A subtree is a stack of ``L`` layers along axis ``a`` (0, or 1 as with ``nn.scan(...,
  variable_axes={'params': 1})``) when it holds at least two parameters, all with size ``L`` on
  axis ``a``, at least one of 3+ axes (a stacked matrix) and one of at most 2 (a stacked norm
  gain, bias or scalar), and, along axis 1, at least two modules. None for a leaf outside every
  stack.
  """
  members = collections.defaultdict(list)
  for i, leaf in enumerate(leaves):
    if not leaf.masked:
      for k in range(len(leaf.names)):
        members[leaf.names[:k]].append(i)

  @functools.lru_cache(maxsize=None)
  def stack_axis(prefix: tuple) -> Optional[int]:
    idx = members[prefix]
    shapes = [leaves[i].shape for i in idx]
    ndims = [len(s) for s in shapes]
    if len(idx) < 2 or max(ndims) < 3 or min(ndims) > 2:
      return None
    # Along axis 1 only a stack of several modules (MaxText scans whole decoder layers): the
    # kernel [D, H, hd] and bias [H, hd] of one attention projection share axis 1 when H == hd.
    modules = len({leaves[i].names[:-1] for i in idx})
    for a in (0, 1):
      if a == 1 and modules < 2:
        break
      if min(ndims) > a and len({s[a] for s in shapes}) == 1:
        return a
    return None

  out: list[Optional[int]] = []
  for leaf in leaves:
    found = None
    if not leaf.masked and leaf.shape:
      found = next((a for k in range(len(leaf.names))
                    if (a := stack_axis(leaf.names[:k])) is not None), None)
    out.append(found)
  return out


def stack_axes_of(leaf: Leaf, axis: Optional[int]) -> tuple[int, ...]:
  """The stacked-layer axes of ``leaf`` (its subtree's ``axis``, if the leaf has one past it)."""
  return (axis,) if axis is not None and len(leaf.shape) > axis + 1 else ()


def block_flags(leaves: Sequence[Leaf], stacked: Sequence[bool]) -> list[bool]:
  """Whether each leaf lies inside a repeated block of the model.

  Inside: a scan-stacked subtree; a subtree with at least one structurally identical sibling
  (``block_0``, ``block_1``...; ``layers/0``, ``layers/1``: same relative paths and shapes); or a
  path component named like a block (``block``, ``TBlock_0``, ``layers``, ``layer_3``, ``h``).
  """
  children: dict = collections.defaultdict(lambda: collections.defaultdict(set))
  for leaf in leaves:
    if leaf.masked:
      continue
    for k in range(1, len(leaf.names)):
      children[leaf.names[:k - 1]][leaf.names[k - 1]].add((leaf.names[k:], leaf.shape))
  repeated: set = set()
  for parent, kids in children.items():
    signatures = collections.Counter(frozenset(sig) for sig in kids.values())
    for name, sig in kids.items():
      if signatures[frozenset(sig)] >= 2:
        repeated.add(parent + (name,))
  out = []
  for leaf, s in zip(leaves, stacked):
    inside = s or any(leaf.names[:k] in repeated for k in range(1, len(leaf.names)))
    inside = inside or any(is_block_name(n) for n in leaf.lower[:-1])
    out.append(bool(inside and not leaf.masked))
  return out


# ------------------------------------------------------------------ 2-D kernels

def _matrix_axes(leaf: Leaf, stack_axis: Optional[int]) -> bool:
  """Whether ``leaf`` is one ``[a, b]`` matrix, or a stack ``[L, a, b]`` of them (axis 0)."""
  stack = stack_axes_of(leaf, stack_axis)
  return len(leaf.shape) - len(stack) == 2 and stack in ((), (0,))


def orientations(leaves: Sequence[Leaf], stack_axis: Sequence[Optional[int]],
                 d_model: Optional[int]) -> list[Optional[str]]:
  """``"out_in"`` for each 2-D kernel stored ``[out, in]``, None for ``[in, out]`` or unknown.

  The module type decides when the tree carries it (``eqx.nn.Linear``: ``[out, in]``). Otherwise
  the model's own convention, read per parameter name (``kernel``, ``weight``...) from its
  non-square kernels whose module names say which side is the model width: an input projection
  (``q_proj``, ``c_attn``, ``c_fc``, ``up_proj``...) has ``D`` as its fan-in, an output
  projection (``o_proj``, ``c_proj``, ``down_proj``...) as its fan-out. Hugging Face's Flax
  ``Conv1D`` (GPT-2: ``c_attn/kernel [3D, D]``) is ``[out, in]``; Flax ``Dense`` is ``[in, out]``.
  A convention counts only when every such kernel agrees.
  """
  votes: dict = collections.defaultdict(collections.Counter)
  if d_model is not None:
    for leaf, axis in zip(leaves, stack_axis):
      if leaf.masked or leaf.storage is not None or not _matrix_axes(leaf, axis):
        continue
      side = io_side(leaf)
      first, last = leaf.shape[-2], leaf.shape[-1]
      if side is None or (first == d_model) == (last == d_model):
        continue
      in_out = (side == "in") == (first == d_model)
      votes[leaf.lower[-1]]["in_out" if in_out else OUT_IN] += 1
  out: list[Optional[str]] = []
  for leaf, axis in zip(leaves, stack_axis):
    if leaf.masked or not _matrix_axes(leaf, axis):
      out.append(None)
    elif leaf.storage is not None:
      out.append(leaf.storage)
    else:
      v = votes.get(leaf.lower[-1], {})
      out.append(OUT_IN if v.get(OUT_IN) and not v.get("in_out") else None)
  return out


def _out_widths(leaves: Sequence[Leaf], orient: Sequence[Optional[str]], d_model: int
                ) -> dict[tuple[str, ...], int]:
  """Module path -> the fan-in of its attention output projection ``[W, D]`` (2-D kernels)."""
  widths: dict[tuple[str, ...], int] = {}
  for leaf, o in zip(leaves, orient):
    if leaf.masked or len(leaf.shape) < 2 or io_side(leaf) != "out":
      continue
    if projection_name(component_name(leaf)) != "out" and component_name(leaf) != "c_proj":
      continue
    fan_in, fan_out = (leaf.shape[-1], leaf.shape[-2]) if o == OUT_IN else leaf.shape[-2:]
    if fan_out == d_model:
      widths.setdefault(projection_path(leaf)[:-1], fan_in)
  return widths


def _fused_layout(leaf: Leaf, orient: Optional[str], d_model: Optional[int],
                  out_width: Optional[int]) -> Optional[FusedDimensionNumbers]:
  """The parts of a 2-D kernel named like a fused projection, from its shape against ``D``."""
  role = fused_role(leaf)
  if role is None or d_model is None:
    return None
  red, out = (-1, -2) if orient == OUT_IN else (-2, -1)
  if leaf.shape[red] != d_model:
    return None
  width = leaf.shape[out]
  parts: Union[None, int, tuple[int, int, int]] = None
  if role in ("kv", "gate_up"):
    parts = 2 if width % 2 == 0 else None
  elif width == 3 * d_model:
    parts = 3
  elif out_width is not None and 0 < out_width < width and (width - out_width) % 2 == 0:
    rest = (width - out_width) // 2    # grouped-query: H * hd queries, K * hd keys and values
    parts = (out_width, rest, rest)
  elif width % 3 == 0:
    parts = 3
  if parts is None:
    return None
  return FusedDimensionNumbers(red, out, out, parts)


# ------------------------------------------------------------------ each kernel's matrix


@dataclasses.dataclass(frozen=True)
class KernelLayout:
  """A recognised matrix layout of one kernel.

  Attributes:
    dims: the matrix, as optax takes it (negative axes: unchanged by leading stacked axes).
    source: ``"metadata"``, ``"shape"`` or ``"attention"`` (shapes confirmed by an attention
      layer).
    head_axis: the axis of the kernel that indexes heads (negative), if it has one.
    fused_axis: the axis of a fused projection (``[3, H, D, hd]``: 3 projections), if any.
  """
  dims: MatrixDims
  source: str
  head_axis: Optional[int] = None
  fused_axis: Optional[int] = None


class ShapeReading(NamedTuple):
  """How a 3+-axis kernel reads against the model width ``D`` (axes count from the front).

  Attributes:
    d: the axis of size ``D``.
    fused: a leading axis of 2 or 3 fused projections in front of the others, if any.
    others: the remaining non-stacked axes (heads and head size), in order.
    position: where ``d`` sits among ``others``: ``"first"``, ``"last"`` or ``"middle"``.
  """
  d: int
  fused: Optional[int]
  others: list[int]
  position: str


def _dims(reduction: Sequence[int], output: Sequence[int]) -> MuonDimensionNumbers:
  def pack(axes: Sequence[int]) -> Axes:
    axes = tuple(sorted(axes))
    return axes[0] if len(axes) == 1 else axes
  return MuonDimensionNumbers(reduction_axis=pack(reduction), output_axis=pack(output))


def _metadata_layout(leaf: Leaf, kinds: tuple[Optional[str], ...], d_model: Optional[int]
                     ) -> Optional[KernelLayout]:
  nd = len(leaf.shape)
  batch = [a for a, k in enumerate(kinds) if k in BATCH_KINDS]
  rest = [a for a in range(nd) if a not in batch]
  model = [a for a in rest if kinds[a] == MODEL]
  if len(rest) < 2 or len(model) != 1 or (d_model is not None and leaf.shape[model[0]] != d_model):
    return None
  m = model[0]
  others = [a for a in rest if a != m]
  neg = [a - nd for a in others]
  heads = [a - nd for a in others if kinds[a] == HEADS]
  fused = [a - nd for a in batch if kinds[a] == FUSED]
  if m == rest[-1]:  # [..., D]: the model axis is the output
    dims = _dims(neg, [m - nd])
  else:
    dims = _dims([m - nd], neg)
  features = [a for a in others if kinds[a] == FUSED_FEATURES]
  if len(features) == 1 and leaf.axes is not None:
    parts = fused_parts_of_name(leaf.axes[features[0]])
    if parts is not None and leaf.shape[features[0]] % parts == 0:
      fused_dims = FusedDimensionNumbers(dims.reduction_axis, dims.output_axis,
                                         features[0] - nd, parts)
      return KernelLayout(fused_dims, "metadata", heads[0] if len(heads) == 1 else None,
                          fused[0] if len(fused) == 1 else None)
  return KernelLayout(dims, "metadata", heads[0] if len(heads) == 1 else None,
                      fused[0] if len(fused) == 1 else None)


def shape_reading(leaf: Leaf, stack: tuple[int, ...], d_model: Optional[int]
                  ) -> Optional[ShapeReading]:
  """How a 3+-axis kernel reads against ``d_model``: D axis, fused axis, the head axes."""
  if d_model is None:
    return None
  nd = len(leaf.shape)
  rest = [a for a in range(nd) if a not in stack]
  if len(rest) < 3:
    return None
  d_axes = [a for a in rest if leaf.shape[a] == d_model]
  if len(d_axes) != 1:
    return None
  d = d_axes[0]
  fused = None
  others = [a for a in rest if a != d]
  if others[0] < d and leaf.shape[others[0]] in (2, 3) and len(others) >= 3:
    fused = others[0]
    others = others[1:]
  position = "first" if d < others[0] else ("last" if d > others[-1] else "middle")
  return ShapeReading(d, fused, others, position)


def reading_layout(leaf: Leaf, r: ShapeReading, source: str) -> KernelLayout:
  """The matrix of a kernel read by :func:`shape_reading`: ``D`` against the other axes."""
  nd = len(leaf.shape)
  others = [a - nd for a in r.others]
  d = r.d - nd
  head_axis = others[0] if len(others) == 2 else None
  fused = None if r.fused is None else r.fused - nd
  if r.position == "last":
    return KernelLayout(_dims(others, [d]), source, head_axis, fused)
  return KernelLayout(_dims([d], others), source, head_axis, fused)


class KernelLayouts(NamedTuple):
  """What :func:`kernel_layouts` reads of every kernel (leaf indices)."""
  layouts: dict[int, KernelLayout]    # the kernels whose matrix is recognised
  readings: dict[int, ShapeReading]   # every 3+-axis kernel with one axis of size D
  orientation: list[Optional[str]]    # per leaf: "out_in" or None
  unsplit: list[int]                  # kernels named like fused projections, left whole


def kernel_layouts(leaves: Sequence[Leaf], stack_axis: Sequence[Optional[int]],
                   kinds: Sequence[Optional[tuple[Optional[str], ...]]],
                   d_model: Optional[int]) -> KernelLayouts:
  """The matrix of every kernel that metadata, shapes or (for 2-D kernels) names give.

  Kernels of 3+ axes read with ``D`` in the middle (Gemma's einsum kernels) are left to the
  attention layers (:func:`stablejax.layout.attention.attention_groups`), which may also confirm
  a shape reading as theirs.
  """
  layouts: dict[int, KernelLayout] = {}
  readings: dict[int, ShapeReading] = {}
  for i, leaf in enumerate(leaves):
    if leaf.masked or len(leaf.shape) < 2:
      continue
    leaf_kinds = kinds[i]
    if leaf_kinds is not None:
      meta = _metadata_layout(leaf, leaf_kinds, d_model)
      if meta is not None:
        layouts[i] = meta
        continue
    stack = stack_axes_of(leaf, stack_axis[i])
    rest = [a - len(leaf.shape) for a in range(len(leaf.shape)) if a not in stack]
    if stack and stack != (0,) and len(rest) == 2:  # [in, L, out]: stacked on axis 1
      layouts[i] = KernelLayout(_dims(rest[:1], rest[1:]), "shape")
      continue
    r = shape_reading(leaf, stack, d_model)
    if r is None:
      continue
    readings[i] = r
    experts = any(is_expert_name(n) for n in leaf.lower)
    if r.position == "first" and r.fused is None and not experts:
      layouts[i] = reading_layout(leaf, r, "shape")  # [D, H, hd]: DenseGeneral in any module
    elif r.position == "last" and r.fused is None and not experts:
      layouts[i] = reading_layout(leaf, r, "shape")  # [H, hd, D]
  orient = orientations(leaves, stack_axis, d_model)
  out_widths = _out_widths(leaves, orient, d_model) if d_model is not None else {}
  unsplit = []
  for i, leaf in enumerate(leaves):
    if i in layouts or leaf.masked or not _matrix_axes(leaf, stack_axis[i]):
      continue
    source = "module" if leaf.storage is not None else "names"
    fused = _fused_layout(leaf, orient[i], d_model,
                          out_widths.get(projection_path(leaf)[:-1]))
    if fused is not None:
      layouts[i] = KernelLayout(fused, source if orient[i] == OUT_IN else "names")
    elif orient[i] == OUT_IN:
      layouts[i] = KernelLayout(_dims([-1], [-2]), source)
    if fused is None and fused_role(leaf) is not None:
      unsplit.append(i)
  return KernelLayouts(layouts, readings, orient, unsplit)
