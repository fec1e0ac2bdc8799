"""A small Equinox GPT trained with the stablejax stack and QK-clip.

    python examples/equinox_lm.py                  # 200 steps, under a minute on a laptop CPU
    python examples/equinox_lm.py --steps 20 --d-model 32

Written the way Equinox code (Levanter and much JAX research code) writes a transformer: real
``eqx.nn`` modules (``Embedding``, ``MultiheadAttention``, ``Linear``, ``LayerNorm``, an untied
head), the blocks built once per layer with ``eqx.filter_vmap`` (every array gets a leading layer
axis) and run with ``jax.lax.scan``. Each block returns its attention's per-head maximum logit
(``stablejax.mha_with_max_logit``), the scan stacks them to ``[layers, heads]``, and
``stablejax.qk_clip`` takes them as ``max_logits``. The optimizer works on
``eqx.partition(model, eqx.is_array)``; ``eqx.nn.Linear`` stores its weight ``[out, in]``, which
the routing reads from the module type.
"""

import argparse

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import stablejax
from _shared import batches  # the bytes of this script, in random windows


class Block(eqx.Module):
  norm1: eqx.nn.LayerNorm
  attn: eqx.nn.MultiheadAttention
  norm2: eqx.nn.LayerNorm
  up: eqx.nn.Linear
  down: eqx.nn.Linear

  def __init__(self, d_model: int, heads: int, key: jax.Array):
    k1, k2, k3 = jax.random.split(key, 3)
    self.norm1 = eqx.nn.LayerNorm(d_model)
    self.attn = eqx.nn.MultiheadAttention(heads, d_model, key=k1)
    self.norm2 = eqx.nn.LayerNorm(d_model)
    self.up = eqx.nn.Linear(d_model, 4 * d_model, key=k2)
    self.down = eqx.nn.Linear(4 * d_model, d_model, key=k3)

  def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``x`` is ``[T, D]`` (one sequence); returns the new ``x`` and the max logits ``[H]``."""
    h = jax.vmap(self.norm1)(x)
    causal = jnp.tril(jnp.ones((x.shape[0], x.shape[0]), bool))
    a, max_logit = stablejax.mha_with_max_logit(self.attn, h, h, h, causal)
    x = x + a
    h = jax.vmap(self.norm2)(x)
    return x + jax.vmap(self.down)(jax.nn.gelu(jax.vmap(self.up)(h))), max_logit


class GPT(eqx.Module):
  embed: eqx.nn.Embedding
  pos_embed: eqx.nn.Embedding
  blocks: Block            # one Block whose arrays carry a leading [layers] axis
  norm: eqx.nn.LayerNorm
  head: eqx.nn.Linear

  def __init__(self, vocab: int, d_model: int, heads: int, layers: int, max_len: int,
               key: jax.Array):
    k1, k2, k3, k4 = jax.random.split(key, 4)
    self.embed = eqx.nn.Embedding(vocab, d_model, key=k1)
    self.pos_embed = eqx.nn.Embedding(max_len, d_model, key=k2)
    make = eqx.filter_vmap(lambda k: Block(d_model, heads, k))
    self.blocks = make(jax.random.split(k3, layers))
    self.norm = eqx.nn.LayerNorm(d_model)
    self.head = eqx.nn.Linear(d_model, vocab, use_bias=False, key=k4)

  def __call__(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``tokens`` is ``[T]``; returns logits ``[T, V]`` and max logits ``[layers, H]``."""
    x = jax.vmap(self.embed)(tokens) + jax.vmap(self.pos_embed)(jnp.arange(tokens.shape[0]))
    arrays, static = eqx.partition(self.blocks, eqx.is_array)

    def layer(x, block_arrays):
      return eqx.combine(block_arrays, static)(x)

    x, max_logits = jax.lax.scan(layer, x, arrays)
    return jax.vmap(self.head)(jax.vmap(self.norm)(x)), max_logits


def make_optimizer(steps: int, tau: float, heads: int) -> optax.GradientTransformation:
  muon_lr = optax.warmup_cosine_decay_schedule(0.0, 0.02, max(1, steps // 10), steps)
  adam_lr = optax.warmup_cosine_decay_schedule(0.0, 3e-3, max(1, steps // 10), steps)
  return stablejax.skip_nonfinite(stablejax.skip_spikes(optax.chain(
      stablejax.hybrid_clip(),
      stablejax.outlier_safe_muon(learning_rate=muon_lr, adam_learning_rate=adam_lr),
      stablejax.qk_clip(tau, num_heads=heads),       # last: after every learning rate
  )), max_consecutive=16)


def train(steps: int = 200, d_model: int = 64, heads: int = 4, layers: int = 2,
          seq_len: int = 64, batch_size: int = 16, tau: float = 30.0, log_every: int = 20,
          seed: int = 0, verbose: bool = True) -> list:
  """Trains and returns the losses (the test suite calls this at small sizes)."""
  model = GPT(256, d_model, heads, layers, seq_len, jax.random.key(seed))
  params, static = eqx.partition(model, eqx.is_array)
  tx = make_optimizer(steps, tau, heads)
  opt_state = tx.init(params)
  if verbose:
    print(stablejax.describe_routing(params, tx))

  @jax.jit
  def train_step(params, opt_state, x, y):
    def loss_fn(params):
      logits, max_logits = jax.vmap(eqx.combine(params, static))(x)   # [B, T, V], [B, L, H]
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
      return loss, {"blocks/attn": max_logits.max(axis=0)}            # [L, H]: layers stacked
    (loss, max_logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params, loss=loss, max_logits=max_logits)
    return eqx.apply_updates(params, updates), opt_state, loss

  losses = []
  data = batches(__file__, batch_size, seq_len, seed)
  for step in range(steps):
    x, y = next(data)
    params, opt_state, loss = train_step(params, opt_state, x, y)
    losses.append(float(loss))
    if verbose and (step % log_every == 0 or step == steps - 1):
      metrics = stablejax.stability_metrics(opt_state)
      print(f"step {step:4d}  loss {losses[-1]:.3f}  "
            f"max logit {float(metrics['qk_clip/max_logit']):.2f}  "
            f"heads clipped {int(metrics['qk_clip/total_clipped'])}")
  return losses


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--d-model", type=int, default=64)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument("--tau", type=float, default=30.0)
  args = parser.parse_args()
  train(args.steps, args.d_model, args.heads, args.layers, tau=args.tau)
