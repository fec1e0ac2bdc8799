"""What each parameter of a model is, read from Flax metadata first, shapes second, names last.

One analysis serves the routing (:mod:`stablejax.muon.routing`: which optimizer trains each
parameter, which matrix Muon orthogonalises) and the attention-head finder
(:func:`stablejax.layout.heads.find_attention_layers`, used by QK-clip), so a layout is recognised
in one place.

**Metadata.** Flax models often say what each axis of a parameter is: Linen's
``nn.with_logical_partitioning`` boxes a parameter in ``nn.LogicallyPartitioned`` with logical
axis names (``('embed', 'mlp')``), ``nn.with_partitioning`` in ``nn.Partitioned`` with mesh axis
names, and NNX keeps ``out_sharding`` (formerly ``sharding_names``) in each ``Variable``'s
metadata. Names from a known vocabulary (the model axis ``embed``; ``heads`` / ``kv_heads``;
``kv`` / ``head_dim``; ``mlp``; ``vocab``; stacked ``layers``; ``exp`` (experts); fused ``qkv``)
give the matrix directly: the model axis on one side, the other non-batch axes together on the
other, stacked, expert and fused axes as batch. Mesh axis names (``'data'``, ``'model'``) say
nothing about what an axis is, and neither do names whose count differs from the number of axes
(``nn.DenseGeneral`` applies a kernel initialiser's names to its flattened 2-D kernel); such
metadata is ignored. A model axis whose size disagrees with the model width found below is not
trusted either.

**Shapes.** The model width ``D`` is read from the token embedding table ``[V, D]`` (or, without
one, from the norm gains). A kernel of 3+ axes with exactly one axis of size ``D`` is the ``D``
axis against its other axes: ``[D, H, hd]`` (``DenseGeneral`` query/key/value, any module name)
is ``D x H*hd``, ``[H, hd, D]`` is ``H*hd x D``. A kernel whose ``D`` axis sits in the middle
(Gemma's einsum ``q_einsum [H, D, hd]``, ``kv_einsum [2, K, D, hd]``, ``qkv_einsum
[3, H, D, hd]``) is read that way only inside an attention layer, recognised by shapes alone: at
least three input projections (query, key, value; a leading axis of size 3 or 2 counts as that
many fused projections) sharing the head size of an output projection ``[H, hd, D]``, with key
heads dividing query heads. A leading axis of size 2 or 3 in front of the heads is a batch axis
(three or two separate matrices). Scan-stacked subtrees (``nn.scan`` / ``nnx.scan``: every
parameter with the same leading axis, stacked matrices next to stacked vectors) add a leading
batch axis.

**Names** decide what neither can: which projection of an attention layer is the query and which
the key, norms and biases (also by shape: fewer than 2 non-batch axes), and the usual names of
embeddings and heads.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import re
import sys
from typing import Any, NamedTuple, Optional, Sequence

import jax
import numpy as np
import optax

MuonDimensionNumbers = optax.contrib.MuonDimensionNumbers


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
  reduction_axis: Any
  output_axis: Any
  fused_axis: int
  parts: Any

  def part_sizes(self, shape: Sequence[int]) -> tuple:
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

# ------------------------------------------------------------------ the tree


def _key_name(entry: Any) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(entry, attr):
      return str(getattr(entry, attr))
  return str(entry)


def _is_variable(x: Any) -> bool:
  nnx = sys.modules.get("flax.nnx")  # no NNX Variable can exist unless flax.nnx was imported
  return nnx is not None and isinstance(x, nnx.Variable)


def _is_box(x: Any) -> bool:
  meta = sys.modules.get("flax.core.meta")  # likewise for Linen's boxed metadata
  return meta is not None and isinstance(x, meta.AxisMetadata)


def is_param_leaf(x: Any) -> bool:
  """An NNX ``Variable``, a Linen metadata box or an ``optax.MaskedNode``: one parameter."""
  return _is_variable(x) or _is_box(x) or isinstance(x, optax.MaskedNode)


def value_of(x: Any) -> Any:
  """The array inside an NNX ``Variable`` or a Linen box (``x`` itself otherwise)."""
  if _is_variable(x):
    return x.get_value()
  if _is_box(x):
    return x.value if hasattr(x, "value") else x.unbox()
  return x


AxisName = Any  # str, None, or a tuple of str (one array axis over several mesh axes)


def _normalise_names(names: Any) -> Optional[tuple]:
  if names is None:
    return None
  try:
    entries = tuple(names)
  except TypeError:
    return None
  out: list = []
  for e in entries:
    if e is None or isinstance(e, str):
      out.append(e)
    elif isinstance(e, (tuple, list)):
      out.append(tuple(str(n) for n in e if n is not None) or None)
    else:
      out.append(None)  # PartitionSpec.UNCONSTRAINED and the like
  return tuple(out)


def axis_names_of(x: Any) -> Optional[tuple]:
  """The axis names a parameter's Flax metadata gives, or None."""
  if _is_box(x):
    return _normalise_names(getattr(x, "names", None))
  if _is_variable(x):
    try:
      meta = x.get_metadata()
    except Exception:  # noqa: BLE001 (older Variable APIs)
      meta = getattr(x, "_var_metadata", {}) or {}
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
  names: tuple
  shape: tuple
  masked: bool
  axes: Optional[tuple] = None
  storage: Optional[str] = None

  @property
  def path(self) -> str:
    return "/".join(self.names)

  @property
  def lower(self) -> tuple:
    return tuple(n.lower() for n in self.names)


