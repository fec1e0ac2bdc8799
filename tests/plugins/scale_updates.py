"""A defence outside the package, as a user writes one (docs/development.md, "Adding a
defence"): its transform and state (optax's shape), its metrics and its declaration. Used with
``python -m stablejax train --plugin scale_updates --set stability.scale_updates.enabled=true``.
"""

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from stablejax.transforms import defence, metrics


class ScaleUpdatesState(NamedTuple):
  steps: jax.Array    # int32 updates scaled so far
  scaled: jax.Array   # bool: this step's update was scaled


def scale_updates(factor: float = 0.5) -> optax.GradientTransformation:
  """Multiplies every update by ``factor`` (a stand-in for a real defence's rule)."""
  def init(params):
    return ScaleUpdatesState(jnp.zeros([], jnp.int32), jnp.zeros([], bool))

  def update(updates, state, params=None):
    return (jax.tree.map(lambda u: u * factor, updates),
            ScaleUpdatesState(state.steps + 1, jnp.asarray(True)))
  return optax.GradientTransformation(init, update)


metrics.register_state_metrics(
    ScaleUpdatesState, "scale_updates", lambda s: {"steps": s.steps, "scaled": s.scaled},
    rates=(metrics.Rate("scale_updates_rate", flag="scaled", counter="steps",
                        label="scaled updates"),))


@dataclasses.dataclass
class ScaleUpdatesConfig:
  enabled: bool = False
  factor: float = 0.5

  def validate(self, where, ctx):
    if not 0 < self.factor <= 1:
      raise ValueError(f"{where}.factor={self.factor} must lie in (0, 1]")


SCALE_UPDATES = defence.Defence(
    name="scale_updates", config=ScaleUpdatesConfig, position=defence.Position.UPDATE,
    factory=scale_updates, label="scale every update")
