"""Small transformers written the way Flax's own docs write them, for the foreign-model tests.

Nothing here knows about stablejax: attention, embeddings, dense layers and norms are Flax's own
modules, names are Flax's defaults (Linen auto-names ``Dense_0``...; NNX uses attribute names).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from helpers import load_example


# ------------------------------------------------------------------ Linen

class LinenBlock(nn.Module):
  heads: int

  @nn.compact
  def __call__(self, x, _=None):
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
    x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(nn.LayerNorm()(x), mask=mask)
    h = nn.gelu(nn.Dense(4 * x.shape[-1])(nn.LayerNorm()(x)))
    return x + nn.Dense(x.shape[-1])(h), None


class LinenLM(nn.Module):
  """Embed -> blocks -> LayerNorm -> head. ``tied``: logits from ``embed.attend``."""
  vocab: int = 64
  d_model: int = 32
  heads: int = 4
  layers: int = 2
  max_len: int = 16
  tied: bool = False
  scan: bool = False

  @nn.compact
  def __call__(self, tokens):
    embed = nn.Embed(self.vocab, self.d_model)
    pos = self.param("pos_embedding", nn.initializers.normal(0.02), (self.max_len, self.d_model))
    x = embed(tokens) + pos[:tokens.shape[1]]
    if self.scan:
      stack = nn.scan(LinenBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                      length=self.layers)
      x, _ = stack(self.heads)(x, None)
    else:
      for _ in range(self.layers):
        x, _ = LinenBlock(self.heads)(x)
    x = nn.LayerNorm()(x)
    return embed.attend(x) if self.tied else nn.Dense(self.vocab)(x)


def linen_params(model: LinenLM, seq_len: int = 8):
  return jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, seq_len), jnp.int32))["params"]


# ------------------------------------------------------------------ NNX

# The pre-LN block of examples/nnx_lm.py (nnx.LayerNorm, nnx.MultiHeadAttention, a GELU MLP of
# two nnx.Linear), so these tests route and train the block the example shows.
NNXBlock = load_example("nnx_lm").Block


class NNXLM(nnx.Module):
  """Embed -> blocks -> LayerNorm -> ``self.out`` (or ``embed.attend`` when tied)."""

  def __init__(self, vocab=64, d_model=32, heads=4, layers=2, tied=False, scan=False, *, rngs):
    self.embed = nnx.Embed(vocab, d_model, rngs=rngs)
    self.scan = scan
    if scan:
      @nnx.split_rngs(splits=layers)
      @nnx.vmap(in_axes=(0,), out_axes=0)
      def create_block(rngs):
        return NNXBlock(d_model, heads, rngs)
      self.blocks = create_block(rngs)
    else:
      self.blocks = nnx.List([NNXBlock(d_model, heads, rngs) for _ in range(layers)])
    self.ln_f = nnx.LayerNorm(d_model, rngs=rngs)
    self.out = None if tied else nnx.Linear(d_model, vocab, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens)
    if self.scan:
      @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
      def forward(x, block):
        return block(x)
      x = forward(x, self.blocks)
    else:
      for block in self.blocks:
        x = block(x)
    x = self.ln_f(x)
    return self.embed.attend(x) if self.out is None else self.out(x)


# ------------------------------------------------------------------ layouts of public models
# Written here after reading the public code; each keeps the parameter tree (paths, shapes and
# metadata) of the model it is named after, at toy sizes.


class DenseGeneralAttention(nn.Module):
  """Causal attention with ``nn.DenseGeneral`` projections under a custom module name.

  The layout of google-deepmind/nanodo's ``CausalAttn``: ``query/key/value/kernel [D, H, hd]``,
  ``attn_out_proj/kernel [H, hd, D]``, no biases; ``partition`` boxes kernels in
  ``nn.Partitioned`` with mesh axis names (FSDP over ``'data'``) as nanodo's ``fsdp.init`` does.
  """
  d_model: int
  heads: int
  partition: bool = False

  def _init(self, names):
    init = nn.initializers.xavier_uniform()
    return nn.with_partitioning(init, names) if self.partition else init

  @nn.compact
  def __call__(self, x):
    hd = self.d_model // self.heads
    q, k, v = (nn.DenseGeneral((self.heads, hd), use_bias=False, name=n,
                               kernel_init=self._init(("data", None, None)))(x)
               for n in ("query", "key", "value"))
    logits = jnp.einsum("bqhd,bkhd->bhqk", q / hd ** 0.5, k)
    mask = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
    probs = jax.nn.softmax(jnp.where(mask, logits, -1e9), axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
    return nn.DenseGeneral(self.d_model, axis=(-2, -1), use_bias=False, name="attn_out_proj",
                           kernel_init=self._init((None, None, "data")))(out)


class DenseGeneralBlock(nn.Module):
  d_model: int
  heads: int
  ff: int
  partition: bool = False

  @nn.compact
  def __call__(self, x):
    x = x + DenseGeneralAttention(self.d_model, self.heads, self.partition)(
        nn.LayerNorm(use_bias=False)(x))
    init = nn.initializers.xavier_uniform()
    init = nn.with_partitioning(init, ("data", None)) if self.partition else init
    h = nn.LayerNorm(use_bias=False)(x)
    h = nn.gelu(nn.Dense(self.ff, use_bias=False, kernel_init=init)(h))
    return x + nn.Dense(self.d_model, use_bias=False, kernel_init=init)(h)


class DenseGeneralLM(nn.Module):
  """nanodo's ``TransformerDo`` layout: token and position ``nn.Embed``, blocks, tied head."""
  vocab: int = 64
  d_model: int = 32
  heads: int = 4
  ff: int = 128
  layers: int = 2
  max_len: int = 16
  partition: bool = False

  def setup(self):
    init = nn.initializers.normal(0.02)
    init = nn.with_partitioning(init, (None, "data")) if self.partition else init
    self.embed = nn.Embed(self.vocab, self.d_model, embedding_init=init)
    self.pos_embed = nn.Embed(self.max_len, self.d_model, embedding_init=init)
    self.blocks = [DenseGeneralBlock(self.d_model, self.heads, self.ff, self.partition)
                   for _ in range(self.layers)]
    self.out_ln = nn.LayerNorm(use_bias=False)

  def __call__(self, tokens):
    x = self.embed(tokens) + self.pos_embed(jnp.arange(tokens.shape[1])[None])
    for block in self.blocks:
      x = block(x)
    return self.embed.attend(self.out_ln(x))


