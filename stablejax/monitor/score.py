"""The stability score and the troubleshooting table (budgets documented in docs/monitoring.md)."""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional

from stablejax.monitor._numbers import _as_float


SCORE_PENALTY_AT_BUDGET = 0.2
"""How much the score drops when one signal reaches its budget."""

# Only abnormal events count: a z-score spike, not ZClip's warmup or ceiling clipping, and not
# AdaGC's per-tensor clipping, which clip on most steps of healthy runs by design.
SCORE_BUDGETS: Mapping[str, float] = {
    "zclip_spike_rate": 0.2,
    "muon_outlier_rate": 0.05,
    "muon_ns_instability_rate": 0.05,
    "muon_fallback_rate": 0.01,
    "skip_rate": 0.05,
    "rollbacks": 1.0,
}
"""Per-signal budget ``b_i``: the rate at which that signal alone brings the score to 0.8."""


def stability_score(rates: Mapping[str, Any]) -> float:
  """One stability score in [0, 1] from window rates.

  ``score = clamp(1 - 0.2 * sum_i(r_i / b_i), 0, 1)`` over the signals of
  :data:`SCORE_BUDGETS` (``b_i``: ZClip z-score spikes 0.2, Muon outliers
  0.05, NS instability 0.05, emergency fallbacks 0.01 per step, skipped steps
  0.05, rollbacks 1 per window). Each signal alone at its budget gives exactly
  the target 0.8, so the troubleshooting limits and the score agree; several
  signals add up. Routine clipping (ZClip's warmup and ceiling clips,
  AdaGC's clipped tensors) is reported in the rates but not scored: healthy
  runs clip on most early steps. Missing, ``None`` or NaN rates count as 0,
  negative rates as 0, an infinite rate gives 0.

  Args:
    rates: mapping with any of the keys of :data:`SCORE_BUDGETS` (other keys
      are ignored), e.g. :meth:`StabilityMonitor.rates`.

  Returns:
    The score as a Python float in [0, 1]; 1.0 when nothing happened or no data.

  Example:
    >>> from stablejax import stability_score
    >>> stability_score({})                                # nothing happened
    1.0
    >>> stability_score({"zclip_spike_rate": 0.1})         # half the spike budget (0.2)
    0.9
    >>> round(stability_score({"skip_rate": 0.05, "muon_outlier_rate": 0.05}), 6)   # two at budget
    0.6
  """
  penalty = 0.0
  for key, budget in SCORE_BUDGETS.items():
    r = _as_float(rates.get(key))
    if r is None or math.isnan(r) or r <= 0:
      continue
    penalty += SCORE_PENALTY_AT_BUDGET * r / budget
  return float(min(1.0, max(0.0, 1.0 - penalty)))


TROUBLESHOOTING = (
    ("zclip_spike_rate", 0.2,
     "ZClip spike rate {value:.3g} > 0.2: lower the learning rates by 20%"),
    ("muon_ns_instability_rate", 0.05,
     "Newton-Schulz instability rate {value:.3g} > 0.05: use fewer NS steps (e.g. 5 -> 3) "
     "or run NS in float32"),
    ("muon_outlier_rate", 0.05,
     "Muon outlier rate {value:.3g} > 0.05: lower the Muon learning rate or check the data "
     "for pathological batches"),
    ("muon_fallback_rate", 0.01,
     "Muon emergency fallbacks {value:.3g} per step > 0.01: lower the Muon learning rate"),
    ("skip_rate", 0.05,
     "skipped-step rate {value:.3g} > 0.05: look for bad data windows; lower the learning rate "
     "(under fp16, a smaller loss scale)"),
)
"""Rows ``(rate key, limit, advice)``; a row fires when the rate exceeds its limit."""

PLATEAU_ADVICE = ("loss plateau (the last window's mean loss is not below the previous "
                  "window's): if early in training, lengthen warmup (e.g. to 500 steps)")


def troubleshooting_advice(rates: Mapping[str, Any], loss_plateau: bool = False) -> list[str]:
  """Advice lines of the troubleshooting table whose condition holds.

  Args:
    rates: window rates (:meth:`StabilityMonitor.rates`).
    loss_plateau: whether the loss stopped improving (adds the warmup row).

  Returns:
    One line per fired row, in table order.
  """
  lines = []
  for key, limit, advice in TROUBLESHOOTING:
    r = _as_float(rates.get(key))
    if r is not None and r > limit:
      lines.append(advice.format(value=r))
  if loss_plateau:
    lines.append(PLATEAU_ADVICE)
  return lines


def _worst_signal(rates: Mapping[str, Any]) -> Optional[str]:
  best, name = 0.0, None
  for key, budget in SCORE_BUDGETS.items():
    r = _as_float(rates.get(key))
    if r is not None and math.isfinite(r) and r / budget > best:
      best, name = r / budget, f"{key} {r:.3g}"
  return name
