"""Attention-logit telemetry: the maximum pre-softmax logit of each attention head.

Attention-logit growth is the first small-scale proxy of large-scale training instability that
Wortsman et al. name ("Small-scale proxies for large-scale Transformer training instabilities",
arXiv 2309.14322, section 3.1.1): without QK-norm the logits ``q.k / sqrt(head_dim)`` of some
heads grow without bound, the attention entropy collapses and the loss degrades; in their runs
every model whose logits passed about 1e4 diverged. Kimi K2's QK-clip (arXiv 2507.20534,
:func:`stablejax.qk_clip`) reads the same number, per head, to rescale the query and key weights.

Everything here measures ``max over batch, query and key positions of q.k / sqrt(head_dim)`` per
query head, in float32, over the positions the mask keeps (an additive bias such as ALiBi is not
part of ``q.k`` and not included):

* :func:`attention_logit_max`: the number itself, from queries and keys (any model).
* :func:`sow_attention_logits`: wraps an ``attention_fn`` of Flax's
  ``nn.MultiHeadDotProductAttention`` or ``nnx.MultiHeadAttention`` so that it sows that number
  into the intermediates (when the layer is called with ``sow_weights=True``).
* :func:`collect_attention_logits`: reads every sown value back as ``{layer name: [*stack, H]}``,
  the layout :func:`stablejax.qk_clip` takes (the layer name is the module path, as in
  :class:`stablejax.layout.heads.AttentionLayer`).

The trainer's GPT sows the same intermediate (``GPT(..., attention_logits=True)``).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import warnings
from typing import Any, Callable, Literal, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

MAX_LOGIT = "max_logit"
"""Name of the sown intermediate: a layer's per-head maximum pre-softmax logit (float32 ``[H]``)."""


@dataclasses.dataclass(frozen=True)
class AttentionPattern:
  """Which key positions each query position attends to: the causal ones, within the last
  ``window`` positions (the query's own included) when a window is set, and of those the ones
  ``mask`` keeps when a mask function is set.

  One pattern serves every path of a model's attention (training, the max-logit path, the KV
  cache), so a family changes its attention by passing another pattern: Mistral's sliding window
  is ``AttentionPattern(window=4096)``. Frozen and hashable, so a Linen module can hold it.

  Attributes:
    window: keys at most ``window - 1`` positions before the query; None: every earlier key.
    mask: ``(query_positions [T, 1], key_positions [1, S]) -> bool [T, S]`` (int32 positions,
      absolute: a decoding call's queries start at the cache's index), True where a key is kept;
      None: no mask beyond causality and the window.

  Example:
    >>> import numpy as np
    >>> pattern = AttentionPattern(window=2)
    >>> pattern.keep(np.arange(3)[:, None], np.arange(3)[None, :]).astype(int).tolist()
    [[1, 0, 0], [1, 1, 0], [0, 1, 1]]
  """

  window: Optional[int] = None
  mask: Optional[Callable[[jax.Array, jax.Array], jax.Array]] = None

  def __post_init__(self) -> None:
    if self.window is not None and (isinstance(self.window, bool) or self.window < 1):
      raise ValueError(f"an attention window of {self.window!r} positions keeps no key: give a "
                       "positive number of positions, or None for full causal attention")

  def keep(self, query_positions: Any, key_positions: Any) -> jax.Array:
    """Boolean ``[T, S]``: True where the query at ``query_positions [T, 1]`` attends to the key
    at ``key_positions [1, S]``."""
    kept = key_positions <= query_positions
    if self.window is not None:
      kept = jnp.logical_and(kept, key_positions > query_positions - self.window)
    if self.mask is not None:
      kept = jnp.logical_and(kept, self.mask(query_positions, key_positions))
    return jnp.asarray(kept)

  def square(self, length: int) -> jax.Array:
    """The ``[T, T]`` mask of a training call over positions ``0 .. length - 1``."""
    positions = np.arange(length, dtype=np.int32)
    return self.keep(positions[:, None], positions[None, :])


CAUSAL = AttentionPattern()
"""Every earlier key position and the query's own: the built-in families' default pattern."""