def _logical(init, names, boxed):
  return nn.with_logical_partitioning(init, names) if boxed else init


class LogicalBlock(nn.Module):
  """Flax ``examples/lm1b``'s decoder block: every parameter boxed with logical axis names.

  ``nn.SelfAttention`` gets the kernel initialiser with two names ``('embed', 'kv')`` for its
  3-axis kernels, exactly as lm1b passes them (``DenseGeneral`` names its flattened kernel).
  """
  heads: int
  mlp: int
  boxed: bool = True

  @nn.compact
  def __call__(self, x):
    d = x.shape[-1]
    ones, zeros = nn.initializers.ones, nn.initializers.zeros
    norm = dict(scale_init=_logical(ones, ("embed",), self.boxed),
                bias_init=_logical(zeros, ("embed",), self.boxed))
    kernel = nn.initializers.xavier_uniform()
    h = nn.LayerNorm(**norm)(x)
    h = nn.SelfAttention(num_heads=self.heads, qkv_features=d, use_bias=False,
                         kernel_init=_logical(kernel, ("embed", "kv"), self.boxed),
                         deterministic=True)(h, nn.make_causal_mask(jnp.ones(x.shape[:2])))
    x = x + h
    h = nn.LayerNorm(**norm)(x)
    h = nn.relu(nn.Dense(self.mlp, kernel_init=_logical(kernel, ("embed", "mlp"), self.boxed),
                         bias_init=_logical(zeros, ("mlp",), self.boxed))(h))
    return x + nn.Dense(d, kernel_init=_logical(kernel, ("mlp", "embed"), self.boxed),
                        bias_init=_logical(zeros, ("embed",), self.boxed))(h)


