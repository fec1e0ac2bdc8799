"""A decoder-only GPT in Flax linen, with the outlier-safe model options.

Default: Pre-LN blocks of RMSNorm -> causal self-attention (RoPE, ``jax.nn.dot_product_attention``)
and RMSNorm -> SwiGLU MLP, a final RMSNorm and an untied output head. No biases.

Options (``ModelConfig``):
  * ``norm="ssnorm"``: Single-Scale RMSNorm, one scalar gain per norm (Outlier-Safe Pre-Training,
    arXiv 2506.19697).
  * ``emb_proj``: EmbProj (arXiv 2506.19697): an orthogonally initialised ``[D, D]`` projection
    after the token embedding (``emb_proj_in``) and one after the final norm, right before the head
    (``emb_proj_out``). Both are plain matrices (trained by Muon) and fold exactly into the
    embedding table and the head (``stablejax.merge_emb_proj``): nothing non-linear sits between
    a projection and the weight it merges into.
  * ``post_ln``: Post-LN blocks ``x = norm(x + f(x))`` for comparison (no final norm then).
  * ``qk_norm``: RMSNorm over the head dimension of queries and keys.
  * ``tie_embeddings``: logits = h @ embedding.T, no ``lm_head``.
  * ``embed_scale``: embeddings multiplied by sqrt(d_model).
  * ``scan_unroll``: layers per iteration of the scanned layers' loop (null: all of them on a CPU,
    one elsewhere; :func:`scan_unroll`). The parameters stay stacked either way.
  * ``bitnet``: every block linear is a BitNet b1.58 quantisation-aware linear mixed with full
    precision by ``bitnet_lambda`` (see ``stablejax.modeling.bitnet``). Embedding, EmbProj and
    head stay full precision.

Precision: parameters are created and stored in ``param_dtype`` (float32 by default); each call
casts activations and a per-call copy of the weights to ``compute_dtype``. Norm statistics,
softmax statistics (inside ``dot_product_attention``) and the logits are float32.

Parameter layout (``scan_layers=True``; without scan ``blocks`` becomes ``block_0``, ``block_1``,
... and the leading ``L`` axis disappears)::

  tok_embed/embedding        [V, D]
  emb_proj_in/kernel         [D, D]      (emb_proj)
  blocks/attn_norm/scale     [L, D]      ([L] with ssnorm)
  blocks/attn/{q,k,v,o}_proj/kernel  [L, D, D]
  blocks/attn/{q,k}_norm/scale       [L, head_dim]   (qk_norm)
  blocks/mlp_norm/scale      [L, D]
  blocks/mlp/{gate,up}_proj/kernel   [L, D, F]
  blocks/mlp/down_proj/kernel        [L, F, D]
  final_norm/scale           [D]         (Pre-LN only)
  emb_proj_out/kernel        [D, D]      (emb_proj)
  lm_head/kernel             [D, V]      (untied only)

Example::

    cfg = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4)
    model = GPT(cfg)
    params = model.init(jax.random.key(0), jnp.zeros((1, 16), jnp.int32))["params"]
    logits = model.apply({"params": params}, tokens)        # [B, T, V] float32
"""

from __future__ import annotations

import optax
import dataclasses
import math
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from stablejax.modeling.attention import CAUSAL, AttentionPattern
from stablejax.modeling.family import (LINEN_CAPABILITIES, AttentionHeads, LanguageModel,
                                       LinenLanguageModel, ModelFamily)
from stablejax.modeling.layers import (DTYPES, DecoderBlock, Linear, RMSNorm, SelfAttention,
                                       SwiGLUMLP, check_tokens, head_logits, run_blocks,
                                       token_embedding)

_NORMS = ("rmsnorm", "ssnorm")


