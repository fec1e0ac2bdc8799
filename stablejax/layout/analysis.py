"""What each parameter of a model is, read from Flax metadata first, shapes second, names last.

One analysis serves the routing (:mod:`stablejax.muon.routing`: which optimizer trains each
parameter, which matrix Muon orthogonalises) and the attention-head finder
(:func:`stablejax.layout.heads.find_attention_layers`, used by QK-clip), so a layout is recognised
in one place. :func:`analyse` runs its parts in order:

* :mod:`stablejax.layout.leaves`: the parameters of the tree (:func:`param_leaves`), each with
  its path, shape and the axis names of its Flax metadata. Linen's
  ``nn.with_logical_partitioning`` boxes a parameter in ``nn.LogicallyPartitioned`` with logical
  axis names (``('embed', 'mlp')``), ``nn.with_partitioning`` in ``nn.Partitioned`` with mesh
  axis names, and NNX keeps ``out_sharding`` (formerly ``sharding_names``) in each
  ``Variable``'s metadata.
* :mod:`stablejax.layout.names`: what those axis names say (``embed``, ``heads``, ``kv``,
  ``mlp``, ``vocab``, ``layers``, ``exp``, ``qkv``; mesh axis names and names whose count differs
  from the number of axes say nothing, as ``nn.DenseGeneral`` applies a kernel initialiser's
  names to its flattened 2-D kernel), and what module names say: which projection is the query
  and which the key, norms and biases (also by shape: fewer than 2 non-batch axes), the usual
  names of embeddings and heads.
* The model width ``D``: the metadata's model axis, else the token embedding table ``[V, D]``,
  else the norm gains.
* :mod:`stablejax.layout.orientation`: scan-stacked subtrees and repeated blocks, and the matrix
  of each kernel: by metadata (a model axis whose size disagrees with ``D`` is not trusted), by
  shape against ``D`` for 3+ axes (``[D, H, hd]`` is ``D x H*hd``, ``[H, hd, D]`` is
  ``H*hd x D``), by storage order and fused parts for 2-D kernels.
* :mod:`stablejax.layout.attention`: the attention layers, by shapes (which also reads Gemma's
  einsum kernels, ``D`` in the middle) or by their projections' names.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Optional, Sequence

from stablejax.layout.attention import AttentionGroup, Kinds, attention_groups
from stablejax.layout.leaves import Leaf, is_param_leaf, param_leaves, path_to_str  # noqa: F401
from stablejax.layout.leaves import value_of  # noqa: F401 (the routing's)
from stablejax.layout.names import AMBIGUOUS_HEAD, BATCH_KINDS, MODEL, NORM, VOCAB  # noqa: F401
from stablejax.layout.names import (axis_kinds, is_embedding_name, is_norm_name, is_positional,
                                    is_strong_head, is_vector_name)  # noqa: F401
from stablejax.layout.orientation import (FusedDimensionNumbers, KernelLayout,  # noqa: F401
                                          block_flags, kernel_layouts, stack_axes)

# The routing (stablejax.muon.routing) reads these two under their names of this module.
_BATCH_KINDS = BATCH_KINDS
_AMBIGUOUS_HEAD = AMBIGUOUS_HEAD


@dataclasses.dataclass
class Analysis:
  """Everything the routing and the head finder read about one parameter tree."""
  leaves: list[Leaf]
  stacked: list[bool]          # inside a scan-stacked subtree
  stack_axis: list[Optional[int]]  # that subtree's layer axis (0 or 1), or None
  in_block: list[bool]
  d_model: Optional[int]
  kinds: list[Optional[tuple[Optional[str], ...]]]  # axis_kinds (None: no usable metadata)
  layouts: dict[int, KernelLayout]  # leaf index -> its recognised matrix
  groups: list[AttentionGroup]
  orientation: list[Optional[str]] = dataclasses.field(default_factory=list)  # "out_in" or None
  unsplit: list[int] = dataclasses.field(default_factory=list)  # fused-named kernels left whole


def _infer_d_model(leaves: Sequence[Leaf], kinds: Kinds, stacked: Sequence[bool]
                   ) -> Optional[int]:
  for leaf, k in zip(leaves, kinds):
    if k is not None and MODEL in k:
      return leaf.shape[k.index(MODEL)]
  tables = [leaf for leaf, s in zip(leaves, stacked)
            if not leaf.masked and not s and len(leaf.shape) == 2 and is_embedding_name(leaf)
            and not is_positional(leaf)]
  if tables:
    return max(tables, key=lambda leaf: leaf.shape[0]).shape[1]
  gains = collections.Counter(leaf.shape[-1] for leaf, s in zip(leaves, stacked)
                              if not leaf.masked and len(leaf.shape) - s == 1
                              and any(is_norm_name(n) for n in leaf.lower))
  return gains.most_common(1)[0][0] if gains else None


def analyse(leaves: Sequence[Leaf], roles: Optional[dict[int, str]] = None) -> Analysis:
  """Reads every parameter's role-relevant facts; see the module docstring for the rules.

  Args:
    leaves: from :func:`param_leaves`.
    roles: optional leaf index -> attention projection role (``"query"``, ``"key"``,
      ``"value"``, ``"out"``, ``"none"``) that wins over the names.

  Example:
    >>> import jax.numpy as jnp
    >>> from stablejax.layout import analysis
    >>> params = {"embed": jnp.zeros((50, 8)), "final_norm": {"scale": jnp.zeros(8)},
    ...           "blocks": {"mlp": {"kernel": jnp.zeros((3, 8, 32))},   # 3 layers, scanned
    ...                      "norm": {"scale": jnp.zeros((3, 8))}}}
    >>> found = analysis.analyse(analysis.param_leaves(params)[0])
    >>> [leaf.path for leaf in found.leaves]
    ['blocks/mlp/kernel', 'blocks/norm/scale', 'embed', 'final_norm/scale']
    >>> found.stack_axis, found.d_model, found.layouts  # the MLP: its last two axes, the default
    ([0, 0, None, None], 8, {})
  """
  leaves = list(leaves)
  stack_axis = stack_axes(leaves)
  stacked = [a is not None for a in stack_axis]
  in_block = block_flags(leaves, stacked)
  kinds = [None if leaf.masked else axis_kinds(leaf) for leaf in leaves]
  d_model = _infer_d_model(leaves, kinds, stacked)
  kernels = kernel_layouts(leaves, stack_axis, kinds, d_model)
  groups = attention_groups(leaves, stack_axis, kinds, d_model, kernels.layouts,
                            kernels.readings, roles or {}, kernels.orientation)
  return Analysis(leaves, stacked, stack_axis, in_block, d_model, kinds, kernels.layouts, groups,
                  kernels.orientation, kernels.unsplit)

