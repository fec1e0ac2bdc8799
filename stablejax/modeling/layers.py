"""The layers the built-in model families share: a bias-free linear layer (optionally BitNet),
RMSNorm, rotary embeddings, self-attention (training, max-logit and KV-cache paths, with the
attention pattern as a parameter), SwiGLU, the token embedding, the stack of blocks (scanned or a
loop) and the output head (tied or untied).

Flax Linen modules and functions of arrays; :mod:`stablejax.modeling.gpt` and
:mod:`stablejax.modeling.llama` build their blocks and models from them (the functions that
create modules, :func:`token_embedding`, :func:`run_blocks` and :func:`head_logits`, are called
inside a model's ``@nn.compact`` ``__call__``, so Flax makes that model their parent and the
parameter names are the model's own), and a family that changes only the
attention pattern (a sliding window) passes another :class:`AttentionPattern`.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from stablejax.modeling.attention import (CAUSAL, MAX_LOGIT, AttentionPattern, causal_attention,
                                         causal_attention_with_max_logit)
from stablejax.modeling.bitnet import bitnet_matmul


DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def matmul_2d(x: jax.Array, kernel: jax.Array, **kwargs: Any) -> jax.Array:
  """``x [..., K] @ kernel [K, N]`` as one 2D product over the flattened leading axes.

  The same products as ``jnp.dot(x, kernel)``, but the weight gradient that autodiff derives is
  then a 2D product with one contracting axis. From a 3D ``x`` it contracts two (batch and
  position), which XLA:CPU lowers by writing the whole upstream gradient transposed inside the
  loop fusion of the elementwise backward; a Flax loop whose ``nn.Dense`` layers see flattened
  rows instead ran at 1.4x to 1.9x its tokens/s on a 2-core CPU (docs/results.md, "Peer speed").
  """
  lead = x.shape[:-1]
  y = jnp.dot(x.reshape(-1, x.shape[-1]), kernel, **kwargs)
  return y.reshape(lead + (kernel.shape[-1],))


class Linear(nn.Module):
  """A bias-free 2D linear layer; optionally BitNet-quantised, its output mixed by
  ``quantized_fraction``."""
  features: int
  compute_dtype: Any
  param_dtype: Any
  kernel_init: Any
  bitnet: bool = False

  @nn.compact
  def __call__(self, x: jax.Array, quantized_fraction: Optional[jax.Array] = None) -> jax.Array:
    kernel = self.param("kernel", self.kernel_init, (x.shape[-1], self.features), self.param_dtype)
    if self.bitnet:
      if quantized_fraction is None:
        raise ValueError("a BitNet Linear needs its quantized_fraction")
      y = bitnet_matmul(x.reshape(-1, x.shape[-1]), kernel, quantized_fraction, self.compute_dtype)
      return y.reshape(x.shape[:-1] + (self.features,))  # per-token quantisation: rows stay rows
    return matmul_2d(x.astype(self.compute_dtype), kernel.astype(self.compute_dtype))


class RMSNorm(nn.Module):
  """RMSNorm with a vector gain (``single_scale=False``) or one scalar gain (SSNorm)."""
  compute_dtype: Any
  param_dtype: Any
  single_scale: bool = False
  eps: float = 1e-6

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    shape = () if self.single_scale else (x.shape[-1],)
    scale = self.param("scale", nn.initializers.ones, shape, self.param_dtype)
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
    return (y * scale.astype(jnp.float32)).astype(self.compute_dtype)


def rope(x: jax.Array, theta: float, offset: Optional[jax.Array] = None) -> jax.Array:
  """Rotary position embedding (rotate-half form) on ``[B, T, H, hd]``; computed in float32.

  ``offset`` (a traced int32, decoding only) shifts the positions to ``offset .. offset + T - 1``;
  without it the angles are numpy constants, as in training.
  """
  t, hd = x.shape[1], x.shape[-1]
  inv_freq = 1.0 / (theta ** (np.arange(0, hd, 2, dtype=np.float32) / hd))
  if offset is None:
    angles = np.arange(t, dtype=np.float32)[:, None] * inv_freq[None, :]      # [T, hd/2]
    cos = jnp.asarray(np.cos(angles))[None, :, None, :]
    sin = jnp.asarray(np.sin(angles))[None, :, None, :]
  else:
    positions = (offset + jnp.arange(t, dtype=jnp.int32)).astype(jnp.float32)
    traced_angles = positions[:, None] * jnp.asarray(inv_freq)[None, :]
    cos = jnp.cos(traced_angles)[None, :, None, :]
    sin = jnp.sin(traced_angles)[None, :, None, :]
  x32 = x.astype(jnp.float32)
  x1, x2 = x32[..., : hd // 2], x32[..., hd // 2:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def f32_accum_dtype(dtype: Any) -> Any:
  """Input dtype for dots that accumulate in float32.

  XLA:CPU has no float16 x float16 -> float32 dot, so on CPU float16 inputs are upcast (fp16
  compute is meant for GPUs; on CPU it only exists for tests).
  """
  if dtype == jnp.float16 and jax.default_backend() == "cpu":
    return jnp.float32
  return dtype


def kv_cached_attention(module: nn.Module, q: jax.Array, k: jax.Array, v: jax.Array,
                        max_seq_len: int, rope_theta: float, dtype: Any,
                        pattern: AttentionPattern = CAUSAL) -> jax.Array:
  """Attention of one decoding call over a KV cache held in ``module``'s ``"cache"`` collection
  (``k``, ``v`` ``[B, max_seq_len, K, hd]`` and the next position ``index``).

  Rotates ``q`` and ``k`` to their positions ``index ..``, writes ``k`` and ``v`` there and
  attends over the cache, to the positions ``pattern`` keeps. ``k`` and ``v`` may have fewer
  heads than ``q`` (grouped-query attention: each key/value head serves ``H // K`` query heads).
  """
  b, t, kv_heads, hd = k.shape
  shape = (b, max_seq_len, kv_heads, hd)
  cached_k = module.variable("cache", "k", jnp.zeros, shape, dtype)
  cached_v = module.variable("cache", "v", jnp.zeros, shape, dtype)
  index = module.variable("cache", "index", lambda: jnp.zeros((), jnp.int32))
  pos = index.value
  q, k = rope(q, rope_theta, pos), rope(k, rope_theta, pos)
  keys = jax.lax.dynamic_update_slice(cached_k.value, k.astype(dtype), (0, pos, 0, 0))
  values = jax.lax.dynamic_update_slice(cached_v.value, v.astype(dtype), (0, pos, 0, 0))
  cached_k.value, cached_v.value, index.value = keys, values, pos + t
  # Query i sits at position pos + i; causality leaves out the later slots (stale or empty).
  mask = pattern.keep((pos + jnp.arange(t, dtype=jnp.int32))[:, None],
                      jnp.arange(max_seq_len, dtype=jnp.int32)[None, :])
  return jax.nn.dot_product_attention(q.astype(dtype), keys, values, mask=mask[None, None])


class SelfAttention(nn.Module):
  """Self-attention with rotary embeddings, grouped-query heads and optional QK-norm: the
  attention of every built-in family, one code path for training (cuDNN's fused attention where
  it applies, :func:`causal_attention`), the max-logit telemetry and the KV cache, each masked
  by ``pattern``.

  Parameters: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` (``kernel``) and with ``qk_norm``
  ``q_norm``, ``k_norm`` (``scale``). ``decode`` reads and appends to a KV cache (``"cache"``:
  ``k``, ``v`` ``[B, max_seq_len, K, hd]`` and ``index``); ``sow_logits`` sows the per-query-head
  max pre-softmax logit (float32 ``[H]``) as ``max_logit`` into ``"intermediates"``, read from the
  logits the softmax uses.
  """

  n_heads: int
  kv_heads: int
  head_dim: int
  d_model: int
  n_layers: int                 # the output projection's init is scaled by 1 / sqrt(2 L)
  max_seq_len: int
  rope_theta: float
  init_std: float
  compute_dtype: Any
  param_dtype: Any
  qk_norm: bool = False
  norm_single_scale: bool = False
  norm_eps: float = 1e-6
  bitnet: bool = False
  pattern: AttentionPattern = CAUSAL
  decode: bool = False
  sow_logits: bool = False

  @nn.compact
  def __call__(self, x: jax.Array, quantized_fraction: Optional[jax.Array] = None) -> jax.Array:
    cdt, pdt = self.compute_dtype, self.param_dtype
    b, t, _ = x.shape
    h, kh, hd = self.n_heads, self.kv_heads, self.head_dim
    init = nn.initializers.normal(self.init_std)
    out_init = nn.initializers.normal(self.init_std / math.sqrt(2 * self.n_layers))
    lin: dict[str, Any] = dict(compute_dtype=cdt, param_dtype=pdt, bitnet=self.bitnet)
    q, k, v = (Linear(heads * hd, kernel_init=init, name=f"{part}_proj", **lin)(
        x, quantized_fraction).reshape(b, t, heads, hd) for part, heads in zip("qkv", (h, kh, kh)))
    if self.qk_norm:
      norm: dict[str, Any] = dict(single_scale=self.norm_single_scale, eps=self.norm_eps)
      q = RMSNorm(cdt, pdt, name="q_norm", **norm)(q)
      k = RMSNorm(cdt, pdt, name="k_norm", **norm)(k)
    adt = f32_accum_dtype(cdt)
    if self.decode:
      y = kv_cached_attention(self, q, k, v, self.max_seq_len, self.rope_theta, adt, self.pattern)
    else:
      q, k = rope(q, self.rope_theta).astype(adt), rope(k, self.rope_theta).astype(adt)
      if self.sow_logits:
        y, max_logit = causal_attention_with_max_logit(q, k, v.astype(adt), self.pattern)
        self.sow("intermediates", MAX_LOGIT, max_logit)
      else:
        y = causal_attention(q, k, v.astype(adt), self.pattern)
    out = Linear(self.d_model, kernel_init=out_init, name="o_proj", **lin)
    return out(y.astype(cdt).reshape(b, t, h * hd), quantized_fraction)


def swiglu(gate: jax.Array, up: jax.Array, dtype: Any) -> jax.Array:
  """``silu(gate) * up`` in float32, returned in ``dtype`` (Shazeer 2020, "GLU Variants Improve
  Transformer")."""
  return (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(dtype)


class SwiGLUMLP(nn.Module):
  """The block's feed-forward layer: ``down_proj(swiglu(gate_proj(x), up_proj(x)))``, bias-free
  (optionally BitNet) linears; ``down_proj``'s init is scaled by ``1 / sqrt(2 n_layers)``."""
  d_model: int
  ff_dim: int
  n_layers: int
  init_std: float
  compute_dtype: Any
  param_dtype: Any
  bitnet: bool = False

  @nn.compact
  def __call__(self, x: jax.Array, quantized_fraction: Optional[jax.Array]) -> jax.Array:
    """``quantized_fraction``: the BitNet linears' mixing weight (``None`` without ``bitnet``)."""
    init = nn.initializers.normal(self.init_std)
    out_init = nn.initializers.normal(self.init_std / math.sqrt(2 * self.n_layers))
    lin: dict[str, Any] = dict(compute_dtype=self.compute_dtype, param_dtype=self.param_dtype,
                               bitnet=self.bitnet)
    gate = Linear(self.ff_dim, kernel_init=init, name="gate_proj", **lin)(x, quantized_fraction)
    up = Linear(self.ff_dim, kernel_init=init, name="up_proj", **lin)(x, quantized_fraction)
    hidden = swiglu(gate, up, self.compute_dtype)
    down = Linear(self.d_model, kernel_init=out_init, name="down_proj", **lin)
    return down(hidden, quantized_fraction)


def check_tokens(tokens: jax.Array, max_seq_len: int) -> None:
  """Raises ValueError (one line naming the fix) unless ``tokens`` is ``[batch, seq]`` with
  ``seq <= max_seq_len``."""
  if tokens.ndim != 2:
    raise ValueError(f"tokens must be [batch, seq] int32, got shape {tokens.shape}")
  if tokens.shape[1] > max_seq_len:
    raise ValueError(
        f"sequence length {tokens.shape[1]} exceeds model.max_seq_len={max_seq_len}: "
        f"raise model.max_seq_len or shorten train.seq_len")


def token_embedding(vocab_size: int, d_model: int, init_std: float, compute_dtype: Any,
                    param_dtype: Any) -> nn.Embed:
  """The token embedding ``tok_embed/embedding [vocab_size, d_model]`` (normal init), a child of
  the module whose ``@nn.compact`` method calls this."""
  return nn.Embed(vocab_size, d_model, embedding_init=nn.initializers.normal(init_std),
                  param_dtype=param_dtype, dtype=compute_dtype, name="tok_embed")


class DecoderBlock(nn.Module):
  """The fields of a block that :func:`run_blocks` runs. A subclass narrows ``config`` to its
  family's config and defines ``__call__(x, shared) -> (x, residual)``: the residual stream
  after the block, and that stream in float32 when ``collect`` (else ``None``)."""
  config: Any
  collect: bool = False
  decode: bool = False
  sow_logits: bool = False
  pattern: AttentionPattern = CAUSAL


def run_blocks(block: type[DecoderBlock], config: Any, x: jax.Array, shared: Any, *,
               n_layers: int, scan: bool, unroll: int = 1, remat: bool = False,
               decode: bool = False, collect: bool = False, sow_logits: bool = False,
               pattern: AttentionPattern = CAUSAL) -> tuple[jax.Array, Optional[jax.Array]]:
  """Runs ``n_layers`` blocks ``block(config, ...)`` over the residual stream ``x``; call it
  inside a model's ``@nn.compact`` ``__call__``, which becomes the blocks' parent.

  Args:
    block: the block class; every block gets ``(x, shared)``.
    config: the family's config, each block's ``config``.
    x: the residual stream ``[B, T, D]`` after the embedding.
    shared: the blocks' second argument, the same for every layer (broadcast by the scan).
    n_layers: how many blocks.
    scan: one ``nn.scan`` named ``blocks`` whose parameters (and caches, or sown intermediates)
      carry a leading ``[n_layers]`` axis, ``unroll`` layers per loop iteration; otherwise
      blocks named ``block_0`` .. ``block_<n_layers - 1>``.
    unroll: layers per iteration of the scanned loop.
    remat: rematerialise each block in the backward pass (not when decoding).
    decode: each block reads and appends to its KV cache (``"cache"``).
    collect: also return the residual stream.
    sow_logits: each block's attention sows its per-head max logit into ``"intermediates"``.
    pattern: the keys each query attends to.

  Returns:
    ``(x, stream)``: the residual stream after the last block and, with ``collect``, float32
    ``[n_layers + 1, B, T, D]`` (after the embedding and after each block), else ``None``.
  """
  if decode and sow_logits:
    raise ValueError("attention_logits is for training and evaluation calls, not decode")
  block_cls: Any = block
  if remat and not decode:
    # Inside a rolled scan the loop keeps XLA from merging the recomputation with the forward
    # pass; unrolled layers (a loop, or a scan unrolled further) need remat's own barrier.
    block_cls = nn.remat(block, prevent_cse=not (scan and unroll == 1))
  block_args: dict[str, Any] = dict(collect=collect, decode=decode, sow_logits=sow_logits,
                                    pattern=pattern)
  stream = [x.astype(jnp.float32)]  # kept when collect
  if scan:
    axes: dict[Any, int] = ({"params": 0, "cache": 0} if decode
                            else {"params": 0, "intermediates": 0})
    scanned = nn.scan(block_cls, variable_axes=axes, split_rngs={"params": True},
                      in_axes=nn.broadcast, length=n_layers, unroll=unroll)
    x, ys = scanned(config, **block_args, name="blocks")(x, shared)
    return x, (jnp.concatenate([stream[0][None], ys], axis=0) if collect else None)
  for i in range(n_layers):
    x, y = block_cls(config, **block_args, name=f"block_{i}")(x, shared)
    stream.append(y)
  return x, (jnp.stack(stream, axis=0) if collect else None)


class LMHead(nn.Module):
  """Output head: kernel ``[D, vocab]`` under ``lm_head/kernel``; float32 logits."""
  vocab_size: int
  compute_dtype: Any
  param_dtype: Any
  init_std: float

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    kernel = self.param("kernel", nn.initializers.normal(self.init_std),
                        (x.shape[-1], self.vocab_size), self.param_dtype)
    hdt = f32_accum_dtype(self.compute_dtype)
    return matmul_2d(x.astype(hdt), kernel.astype(hdt), preferred_element_type=jnp.float32)


def head_logits(x: jax.Array, embed: nn.Embed, *, tied: bool, vocab_size: int, compute_dtype: Any,
                param_dtype: Any, init_std: float) -> jax.Array:
  """Float32 logits ``[..., vocab_size]`` of the final hidden states ``x``: with ``tied``,
  ``x @ embed.embedding.T`` (no parameter of its own); otherwise an :class:`LMHead` named
  ``lm_head``, a child of the module whose ``@nn.compact`` method calls this."""
  x = x.astype(compute_dtype)
  if tied:
    hdt = f32_accum_dtype(compute_dtype)
    logits = matmul_2d(x.astype(hdt), embed.embedding.T.astype(hdt),
                       preferred_element_type=jnp.float32)
  else:
    logits = LMHead(vocab_size, compute_dtype, param_dtype, init_std, name="lm_head")(x)
  return logits.astype(jnp.float32)
