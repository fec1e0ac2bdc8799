"""Two rules of :class:`~stablejax.monitor.StabilityMonitor` about single logged steps: the
update-norm indicator, and holding back a gradient-health transition that a defence handled.

**Update norm.** The train step logs ``update_norm``, the global norm of the update it applied,
and ``update_norm/layer_<i>`` per layer. Divided by the logged learning rate (``lr``: the
schedule times the recovery's scale) it is the update before the learning rate, which a
warmup-and-decay schedule does not move; a jump of it against its own recent median is an
update spike. Update-norm spikes preceded the loss spikes of Marin's 32B run (Adam's second
moment out of date: Wortsman et al., arXiv 2304.13013, section 3.4), so the monitor reads it next
to the attention logits as a leading indicator (:class:`UpdateNormThresholds`). A skipped step
(update 0) and a step at learning rate 0 are left out.

**Handled transitions.** A gradient norm that leaves the healthy range for one or two logged
steps, where a defence acted on each of them (clipped or skipped it: the ``acted`` flags of
:func:`stablejax.register_state_metrics`), is a spike the stack already handled; warning about
it (and about the return) only teaches users to ignore warnings. :class:`HandledTransitions`
holds such an excursion back while it lasts, up to two logged steps (a gradient spike often
spans two steps, through the momentum), and drops it when the level is healthy again; a longer
one is emitted, late, and so is one with a step no defence acted on (at once, when its first
step is such).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
import statistics
from typing import Any, Mapping, Optional

from stablejax.monitor import specs
from stablejax.monitor._numbers import _as_float

UPDATE_KEY = "update_norm"
UPDATE_ADVICE = ("update-norm spikes preceded the loss spikes of Marin's 32B run: clip the update "
                 "(stability.zclip_update_norm.enabled=true, stablejax.zclip_update_norm) or "
                 "lower the learning rate")
_LAYER = re.compile(r"^update_norm/(layer_\d+)$")


@dataclasses.dataclass(frozen=True)
class UpdateNormThresholds:
  """When :class:`~stablejax.monitor.StabilityMonitor` warns about an update-norm spike.

  The value is ``update_norm / lr`` of a train record (the update before the learning rate). It
  warns when that value is at least ``growth`` times the median of the values logged in the
  preceding ``window`` steps, once at least ``min_records`` of them are there; once per episode
  (the next warning needs a logged step below ``growth`` first).

  Args:
    growth: ratio to the recent median that warns (2: the size of the update-norm spikes that
      preceded Marin's loss spikes; clean runs of ``bench/scenarios.py`` and
      ``bench/stress.py --long`` stay within 1.6x of their median).
    window: steps of history the median covers.
    min_records: logged values needed before the rule can warn.

  Example:
    >>> from stablejax import StabilityMonitor
    >>> from stablejax.monitor.update_norm import UpdateNormThresholds
    >>> monitor = StabilityMonitor(update_norm=UpdateNormThresholds(min_records=3))
    >>> for step in (10, 20, 30):
    ...   _ = monitor.update(step, {"loss": 3.0, "lr": 0.01, "update_norm": 0.02})
    >>> monitor.update(40, {"loss": 3.0, "lr": 0.01, "update_norm": 0.09})[0][:58]
    'step 40: update norm spike: x4.5 its median of the last 30'
  """

  growth: float = 2.0
  window: int = 100
  min_records: int = 5

  def __post_init__(self) -> None:
    if not (isinstance(self.growth, (int, float)) and math.isfinite(self.growth)
            and self.growth > 1):
      raise ValueError(f"UpdateNormThresholds.growth must be a finite number > 1, got "
                       f"{self.growth!r}")
    for name in ("window", "min_records"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"UpdateNormThresholds.{name} must be a positive int, got {value!r}")


def _before_rate(metrics: Mapping[str, Any]) -> tuple[Optional[float], dict[str, float]]:
  """``update_norm / lr`` and the same per layer, or (None, {}) when not measurable. The norm of
  the update the optimizer produced where a state says it differs from the applied one
  (:func:`stablejax.compensated_updates`), else the record's ``update_norm``."""
  norm = None
  for key in (*specs.update_norm_keys(), UPDATE_KEY):
    norm = _as_float(metrics.get(key))
    if norm is not None:
      break
  lr = _as_float(metrics.get("lr"))
  if norm is None or lr is None or not (math.isfinite(lr) and lr > 0):
    return None, {}
  if not (math.isfinite(norm) and norm > 0):
    return None, {}  # a skipped step, or a non-finite one (other rules speak for it)
  layers = {}
  for key, value in metrics.items():
    match = _LAYER.match(key)
    v = _as_float(value) if match else None
    if match and v is not None and math.isfinite(v) and v > 0:
      layers[match.group(1)] = v / lr
  return norm / lr, layers