class LogicalDecoder(nn.Module):
  vocab: int
  d_model: int
  heads: int
  mlp: int
  layers: int
  boxed: bool = True

  @nn.compact
  def __call__(self, tokens):
    embed = nn.Embed(self.vocab, self.d_model, embedding_init=_logical(
        nn.initializers.normal(1.0), ("vocab", "embed"), self.boxed))
    x = embed(tokens)
    for i in range(self.layers):
      x = LogicalBlock(self.heads, self.mlp, self.boxed, name=f"encoderdecoderblock_{i}")(x)
    x = nn.LayerNorm(name="encoderdecoder_norm",
                     scale_init=_logical(nn.initializers.ones, ("embed",), self.boxed),
                     bias_init=_logical(nn.initializers.zeros, ("embed",), self.boxed))(x)
    return nn.Dense(self.vocab, name="logitdense",
                    kernel_init=_logical(nn.initializers.xavier_uniform(), ("embed", "vocab"),
                                         self.boxed),
                    bias_init=_logical(nn.initializers.zeros, ("vocab",), self.boxed))(x)


class LogicalLM(nn.Module):
  """Flax ``examples/lm1b``'s ``TransformerLM``: the untied head sits under ``decoder/``."""
  vocab: int = 64
  d_model: int = 32
  heads: int = 4
  mlp: int = 128
  layers: int = 2
  boxed: bool = True

  @nn.compact
  def __call__(self, tokens):
    return LogicalDecoder(self.vocab, self.d_model, self.heads, self.mlp, self.layers,
                          self.boxed, name="decoder")(tokens)


class EinsumParam(nnx.Module):
  """Gemma's ``layers.Einsum``: one ``w`` parameter contracted by an einsum string."""

  def __init__(self, spec: str, shape, *, rngs: nnx.Rngs):
    self.spec = spec
    self.w = nnx.Param(nnx.initializers.normal(0.05)(rngs.params(), shape))

  def __call__(self, x):
    return jnp.einsum(self.spec, x, self.w[...])


class EinsumRMSNorm(nnx.Module):
  def __init__(self, dim: int, *, rngs: nnx.Rngs):
    self.scale = nnx.Param(jnp.zeros((dim,)))

  def __call__(self, x):
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
    return x * (1 + self.scale[...])


class EinsumAttention(nnx.Module):
  """Flax ``examples/gemma``'s attention: fused ``qkv_einsum`` when ``kv_heads == heads``,
  otherwise ``q_einsum`` and a fused ``kv_einsum``; ``attn_vec_einsum`` out."""

  def __init__(self, d_model, heads, kv_heads, head_dim, qk_norm=False, *, rngs):
    self.heads, self.kv_heads = heads, kv_heads
    self.attn_vec_einsum = EinsumParam("BTNH,NHD->BTD", (heads, head_dim, d_model), rngs=rngs)
    if heads == kv_heads:
      self.qkv_einsum = EinsumParam("BTD,SNDH->SBTNH", (3, heads, d_model, head_dim), rngs=rngs)
    else:
      self.q_einsum = EinsumParam("BTD,NDH->BTNH", (heads, d_model, head_dim), rngs=rngs)
      self.kv_einsum = EinsumParam("BSD,CKDH->CBSKH", (2, kv_heads, d_model, head_dim), rngs=rngs)
    if qk_norm:
      self._query_norm = EinsumRMSNorm(head_dim, rngs=rngs)
      self._key_norm = EinsumRMSNorm(head_dim, rngs=rngs)
    self.qk_norm = qk_norm

  def __call__(self, x):
    if self.heads == self.kv_heads:
      q, k, v = self.qkv_einsum(x)
    else:
      q = self.q_einsum(x)
      k, v = self.kv_einsum(x)
    if self.qk_norm:
      q, k = self._query_norm(q), self._key_norm(k)
    groups = self.heads // self.kv_heads
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    logits = jnp.einsum("BTNH,BSNH->BTNS", q * q.shape[-1] ** -0.5, k)
    t = x.shape[1]
    logits = jnp.where(jnp.tril(jnp.ones((t, t), bool))[:, None], logits, -1e9)
    return self.attn_vec_einsum(jnp.einsum("BTNS,BSNH->BTNH", jax.nn.softmax(logits, -1), v))


class EinsumBlock(nnx.Module):
  def __init__(self, d_model, heads, kv_heads, head_dim, hidden, qk_norm=False, *, rngs):
    self.pre_attention_norm = EinsumRMSNorm(d_model, rngs=rngs)
    self.attn = EinsumAttention(d_model, heads, kv_heads, head_dim, qk_norm, rngs=rngs)
    self.pre_ffw_norm = EinsumRMSNorm(d_model, rngs=rngs)
    self.mlp = nnx.Dict(  # Gemma's FeedForward: three bias-free nnx.Linear
        gate_proj=nnx.Linear(d_model, hidden, use_bias=False, rngs=rngs),
        up_proj=nnx.Linear(d_model, hidden, use_bias=False, rngs=rngs),
        down_proj=nnx.Linear(hidden, d_model, use_bias=False, rngs=rngs))

  def __call__(self, x):
    x = x + self.attn(self.pre_attention_norm(x))
    h = self.pre_ffw_norm(x)
    h = nnx.gelu(self.mlp["gate_proj"](h)) * self.mlp["up_proj"](h)
    return x + self.mlp["down_proj"](h)


