"""The training loops people already have, as written: Flax's TrainState (its own
``apply_gradients(grads=...)``, which passes no ``loss=``, and ``stablejax.apply_gradients``), and
``optax.inject_hyperparams`` over every stablejax factory without ``static_args``."""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import stablejax
from stablejax.layout.heads import AttentionLayer, HeadParam

from helpers import load_example

train_state_lm = load_example("train_state_lm")

PARAMS = {"embed": jnp.ones((10, 4)), "q": jnp.eye(4), "k": jnp.eye(4), "b": jnp.zeros(4)}
LAYER = AttentionLayer("attn", 2, 2, (HeadParam("q", -1),), (HeadParam("k", -1),))
FACTORIES = {
    "zclip": (stablejax.zclip, {}),
    "adagc": (stablejax.adagc, {}),
    "hybrid_clip": (stablejax.hybrid_clip, {}),
    "skip_nonfinite": (stablejax.skip_nonfinite, {"inner": optax.sgd(0.1)}),
    "skip_spikes": (stablejax.skip_spikes, {"inner": optax.sgd(0.1)}),
    "outlier_safe_muon": (stablejax.outlier_safe_muon, {"learning_rate": 0.02}),
    "qk_clip": (stablejax.qk_clip, {"layers": [LAYER]}),
}


@pytest.mark.parametrize("name", FACTORIES)
def test_inject_hyperparams_over_every_factory_without_static_args(name):
  factory, kwargs = FACTORIES[name]
  injected = optax.inject_hyperparams(factory)(**kwargs)
  plain = factory(**kwargs)
  grads = jax.tree.map(lambda x: jnp.full(x.shape, 0.5), PARAMS)
  extra = {"loss": jnp.float32(1.0), "max_logits": {"attn": jnp.array([400.0, 1.0])}}
  plain = optax.with_extra_args_support(plain)
  s_inj, s_plain = injected.init(PARAMS), plain.init(PARAMS)
  # Both jitted: one program each (the plain one op by op compiled a program per operation).
  update_inj, update_plain = jax.jit(injected.update), jax.jit(plain.update)
  for _ in range(2):
    u_inj, s_inj = update_inj(grads, s_inj, PARAMS, **extra)
    u_plain, s_plain = update_plain(grads, s_plain, PARAMS, **extra)
    for a, b in zip(jax.tree.leaves(u_inj), jax.tree.leaves(u_plain)):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
  # integer hyperparameters that are shapes or loop counts are not injected
  assert not {"ns_steps", "window"} & set(s_inj.hyperparams)


@pytest.mark.slow
def test_flax_train_state_loop_as_written_trains_with_the_readme_chain():
  # Flax's own state.apply_gradients(grads=...): no loss= reaches skip_spikes, which then
  # watches the gradient norm; the injected rates are halved halfway through.
  losses = train_state_lm.train(steps=24, d_model=32, seq_len=32, batch_size=8,
                                pass_loss=False, verbose=False)
  assert np.all(np.isfinite(losses)) and np.mean(losses[-4:]) < np.mean(losses[:4]) - 1.0, losses


def test_apply_gradients_passes_loss_and_equals_flax_without_it():
  tx = stablejax.skip_spikes(optax.adam(0.1), window=4, min_history=2)
  params = {"w": jnp.ones(3)}
  ours = theirs = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
  for g in (1.0, 1.2, 0.9):
    grads = {"w": jnp.full(3, g)}
    ours = stablejax.apply_gradients(ours, grads=grads, loss=jnp.float32(2.0))
    theirs = theirs.apply_gradients(grads=grads)
  np.testing.assert_array_equal(ours.params["w"], theirs.params["w"])
  assert int(ours.step) == int(theirs.step) == 3
  assert int(ours.opt_state.loss_count) == 3 and int(theirs.opt_state.loss_count) == 0
  spiked = stablejax.apply_gradients(ours, grads={"w": jnp.ones(3)}, loss=jnp.float32(90.0))
  assert bool(spiked.opt_state.skipped)
  np.testing.assert_array_equal(spiked.params["w"], ours.params["w"])
  with pytest.raises(ValueError, match="apply_gradients: state has no 'step'"):
    stablejax.apply_gradients({"params": params}, grads=params)
