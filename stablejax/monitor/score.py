"""The stability score and the troubleshooting table (budgets documented in docs/monitoring.md)."""

from __future__ import annotations

import math
from typing import Any, Iterator, Mapping, Optional, Sequence

from stablejax.monitor import specs
from stablejax.monitor._numbers import _as_float


SCORE_PENALTY_AT_BUDGET = 0.2
"""How much the score drops when one signal reaches its budget."""


class _Budgets(Mapping[str, float]):
  """The budget of every scored rate: the rates registered with a budget
  (:func:`stablejax.register_state_metrics`), then the skipped-step rate and the rollbacks."""

  def _items(self) -> dict[str, float]:
    budgets = {rate.name: rate.budget for _, rate in specs.rates() if rate.budget is not None}
    budgets[specs.SKIP_RATE] = specs.SKIP_RATE_BUDGET
    budgets[specs.ROLLBACKS] = specs.ROLLBACKS_BUDGET
    return budgets

  def __getitem__(self, key: str) -> float:
    return self._items()[key]

  def __iter__(self) -> Iterator[str]:
    return iter(self._items())

  def __len__(self) -> int:
    return len(self._items())

  def __repr__(self) -> str:
    return repr(self._items())


# Only abnormal events count: a z-score spike, not ZClip's warmup or ceiling clipping, and not
# AdaGC's per-tensor clipping, which clip on most steps of healthy runs by design.
SCORE_BUDGETS: Mapping[str, float] = _Budgets()
"""Per-signal budget ``b_i``: the rate at which that signal alone brings the score to 0.8 (a live
view of the registered rates' budgets: ZClip spikes 0.2, Muon outliers 0.05, NS instability 0.05,
emergency fallbacks 0.01, skipped steps 0.05, rollbacks 1)."""


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


class _Troubleshooting(Sequence[tuple[str, float, str]]):
  """The rows of the registered rates that carry advice, then the skipped-step rate's."""

  def _rows(self) -> list[tuple[str, float, str]]:
    rows = [(rate.name, rate.budget, rate.advice) for _, rate in specs.rates()
            if rate.budget is not None and rate.advice is not None]
    rows.append((specs.SKIP_RATE, specs.SKIP_RATE_BUDGET, specs.SKIP_RATE_ADVICE))
    return rows

  def __getitem__(self, index: Any) -> Any:
    return self._rows()[index]

  def __len__(self) -> int:
    return len(self._rows())

  def __repr__(self) -> str:
    return repr(self._rows())


TROUBLESHOOTING: Sequence[tuple[str, float, str]] = _Troubleshooting()
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
  for key, limit, advice in list(TROUBLESHOOTING):
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