def path_to_str(path: Sequence[Any]) -> str:
  """A key path such as ``('params', 'block_0', 'kernel')`` as ``params/block_0/kernel``."""
  return "/".join(_key_name(e) for e in path)


OUT_IN = "out_in"


def _out_in_linear(x: Any) -> bool:
  eqx = sys.modules.get("equinox")  # no Equinox module can exist unless equinox was imported
  return eqx is not None and isinstance(x, eqx.nn.Linear)


def _out_in_paths(tree: Any) -> set:
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


def param_leaves(tree: Any, with_values: bool = False) -> tuple:
  """The parameters of ``tree`` (a ``Variable`` or a Linen box is one) and the treedef.

  Returns ``(leaves, treedef)``, or ``(leaves, values, treedef)`` with ``with_values``.
  """
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_param_leaf)
  out_in = _out_in_paths(tree)
  leaves = []
  for path, leaf in flat:
    masked = isinstance(leaf, optax.MaskedNode)
    shape = () if masked else tuple(np.shape(value_of(leaf)))
    names = tuple(_key_name(k) for k in path)
    leaves.append(Leaf(names, shape, masked, None if masked else axis_names_of(leaf),
                       OUT_IN if names in out_in else None))
  if with_values:
    return leaves, [leaf for _, leaf in flat], treedef
  return leaves, treedef


def structure_key(leaves: Sequence[Leaf]) -> tuple:
  """What a routing decision depends on besides metadata: every parameter's path and shape."""
  return tuple((leaf.names, leaf.shape, leaf.masked) for leaf in leaves)


# ------------------------------------------------------------------ axis names

MODEL, HEADS, HEAD_DIM, MLP, VOCAB, STACK, EXPERT, FUSED, NORM = (
    "model", "heads", "head_dim", "mlp", "vocab", "stack", "expert", "fused", "norm")
# A 'qkv' / 'kv' axis that is not a small batch axis of 2 or 3 but the features of the fused
# projections one after the other ([D, 3 * H * hd] named ('embed', 'qkv')).
FUSED_FEATURES = "fused_features"
_FUSED_PARTS = {"qkv": 3, "fused_qkv": 3, "kv": 2}
_BATCH_KINDS = (STACK, EXPERT, FUSED)

_KIND_OF_NAME = {
    **dict.fromkeys(("embed", "embedding", "emb", "d_model", "dmodel", "model_dim", "embed_dim"),
                    MODEL),
    **dict.fromkeys(("heads", "q_heads", "kv_heads", "num_heads", "n_heads", "head", "q_head",
                     "kv_head", "query_heads", "key_heads"), HEADS),
    **dict.fromkeys(("kv", "head_dim", "kv_head_dim", "q_head_dim", "qkv_dim", "hd", "joined_kv",
                     "kv_dim", "v_head_dim"), HEAD_DIM),
    **dict.fromkeys(("mlp", "ffn", "ff", "mlp_dim", "intermediate", "hidden", "ff_dim"), MLP),
    **dict.fromkeys(("vocab", "vocab_size", "vocabulary"), VOCAB),
    **dict.fromkeys(("layers", "layer", "stage", "stages", "stack", "num_layers", "scan", "repeat",
                     "circular_repeats"), STACK),
    **dict.fromkeys(("exp", "expert", "experts", "num_experts"), EXPERT),
    **dict.fromkeys(("qkv", "fused_qkv"), FUSED),
    **dict.fromkeys(("norm",), NORM),
}