class EinsumLM(nnx.Module):
  """Flax ``examples/gemma``'s ``Transformer``: ``embedder/input_embedding``, ``layers``, tied."""

  def __init__(self, vocab=64, d_model=32, heads=4, kv_heads=4, head_dim=8, hidden=64,
               layers=2, qk_norm=False, *, rngs):
    self.embedder = nnx.Dict(input_embedding=nnx.Param(
        nnx.initializers.normal(1.0)(rngs.params(), (vocab, d_model))))
    self.layers = nnx.List([EinsumBlock(d_model, heads, kv_heads, head_dim, hidden, qk_norm,
                                        rngs=rngs) for _ in range(layers)])
    self.final_norm = EinsumRMSNorm(d_model, rngs=rngs)

  def __call__(self, tokens):
    table = self.embedder["input_embedding"][...]
    x = table[tokens] * jnp.sqrt(table.shape[1])
    for layer in self.layers:
      x = layer(x)
    return self.final_norm(x) @ table.T


class ShardedNamesLM(nnx.Module):
  """An NNX model whose Variables carry logical ``out_sharding`` names (``nnx.with_partitioning``).

  Attention as separate ``nnx.LinearGeneral`` projections: query/key/value ``[D, H, hd]`` named
  ``('embed', 'heads', 'head_dim')``, out ``[H, hd, D]`` named ``('heads', 'head_dim', 'embed')``.
  Module names say nothing (``wa``, ``wb``...), so only the metadata and the shapes tell.
  Create it under ``nnx.use_eager_sharding(False)`` (no mesh) or under a mesh with rules.
  """

  def __init__(self, vocab=64, d_model=32, heads=4, ff=96, layers=2, *, rngs):
    part = nnx.with_partitioning
    init = nnx.initializers.lecun_normal()
    hd = d_model // heads
    self.tokens = nnx.Embed(vocab, d_model, rngs=rngs, embedding_init=part(
        nnx.initializers.normal(1.0), ("vocab", "embed")))
    self.layers = nnx.List()
    for _ in range(layers):
      proj = {n: nnx.LinearGeneral(d_model, (heads, hd), use_bias=False, rngs=rngs,
                                   kernel_init=part(init, ("embed", "heads", "head_dim")))
              for n in ("wa", "wb", "wc")}
      proj["wd"] = nnx.LinearGeneral((heads, hd), d_model, axis=(-2, -1), use_bias=False,
                                     rngs=rngs, kernel_init=part(init, ("heads", "head_dim",
                                                                        "embed")))
      proj["up"] = nnx.Linear(d_model, ff, use_bias=False, rngs=rngs,
                              kernel_init=part(init, ("embed", "mlp")))
      proj["down"] = nnx.Linear(ff, d_model, use_bias=False, rngs=rngs,
                                kernel_init=part(init, ("mlp", "embed")))
      proj["gain"] = nnx.RMSNorm(d_model, rngs=rngs, scale_init=part(nnx.initializers.ones,
                                                                     ("norm",)))
      self.layers.append(nnx.Dict(proj))
    self.unembed_w = nnx.Param(init(rngs.params(), (d_model, vocab)),
                               out_sharding=("embed", "vocab"))

  def __call__(self, tokens):
    x = self.tokens(tokens)
    for layer in self.layers:
      h = layer["gain"](x)
      q, k, v = layer["wa"](h), layer["wb"](h), layer["wc"](h)
      logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / q.shape[-1] ** 0.5
      t = x.shape[1]
      logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, -1e9)
      x = x + layer["wd"](jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, -1), v))
      x = x + layer["down"](nnx.relu(layer["up"](x)))
    return x @ self.unembed_w[...]


