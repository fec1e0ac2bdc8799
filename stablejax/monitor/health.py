"""Health levels of the global gradient norm."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

from stablejax.monitor._numbers import _as_float


HEALTH_LEVELS = ("low", "healthy", "high", "critical", "exploded")
"""All levels, mildest first. ``"low"`` only occurs when ``HealthThresholds.low`` is set."""

_LEVEL_CODE = {"low": -1, "healthy": 0, "high": 1, "critical": 2, "exploded": 3}


@dataclasses.dataclass(frozen=True)
class HealthThresholds:
  """Boundaries of the gradient health levels (global L2 norm of the raw gradient).

  ``norm <= high`` is healthy, ``high < norm <= critical`` is high,
  ``norm > critical`` is critical and a non-finite norm (or loss) is exploded.
  Small norms are healthy by default: a small gradient is not a stability
  problem by itself, and a run that has stopped learning is caught by the
  parameter movement check instead. Set ``low`` (for example ``0.5``) to get a
  separate ``"low"`` level for ``norm < low``.

  Args:
    high: upper edge of the healthy range (default 5.0).
    critical: upper edge of the high range (default 10.0).
    low: optional lower edge of the healthy range; ``None`` disables "low".
  """

  high: float = 5.0
  critical: float = 10.0
  low: Optional[float] = None

  def __post_init__(self):
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


def grad_health_level(grad_norm: Any, thresholds: HealthThresholds = HealthThresholds()) -> str:
  """Health level of one global gradient norm.

  Args:
    grad_norm: the global L2 norm of the raw gradient (a number; NaN/Inf allowed).
    thresholds: level boundaries (defaults: healthy up to 5, high up to 10).

  Returns:
    ``"healthy"``, ``"high"``, ``"critical"`` or ``"exploded"`` (non-finite or
    missing norm), or ``"low"`` when ``thresholds.low`` is set and the norm is
    below it.

  Example::

    grad_health_level(7.0)            # "high"
    grad_health_level(float("nan"))   # "exploded"
  """
  g = _as_float(grad_norm)
  if g is None or not math.isfinite(g):
    return "exploded"
  g = abs(g)
  if g > thresholds.critical:
    return "critical"
  if g > thresholds.high:
    return "high"
  if thresholds.low is not None and g < thresholds.low:
    return "low"
  return "healthy"


def health_code(level: Optional[str]) -> float:
  """Numeric code of a health level for plots and TensorBoard.

  Returns -1 low, 0 healthy, 1 high, 2 critical, 3 exploded, NaN for unknown.
  """
  return float(_LEVEL_CODE.get(level, float("nan")))