def _kind(name: AxisName) -> Optional[str]:
  names = name if isinstance(name, tuple) else (name,)
  for n in names:
    if isinstance(n, str):
      k = _KIND_OF_NAME.get(n.lower())
      if k is None and n.lower().startswith("embed"):
        k = MODEL  # MaxText's embed_no_exp and the like
      if k is not None:
        return k
  return None


def axis_kinds(leaf: Leaf) -> Optional[tuple]:
  """What each axis of ``leaf`` is by its metadata, or None when the metadata says nothing.

  The names must be as many as the axes and at least one must be a known logical name.
  """
  if leaf.axes is None or len(leaf.axes) != len(leaf.shape):
    return None
  kinds = [_kind(n) for n in leaf.axes]
  if not any(kinds):
    return None
  has_heads = any(k in (HEADS, HEAD_DIM) for i, k in enumerate(kinds)
                  if str(leaf.axes[i]).lower() != "kv")
  for i, (name, k) in enumerate(zip(leaf.axes, kinds)):
    # 'kv' names the per-head feature axis in T5X-style models, but a 'kv' axis of 2 or 3 next to
    # a heads axis is a fused key/value (or query/key/value) axis.
    if k == HEAD_DIM and str(name).lower() == "kv" and leaf.shape[i] in (2, 3) and has_heads:
      kinds[i] = FUSED
    # A fused axis of a 2-D kernel is not a batch axis: the projections lie side by side in it.
    if k == FUSED and len(leaf.shape) == 2 and leaf.shape[i] not in (2, 3):
      kinds[i] = FUSED_FEATURES
  return tuple(kinds)


def fused_parts_of_name(name: AxisName) -> Optional[int]:
  """How many projections a fused axis named ``name`` holds (``qkv``: 3, ``kv``: 2)."""
  names = name if isinstance(name, tuple) else (name,)
  return next((_FUSED_PARTS[n.lower()] for n in names
               if isinstance(n, str) and n.lower() in _FUSED_PARTS), None)


# ------------------------------------------------------------------ names

_NORM = re.compile(r"norm|^ln(_\w+|\d+)?$")          # rms_norm, LayerNorm_0, ln_f, ln1 ...
_VECTOR_NAMES = ("bias", "scale")
_WEIGHT_NAMES = ("kernel", "w", "weight", "weights")
_BIAS_NAMES = ("bias", "b")
_STRONG_HEAD = ("lm_head", "head", "logits", "unembed", "unembedding")
_AMBIGUOUS_HEAD = ("out", "output", "decoder", "logitdense", "output_layer", "logit", "readout")
_BLOCK = re.compile(r"block|^(layers?|h|blocks?)(_?\d+)?$")
_EXPERTS = re.compile(r"expert|moe|^exp$")
_PROJ_AFFIX = re.compile(r"^(w_?|to_|attn_|self_attn_|c_)|(_?proj(ection)?|_einsum|_linear|_dense"
                         r"|_kernel|_weight|_layer)$")
PROJECTION_NAMES = {
    "query": ("q", "query", "wq", "queries"),
    "key": ("k", "key", "wk", "keys"),
    "value": ("v", "value", "wv", "values"),
    "out": ("o", "out", "wo", "output", "attn_out", "vec", "attn_vec", "out_proj", "dense"),
    "kv": ("kv", "wkv"),
    "qkv": ("qkv", "wqkv", "in", "attn", "c_attn"),
}
_QK_NORM = re.compile(r"^_?(q|query|k|key)_?(norm|ln|layernorm|rmsnorm)$")


def projection_name(component: str) -> Optional[str]:
  """``"query"``, ``"key"``, ``"value"``, ``"out"``, ``"kv"`` or ``"qkv"`` for a module name."""
  name = component.lower()
  for _ in range(3):
    for role, names in PROJECTION_NAMES.items():
      if name in names:
        return role
    stripped = _PROJ_AFFIX.sub("", name)
    if stripped == name or not stripped:
      break
    name = stripped
  return None