class UpdateNormRule:
  """The update-norm indicator's history and decision (state of the monitor)."""

  def __init__(self, thresholds: UpdateNormThresholds):
    self.thresholds = thresholds
    self.history: collections.deque = collections.deque()  # [clock, value, {layer: value}]
    self.active = False

  def update(self, step: int, clock: int, metrics: Mapping[str, Any]) -> list[str]:
    t = self.thresholds
    value, layers = _before_rate(metrics)
    if value is None:
      return []
    while self.history and self.history[0][0] <= clock - t.window:
      self.history.popleft()
    past = [v for _, v, _ in self.history]
    past_layers = [ls for _, _, ls in self.history]
    self.history.append([clock, value, layers])
    if len(past) < t.min_records:
      return []
    median = statistics.median(past)
    ratio = value / median if median > 0 else math.inf
    was_active, self.active = self.active, ratio >= t.growth
    if not self.active or was_active:
      return []
    where = ""
    ratios = {}
    for name, v in layers.items():
      own = [ls[name] for ls in past_layers if name in ls]
      if own and statistics.median(own) > 0:
        ratios[name] = v / statistics.median(own)
    if ratios:
      top = max(ratios, key=ratios.__getitem__)
      where = f", largest in {top} (x{ratios[top]:.3g})"
    span = min(t.window, clock - self.history[0][0]) if len(self.history) > 1 else t.window
    return [f"step {step}: update norm spike: x{ratio:.3g} its median of the last {span} steps "
            f"(before the learning rate{where}); {UPDATE_ADVICE}"]

  def state_dict(self) -> dict[str, Any]:
    return {"history": [list(x) for x in self.history], "active": self.active}

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    self.history = collections.deque(
        [int(c), float(v), {str(k): float(x) for k, x in ls.items()}]
        for c, v, ls in state.get("history", []))
    self.active = bool(state.get("active", False))


class HandledTransitions:
  """Holds back a gradient-health excursion out of the healthy range while a defence acts on
  each of its logged steps, for up to ``max_records`` of them; drops it (and the return) when the
  level is healthy again within them, and emits it, late, otherwise."""

  def __init__(self, max_records: int = 2) -> None:
    self.max_records = max_records
    self.held: Optional[list[str]] = None
    self.length = 0   # logged steps of the held excursion

  def filter(self, lines: list[str], old_level: Optional[str], level: Optional[str],
             handled: bool, measured: bool) -> list[str]:
    """The lines to emit now for this record's level ``lines`` (from ``old_level`` to
    ``level``; ``handled``: a defence clipped or skipped this step; ``measured``: the record
    had a level at all)."""
    if self.held is not None:
      if not measured:
        return []  # no level read at this record: keep waiting
      if level == "healthy":
        self.held, self.length = None, 0
        return []  # a short excursion the stack handled: neither it nor the return is news
      if handled and self.length < self.max_records:
        self.held, self.length = self.held + lines, self.length + 1
        return []
      held, self.held, self.length = self.held, None, 0
      return held + lines
    if lines and handled and old_level in (None, "healthy") and level != "healthy":
      self.held, self.length = lines, 1
      return []
    return lines

  def state_dict(self) -> Optional[list]:
    return None if self.held is None else [list(self.held), self.length]

  def load_state_dict(self, state: Optional[list]) -> None:
    if not state:
      self.held, self.length = None, 0
    elif state and isinstance(state[0], list):
      self.held, self.length = [str(x) for x in state[0]], int(state[1])
    else:  # a bare list of lines
      self.held, self.length = [str(x) for x in state], 1