def _grouped_logits(query: jax.Array, key: jax.Array, scale: Optional[float] = None
                    ) -> jax.Array:
  """float32 ``scale * q.k`` (``1 / sqrt(d)`` by default) of shape ``[batch..., H, T, S]``; key
  heads shared by groups."""
  h, kh, depth = query.shape[-2], key.shape[-2], query.shape[-1]
  if h % kh:
    raise ValueError(f"query heads {h} are not a multiple of key heads {kh}: grouped-query "
                     "attention needs H = G * K")
  g = h // kh
  q = query.reshape(query.shape[:-2] + (kh, g, depth))
  logits = jnp.einsum("...tkgd,...skd->...kgts", q, key, preferred_element_type=jnp.float32)
  logits = logits.reshape(logits.shape[:-4] + (h,) + logits.shape[-2:])
  return logits.astype(jnp.float32) * jnp.float32(1.0 / math.sqrt(depth) if scale is None
                                                  else scale)


def _per_head_max(logits: jax.Array, keep: Optional[jax.Array]) -> jax.Array:
  """Max over every axis but the head axis (-3) of the kept entries; -inf if none is kept."""
  if keep is not None:
    logits = jnp.where(keep, logits, -jnp.inf)
  moved = jnp.moveaxis(logits, -3, 0)
  return jax.lax.stop_gradient(jnp.max(moved.reshape(moved.shape[0], -1), axis=1))


def attention_logit_max(query: jax.Array, key: jax.Array, *, mask: Optional[jax.Array] = None,
                        is_causal: bool = False, scale: Optional[float] = None) -> jax.Array:
  """Per-head maximum pre-softmax attention logit ``max q.k / sqrt(head_dim)``.

  The maximum runs over the batch, the query positions and the key positions that ``mask`` and
  ``is_causal`` keep; it is computed in float32 and carries no gradient. Grouped-query and
  multi-query attention (fewer key heads than query heads) are supported: query head ``h``
  attends with key head ``h // (H // K)``.

  Args:
    query: ``[batch..., T, H, head_dim]`` queries (after RoPE, if the model uses it).
    key: ``[batch..., S, K, head_dim]`` keys, ``K`` dividing ``H``.
    mask: optional boolean mask broadcastable to ``[batch..., H, T, S]``; False entries are left
      out (as ``flax.linen.dot_product_attention`` masks them).
    is_causal: also leave out key positions after the query position (``T == S``).
    scale: the model's factor on ``q.k``; None: ``1 / sqrt(head_dim)``. A model that scales
      differently (GPT-Neo: 1; a query pre-scaled by the model) passes its own.

  Returns:
    float32 ``[H]``: each query head's maximum logit (``-inf`` for a head whose every entry is
    masked).

  References:
    Wortsman et al., `Small-scale proxies for large-scale Transformer training instabilities
    <https://arxiv.org/abs/2309.14322>`_ (arXiv 2309.14322), section 3.1.1; Kimi Team, `Kimi K2
    <https://arxiv.org/abs/2507.20534>`_ (arXiv 2507.20534), section 2.1 (``S_max`` per head).

  Example:
    >>> import jax.numpy as jnp
    >>> import stablejax
    >>> q = jnp.zeros((1, 2, 2, 4)).at[0, 1, 0].set(2.0)   # [B, T, H, head_dim]
    >>> k = jnp.ones((1, 2, 2, 4))
    >>> stablejax.attention_logit_max(q, k, is_causal=True).tolist()   # 2 * 4 / sqrt(4) = 4
    [4.0, 0.0]
  """
  query, key = jnp.asarray(query), jnp.asarray(key)
  if query.ndim < 3 or query.ndim != key.ndim or query.shape[-1] != key.shape[-1]:
    raise ValueError(f"query {query.shape} and key {key.shape} must be [batch..., length, heads, "
                     "head_dim] with the same rank and head_dim")
  logits = _grouped_logits(query, key, scale)
  keep = None
  if mask is not None:
    keep = jnp.asarray(mask, bool)
  if is_causal:
    t, s = logits.shape[-2:]
    causal = jnp.asarray(np.tril(np.ones((t, s), bool), k=s - t))
    keep = causal if keep is None else jnp.logical_and(keep, causal)
  return _per_head_max(logits, keep)


