"""Per-head maximum attention logits from models you cannot edit.

:func:`stablejax.sow_attention_logits` needs an ``attention_fn`` hook. Hugging Face's Flax models
call ``flax.linen.dot_product_attention_weights`` themselves, and ``output_attentions`` returns
probabilities, from which the maximum logit cannot be recovered (the softmax removes each row's
scale). What every Linen model offers without an edit is Flax's ``capture_intermediates``: the
output of every submodule's ``__call__``. An :class:`AttentionProbe` names the submodule of each
attention layer whose output holds the queries and the keys (after RoPE: Llama's ``rotary_emb``
returns ``(key, query)``; GPT-2's fused ``c_attn`` holds ``[q | k | v]``), captures only those,
and computes :func:`stablejax.attention_logit_max` with the model's own logit scale (GPT-Neo
does not divide by ``sqrt(head_dim)``). :func:`hf_attention_probe` knows the Hugging Face
families; the layer names are the module paths, as :func:`stablejax.qk_clip` keys them.

Equinox has no intermediates: :func:`mha_with_max_logit` calls an ``eqx.nn.MultiheadAttention``
through its ``process_heads`` hook and returns the output with the per-head maximum logit, for a
block to return next to its output (``jax.lax.scan`` over stacked blocks stacks them).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from stablejax.layout.analysis import value_of
from stablejax.modeling.attention import attention_logit_max

_CALL = "__call__"


@dataclasses.dataclass(frozen=True)
class AttentionProbe:
  """Where each attention layer's queries and keys are among a Linen model's intermediates.

  Every module named ``query`` (and ``key``) whose parent is an attention layer is captured; the
  parent's path is the layer's name. Its output (or entry ``query_index`` of an output tuple,
  then the range ``query_part`` of its last axis) is the queries, ``[batch..., T, H * hd]`` or
  ``[batch..., T, H, hd]``.

  Attributes:
    query: the name of the submodule whose output holds the queries (``"q_proj"``,
      ``"rotary_emb"``, ``"c_attn"``).
    key: likewise for the keys.
    num_heads: query heads ``H``.
    num_kv_heads: key heads ``K`` (``H`` for multi-head attention).
    head_dim: the size of each head.
    scale: the model's factor on ``q.k`` (``1 / sqrt(head_dim)`` for most; 1 for GPT-Neo).
    query_index: the entry of a tuple output that is the queries (Llama's ``rotary_emb``
      returns ``(key, query)``: 1), or None.
    key_index: likewise for the keys.
    query_part: ``(start, size)`` of the last axis that is the queries (a fused ``[q | k | v]``
      output), or None for all of it.
    key_part: likewise for the keys.
    is_causal: leave out key positions after the query position.

  Example:
    >>> import flax.linen as nn, jax, jax.numpy as jnp, stablejax
    >>> class Attn(nn.Module):   # a hand-written layer with no attention_fn hook
    ...   @nn.compact
    ...   def __call__(self, x):
    ...     q, k = nn.Dense(8, name="q_proj")(x), nn.Dense(8, name="k_proj")(x)
    ...     return nn.Dense(8, name="o_proj")(q * k)
    >>> probe = stablejax.AttentionProbe("q_proj", "k_proj", num_heads=2, num_kv_heads=2,
    ...                                  head_dim=4, scale=0.5)
    >>> x = jnp.ones((1, 3, 8))
    >>> variables = Attn().init(jax.random.key(0), x)
    >>> y, max_logits = probe.apply(Attn(), variables, x)
    >>> {name: v.shape for name, v in max_logits.items()}
    {'': (2,)}
  """
  query: str
  key: str
  num_heads: int
  num_kv_heads: int
  head_dim: int
  scale: float
  query_index: Optional[int] = None
  key_index: Optional[int] = None
  query_part: Optional[tuple[int, int]] = None
  key_part: Optional[tuple[int, int]] = None
  is_causal: bool = True

  def __post_init__(self) -> None:
    if self.num_heads < 1 or self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
      raise ValueError(f"AttentionProbe: num_heads={self.num_heads} must be a positive multiple "
                       f"of num_kv_heads={self.num_kv_heads}")
    if self.head_dim < 1 or not math.isfinite(self.scale) or self.scale <= 0:
      raise ValueError(f"AttentionProbe: head_dim={self.head_dim} must be >= 1 and scale="
                       f"{self.scale} a finite number > 0")

  def filter(self, module: Any, method_name: str) -> bool:
    """``capture_intermediates=`` filter: the ``__call__`` of the query and key modules only."""
    return method_name == _CALL and getattr(module, "name", None) in (self.query, self.key)

  def _heads(self, out: Any, index: Optional[int], part: Optional[tuple[int, int]],
             heads: int, what: str, layer: str) -> jax.Array:
    if index is not None:
      out = out[index]
    x = jnp.asarray(out)
    if part is not None:
      x = x[..., part[0]:part[0] + part[1]]
    if x.ndim >= 3 and x.shape[-2:] == (heads, self.head_dim):
      return x
    if x.ndim >= 2 and x.shape[-1] == heads * self.head_dim:
      return x.reshape(x.shape[:-1] + (heads, self.head_dim))
    raise ValueError(f"AttentionProbe: the {what} of layer {layer!r} have shape {x.shape}, not "
                     f"[..., T, {heads} * {self.head_dim}] or [..., T, {heads}, {self.head_dim}]; "
                     "check num_heads, num_kv_heads, head_dim and the index/part arguments")

  def max_logits(self, intermediates: Any, attention_mask: Optional[jax.Array] = None,
                 mask: Optional[jax.Array] = None) -> dict[str, jax.Array]:
    """Each layer's float32 per-head maximum logit ``[H]`` from captured intermediates.

    Args:
      intermediates: what Linen's ``apply(..., capture_intermediates=probe.filter,
        mutable=["intermediates"])`` returned (the whole mutable dict or its
        ``"intermediates"``), or, for a Flax NNX model, the state that
        ``nnx.capture(forward, nnx.Intermediate, method_outputs=nnx.Intermediate)`` returns
        next to the output (every method's output, ``__call__`` among them).
      attention_mask: optional ``[batch, S]`` padding mask (1 or True: a real token), as
        Hugging Face models take it.
      mask: optional boolean mask broadcastable to ``[batch, H, T, S]``.

    Returns:
      ``{layer path: float32 [H]}``, the layout :func:`stablejax.qk_clip` takes.
    """
    tree = intermediates.get("intermediates", intermediates) if hasattr(
        intermediates, "get") else intermediates
    found: dict[tuple, dict[str, Any]] = {}

    def walk(node: Any, path: tuple) -> None:
      if not hasattr(node, "items"):
        return
      for name, child in node.items():
        if name == _CALL and path and path[-1] in (self.query, self.key):
          found.setdefault(path[:-1], {})[path[-1]] = value_of(child)  # NNX: an Intermediate
        else:
          walk(child, path + (str(name),))
    walk(tree, ())
    keep = mask
    if attention_mask is not None:
      pad = jnp.asarray(attention_mask).astype(bool)[..., None, None, :]
      keep = pad if keep is None else jnp.logical_and(keep, pad)
    out: dict[str, jax.Array] = {}
    for parent, calls in sorted(found.items()):
      name = "/".join(parent)
      if self.query not in calls or self.key not in calls:
        continue
      per_call = []
      for q_out, k_out in zip(calls[self.query], calls[self.key]):
        q = self._heads(q_out, self.query_index, self.query_part, self.num_heads, "queries", name)
        k = self._heads(k_out, self.key_index, self.key_part, self.num_kv_heads, "keys", name)
        per_call.append(attention_logit_max(q, k, mask=keep, is_causal=self.is_causal,
                                            scale=self.scale))
      out[name] = jnp.max(jnp.stack(per_call), axis=0)
    if not out:
      raise ValueError(f"AttentionProbe: no module named {self.query!r} with a sibling "
                       f"{self.key!r} among the intermediates; apply the model with "
                       "capture_intermediates=probe.filter, mutable=['intermediates']")
    return out

  def apply(self, module: Any, variables: Any, *args: Any, attention_mask: Optional[jax.Array]
            = None, **kwargs: Any) -> tuple[Any, dict[str, jax.Array]]:
    """``module.apply(variables, *args, **kwargs)`` and the max logits of that forward pass.

    Args:
      module: a Linen module (a Hugging Face Flax model's ``model.module``).
      variables: ``{"params": params}``.
      *args: the module's positional arguments.
      attention_mask: a ``[batch, S]`` padding mask for the logits (not passed to the module:
        give the module its own in ``args`` / ``kwargs``).
      **kwargs: the module's keyword arguments.

    Returns:
      ``(output, {layer path: float32 [H]})``.
    """
    output, state = module.apply(variables, *args, capture_intermediates=self.filter,
                                 mutable=["intermediates"], **kwargs)
    return output, self.max_logits(state, attention_mask=attention_mask)


def _config_get(config: Any, *names: str) -> Any:
  for name in names:
    value = getattr(config, name, None)
    if value is not None:
      return value
  return None


HF_FAMILIES = ("gpt2", "gpt_neo", "llama", "mistral", "gemma")


def hf_attention_probe(config: Any) -> AttentionProbe:
  """The :class:`AttentionProbe` of a Hugging Face Flax model, from its config.

  ============  ===================================  =========================================
  family        queries and keys captured from        logit scale
  ============  ===================================  =========================================
  ``gpt2``      ``c_attn`` (fused ``[q | k | v]``)   ``1 / sqrt(head_dim)``
  ``gpt_neo``   ``q_proj``, ``k_proj``               1 (GPT-Neo does not scale its logits)
  ``llama``,    ``rotary_emb`` (``(key, query)``     ``1 / sqrt(head_dim)``
  ``mistral``,  after RoPE)
  ``gemma``
  ============  ===================================  =========================================

  GPT-Neo's local-attention layers see a window of keys; the probe takes every causal key, so
  its maximum can exceed the one the layer's softmax saw (never fall below it). Mistral's sliding
  window likewise.

  Args:
    config: ``model.config`` (a ``transformers.PretrainedConfig``).

  Returns:
    The probe; ``probe.apply(model.module, {"params": params}, input_ids, attention_mask,
    position_ids)`` returns the logits of the model and ``{layer path: [H]}``.

  Raises:
    ValueError: a family not in the table (build an :class:`AttentionProbe` by hand).

  Example:
    >>> import types, stablejax
    >>> config = types.SimpleNamespace(model_type="llama", hidden_size=64,   # model.config
    ...                                num_attention_heads=8, num_key_value_heads=2)
    >>> probe = stablejax.hf_attention_probe(config)
    >>> probe.query, probe.query_index, probe.num_kv_heads, probe.scale
    ('rotary_emb', 1, 2, 0.3535533905932738)
  """
  family = getattr(config, "model_type", None)
  heads = _config_get(config, "num_attention_heads", "n_head", "num_heads")
  width = _config_get(config, "hidden_size", "n_embd")
  if family not in HF_FAMILIES or heads is None or width is None:
    raise ValueError(f"hf_attention_probe: no recipe for model_type {family!r} (known: "
                     f"{', '.join(HF_FAMILIES)}); build stablejax.AttentionProbe(query=..., "
                     "key=..., ...) naming the submodules that output its queries and keys")
  kv_heads = _config_get(config, "num_key_value_heads") or heads
  head_dim = width // heads
  if family == "gpt2":
    return AttentionProbe("c_attn", "c_attn", heads, heads, head_dim, 1.0 / math.sqrt(head_dim),
                          query_part=(0, width), key_part=(width, width))
  if family == "gpt_neo":
    return AttentionProbe("q_proj", "k_proj", heads, heads, head_dim, 1.0)
  if family == "gemma":
    head_dim = _config_get(config, "head_dim") or head_dim
  return AttentionProbe("rotary_emb", "rotary_emb", heads, kv_heads, head_dim,
                        1.0 / math.sqrt(head_dim), query_index=1, key_index=0)


def mha_with_max_logit(mha: Any, query: jax.Array, key_: jax.Array, value: jax.Array,
                       mask: Optional[jax.Array] = None, *,
                       process_heads: Optional[Callable[..., Any]] = None, **kwargs: Any
                       ) -> tuple[jax.Array, jax.Array]:
  """An ``eqx.nn.MultiheadAttention`` call that also returns its per-head maximum logit.

  Calls ``mha(query, key_, value, mask, process_heads=..., **kwargs)`` with a ``process_heads``
  that runs yours (RoPE, say) and keeps the heads it returns, then computes
  :func:`stablejax.attention_logit_max` of those queries and keys with Equinox's scale
  ``1 / sqrt(head_dim)`` and ``mask``: one extra ``q.k`` product, no second projection.

  Args:
    mha: the ``eqx.nn.MultiheadAttention``.
    query: ``[T, D]`` (Equinox layers take one example; ``jax.vmap`` over a batch).
    key_: ``[S, D]``.
    value: ``[S, D]``.
    mask: optional boolean ``[T, S]`` (or ``[H, T, S]``), as ``mha`` takes it.
    process_heads: your ``process_heads`` for ``mha``, if any.
    **kwargs: the rest of ``mha``'s keyword arguments (``key=``, ``inference=``...).

  Returns:
    ``(output [T, D], max_logit float32 [H])``.

  Example:
    >>> import equinox as eqx, jax, jax.numpy as jnp, stablejax
    >>> mha = eqx.nn.MultiheadAttention(num_heads=2, query_size=8, key=jax.random.key(0))
    >>> x, causal = jnp.ones((3, 8)), jnp.tril(jnp.ones((3, 3), bool))
    >>> out, max_logit = stablejax.mha_with_max_logit(mha, x, x, x, causal)
    >>> out.shape, max_logit.shape
    ((3, 8), (2,))
  """
  captured: dict[str, jax.Array] = {}

  def keep(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    if process_heads is not None:
      q, k, v = process_heads(q, k, v)
    captured["query"], captured["key"] = q, k
    return q, k, v

  out = mha(query, key_, value, mask, process_heads=keep, **kwargs)
  return out, attention_logit_max(captured["query"], captured["key"], mask=mask)