@dataclasses.dataclass
class ModelConfig:
  vocab_size: int = 256
  d_model: int = 192
  n_layers: int = 4
  n_heads: int = 4
  d_ff: int = 0              # 0 -> SwiGLU hidden = multiple of 64 nearest 8/3 * d_model
  max_seq_len: int = 128
  rope_theta: float = 10000.0
  qk_norm: bool = True
  tie_embeddings: bool = False
  norm: str = "rmsnorm"      # "rmsnorm" | "ssnorm" (Single-Scale RMSNorm, arXiv 2506.19697)
  post_ln: bool = False      # Post-LN for comparison; Pre-LN default
  emb_proj: bool = False     # EmbProj (arXiv 2506.19697)
  embed_scale: bool = False  # multiply embeddings by sqrt(d_model)
  bitnet: bool = False       # BitNet b1.58-style quantisation-aware linears mixed by lambda
  compute_dtype: str = "float32"    # "float32" | "bfloat16" | "float16"
  param_dtype: str = "float32"      # "bfloat16" only to reproduce the underflow failure
  init_std: float = 0.02
  scan_layers: bool = True   # nn.scan over blocks: stacked [L, ...] params, fast compile
  # Layers per iteration of that scan (lax.scan's unroll; the parameters stay stacked). null: the
  # platform's choice, every layer on a CPU (where the rolled loop cost about a fifth of the
  # default step, docs/results.md "Peer speed"), 1 on GPU and TPU (one layer's code to compile).
  scan_unroll: Optional[int] = None
  remat: bool = False        # rematerialise each block in the backward pass

  @property
  def head_dim(self) -> int:
    return self.d_model // self.n_heads

  @property
  def ff_dim(self) -> int:
    """SwiGLU hidden size: ``d_ff`` or the multiple of 64 nearest to 8/3 * d_model (at least 64)."""
    if self.d_ff:
      return self.d_ff
    return max(64, 64 * int(round(8 * self.d_model / 3 / 64)))

  def validate(self) -> None:
    """Raises ValueError (one line naming the problem and the fix) for an unusable config."""
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"model.{name}={value!r} must be a positive integer")
    if not isinstance(self.d_ff, int) or self.d_ff < 0:
      raise ValueError(f"model.d_ff={self.d_ff!r} must be a non-negative integer (0 = automatic)")
    if self.d_model % self.n_heads:
      divisors = [h for h in range(1, self.d_model + 1) if self.d_model % h == 0 and h <= 64]
      raise ValueError(
          f"model.n_heads={self.n_heads} does not divide model.d_model={self.d_model}: "
          f"choose n_heads in {divisors[-6:]} or change d_model")
    if self.head_dim % 2:
      raise ValueError(
          f"model head_dim = d_model/n_heads = {self.head_dim} is odd but RoPE needs an even "
          f"head dimension: change model.d_model or model.n_heads")
    if self.norm not in _NORMS:
      raise ValueError(f"model.norm={self.norm!r} is unknown: use one of {list(_NORMS)}")
    for name in ("compute_dtype", "param_dtype"):
      value = getattr(self, name)
      if value not in DTYPES:
        raise ValueError(f"model.{name}={value!r} is unknown: use one of {list(DTYPES)}")
    if self.scan_unroll is not None and (not isinstance(self.scan_unroll, int)
                                         or isinstance(self.scan_unroll, bool)
                                         or self.scan_unroll < 1):
      raise ValueError(f"model.scan_unroll={self.scan_unroll!r} must be a positive integer (layers "
                       f"per loop iteration) or null (the platform's choice)")
    if not self.init_std > 0:
      raise ValueError(f"model.init_std={self.init_std!r} must be > 0 (e.g. 0.02)")
    if not self.rope_theta > 0:
      raise ValueError(f"model.rope_theta={self.rope_theta!r} must be > 0 (e.g. 10000.0)")


