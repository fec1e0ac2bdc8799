"""When to roll back, and the bookkeeping of rollbacks (host side, fed at log and eval steps).

Triggers (all switchable through `stability`):
- `needs_rollback` raised by skip_nonfinite or skip_spikes (too many skipped steps in a row);
- a parameter that became non-finite;
- the train loss over the last `loss_window` logged values: all non-finite, or a median above
  `loss_explosion_factor` x the best median seen so far (a median, so one spike does not count);
- a non-finite validation loss, or one above `loss_explosion_factor` x the best so far.

The action (restore the last good checkpoint, multiply the LR by `emergency_lr_factor`, skip the
data window that led to the failure) is carried out by the training loop.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics
from typing import Optional

from stablejax.training.config import StabilityConfig


@dataclasses.dataclass
class RollbackEvent:
  step: int            # step at which the trigger was seen
  cause: str
  restored_step: int = -1
  lr_scale: float = 1.0
  skipped_batches: tuple[int, int] = (0, 0)  # [first, last) data batch indices skipped

  def describe(self) -> str:
    a, b = self.skipped_batches
    return (f"step {self.step}: {self.cause}; restored step {self.restored_step}, "
            f"lr scale {self.lr_scale:g}, skipped data batches {a}..{b - 1}")


class Recovery:
  """Watches logged values and says when training must roll back."""

  def __init__(self, cfg: StabilityConfig):
    self.cfg = cfg
    self.losses: collections.deque = collections.deque(maxlen=max(1, cfg.loss_window))
    self.best_loss_median = math.inf
    self.best_val = math.inf
    self.events: list[RollbackEvent] = []

  @property
  def rollbacks(self) -> int:
    return len(self.events)

  @property
  def budget_left(self) -> bool:
    return self.rollbacks < self.cfg.max_rollbacks

  def check_train(self, record: dict) -> Optional[str]:
    """Returns the cause of a needed rollback, or None. `record` is one fetched metrics record."""
    flags = [k for k, v in record.items() if k.endswith("/needs_rollback") and bool(v)]
    if flags:
      prefix = flags[0].split("/")[0]
      return f"{prefix}: {int(record.get(prefix + '/consecutive_skips', 0))} consecutive skipped steps"
    if not bool(record.get("params_finite", True)):
      return "a parameter became non-finite"
    loss = float(record["loss"])
    self.losses.append(loss)
    if len(self.losses) < self.losses.maxlen:
      return None
    finite = [x for x in self.losses if math.isfinite(x)]
    if not finite:
      return f"train loss non-finite for the last {len(self.losses)} logged steps"
    median = statistics.median(finite)
    if median > self.cfg.loss_explosion_factor * self.best_loss_median:
      return (f"train loss exploded: median {median:.3g} of the last {len(self.losses)} logged steps"
              f" > {self.cfg.loss_explosion_factor:g} x best {self.best_loss_median:.3g}")
    self.best_loss_median = min(self.best_loss_median, median)
    return None

  def check_val(self, val_loss: float) -> Optional[str]:
    if not math.isfinite(val_loss):
      return "validation loss is non-finite"
    if val_loss > self.cfg.loss_explosion_factor * self.best_val:
      return (f"validation loss exploded: {val_loss:.3g} > {self.cfg.loss_explosion_factor:g}"
              f" x best {self.best_val:.3g}")
    self.best_val = min(self.best_val, val_loss)
    return None

  def healthy(self) -> bool:
    """True when the recent logged losses give no reason to doubt the current state."""
    return all(math.isfinite(x) for x in list(self.losses)[-1:])

  def record(self, event: RollbackEvent) -> None:
    self.events.append(event)
    self.losses.clear()  # the window described the abandoned trajectory

  def state_dict(self) -> dict:
    return {"best_loss_median": self.best_loss_median, "best_val": self.best_val,
            "events": [dataclasses.asdict(e) for e in self.events]}

  def load_state_dict(self, d: dict) -> None:
    self.best_loss_median = float(d.get("best_loss_median", math.inf))
    self.best_val = float(d.get("best_val", math.inf))
    self.events = [RollbackEvent(**{**e, "skipped_batches": tuple(e["skipped_batches"])})
                   for e in d.get("events", [])]
