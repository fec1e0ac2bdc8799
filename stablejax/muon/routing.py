"""The routing of a parameter tree: each parameter's group, each Muon leaf's matrix, and notes.

:func:`plan` is the one place that decides, for any parameter tree, which optimizer group trains
each parameter (:mod:`stablejax.muon.labels`), which matrix Muon orthogonalises in each Muon leaf
(:mod:`stablejax.muon.matrices`, from the layout analysis of :mod:`stablejax.layout.analysis`),
and what the user should be told (:mod:`stablejax.muon.notes`).

**A function of the parameter tree.** A Flax NNX ``Variable`` or a Linen metadata box counts as
one parameter at its own path (so boxed and unboxed trees, ``nnx.State`` with ``Variable``
objects and the pure arrays ``nnx.Optimizer.update`` passes, have the same paths), and Linen
``{'params': ...}`` collections, ``FrozenDict``, dicts, lists, tuples and
``jax.ShapeDtypeStruct`` leaves all work. Metadata can only add what the shapes cannot tell
(a stacked axis that is not the leading one); :func:`stablejax.outlier_safe_muon` routes at
``init`` (``nnx.Optimizer`` passes ``Variable`` objects there) and its state records the groups,
so the groups read from metadata at ``init`` also hold for the pure arrays of ``update``.

**Matrix layout.** By default the layout the analysis recognises (Flax attention kernels
``[D, H, hd]`` as one ``[D, H*hd]`` matrix, fused projections per part), else the last two axes
``[..., fan_in, fan_out]``; ``weight_dimension_numbers`` (as ``optax.contrib.muon`` takes them)
wins.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence, Union

import jax
import optax

from stablejax.layout import analysis as layout
from stablejax.layout import heads as _heads
from stablejax.layout.analysis import FusedDimensionNumbers
from stablejax.layout.analysis import Leaf, param_leaves, path_to_str  # noqa: F401 (re-exported)
from stablejax.muon import labels as _labels
from stablejax.muon.labels import GROUPS as _GROUPS
from stablejax.muon.labels import apply_overrides
from stablejax.muon.matrices import DIMENSION_TYPES as _DIMENSION_TYPES
from stablejax.muon.matrices import LAST_TWO_AXES as _LAST_TWO_AXES
from stablejax.muon.matrices import Dims
from stablejax.muon.matrices import MuonDimensionNumbers as _MDN
from stablejax.muon.matrices import check_dims as _check_dims
from stablejax.muon import notes as _notes
from stablejax.muon.notes import Note as _Note
from stablejax.muon.notes import labels_hint
from stablejax.muon.notes import warn_notes as _warn_notes

# What param_labels takes: None (the default rule), {path pattern: group} overrides on top of it,
# a label tree (or a prefix of one), or a callable params -> labels.
LabelsOrFn = Union[None, Mapping[str, str], optax.Params, Callable[[optax.Params], Any]]
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


def per_head_of(per_head: object, num_heads: object) -> Optional[PerHead]:
  """Validates ``per_head`` / ``num_heads`` arguments: a :class:`PerHead`, or None."""
  if not isinstance(per_head, bool):
    raise ValueError(f"per_head must be True or False, got {per_head!r}")
  if num_heads is not None and (isinstance(num_heads, bool) or not isinstance(num_heads, int)
                                or num_heads < 1):
    raise ValueError(f"num_heads={num_heads!r} must be a positive int (the query head count)")
  return PerHead(num_heads) if per_head else None


def _given_layouts(tree: optax.Params, weight_dimension_numbers: DimensionNumbersOrFn,
                   n: int) -> list:
  if weight_dimension_numbers is None:
    return [None] * n
  wdn = weight_dimension_numbers
  if callable(wdn) and not isinstance(wdn, _MDN):
    wdn = wdn(_labels.pure(tree))
  return _labels.broadcast(wdn, tree, lambda x: x is None or isinstance(x, _DIMENSION_TYPES),
                    "weight_dimension_numbers")


def _layouts(tree: optax.Params, leaves: Sequence[Leaf], a: layout.Analysis,
             weight_dimension_numbers: DimensionNumbersOrFn,
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
      dims, source = _LAST_TWO_AXES, None
    if len(leaf.shape) >= 2:
      _check_dims(dims, leaf.shape, leaf.path)
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
        _check_dims(dims, leaves[i].shape, leaves[i].path)
        layouts[i], sources[i] = dims, "per_head"
  return layouts, sources


def matrix_layouts(tree: optax.Params, weight_dimension_numbers: DimensionNumbersOrFn = None,
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


# ------------------------------------------------------------------ the plan

class RoutingPlan(NamedTuple):
  """Labels, Muon matrix layouts and notes for every parameter of one tree."""
  leaves: list
  treedef: Any
  labels: list
  layouts: list
  notes: list
  sources: list = []

  def label_tree(self) -> optax.Params:
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


def plan(tree: optax.Params, param_labels: LabelsOrFn = None,
         weight_dimension_numbers: DimensionNumbersOrFn = None,
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
  notes: list[_Note] = []
  if param_labels is None or _labels.is_overrides(param_labels):
    overrides: Optional[Mapping[str, str]] = param_labels  # type: ignore[assignment]
    labels, notes = _labels.default_labels(leaves, overrides, strict, a)
  else:
    given = param_labels(_labels.pure(tree)) if callable(param_labels) else param_labels
    labels = _labels.broadcast(given, tree, lambda x: isinstance(x, str), "param_labels")
  bad = sorted({str(lab) for lab, leaf in zip(labels, leaves) if not leaf.masked
                and lab not in _GROUPS})
  if bad:
    raise ValueError(f"param_labels contains unknown group(s) {bad}; use labels from {_GROUPS}")
  for leaf, label in zip(leaves, labels):
    if label == "muon" and len(leaf.shape) < 2:
      raise ValueError(f"Muon needs matrices but {leaf.path} has shape {leaf.shape}; label it "
                       f"'adam' in param_labels, e.g. {labels_hint(leaf.path, 'adam')}")
  muon = [label == "muon" for label in labels]
  layouts, sources = _layouts(tree, leaves, a, weight_dimension_numbers, muon, per_head)
  if per_head is not None and "per_head" not in sources:
    notes.append(_Note("warning", "per_head: no attention projection is split per head (no "
                                 "attention layer was recognised, or weight_dimension_numbers "
                                 "gives their layouts); give them as stablejax."
                                 "FusedDimensionNumbers with one part per head"))
  notes += _notes.unrecognised_note(leaves, a, labels, layouts, sources)
  notes += _notes.fused_notes(leaves, a, labels, layouts, sources)
  return RoutingPlan(leaves, treedef, labels, layouts, notes, sources)



def muon_layouts(tree: optax.Params, labels: optax.Params,
                 weight_dimension_numbers: DimensionNumbersOrFn = None,
                 per_head: Optional[PerHead] = None) -> list[Dims]:
  """The layout of every Muon leaf of ``tree``, in order, with the groups ``labels`` gives (a
  label tree of ``tree``'s parameters, ``optax.MaskedNode`` for those left out): the layouts
  :func:`plan` gives ``tree`` with those groups."""
  leaves, _ = param_leaves(tree)
  muon = [label == "muon" for label in _label_list(labels, len(leaves))]
  layouts, _ = _layouts(tree, leaves, layout.analyse(leaves), weight_dimension_numbers, muon,
                        per_head)
  return [d for leaf, is_muon, d in zip(leaves, muon, layouts) if is_muon and not leaf.masked]


def _label_list(labels: optax.Params, n: int) -> list[Optional[str]]:
  """One label per parameter (None for a masked one) of a label tree from ``label_tree``."""
  out = [None if isinstance(x, optax.MaskedNode) else x
         for x in jax.tree.leaves(labels, is_leaf=lambda x: isinstance(x, optax.MaskedNode))]
  if len(out) != n:
    raise ValueError(f"{n} parameters but {len(out)} labels")
  return out


def metadata_layout_notes(tree: optax.Params, routed: RoutingPlan,
                          weight_dimension_numbers: DimensionNumbersOrFn = None,
                          per_head: Optional[PerHead] = None) -> list[_Note]:
  """A warning for the Muon leaves of ``tree`` whose layout its Flax metadata decides and its
  shapes alone would not: ``update`` reads layouts from the tree it is given, and
  ``nnx.Optimizer`` (or a Linen state unboxed for the step) gives it the arrays without their
  metadata."""
  if all(leaf.axes is None for leaf in routed.leaves):
    return []
  labels = routed.label_tree()
  bare = muon_layouts(_labels.pure(tree), labels, weight_dimension_numbers, per_head)
  if bare == routed.muon_layouts():
    return []
  muon = [leaf for leaf, label in zip(routed.leaves, routed.labels) if label == "muon"]
  differ = [leaf.path for leaf, a, b in zip(muon, routed.muon_layouts(), bare) if a != b]
  return [_Note("warning", f"the Muon layouts of {', '.join(differ[:3])}"
                           f"{' and more' if len(differ) > 3 else ''} come from their Flax "
                           "metadata, which the arrays update() gets may not carry (nnx.Optimizer "
                           "passes pure arrays); pass them explicitly: weight_dimension_numbers="
                           "stablejax.muon_dimension_numbers(params)")]


def muon_dimension_numbers(params: optax.Params, overrides: Optional[Mapping[str, Dims]] = None,
                           param_labels: LabelsOrFn = None, strict: bool = False, *,
                           per_head: bool = False, num_heads: Optional[int] = None
                           ) -> optax.Params:
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
  _warn_notes([n for n in p.notes if n.text.startswith("per_head")], "muon_dimension_numbers")
  layouts = list(p.layouts)
  if overrides:
    def check(pattern: str, dims: object) -> None:
      if not isinstance(dims, _DIMENSION_TYPES):
        raise ValueError(f"overrides maps {pattern!r} to {dims!r}; use "
                         "optax.contrib.MuonDimensionNumbers(reduction_axis=..., output_axis=...) "
                         "or stablejax.FusedDimensionNumbers(..., fused_axis=..., parts=...)")
    given = [None] * len(p.leaves)
    fixed, notes = apply_overrides(p.leaves, given, overrides, "muon_dimension_numbers overrides",
                                   check, strict)
    for i, hit in enumerate(fixed):
      if not hit:
        continue
      if p.labels[i] != "muon":
        raise ValueError(f"overrides gives dimension numbers to {p.leaves[i].path}, which is "
                         f"routed to {p.labels[i]!r}, not Muon")
      _check_dims(given[i], p.leaves[i].shape, p.leaves[i].path)
      layouts[i] = given[i]
    _warn_notes(notes, "muon_dimension_numbers")
  return p.treedef.unflatten(layouts)



# ------------------------------------------------------------------ for describe_routing

class RoutingInfo(NamedTuple):
  """What :func:`stablejax.outlier_safe_muon` was built with, for :func:`describe_routing`."""
  param_labels: LabelsOrFn
  weight_dimension_numbers: DimensionNumbersOrFn
  learning_rates: dict      # group -> float, schedule or (under inject_hyperparams) tracer
  rate_sources: dict        # group -> name of the argument the rate came from
  per_head: Optional[PerHead] = None


