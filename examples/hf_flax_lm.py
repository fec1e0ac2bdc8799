"""A Hugging Face Flax model (transformers 4.x) trained with the stablejax stack and QK-clip.

    python examples/hf_flax_lm.py                     # GPT-2, 100 steps
    python examples/hf_flax_lm.py --family llama --steps 30

The model is ``transformers``' own Flax class built from a small config (random weights; nothing
is downloaded) and is not edited: its attention calls ``dot_product_attention_weights`` itself,
so the per-head maximum logits come from Flax's ``capture_intermediates`` through
``stablejax.hf_attention_probe(model.config)`` (GPT-2's fused ``c_attn``; the queries and keys
after RoPE for Llama, Mistral and Gemma; GPT-Neo's unscaled logits). ``stablejax.qk_clip``
reads the head counts from the same config. The routing table shows GPT-2's fused ``c_attn``
orthogonalised per projection and its ``Conv1D`` kernels read as ``[out, in]``.
"""

import argparse
import warnings

import jax
import jax.numpy as jnp
import optax
import transformers

import stablejax
from _shared import batches  # the bytes of this script, in random windows

CONFIGS = {
    "gpt2": lambda d, layers: transformers.GPT2Config(
        vocab_size=256, n_positions=64, n_embd=d, n_layer=layers, n_head=4, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0),
    "gpt_neo": lambda d, layers: transformers.GPTNeoConfig(
        vocab_size=256, max_position_embeddings=64, hidden_size=d, num_layers=layers,
        num_heads=4, attention_types=[[["global"], layers]], resid_dropout=0.0,
        embed_dropout=0.0, attention_dropout=0.0),
    "llama": lambda d, layers: transformers.LlamaConfig(
        vocab_size=256, hidden_size=d, intermediate_size=2 * d, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64),
}
MODELS = {"gpt2": "FlaxGPT2LMHeadModel", "gpt_neo": "FlaxGPTNeoForCausalLM",
          "llama": "FlaxLlamaForCausalLM"}


def make_train_step(model, probe, tx):
  """``train_step(params, opt_state, x, y) -> (params, opt_state, loss)``, jitted: one forward
  pass gives the loss and, through ``probe``, the per-head max logits that QK-clip reads."""

  @jax.jit
  def train_step(params, opt_state, x, y):
    mask, positions = jnp.ones_like(x), jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape)

    def loss_fn(params):
      out, max_logits = probe.apply(model.module, {"params": params}, x, mask, positions)
      loss = optax.softmax_cross_entropy_with_integer_labels(out.logits, y).mean()
      return loss, max_logits

    (loss, max_logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params, loss=loss, max_logits=max_logits)
    return optax.apply_updates(params, updates), opt_state, loss

  return train_step


def train(family: str = "gpt2", steps: int = 100, d_model: int = 64, layers: int = 2,
          seq_len: int = 32, batch_size: int = 8, tau: float = 30.0,
          verbose: bool = True) -> list:
  """Trains and returns the losses."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # transformers' notice that its Flax classes are deprecated
    model = getattr(transformers, MODELS[family])(CONFIGS[family](d_model, layers), seed=0)
  params = model.params
  probe = stablejax.hf_attention_probe(model.config)
  tx = stablejax.skip_nonfinite(stablejax.skip_spikes(optax.chain(
      stablejax.hybrid_clip(),
      stablejax.outlier_safe_muon(learning_rate=0.02, adam_learning_rate=3e-3),
      stablejax.qk_clip(tau, config=model.config),   # last: after every learning rate
  )), max_consecutive=16)
  opt_state = tx.init(params)
  if verbose:
    print(stablejax.describe_routing(params, tx))
  train_step = make_train_step(model, probe, tx)

  losses = []
  data = batches(__file__, batch_size, seq_len)
  for step in range(steps):
    x, y = next(data)
    params, opt_state, loss = train_step(params, opt_state, x, y)
    losses.append(float(loss))
    if verbose and (step % 20 == 0 or step == steps - 1):
      m = stablejax.stability_metrics(opt_state)
      print(f"step {step:4d}  loss {losses[-1]:.3f}  "
            f"max logit {float(m['qk_clip/max_logit']):.2f}  "
            f"heads clipped {int(m['qk_clip/total_clipped'])}")
  return losses


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--family", choices=sorted(CONFIGS), default="gpt2")
  parser.add_argument("--steps", type=int, default=100)
  parser.add_argument("--d-model", type=int, default=64)
  parser.add_argument("--layers", type=int, default=2)
  args = parser.parse_args()
  train(args.family, args.steps, args.d_model, args.layers)
