"""When to roll back, where to, and the learning-rate backoff after it.

Triggers (host side, fed with fetched metrics records at log and eval steps, so every process of
a multi-host run takes the same decision from the same numbers):
- a rollback request from skip_nonfinite or skip_spikes (`max_consecutive_skips` skipped steps in
  a row): the wrappers count requests (their metrics' ``rollback`` counter), so a burst of skips
  that ended between two logged steps is still seen;
- a parameter that became non-finite;
- divergence of the train loss: the last `loss_window` logged losses in a row are all non-finite
  or above `loss_explosion_factor` x the best median of `loss_window` logged losses so far. A bump
  that comes back under that line within the window is transient and does not trigger;
- a non-finite validation loss.

The action (carried out by the training loop): restore the newest checkpoint (one further back
when the previous rollback already returned to it and no newer checkpoint was saved since),
multiply the LR scale in effect by `emergency_lr_factor`, let it return to 1.0 over
`lr_recovery_steps` steps, and skip the data batches read since the target checkpoint (when it
is damaged and an older one is restored, the batches in between are replayed first).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from stablejax.monitor.specs import rollback_request_counts
from stablejax.training.config import StabilitySections


@dataclasses.dataclass
class RollbackEvent:
  step: int            # step at which the trigger was seen
  cause: str
  restored_step: int = -1
  lr_scale: float = 1.0  # LR scale right after the rollback (it then returns to 1.0)
  skipped_batches: tuple[int, int] = (0, 0)  # [first, last) data batch indices skipped
  reproduced: Optional[bool] = None  # a replay reproduced the failure (None: not replayed)

  def describe(self) -> str:
    a, b = self.skipped_batches
    replayed = " (reproduced by its replay)" if self.reproduced else ""
    return (f"step {self.step}: {self.cause}{replayed}; restored step {self.restored_step}, "
            f"lr scale {self.lr_scale:.3g}, skipped data batches {a}..{b - 1}")


@dataclasses.dataclass
class TransientEvent:
  """A failure that a replay of its window did not reproduce (a device fault, not the data's)."""
  step: int            # step at which the trigger was seen
  cause: str
  restored_step: int
  device: str          # the suspect: "process 0 (host), device cpu:0", or what is known

  def describe(self) -> str:
    return (f"step {self.step}: {self.cause}; replayed from step {self.restored_step}: not "
            f"reproduced ({self.device})")


class LRBackoff(NamedTuple):
  """The learning-rate backoff of the latest rollback, or a re-warmup, kept in the train state (so
  in checkpoints).

  Attributes:
    scale: float32 LR scale right after the rollback (1.0: no backoff; 0.0: a re-warmup).
    start: int32 step the return to 1.0 starts from (the restored step).
    steps: int32 length of a return of its own, linear (a re-warmup); -1: the recovery's
      ``lr_recovery_steps`` and ``lr_recovery_schedule``.
  """
  scale: jax.Array
  start: jax.Array
  steps: jax.Array

  @classmethod
  def none(cls) -> "LRBackoff":
    return cls(scale=jnp.ones((), jnp.float32), start=jnp.zeros((), jnp.int32),
               steps=jnp.full((), -1, jnp.int32))


def backoff_lr_scale(backoff: LRBackoff, step: jax.Array, recovery_steps: Optional[int],
                     schedule: str = "linear") -> jax.Array:
  """LR scale at `step`: `backoff.scale` at `backoff.start`, back to 1.0 after `recovery_steps`
  (or, for a backoff with ``steps >= 0``, linearly over its own ``steps``).

  "linear" interpolates the scale, "geometric" its logarithm (equal ratios per step, so most of
  the way back is made late). `recovery_steps=None` keeps the backed-off scale for good.
  """
  count = step - backoff.start
  own_fraction = jnp.clip(count / jnp.maximum(backoff.steps, 1), 0.0, 1.0)
  own = backoff.scale + (1.0 - backoff.scale) * own_fraction
  if recovery_steps is None:
    configured = backoff.scale
  elif schedule == "linear":
    configured = jnp.asarray(optax.linear_schedule(backoff.scale, 1.0, recovery_steps)(count))
  elif schedule == "geometric":
    configured = jnp.exp(optax.linear_schedule(jnp.log(backoff.scale), 0.0, recovery_steps)(count))
  else:
    raise ValueError(f"unknown LR recovery schedule {schedule!r}: use 'linear' or 'geometric'")
  return jnp.where(backoff.steps >= 0, own, configured).astype(jnp.float32)


class Recovery:
  """Watches logged values, says when training must roll back and to which checkpoint."""

  def __init__(self, stability: StabilitySections):
    """``stability``: the config's ``stability`` section (its ``recovery`` settings, and the skip
    wrappers' ``max_consecutive`` for the messages)."""
    self.stability = stability
    self.cfg = stability.recovery
    self.window = max(1, self.cfg.loss_window)
    self.recent: collections.deque = collections.deque(maxlen=self.window)  # losses not elevated
    self.best_loss_median = math.inf
    self.elevated_run = 0        # logged train losses in a row above the line (or non-finite)
    self.acknowledged: dict[str, int] = {}  # rollback requests already in the current state
    self.events: list[RollbackEvent] = []
    self.transients: list[TransientEvent] = []

  @property
  def rollbacks(self) -> int:
    return len(self.events)

  @property
  def budget_left(self) -> bool:
    return self.rollbacks < self.cfg.max_rollbacks

  def acknowledge(self, state_metrics: dict) -> None:
    """Takes the rollback requests counted in a restored (or initial) state as handled."""
    self.acknowledged = rollback_request_counts(state_metrics)

  def _elevated(self, loss: float) -> bool:
    return not math.isfinite(loss) or loss > self.cfg.loss_explosion_factor * self.best_loss_median

  def check_train(self, record: dict) -> Optional[str]:
    """Returns the cause of a needed rollback, or None. `record` is one fetched metrics record."""
    for key, count in sorted(rollback_request_counts(record).items()):
      if count > self.acknowledged.get(key, 0):
        wrapper = key.rsplit("/", 1)[0]
        limit = getattr(getattr(self.stability, wrapper, None), "max_consecutive", None)
        setting = f" (stability.{wrapper}.max_consecutive={limit})" if limit is not None else ""
        return f"{wrapper}: too many skipped steps in a row{setting}"
    if not bool(record.get("params_finite", True)):
      return "a parameter became non-finite"
    loss = float(record["loss"])
    if self._elevated(loss):
      self.elevated_run += 1
    else:
      self.elevated_run = 0
      self.recent.append(loss)
      if len(self.recent) == self.window:
        self.best_loss_median = min(self.best_loss_median, statistics.median(self.recent))
    if self.elevated_run >= self.window:
      return (f"train loss diverged: the last {self.window} logged losses are all non-finite "
              f"or above {self.cfg.loss_explosion_factor:g} x the best median "
              f"{self.best_loss_median:.3g} (latest {loss:.3g})")
    return None

  def check_val(self, val_loss: float) -> Optional[str]:
    # One evaluation cannot tell a bump from a divergence; a lasting rise shows in the train window.
    if not math.isfinite(val_loss):
      return "validation loss is non-finite"
    return None

  def healthy(self) -> bool:
    """True when the latest logged loss gives no reason to doubt the current state (safe to save).
    """
    return self.elevated_run == 0

  def rollback_target(self, steps: list[int]) -> Optional[int]:
    """The checkpoint to return to: the newest, or the one before it when the previous rollback
    already returned to the newest (its state failed again, so it is not a good place to retry)."""
    if not steps:
      return None
    newest = max(steps)
    if self.events and self.events[-1].restored_step == newest:
      older = [s for s in steps if s < newest]
      if older:
        return max(older)
    return newest

  def record(self, event: RollbackEvent, restored_metrics: dict) -> None:
    self.events.append(event)
    self.restart_window(restored_metrics)

  def restart_window(self, restored_metrics: dict) -> None:
    """Starts watching again from a restored state (a rollback's, a replay's): its rollback
    requests are handled, and the loss window described the trajectory left behind."""
    self.acknowledge(restored_metrics)
    self.recent.clear()
    self.elevated_run = 0

  def record_transient(self, event: TransientEvent) -> Optional[str]:
    """Records a transient failure; returns why the run should stop (``max_transients`` on one
    device within ``transient_window`` steps), else None."""
    self.transients.append(event)
    recent = [e for e in self.transients if e.device == event.device
              and e.step > event.step - self.cfg.transient_window]
    if len(recent) < self.cfg.max_transients:
      return None
    return (f"{len(recent)} transient failures on {event.device} within "
            f"{self.cfg.transient_window} steps (stability.recovery.max_transients="
            f"{self.cfg.max_transients}): the hardware is suspect")

  def state_dict(self) -> dict:
    return {"best_loss_median": self.best_loss_median,
            "events": [dataclasses.asdict(e) for e in self.events],
            "transients": [dataclasses.asdict(e) for e in self.transients]}

  def load_state_dict(self, d: dict) -> None:
    self.best_loss_median = float(d.get("best_loss_median", math.inf))
    self.events = [RollbackEvent(**{**e, "skipped_batches": tuple(e["skipped_batches"])})
                   for e in d.get("events", [])]
    self.transients = [TransientEvent(**e) for e in d.get("transients", [])]