def scan_unroll(cfg: ModelConfig, platform: str) -> int:
  """Layers per iteration of the scanned layers' loop on ``platform`` (``jax.default_backend()``).

  ``cfg.scan_unroll`` when set; otherwise every layer on ``"cpu"``, where the rolled loop of
  layers cost about a fifth of the default model's step (the loop's dynamic slices of the
  stacked weights and saved activations, and fusions that cannot cross iterations), and 1
  elsewhere, where the rolled loop compiles one layer's code for all of them. The parameter
  layout is the same either way (stacked ``[L, ...]``), so a checkpoint moves between platforms.

  Example:
    >>> cfg = ModelConfig(n_layers=4)
    >>> scan_unroll(cfg, "cpu"), scan_unroll(cfg, "gpu")
    (4, 1)
    >>> scan_unroll(ModelConfig(n_layers=4, scan_unroll=2), "cpu")
    2
  """
  if cfg.scan_unroll is not None:
    return cfg.scan_unroll
  return cfg.n_layers if platform == "cpu" else 1


# ----------------------------------------------------------------------------- blocks


def _dtypes(cfg: ModelConfig) -> tuple[Any, Any]:
  return DTYPES[cfg.compute_dtype], DTYPES[cfg.param_dtype]


def attention(cfg: ModelConfig, pattern: AttentionPattern, decode: bool, sow_logits: bool
              ) -> SelfAttention:
  """The block's self-attention (the shared :class:`SelfAttention`, one key/value head per query
  head), named ``attn``."""
  cdt, pdt = _dtypes(cfg)
  return SelfAttention(
      n_heads=cfg.n_heads, kv_heads=cfg.n_heads, head_dim=cfg.head_dim, d_model=cfg.d_model,
      n_layers=cfg.n_layers, max_seq_len=cfg.max_seq_len, rope_theta=cfg.rope_theta,
      init_std=cfg.init_std, compute_dtype=cdt, param_dtype=pdt, qk_norm=cfg.qk_norm,
      norm_single_scale=cfg.norm == "ssnorm", bitnet=cfg.bitnet, pattern=pattern, decode=decode,
      sow_logits=sow_logits, name="attn")


def mlp(cfg: ModelConfig) -> SwiGLUMLP:
  """The block's SwiGLU MLP (BitNet linears with ``bitnet``), named ``mlp``."""
  cdt, pdt = _dtypes(cfg)
  return SwiGLUMLP(d_model=cfg.d_model, ff_dim=cfg.ff_dim, n_layers=cfg.n_layers,
                   init_std=cfg.init_std, compute_dtype=cdt, param_dtype=pdt, bitnet=cfg.bitnet,
                   name="mlp")


class Block(DecoderBlock):
  """One transformer block; returns ``(x, y)`` so it can be scanned (y: residual or None)."""
  config: ModelConfig

  @nn.compact
  def __call__(self, x: jax.Array, quantized_fraction: Optional[jax.Array]) -> Any:
    cfg = self.config
    cdt, pdt = _dtypes(cfg)
    single = cfg.norm == "ssnorm"
    attn_norm = RMSNorm(cdt, pdt, single_scale=single, name="attn_norm")
    mlp_norm = RMSNorm(cdt, pdt, single_scale=single, name="mlp_norm")
    attn = attention(cfg, self.pattern, self.decode, self.sow_logits)
    feed_forward = mlp(cfg)
    if cfg.post_ln:
      x = attn_norm(x + attn(x, quantized_fraction))
      x = mlp_norm(x + feed_forward(x, quantized_fraction))
    else:
      x = x + attn(attn_norm(x), quantized_fraction)
      x = x + feed_forward(mlp_norm(x), quantized_fraction)
    return x, (x.astype(jnp.float32) if self.collect else None)


