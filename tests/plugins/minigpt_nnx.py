"""A plugin model family around public code stablejax was not written for: ``MiniGPT`` of the JAX
AI Stack's "Pretraining an LLM using JAX" tutorial (jax-ml/jax-ai-stack,
``docs/source/JAX_for_LLM_pretraining.md``, itself after Keras' miniature-GPT example), in Flax
NNX. Its modules and names are kept; moved to flax.nnx 0.12 (``nnx.List`` for the block list) and
without the tutorial's device mesh (``nnx.with_partitioning`` of a global 4x2 TPU mesh): the
trainer shards over its own mesh. Post-LN blocks of ``nnx.MultiHeadAttention`` (kernels ``[D, H,
hd]``), ReLU feed-forward, learned positions, untied output layer with a bias.

The declaration at the bottom is all a user writes to train it with ``python -m stablejax train
--plugin <this file> --set model.family=minigpt``.
"""

import dataclasses

import jax.numpy as jnp
from flax import nnx

from stablejax.modeling.family import ModelFamily, NNXLanguageModel


def causal_attention_mask(seq_len):
  return jnp.tril(jnp.ones((seq_len, seq_len)))


class TransformerBlock(nnx.Module):
  def __init__(self, embed_dim: int, num_heads: int, ff_dim: int, *, rngs: nnx.Rngs,
               rate: float = 0.1):
    self.mha = nnx.MultiHeadAttention(num_heads=num_heads, in_features=embed_dim,
                                      kernel_init=nnx.initializers.xavier_uniform(),
                                      bias_init=nnx.initializers.zeros_init(), rngs=rngs)
    self.dropout1 = nnx.Dropout(rate=rate)
    self.layer_norm1 = nnx.LayerNorm(epsilon=1e-6, num_features=embed_dim, rngs=rngs)
    self.linear1 = nnx.Linear(in_features=embed_dim, out_features=ff_dim,
                              kernel_init=nnx.initializers.xavier_uniform(),
                              bias_init=nnx.initializers.zeros_init(), rngs=rngs)
    self.linear2 = nnx.Linear(in_features=ff_dim, out_features=embed_dim,
                              kernel_init=nnx.initializers.xavier_uniform(),
                              bias_init=nnx.initializers.zeros_init(), rngs=rngs)
    self.dropout2 = nnx.Dropout(rate=rate)
    self.layer_norm2 = nnx.LayerNorm(epsilon=1e-6, num_features=embed_dim, rngs=rngs)

  def __call__(self, inputs, training: bool = False):
    _, seq_len, _ = inputs.shape
    mask = causal_attention_mask(seq_len)
    attention_output = self.mha(inputs_q=inputs, mask=mask, decode=False)
    attention_output = self.dropout1(attention_output, deterministic=not training)
    out1 = self.layer_norm1(inputs + attention_output)
    ffn_output = self.linear1(out1)
    ffn_output = nnx.relu(ffn_output)
    ffn_output = self.linear2(ffn_output)
    ffn_output = self.dropout2(ffn_output, deterministic=not training)
    return self.layer_norm2(out1 + ffn_output)


class TokenAndPositionEmbedding(nnx.Module):
  def __init__(self, maxlen: int, vocab_size: int, embed_dim: int, *, rngs: nnx.Rngs):
    self.token_emb = nnx.Embed(num_embeddings=vocab_size, features=embed_dim, rngs=rngs)
    self.pos_emb = nnx.Embed(num_embeddings=maxlen, features=embed_dim, rngs=rngs)

  def __call__(self, x):
    positions = jnp.arange(0, x.shape[1])[None, :]
    position_embedding = self.pos_emb(positions)
    token_embedding = self.token_emb(x)
    return token_embedding + position_embedding


class MiniGPT(nnx.Module):
  def __init__(self, maxlen: int, vocab_size: int, embed_dim: int, num_heads: int,
               feed_forward_dim: int, num_transformer_blocks: int, rngs: nnx.Rngs):
    self.embedding_layer = TokenAndPositionEmbedding(maxlen, vocab_size, embed_dim, rngs=rngs)
    self.transformer_blocks = nnx.List([TransformerBlock(
        embed_dim, num_heads, feed_forward_dim, rngs=rngs
    ) for _ in range(num_transformer_blocks)])
    self.output_layer = nnx.Linear(in_features=embed_dim, out_features=vocab_size,
                                   kernel_init=nnx.initializers.xavier_uniform(),
                                   bias_init=nnx.initializers.zeros_init(), rngs=rngs)

  def __call__(self, inputs, training: bool = False):
    x = self.embedding_layer(inputs)
    for transformer_block in self.transformer_blocks:
      x = transformer_block(x, training=training)
    outputs = self.output_layer(x)
    return outputs


# ----------------------------------------------------------------------------- the declaration


@dataclasses.dataclass
class MiniGPTConfig:
  vocab_size: int = 256
  max_seq_len: int = 64       # the tutorial's maxlen
  embed_dim: int = 32
  num_heads: int = 4
  feed_forward_dim: int = 64
  num_transformer_blocks: int = 2


def _build(c: MiniGPTConfig, run_config) -> NNXLanguageModel:
  return NNXLanguageModel("minigpt", c, lambda rngs: MiniGPT(
      c.max_seq_len, c.vocab_size, c.embed_dim, c.num_heads, c.feed_forward_dim,
      c.num_transformer_blocks, rngs=rngs))


MINIGPT = ModelFamily(name="minigpt", config=MiniGPTConfig, build=_build,
                      label="the JAX AI Stack tutorial's MiniGPT (Flax NNX)")
