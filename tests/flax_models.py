"""Small transformers written the way Flax's own docs write them, for the foreign-model tests.

Nothing here knows about stablejax: attention, embeddings, dense layers and norms are Flax's own
modules, names are Flax's defaults (Linen auto-names ``Dense_0``...; NNX uses attribute names).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx


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
  return model.init(jax.random.key(0), jnp.zeros((1, seq_len), jnp.int32))["params"]


# ------------------------------------------------------------------ NNX

class NNXBlock(nnx.Module):
  def __init__(self, d_model: int, heads: int, rngs: nnx.Rngs):
    self.ln1 = nnx.LayerNorm(d_model, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(num_heads=heads, in_features=d_model, decode=False,
                                       rngs=rngs)
    self.ln2 = nnx.LayerNorm(d_model, rngs=rngs)
    self.fc = nnx.Linear(d_model, 4 * d_model, rngs=rngs)
    self.proj = nnx.Linear(4 * d_model, d_model, rngs=rngs)

  def __call__(self, x):
    x = x + self.attn(self.ln1(x), mask=nnx.make_causal_mask(x[..., 0]))
    return x + self.proj(nnx.gelu(self.fc(self.ln2(x))))


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
