"""A Llama/Qwen-style decoder in Flax linen, the trainer's ``model.family="llama"``.

Pre-norm blocks of RMSNorm -> causal self-attention with rotary embeddings and grouped-query
attention (``n_kv_heads`` key/value heads shared by ``n_heads // n_kv_heads`` query heads each;
``n_kv_heads == n_heads`` is multi-head attention, 1 is multi-query) -> RMSNorm -> SwiGLU MLP,
a final RMSNorm and an untied (or tied) head; no biases. ``qk_norm``: RMSNorm over the head
dimension of queries and keys before the rotation (Qwen3, OLMo 2), on by default because without
it the attention logits of this project's small models grow at high learning rates (README).
With ``qk_norm=false``, ``tie_embeddings=false`` and ``rope_theta=10000``, the logits equal
Hugging Face's ``FlaxLlamaForCausalLM`` for the same weights, to float32 rounding
(``tests/test_llama.py``).

Parameter layout (``scan_layers=True``; without scan ``blocks`` becomes ``block_0``, ...), the
names the GPT family uses, so routing, AdaGC's per-layer thresholds and QK-clip read both alike::

  tok_embed/embedding               [V, D]
  blocks/attn_norm/scale            [L, D]
  blocks/attn/q_proj/kernel         [L, D, H * hd]
  blocks/attn/{k,v}_proj/kernel     [L, D, K * hd]
  blocks/attn/o_proj/kernel         [L, H * hd, D]
  blocks/attn/{q,k}_norm/scale      [L, hd]          (qk_norm)
  blocks/mlp_norm/scale             [L, D]
  blocks/mlp/{gate,up}_proj/kernel  [L, D, F]
  blocks/mlp/down_proj/kernel       [L, F, D]
  final_norm/scale                  [D]
  lm_head/kernel                    [D, V]           (untied only)

References:
  Touvron et al., `Llama 2 <https://arxiv.org/abs/2307.09288>`_ (arXiv 2307.09288); Ainslie et
  al., `GQA <https://arxiv.org/abs/2305.13245>`_ (arXiv 2305.13245); Qwen Team, `Qwen3 Technical
  Report <https://arxiv.org/abs/2505.09388>`_ (arXiv 2505.09388), QK-norm.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from stablejax.modeling.llama import Llama, LlamaConfig
  >>> cfg = LlamaConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
  ...                   max_seq_len=16)
  >>> tokens = jnp.zeros((1, 8), jnp.int32)
  >>> params = jax.jit(Llama(cfg).init)(jax.random.key(0), tokens)["params"]
  >>> params["blocks"]["attn"]["k_proj"]["kernel"].shape   # [L, D, K * head_dim]
  (2, 32, 16)
  >>> jax.jit(Llama(cfg).apply)({"params": params}, tokens).shape
  (1, 8, 64)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from stablejax.modeling.attention import CAUSAL, AttentionPattern
from stablejax.modeling.family import (LINEN_CAPABILITIES, AttentionHeads, LinenLanguageModel,
                                       ModelFamily)
from stablejax.modeling.layers import (DTYPES, DecoderBlock, RMSNorm, SelfAttention, SwiGLUMLP,
                                       check_tokens, head_logits, run_blocks, token_embedding)


@dataclasses.dataclass
class LlamaConfig:
  """``model.*`` of ``model.family="llama"``."""

  vocab_size: int = 256
  d_model: int = 192
  n_layers: int = 4
  n_heads: int = 4
  n_kv_heads: Optional[int] = None   # key/value heads (GQA); null: n_heads
  head_dim: Optional[int] = None     # null: d_model // n_heads
  d_ff: int = 0                      # SwiGLU hidden; 0: multiple of 64 nearest 8/3 * d_model
  max_seq_len: int = 128
  rope_theta: float = 10000.0
  norm_eps: float = 1e-5
  qk_norm: bool = True
  tie_embeddings: bool = False
  compute_dtype: str = "float32"     # "float32" | "bfloat16" | "float16"
  param_dtype: str = "float32"
  init_std: float = 0.02
  scan_layers: bool = True           # nn.scan over blocks: stacked [L, ...] params
  remat: bool = False                # rematerialise each block in the backward pass

  @property
  def kv_heads(self) -> int:
    return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

  @property
  def hd(self) -> int:
    return self.d_model // self.n_heads if self.head_dim is None else self.head_dim

  @property
  def ff_dim(self) -> int:
    return self.d_ff or max(64, 64 * int(round(8 * self.d_model / 3 / 64)))

  def validate(self) -> None:
    """Raises ValueError (one line naming the key and the fix) for an unusable config."""
    # Sizes first (the optional ones when set), so the checks of their relations meet none
    # that is zero or negative.
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len", "n_kv_heads",
                 "head_dim"):
      value = getattr(self, name)
      if value is None and name in ("n_kv_heads", "head_dim"):
        continue
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"model.{name}={value!r} must be a positive integer")
    if self.n_kv_heads is not None and self.n_heads % self.n_kv_heads:
      divisors = [k for k in range(1, self.n_heads + 1) if self.n_heads % k == 0]
      raise ValueError(f"model.n_kv_heads={self.n_kv_heads} must divide model.n_heads="
                       f"{self.n_heads} (each key/value head serves a group of query heads): use "
                       f"one of {divisors}")
    if self.head_dim is None and self.d_model % self.n_heads:
      raise ValueError(f"model.n_heads={self.n_heads} does not divide model.d_model="
                       f"{self.d_model}: change one, or set model.head_dim")
    if self.hd % 2 or self.hd < 2:
      raise ValueError(f"the head dimension {self.hd} must be even (rotary embeddings rotate "
                       "pairs): change model.d_model, model.n_heads or model.head_dim")
    if self.d_ff < 0:
      raise ValueError(f"model.d_ff={self.d_ff} must be >= 0 (0: automatic)")
    for name in ("compute_dtype", "param_dtype"):
      if getattr(self, name) not in DTYPES:
        raise ValueError(f"model.{name}={getattr(self, name)!r} is unknown: use one of "
                         f"{list(DTYPES)}")
    for name in ("rope_theta", "norm_eps", "init_std"):
      if not getattr(self, name) > 0:
        raise ValueError(f"model.{name}={getattr(self, name)!r} must be > 0")


def _dtypes(cfg: LlamaConfig) -> tuple[Any, Any]:
  return DTYPES[cfg.compute_dtype], DTYPES[cfg.param_dtype]


def attention(cfg: LlamaConfig, pattern: AttentionPattern, decode: bool, sow_logits: bool
              ) -> SelfAttention:
  """The block's grouped-query self-attention (the shared :class:`SelfAttention`), named
  ``attn``."""
  cdt, pdt = _dtypes(cfg)
  return SelfAttention(
      n_heads=cfg.n_heads, kv_heads=cfg.kv_heads, head_dim=cfg.hd, d_model=cfg.d_model,
      n_layers=cfg.n_layers, max_seq_len=cfg.max_seq_len, rope_theta=cfg.rope_theta,
      init_std=cfg.init_std, compute_dtype=cdt, param_dtype=pdt, qk_norm=cfg.qk_norm,
      norm_eps=cfg.norm_eps, pattern=pattern, decode=decode, sow_logits=sow_logits, name="attn")


def mlp(cfg: LlamaConfig) -> SwiGLUMLP:
  """The block's SwiGLU MLP, named ``mlp``."""
  cdt, pdt = _dtypes(cfg)
  return SwiGLUMLP(d_model=cfg.d_model, ff_dim=cfg.ff_dim, n_layers=cfg.n_layers,
                   init_std=cfg.init_std, compute_dtype=cdt, param_dtype=pdt, name="mlp")


