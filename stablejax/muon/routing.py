"""Which optimizer updates which parameter, and which matrix Muon orthogonalises.

Muon is defined for the hidden weight matrices of a network. Embedding tables (a lookup, not a
matrix-vector product), the output head, and vectors (norm scales, biases) are trained with AdamW
in every published Muon setup (Jordan et al., modded-nanogpt; Liu et al., arXiv 2502.16982).
Optimizers that route by ``ndim == 2`` alone silently send the embedding and the head to Muon,
so the routing here goes by the parameter's role, read from its path and shape, and can be printed
with :func:`describe_routing`.

Groups: ``"muon"`` (hidden matrices), ``"adam"`` (norm gains, biases, scalars: never weight
decayed), ``"embedding"`` and ``"head"`` (AdamW matrices with their own learning rates).

**A function of the parameter, not of its wrapping.** Labels depend only on each parameter's path
and shape. A Flax NNX ``Variable`` counts as one parameter at the path of the ``Variable`` (so
``nnx.state(model, nnx.Param)`` at ``init`` and the pure arrays ``nnx.Optimizer.update`` passes
give the same labels), and Linen ``{'params': ...}`` collections, ``FrozenDict``, ``nnx.State``,
dicts, lists, tuples and ``jax.ShapeDtypeStruct`` leaves all work.

**Matrix layout.** A leaf's matrix is described by an ``optax.contrib.MuonDimensionNumbers``
(reduction axes = fan-in, output axes = fan-out, every other axis a batch axis, as in
``optax.contrib.muon``). Defaults: the last two axes ``[..., fan_in, fan_out]`` (Flax ``Dense``
kernels are ``[in, out]``; a scan-stacked ``[L, in, out]`` kernel is ``L`` matrices); the query,
key and value kernels ``[..., D, H, hd]`` of Flax's ``MultiHeadDotProductAttention`` and
``nnx.MultiHeadAttention`` are the ``[D, H*hd]`` matrix and their output kernel ``[..., H, hd, D]``
the ``[H*hd, D]`` matrix (also stacked under ``nn.scan`` / ``nnx.scan``).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import fnmatch
import functools
import math
import re
import sys
from typing import Any, Callable, Mapping, NamedTuple, Optional, Union

import jax
import numpy as np
import optax

GROUPS = ("muon", "adam", "embedding", "head")
MuonDimensionNumbers = optax.contrib.MuonDimensionNumbers

LAST_TWO_AXES = MuonDimensionNumbers(reduction_axis=-2, output_axis=-1)
ATTENTION_QKV = MuonDimensionNumbers(reduction_axis=-3, output_axis=(-2, -1))
ATTENTION_OUT = MuonDimensionNumbers(reduction_axis=(-3, -2), output_axis=-1)

LabelsOrFn = Union[None, Mapping[str, str], Any, Callable[[Any], Any]]

# Name rules (on lower-cased path components).
_NORM = re.compile(r"norm|^ln(_\w+|\d+)?$")          # rms_norm, LayerNorm_0, ln_f, ln1 ...
_VECTOR_NAMES = ("bias", "scale")
_STRONG_HEAD = ("lm_head", "head", "logits", "unembed", "unembedding")
_AMBIGUOUS_HEAD = ("out", "output", "decoder")       # a head only if shaped like one
_ATTENTION = ("query", "key", "value", "out")


# ------------------------------------------------------------------ canonical view of a tree

def _key_name(entry) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(entry, attr):
      return str(getattr(entry, attr))
  return str(entry)


def path_to_str(path) -> str:
  """``('params', 'block_0', 'attn', 'kernel')`` style key path -> ``params/block_0/attn/kernel``."""
  return "/".join(_key_name(e) for e in path)


def _is_variable(x) -> bool:
  nnx = sys.modules.get("flax.nnx")  # no NNX Variable can exist unless flax.nnx was imported
  return nnx is not None and isinstance(x, nnx.Variable)


def _is_param_leaf(x) -> bool:
  return _is_variable(x) or isinstance(x, optax.MaskedNode)


def _value(x):
  return x.get_value() if _is_variable(x) else x


def pure(tree):
  """``tree`` with every NNX ``Variable`` replaced by its value (other trees are unchanged)."""
  return jax.tree.map(_value, tree, is_leaf=_is_variable)


@dataclasses.dataclass
class Leaf:
  """One parameter of a tree: its path, shape, and whether it is masked out (``MaskedNode``)."""
  names: tuple
  shape: tuple
  masked: bool

  @property
  def path(self) -> str:
    return "/".join(self.names)

  @property
  def lower(self) -> tuple:
    return tuple(n.lower() for n in self.names)


def param_leaves(tree, with_values: bool = False):
  """The parameters of ``tree`` (an NNX ``Variable`` is one parameter) and the treedef to rebuild it.

  Returns ``(leaves, treedef)``, or ``(leaves, values, treedef)`` with ``with_values``.
  """
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_param_leaf)
  leaves = []
  for path, leaf in flat:
    masked = isinstance(leaf, optax.MaskedNode)
    shape = () if masked else tuple(np.shape(_value(leaf)))
    leaves.append(Leaf(tuple(_key_name(k) for k in path), shape, masked))
  if with_values:
    return leaves, [leaf for _, leaf in flat], treedef
  return leaves, treedef


def _broadcast(prefix_tree, tree, is_value, what: str) -> list:
  """Expands a prefix tree of values (leaves matching ``is_value``) to one value per parameter."""
  def expand(value, subtree):
    return [value] * len(param_leaves(subtree)[0])
  try:
    expanded = jax.tree.map(expand, prefix_tree, tree, is_leaf=is_value)
  except (ValueError, TypeError) as e:
    raise ValueError(f"{what} must have the structure of the params (one entry per parameter) or "
                     f"be a prefix of it; pass a callable params -> {what} to derive it ({e})"
                     ) from None
  out = []
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

def _stacked(leaves: list[Leaf]) -> list[bool]:
  """Whether each leaf lies in a scan-stacked subtree (``nn.scan`` / ``nnx.scan`` over layers).

  A subtree is a stack of length ``L`` when it holds at least two parameters, all with leading
  axis ``L``, at least one of 3+ axes (a stacked matrix) and one of at most 2 (a stacked norm
  gain, bias or scalar).
  """
  members = collections.defaultdict(list)
  for i, leaf in enumerate(leaves):
    if not leaf.masked:
      for k in range(len(leaf.names)):
        members[leaf.names[:k]].append(i)

  @functools.lru_cache(maxsize=None)
  def is_stack(prefix) -> bool:
    idx = members[prefix]
    shapes = [leaves[i].shape for i in idx]
    if len(idx) < 2 or any(len(s) == 0 for s in shapes) or len({s[0] for s in shapes}) != 1:
      return False
    ndims = [len(s) for s in shapes]
    return max(ndims) >= 3 and min(ndims) <= 2

  return [not leaf.masked and len(leaf.shape) >= 1
          and any(is_stack(leaf.names[:k]) for k in range(len(leaf.names)))
          for leaf in leaves]


def _is_strong_head(name: str) -> bool:
  return name in _STRONG_HEAD or (name.endswith("head") and not name.endswith("multihead"))


def _role(leaf: Leaf, stacked: bool) -> str:
  lower = leaf.lower
  name = lower[-1] if lower else ""
  joined = "/".join(lower)
  if len(leaf.shape) - stacked < 2 or name in _VECTOR_NAMES or any(_NORM.search(n) for n in lower):
    return "adam"
  if any(_is_strong_head(n) for n in lower):
    return "head"
  if ("embed" in joined and "emb_proj" not in joined) or any(n in ("wte", "wpe") for n in lower):
    return "embedding"
  return "muon"


def _is_top_level(leaf: Leaf) -> bool:
  n = len(leaf.names)
  return n == 2 or (n == 3 and leaf.lower[0] == "params")


def _auto_index(leaf: Leaf) -> int:
  m = re.search(r"_(\d+)$", leaf.names[-2]) if len(leaf.names) >= 2 else None
  return int(m.group(1)) if m else -1


def _find_head(leaves, labels, stacked, fixed) -> list[Note]:
  """Finds an output head the name rules missed, by its shape against the embedding table."""
  if any(l == "head" for l in labels):
    return []
  tables = [i for i, leaf in enumerate(leaves)
            if labels[i] == "embedding" and len(leaf.shape) == 2 and not stacked[i]
            and not any("pos" in n or n == "wpe" for n in leaf.lower)]
  if not tables:
    return []
  table = max(tables, key=lambda i: leaves[i].shape[0])
  vocab, dim = leaves[table].shape
  emb = f"{leaves[table].path} {leaves[table].shape}"
  if vocab == dim:
    return [Note("unsure", f"the embedding {emb} is square, so no head can be told apart by "
                           "shape; if the model has an output head, route it with "
                           + _labels_hint("<path of the head kernel>", "head"))]
  candidates = [i for i, leaf in enumerate(leaves)
                if labels[i] == "muon" and not fixed[i] and not stacked[i]
                and leaf.shape == (dim, vocab)]
  named = [i for i in candidates if set(leaves[i].lower[-2:]) & set(_AMBIGUOUS_HEAD)]
  top = [i for i in candidates if i not in named and _is_top_level(leaves[i])]
  notes = []
  if named:
    heads = named
  elif top:
    heads = [max(top, key=lambda i: _auto_index(leaves[i]))]
    rest = [leaves[i].path for i in top if i not in heads]
    why = "the last of several top-level" if rest else "the top-level"
    notes.append(Note("info" if not rest else "unsure",
                      f"{leaves[heads[0]].path} {leaves[heads[0]].shape} is routed to 'head': "
                      f"{why} [d_model, vocab] matrix next to the embedding {emb}"
                      + (f" (also that shape: {', '.join(rest)}; if one of them is the head "
                         f"instead, say so with {_labels_hint(rest[0], 'head')})" if rest else "")
                      + f"; if it is not the head: {_labels_hint(leaves[heads[0]].path, 'muon')}"))
  else:
    heads = []
  for i in heads:
    labels[i] = "head"
  if heads:
    return notes
  inner = [leaves[i].path for i in candidates]
  if inner:
    return [Note("unsure", f"no output head found next to the embedding {emb}; "
                           f"{', '.join(inner)} {'have' if len(inner) > 1 else 'has'} its "
                           f"[d_model, vocab] shape {(dim, vocab)} but sit inside a block, so "
                           f"{'they stay' if len(inner) > 1 else 'it stays'} on Muon; if one is the "
                           f"head: {_labels_hint(inner[0], 'head')}")]
  other = [leaves[i].path for i, leaf in enumerate(leaves)
           if i != table and labels[i] in ("muon", "embedding") and vocab in leaf.shape]
  if other:
    return [Note("unsure", f"no output head found next to the embedding {emb}; "
                           f"{', '.join(other)} also have a vocabulary-sized axis; if one is the "
                           f"head: {_labels_hint(other[0], 'head')}")]
  return [Note("info", f"no output head found: taken as tied to the embedding {emb} "
                       "(logits = x @ embedding.T, trained by its AdamW group); if the model has "
                       f"a separate head, route it with {_labels_hint('<path>', 'head')}")]


def _match(pattern: str, path: str) -> bool:
  return fnmatch.fnmatchcase(path, pattern) or path.startswith(pattern.rstrip("/") + "/")


def _is_overrides(x) -> bool:
  return (isinstance(x, Mapping) and len(x) > 0
          and all(isinstance(k, str) and isinstance(v, str) for k, v in x.items()))


def _apply_overrides(leaves, values, overrides: Mapping, what: str, check) -> list[bool]:
  fixed = [False] * len(leaves)
  for pattern, value in overrides.items():
    check(pattern, value)
    hits = [i for i, leaf in enumerate(leaves) if not leaf.masked and _match(pattern, leaf.path)]
    if not hits:
      example = next((l.path for l in leaves if not l.masked), "")
      raise ValueError(f"{what} pattern {pattern!r} matches no parameter; patterns are "
                       f"fnmatch globs or path prefixes on '/'-joined paths such as {example!r}")
    for i in hits:
      values[i] = value
      fixed[i] = True
  return fixed


def _check_group(pattern, group):
  if group not in GROUPS:
    raise ValueError(f"param_labels maps {pattern!r} to unknown group {group!r}; "
                     f"use one of {GROUPS}")


def default_labels(leaves: list[Leaf], overrides: Optional[Mapping[str, str]] = None
                   ) -> tuple[list, list[Note]]:
  """Labels (None for masked leaves) and notes of the default rule, with optional overrides."""
  stacked = _stacked(leaves)
  labels = [None if leaf.masked else _role(leaf, s) for leaf, s in zip(leaves, stacked)]
  fixed = [False] * len(leaves)
  if overrides:
    fixed = _apply_overrides(leaves, labels, overrides, "param_labels", _check_group)
  notes = _find_head(leaves, labels, stacked, fixed)
  return labels, notes


# ------------------------------------------------------------------ matrix layouts

def _normalize_axes(dims: MuonDimensionNumbers, ndim: int):
  def norm(axes):
    axes = (axes,) if isinstance(axes, (int, np.integer)) else tuple(axes)
    return tuple(int(a) % ndim if -ndim <= int(a) < ndim else None for a in axes)
  return norm(dims.reduction_axis), norm(dims.output_axis)


def check_dims(dims, shape, path: str) -> None:
  """Raises a clear error when ``dims`` does not describe a matrix of a ``shape`` leaf."""
  if not isinstance(dims, MuonDimensionNumbers):
    raise ValueError(f"weight_dimension_numbers for {path} must be an "
                     f"optax.contrib.MuonDimensionNumbers or None, got {dims!r}")
  red, out = _normalize_axes(dims, len(shape))
  if None in red or None in out or not red or not out or set(red) & set(out) \
      or len(set(red)) != len(red) or len(set(out)) != len(out):
    raise ValueError(f"weight_dimension_numbers {dims} do not fit {path} of shape {shape}: "
                     "reduction and output axes must be non-empty, disjoint and within its "
                     f"{len(shape)} axes")


def matrix_shape(dims: MuonDimensionNumbers, shape) -> tuple[tuple, int, int]:
  """``(batch_shape, fan_in, fan_out)`` of the matrices ``dims`` cut out of a ``shape`` leaf."""
  red, out = _normalize_axes(dims, len(shape))
  batch = tuple(shape[a] for a in range(len(shape)) if a not in red and a not in out)
  return batch, math.prod(shape[a] for a in red), math.prod(shape[a] for a in out)


def _attention_layouts(leaves: list[Leaf]) -> dict[int, MuonDimensionNumbers]:
  """Query/key/value/out kernels of Flax attention modules, recognised by names and shapes."""
  by_path = {leaf.names: i for i, leaf in enumerate(leaves) if not leaf.masked}
  found = {}
  for i, leaf in enumerate(leaves):
    if leaf.masked or len(leaf.names) < 2 or leaf.lower[-1] != "kernel" or leaf.lower[-2] != "out":
      continue
    parent = leaf.names[:-2]
    kids = {}
    for name in _ATTENTION:
      j = next((by_path[p] for p in by_path
                if p[:-2] == parent and len(p) == len(leaf.names)
                and p[-2].lower() == name and p[-1].lower() == "kernel"), None)
      if j is not None:
        kids[name] = j
    if len(kids) != 4:
      continue
    q, k, v, o = (leaves[kids[n]].shape for n in _ATTENTION)
    nd = len(o)
    if nd < 3 or any(len(s) != nd for s in (q, k, v)):
      continue
    heads, head_dim = o[-3], o[-2]
    if q[-2:] == (heads, head_dim) and k[-1] == head_dim and v[-1] == head_dim \
        and q[:-3] == k[:-3] == v[:-3] == o[:-3]:
      for n in ("query", "key", "value"):
        found[kids[n]] = ATTENTION_QKV
      found[kids["out"]] = ATTENTION_OUT
  return found


def _given_layouts(tree, weight_dimension_numbers) -> list:
  if weight_dimension_numbers is None:
    return [None] * len(param_leaves(tree)[0])
  wdn = weight_dimension_numbers
  if callable(wdn) and not isinstance(wdn, MuonDimensionNumbers):
    wdn = wdn(pure(tree))
  return _broadcast(wdn, tree, lambda x: x is None or isinstance(x, MuonDimensionNumbers),
                    "weight_dimension_numbers")


def _layouts(tree, weight_dimension_numbers):
  leaves, _ = param_leaves(tree)
  given = _given_layouts(tree, weight_dimension_numbers)
  attention = _attention_layouts(leaves)
  layouts = []
  for i, leaf in enumerate(leaves):
    if leaf.masked:
      layouts.append(None)
      continue
    dims = given[i] if given[i] is not None else attention.get(i, LAST_TWO_AXES)
    if len(leaf.shape) >= 2:
      check_dims(dims, leaf.shape, leaf.path)
    layouts.append(dims)
  return layouts, given, attention


def matrix_layouts(tree, weight_dimension_numbers=None) -> list:
  """One ``MuonDimensionNumbers`` per parameter of ``tree`` (None for masked-out leaves).

  Every unmasked parameter is taken to be a Muon matrix. Given dimension numbers win (a tree,
  a prefix of one, a single one, or a callable ``params -> tree``, as ``optax.contrib.muon`` takes
  them; a None entry means "the default layout"); otherwise the Flax attention rule, otherwise
  the last two axes.
  """
  return _layouts(tree, weight_dimension_numbers)[0]


def _layout_name(dims, shape) -> str:
  batch, fan_in, fan_out = matrix_shape(dims, shape)
  n = math.prod(batch)
  return f"{n} x {fan_in}x{fan_out}" if n > 1 else f"{fan_in}x{fan_out}"


# ------------------------------------------------------------------ the plan

class RoutingPlan(NamedTuple):
  """Labels, Muon matrix layouts and notes for every parameter of one tree."""
  leaves: list
  treedef: Any
  labels: list
  layouts: list
  notes: list

  def label_tree(self):
    """The labels as a tree: the params' structure with each parameter replaced by its group.

    Masked-out leaves (``optax.MaskedNode``, when an ``optax.masked`` wraps the transform) stay
    ``MaskedNode``, so the tree still matches the params it came from.
    """
    return self.treedef.unflatten([optax.MaskedNode() if leaf.masked else label
                                   for leaf, label in zip(self.leaves, self.labels)])

  def unmasked_labels(self) -> list:
    """One label per array leaf of the params, in ``jax.tree.leaves`` order."""
    return [label for leaf, label in zip(self.leaves, self.labels) if not leaf.masked]


def plan(tree, param_labels: LabelsOrFn = None, weight_dimension_numbers=None) -> RoutingPlan:
  """Routes every parameter of ``tree``: group, Muon matrix layout, and notes on unsure rules.

  Args:
    tree: the params (any pytree; NNX ``Variable`` objects count as one parameter each).
    param_labels: None (default rule), a mapping ``{path pattern: group}`` applied on top of the
      default rule, a label tree (or a prefix of one), or a callable ``params -> labels``.
    weight_dimension_numbers: Muon matrix layouts, as ``optax.contrib.muon`` takes them.

  Returns:
    A :class:`RoutingPlan`.
  """
  leaves, values, treedef = param_leaves(tree, with_values=True)
  notes: list[Note] = []
  if param_labels is None or _is_overrides(param_labels):
    labels, notes = default_labels(leaves, param_labels)
  else:
    given = param_labels(pure(tree)) if callable(param_labels) else param_labels
    labels = _broadcast(given, tree, lambda x: isinstance(x, str), "param_labels")
  bad = sorted({str(l) for l, leaf in zip(labels, leaves) if not leaf.masked and l not in GROUPS})
  if bad:
    raise ValueError(f"param_labels contains unknown group(s) {bad}; use labels from {GROUPS}")
  for leaf, label in zip(leaves, labels):
    if label == "muon" and len(leaf.shape) < 2:
      raise ValueError(f"Muon needs matrices but {leaf.path} has shape {leaf.shape}; label it "
                       f"'adam' in param_labels, e.g. {_labels_hint(leaf.path, 'adam')}")
  # The Muon branch sees exactly this masked tree: computing its layouts the same way here
  # guarantees the table shows what the optimizer does.
  muon_only = treedef.unflatten([value if label == "muon" and not leaf.masked
                                 else optax.MaskedNode()
                                 for leaf, value, label in zip(leaves, values, labels)])
  layouts, given, attention = _layouts(muon_only, weight_dimension_numbers)
  stacked = _stacked(leaves)
  for i, (leaf, label) in enumerate(zip(leaves, labels)):
    if label != "muon" or len(leaf.shape) < 3 or given[i] is not None or i in attention:
      continue
    if stacked[i] and len(leaf.shape) == 3:
      continue
    batch, fan_in, fan_out = matrix_shape(layouts[i], leaf.shape)
    notes.append(Note("warning", f"{leaf.path} {leaf.shape} has {len(leaf.shape)} axes and no "
                                 "rule recognises its layout (not a Flax attention kernel, not a "
                                 "scan-stacked layer): Muon treats it as "
                                 f"{math.prod(batch)} separate {fan_in}x{fan_out} matrices (its "
                                 f"last two axes); if that is not its layout: "
                                 f"{_dims_hint(leaf.path)}"))
  return RoutingPlan(leaves, treedef, labels, layouts, notes)


# ------------------------------------------------------------------ public helpers

def label_params(params, overrides: Optional[Mapping[str, str]] = None) -> Any:
  """Default routing: a pytree of group labels with the structure of ``params``.

  Rules on each parameter's lower-cased path components and shape, first match wins:

  1. ``"adam"`` (never weight decayed): vectors and scalars (fewer than 2 axes, not counting the
     layer axis of a scan-stacked subtree), leaves named ``bias`` or ``scale``, and anything
     under a component containing ``norm`` or named ``ln``, ``ln_f``, ``ln_1``, ``ln1``...;
  2. ``"head"``: a component named ``lm_head``, ``head``, ``logits``, ``unembed``,
     ``unembedding`` or ending in ``head`` (``value_head``);
  3. ``"embedding"``: a path containing ``embed`` (but not ``emb_proj``), or a component named
     ``wte`` / ``wpe``;
  4. ``"muon"``: every other matrix.

  Then, when an embedding table ``[V, D]`` exists and no head was named, the head is looked for
  by shape: a ``[D, V]`` matrix named ``out``, ``output`` or ``decoder``, else an unnamed
  top-level one (Linen's auto-named last ``Dense_N``); the table's ``V`` must differ from ``D``.
  :func:`describe_routing` reports what was decided by shape, a head that could not be found
  (taken as tied to the embedding), and every case it is unsure of, with the override to use.

  A scan-stacked subtree (``nn.scan`` / ``nnx.scan``: every parameter with the same leading
  axis ``L``, stacked matrices next to stacked norm gains or biases) keeps those roles:
  ``[L, D]`` norm gains are "adam", ``[L, in, out]`` kernels are ``L`` Muon matrices.

  Args:
    params: any pytree of arrays (or ``jax.ShapeDtypeStruct``), Flax Linen params or
      variables, ``nnx.State`` (NNX ``Variable`` objects count as one parameter each).
    overrides: optional ``{pattern: group}`` applied after the rules; a pattern is an fnmatch
      glob on the ``/``-joined path (``"params/Dense_3/*"``) or a path prefix
      (``"params/Dense_3"``). A pattern matching nothing is an error.

  Returns:
    A pytree of strings from :data:`GROUPS`: the structure of ``params`` with each parameter
    (array or NNX ``Variable``) replaced by its group.

  Example:
    >>> import jax.numpy as jnp
    >>> from stablejax import label_params
    >>> label_params({"wte": {"embedding": jnp.zeros((10, 4))},
    ...               "mlp": {"kernel": jnp.zeros((4, 8)), "bias": jnp.zeros(8)},
    ...               "lm_head": {"kernel": jnp.zeros((4, 10))}})
    {'lm_head': {'kernel': 'head'}, 'mlp': {'bias': 'adam', 'kernel': 'muon'}, 'wte': {'embedding': 'embedding'}}
  """
  if overrides is not None and not isinstance(overrides, Mapping):
    raise ValueError(f"overrides must be a mapping {{path pattern: group}}, got {overrides!r}")
  leaves, treedef = param_leaves(params)
  labels, _ = default_labels(leaves, overrides or None)
  return treedef.unflatten(labels)


def muon_dimension_numbers(params, overrides: Optional[Mapping[str, Any]] = None,
                           param_labels: LabelsOrFn = None) -> Any:
  """The matrix layout of every Muon parameter, as ``optax.contrib.MuonDimensionNumbers``.

  The tree :func:`stablejax.outlier_safe_muon` uses by default: the recognised Flax attention
  layouts, the last two axes otherwise, and None for parameters not routed to Muon. It is also
  what ``optax.contrib.muon(muon_weight_dimension_numbers=...)`` takes, and, with ``overrides``,
  the easy way to give one leaf its layout.

  Args:
    params: the params (any pytree; NNX ``Variable`` objects count as one parameter).
    overrides: optional ``{pattern: MuonDimensionNumbers}``; patterns as in :func:`label_params`.
    param_labels: the routing, as :func:`stablejax.outlier_safe_muon` takes it.

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
  p = plan(params, param_labels)
  layouts = list(p.layouts)
  if overrides:
    def check(pattern, dims):
      if not isinstance(dims, MuonDimensionNumbers):
        raise ValueError(f"overrides maps {pattern!r} to {dims!r}; use "
                         "optax.contrib.MuonDimensionNumbers(reduction_axis=..., output_axis=...)")
    for pattern, dims in overrides.items():
      check(pattern, dims)
      hits = [i for i, leaf in enumerate(p.leaves) if _match(pattern, leaf.path)]
      if not hits:
        raise ValueError(f"overrides pattern {pattern!r} matches no parameter")
      for i in hits:
        if p.labels[i] != "muon":
          raise ValueError(f"overrides gives dimension numbers to {p.leaves[i].path}, which is "
                           f"routed to {p.labels[i]!r}, not Muon")
        check_dims(dims, p.leaves[i].shape, p.leaves[i].path)
        layouts[i] = dims
  return p.treedef.unflatten(layouts)


def resolve_labels(params, param_labels: LabelsOrFn = None):
  """Labels for ``params`` from None, a ``{pattern: group}`` mapping, a callable or a label tree."""
  return plan(params, param_labels).label_tree()


# ------------------------------------------------------------------ for describe_routing

class RoutingInfo(NamedTuple):
  """What :func:`stablejax.outlier_safe_muon` was built with, for :func:`describe_routing`."""
  param_labels: Any
  weight_dimension_numbers: Any
  learning_rates: dict      # group -> float, schedule or (under inject_hyperparams) tracer
  rate_sources: dict        # group -> name of the argument the rate came from


_CAPTURES: list = []


def record_init(info: RoutingInfo, params) -> None:
  """Called by outlier_safe_muon's ``init``: lets :func:`describe_routing` find it in any chain."""
  if _CAPTURES:
    _CAPTURES[-1].append((info, params))


@contextlib.contextmanager
def _capture():
  found: list = []
  _CAPTURES.append(found)
  try:
    yield found
  finally:
    _CAPTURES.pop()