def is_vector_name(leaf: Leaf) -> bool:
  lower = leaf.lower
  return bool(lower) and (lower[-1] in _VECTOR_NAMES or any(_NORM.search(n) for n in lower))


def is_strong_head(name: str) -> bool:
  return (name in _STRONG_HEAD or "unembed" in name
          or (name.endswith("head") and not name.endswith("multihead")))


def is_embedding_name(leaf: Leaf) -> bool:
  joined = "/".join(leaf.lower)
  return (("embed" in joined and "emb_proj" not in joined)
          or any(n in ("wte", "wpe") for n in leaf.lower))


def is_positional(leaf: Leaf) -> bool:
  return any("pos" in n or n == "wpe" for n in leaf.lower)


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


def stacked_flags(leaves: Sequence[Leaf]) -> list[bool]:
  """Whether each leaf lies in a scan-stacked subtree (see :func:`stack_axes`)."""
  return [a is not None for a in stack_axes(leaves)]


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
    inside = inside or any(_BLOCK.search(n) for n in leaf.lower[:-1])
    out.append(bool(inside and not leaf.masked))
  return out


# ------------------------------------------------------------------ 2-D kernels

# Projections whose fan-in is the model width (attention inputs, MLP up/gate) and whose fan-out is
# (attention and MLP outputs), by the names models give them. Only specific names: a generic
# "dense" or "output" is an input projection in one model and an output in the next.
_IN_NAMES = frozenset((
    "q", "k", "v", "query", "key", "value", "wq", "wk", "wv", "q_proj", "k_proj", "v_proj",
    "query_proj", "key_proj", "value_proj", "qkv", "qkv_proj", "wqkv", "c_attn",
    "query_key_value", "kv", "kv_proj", "wkv", "in_proj", "c_fc", "fc1", "fc_in", "w1", "w3",
    "wi", "wi_0", "wi_1", "gate_proj", "up_proj", "gate", "up", "gate_up_proj", "gate_up",
    "dense_h_to_4h", "lin1"))
_OUT_NAMES = frozenset((
    "o", "o_proj", "out_proj", "wo", "c_proj", "attn_out", "output_proj", "fc2", "fc_out", "w2",
    "down_proj", "down", "dense_4h_to_h", "lin2"))
_GATE_UP_NAMES = frozenset(("gate_up_proj", "gate_up", "up_gate_proj", "up_gate", "w13", "w1_3"))


def component_name(leaf: Leaf) -> str:
  """The (lower-case) name of the module holding a kernel: ``q_proj`` for ``.../q_proj/kernel``."""
  lower = leaf.lower
  return lower[-2] if len(lower) >= 2 and lower[-1] in _WEIGHT_NAMES else lower[-1]


def _io_side(leaf: Leaf) -> Optional[str]:
  name = component_name(leaf)
  if name in _IN_NAMES:
    return "in"
  if name in _OUT_NAMES:
    return "out"
  return None


def _fused_role(leaf: Leaf) -> Optional[str]:
  """``"qkv"``, ``"kv"`` or ``"gate_up"`` for a kernel named like a fused projection."""
  name = component_name(leaf)
  if name in _GATE_UP_NAMES:
    return "gate_up"
  role = projection_name(name)
  return role if role in ("qkv", "kv") else None


def _matrix_axes(leaf: Leaf, stack_axis: Optional[int]) -> bool:
  """Whether ``leaf`` is one ``[a, b]`` matrix, or a stack ``[L, a, b]`` of them (axis 0)."""
  stack = _stack_axes(leaf, stack_axis)
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
      side = _io_side(leaf)
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


def _out_widths(leaves: Sequence[Leaf], orient: Sequence[Optional[str]], d_model: int) -> dict:
  """Module path -> the fan-in of its attention output projection ``[W, D]`` (2-D kernels)."""
  widths: dict = {}
  for leaf, o in zip(leaves, orient):
    if leaf.masked or len(leaf.shape) < 2 or _io_side(leaf) != "out":
      continue
    if projection_name(component_name(leaf)) != "out" and component_name(leaf) != "c_proj":
      continue
    fan_in, fan_out = (leaf.shape[-1], leaf.shape[-2]) if o == OUT_IN else leaf.shape[-2:]
    if fan_out == d_model:
      widths.setdefault(_projection_path(leaf)[:-1], fan_in)
  return widths


