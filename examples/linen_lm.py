"""A small Flax Linen transformer trained with the stablejax stack in a plain ``jax.jit`` step.

    python examples/linen_lm.py                    # 300 steps, about a minute on a laptop CPU
    python examples/linen_lm.py --steps 40 --d-model 32

The model is written the way Flax's docs write one (``nn.Embed``,
``nn.MultiHeadDotProductAttention``, ``nn.Dense``, ``nn.LayerNorm``, and an unnamed
``nn.Dense(vocab)`` head at the end, auto-named ``Dense_0``) and knows nothing about stablejax.
It learns to predict the bytes of this file. The optimizer is the README's full chain; the
routing table shows which parameter goes to Muon and which to AdamW, at which learning rate,
and notes that the unnamed head was recognised by its shape.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import stablejax
from _shared import batches, print_progress, size_arguments


class Block(nn.Module):
  heads: int

  @nn.compact
  def __call__(self, x):
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
    x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(nn.LayerNorm()(x), mask=mask)
    h = nn.gelu(nn.Dense(4 * x.shape[-1])(nn.LayerNorm()(x)))
    return x + nn.Dense(x.shape[-1])(h)


class LM(nn.Module):
  vocab: int
  d_model: int
  heads: int
  layers: int
  max_len: int

  @nn.compact
  def __call__(self, tokens):
    pos = self.param("pos_embedding", nn.initializers.normal(0.02), (self.max_len, self.d_model))
    x = nn.Embed(self.vocab, self.d_model)(tokens) + pos[:tokens.shape[1]]
    for _ in range(self.layers):
      x = Block(self.heads)(x)
    return nn.Dense(self.vocab)(nn.LayerNorm()(x))


def make_train_step(model, tx):
  """``train_step(params, opt_state, x, y) -> (params, opt_state, loss)``, jitted."""

  @jax.jit
  def train_step(params, opt_state, x, y):
    def loss_fn(params):
      logits = model.apply({"params": params}, x)
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params, loss=loss)  # loss= feeds skip_spikes
    return optax.apply_updates(params, updates), opt_state, loss

  return train_step


def main(argv=None):
  args = size_arguments(__doc__.split("\n")[0], argv)  # --steps, --d-model, ..., --seq-len

  model = LM(256, args.d_model, args.heads, args.layers, args.seq_len)
  data = batches(__file__, args.batch, args.seq_len)
  params = model.init(jax.random.key(0), next(data)[0])["params"]

  def schedule(peak: float) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(0.0, peak, 20, args.steps)

  tx = stablejax.skip_nonfinite(
      stablejax.skip_spikes(
          optax.chain(
              stablejax.zclip(),
              stablejax.outlier_safe_muon(learning_rate=schedule(0.02),
                                          adam_learning_rate=schedule(3e-3)),
          )),
      max_consecutive=16)
  opt_state = tx.init(params)
  print(stablejax.describe_routing(params, tx))
  train_step = make_train_step(model, tx)

  losses = []
  for step in range(1, args.steps + 1):
    params, opt_state, loss = train_step(params, opt_state, *next(data))
    losses.append(float(loss))
    if step % 20 == 0 or step == args.steps:
      metrics = stablejax.stability_metrics(opt_state)  # a flat dict of arrays
      print_progress(step, losses, metrics)  # the loss and the defences' counters
  first, last = np.mean(losses[:5]), np.mean(losses[-5:])
  print(f"loss {first:.3f} -> {last:.3f}")


if __name__ == "__main__":
  main()
