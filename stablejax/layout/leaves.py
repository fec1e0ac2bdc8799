"""The parameters of a tree, one :class:`Leaf` each: its path, its shape, and what the tree says.

A parameter is an array, an NNX ``Variable`` or a Linen metadata box (``nn.Partitioned``,
``nn.LogicallyPartitioned``); an ``optax.MaskedNode`` stands for a masked-out one. Besides the
shape a leaf keeps what the tree says of it: the axis names of its Flax metadata (Linen's
``names``, NNX's ``out_sharding``), and the storage order its module type gives (Equinox's
``eqx.nn.Linear`` keeps its weight ``[out, in]``).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Literal, Optional, Sequence, Union, overload

import jax
import numpy as np
import optax
from jax.tree_util import PyTreeDef

# An axis name: a name, None, or a tuple of names (one array axis over several mesh axes).
AxisName = Union[str, None, tuple[str, ...]]
# Leaf.storage of a weight its module type stores [out, in] (y = W x), not Flax's [in, out].
OUT_IN = "out_in"


def _key_name(entry: object) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(entry, attr):
      return str(getattr(entry, attr))
  return str(entry)


def _is_variable(x: object) -> bool:
  nnx = sys.modules.get("flax.nnx")  # no NNX Variable can exist unless flax.nnx was imported
  return nnx is not None and isinstance(x, nnx.Variable)


def _is_box(x: object) -> bool:
  meta = sys.modules.get("flax.core.meta")  # likewise for Linen's boxed metadata
  return meta is not None and isinstance(x, meta.AxisMetadata)


def is_param_leaf(x: object) -> bool:
  """An NNX ``Variable``, a Linen metadata box or an ``optax.MaskedNode``: one parameter."""
  return _is_variable(x) or _is_box(x) or isinstance(x, optax.MaskedNode)


def value_of(x: object) -> object:
  """The array inside an NNX ``Variable`` or a Linen box (``x`` itself otherwise)."""
  node: Any = x  # a Variable or a box, once the checks below say which
  if _is_variable(x):
    return node.get_value()
  if _is_box(x):
    return node.value if hasattr(node, "value") else node.unbox()
  return x


def _normalise_names(names: Any) -> Optional[tuple[AxisName, ...]]:
  """Metadata's axis names (any sequence; a mesh axis entry may be a tuple) as AxisNames."""
  if names is None:
    return None
  try:
    entries = tuple(names)
  except TypeError:
    return None
  out: list[AxisName] = []
  for e in entries:
    if e is None or isinstance(e, str):
      out.append(e)
    elif isinstance(e, (tuple, list)):
      out.append(tuple(str(n) for n in e if n is not None) or None)
    else:
      out.append(None)  # PartitionSpec.UNCONSTRAINED and the like
  return tuple(out)


def axis_names_of(x: object) -> Optional[tuple[AxisName, ...]]:
  """The axis names a parameter's Flax metadata gives, or None."""
  node: Any = x  # a Variable or a box, once the checks below say which
  if _is_box(x):
    return _normalise_names(getattr(node, "names", None))
  if _is_variable(x):
    try:
      meta = node.get_metadata()
    except Exception:  # noqa: BLE001 (older Variable APIs)
      meta = getattr(node, "_var_metadata", {}) or {}
    for key in ("out_sharding", "sharding_names", "sharding"):
      if meta.get(key) is not None:
        return _normalise_names(meta[key])
  return None


@dataclasses.dataclass
class Leaf:
  """One parameter of a tree: path, shape, masked out or not, and its metadata's axis names.

  ``storage`` is ``"out_in"`` for a weight whose module type says it is stored ``[out, in]``
  (Equinox's ``eqx.nn.Linear``), None when the tree does not say.
  """
  names: tuple[str, ...]
  shape: tuple[int, ...]
  masked: bool
  axes: Optional[tuple[AxisName, ...]] = None
  storage: Optional[str] = None

  @property
  def path(self) -> str:
    return "/".join(self.names)

  @property
  def lower(self) -> tuple[str, ...]:
    return tuple(n.lower() for n in self.names)


def path_to_str(path: Sequence[object]) -> str:
  """A key path such as ``('params', 'block_0', 'kernel')`` as ``params/block_0/kernel``."""
  return "/".join(_key_name(e) for e in path)


def _out_in_linear(x: object) -> bool:
  eqx = sys.modules.get("equinox")  # no Equinox module can exist unless equinox was imported
  return eqx is not None and isinstance(x, eqx.nn.Linear)


def _out_in_paths(tree: optax.Params) -> set[tuple[str, ...]]:
  """Paths of the weights that their module type stores ``[out, in]``: ``eqx.nn.Linear.weight``
  (``y = W x``), also when ``eqx.filter_vmap`` stacked the module (``[L, out, in]``)."""
  if sys.modules.get("equinox") is None:
    return set()
  found = set()
  for path, node in jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=lambda x: is_param_leaf(x) or _out_in_linear(x))[0]:
    if _out_in_linear(node) and getattr(node, "weight", None) is not None:
      found.add(tuple(_key_name(k) for k in path) + ("weight",))
  return found


@overload
def param_leaves(tree: optax.Params, with_values: Literal[False] = False
                 ) -> tuple[list[Leaf], PyTreeDef]: ...


@overload
def param_leaves(tree: optax.Params, with_values: Literal[True]
                 ) -> tuple[list[Leaf], list[object], PyTreeDef]: ...


def param_leaves(tree: optax.Params, with_values: bool = False
                 ) -> Union[tuple[list[Leaf], PyTreeDef],
                            tuple[list[Leaf], list[object], PyTreeDef]]:
  """The parameters of ``tree`` (a ``Variable`` or a Linen box is one) and the treedef.

  Returns ``(leaves, treedef)``, or ``(leaves, values, treedef)`` with ``with_values`` (the
  values: the tree's own leaves, ``Variable`` objects and boxes as they are).
  """
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_param_leaf)
  out_in = _out_in_paths(tree)
  leaves = []
  for path, leaf in flat:
    masked = isinstance(leaf, optax.MaskedNode)
    shape: tuple[int, ...] = ()
    if not masked:
      value: Any = value_of(leaf)  # an array, a jax.ShapeDtypeStruct, a scalar: np.shape reads each
      shape = tuple(np.shape(value))
    names = tuple(_key_name(k) for k in path)
    leaves.append(Leaf(names, shape, masked, None if masked else axis_names_of(leaf),
                       OUT_IN if names in out_in else None))
  if with_values:
    return leaves, [leaf for _, leaf in flat], treedef
  return leaves, treedef
