"""A defence that reads and resets the optimizer's moments (transforms/moments.py), as a user
writes one: tests/plugins/spam.py, checked against SPAM's rule re-derived with numpy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from helpers import PLUGINS, load_plugin


@pytest.fixture(scope="module")
def spam_module():
  from stablejax.transforms import defence, metrics
  module = load_plugin("spam")
  yield module
  defence.unregister("spam")
  metrics.unregister_state_metrics(module.SpamState)


def test_spam_clips_against_adams_second_moment_and_resets_the_moments(spam_module):
  params = {"w": jnp.zeros(4), "v": jnp.zeros(3)}
  grads = [{"w": jnp.array([1.0, -1.0, 0.5, 0.2]), "v": jnp.array([0.1, 0.2, 0.3])},
           {"w": jnp.array([0.9, -1.1, 0.4, 0.3]), "v": jnp.array([0.1, 0.2, 0.3])},
           {"w": jnp.array([50.0, -1.0, -40.0, 0.2]), "v": jnp.array([0.1, 9.0, 0.3])}]
  theta, b2 = 4.0, 0.99
  adam = optax.adam(0.01, b2=b2)
  tx = spam_module.spam(adam, theta=theta, reset_every=3)
  state, reference = tx.init(params), adam.init(params)
  nu = {k: np.zeros(np.shape(p)) for k, p in params.items()}
  for step, g in enumerate(grads, start=1):
    # numpy: an entry with g^2 > theta * nu (Adam's second moment before this step) is clipped
    want = {k: np.where((np.square(g[k]) > theta * nu[k]) & (nu[k] > 0),
                        np.sign(g[k]) * np.sqrt(theta * nu[k]), g[k]) for k in g}
    updates, state = jax.jit(tx.update)(g, state, params)
    expected, reference = adam.update(jax.tree.map(jnp.asarray, want), reference, params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), updates, expected)
    clipped = sum(int(np.sum(want[k] != np.asarray(g[k]))) for k in g)
    assert float(state.clipped) == pytest.approx(clipped / 7)
    nu = {k: b2 * nu[k] + (1 - b2) * np.square(want[k]) for k in nu}
  assert float(state.clipped) > 0 and int(state.resets) == 1  # step 3: spikes, then the reset
  adam_state = state.inner_state[0]
  assert all(float(jnp.abs(x).max()) == 0 for x in jax.tree.leaves((adam_state.mu, adam_state.nu)))
  assert int(adam_state.count) == 3  # only the moments are reset


def test_the_moments_are_found_inside_the_trainers_chain_whatever_the_optimizer(spam_module):
  # outlier_safe_muon's groups (the AdamW groups have both moments, Muon's matrices a momentum
  # only), AdamW, and an optimizer without a second moment (Lion).
  from stablejax.training.config import load_config
  from stablejax.training.optim import build_optimizer
  from stablejax.transforms.moments import has_moments, parameter_moments
  params = {"embed": {"embedding": jnp.ones((16, 8))}, "block": {"kernel": jnp.ones((8, 8)),
                                                                   "scale": jnp.ones(8)},
            "lm_head": {"kernel": jnp.ones((8, 16))}}
  for name, second in (("muon", {"block/kernel": False, "block/scale": True,
                                 "embed/embedding": True, "lm_head/kernel": True}),
                       ("adamw", dict.fromkeys(("block/kernel", "block/scale", "embed/embedding",
                                                "lm_head/kernel"), True))):
    cfg = load_config(None, [f"optimizer.name={name}", "train.steps=10", "train.warmup_steps=2",
                             "stability.spam.enabled=true"], plugins=[str(PLUGINS / "spam.py")])
    state = jax.eval_shape(build_optimizer(cfg).init, params)
    first = parameter_moments(state, params, "mu")
    nu = parameter_moments(state, params, "nu")
    flat = {"/".join(str(k.key) for k in path): leaf
            for path, leaf in jax.tree_util.tree_leaves_with_path(nu, is_leaf=lambda x: x is None)}
    assert {k: v is not None for k, v in flat.items()} == second, name
    assert all(x is not None for x in jax.tree.leaves(first, is_leaf=lambda x: x is None))
    assert "spam" in state  # the wrapper's own entry, keyed by its name
  lion = optax.lion(1e-3).init(params)
  assert has_moments(lion, "mu") and not has_moments(lion, "nu")