class LlamaBlock(DecoderBlock):
  """One block; returns ``(x, residual or None)`` so it can be scanned."""

  config: LlamaConfig

  @nn.compact
  def __call__(self, x: jax.Array, _: Any = None) -> tuple[jax.Array, Optional[jax.Array]]:
    cfg = self.config
    cdt, pdt = _dtypes(cfg)
    attn = attention(cfg, self.pattern, self.decode, self.sow_logits)
    x = x + attn(RMSNorm(cdt, pdt, eps=cfg.norm_eps, name="attn_norm")(x))
    x = x + mlp(cfg)(RMSNorm(cdt, pdt, eps=cfg.norm_eps, name="mlp_norm")(x), None)
    return x, (x.astype(jnp.float32) if self.collect else None)


class Llama(nn.Module):
  """The decoder; see the module docstring. ``__call__`` takes what :class:`GPT`'s takes
  (``decode``, ``attention_logits``, ``return_activations``) but ``bitnet_lambda``;
  ``pattern``: the keys each query attends to (an :class:`AttentionPattern`; causal by default,
  a sliding window in tests/plugins/mistral.py)."""

  config: LlamaConfig
  pattern: AttentionPattern = CAUSAL

  @nn.compact
  def __call__(self, tokens: jax.Array, *, return_activations: bool = False,
               decode: bool = False, attention_logits: bool = False) -> Any:
    cfg = self.config
    cdt, pdt = _dtypes(cfg)
    check_tokens(tokens, cfg.max_seq_len)
    embed = token_embedding(cfg.vocab_size, cfg.d_model, cfg.init_std, cdt, pdt)
    x, stream = run_blocks(
        LlamaBlock, cfg, embed(tokens.astype(jnp.int32)).astype(cdt), None,
        n_layers=cfg.n_layers, scan=cfg.scan_layers, remat=cfg.remat, decode=decode,
        collect=return_activations, sow_logits=attention_logits, pattern=self.pattern)
    x = RMSNorm(cdt, pdt, eps=cfg.norm_eps, name="final_norm")(x)
    logits = head_logits(x, embed, tied=cfg.tie_embeddings, vocab_size=cfg.vocab_size,
                         compute_dtype=cdt, param_dtype=pdt, init_std=cfg.init_std)
    return (logits, {"residual": stream}) if return_activations else logits