class GPT(nn.Module):
  """Decoder-only transformer. See the module docstring for options and parameter names;
  ``pattern``: the keys each query attends to (an :class:`AttentionPattern`; causal by
  default)."""
  config: ModelConfig
  pattern: AttentionPattern = CAUSAL

  @nn.compact
  def __call__(self, tokens: jax.Array, *, bitnet_lambda: Optional[jax.Array] = None,
               return_activations: bool = False, decode: bool = False,
               attention_logits: bool = False) -> Any:
    """Runs the model.

    Args:
      tokens: int32 ``[B, T]`` with ``T <= max_seq_len``.
      decode: incremental decoding with a KV cache (``stablejax.training.trained.decoding``): apply
        with ``mutable=["cache"]``; the first call creates the cache and processes a prompt at
        positions ``0 .. T-1``, each later call (with the returned ``"cache"``) continues at the
        next position. Parameters and outputs are those of the normal call.
      bitnet_lambda: BitNet mixing weight in [0, 1] (a scalar, may be traced); ``None`` means 1.0
        (fully quantised). Ignored unless ``config.bitnet``.
      return_activations: also return ``{"residual": float32 [n_layers + 1, B, T, D]}``, the
        residual stream after the embedding (and ``emb_proj_in``) and after each block.
      attention_logits: each attention layer sows its per-head maximum pre-softmax logit
        ``max(q.k / sqrt(head_dim))`` over batch and positions (float32 ``[H]``, stacked to
        ``[n_layers, H]`` under ``scan_layers``) into the ``"intermediates"`` collection; apply
        with ``mutable=["intermediates"]`` and read them with
        :func:`stablejax.collect_attention_logits` (keys ``"blocks/attn"`` or
        ``"block_<i>/attn"``). Not with ``decode``.

    Returns:
      float32 logits ``[B, T, vocab_size]``, or ``(logits, activations)``.
    """
    cfg = self.config
    cdt, pdt = _dtypes(cfg)
    check_tokens(tokens, cfg.max_seq_len)
    quantized_fraction = jnp.asarray(1.0 if bitnet_lambda is None else bitnet_lambda, jnp.float32)

    embed = token_embedding(cfg.vocab_size, cfg.d_model, cfg.init_std, cdt, pdt)
    x = embed(tokens.astype(jnp.int32))
    if cfg.embed_scale:
      x = x * jnp.asarray(math.sqrt(cfg.d_model), cdt)
    if cfg.emb_proj:
      x = Linear(cfg.d_model, compute_dtype=cdt, param_dtype=pdt,
                 kernel_init=nn.initializers.orthogonal(), name="emb_proj_in")(x)
    x, residuals = run_blocks(
        Block, cfg, x.astype(cdt), quantized_fraction, n_layers=cfg.n_layers,
        scan=cfg.scan_layers, unroll=scan_unroll(cfg, jax.default_backend()), remat=cfg.remat,
        decode=decode, collect=return_activations, sow_logits=attention_logits,
        pattern=self.pattern)

    if not cfg.post_ln:
      x = RMSNorm(cdt, pdt, single_scale=cfg.norm == "ssnorm", name="final_norm")(x)
    if cfg.emb_proj:
      x = Linear(cfg.d_model, compute_dtype=cdt, param_dtype=pdt,
                 kernel_init=nn.initializers.orthogonal(), name="emb_proj_out")(x)
    logits = head_logits(x, embed, tied=cfg.tie_embeddings, vocab_size=cfg.vocab_size,
                         compute_dtype=cdt, param_dtype=pdt, init_std=cfg.init_std)
    if return_activations:
      return logits, {"residual": residuals}
    return logits


def layer_max_logits(cfg: ModelConfig, collected: dict) -> jax.Array:
  """``[n_layers, H]`` per-head max logits, in layer order, from the values
  ``GPT(..., attention_logits=True)`` sows (:func:`stablejax.collect_attention_logits`: keyed
  by the attention module's path, ``"blocks/attn"`` ``[L, H]`` under ``scan_layers``, else
  ``"block_<i>/attn"`` ``[H]``, the names ``find_attention_layers`` gives the layers)."""
  if cfg.scan_layers:
    return collected["blocks/attn"]
  return jnp.stack([collected[f"block_{i}/attn"] for i in range(cfg.n_layers)])


