"""Which optimizer updates which parameter, and which matrix Muon orthogonalises.

Muon is defined for the hidden weight matrices of a network. Embedding tables (a lookup, not a
matrix-vector product), the output head, and vectors (norm scales, biases) are trained with AdamW
in every published Muon setup (Jordan et al., modded-nanogpt; Liu et al., arXiv 2502.16982).
Optimizers that route by ``ndim == 2`` alone silently send the embedding and the head to Muon,
so the routing here goes by the parameter's role, and can be printed with
:func:`describe_routing`.

Groups: ``"muon"`` (hidden matrices), ``"adam"`` (norm gains, biases, scalars: never weight
decayed), ``"embedding"`` and ``"head"`` (AdamW matrices with their own learning rates).

**Metadata first, shapes second, names last** (:mod:`stablejax.layout.analysis`, the analysis the
attention-head finder shares). Flax partitioning metadata with logical axis names (Linen
``nn.LogicallyPartitioned`` / ``nn.Partitioned`` boxes, NNX ``out_sharding``) says what each
axis is: ``('vocab', 'embed')`` is an embedding, ``('embed', 'vocab')`` a head, and a kernel's
matrix is its ``embed`` axis against its other non-batch axes (stacked ``layers``, experts and
fused ``qkv`` axes are batch). Without such metadata the model width ``D`` comes from the
embedding table and each 3+-axis kernel is read against it (``[D, H, hd]``, ``[H, hd, D]``, and
Gemma's einsum kernels inside a recognised attention layer); a ``[D, V]`` matrix outside the
repeated blocks is the head, whatever its module is called. Names decide the rest (norms,
biases, the usual embedding and head names).

**A function of the parameter tree.** A Flax NNX ``Variable`` or a Linen metadata box counts as
one parameter at its own path (so boxed and unboxed trees, ``nnx.State`` with ``Variable``
objects and the pure arrays ``nnx.Optimizer.update`` passes, have the same paths), and Linen
``{'params': ...}`` collections, ``FrozenDict``, dicts, lists, tuples and
``jax.ShapeDtypeStruct`` leaves all work. Metadata can only add what the shapes cannot tell
(a stacked axis that is not the leading one); :func:`stablejax.outlier_safe_muon` decides the
routing at ``init`` and reuses it at ``update`` for the same paths and shapes, so metadata seen
at ``init`` (``nnx.Optimizer`` passes ``Variable`` objects there) also holds for the pure arrays
of ``update``.

**Matrix layout.** A leaf's matrix is described by an ``optax.contrib.MuonDimensionNumbers``
(reduction axes = fan-in, output axes = fan-out, every other axis a batch axis, as in
``optax.contrib.muon``); by default the recognised layout above, else the last two axes
``[..., fan_in, fan_out]`` (Flax ``Dense`` kernels are ``[in, out]``; a scan-stacked
``[L, in, out]`` kernel is ``L`` matrices).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import fnmatch
import math
import re
import warnings
from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from stablejax.layout import analysis as layout
from stablejax.layout import heads as _heads
from stablejax.layout.analysis import FusedDimensionNumbers
from stablejax.layout.analysis import Leaf, param_leaves, path_to_str  # noqa: F401 (re-exported)

GROUPS = ("muon", "adam", "embedding", "head")
MuonDimensionNumbers: Any = optax.contrib.MuonDimensionNumbers  # Any: usable in isinstance
# What a leaf's matrix layout may be: optax's dimension numbers, or fused parts of one axis.
DIMENSION_TYPES: tuple[type, ...] = (MuonDimensionNumbers, FusedDimensionNumbers)
OUT_IN = MuonDimensionNumbers(reduction_axis=-1, output_axis=-2)

LAST_TWO_AXES = MuonDimensionNumbers(reduction_axis=-2, output_axis=-1)
ATTENTION_QKV = MuonDimensionNumbers(reduction_axis=-3, output_axis=(-2, -1))
ATTENTION_OUT = MuonDimensionNumbers(reduction_axis=(-3, -2), output_axis=-1)

LabelsOrFn = Union[None, Mapping[str, str], Any, Callable[[Any], Any]]
# What weight_dimension_numbers takes: one layout for every leaf, a tree (or a prefix of one) of
# them with None for "the default", or a callable params -> such a tree (as optax.contrib.muon).
DimensionNumbersOrFn = Union[None, optax.contrib.MuonDimensionNumbers,
                             FusedDimensionNumbers, optax.Params,
                             Callable[[optax.Params], Any]]

# What decided a Muon leaf's matrix, as describe_routing prints it.
LAYOUT_SOURCES = {"given": "given", "metadata": "metadata", "shape": "shapes",
                  "attention": "attention layer", "names": "names and shapes",
                  "module": "module type", "per_head": "attention heads", None: "last two axes"}


class PerHead(NamedTuple):
  """Per-head orthogonalisation of attention projections
  (:func:`stablejax.layout.heads.per_head_layouts`).

  Attributes:
    num_heads: the query head count, for layers of 2-D kernels without a query/key norm.
  """
  num_heads: Optional[int] = None


def per_head_of(per_head: Any, num_heads: Any) -> Optional[PerHead]:
  """Validates ``per_head`` / ``num_heads`` arguments: a :class:`PerHead`, or None."""
  if not isinstance(per_head, bool):
    raise ValueError(f"per_head must be True or False, got {per_head!r}")
  if num_heads is not None and (isinstance(num_heads, bool) or not isinstance(num_heads, int)
                                or num_heads < 1):
    raise ValueError(f"num_heads={num_heads!r} must be a positive int (the query head count)")
  return PerHead(num_heads) if per_head else None


def pure(tree: Any) -> Any:
  """``tree`` with every NNX ``Variable`` and Linen box replaced by its value."""
  return jax.tree.map(layout.value_of, tree, is_leaf=layout.is_param_leaf)


def _broadcast(prefix_tree: Any, tree: Any, is_value: Callable[[Any], bool], what: str) -> list:
  """Expands a prefix tree of values (leaves matching ``is_value``) to one value per parameter."""
  def expand(value: Any, subtree: Any) -> list:
    return [value] * len(param_leaves(subtree)[0])
  try:
    expanded = jax.tree.map(expand, prefix_tree, tree, is_leaf=is_value)
  except (ValueError, TypeError) as e:
    raise ValueError(f"{what} must have the structure of the params (one entry per parameter) or "
                     f"be a prefix of it; pass a callable params -> {what} to derive it ({e})"
                     ) from None
  out: list = []
  for chunk in jax.tree.leaves(expanded, is_leaf=lambda x: isinstance(x, list)):
    out.extend(chunk)
  return out


# ------------------------------------------------------------------ notes

@dataclasses.dataclass
class Note:
  """Something :func:`describe_routing` and the trainer banner print below the table."""
  kind: str      # "info" (a rule decided by shape), "unsure", or "warning"
  text: str


def _labels_hint(path: str, group: str) -> str:
  return f"param_labels={{{path!r}: {group!r}}}"


def _dims_hint(path: str) -> str:
  return ("weight_dimension_numbers=lambda p: stablejax.muon_dimension_numbers(p, overrides="
          f"{{{path!r}: optax.contrib.MuonDimensionNumbers(reduction_axis=..., output_axis=...)}})")


# ------------------------------------------------------------------ the role rules

def _batch_ndim(a: layout.Analysis, i: int) -> int:
  kinds = a.kinds[i]
  if kinds is not None:
    return sum(1 for k in kinds if k in layout._BATCH_KINDS)
  return 1 if a.stacked[i] else 0


def _metadata_role(a: layout.Analysis, i: int) -> Optional[str]:
  kinds = a.kinds[i]
  if kinds is None:
    return None
  if layout.NORM in kinds:
    return "adam"
  rest = [k for k in kinds if k not in layout._BATCH_KINDS]
  if len(rest) < 2:
    return "adam"
  if rest == [layout.VOCAB, layout.MODEL]:
    return "embedding"
  if rest == [layout.MODEL, layout.VOCAB]:
    return "head"
  return None


def _role(a: layout.Analysis, i: int) -> str:
  leaf = a.leaves[i]
  by_metadata = _metadata_role(a, i)
  if by_metadata is not None:
    return by_metadata
  lower = leaf.lower
  if len(leaf.shape) - _batch_ndim(a, i) < 2 or layout.is_vector_name(leaf):
    return "adam"
  if any(layout.is_strong_head(n) for n in lower):
    return "head"
  if layout.is_embedding_name(leaf):
    return "embedding"
  return "muon"


def _embedding_table(a: layout.Analysis, labels: list) -> Optional[int]:
  tables = [i for i, leaf in enumerate(a.leaves)
            if labels[i] == "embedding" and len(leaf.shape) == 2 and not a.stacked[i]
            and not layout.is_positional(leaf)]
  return max(tables, key=lambda i: a.leaves[i].shape[0]) if tables else None


def _find_head(a: layout.Analysis, labels: list, fixed: list) -> list[Note]:
  """Finds an output head the names did not mark, by its shape against the embedding table."""
  if any(label == "head" for label in labels):
    return []
  table = _embedding_table(a, labels)
  if table is None:
    return []
  leaves = a.leaves
  vocab, dim = leaves[table].shape
  emb = f"{leaves[table].path} {leaves[table].shape}"
  if vocab == dim:
    return [Note("unsure", f"the embedding {emb} is square, so no head can be told apart by "
                           "shape; if the model has an output head, route it with "
                           + _labels_hint("<path of the head kernel>", "head"))]

  def candidates(shape: tuple) -> list[int]:
    return [i for i, leaf in enumerate(leaves)
            if labels[i] == "muon" and not fixed[i] and not a.in_block[i] and leaf.shape == shape]
  for shape, kind in (((dim, vocab), "info"), ((vocab, dim), "unsure")):
    found = candidates(shape)
    if not found:
      continue
    named = [i for i in found if set(leaves[i].lower[-2:]) & set(layout._AMBIGUOUS_HEAD)]
    pool = named or found
    depth = min(len(leaves[i].names) for i in pool)
    pool = [i for i in pool if len(leaves[i].names) == depth]
    head = max(pool, key=lambda i: (_auto_index(leaves[i]), leaves[i].path))
    labels[head] = "head"
    rest = [leaves[i].path for i in found if i != head]
    if named and not rest and shape == (dim, vocab):
      return []  # named like a head and shaped like one: nothing to report
    what = "[d_model, vocab]" if shape == (dim, vocab) else "[vocab, d_model]"
    text = (f"{leaves[head].path} {leaves[head].shape} is routed to 'head': the {what} matrix "
            f"outside the repeated blocks, next to the embedding {emb}")
    if rest:
      kind = "unsure"
      text += (f" (also that shape: {', '.join(rest)}; if one of them is the head instead, say "
               f"so with {_labels_hint(rest[0], 'head')})")
    text += f"; if it is not the head: {_labels_hint(leaves[head].path, 'muon')}"
    return [Note(kind, text)]
  other = [leaves[i].path for i, leaf in enumerate(leaves)
           if i != table and labels[i] in ("muon", "embedding") and not a.in_block[i]
           and vocab in leaf.shape]
  if other:
    return [Note("unsure", f"no output head found next to the embedding {emb}; "
                           f"{', '.join(other)} also have a vocabulary-sized axis; if one is the "
                           f"head: {_labels_hint(other[0], 'head')}")]
  return [Note("info", f"no output head found outside the repeated blocks: taken as tied to the "
                       f"embedding {emb} (logits = x @ embedding.T, trained by its AdamW group); "
                       f"if the model has a separate head, route it with "
                       f"{_labels_hint('<path>', 'head')}")]


def _auto_index(leaf: Leaf) -> int:
  m = re.search(r"_(\d+)$", leaf.names[-2]) if len(leaf.names) >= 2 else None
  return int(m.group(1)) if m else -1


def _match(pattern: str, path: str) -> bool:
  return fnmatch.fnmatchcase(path, pattern) or path.startswith(pattern.rstrip("/") + "/")


def _is_overrides(x: Any) -> bool:
  return (isinstance(x, Mapping) and len(x) > 0
          and all(isinstance(k, str) and isinstance(v, str) for k, v in x.items()))


def _apply_overrides(leaves: Sequence[Leaf], values: list, overrides: Mapping, what: str,
                     check: Callable[[str, Any], None], strict: bool) -> tuple[list, list[Note]]:
  """Sets ``values[i]`` for every leaf a pattern matches; patterns matching nothing warn."""
  fixed = [False] * len(leaves)
  unmatched = []
  for pattern, value in overrides.items():
    check(pattern, value)
    hits = [i for i, leaf in enumerate(leaves) if not leaf.masked and _match(pattern, leaf.path)]
    if not hits:
      unmatched.append(pattern)
    for i in hits:
      values[i] = value
      fixed[i] = True
  if not unmatched:
    return fixed, []
  example = next((leaf.path for leaf in leaves if not leaf.masked), "")
  text = (f"{what} pattern{'s' if len(unmatched) > 1 else ''} {', '.join(map(repr, unmatched))} "
          f"match{'' if len(unmatched) > 1 else 'es'} no parameter of this model (ignored); "
          f"patterns are fnmatch globs or path prefixes on '/'-joined paths such as {example!r}")
  if strict:
    raise ValueError(text)
  return fixed, [Note("warning", text)]


def _check_group(pattern: str, group: Any) -> None:
  if group not in GROUPS:
    raise ValueError(f"param_labels maps {pattern!r} to unknown group {group!r}; "
                     f"use one of {GROUPS}")


def default_labels(leaves: Sequence[Leaf], overrides: Optional[Mapping[str, str]] = None,
                   strict: bool = False, analysis: Optional[layout.Analysis] = None
                   ) -> tuple[list, list[Note]]:
  """Labels (None for masked leaves) and notes of the default rule, with optional overrides."""
  a = analysis or layout.analyse(leaves)
  labels: list = [None if leaf.masked else _role(a, i) for i, leaf in enumerate(leaves)]
  fixed = [False] * len(leaves)
  notes: list[Note] = []
  if overrides:
    fixed, notes = _apply_overrides(leaves, labels, overrides, "param_labels", _check_group,
                                    strict)
  return labels, notes + _find_head(a, labels, fixed)


# ------------------------------------------------------------------ matrix layouts

def _normalize_axes(dims: MuonDimensionNumbers, ndim: int) -> tuple[tuple, tuple]:
  def norm(axes: Any) -> tuple:
    axes = (axes,) if isinstance(axes, (int, np.integer)) else tuple(axes)
    return tuple(int(a) % ndim if -ndim <= int(a) < ndim else None for a in axes)
  return norm(dims.reduction_axis), norm(dims.output_axis)


def check_dims(dims: Any, shape: Sequence[int], path: str) -> None:
  """Raises a clear error when ``dims`` does not describe a matrix of a ``shape`` leaf."""
  if not isinstance(dims, DIMENSION_TYPES):
    raise ValueError(f"weight_dimension_numbers for {path} must be an "
                     "optax.contrib.MuonDimensionNumbers, a stablejax.FusedDimensionNumbers or "
                     f"None, got {dims!r}")
  red, out = _normalize_axes(dims, len(shape))
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
  red, out = _normalize_axes(dims, len(shape))
  batch = tuple(shape[a] for a in range(len(shape)) if a not in red and a not in out)
  return batch, math.prod(shape[a] for a in red), math.prod(shape[a] for a in out)


def _given_layouts(tree: Any, weight_dimension_numbers: Any, n: int) -> list:
  if weight_dimension_numbers is None:
    return [None] * n
  wdn = weight_dimension_numbers
  if callable(wdn) and not isinstance(wdn, MuonDimensionNumbers):
    wdn = wdn(pure(tree))
  return _broadcast(wdn, tree, lambda x: x is None or isinstance(x, DIMENSION_TYPES),
                    "weight_dimension_numbers")


def _layouts(tree: Any, leaves: Sequence[Leaf], a: layout.Analysis, weight_dimension_numbers: Any,
             muon: Sequence[bool], per_head: Optional[PerHead] = None) -> tuple[list, list]:
  """One layout and its source per leaf (None for leaves that are not Muon's)."""
  given = _given_layouts(tree, weight_dimension_numbers, len(leaves))
  layouts: list = []
  sources: list = []
  for i, leaf in enumerate(leaves):
    if leaf.masked or not muon[i]:
      layouts.append(None)
      sources.append(None)
      continue
    if given[i] is not None:
      dims, source = given[i], "given"
    elif i in a.layouts:
      dims, source = a.layouts[i].dims, a.layouts[i].source
    else:
      dims, source = LAST_TWO_AXES, None
    if len(leaf.shape) >= 2:
      check_dims(dims, leaf.shape, leaf.path)
    layouts.append(dims)
    sources.append(source)
  if per_head is not None:
    split, unknown = _heads.per_head_layouts(a, layouts, per_head.num_heads)
    if unknown:
      raise ValueError(f"per_head: attention layer {unknown[0]!r} holds all its heads in one "
                       "axis of 2-D kernels and has no query/key norm to read the head size "
                       "from; pass num_heads= (the model's query head count)")
    for i, dims in split.items():
      if sources[i] != "given":
        check_dims(dims, leaves[i].shape, leaves[i].path)
        layouts[i], sources[i] = dims, "per_head"
  return layouts, sources


def matrix_layouts(tree: Any, weight_dimension_numbers: Any = None,
                   per_head: Optional[PerHead] = None) -> list:
  """One ``MuonDimensionNumbers`` per parameter of ``tree`` (None for masked-out leaves).

  Every unmasked parameter is taken to be a Muon matrix. Given dimension numbers win (a tree,
  a prefix of one, a single one, or a callable ``params -> tree``, as ``optax.contrib.muon`` takes
  them; a None entry means "the default layout"); otherwise the layout the analysis recognises
  in this tree, otherwise the last two axes.
  """
  leaves, _ = param_leaves(tree)
  a = layout.analyse(leaves)
  return _layouts(tree, leaves, a, weight_dimension_numbers, [True] * len(leaves), per_head)[0]


def to_matrices(x: jax.Array, dims: Any) -> tuple[jax.Array, Callable[[jax.Array], jax.Array]]:
  """``x`` as ``[*batch, fan_in, fan_out]`` per ``dims``, and the function that undoes it."""
  red, out = _normalize_axes(dims, x.ndim)
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


def split_fused(x: jax.Array, dims: Any) -> tuple[list, Callable[[list], jax.Array]]:
  """The matrices of a leaf as ``[(piece, dims)]`` and the function that joins their results.

  Plain dimension numbers: the leaf itself. A :class:`stablejax.FusedDimensionNumbers` kernel:
  equal parts become one more batch axis (``[D, 3W]`` -> ``[D, 3, W]``: one batched NS call);
  parts of different sizes (grouped-query ``[D, (H + 2K) hd]``) are sliced apart.
  """
  if not isinstance(dims, FusedDimensionNumbers):
    return [(x, dims)], lambda outs: outs[0]
  red, out = _normalize_axes(dims, x.ndim)
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


def part_shapes(dims: Any, shape: Sequence[int]) -> list[tuple[tuple, int, int]]:
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


def _layout_name(dims: MuonDimensionNumbers, shape: Sequence[int]) -> str:
  names = []
  for batch, fan_in, fan_out in part_shapes(dims, shape):
    n = math.prod(batch)
    names.append(f"{n} x {fan_in}x{fan_out}" if n > 1 else f"{fan_in}x{fan_out}")
  if len(names) > 1 and len(set(names)) == 1:
    return f"{len(names)} x {names[0]}" if " x " not in names[0] else \
        f"{len(names)} parts of {names[0]}"
  return " + ".join(names)


def _unrecognised_note(leaves: Sequence[Leaf], a: layout.Analysis, labels: list, layouts: list,
                       sources: list) -> list[Note]:
  """One warning for every Muon kernel of 3+ non-batch axes that no rule recognised."""
  by_layout: dict = collections.defaultdict(list)
  for i, leaf in enumerate(leaves):
    if labels[i] != "muon" or sources[i] is not None:
      continue
    if len(leaf.shape) - _batch_ndim(a, i) < 3:
      continue
    by_layout[(leaf.shape, _layout_name(layouts[i], leaf.shape))].append(leaf.path)
  if not by_layout:
    return []
  n = sum(len(v) for v in by_layout.values())
  parts = []
  for (shape, name), paths in by_layout.items():
    shown = ", ".join(paths[:2]) + (f" and {len(paths) - 2} more" if len(paths) > 2 else "")
    parts.append(f"{len(paths)} x {shape} as {name} ({shown})")
  first = next(iter(by_layout.values()))[0]
  return [Note("warning", f"{n} kernel{'s' if n > 1 else ''} of 3+ axes match no layout rule "
                          "(no logical axis names, no single d_model axis, not a recognised "
                          "attention layer), so Muon orthogonalises their last two axes: "
                          + "; ".join(parts) + "; if that is not their layout: "
                          + _dims_hint(first))]


def _fused_notes(leaves: Sequence[Leaf], a: layout.Analysis, labels: list, layouts: list,
                 sources: list) -> list[Note]:
  """What was done with fused kernels: split per projection (info), or left whole (warning)."""
  notes = []
  split = collections.defaultdict(list)
  for i, leaf in enumerate(leaves):
    if labels[i] == "muon" and isinstance(layouts[i], FusedDimensionNumbers) \
        and sources[i] not in ("given", "per_head"):
      split[(leaf.shape, _layout_name(layouts[i], leaf.shape))].append(leaf.path)
  for (shape, name), paths in split.items():
    shown = ", ".join(paths[:2]) + (f" and {len(paths) - 2} more" if len(paths) > 2 else "")
    notes.append(Note("info", f"{len(paths)} fused kernel{'s' if len(paths) > 1 else ''} "
                              f"{shape} ({shown}) orthogonalised per projection as {name}; if "
                              "the parts differ: " + _dims_hint(paths[0]).replace(
                                  "optax.contrib.MuonDimensionNumbers(reduction_axis=..., "
                                  "output_axis=...)", "stablejax.FusedDimensionNumbers(...)")))
  whole = [leaves[i].path for i in a.unsplit
           if labels[i] == "muon" and not isinstance(layouts[i], FusedDimensionNumbers)
           and sources[i] != "given"]
  if whole:
    notes.append(Note("warning", f"{whole[0]} {leaves[a.unsplit[0]].shape} is named like a fused "
                                 "projection but its parts cannot be read from the shapes, so "
                                 "Muon orthogonalises it as one matrix"
                                 + (f" (also {len(whole) - 1} more)" if len(whole) > 1 else "")
                                 + "; say how it splits: " + _dims_hint(whole[0]).replace(
                                     "optax.contrib.MuonDimensionNumbers(reduction_axis=..., "
                                     "output_axis=...)",
                                     "stablejax.FusedDimensionNumbers(reduction_axis=..., "
                                     "output_axis=..., fused_axis=..., parts=...)")))
  return notes


# ------------------------------------------------------------------ the plan

class RoutingPlan(NamedTuple):
  """Labels, Muon matrix layouts and notes for every parameter of one tree."""
  leaves: list
  treedef: Any
  labels: list
  layouts: list
  notes: list
  sources: list = []

  def label_tree(self) -> Any:
    """The labels as a tree: the params' structure with each parameter replaced by its group.

    Masked-out leaves (``optax.MaskedNode``, when an ``optax.masked`` wraps the transform) stay
    ``MaskedNode``, so the tree still matches the params it came from.
    """
    return self.treedef.unflatten([optax.MaskedNode() if leaf.masked else label
                                   for leaf, label in zip(self.leaves, self.labels)])

  def unmasked_labels(self) -> list:
    """One label per array leaf of the params, in ``jax.tree.leaves`` order."""
    return [label for leaf, label in zip(self.leaves, self.labels) if not leaf.masked]

  def muon_layouts(self) -> list:
    """The layout of every Muon leaf, in order (what the Muon branch orthogonalises)."""
    return [d for leaf, label, d in zip(self.leaves, self.labels, self.layouts)
            if label == "muon" and not leaf.masked]

  def muon_only_key(self) -> tuple:
    """The structure key of the params with every non-Muon leaf masked out, as
    ``optax.partition`` hands them to the Muon branch."""
    return tuple((leaf.names, leaf.shape, False) if label == "muon" and not leaf.masked
                 else (leaf.names, (), True) for leaf, label in zip(self.leaves, self.labels))


def plan(tree: Any, param_labels: LabelsOrFn = None, weight_dimension_numbers: Any = None,
         strict: bool = False, per_head: Optional[PerHead] = None) -> RoutingPlan:
  """Routes every parameter of ``tree``: group, Muon matrix layout, and notes on unsure rules.

  Args:
    tree: the params (any pytree; NNX ``Variable`` objects and Linen boxes count as one
      parameter each).
    param_labels: None (default rule), a mapping ``{path pattern: group}`` applied on top of the
      default rule, a label tree (or a prefix of one), or a callable ``params -> labels``.
    weight_dimension_numbers: Muon matrix layouts, as ``optax.contrib.muon`` takes them.
    strict: a ``param_labels`` pattern that matches no parameter is an error (a warning note
      otherwise).
    per_head: orthogonalise attention projections per head (:class:`PerHead`); None: whole.

  Returns:
    A :class:`RoutingPlan`.
  """
  leaves, values, treedef = param_leaves(tree, with_values=True)
  a = layout.analyse(leaves)
  notes: list[Note] = []
  if param_labels is None or _is_overrides(param_labels):
    overrides: Optional[Mapping[str, str]] = param_labels  # type: ignore[assignment]
    labels, notes = default_labels(leaves, overrides, strict, a)
  else:
    given = param_labels(pure(tree)) if callable(param_labels) else param_labels
    labels = _broadcast(given, tree, lambda x: isinstance(x, str), "param_labels")
  bad = sorted({str(lab) for lab, leaf in zip(labels, leaves) if not leaf.masked
                and lab not in GROUPS})
  if bad:
    raise ValueError(f"param_labels contains unknown group(s) {bad}; use labels from {GROUPS}")
  for leaf, label in zip(leaves, labels):
    if label == "muon" and len(leaf.shape) < 2:
      raise ValueError(f"Muon needs matrices but {leaf.path} has shape {leaf.shape}; label it "
                       f"'adam' in param_labels, e.g. {_labels_hint(leaf.path, 'adam')}")
  muon = [label == "muon" for label in labels]
  layouts, sources = _layouts(tree, leaves, a, weight_dimension_numbers, muon, per_head)
  if per_head is not None and "per_head" not in sources:
    notes.append(Note("warning", "per_head: no attention projection is split per head (no "
                                 "attention layer was recognised, or weight_dimension_numbers "
                                 "gives their layouts); give them as stablejax."
                                 "FusedDimensionNumbers with one part per head"))
  notes += _unrecognised_note(leaves, a, labels, layouts, sources)
  notes += _fused_notes(leaves, a, labels, layouts, sources)
  return RoutingPlan(leaves, treedef, labels, layouts, notes, sources)


def warn_notes(notes: Sequence[Note], who: str, stacklevel: int = 3) -> None:
  """Emits each warning note as one ``UserWarning``."""
  for note in notes:
    if note.kind == "warning":
      warnings.warn(f"{who}: {note.text}", stacklevel=stacklevel)


# ------------------------------------------------------------------ public helpers

def label_params(params: Any, overrides: Optional[Mapping[str, str]] = None,
                 strict: bool = False) -> Any:
  """Default routing: a pytree of group labels with the structure of ``params``.

  Rules, first match wins (see :mod:`stablejax.muon.routing` and :mod:`stablejax.layout.analysis`):

  1. Flax metadata with logical axis names: a ``norm`` axis or fewer than 2 non-batch axes is
     ``"adam"``, ``('vocab', 'embed')`` is ``"embedding"``, ``('embed', 'vocab')`` is ``"head"``;
  2. ``"adam"`` (never weight decayed): vectors and scalars (fewer than 2 axes, not counting the
     layer axis of a scan-stacked subtree), leaves named ``bias`` or ``scale``, and anything
     under a component containing ``norm`` or named ``ln``, ``ln_f``, ``ln_1``, ``ln1``...;
  3. ``"head"``: a component named ``lm_head``, ``head``, ``logits``, ``unembed``,
     ``unembedding`` or ending in ``head`` (``value_head``);
  4. ``"embedding"``: a path containing ``embed`` (but not ``emb_proj``), or a component named
     ``wte`` / ``wpe``;
  5. ``"muon"``: every other matrix.

  Then, when an embedding table ``[V, D]`` (``V != D``) exists and no head was found, the head is
  looked for by shape: a ``[D, V]`` matrix (else a ``[V, D]`` one) *outside the repeated blocks*
  (scan-stacked subtrees, structurally identical siblings such as ``block_0``, ``block_1``, and
  components named like blocks or layers), whatever its module is called (Linen's auto-named
  ``Dense_3``, lm1b's ``decoder/logitdense``, miniGPT's ``output_layer``). Without one the head
  is taken as tied to the embedding, and an MLP kernel of the same shape inside a block (MLP
  width equal to the vocabulary) is not mistaken for it. :func:`describe_routing` reports what
  was decided by shape, a head taken as tied, and every case it is unsure of, with the override
  to use.

  Args:
    params: any pytree of arrays (or ``jax.ShapeDtypeStruct``), Flax Linen params or
      variables, boxed (``nn.Partitioned`` / ``nn.LogicallyPartitioned``) or not, ``nnx.State``
      (NNX ``Variable`` objects count as one parameter each).
    overrides: optional ``{pattern: group}`` applied after the rules; a pattern is an fnmatch
      glob on the ``/``-joined path (``"params/Dense_3/*"``) or a path prefix
      (``"params/Dense_3"``). A pattern matching no parameter warns once, naming it (so one
      mapping can serve several variants of a model).
    strict: a pattern matching no parameter is an error instead.

  Returns:
    A pytree of strings from :data:`GROUPS`: the structure of ``params`` with each parameter
    (array, box or NNX ``Variable``) replaced by its group.

  Example:
    >>> import jax.numpy as jnp
    >>> from stablejax import label_params
    >>> labels = label_params({"wte": {"embedding": jnp.zeros((10, 4))},
    ...                        "mlp": {"kernel": jnp.zeros((4, 8)), "bias": jnp.zeros(8)},
    ...                        "lm_head": {"kernel": jnp.zeros((4, 10))}})
    >>> labels["lm_head"], labels["mlp"], labels["wte"]
    ({'kernel': 'head'}, {'bias': 'adam', 'kernel': 'muon'}, {'embedding': 'embedding'})
  """
  if overrides is not None and not isinstance(overrides, Mapping):
    raise ValueError(f"overrides must be a mapping {{path pattern: group}}, got {overrides!r}")
  leaves, treedef = param_leaves(params)
  labels, notes = default_labels(leaves, overrides or None, strict)
  warn_notes(notes, "label_params")
  return treedef.unflatten(labels)


def muon_dimension_numbers(params: Any, overrides: Optional[Mapping[str, Any]] = None,
                           param_labels: LabelsOrFn = None, strict: bool = False, *,
                           per_head: bool = False, num_heads: Optional[int] = None) -> Any:
  """The matrix layout of every Muon parameter, as ``optax.contrib.MuonDimensionNumbers``.

  The tree :func:`stablejax.outlier_safe_muon` uses by default: the layouts read from Flax
  metadata or shapes (attention kernels as their whole matrix), the last two axes otherwise,
  and None for parameters not routed to Muon. It is also what
  ``optax.contrib.muon(muon_weight_dimension_numbers=...)`` takes, and, with ``overrides``, the
  easy way to give one leaf its layout.

  Args:
    params: the params (any pytree; NNX ``Variable`` objects and Linen boxes count as one
      parameter).
    overrides: optional ``{pattern: MuonDimensionNumbers}``; patterns as in
      :func:`label_params`. A pattern matching no parameter warns once, naming it.
    param_labels: the routing, as :func:`stablejax.outlier_safe_muon` takes it.
    strict: a pattern matching no parameter is an error instead.
    per_head: attention projections per head (query, key, value per head, grouped-query key
      and value per key head, the output projection per head; see
      :func:`stablejax.layout.heads.per_head_layouts`); kernels with a heads axis get plain
      ``MuonDimensionNumbers`` that ``optax.contrib.muon`` takes too.
    num_heads: the query head count, for ``per_head`` on 2-D projections without a query/key
      norm.

  Returns:
    A tree with the structure of ``params`` (each parameter replaced by its dimension numbers or
    None).

  Example:
    >>> import jax.numpy as jnp, optax, stablejax
    >>> params = {"conv": {"kernel": jnp.zeros((3, 3, 8, 16))}}
    >>> dims = stablejax.muon_dimension_numbers(params, overrides={
    ...     "conv/kernel": optax.contrib.MuonDimensionNumbers((0, 1, 2), 3)})
    >>> tx = stablejax.outlier_safe_muon(2e-3, weight_dimension_numbers=dims)
  """
  p = plan(params, param_labels, strict=strict, per_head=per_head_of(per_head, num_heads))
  warn_notes([n for n in p.notes if n.text.startswith("per_head")], "muon_dimension_numbers")
  layouts = list(p.layouts)
  if overrides:
    def check(pattern: str, dims: Any) -> None:
      if not isinstance(dims, DIMENSION_TYPES):
        raise ValueError(f"overrides maps {pattern!r} to {dims!r}; use "
                         "optax.contrib.MuonDimensionNumbers(reduction_axis=..., output_axis=...) "
                         "or stablejax.FusedDimensionNumbers(..., fused_axis=..., parts=...)")
    given = [None] * len(p.leaves)
    fixed, notes = _apply_overrides(p.leaves, given, overrides, "muon_dimension_numbers overrides",
                                    check, strict)
    for i, hit in enumerate(fixed):
      if not hit:
        continue
      if p.labels[i] != "muon":
        raise ValueError(f"overrides gives dimension numbers to {p.leaves[i].path}, which is "
                         f"routed to {p.labels[i]!r}, not Muon")
      check_dims(given[i], p.leaves[i].shape, p.leaves[i].path)
      layouts[i] = given[i]
    warn_notes(notes, "muon_dimension_numbers")
  return p.treedef.unflatten(layouts)


def resolve_labels(params: Any, param_labels: LabelsOrFn = None) -> Any:
  """Labels for ``params`` from None, a ``{pattern: group}`` mapping, a callable or a label tree."""
  return plan(params, param_labels).label_tree()


# ------------------------------------------------------------------ for describe_routing

class RoutingInfo(NamedTuple):
  """What :func:`stablejax.outlier_safe_muon` was built with, for :func:`describe_routing`."""
  param_labels: Any
  weight_dimension_numbers: Any
  learning_rates: dict      # group -> float, schedule or (under inject_hyperparams) tracer
  rate_sources: dict        # group -> name of the argument the rate came from
  per_head: Optional[PerHead] = None


_CAPTURES: list = []


def record_init(info: RoutingInfo, params: Any) -> None:
  """Called by outlier_safe_muon's ``init``: lets :func:`describe_routing` find it in any chain."""
  if _CAPTURES:
    _CAPTURES[-1].append((info, params))


def capturing() -> bool:
  """Whether :func:`describe_routing` is tracing an ``init`` (it prints the notes itself)."""
  return bool(_CAPTURES)


@contextlib.contextmanager
def _capture() -> Any:
  found: list = []
  _CAPTURES.append(found)
  try:
    yield found
  finally:
    _CAPTURES.pop()
