"""A small Flax NNX transformer trained with the stablejax stack through ``nnx.Optimizer``.

    python examples/nnx_lm.py                      # 300 steps, about a minute on a laptop CPU
    python examples/nnx_lm.py --steps 40 --d-model 32

The model is written the way Flax's docs write one (``nnx.Embed``, ``nnx.MultiHeadAttention``,
``nnx.Linear``, ``nnx.LayerNorm``, an untied ``self.out`` head) and knows nothing about stablejax.
It learns to predict the bytes of this file. The optimizer is the README's full chain; the
routing table shows which parameter goes to Muon and which to AdamW, at which learning rate.
"""

import numpy as np
import optax
from flax import nnx

import stablejax
from _shared import batches, print_progress, size_arguments


class Block(nnx.Module):
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


class LM(nnx.Module):
  def __init__(self, vocab: int, d_model: int, heads: int, layers: int, max_len: int,
               rngs: nnx.Rngs):
    self.embed = nnx.Embed(vocab, d_model, rngs=rngs)
    self.pos_embed = nnx.Param(0.02 * nnx.initializers.normal()(rngs.params(), (max_len, d_model)))
    self.blocks = nnx.List([Block(d_model, heads, rngs) for _ in range(layers)])
    self.ln_f = nnx.LayerNorm(d_model, rngs=rngs)
    self.out = nnx.Linear(d_model, vocab, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens) + self.pos_embed[:tokens.shape[1]]
    for block in self.blocks:
      x = block(x)
    return self.out(self.ln_f(x))


def main(argv=None):
  args = size_arguments(__doc__.split("\n")[0], argv)  # --steps, --d-model, ..., --seq-len

  model = LM(256, args.d_model, args.heads, args.layers, args.seq_len, nnx.Rngs(0))

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
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  print(stablejax.describe_routing(nnx.state(model, nnx.Param), tx))

  @nnx.jit
  def train_step(model, optimizer, x, y):
    def loss_fn(model):
      return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads, loss=loss)  # loss= feeds the spike check
    return loss, stablejax.stability_metrics(nnx.as_pure(optimizer.opt_state))

  data = batches(__file__, args.batch, args.seq_len)
  losses = []
  for step in range(1, args.steps + 1):
    loss, metrics = train_step(model, optimizer, *next(data))
    losses.append(float(loss))
    if step % 20 == 0 or step == args.steps:
      print_progress(step, losses, metrics)  # the loss and the defences' counters
  first, last = np.mean(losses[:5]), np.mean(losses[-5:])
  print(f"loss {first:.3f} -> {last:.3f}")


if __name__ == "__main__":
  main()
