"""The attention-logit rule of :class:`~stablejax.monitor.StabilityMonitor`: a warning, with
advice, when the logged maximum pre-softmax attention logit is high, grew within a window, or
grew fast from one logged step to the next (:class:`AttentionLogitThresholds` says when)."""

from __future__ import annotations

import collections
import math
from typing import Any, Mapping, Optional

from stablejax.monitor._numbers import _as_float
from stablejax.monitor.health import AttentionLogitThresholds

ATTN_KEY = "attn_logit_max"
ATTENTION_ADVICE = ("without QK-norm, attention logits past ~1e4 preceded divergence in every run "
                    "of Wortsman et al. (arXiv 2309.14322): turn on QK-norm (model.qk_norm=true), "
                    "or QK-clip (stability.qk_clip.enabled=true, stablejax.qk_clip), or lower the "
                    "learning rate")


class AttentionLogitRule:
  """The rule's history: the logits of the growth window, the last value seen (the rate
  condition's base; the initial parameters' before the first record), and the value of the last
  warning (a further one needs ``repeat_factor`` times more)."""

  def __init__(self, thresholds: AttentionLogitThresholds):
    self.thresholds = thresholds
    self._attn: collections.deque = collections.deque()   # [clock, max logit]
    self._attn_warned: Optional[float] = None   # max logit of the last attention warning
    self.active = False                         # the rule held at the last record
    self._attn_last: Optional[list] = None      # [step, max logit] of the last value seen

  def observe_initial(self, metrics: Mapping[str, Any]) -> None:
    """The initial parameters' telemetry (step 0): the first record's rate is measured from it."""
    v = _as_float(metrics.get(ATTN_KEY))
    if v is not None and math.isfinite(v) and v > 0:
      self._attn_last = [0, v]

  def update(self, step: int, clock: int, metrics: Mapping[str, Any]) -> list[str]:
    """The warning line of one record (at most one), or none."""
    rule = self.thresholds
    v = _as_float(metrics.get(ATTN_KEY))
    if v is None or math.isnan(v):
      return []
    while self._attn and self._attn[0][0] < clock - rule.growth_window:
      self._attn.popleft()
    base = min((x for _, x in self._attn), default=None)
    if math.isfinite(v):
      self._attn.append([clock, v])
    level = v > rule.high
    trend = v > rule.growth_floor and base is not None and base > 0 and v >= rule.growth * base
    last, self._attn_last = self._attn_last, ([step, v] if math.isfinite(v) and v > 0
                                              else self._attn_last)
    per_step = None
    if last is not None and step > last[0] and last[1] > 0 and math.isfinite(v):
      per_step = (v / last[1]) ** (1.0 / (step - last[0]))
    rate = v > rule.step_growth_floor and per_step is not None and per_step >= rule.step_growth
    self.active = level or trend or rate
    if not self.active:
      return []
    if self._attn_warned is not None and not v >= rule.repeat_factor * self._attn_warned:
      return []
    self._attn_warned = v
    if trend and base is not None:
      why = f"x{v / base:.3g} within {rule.growth_window} steps"
    elif rate and last is not None:
      why = f"x{v / last[1]:.3g} in {step - last[0]} step{'s' if step - last[0] > 1 else ''}"
    else:
      why = f"above {rule.high:g}"
    layers = {k[len(ATTN_KEY) + 1:]: _as_float(x) for k, x in metrics.items()
              if k.startswith(ATTN_KEY + "/layer_") and k.count("/") == 1}
    finite = {k: x for k, x in layers.items() if x is not None and not math.isnan(x)}
    where = f", largest in {max(finite, key=finite.__getitem__)}" if finite else ""
    return [f"step {step}: attention logits growing: max pre-softmax logit {v:.4g} ({why}{where})"
            f"; {ATTENTION_ADVICE}"]

  def state_dict(self) -> dict[str, Any]:
    return {"attn": [list(x) for x in self._attn], "attn_warned": self._attn_warned,
            "attn_active": self.active, "attn_last": self._attn_last}

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    # Absent from states saved before the rule (and before its rate condition) existed.
    self._attn = collections.deque([int(c), float(v)] for c, v in state.get("attn", []))
    self._attn_warned = state.get("attn_warned")
    self.active = bool(state.get("attn_active", False))
    last = state.get("attn_last")
    self._attn_last = None if last is None else [int(last[0]), float(last[1])]