def count_params(params: optax.Params) -> int:
  """Total number of parameter entries in a pytree."""
  return int(sum(np.prod(np.shape(p)) for p in jax.tree_util.tree_leaves(params)))


def model_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
  """Training FLOPs per token: 6 N + 12 L D T (PaLM appendix B convention).

  N counts the parameters used in matmuls: block linears, EmbProj and the head (the embedding
  table when tied). The input-embedding lookup is a gather and is not counted; norms are
  negligible and not counted. The attention term counts the full T x T score matrix (the causal
  half is not subtracted), as in PaLM. BitNet's second (quantised) matmul is not counted.

  Args:
    cfg: the model config.
    seq_len: training sequence length T.

  Returns:
    FLOPs per token for one forward + backward pass.
  """
  d, f, layers = cfg.d_model, cfg.ff_dim, cfg.n_layers
  n = layers * (4 * d * d + 3 * d * f) + d * cfg.vocab_size
  if cfg.emb_proj:
    n += 2 * d * d
  return float(6 * n + 12 * layers * d * seq_len)


# ----------------------------------------------------------------------------- the family


class GPTModel(LinenLanguageModel):
  """:class:`GPT` as the trainer uses it (``model.family="gpt"``): every capability.

  ``model.bitnet``: the quantisation strength follows ``train.lambda_warmup_steps`` and
  ``train.lambda_schedule`` of the run's config (1.0 outside the trainer) and is logged as
  ``lambda``.
  """

  def __init__(self, config: ModelConfig, run_config: Any = None,
               pattern: AttentionPattern = CAUSAL, family: str = "gpt"):
    super().__init__(family, config, GPT(config, pattern), offers=LINEN_CAPABILITIES)
    self.pattern = pattern
    self.bitnet_lambda_schedule: Optional[Any] = None
    if config.bitnet:
      from stablejax.modeling.utils import lambda_warmup
      train = getattr(run_config, "train", None)
      self.bitnet_lambda_schedule = (
          lambda_warmup(train.lambda_warmup_steps, train.lambda_schedule) if train is not None
          else (lambda step: jnp.float32(1.0)))

  def call_kwargs(self, step: jax.typing.ArrayLike) -> dict[str, Any]:
    schedule = self.bitnet_lambda_schedule
    return {"bitnet_lambda": schedule(step)} if schedule is not None else {}

  def attention_heads(self) -> AttentionHeads:
    return AttentionHeads(self.config.n_heads, self.config.n_heads, self.config.qk_norm)

  def flops_per_token(self, seq_len: int) -> float:
    return model_flops_per_token(self.config, seq_len)

  def describe(self) -> str:
    c = self.config
    return f"GPT, {c.n_layers} layers, d_model {c.d_model}, {c.n_heads} heads"

  def step_metrics(self, step: jax.typing.ArrayLike) -> dict[str, jax.Array]:
    schedule = self.bitnet_lambda_schedule
    return {"lambda": schedule(step)} if schedule is not None else {}

  def ineffective_keys(self, run_config: Any) -> list[tuple[str, str]]:
    if self.config.bitnet:
      return []
    return [("train.lambda_warmup_steps", "model.bitnet=false"),
            ("train.lambda_schedule", "model.bitnet=false")]

  def for_deployment(self, params: optax.Params) -> tuple[Any, LanguageModel]:
    if not self.config.emb_proj:
      return params, self
    from stablejax.modeling.utils import merge_emb_proj
    merged, cfg = merge_emb_proj(params, self.config)
    model = GPTModel(cfg, pattern=self.pattern, family=self.family)
    model.bitnet_lambda_schedule = self.bitnet_lambda_schedule
    return merged, model


FAMILY = ModelFamily(
    name="gpt", config=ModelConfig, build=lambda section, run_config: GPTModel(section, run_config),
    label="Pre-LN GPT: RMSNorm, SwiGLU, rotary, QK-norm, EmbProj, BitNet (stablejax.modeling.gpt)")
