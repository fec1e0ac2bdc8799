"""Which optimizer group trains each parameter: the role rules and :func:`label_params`.

Muon is defined for the hidden weight matrices of a network. Embedding tables (a lookup, not a
matrix-vector product), the output head, and vectors (norm scales, biases) are trained with AdamW
in every published Muon setup (Jordan et al., modded-nanogpt; Liu et al., arXiv 2502.16982).
Optimizers that route by ``ndim == 2`` alone silently send the embedding and the head to Muon,
so the routing here goes by the parameter's role, and can be printed with
:func:`stablejax.describe_routing`.

Groups: ``"muon"`` (hidden matrices), ``"adam"`` (norm gains, biases, scalars: never weight
decayed), ``"embedding"`` and ``"head"`` (AdamW matrices with their own learning rates).

**Metadata first, shapes second, names last** (:mod:`stablejax.layout.analysis`, the analysis the
attention-head finder shares). Flax partitioning metadata with logical axis names (Linen
``nn.LogicallyPartitioned`` / ``nn.Partitioned`` boxes, NNX ``out_sharding``) says what each
axis is: ``('vocab', 'embed')`` is an embedding, ``('embed', 'vocab')`` a head. Without such
metadata a ``[D, V]`` matrix outside the repeated blocks is the head, whatever its module is
called (``D`` from the embedding table). Names decide the rest (norms, biases, the usual
embedding and head names).
"""

from __future__ import annotations

import fnmatch
import re
from typing import Any, Callable, Mapping, Optional, Sequence

import jax
import optax

from stablejax.layout import analysis as layout
from stablejax.layout.analysis import Leaf, param_leaves
from stablejax.muon.matrices import batch_ndim
from stablejax.muon.notes import Note, labels_hint, warn_notes

GROUPS = ("muon", "adam", "embedding", "head")


def pure(tree: optax.Params) -> optax.Params:
  """``tree`` with every NNX ``Variable`` and Linen box replaced by its value."""
  return jax.tree.map(layout.value_of, tree, is_leaf=layout.is_param_leaf)


def broadcast(prefix_tree: optax.Params, tree: optax.Params, is_value: Callable[[Any], bool],
              what: str) -> list:
  """Expands a prefix tree of values (leaves matching ``is_value``) to one value per parameter."""
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



# ------------------------------------------------------------------ the role rules

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
  if len(leaf.shape) - batch_ndim(a, i) < 2 or layout.is_vector_name(leaf):
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
                           + labels_hint("<path of the head kernel>", "head"))]

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
               f"so with {labels_hint(rest[0], 'head')})")
    text += f"; if it is not the head: {labels_hint(leaves[head].path, 'muon')}"
    return [Note(kind, text)]
  other = [leaves[i].path for i, leaf in enumerate(leaves)
           if i != table and labels[i] in ("muon", "embedding") and not a.in_block[i]
           and vocab in leaf.shape]
  if other:
    return [Note("unsure", f"no output head found next to the embedding {emb}; "
                           f"{', '.join(other)} also have a vocabulary-sized axis; if one is the "
                           f"head: {labels_hint(other[0], 'head')}")]
  return [Note("info", f"no output head found outside the repeated blocks: taken as tied to the "
                       f"embedding {emb} (logits = x @ embedding.T, trained by its AdamW group); "
                       f"if the model has a separate head, route it with "
                       f"{labels_hint('<path>', 'head')}")]


def _auto_index(leaf: Leaf) -> int:
  m = re.search(r"_(\d+)$", leaf.names[-2]) if len(leaf.names) >= 2 else None
  return int(m.group(1)) if m else -1


def _match(pattern: str, path: str) -> bool:
  return fnmatch.fnmatchcase(path, pattern) or path.startswith(pattern.rstrip("/") + "/")


def is_overrides(x: object) -> bool:
  return (isinstance(x, Mapping) and len(x) > 0
          and all(isinstance(k, str) and isinstance(v, str) for k, v in x.items()))


def apply_overrides(leaves: Sequence[Leaf], values: list, overrides: Mapping, what: str,
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
    fixed, notes = apply_overrides(leaves, labels, overrides, "param_labels", _check_group,
                                    strict)
  return labels, notes + _find_head(a, labels, fixed)



def label_params(params: optax.Params, overrides: Optional[Mapping[str, str]] = None,
                 strict: bool = False) -> optax.Params:
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

