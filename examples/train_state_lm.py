"""Flax's TrainState loop, as most Flax examples write it, with the stablejax stack.

    python examples/train_state_lm.py              # 200 steps
    python examples/train_state_lm.py --steps 30

Two ways, both with the README's chain:

* ``state.apply_gradients(grads=grads)``, Flax's own method, unchanged. It passes no ``loss=`` to
  the optimizer, so ``skip_spikes`` (with its default ``watch=None``) watches the gradient norm
  alone: a loss spike whose gradient norm stays in range goes through.
* ``stablejax.apply_gradients(state, grads=grads, loss=loss)``: the same step that also hands
  ``loss=`` (and ``max_logits=`` for QK-clip) to the optimizer, so both signals are watched.

The learning rate is injected with ``optax.inject_hyperparams`` and lowered at run time halfway
through, the usual way to change a rate without rebuilding the optimizer.
"""

import argparse

import flax.linen as nn
import jax
import optax
from flax.training import train_state

import stablejax
from _shared import batches  # the bytes of this script, in random windows


class LM(nn.Module):
  vocab: int = 256
  d_model: int = 64
  heads: int = 4

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(self.vocab, self.d_model)(tokens)
    mask = nn.make_causal_mask(tokens)
    x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(nn.LayerNorm()(x), mask=mask)
    x = x + nn.Dense(self.d_model)(nn.gelu(nn.Dense(4 * self.d_model)(nn.LayerNorm()(x))))
    return nn.Dense(self.vocab)(nn.LayerNorm()(x))


def make_optimizer() -> optax.GradientTransformation:
  muon = optax.inject_hyperparams(stablejax.outlier_safe_muon)(
      learning_rate=0.02, adam_learning_rate=3e-3)   # rates changed at run time, see below
  return stablejax.skip_nonfinite(stablejax.skip_spikes(optax.chain(
      stablejax.hybrid_clip(), muon)), max_consecutive=16)


def set_learning_rates(state: train_state.TrainState, scale: float) -> train_state.TrainState:
  """Multiplies the injected rates in place of rebuilding the optimizer."""
  def scaled(node):
    if isinstance(node, optax.InjectHyperparamsState):
      rates = {k: v * scale if k.endswith("learning_rate") else v
               for k, v in node.hyperparams.items()}
      return node._replace(hyperparams=rates)
    return node
  opt_state = jax.tree.map(scaled, state.opt_state,
                           is_leaf=lambda n: isinstance(n, optax.InjectHyperparamsState))
  return state.replace(opt_state=opt_state)


def train(steps: int = 200, d_model: int = 64, seq_len: int = 64, batch_size: int = 16,
          pass_loss: bool = True, seed: int = 0, verbose: bool = True) -> list:
  """Trains and returns the losses (the test suite calls this at small sizes)."""
  model = LM(d_model=d_model)
  data = batches(__file__, batch_size, seq_len, seed)
  x, _ = next(data)
  state = train_state.TrainState.create(
      apply_fn=model.apply, params=model.init(jax.random.key(seed), x)["params"],
      tx=make_optimizer())

  @jax.jit
  def train_step(state, x, y):
    def loss_fn(params):
      logits = state.apply_fn({"params": params}, x)
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    if pass_loss:
      state = stablejax.apply_gradients(state, grads=grads, loss=loss)   # loss= feeds skip_spikes
    else:
      state = state.apply_gradients(grads=grads)   # Flax's own: the gradient norm is watched
    return state, loss

  losses = []
  for step in range(steps):
    if step == steps // 2:
      state = set_learning_rates(state, 0.5)
    x, y = next(data)
    state, loss = train_step(state, x, y)
    losses.append(float(loss))
    if verbose and (step % 20 == 0 or step == steps - 1):
      skips = int(stablejax.stability_metrics(state.opt_state)["skip_spikes/total_skips"])
      print(f"step {step:4d}  loss {losses[-1]:.3f}  spike skips {skips}")
  return losses


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--flax-apply-gradients", action="store_true",
                      help="step with TrainState.apply_gradients (no loss= to the optimizer)")
  args = parser.parse_args()
  train(args.steps, pass_loss=not args.flax_apply_gradients)