def flops_per_token(cfg: LlamaConfig, seq_len: int) -> float:
  """Training FLOPs per token, 6 N + 12 L (H hd) T (the GPT family's convention, PaLM appendix
  B): N counts the block linears and the head (the embedding table when tied)."""
  d, q, kv, f, layers = cfg.d_model, cfg.n_heads * cfg.hd, cfg.kv_heads * cfg.hd, cfg.ff_dim, \
      cfg.n_layers
  n = layers * (2 * d * q + 2 * d * kv + 3 * d * f) + d * cfg.vocab_size
  return float(6 * n + 12 * layers * q * seq_len)


class LlamaModel(LinenLanguageModel):
  """:class:`Llama` as the trainer uses it: every capability. ``pattern`` and ``family`` serve
  a family that is Llama with another attention pattern (tests/plugins/mistral.py)."""

  def __init__(self, config: LlamaConfig, run_config: Any = None,
               pattern: AttentionPattern = CAUSAL, family: str = "llama"):
    super().__init__(family, config, Llama(config, pattern), offers=LINEN_CAPABILITIES)

  def attention_heads(self) -> AttentionHeads:
    return AttentionHeads(self.config.n_heads, self.config.kv_heads, self.config.qk_norm)

  def flops_per_token(self, seq_len: int) -> float:
    return flops_per_token(self.config, seq_len)

  def describe(self) -> str:
    c = self.config
    return (f"Llama, {c.n_layers} layers, d_model {c.d_model}, {c.n_heads} query heads, "
            f"{c.kv_heads} key/value heads")


FAMILY = ModelFamily(
    name="llama", config=LlamaConfig,
    build=lambda section, run_config: LlamaModel(section, run_config),
    label="Llama/Qwen-style: RMSNorm, SwiGLU, rotary, grouped-query attention, QK-norm on or off, "
          "tied or untied head (stablejax.modeling.llama)")