def _fused_layout(leaf: Leaf, orient: Optional[str], d_model: Optional[int],
                  out_width: Optional[int]) -> Optional[FusedDimensionNumbers]:
  """The parts of a 2-D kernel named like a fused projection, from its shape against ``D``."""
  role = _fused_role(leaf)
  if role is None or d_model is None:
    return None
  red, out = (-1, -2) if orient == OUT_IN else (-2, -1)
  if leaf.shape[red] != d_model:
    return None
  width = leaf.shape[out]
  parts: Any = None
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


# ------------------------------------------------------------------ the analysis


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
  dims: Any  # MuonDimensionNumbers, or FusedDimensionNumbers for a fused 2-D kernel
  source: str
  head_axis: Optional[int] = None
  fused_axis: Optional[int] = None


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
  parts: Optional[tuple] = None  # 2-D fused kernel: the sizes of its parts along head_axis


@dataclasses.dataclass
class AttentionGroup:
  """An attention layer found by the analysis (leaf indices; converted by ``heads.py``)."""
  name: str
  projections: list
  stack_ndim: int
  head_dim: Optional[int]
  qk_norm_dim: Optional[int]
  leading_stack: bool = True   # the stacked-layer axes lead every parameter


@dataclasses.dataclass
class Analysis:
  """Everything the routing and the head finder read about one parameter tree."""
  leaves: list
  stacked: list                # bool per leaf: inside a scan-stacked subtree
  stack_axis: list             # that subtree's layer axis (0 or 1), or None
  in_block: list
  d_model: Optional[int]
  kinds: list                  # axis_kinds per leaf (None: no usable metadata)
  layouts: dict                # leaf index -> KernelLayout
  groups: list                 # AttentionGroup
  orientation: list = dataclasses.field(default_factory=list)  # "out_in" or None per leaf
  unsplit: list = dataclasses.field(default_factory=list)  # fused-named kernels left whole


def _stack_axes(leaf: Leaf, axis: Optional[int]) -> tuple:
  return (axis,) if axis is not None and len(leaf.shape) > axis + 1 else ()


def _infer_d_model(leaves: Sequence[Leaf], kinds: Sequence, stacked: Sequence[bool]
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
                              and any(_NORM.search(n) for n in leaf.lower))
  return gains.most_common(1)[0][0] if gains else None


def _dims(reduction: Sequence[int], output: Sequence[int]) -> MuonDimensionNumbers:
  def pack(axes: Sequence[int]) -> Any:
    axes = tuple(sorted(axes))
    return axes[0] if len(axes) == 1 else axes
  return MuonDimensionNumbers(reduction_axis=pack(reduction), output_axis=pack(output))


def _metadata_layout(leaf: Leaf, kinds: tuple, d_model: Optional[int]) -> Optional[KernelLayout]:
  nd = len(leaf.shape)
  batch = [a for a, k in enumerate(kinds) if k in _BATCH_KINDS]
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


def _shape_reading(leaf: Leaf, stack: tuple, d_model: Optional[int]) -> Optional[dict]:
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
  return {"d": d, "fused": fused, "others": others, "position": position}


def _reading_layout(leaf: Leaf, r: dict, source: str) -> KernelLayout:
  nd = len(leaf.shape)
  others = [a - nd for a in r["others"]]
  d = r["d"] - nd
  head_axis = others[0] if len(others) == 2 else None
  fused = None if r["fused"] is None else r["fused"] - nd
  if r["position"] == "last":
    return KernelLayout(_dims(others, [d]), source, head_axis, fused)
  return KernelLayout(_dims([d], others), source, head_axis, fused)


def _projection_path(leaf: Leaf) -> tuple:
  return leaf.names[:-1] if leaf.lower[-1] in _WEIGHT_NAMES else leaf.names


