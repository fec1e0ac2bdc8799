"""A user's optimizer declared in one file (tests/plugins/optax_muon.py: optax's own Muon) is
built by the trainer with the run's schedules and routing: Muon's orthogonalised step for the
hidden matrices, Adam's for the rest, its state under its name."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import PLUGINS, load_plugin


@pytest.fixture(scope="module")
def optax_muon():
  from stablejax.training.config import optimizers
  module = load_plugin("optax_muon")
  yield module
  optimizers.unregister("optax_muon")


def test_a_plugin_optimizer_is_routed_like_muon_and_its_state_sits_under_its_name(optax_muon):
  from stablejax.training.config import load_config
  from stablejax.training.optim import build_optimizer, learning_rates
  cfg = load_config(None, ["optimizer.name=optax_muon", "optimizer.learning_rate=0.02",
                           "optimizer.adam_learning_rate=0.004", "optimizer.consistent_rms=null",
                           "train.steps=10", "train.warmup_steps=0", "model.qk_norm=false"],
                    plugins=[str(PLUGINS / "optax_muon.py")])
  assert type(cfg.optimizer) is optax_muon.OptaxMuonConfig and cfg.optimizer.nesterov
  assert learning_rates(cfg) == {"muon": 0.02, "adam": 0.004}
  rng = np.random.default_rng(0)
  params = {"embed": {"embedding": jnp.ones((32, 16))},
            "blocks_0": {"mlp": {"kernel": jnp.ones((16, 24))}, "norm": {"scale": jnp.ones(16)}},
            "lm_head": {"kernel": jnp.ones((16, 32))}}
  grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
  tx = build_optimizer(cfg)
  state = tx.init(params)
  assert "optax_muon" in state["optimizer"]  # resumable: the key says whose state it is
  updates, _ = jax.jit(tx.update)(grads, state, params)
  # Adam's first step moves every entry by the rate (bias-corrected m / sqrt(v) = sign(g)),
  # times Nesterov's look-ahead (optax's muon passes nesterov to its Adam): the step's moment is
  # b1 m_hat(2) + (1 - b1) g / (1 - b1) = g (1 + b1 / (1 + b1)) with b1 = 0.9.
  nesterov = 1 + 0.9 / 1.9
  for path in (("embed", "embedding"), ("blocks_0", "norm", "scale"), ("lm_head", "kernel")):
    u, g = updates, grads
    for key in path:
      u, g = u[key], g[key]
    want = -0.004 * nesterov * np.sign(np.asarray(g))
    np.testing.assert_allclose(np.asarray(u), want, rtol=2e-3)  # eps against small entries
  # Muon's: the hidden matrix's step is near-orthogonal, its singular values about lr (NS5 puts
  # them within about [0.7, 1.2]) times optax's shape factor sqrt(max(1, fan_out / fan_in)) for
  # the (16, 24) kernel; the raw gradient's spread far wider.
  scale = 0.02 * np.sqrt(24 / 16)
  singular = np.linalg.svd(np.asarray(updates["blocks_0"]["mlp"]["kernel"]), compute_uv=False)
  assert 0.6 * scale < singular.min() and singular.max() < 1.25 * scale, singular / scale
  raw = np.linalg.svd(np.asarray(grads["blocks_0"]["mlp"]["kernel"]), compute_uv=False)
  assert raw.max() / raw.min() > 3 * singular.max() / singular.min()
