"""Health levels of the global gradient norm."""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics
from typing import Any, Mapping, Optional

from stablejax.monitor._numbers import _as_float


HEALTH_LEVELS = ("low", "healthy", "high", "critical", "exploded")
"""All levels, mildest first. ``"low"`` only occurs when ``HealthThresholds.low`` is set."""

_LEVEL_CODE = {"low": -1, "healthy": 0, "high": 1, "critical": 2, "exploded": 3}


@dataclasses.dataclass(frozen=True)
class HealthThresholds:
  """Boundaries of the gradient health levels (global L2 norm of the raw gradient).

  With ``relative=True`` (the default) the boundaries are multiples of the run's own typical
  gradient norm: :class:`StabilityMonitor` divides each logged norm by the median of the finite
  norms logged in the preceding ``window`` steps, and gives no high, critical or low level before
  ``min_history`` such norms were logged. The scale of a healthy gradient norm depends on the
  model, the vocabulary, the batch and the loss (a 124M-parameter GPT with a 50K vocabulary
  starts near 50; a small byte-level model near 1), so a fixed norm cannot say "unusually large
  for this run"; a norm several times the run's recent median can. The median ignores a single
  spike, and the early steps, where the norm falls from its value at initialisation, set the
  reference instead of raising levels. With ``relative=False`` the boundaries are absolute norms.

  ``ratio <= high`` is healthy, ``high < ratio <= critical`` is high, ``ratio > critical`` is
  critical and a non-finite norm (or loss) is exploded, where ``ratio`` is the norm over the
  reference (over 1 when absolute). Small norms are healthy by default: a small gradient is not
  a stability problem by itself, and a run that has stopped learning is caught by the parameter
  movement check instead. Set ``low`` (for example ``0.5``) to get a separate ``"low"`` level
  for ``ratio < low``.

  Args:
    high: upper edge of the healthy range (default 5.0).
    critical: upper edge of the high range (default 10.0).
    low: optional lower edge of the healthy range; ``None`` disables "low".
    relative: boundaries as multiples of the run's median gradient norm (True) or as norms.
    window: steps of history the median covers (relative only).
    min_history: finite norms logged in the window before the relative levels apply.

  Example:
    >>> from stablejax import HealthThresholds, grad_health_level
    >>> grad_health_level(7.0), grad_health_level(7.0, HealthThresholds(high=8.0, critical=20.0))
    ('high', 'healthy')
    >>> grad_health_level(0.01, HealthThresholds(low=0.1))
    'low'
    >>> grad_health_level(55.7, reference=50.0)  # relative: 1.1 times the run's median
    'healthy'
  """

  high: float = 5.0
  critical: float = 10.0
  low: Optional[float] = None
  relative: bool = True
  window: int = 200
  min_history: int = 3

  def __post_init__(self) -> None:
    for name in ("high", "critical"):
      value = getattr(self, name)
      if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"HealthThresholds.{name} must be a positive finite number, got {value!r}")
    if not self.high < self.critical:
      raise ValueError(
          f"HealthThresholds needs high < critical, got high={self.high}, critical={self.critical}")
    if self.low is not None and not (0 <= self.low < self.high):
      raise ValueError(
          f"HealthThresholds.low must be in [0, high={self.high}) or None, got {self.low!r}")
    if not isinstance(self.relative, bool):
      raise ValueError(f"HealthThresholds.relative must be True or False, got {self.relative!r}")
    for name in ("window", "min_history"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"HealthThresholds.{name} must be a positive int, got {value!r}")


