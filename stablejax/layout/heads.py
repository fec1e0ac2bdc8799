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
import fnmatch
import warnings
from typing import Mapping, Optional, Sequence, Union

import optax

from stablejax.layout import analysis as layout
from stablejax.layout.attention import AttentionGroup, Projection
from stablejax.layout.leaves import Leaf
from stablejax.layout.orientation import FusedDimensionNumbers, MatrixDims, MuonDimensionNumbers


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
    span: for a 2-D fused projection, ``(start, size)`` of the range of ``head_axis`` that is
      this projection, its heads head-major inside it (GPT-2's ``c_attn`` ``[D, 3D]``: the query
      is ``(0, D)``, the key ``(D, D)``); None when the whole axis is this projection's.
  """
  path: str
  head_axis: int
  select: Optional[tuple[int, int]] = None
  span: Optional[tuple[int, int]] = None


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


# ------------------------------------------------------------------ finding them

ROLES = ("query", "key", "value", "out", "none")


def _match(pattern: str, path: str) -> bool:
  return fnmatch.fnmatchcase(path, pattern) or path.startswith(pattern.rstrip("/") + "/")


def _role_overrides(leaves: Sequence[Leaf], overrides: Mapping[str, str], strict: bool
                    ) -> dict[int, str]:
  """Leaf index -> role for every kernel a pattern matches; warns about patterns matching none."""
  roles: dict[int, str] = {}
  unmatched = []
  for pattern, role in overrides.items():
    if role not in ROLES:
      raise ValueError(f"find_attention_layers: overrides maps {pattern!r} to {role!r}; use one "
                       f"of {ROLES}")
    hits = [i for i, leaf in enumerate(leaves)
            if not leaf.masked and len(leaf.shape) >= 2 and _match(pattern, leaf.path)]
    for i in hits:
      roles[i] = role
    if not hits:
      unmatched.append(pattern)
  if unmatched:
    example = next((leaf.path for leaf in leaves if len(leaf.shape) >= 2), "")
    text = (f"find_attention_layers: overrides pattern(s) {unmatched} match no kernel; patterns "
            f"are fnmatch globs or path prefixes of kernel paths such as {example!r}")
    if strict:
      raise ValueError(text)
    warnings.warn(text, stacklevel=3)
  return roles


def _head_param(analysis: layout.Analysis, index: int, head_axis: Optional[int],
                fused_axis: Optional[int], part: Optional[int],
                span: Optional[tuple[int, int]] = None) -> HeadParam:
  leaf = analysis.leaves[index]
  assert head_axis is not None  # every projection of a layer has its head axis
  select = None
  if part is not None and fused_axis is not None:
    select = (len(leaf.shape) + fused_axis, part)
  return HeadParam(leaf.path, head_axis, select, span)


def _bias_param(analysis: layout.Analysis, p: Projection, heads: int, head_dim: int,
                stack_ndim: int, part: Optional[int]) -> Optional[HeadParam]:
  """The bias of a projection, if its shape is ``[*stack, (F,) H, hd]`` or ``[*stack, H*hd]``."""
  if p.bias is None:
    return None
  leaf = analysis.leaves[p.bias]
  shape = leaf.shape[stack_ndim:]
  if p.parts is not None and part is not None:  # a 2-D fused kernel's bias: [*stack, sum(parts)]
    start = sum(p.parts[:part])
    if shape != (sum(p.parts),) or p.parts[part] != heads * head_dim:
      return None
    return HeadParam(leaf.path, -1, None, (start, p.parts[part]))
  select = None
  if part is not None:
    if not shape or shape[0] != p.fused:
      return None
    select, shape = (stack_ndim, part), shape[1:]
  if shape == (heads, head_dim):
    return HeadParam(leaf.path, -2, select)
  if shape == (heads * head_dim,):
    return HeadParam(leaf.path, -1, select)
  return None


def _part_width(p: Projection, part: Optional[int]) -> int:
  return p.parts[part] if p.parts is not None and part is not None else p.width


def _span(p: Projection, part: Optional[int]) -> Optional[tuple[int, int]]:
  if p.parts is None or part is None:
    return None
  return (sum(p.parts[:part]), p.parts[part])


def _layer(analysis: layout.Analysis, group: AttentionGroup, num_heads: Optional[int],
           num_kv_heads: Optional[int] = None) -> AttentionLayer:
  if not group.leading_stack:
    raise ValueError(f"attention layer {group.name!r} is stacked along an axis that is not the "
                     "leading one (nn.scan with variable_axes={'params': 1}); AttentionLayer "
                     "describes leading stacked axes only")
  parts: dict[str, tuple[Projection, Optional[int]]] = {}
  for p in group.projections:
    if p.role == "qkv" and (p.fused == 3 or (p.parts is not None and len(p.parts) == 3)):
      parts.setdefault("query", (p, 0))
      parts.setdefault("key", (p, 1))
    elif p.role == "kv" and (p.fused == 2 or (p.parts is not None and len(p.parts) == 2)):
      parts.setdefault("key", (p, 0))
    elif p.role in ("query", "key") and p.fused == 1:
      parts.setdefault(p.role, (p, None))
  missing = [r for r in ("query", "key") if r not in parts]
  if missing:
    kernels = [analysis.leaves[p.kernel].path for p in group.projections if p.role != "out"]
    raise LookupError(f"attention layer {group.name!r}: no {' or '.join(missing)} projection "
                      f"could be told apart among {kernels} (by shape or by name); say which with "
                      f"overrides={{{kernels[0]!r}: 'query', ...}}")
  (q, q_part), (k, k_part) = parts["query"], parts["key"]
  heads: int
  kv_heads: int
  head_dim: int
  if q.heads is not None and k.heads is not None and q.head_dim is not None:
    heads, kv_heads, head_dim = q.heads, k.heads, q.head_dim  # 3+-axis kernels: heads an axis
    if num_heads is not None and num_heads != heads:
      raise ValueError(f"attention layer {group.name!r} has {heads} query heads "
                       f"({analysis.leaves[q.kernel].path} {analysis.leaves[q.kernel].shape}), "
                       f"not num_heads={num_heads}")
  else:  # [D, H*hd] kernels: heads split from the output axis, head-major
    q_width, k_width = _part_width(q, q_part), _part_width(k, k_part)
    if group.qk_norm_dim is not None:
      head_dim = group.qk_norm_dim
    elif num_heads is not None and q_width % num_heads == 0:
      head_dim = q_width // num_heads
    elif num_heads is None and num_kv_heads is not None and k_width % num_kv_heads == 0:
      head_dim = k_width // num_kv_heads
    else:
      raise ValueError(
          f"attention layer {group.name!r}: its query kernel {analysis.leaves[q.kernel].path} "
          f"{analysis.leaves[q.kernel].shape} holds all heads in one axis of {q_width}; "
          + ("pass num_heads= (the model's head count) or config= (a Hugging Face config)"
             if num_heads is None else f"num_heads={num_heads} does not divide it"))
    if q_width % head_dim or k_width % head_dim:
      raise ValueError(f"attention layer {group.name!r}: query width {q_width} and key width "
                       f"{k_width} are not multiples of the head size {head_dim}")
    heads, kv_heads = q_width // head_dim, k_width // head_dim
    if num_heads is not None and num_heads != heads:
      raise ValueError(f"attention layer {group.name!r}: num_heads={num_heads} disagrees with "
                       f"the head size {head_dim} of its query/key norm ({heads} heads)")
  if num_kv_heads is not None and num_kv_heads != kv_heads:
    raise ValueError(f"attention layer {group.name!r} has {kv_heads} key heads "
                     f"({analysis.leaves[k.kernel].path} {analysis.leaves[k.kernel].shape}), "
                     f"not num_kv_heads={num_kv_heads}")
  query = [_head_param(analysis, q.kernel, q.head_axis, q.fused_axis, q_part, _span(q, q_part))]
  key = [_head_param(analysis, k.kernel, k.head_axis, k.fused_axis, k_part, _span(k, k_part))]
  for p, part, h, out in ((q, q_part, heads, query), (k, k_part, kv_heads, key)):
    bias = _bias_param(analysis, p, h, head_dim, group.stack_ndim, part)
    if bias is not None:
      out.append(bias)
  return AttentionLayer(group.name, heads, kv_heads, tuple(query), tuple(key), group.stack_ndim)


def heads_of_config(config: object) -> tuple[int, Optional[int]]:
  """``(num_heads, num_kv_heads)`` of a model config: a Hugging Face ``PretrainedConfig`` (or any
  object or mapping with ``num_attention_heads`` / ``n_head`` / ``num_heads`` and optionally
  ``num_key_value_heads`` / ``num_kv_heads``); ``num_kv_heads`` is None when it does not say.

  Example:
    >>> from stablejax.layout.heads import heads_of_config
    >>> heads_of_config({"num_attention_heads": 8, "num_key_value_heads": 2})
    (8, 2)
  """
  def get(name: str) -> object:
    if isinstance(config, Mapping):
      return config.get(name)
    return getattr(config, name, None)
  heads = next((v for n in ("num_attention_heads", "n_head", "num_heads")
                if isinstance(v := get(n), int) and not isinstance(v, bool)), None)
  if heads is None:
    raise ValueError(f"config {type(config).__name__} says no head count (num_attention_heads, "
                     "n_head or num_heads); pass num_heads= instead")
  kv = next((v for n in ("num_key_value_heads", "num_kv_heads", "n_kv_heads")
             if isinstance(v := get(n), int) and not isinstance(v, bool)), None)
  return heads, kv


def resolve_head_counts(num_heads: Optional[int], num_kv_heads: Optional[int], config: object,
                        who: str) -> tuple[Optional[int], Optional[int]]:
  """The head counts given directly or read from ``config`` (they must agree when both are)."""
  for name, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
      raise ValueError(f"{who}: {name}={value!r} must be a positive int")
  if config is None:
    return num_heads, num_kv_heads
  heads, kv = heads_of_config(config)
  for name, given, read in (("num_heads", num_heads, heads), ("num_kv_heads", num_kv_heads, kv)):
    if given is not None and read is not None and given != read:
      raise ValueError(f"{who}: {name}={given} disagrees with the config's {read}")
  return num_heads or heads, num_kv_heads or kv


def find_attention_layers(params: optax.Params, num_heads: Optional[int] = None,
                          overrides: Optional[Mapping[str, str]] = None,
                          strict: bool = False, *, num_kv_heads: Optional[int] = None,
                          config: object = None) -> list[AttentionLayer]:
  """The attention layers of a model: where each layer's query and key heads lie.

  Reads the same layout analysis as the Muon routing (:mod:`stablejax.layout.analysis`: Flax
  partitioning metadata first, shapes second, names last). Recognised:

  * 3+-axis projections with a heads axis: Flax Linen ``MultiHeadDotProductAttention`` and
    ``nnx.MultiHeadAttention`` (query/key ``[D, H, hd]``, biases ``[H, hd]``), ``DenseGeneral``
    attention under any module name, Gemma's einsum kernels (fused ``qkv_einsum [3, H, D, hd]``;
    ``q_einsum [H, D, hd]`` with ``kv_einsum [2, K, D, hd]`` for grouped-query attention), and
    the same under ``nn.scan`` / ``nnx.scan`` (a leading layer axis) or with logical axis names;
    the query is told from the key by name (``query`` / ``q_proj`` / ``wq``...), by position in a
    fused kernel, or as the projection with the most heads.
  * 2-D projections ``[D, H*hd]`` named like ``q_proj`` / ``k_proj`` (stablejax's own GPT:
    ``blocks/attn/{q,k}_proj/kernel [L, D, D]``; Hugging Face's Flax Llama, Mistral, Gemma and
    GPT-Neo), or stored ``[H*hd, D]`` (Equinox's ``MultiheadAttention``, whose
    ``query_proj`` / ``key_proj`` are ``eqx.nn.Linear``), and fused 2-D query/key/value kernels
    (GPT-2's ``c_attn``, ``[3D, D]`` in Hugging Face's Flax ``Conv1D``; see
    :func:`stablejax.layout.orientation.orientations` for how the storage is read): heads are split
    from the output axis, head major; the head count comes from ``num_heads`` (or ``config``) or
    from a query/key norm gain ``[hd]`` (``q_norm/scale``) next to them. Grouped-query key heads
    are the key width over the head size.

  Args:
    params: the parameter tree (arrays, ``jax.ShapeDtypeStruct``, Linen boxes, NNX ``Variable``
      objects, ``{'params': ...}``, Equinox modules).
    num_heads: the query head count, needed only for 2-D projections without a query/key norm;
      checked against the shapes otherwise.
    overrides: ``{path pattern: role}`` with role ``"query"``, ``"key"``, ``"value"``, ``"out"``
      or ``"none"`` (not a projection), for kernels whose role the names do not tell; patterns
      are fnmatch globs or path prefixes of kernel paths. A pattern that matches no projection
      warns (so one mapping can serve several variants of a model).
    strict: raise instead of warning for such a pattern.
    num_kv_heads: the key head count (grouped-query attention), checked against the shapes;
      for 2-D projections it also gives the head size when ``num_heads`` is not known.
    config: a Hugging Face model config (``model.config``) or a mapping, read for ``num_heads``
      and ``num_kv_heads`` (see :func:`heads_of_config`).

  Returns:
    One :class:`AttentionLayer` per attention module (per stack of layers for scanned models),
    in path order.

  Raises:
    ValueError: the head count of a 2-D layer cannot be read (pass ``num_heads``),
      ``num_heads`` disagrees with the shapes, or a layer is stacked along an axis that is not
      the leading one (``nn.scan(..., variable_axes={'params': 1})``).
    LookupError: a layer's query or key cannot be told apart (pass ``overrides``).

  Example:
    >>> import jax.numpy as jnp
    >>> from stablejax.layout.heads import find_attention_layers
    >>> params = {"embed": jnp.zeros((50, 8)),
    ...           "attn": {"query": {"kernel": jnp.zeros((8, 2, 4))},
    ...                    "key": {"kernel": jnp.zeros((8, 2, 4))},
    ...                    "value": {"kernel": jnp.zeros((8, 2, 4))},
    ...                    "out": {"kernel": jnp.zeros((2, 4, 8))}}}
    >>> [(l.name, l.num_heads, l.query[0].head_axis) for l in find_attention_layers(params)]
    [('attn', 2, -2)]
  """
  if overrides is not None and not isinstance(overrides, Mapping):
    raise ValueError(f"overrides must be a mapping {{path pattern: role}}, got {overrides!r}")
  num_heads, num_kv_heads = resolve_head_counts(num_heads, num_kv_heads, config,
                                                "find_attention_layers")
  leaves, _ = layout.param_leaves(params)
  roles = _role_overrides(leaves, overrides, strict) if overrides else None
  analysis = layout.analyse(leaves, roles)
  layers = [_layer(analysis, g, num_heads, num_kv_heads) for g in analysis.groups]
  return sorted(layers, key=lambda layer: layer.name)


# ------------------------------------------------------------------ per-head matrices

def _axes(axes: Union[int, Sequence[int]], ndim: int) -> tuple[int, ...]:
  """Axes as negative ints (a layout's convention: unchanged by leading stacked axes)."""
  axes = (axes,) if isinstance(axes, int) else tuple(axes)
  return tuple(int(a) % ndim - ndim for a in axes)


def _pack(axes: Sequence[int]) -> Union[int, tuple[int, ...]]:
  return axes[0] if len(axes) == 1 else tuple(axes)


def _head_dim(analysis: layout.Analysis, group: AttentionGroup,
              num_heads: Optional[int]) -> Optional[int]:
  """The head size of a layer: its heads axis, its query/key norm, or the query width over
  ``num_heads`` (None when none of them says)."""
  if group.head_dim is not None:
    return group.head_dim
  if group.qk_norm_dim is not None:
    return group.qk_norm_dim
  for p in group.projections:
    if num_heads is None:
      break
    width = p.parts[0] if p.role == "qkv" and p.parts else p.width
    if p.role in ("query", "qkv", "out") and width % num_heads == 0:
      return width // num_heads
  return None


def per_head_layouts(analysis: layout.Analysis, layouts: Sequence[Optional[MatrixDims]],
                     num_heads: Optional[int] = None
                     ) -> tuple[dict[int, MatrixDims], list[str]]:
  """The matrices of every attention projection split per head, for Muon.

  Query, key and value projections become one ``[D, hd]`` matrix per head (grouped-query key
  and value: per key head; a fused query/key/value kernel: per head of each part), the output
  projection one ``[hd, D]`` matrix per head, whatever the storage: a kernel with a heads axis
  (``[D, H, hd]``, ``[H, hd, D]``, Gemma's ``[H, D, hd]``) gets that axis as a batch axis of
  its ``optax.contrib.MuonDimensionNumbers``; a 2-D kernel (``[D, H*hd]``, ``[out, in]``
  storage, fused ``[D, (H + 2K) hd]``, stacked ``[L, ...]``) a
  :class:`stablejax.FusedDimensionNumbers` of ``width / hd`` equal parts along its head side,
  split head-major as ``reshape(..., H, hd)`` does.

  Args:
    analysis: :func:`stablejax.layout.analysis.analyse` of the parameters.
    layouts: the whole-matrix layout of each leaf (None for leaves that are not Muon's); only
      the attention projections among them are split.
    num_heads: the query head count, needed for layers of 2-D kernels without a query/key norm
      (the head size is then the query width over it).

  Returns:
    ``({leaf index: per-head dimension numbers}, [layers whose head size is unknown])``.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> from stablejax.layout import analysis
    >>> from stablejax.layout.heads import per_head_layouts
    >>> MDN = optax.contrib.MuonDimensionNumbers
    >>> params = {"embed": jnp.zeros((50, 8)), "attn": {
    ...     name: {"kernel": jnp.zeros((8, 8))} for name in ("q_proj", "k_proj", "v_proj",
    ...                                                     "o_proj")}}
    >>> leaves, _ = analysis.param_leaves(params)
    >>> [leaf.path for leaf in leaves]  # doctest: +NORMALIZE_WHITESPACE
    ['attn/k_proj/kernel', 'attn/o_proj/kernel', 'attn/q_proj/kernel', 'attn/v_proj/kernel',
     'embed']
    >>> whole = [MDN(-2, -1)] * 4 + [None]   # the Muon layouts; the embedding is not Muon's
    >>> split, unknown = per_head_layouts(analysis.analyse(leaves), whole, num_heads=2)
    >>> split[0]  # k_proj: 2 heads of 4 along its output axis
    FusedDimensionNumbers(reduction_axis=-2, output_axis=-1, fused_axis=-1, parts=2)
    >>> split[1]  # o_proj: 2 heads of 4 along its input axis
    FusedDimensionNumbers(reduction_axis=-2, output_axis=-1, fused_axis=-2, parts=2)
  """
  out: dict[int, MatrixDims] = {}
  unknown: list[str] = []
  for group in analysis.groups:
    hd = _head_dim(analysis, group, num_heads)
    for p in group.projections:
      dims = layouts[p.kernel] if p.kernel < len(layouts) else None
      if dims is None:
        continue
      shape = analysis.leaves[p.kernel].shape
      nd = len(shape)
      red, outs = _axes(dims.reduction_axis, nd), _axes(dims.output_axis, nd)
      if p.heads is not None and p.head_axis is not None:  # a heads axis: make it a batch axis
        head = p.head_axis % nd - nd
        red2, out2 = tuple(a for a in red if a != head), tuple(a for a in outs if a != head)
        if red2 and out2 and (red2, out2) != (red, outs):
          out[p.kernel] = MuonDimensionNumbers(_pack(red2), _pack(out2))
        continue
      if p.role is None:
        continue
      if hd is None:
        if group.name not in unknown:
          unknown.append(group.name)
        continue
      side = red if p.role == "out" else outs
      if len(side) != 1 or shape[side[0]] % hd:
        continue
      out[p.kernel] = FusedDimensionNumbers(_pack(red), _pack(outs), side[0],
                                            shape[side[0]] // hd)
  return out, unknown