def analyse(leaves: Sequence[Leaf], roles: Optional[dict] = None) -> Analysis:
  """Reads every parameter's role-relevant facts; see the module docstring for the rules.

  Args:
    leaves: from :func:`param_leaves`.
    roles: optional leaf index -> attention projection role (``"query"``, ``"key"``,
      ``"value"``, ``"out"``, ``"none"``) that wins over the names.
  """
  leaves = list(leaves)
  stack_axis = stack_axes(leaves)
  stacked = [a is not None for a in stack_axis]
  in_block = block_flags(leaves, stacked)
  kinds = [None if leaf.masked else axis_kinds(leaf) for leaf in leaves]
  d_model = _infer_d_model(leaves, kinds, stacked)
  layouts: dict[int, KernelLayout] = {}
  readings: dict[int, dict] = {}
  for i, leaf in enumerate(leaves):
    if leaf.masked or len(leaf.shape) < 2:
      continue
    leaf_kinds = kinds[i]
    if leaf_kinds is not None:
      meta = _metadata_layout(leaf, leaf_kinds, d_model)
      if meta is not None:
        layouts[i] = meta
        continue
    stack = _stack_axes(leaf, stack_axis[i])
    rest = [a - len(leaf.shape) for a in range(len(leaf.shape)) if a not in stack]
    if stack and stack != (0,) and len(rest) == 2:  # [in, L, out]: stacked on axis 1
      layouts[i] = KernelLayout(_dims(rest[:1], rest[1:]), "shape")
      continue
    r = _shape_reading(leaf, stack, d_model)
    if r is None:
      continue
    readings[i] = r
    experts = any(_EXPERTS.search(n) for n in leaf.lower)
    if r["position"] == "first" and r["fused"] is None and not experts:
      layouts[i] = _reading_layout(leaf, r, "shape")  # [D, H, hd]: DenseGeneral in any module
    elif r["position"] == "last" and r["fused"] is None and not experts:
      layouts[i] = _reading_layout(leaf, r, "shape")  # [H, hd, D]
  orient = orientations(leaves, stack_axis, d_model)
  out_widths = _out_widths(leaves, orient, d_model) if d_model is not None else {}
  unsplit = []
  for i, leaf in enumerate(leaves):
    if i in layouts or leaf.masked or not _matrix_axes(leaf, stack_axis[i]):
      continue
    source = "module" if leaf.storage is not None else "names"
    fused = _fused_layout(leaf, orient[i], d_model,
                          out_widths.get(_projection_path(leaf)[:-1]))
    if fused is not None:
      layouts[i] = KernelLayout(fused, source if orient[i] == OUT_IN else "names")
    elif orient[i] == OUT_IN:
      layouts[i] = KernelLayout(_dims([-1], [-2]), source)
    if fused is None and _fused_role(leaf) is not None:
      unsplit.append(i)
  groups = _attention_groups(leaves, stack_axis, kinds, d_model, layouts, readings, roles or {},
                             orient)
  return Analysis(leaves, stacked, stack_axis, in_block, d_model, kinds, layouts, groups, orient,
                  unsplit)


# ------------------------------------------------------------------ attention layers

def _bias_of(leaves: Sequence[Leaf], by_path: dict, kernel: Leaf) -> Optional[int]:
  proj = _projection_path(kernel)
  if proj == kernel.names:
    return None
  for name in _BIAS_NAMES:
    j = by_path.get(proj + (name,))
    if j is not None:
      return j
  return None


def _attention_groups(leaves: list, stack_axis: list, kinds: list, d_model: Optional[int],
                      layouts: dict, readings: dict, roles: dict, orient: list) -> list:
  by_path = {leaf.names: i for i, leaf in enumerate(leaves) if not leaf.masked}
  members: dict = collections.defaultdict(list)
  for i, leaf in enumerate(leaves):
    if (leaf.masked or len(leaf.shape) < 2 or leaf.lower[-1] in _BIAS_NAMES
        or roles.get(i) == "none"):
      continue
    proj = _projection_path(leaf)
    if len(proj) >= 1:
      members[proj[:-1]].append(i)
  groups = []
  for parent, idx in members.items():
    group = None
    for d in _widths_to_try(leaves, stack_axis, idx, d_model):
      group_readings = dict(readings) if d == d_model else {
          i: r for i in idx
          if (r := _shape_reading(leaves[i], _stack_axes(leaves[i], stack_axis[i]), d))}
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


