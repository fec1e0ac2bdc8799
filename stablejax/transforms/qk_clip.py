"""QK-clip: rescale the query and key weights of heads whose attention logits grew past ``tau``.

Kimi Team, "Kimi K2: Open Agentic Intelligence" (arXiv 2507.20534), section 2.1, MuonClip: after
each optimizer update, every attention head ``h`` whose maximum pre-softmax logit of the step,
``S_max^h = max q_h.k_h / sqrt(head_dim)`` over the batch, exceeded ``tau`` gets its query and
key weights multiplied by ``sqrt(gamma_h)`` each, ``gamma_h = tau / S_max^h``, so that the same
batch would give that head a maximum logit of exactly ``tau``. Heads below ``tau`` are untouched;
the rule acts per head, not per layer, so a healthy head in a layer with one runaway head keeps
its weights. Where a key is shared (Kimi K2's MLA shares its rotary key ``k^R`` between heads
and leaves it alone, giving the head's rotary query the whole ``gamma``), the shared part is not
rescaled and the query takes the whole factor; here that is grouped-query and multi-query
attention, whose key heads are shared by ``H / K`` query heads: with ``K < H`` each offending
query head is multiplied by ``gamma`` and the keys stay as they are. Biases of the projections
are scaled with their kernels, so the logit scales exactly (``(W x + b) * c = (c W) x + c b``).

The transform goes last in the chain (after every learning-rate scaling), inside the skip
wrappers: it returns the updates that, applied with ``optax.apply_updates``, leave the
*updated* weights rescaled, ``u' = u * f + p * (f - 1)`` for the factor ``f`` of each entry
(``(p + u) * f`` after the update; ``u' = u`` exactly where ``f = 1``). A skipped step therefore
clips nothing (the skip wrapper returns zero updates). The max logits come in as the extra
argument ``max_logits`` (as ``loss=`` does for the skip wrappers), computed in the step's forward
pass: :func:`stablejax.collect_attention_logits` reads them from a Flax model's intermediates.

Which parameters are a layer's query and key projections, and where their heads lie, is an
:class:`~stablejax.layout.heads.AttentionLayer` (see :mod:`stablejax.layout.heads`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from stablejax.layout.heads import AttentionLayer, HeadParam, find_attention_layers
from stablejax.layout.heads import resolve_head_counts
from stablejax.transforms import _common
from stablejax.transforms import defence
from stablejax.transforms.metrics import Series, register_state_metrics
from stablejax.transforms.stacked import key_name

LayersArg = Union[Sequence[AttentionLayer], Callable[[Any], Sequence[AttentionLayer]], None]


class QKClipState(NamedTuple):
  """State of :func:`qk_clip`: diagnostics of the last step.

  Attributes:
    heads_clipped: query heads rescaled at the last step (int32; a head of a stacked layer
      counts once per layer).
    max_logit: the largest per-head maximum logit passed in at the last step (float32; over
      every layer and head; non-finite values included, so a runaway logit shows).
    total_clipped: head rescalings since init (int32, saturating).

  Example:
    >>> import jax.numpy as jnp
    >>> import stablejax
    >>> from stablejax.layout.heads import AttentionLayer, HeadParam
    >>> attn = AttentionLayer("attn", num_heads=2, num_kv_heads=2,
    ...                       query=(HeadParam("q", head_axis=-1),),
    ...                       key=(HeadParam("k", head_axis=-1),))
    >>> tx = stablejax.qk_clip(tau=100.0, layers=[attn])
    >>> params = {"q": jnp.ones((4, 4)), "k": jnp.ones((4, 4))}
    >>> _, state = tx.update(params, tx.init(params), params,
    ...                      max_logits={"attn": jnp.array([400.0, 50.0])})
    >>> int(state.heads_clipped), float(state.max_logit), int(state.total_clipped)
    (1, 400.0, 1)
  """
  heads_clipped: jax.Array
  max_logit: jax.Array
  total_clipped: jax.Array


def qk_clip(tau: float = 100.0, layers: LayersArg = None, num_heads: Optional[int] = None, *,
            num_kv_heads: Optional[int] = None, config: Any = None
            ) -> optax.GradientTransformationExtraArgs:
  """Kimi K2's QK-clip (MuonClip's clipping half) as the last link of an optax chain.

  For each attention layer and each query head ``h`` whose maximum pre-softmax logit at this
  step ``S_h`` (the extra argument ``max_logits``) exceeds ``tau``, with ``gamma = tau / S_h``:
  multi-head attention (``K == H``) multiplies the head's query and key weights by
  ``sqrt(gamma)`` each; grouped-query or multi-query attention (``K < H``, key heads shared by
  several query heads) multiplies the query head by ``gamma`` and leaves the shared key head
  alone, as Kimi K2 does with its shared rotary key. Kernels and biases of the projections are
  scaled alike, so the head's logits scale by exactly ``gamma``. The returned updates, applied,
  leave the *updated* parameters rescaled; every other entry gets its update unchanged. A
  non-finite ``S_h`` clips nothing (the step is a case for :func:`stablejax.skip_nonfinite`).

  A shared key head whose query heads exceed ``tau`` (one, several or all of its group) is never
  scaled: each offending query head ``h`` takes its own ``gamma_h`` and the group's other query
  heads keep their logits, so every query head ends at ``min(S_h, tau)`` exactly on the same
  batch (scaling the shared key instead would move the logits of the heads below ``tau`` too).

  Put it after every transform that scales the update (learning rate, schedules, a
  learning-rate multiplier) and inside the skip wrappers, so a skipped step clips nothing. It
  works with any optimizer before it (AdamW, :func:`stablejax.outlier_safe_muon`). No host
  transfer, no Python branch on traced values.

  Args:
    tau: the logit threshold (Kimi K2 uses 100). At small scale healthy heads can exceed 100
      (see the README's measurements), so set it from the logits of a healthy run.
    layers: the attention layers: a list of :class:`~stablejax.layout.heads.AttentionLayer`, a
      function ``params -> list`` of them, or None for
      ``stablejax.layout.heads.find_attention_layers(params, num_heads)`` (called once per
      parameter structure, when the step is traced).
    num_heads: with ``layers=None``, the query head count for models whose query and key
      kernels hold every head in one axis (``[D, H * head_dim]``: Hugging Face's Flax Llama,
      Mistral, Gemma, GPT-Neo and GPT-2, an Equinox ``MultiheadAttention``) and have no QK-norm
      gain to read it from; checked against the shapes otherwise.
    num_kv_heads: with ``layers=None``, the key head count (grouped-query attention); checked
      against the shapes.
    config: with ``layers=None``, a Hugging Face model config (``model.config``) or a mapping to
      read ``num_heads`` and ``num_kv_heads`` from.

  The layers are found, and checked against the parameters, at ``init``: a layout whose heads
  cannot be located fails there with one line naming the argument that fixes it.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose ``update(updates, state, params, *,
    max_logits, **extra)`` needs ``params`` and ``max_logits``, a mapping from
    :attr:`AttentionLayer.name` to the layer's float32 per-head maximum logits
    ``[*stack, num_heads]`` (e.g. :func:`stablejax.collect_attention_logits` of the forward
    pass's intermediates). Its state is a :class:`QKClipState`; ``stability_metrics`` reports
    ``qk_clip/heads_clipped``, ``qk_clip/max_logit`` and ``qk_clip/total_clipped``.

  References:
    Kimi Team, `Kimi K2: Open Agentic Intelligence <https://arxiv.org/abs/2507.20534>`_
    (arXiv 2507.20534), section 2.1 and Algorithm 1 (MuonClip).

  Example:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import stablejax
    >>> from stablejax.layout.heads import AttentionLayer, HeadParam, find_attention_layers
    >>> attn = AttentionLayer("attn", num_heads=2, num_kv_heads=2,
    ...                       query=(HeadParam("q", head_axis=-1),),
    ...                       key=(HeadParam("k", head_axis=-1),))
    >>> params = {"q": jnp.ones((4, 4)), "k": jnp.ones((4, 4))}   # [D, H * head_dim]
    >>> tx = optax.chain(optax.sgd(0.0), stablejax.qk_clip(tau=100.0, layers=[attn]))
    >>> state = tx.init(params)
    >>> grads = {"q": jnp.zeros((4, 4)), "k": jnp.zeros((4, 4))}
    >>> updates, state = tx.update(grads, state, params,
    ...                            max_logits={"attn": jnp.array([400.0, 50.0])})
    >>> optax.apply_updates(params, updates)["q"][0].tolist()   # head 0 by sqrt(100 / 400)
    [0.5, 0.5, 1.0, 1.0]
  """
  _common.check("tau", tau, lambda v: v > 0 and np.isfinite(v), "use a finite number > 0")
  if (num_heads is not None or num_kv_heads is not None or config is not None) \
      and layers is not None:
    raise ValueError("qk_clip num_heads, num_kv_heads and config are for layers=None (found "
                     "from the params); an AttentionLayer already states its heads")
  num_heads, num_kv_heads = resolve_head_counts(num_heads, num_kv_heads, config, "qk_clip")
  if not (layers is None or callable(layers) or isinstance(layers, (list, tuple))):
    raise ValueError(f"qk_clip layers={layers!r} is invalid: pass a list of AttentionLayer, a "
                     "function params -> list of AttentionLayer, or None")
  resolved: dict[Any, tuple[AttentionLayer, ...]] = {}

  def find_layers(params: optax.Params) -> tuple[AttentionLayer, ...]:
    structure = jax.tree.structure(params)
    if structure not in resolved:
      resolved[structure] = _attention_layers(params, layers, num_heads, num_kv_heads)
    return resolved[structure]

  def init_fn(params: optax.Params) -> QKClipState:
    _check_layers(params, find_layers(params))
    return QKClipState(heads_clipped=jnp.zeros([], jnp.int32),
                       max_logit=jnp.full([], -jnp.inf, jnp.float32),
                       total_clipped=jnp.zeros([], jnp.int32))

  def update_fn(updates: optax.Updates, state: optax.OptState,
                params: Optional[optax.Params] = None, **extra_args: Any
                ) -> tuple[optax.Updates, optax.OptState]:
    max_logits: Optional[Mapping[str, Any]] = extra_args.get("max_logits")
    if params is None:
      raise ValueError("qk_clip needs params: call tx.update(updates, state, params, "
                       "max_logits=...)")
    if max_logits is None:
      raise ValueError("qk_clip needs the per-head max logits of the step: pass max_logits="
                       "{layer name: [*stack, heads]} to tx.update (see "
                       "stablejax.collect_attention_logits)")
    found = find_layers(params)
    flat_p, treedef = jax.tree_util.tree_flatten_with_path(params)
    flat_u = jax.tree_util.tree_leaves(updates)
    if len(flat_u) != len(flat_p):
      raise ValueError("qk_clip: updates and params have different tree structures")
    params_flat = [p for _, p in flat_p]
    factors, clipped, peaks = _weight_factors(found, max_logits, _common.f32(tau),
                                              [_leaf_name(path) for path, _ in flat_p],
                                              params_flat)
    new_u = [_rescaled_update(u, p, factors[i]) if i in factors else u
             for i, (u, p) in enumerate(zip(flat_u, params_flat))]
    assert isinstance(state, QKClipState)
    return jax.tree_util.tree_unflatten(treedef, new_u), _next_state(state, clipped, peaks)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# ----------------------------------------------------------------------------- the rule's parts


def _leaf_name(path: Sequence[Any]) -> str:
  """``/``-joined keys, indices and attribute names (Equinox modules); the trailing attribute of
  an NNX ``Variable`` holding its array is dropped (``.../kernel`` holds the Variable)."""
  names = []
  for n, entry in enumerate(path):
    if isinstance(entry, jax.tree_util.GetAttrKey) and n == len(path) - 1 and n > 0 \
        and entry.name in ("value", "raw_value", "_raw_value"):
      continue
    names.append(key_name(entry))
  return "/".join(names)


def _head_factor(shape: tuple[int, ...], param: HeadParam, stack_ndim: int, per_head: jax.Array,
                 layer: str = "") -> jax.Array:
  """``per_head`` (``[*stack, n]``) laid out to broadcast against a parameter of ``shape``."""
  ndim = len(shape)
  axis = param.head_axis % ndim if -ndim <= param.head_axis < ndim else None
  if axis is None or axis < stack_ndim:
    raise ValueError(f"qk_clip: {param.path} of layer {layer!r} has shape {shape}; head_axis="
                     f"{param.head_axis} must name one of its non-stacked axes")
  n, size = per_head.shape[-1], shape[axis]
  if tuple(per_head.shape[:-1]) != tuple(shape[:stack_ndim]):
    raise ValueError(f"qk_clip: max_logits[{layer!r}] has shape {tuple(per_head.shape[:-1])} + "
                     f"(heads,) but {param.path} stacks {tuple(shape[:stack_ndim])} layers")
  start, width = param.span if param.span is not None else (0, size)
  if start < 0 or width < 1 or start + width > size:
    raise ValueError(f"qk_clip: span {param.span} of {param.path} lies outside its axis "
                     f"{param.head_axis} of size {size}")
  if width == n:
    factor = per_head
  elif width % n == 0:
    factor = jnp.repeat(per_head, width // n, axis=-1)     # [H * hd], head-major
  else:
    raise ValueError(f"qk_clip: axis {param.head_axis} of {param.path} has size {width}, neither "
                     f"{n} heads nor a multiple of them")
  if width != size:  # the other projections of a fused kernel keep a factor of 1
    ones = jnp.ones(factor.shape[:-1], factor.dtype)[..., None]
    factor = jnp.concatenate([jnp.repeat(ones, start, axis=-1), factor,
                              jnp.repeat(ones, size - start - width, axis=-1)], axis=-1)
  factor = factor.reshape(tuple(shape[:stack_ndim]) + (1,) * (axis - stack_ndim) + (size,)
                          + (1,) * (ndim - axis - 1))
  if param.select is not None:
    sel_axis, index = param.select
    sel_axis %= ndim
    hit = np.arange(shape[sel_axis]) == index
    hit = hit.reshape((1,) * sel_axis + (shape[sel_axis],) + (1,) * (ndim - sel_axis - 1))
    factor = jnp.where(jnp.asarray(hit), factor, jnp.float32(1.0))
  return factor


def _attention_layers(params: optax.Params, layers: LayersArg, num_heads: Optional[int],
                      num_kv_heads: Optional[int]) -> tuple[AttentionLayer, ...]:
  """The attention layers of ``params``: ``layers`` as given, called on ``params``, or found in
  them (``layers=None``)."""
  if layers is None:
    try:
      listed: Sequence[AttentionLayer] = find_attention_layers(
          params, num_heads=num_heads, num_kv_heads=num_kv_heads)
    except (ValueError, LookupError) as e:
      raise type(e)(f"qk_clip: {e}") from None
  elif callable(layers):
    listed = layers(params)
  else:
    listed = layers
  found = tuple(listed)
  for layer in found:
    if not isinstance(layer, AttentionLayer):
      raise ValueError(f"qk_clip layers must be AttentionLayer objects, got {layer!r}")
  if not found:
    raise ValueError("qk_clip found no attention layer in the parameters: pass layers= "
                     "(a list of stablejax.layout.heads.AttentionLayer)")
  return found


def _check_layers(params: optax.Params, layers: Sequence[AttentionLayer]) -> None:
  """Every named parameter exists and its head axis fits the layer's head count."""
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  shapes = {_leaf_name(path): tuple(np.shape(leaf)) for path, leaf in flat}
  for layer in layers:
    heads = {"query": layer.num_heads, "key": layer.num_kv_heads}
    for role, params_of in (("query", layer.query), ("key", layer.key)):
      for param in params_of:
        shape = shapes[_param_name(param, layer, shapes)]
        probe = jax.ShapeDtypeStruct(tuple(shape[:layer.stack_ndim]) + (heads[role],),
                                     jnp.float32)
        jax.eval_shape(functools.partial(_head_factor, shape, param, layer.stack_ndim,
                                         layer=layer.name), probe)


def _param_name(param: HeadParam, layer: AttentionLayer, names: Mapping[str, Any]) -> str:
  """``param``'s path, which must be one of ``names`` (the parameters')."""
  if param.path not in names:
    raise ValueError(f"qk_clip: attention layer {layer.name!r} names {param.path!r}, "
                     f"which is not a parameter (parameters look like "
                     f"{next(iter(names), '')!r})")
  return param.path


def _layer_logits(layer: AttentionLayer, max_logits: Mapping[str, Any]) -> jax.Array:
  """The layer's per-head maximum logits of the step, float32 ``[*stack, num_heads]``."""
  if layer.name not in max_logits:
    raise ValueError(f"qk_clip: max_logits has no entry for attention layer {layer.name!r} "
                     f"(it has {sorted(max_logits)})")
  logits = _common.f32(max_logits[layer.name])
  if logits.ndim != layer.stack_ndim + 1 or logits.shape[-1] != layer.num_heads:
    raise ValueError(f"qk_clip: max_logits[{layer.name!r}] has shape {logits.shape}; expected"
                     f" {layer.stack_ndim} stacked axes and {layer.num_heads} heads")
  return logits


def _query_key_factors(layer: AttentionLayer, logits: jax.Array, tau32: jax.Array
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The factors of the layer's query heads and key heads, and how many query heads exceed
  ``tau``: ``gamma = tau / S_h`` for a head over ``tau`` (1 for the others, and for a non-finite
  ``S_h``), split as ``sqrt(gamma)`` between W_q and W_k, or all of it on the query head where
  key heads are shared."""
  over = jnp.logical_and(jnp.isfinite(logits), logits > tau32)
  gamma = jnp.where(over, tau32 / jnp.where(over, logits, 1.0), 1.0)
  if layer.num_kv_heads == layer.num_heads:
    query_factor = key_factor = jnp.sqrt(gamma)
  else:  # shared key heads: untouched; the query head takes the whole factor
    query_factor = gamma
    key_factor = jnp.ones(gamma.shape[:-1] + (layer.num_kv_heads,), jnp.float32)
  return query_factor, key_factor, jnp.sum(over, dtype=jnp.int32)


def _weight_factors(layers: Sequence[AttentionLayer], max_logits: Mapping[str, Any],
                    tau32: jax.Array, names: Sequence[str], params: Sequence[Any]
                    ) -> tuple[dict[int, jax.Array], list[jax.Array], list[jax.Array]]:
  """{leaf index: factor} for every query and key parameter of ``layers`` (the leaves named
  ``names``, with values ``params``), broadcast to its shape; and per layer the heads clipped
  and the largest logit."""
  index = {name: i for i, name in enumerate(names)}
  factors: dict[int, jax.Array] = {}
  clipped, peaks = [], []
  for layer in layers:
    logits = _layer_logits(layer, max_logits)
    query_factor, key_factor, over = _query_key_factors(layer, logits, tau32)
    clipped.append(over)
    peaks.append(jnp.max(logits))
    for params_of, per_head in ((layer.query, query_factor), (layer.key, key_factor)):
      for param in params_of:
        i = index[_param_name(param, layer, index)]
        f = _head_factor(tuple(np.shape(params[i])), param, layer.stack_ndim, per_head,
                         layer.name)
        factors[i] = f if i not in factors else factors[i] * f
  return factors, clipped, peaks


def _rescaled_update(u: Any, p: Any, f: jax.Array) -> jax.Array:
  """The update that, applied to ``p``, leaves the updated weight multiplied by ``f``:
  ``(p + u') = (p + u) * f``."""
  return (_common.f32(u) * f + _common.f32(p) * (f - 1.0)).astype(jnp.asarray(u).dtype)


def _next_state(state: QKClipState, clipped: Sequence[jax.Array], peaks: Sequence[jax.Array]
                ) -> QKClipState:
  heads = jnp.sum(jnp.stack(clipped))
  room = jnp.iinfo(jnp.int32).max - state.total_clipped  # saturate instead of overflowing
  return QKClipState(
      heads_clipped=heads, max_logit=jnp.max(jnp.stack(peaks)),
      total_clipped=jnp.where(heads > room, jnp.iinfo(jnp.int32).max,
                              state.total_clipped + heads))


def _qk_clip_metrics(state: QKClipState) -> dict[str, jax.Array]:
  return {"heads_clipped": state.heads_clipped, "max_logit": state.max_logit,
          "total_clipped": state.total_clipped}


register_state_metrics(
    QKClipState, "qk_clip", _qk_clip_metrics,
    series=(Series("max_logit", "QK-clip: step max (before clipping)", "attention", ":"),),
    order=40)


# ----------------------------------------------------------------------------- the declaration


@dataclasses.dataclass
class QKClipConfig:
  """``stability.qk_clip``: QK-clip (Kimi K2) on the final update, last in the chain and inside
  the skip wrappers (a skipped step clips nothing); the train step computes each head's max
  logit in its own forward pass only when it is on. ``tau`` 30 is the trainer's default: at this
  project's scale healthy heads exceed Kimi's 100 and tau 30 flattened the learning-rate
  sensitivity most (README); the library's :func:`qk_clip` keeps Kimi's 100."""

  enabled: bool = False
  tau: float = 30.0

  def validate(self, where: str, ctx: defence.DefenceContext) -> None:
    defence.check_positive(f"{where}.tau", self.tau)
    if not self.enabled or ctx.model is None:
      return
    needed_by = f"QK-clip ({where}.enabled=true)"
    ctx.model.require("attention logits", needed_by)
    ctx.model.require("attention layout", needed_by)
    if ctx.model.attention_heads().qk_norm:
      raise ValueError(f"{where}.enabled=true with model.qk_norm=true: QK-norm removes the scale "
                       "of W_q and W_k from the logits, so QK-clip would shrink them every step "
                       f"without lowering a logit; set {where}.enabled=false (QK-norm already "
                       "bounds the logits) or model.qk_norm=false")


def _build(c: QKClipConfig, ctx: defence.DefenceContext) -> optax.GradientTransformationExtraArgs:
  heads = ctx.model.attention_heads() if ctx.model is not None else None
  return qk_clip(tau=c.tau, num_heads=heads.num_heads if heads else None,
                 num_kv_heads=heads.num_kv_heads if heads else None)


QK_CLIP = defence.Defence(
    name="qk_clip", config=QKClipConfig, position=defence.Position.FINAL, order=10,
    build=_build, step_args=("max_logits",),
    label="QK-clip (per-head rescale of W_q, W_k above tau)")
