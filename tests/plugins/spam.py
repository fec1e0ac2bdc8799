"""A SPAM-style defence as a user writes one: it reads and resets the optimizer's moments, so it is
a wrapper (docs/development.md, "A defence that touches the optimizer's state").

SPAM (Huang et al., "SPAM: Spike-Aware Adam with Momentum Reset for Stable LLM Training", ICLR
2025, arXiv 2501.06842): a gradient entry whose square exceeds ``theta`` times Adam's second
moment is clipped to ``sign(g) sqrt(theta v)``, and the moments are reset to zero every
``reset_every`` steps. Here whatever the optimizer: Adam's groups have a second moment and are
clipped; every momentum (Muon's too) is reset; an optimizer without moments is left alone.

    python -m stablejax train --plugin tests/plugins/spam.py --set stability.spam.enabled=true
"""

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from stablejax.transforms import defence, metrics
from stablejax.transforms.moments import map_moments, parameter_moments


class SpamState(NamedTuple):
  count: jax.Array      # int32 steps
  clipped: jax.Array    # float32 fraction of the last step's gradient entries clipped
  resets: jax.Array     # int32 moment resets so far
  inner_state: Any


def spam(inner: optax.GradientTransformation, theta: float = 5000.0,
         reset_every: int = 500) -> optax.GradientTransformationExtraArgs:
  """``inner`` with SPAM's spike-aware clipping before it and its moment reset after it."""
  inner = optax.with_extra_args_support(inner)

  def init(params):
    return SpamState(jnp.zeros([], jnp.int32), jnp.zeros([], jnp.float32),
                     jnp.zeros([], jnp.int32), inner.init(params))

  def update(grads, state, params=None, **extra):
    second = parameter_moments(state.inner_state, grads, "nu")

    def clip(g, v):
      if v is None:  # no second moment for this parameter (Muon's matrices)
        return g, jnp.zeros([], jnp.float32)
      spike = (jnp.square(g) > theta * v) & (v > 0)
      clipped = jnp.where(spike, jnp.sign(g) * jnp.sqrt(theta * v), g)
      return clipped, jnp.sum(spike, dtype=jnp.float32)
    pairs = jax.tree.map(clip, grads, second, is_leaf=lambda x: x is None)
    clipped = jax.tree.map(lambda _, p: p[0], grads, pairs)
    count_clipped = sum(jax.tree.leaves(jax.tree.map(lambda _, p: p[1], grads, pairs)))
    entries = sum(g.size for g in jax.tree.leaves(grads))
    updates, inner_state = inner.update(clipped, state.inner_state, params, **extra)
    count = state.count + 1
    reset = count % reset_every == 0
    inner_state = map_moments(inner_state, lambda kind, path, x: jnp.where(reset, 0, x))
    return updates, SpamState(count, count_clipped / entries,
                              state.resets + reset.astype(jnp.int32), inner_state)

  return optax.GradientTransformationExtraArgs(init, update)


metrics.register_state_metrics(
    SpamState, "spam", lambda s: {"clipped": s.clipped, "resets": s.resets},
    rates=(metrics.Rate("spam_clip_rate", flag="clipped", label="SPAM-clipped entries"),))


@dataclasses.dataclass
class SpamConfig:
  enabled: bool = False
  theta: float = 5000.0
  reset_every: int = 500

  def validate(self, where, ctx):
    if not self.theta > 0 or self.reset_every < 1:
      raise ValueError(f"{where}.theta must be > 0 and {where}.reset_every >= 1")


SPAM = defence.Defence(
    name="spam", config=SpamConfig, position=defence.Position.WRAPPER, order=5,
    build=lambda section, ctx: lambda inner: spam(inner, section.theta, section.reset_every),
    label="SPAM (spike-aware clipping, moment reset)")