def grad_health_level(grad_norm: Any, thresholds: HealthThresholds = HealthThresholds(),
                      reference: Optional[float] = None) -> str:
  """Health level of one global gradient norm.

  Args:
    grad_norm: the global L2 norm of the raw gradient (a number; NaN/Inf allowed).
    thresholds: level boundaries (defaults: healthy up to 5, high up to 10).
    reference: the run's typical gradient norm, of which the boundaries are multiples (what
      :class:`StabilityMonitor` passes for relative thresholds: the median of recent norms);
      None compares ``grad_norm`` with the boundaries as they are.

  Returns:
    ``"healthy"``, ``"high"``, ``"critical"`` or ``"exploded"`` (non-finite or
    missing norm), or ``"low"`` when ``thresholds.low`` is set and the norm is
    below it.

  Example:
    >>> from stablejax import grad_health_level
    >>> grad_health_level(1.2), grad_health_level(7.0), grad_health_level(12.0)
    ('healthy', 'high', 'critical')
    >>> grad_health_level(float("nan"))
    'exploded'
    >>> grad_health_level(12.0, reference=2.0)  # 6 times the reference
    'high'
  """
  g = _as_float(grad_norm)
  if g is None or not math.isfinite(g):
    return "exploded"
  g = abs(g)
  if reference is not None:
    ref = _as_float(reference)
    if ref is None or not (math.isfinite(ref) and ref > 0):
      raise ValueError(f"grad_health_level reference must be a positive finite norm, got "
                       f"{reference!r}")
    g = g / ref
  if g > thresholds.critical:
    return "critical"
  if g > thresholds.high:
    return "high"
  if thresholds.low is not None and g < thresholds.low:
    return "low"
  return "healthy"


class GradientHealth:
  """The gradient health level of a run's logged records (what :class:`StabilityMonitor` reports
  and warns about): the level, how often each level was measured, the largest finite norm, and
  for relative thresholds the norms of the last ``thresholds.window`` steps, whose median is the
  reference."""

  def __init__(self, thresholds: HealthThresholds):
    self.thresholds = thresholds
    self.level: Optional[str] = None
    self.level_counts: dict[str, int] = {}
    self.max_grad_norm: Optional[float] = None
    self._grad_norms: collections.deque = collections.deque()   # [clock, finite grad norm]

  def update(self, step: int, clock: int, g: Optional[float], exploded: bool) -> list[str]:
    """The line of one record's level if it changed (none for a first healthy record).

    Args:
      step: the record's step.
      clock: the monitor's count of steps seen (the reference's window is in these).
      g: the record's global gradient norm, or None.
      exploded: the step was skipped as non-finite, or its loss is not finite.
    """
    t = self.thresholds
    reference = self._reference(clock) if t.relative else None
    if exploded:
      level = "exploded"
    elif g is not None:
      if t.relative and reference is None:  # the history that sets the reference is filling
        level = "exploded" if not math.isfinite(g) else "healthy"
      else:
        level = grad_health_level(g, t, reference)
    else:
      return []
    if g is not None and math.isfinite(g):
      self.max_grad_norm = g if self.max_grad_norm is None else max(self.max_grad_norm, g)
      self._grad_norms.append([clock, g])
    self.level_counts[level] = self.level_counts.get(level, 0) + 1
    old, self.level = self.level, level
    if level == old or (old is None and level == "healthy"):
      return []
    norm = "n/a" if g is None else f"{g:.4g}"
    if level == "healthy":
      return [f"step {step}: gradient health back to healthy (grad norm {norm})"]
    unit = "" if reference is None else (
        f" x {reference:.4g}, the median grad norm of the last {t.window} steps")
    if level == "low":
      detail = f"grad norm < {t.low:g}{unit}"
    elif level == "high":
      detail = f"{t.high:g}{unit} < grad norm <= {t.critical:g}{unit}"
    elif level == "critical":
      detail = f"grad norm > {t.critical:g}{unit}"
    else:
      detail = "non-finite grad norm or loss"
    return [f"step {step}: gradient health {level} (grad norm {norm}; {detail})"]

  def _reference(self, clock: int) -> Optional[float]:
    """Median of the finite grad norms logged in the last ``thresholds.window`` steps before
    this record, or None while fewer than ``thresholds.min_history`` of them (or none > 0)."""
    t = self.thresholds
    while self._grad_norms and self._grad_norms[0][0] <= clock - t.window:
      self._grad_norms.popleft()
    recent = [g for _, g in self._grad_norms]
    if len(recent) < t.min_history:
      return None
    reference = statistics.median(recent)
    return reference if reference > 0 else None

  def state_dict(self) -> dict[str, Any]:
    return {"level": self.level, "level_counts": dict(self.level_counts),
            "max_grad_norm": self.max_grad_norm,
            "grad_norms": [list(x) for x in self._grad_norms]}

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    self.level = state["level"]
    self.level_counts = {str(k): int(v) for k, v in state["level_counts"].items()}
    self.max_grad_norm = state["max_grad_norm"]
    # Absent from states saved before the relative health levels: the history refills.
    self._grad_norms = collections.deque([int(c), float(g)] for c, g in state.get("grad_norms", []))