def _widths_to_try(leaves: list, stack_axis: list, idx: list, d_model: Optional[int]) -> list:
  """The model width, or without one, every first or last axis size of the group's kernels."""
  if d_model is not None:
    return [d_model]
  sizes: set = set()
  for i in idx:
    leaf = leaves[i]
    axes = [a for a in range(len(leaf.shape)) if a not in _stack_axes(leaf, stack_axis[i])]
    if len(axes) >= 3:
      sizes.update((leaf.shape[axes[0]], leaf.shape[axes[-1]]))
  return sorted(sizes, reverse=True)


def _qk_norm_dim(leaves: Sequence[Leaf], parent: tuple, stack: int) -> Optional[int]:
  dims = set()
  for leaf in leaves:
    if leaf.masked or leaf.names[:len(parent)] != parent or len(leaf.names) != len(parent) + 2:
      continue
    if _QK_NORM.match(leaf.lower[len(parent)]) and len(leaf.shape) - stack == 1:
      dims.add(leaf.shape[-1])
  return dims.pop() if len(dims) == 1 else None


def _group_from_shapes(leaves: list, stack_axis: list, kinds: list, d_model: Optional[int],
                       layouts: dict, readings: dict, by_path: dict, parent: tuple, idx: list,
                       roles: dict) -> Optional[AttentionGroup]:
  """An attention layer recognised from 3+-axis kernels (metadata or shapes)."""
  ins: list[Projection] = []
  outs: list[Projection] = []
  for i in idx:
    leaf = leaves[i]
    nd = len(leaf.shape)
    lay = layouts.get(i)
    if lay is not None and lay.source == "metadata":
      k = kinds[i]
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
    if r is None or len(r["others"]) != 2:
      continue
    h_ax, hd_ax = r["others"]
    h, hd = leaf.shape[h_ax], leaf.shape[hd_ax]
    fused = 1 if r["fused"] is None else leaf.shape[r["fused"]]
    p = Projection(None, i, _bias_of(leaves, by_path, leaf), h, hd, h_ax - nd, fused,
                   None if r["fused"] is None else r["fused"] - nd, h * hd)
    (outs if r["position"] == "last" else ins).append(p)
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
    r = readings.get(p.kernel)
    if r is not None:
      layouts[p.kernel] = _reading_layout(leaves[p.kernel], r, "attention")
  for p in outs:
    p.role = "out"
  _assign_roles(leaves, ins, q_heads)
  for p in ins:
    if p.kernel in roles and p.fused == 1:
      p.role = roles[p.kernel]
  k = kinds[ins[0].kernel]
  if k is not None and layouts[ins[0].kernel].source == "metadata":
    axes = tuple(a for a, kind in enumerate(k) if kind == STACK)
  else:
    axes = _stack_axes(leaves[ins[0].kernel], stack_axis[ins[0].kernel])
  return AttentionGroup("/".join(parent), ins + outs, len(axes), head_dims.pop(), None,
                        axes == tuple(range(len(axes))))


def _assign_roles(leaves: Sequence[Leaf], ins: list, q_heads: int) -> None:
  """Query/key/value roles of the input projections: fused ones by position, others by name."""
  for p in ins:
    if p.fused == 3:
      p.role = "qkv"
    elif p.fused == 2:
      p.role = "kv"
    else:
      p.role = projection_name(leaves[p.kernel].names[-2] if _projection_path(leaves[p.kernel])
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


def _group_from_names(leaves: list, stack_axis: list, d_model: Optional[int], by_path: dict,
                      parent: tuple, idx: list, roles: dict, layouts: dict, orient: list
                      ) -> Optional[AttentionGroup]:
  """An attention layer of 2-D ``[D, H*hd]`` (or ``[H*hd, D]``) kernels, recognised by its
  projections' names; a fused query/key/value or key/value kernel counts with its parts."""
  if d_model is None:
    return None
  projs = []
  for i in idx:
    leaf = leaves[i]
    stack = len(_stack_axes(leaf, stack_axis[i]))
    if len(leaf.shape) - stack != 2 or stack_axis[i] not in (None, 0):
      continue
    comp = leaf.names[-2] if _projection_path(leaf) != leaf.names else leaf.names[-1]
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
  stack = len(_stack_axes(leaves[projs[0].kernel], stack_axis[projs[0].kernel]))
  return AttentionGroup("/".join(parent), projs, stack, None,
                        _qk_norm_dim(leaves, parent, stack))