class LayerAxisBlock(nn.Module):
  """A Linen block whose every parameter is boxed with logical names, for ``nn.scan`` over an
  axis that is not the leading one (MaxText's ``param_scan_axis=1``)."""
  heads: int
  mlp: int

  @nn.compact
  def __call__(self, x, _):
    d = x.shape[-1]
    hd = d // self.heads
    init = nn.initializers.lecun_normal()

    def proj(names, features, axis=-1, name=None):
      return nn.DenseGeneral(features, axis=axis, use_bias=False, name=name,
                             kernel_init=nn.with_logical_partitioning(init, names))
    h = nn.RMSNorm(scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("norm",)))(x)
    q, k, v = (proj(("embed", "heads", "kv"), (self.heads, hd), name=n)(h) for n in "qkv")
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / hd ** 0.5
    x = x + proj(("heads", "kv", "embed"), d, axis=(-2, -1), name="o")(
        jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, -1), v))
    x = x + proj(("mlp", "embed"), d, name="wo")(nn.relu(proj(("embed", "mlp"), self.mlp,
                                                             name="wi")(x)))
    return x, None


class LayerAxisLM(nn.Module):
  vocab: int = 64
  d_model: int = 32
  heads: int = 4
  mlp: int = 96
  layers: int = 3

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(self.vocab, self.d_model, embedding_init=nn.with_logical_partitioning(
        nn.initializers.normal(1.0), ("vocab", "embed")))(tokens)
    stack = nn.scan(LayerAxisBlock, variable_axes={"params": 1}, split_rngs={"params": True},
                    length=self.layers, metadata_params={nn.PARTITION_NAME: "layers"})
    x, _ = stack(self.heads, self.mlp, name="decoder")(x, None)
    return nn.Dense(self.vocab, use_bias=False, name="logits_dense", kernel_init=(
        nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "vocab"))))(x)


class MiniGPTLike(nnx.Module):
  """The Flax NNX miniGPT tutorial's tree: ``embedding_layer/{token_emb,pos_emb}``,
  ``transformer_blocks/layers/i/{mha,layer_norm1,mlp,layer_norm2}``, untied ``output_layer``;
  kernels annotated with mesh axes ``P(None, 'model')`` as the tutorial does."""

  def __init__(self, vocab=64, d_model=32, heads=4, ff=32, layers=2, maxlen=16, *, rngs):
    from jax.sharding import PartitionSpec as P
    model = {"out_sharding": P(None, "model")}
    vec = {"out_sharding": P("model")}
    self.embedding_layer = nnx.Dict(token_emb=nnx.Embed(vocab, d_model, rngs=rngs),
                                    pos_emb=nnx.Embed(maxlen, d_model, rngs=rngs))
    blocks = []
    for _ in range(layers):
      blocks.append(nnx.Dict(
          mha=nnx.MultiHeadAttention(num_heads=heads, in_features=d_model, decode=False,
                                     kernel_metadata=model, bias_metadata=vec, rngs=rngs),
          layer_norm1=nnx.LayerNorm(d_model, epsilon=1e-6, scale_metadata=vec,
                                    bias_metadata=vec, rngs=rngs),
          mlp=nnx.Sequential(
              nnx.Linear(d_model, ff, kernel_metadata=model, bias_metadata=vec, rngs=rngs),
              nnx.relu,
              nnx.Linear(ff, d_model, kernel_metadata=model, bias_metadata=vec, rngs=rngs)),
          layer_norm2=nnx.LayerNorm(d_model, epsilon=1e-6, scale_metadata=vec,
                                    bias_metadata=vec, rngs=rngs)))
    self.transformer_blocks = nnx.Sequential(*blocks)
    self.output_layer = nnx.Linear(d_model, vocab, kernel_metadata=model, bias_metadata=vec,
                                   rngs=rngs)

  def __call__(self, tokens):
    emb = self.embedding_layer
    sharding = jax.typeof(tokens).sharding
    explicit = not sharding.mesh.empty  # under jax.set_mesh, as the tutorial runs
    kw = {"out_sharding": sharding} if explicit else {}
    x = emb["token_emb"](tokens, **kw) + emb["pos_emb"](jnp.arange(tokens.shape[1])[None])
    for block in self.transformer_blocks.layers:
      x = block["layer_norm1"](x + block["mha"](x, is_causal=True, decode=False))
      x = block["layer_norm2"](x + block["mlp"](x))
    logits = self.output_layer(x)
    return jax.sharding.reshard(logits, sharding) if explicit else logits