def health_code(level: Optional[str]) -> float:
  """Numeric code of a health level for plots and TensorBoard.

  Returns -1 low, 0 healthy, 1 high, 2 critical, 3 exploded, NaN for unknown.
  """
  return float(_LEVEL_CODE.get(level or "", float("nan")))


@dataclasses.dataclass(frozen=True)
class AttentionLogitThresholds:
  """When :class:`StabilityMonitor` warns about attention-logit growth (level and trend).

  Reads the logged maximum pre-softmax attention logit (``attn_logit_max`` of a train record,
  the maximum over layers, heads, batch and positions of ``q.k / sqrt(head_dim)``). Without
  QK-norm, runaway logits are the first of Wortsman et al.'s small-scale proxies of large-scale
  instability (arXiv 2309.14322, section 3.1.1; every run of theirs whose logits passed ~1e4
  diverged). Two conditions, either of which warns:

  * level: ``max_logit > high``;
  * trend: ``max_logit > growth_floor`` and ``max_logit >= growth`` times the smallest value
    logged in the preceding ``growth_window`` steps;
  * rate: ``max_logit > step_growth_floor`` and it grew by ``step_growth`` or more per step on
    average since the previous logged value (the initial parameters' value before the first
    one, :meth:`StabilityMonitor.observe_initial`). Healthy runs grow their logits by orders of
    magnitude over their first hundreds of steps (hence the trend rule's floor), never by x4 in
    one update; a learning rate that breaks the model at once does it in its first update.

  A warning is given when a condition first holds and again only when the logit has grown
  ``repeat_factor`` times past the value of the previous warning. The defaults come from the
  long-horizon stress sweep of ``bench/stress.py`` (docs/results.md): no warning on its clean
  runs, a warning before the loss degraded on its unstable ones.

  Args:
    high: logit level that warns on its own.
    growth: growth factor within ``growth_window`` steps that warns above ``growth_floor``.
    growth_window: steps over which the growth is measured.
    growth_floor: no trend warning below this logit (early training grows fast from ~1).
    repeat_factor: a further warning needs the logit this many times above the last one.
    step_growth: growth per step (geometric mean since the previous logged value) that warns
      above ``step_growth_floor``.
    step_growth_floor: no rate warning below this logit.

  Example:
    >>> from stablejax import AttentionLogitThresholds, StabilityMonitor
    >>> monitor = StabilityMonitor(attention=AttentionLogitThresholds(high=50.0,
    ...                                                               growth_floor=10.0))
    >>> [monitor.update(s, {"loss": 3.0, "grad_norm": 1.0, "attn_logit_max": v})
    ...  for s, v in [(10, 5.0), (20, 12.0)]]
    [[], []]
    >>> monitor.update(30, {"loss": 3.0, "grad_norm": 1.0, "attn_logit_max": 60.0})
    ['step 30: attention logits growing: max pre-softmax logit 60 (x12 within 100 steps); ...']
  """

  high: float = 1000.0
  growth: float = 8.0
  growth_window: int = 100
  growth_floor: float = 200.0
  repeat_factor: float = 10.0
  step_growth: float = 4.0
  step_growth_floor: float = 10.0

  def __post_init__(self) -> None:
    for name in ("high", "growth", "growth_floor", "repeat_factor", "step_growth",
                 "step_growth_floor"):
      value = getattr(self, name)
      if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"AttentionLogitThresholds.{name} must be a positive finite number, "
                         f"got {value!r}")
    if self.growth <= 1 or self.repeat_factor <= 1 or self.step_growth <= 1:
      raise ValueError("AttentionLogitThresholds.growth, repeat_factor and step_growth must be "
                       "> 1")
    if not isinstance(self.growth_window, int) or self.growth_window < 1:
      raise ValueError(f"AttentionLogitThresholds.growth_window must be a positive int of steps, "
                       f"got {self.growth_window!r}")