def causal_attention_with_max_logit(query: jax.Array, key: jax.Array, value: jax.Array,
                                    pattern: AttentionPattern = CAUSAL
                                    ) -> tuple[jax.Array, jax.Array]:
  """Causal attention and its per-head maximum logit from the same logits.

  The computation is that of ``jax.nn.dot_product_attention(..., is_causal=True)``'s XLA
  implementation (float32 logits, float32 softmax, probabilities cast to the key dtype); the
  maximum is read from the logits the softmax uses, so it costs one reduction, no second
  ``q.k`` product.

  Args:
    query: ``[B, T, H, head_dim]``.
    key: ``[B, T, K, head_dim]``, ``K`` dividing ``H`` (grouped-query attention: query head
      ``h`` attends with key and value head ``h // (H // K)``).
    value: ``[B, T, K, head_dim]``.
    pattern: the keys each query attends to (:class:`AttentionPattern`); the maximum runs over
      those only.

  Returns:
    ``(out [B, T, H, head_dim] in value's dtype, max_logit float32 [H])``.
  """
  logits = _grouped_logits(query, key)                       # [B, H, T, T]
  b, h, t, _ = logits.shape
  kh = key.shape[-2]
  kept = pattern.square(t)
  max_logit = _per_head_max(logits, kept)
  masked = jnp.where(kept, logits, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(masked, axis=-1).astype(key.dtype)
  grouped = probs.reshape(b, kh, h // kh, t, t)
  out = jnp.einsum("bkgts,bskd->btkgd", grouped, value).reshape(b, t, h, value.shape[-1])
  return out, max_logit


# cuDNN's fused (flash) attention takes half-precision inputs only.
_CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
_warned_cudnn: list = []


def attention_implementation(platform: str, dtype: Any) -> Optional[Literal["cudnn"]]:
  """The ``implementation=`` :func:`causal_attention` passes to ``jax.nn.dot_product_attention``.

  ``"cudnn"`` (cuDNN's fused attention) on a CUDA GPU for bfloat16 and float16 inputs, the only
  dtypes it takes; None elsewhere, which is JAX's XLA implementation (the same arithmetic as
  :func:`causal_attention_with_max_logit`: float32 logits and softmax).

  Args:
    platform: ``"cuda"``, ``"rocm"``, ``"tpu"`` or ``"cpu"`` (:func:`device_platform`).
    dtype: the dtype of the queries, keys and values.

  Returns:
    ``"cudnn"`` or None.

  Example:
    >>> import jax.numpy as jnp
    >>> attention_implementation("cuda", jnp.bfloat16)
    'cudnn'
    >>> attention_implementation("cuda", jnp.float32) is None
    True
    >>> attention_implementation("cpu", jnp.bfloat16) is None
    True
  """
  if platform == "cuda" and any(jnp.dtype(dtype) == jnp.dtype(d) for d in _CUDNN_DTYPES):
    return "cudnn"
  return None


def device_platform() -> str:
  """``"cuda"``, ``"rocm"``, ``"tpu"`` or ``"cpu"``: the platform of the default device (JAX calls
  both GPU kinds ``"gpu"``)."""
  dev = jax.devices()[0]
  if dev.platform != "gpu":
    return dev.platform
  version = str(getattr(dev.client, "platform_version", "")).lower()
  return "rocm" if "rocm" in version else "cuda"


def causal_attention(query: jax.Array, key: jax.Array, value: jax.Array,
                     pattern: AttentionPattern = CAUSAL) -> jax.Array:
  """Causal ``jax.nn.dot_product_attention`` with the implementation of
  :func:`attention_implementation` for this device and dtype.

  Where cuDNN refuses the call (a head dimension or sequence length its fused attention does not
  take, a cuDNN too old), it says why once and the XLA implementation runs instead. A window is
  the fused attention's ``local_window_size``; a mask function an explicit ``mask``.

  Args:
    query: ``[B, T, H, head_dim]``.
    key: ``[B, T, K, head_dim]`` (``K`` divides ``H``).
    value: ``[B, T, K, head_dim]``.
    pattern: the keys each query attends to (:class:`AttentionPattern`).

  Returns:
    ``[B, T, H, head_dim]`` in the inputs' dtype.
  """
  kwargs: dict[str, Any] = {"is_causal": True}
  if pattern.mask is not None:
    kwargs = {"mask": pattern.square(query.shape[1])[None, None]}
  elif pattern.window is not None:
    kwargs["local_window_size"] = (pattern.window - 1, 0)
  implementation = attention_implementation(device_platform(), query.dtype)
  if implementation is not None:
    try:
      return jax.nn.dot_product_attention(query, key, value, implementation=implementation,
                                          **kwargs)
    except (NotImplementedError, RuntimeError, ValueError) as e:
      if not _warned_cudnn:
        _warned_cudnn.append(True)
        warnings.warn(f"cuDNN attention is not available for queries {query.shape} "
                      f"{query.dtype} ({type(e).__name__}: {str(e).splitlines()[0]}); the XLA "
                      "implementation runs instead", stacklevel=2)
  return jax.nn.dot_product_attention(query, key, value, **kwargs)


def sow_attention_logits(attention_fn: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
  """An ``attention_fn`` for Flax attention layers that also sows the per-head max logit.

  Pass it as ``attention_fn=`` to ``flax.linen.MultiHeadDotProductAttention`` (wrapping
  ``flax.linen.dot_product_attention``) or ``flax.nnx.MultiHeadAttention`` (wrapping
  ``flax.nnx.dot_product_attention``). Called with ``sow_weights=True``, the layer hands its
  module to the attention function; the wrapper then sows :func:`attention_logit_max` of the
  queries and keys (with the layer's mask, and ``is_causal`` for NNX) as ``"max_logit"`` into the
  intermediates (Linen: the ``"intermediates"`` collection; NNX: ``nnx.Intermediate``, collected
  by running the forward pass under ``nnx.capture(forward, nnx.Intermediate)``, the way Flax
  0.12 supports; outside it an NNX layer sows nothing and warns once) and calls
  ``attention_fn`` *without* the module, so the full attention weights are not stored. Without
  ``sow_weights`` it is ``attention_fn`` unchanged (no extra work). Read the values with
  :func:`collect_attention_logits`.

  Args:
    attention_fn: the attention function to wrap (e.g. ``nn.dot_product_attention``).

  Returns:
    An attention function with the signature the Flax layers call.

  Example:
    >>> import flax.linen as nn
    >>> import jax
    >>> import jax.numpy as jnp
    >>> import stablejax
    >>> layer = nn.MultiHeadDotProductAttention(
    ...     num_heads=2, qkv_features=8,
    ...     attention_fn=stablejax.sow_attention_logits(nn.dot_product_attention))
    >>> x = jnp.ones((1, 3, 8))
    >>> variables = layer.init(jax.random.key(0), x)
    >>> y, state = layer.apply(variables, x, sow_weights=True, mutable=["intermediates"])
    >>> {k: v.shape for k, v in stablejax.collect_attention_logits(state).items()}
    {'': (2,)}
  """
  if not callable(attention_fn):
    raise ValueError("attention_fn must be callable: pass e.g. flax.linen.dot_product_attention")
  params: Mapping[str, inspect.Parameter]
  try:
    params = inspect.signature(attention_fn).parameters
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
  except (TypeError, ValueError):
    params, takes_all = {}, True

  def wrapped(query: jax.Array, key: jax.Array, value: jax.Array,
              bias: Optional[jax.Array] = None, mask: Optional[jax.Array] = None,
              broadcast_dropout: bool = True, dropout_rng: Optional[jax.Array] = None,
              dropout_rate: float = 0.0, deterministic: bool = False, dtype: Any = None,
              precision: Any = None, module: Any = None, force_fp32_for_softmax: bool = False,
              qk_attn_weights_einsum: Optional[Callable[..., jax.Array]] = None,
              attn_weights_value_einsum: Optional[Callable[..., jax.Array]] = None,
              is_causal: bool = False) -> jax.Array:
    given = dict(bias=bias, mask=mask, broadcast_dropout=broadcast_dropout,
                 dropout_rng=dropout_rng, dropout_rate=dropout_rate, deterministic=deterministic,
                 dtype=dtype, precision=precision, force_fp32_for_softmax=force_fp32_for_softmax,
                 qk_attn_weights_einsum=qk_attn_weights_einsum,
                 attn_weights_value_einsum=attn_weights_value_einsum, is_causal=is_causal)
    defaults = inspect.signature(wrapped).parameters
    # Forward what the caller set (or the inner function understands), nothing it cannot take.
    kwargs = {k: v for k, v in given.items()
              if (takes_all or k in params) and (k in params or v is not defaults[k].default)}
    if module is not None:
      _sow(module, lambda: attention_logit_max(query, key, mask=mask, is_causal=is_causal))
    return attention_fn(query, key, value, **kwargs)

  return wrapped


_warned_outside_capture: list = []


def _sow(module: Any, value: Callable[[], jax.Array]) -> None:
  """Sows ``value()`` as ``"max_logit"``: Linen into ``"intermediates"``; NNX into
  ``nnx.Intermediate``, only inside ``nnx.capture`` (Flax 0.12 deprecates ``Module.sow`` outside
  it: a layer called outside sows nothing and says once how to collect the values)."""
  import flax.linen as nn
  if isinstance(module, nn.Module):
    module.sow("intermediates", MAX_LOGIT, value())
    return
  from flax import nnx
  if hasattr(module, "__captures__"):  # set by nnx.capture for the duration of the call
    module.sow(nnx.Intermediate, MAX_LOGIT, value())
  elif not _warned_outside_capture:
    _warned_outside_capture.append(True)
    warnings.warn("sow_attention_logits: an NNX layer called with sow_weights=True outside "
                  "nnx.capture sows nothing (Flax deprecates Module.sow there); run the forward "
                  "pass as nnx.capture(forward, nnx.Intermediate)(model, x) and pass the "
                  "intermediates it returns to collect_attention_logits", stacklevel=4)


def _key_name(entry: Any) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(entry, attr):
      return str(getattr(entry, attr))
  return str(entry)


def collect_attention_logits(intermediates: Any) -> dict[str, jax.Array]:
  """Every sown per-head max logit, keyed by the ``/``-joined path of the layer that sowed it.

  Accepts Linen intermediates (the ``"intermediates"`` collection, or the whole mutable dict
  ``apply`` returned) and NNX state (what ``nnx.capture(forward, nnx.Intermediate)`` returns
  next to the output). A layer called several times in one apply gives
  the elementwise maximum of its calls. Under ``nn.scan`` / ``nnx.scan`` the stacked-layer axes
  come first: ``[*stack, H]``, the layout of :func:`stablejax.qk_clip`'s ``max_logits``.

  Args:
    intermediates: the tree holding the sown ``"max_logit"`` values.

  Returns:
    ``{layer path: float32 [*stack, H]}`` (a layer at the root has the path ``""``), in the
    order the tree lists them.

  Example:
    >>> import jax.numpy as jnp
    >>> import stablejax
    >>> sown = {"intermediates": {"blocks": {"attn": {"max_logit": (jnp.ones((4, 2)),)}}}}
    >>> {k: v.shape for k, v in stablejax.collect_attention_logits(sown).items()}
    {'blocks/attn': (4, 2)}
  """
  found: dict[str, jax.Array] = {}
  leaves = jax.tree_util.tree_flatten_with_path(intermediates)[0]
  for path, leaf in leaves:
    names = [_key_name(p) for p in path]
    if MAX_LOGIT not in names:
      continue
    where = names.index(MAX_LOGIT)
    module_path = [n for n in names[:where] if n != "intermediates"]
    name = "/".join(module_path)
    value = jnp.asarray(leaf, jnp.float32)
    found[name] = value if name not in found else jnp.maximum(found[name], value)
  return found
