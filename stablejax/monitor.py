"""Stability monitoring: health levels, rates, one stability score, movement checks.

Everything here reads what the training step already computes:
:func:`stablejax.stability_metrics` of the optimizer state plus the loss and the
global gradient norm, fetched to the host every log interval (one
``metrics.jsonl`` train record). Two parts:

* Host side, pure Python: :class:`StabilityMonitor` turns a stream of records
  into sliding-window rates (ZClip spike and clip rate, AdaGC clipped-tensor
  rate, Muon outlier / Newton-Schulz instability / emergency fallback rates,
  skipped-step rate, rollbacks), a gradient health level
  (:func:`grad_health_level`), one score in ``[0, 1]``
  (:func:`stability_score`) and warning lines with troubleshooting advice.
* Device side, jittable: :func:`param_movement` (relative change of each
  parameter group and the size of its updates against the parameter dtype's
  resolution, which exposes learning rates that are too low and updates that
  underflow bf16 parameters) and :func:`per_layer_grad_norms` (for TensorBoard
  histograms). :func:`movement_warnings` reads the former on the host.

The score formula, the health levels and the troubleshooting table are
documented in ``docs/monitoring.md``; the numbers below are the same.

Example::

  monitor = stablejax.StabilityMonitor(window=100)
  for line in monitor.update(step, record):    # record: one train record
    print(line)
  record["health"] = monitor.level
  record["stability_score"] = monitor.score()
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from typing import Any, Callable, Iterable, Mapping, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

# --------------------------------------------------------------------------
# Health levels of the global gradient norm
# --------------------------------------------------------------------------

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


_SPECIAL_FLOATS = {"nan": float("nan"), "inf": float("inf"), "infinity": float("inf"),
                   "-inf": float("-inf"), "-infinity": float("-inf")}


def _as_float(value: Any) -> Optional[float]:
  """A Python float from a number, bool, numpy/jax scalar, or None if not numeric."""
  if isinstance(value, str):  # "NaN" / "Infinity" as some JSON writers spell them
    return _SPECIAL_FLOATS.get(value.strip().lower())
  if value is None:
    return None
  try:
    return float(value)
  except (TypeError, ValueError):
    return None


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


# --------------------------------------------------------------------------
# Stability score and troubleshooting table
# --------------------------------------------------------------------------

SCORE_PENALTY_AT_BUDGET = 0.2
"""How much the score drops when one signal reaches its budget."""

SCORE_BUDGETS: Mapping[str, float] = {
    "zclip_spike_rate": 0.2,
    "zclip_clip_rate": 0.5,
    "adagc_clip_rate": 2.0,
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
  :data:`SCORE_BUDGETS` (``b_i``: spike 0.2, clip 0.5, AdaGC 1.0, Muon
  outliers 0.05, NS instability 0.05, emergency fallbacks 0.01 per step,
  skipped steps 0.05, rollbacks 1 per window). Each signal alone at its budget
  gives exactly the target 0.8, so the troubleshooting limits and the score
  agree; several signals add up. Missing, ``None`` or NaN rates count as 0,
  negative rates as 0, an infinite rate gives 0.

  Args:
    rates: mapping with any of the keys of :data:`SCORE_BUDGETS` (other keys
      are ignored), e.g. :meth:`StabilityMonitor.rates`.

  Returns:
    The score as a Python float in [0, 1]; 1.0 when nothing happened or no data.

  Example::

    stability_score({"zclip_spike_rate": 0.1})   # 0.9
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
    ("zclip_clip_rate", 0.5,
     "ZClip clip rate {value:.3g} > 0.5: lower the ZClip z threshold (e.g. 2.5 -> 2.0) only if "
     "spikes still get through; if clipping is merely frequent, the norm is rising faster than "
     "the EMA follows: lower the learning rate or lengthen warmup"),
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


# --------------------------------------------------------------------------
# Host-side monitor
# --------------------------------------------------------------------------

# kind -> (cumulative counter keys, per-step flag keys). Counter differences
# between consecutive updates give exact event counts; where a counter is
# missing or went backwards (rollback, resume), the per-step flag of the
# logged step is used as a one-step sample.
_EVENT_KINDS = {
    "zclip_spike": (("zclip/spike_count",), ("zclip/is_spike",)),
    "zclip_clip": (("zclip/clip_count",), ("zclip/was_clipped",)),
    "skip_nonfinite": (("skip_nonfinite/total_skips",), ("skip_nonfinite/skipped",)),
    "skip_spikes": (("skip_spikes/total_skips",), ("skip_spikes/skipped",)),
    "muon_fallback": (("muon/fallback_count",), ("muon/fallback_rate",)),
}
# rate name -> per-step sampled metric key (averaged over the samples in the window).
_SAMPLED = {
    "adagc_clip_rate": "adagc/clipped_fraction",
    "muon_outlier_rate": "muon/outlier_rate",
    "muon_ns_instability_rate": "muon/ns_instability_rate",
}
_GRAD_NORM_KEYS = ("grad_norm", "zclip/grad_norm", "adagc/grad_norm", "skip_spikes/grad_norm")


def _event_sample(kind: str, metrics: Mapping[str, Any], prev_counters: Mapping[str, float],
                  steps: int) -> tuple[Optional[float], Optional[str], Optional[float]]:
  """(events, how, counter value): events over ``steps`` from the counter, or a 1-step flag."""
  counter_keys, flag_keys = _EVENT_KINDS[kind]
  for key in counter_keys:
    c = _as_float(metrics.get(key))
    if c is None or not math.isfinite(c):
      continue
    prev = prev_counters.get(key)
    if prev is not None and steps > 0 and c >= prev:
      return c - prev, "counter", c
    break  # counter present but no usable baseline: fall through to the flag
  for key in flag_keys:
    f = _as_float(metrics.get(key))
    if f is None or not math.isfinite(f):
      continue
    if kind == "muon_fallback":
      f = 1.0 if f > 0 else 0.0  # fraction of tensors -> "a fallback happened this step"
    return min(max(f, 0.0), 1.0), "flag", None
  return None, None, None


class StabilityMonitor:
  """Sliding-window stability rates, gradient health and warnings, on the host.

  Feed it one train record every log interval with :meth:`update`; it returns
  new warning lines: a gradient health level entered (once, not repeated while
  the level stays), the return to healthy, and (once a full ``window`` of steps
  has been seen, then at most once per ``advice_every`` steps) a stability
  score below ``score_target`` together
  with the troubleshooting advice, or a fired table row on its own.

  Counters (``zclip/spike_count``, ``zclip/clip_count``,
  ``skip_*/total_skips``, ``muon/fallback_count``) are cumulative, so the
  number of events between two updates is their difference and the number of
  steps is the step difference: events on steps that were not logged still
  count. On the first update, or when a counter is missing or went backwards
  (a rollback or a resume restored older optimizer state), the per-step flag of
  the logged step (``is_spike``, ``was_clipped``, ``*/skipped``,
  ``muon/fallback_rate > 0``) counts as a one-step sample instead. Per-step
  fractions (AdaGC clipped fraction, Muon outlier and NS instability rates)
  are averaged over the logged steps in the window. Non-finite values and
  missing keys are ignored (a chain without Muon simply has no Muon rates).

  The window covers the last ``window`` training steps as seen by the monitor
  (whole log intervals ending inside it; a step number that goes backwards
  after a rollback advances the window by one step).

  Args:
    window: window length in training steps (default 100).
    thresholds: gradient health level boundaries.
    score_target: score below which a warning with advice is emitted (0.8).
    advice_every: minimum number of steps between two advice warnings
      (default: ``window``).
    loss_plateau_check: whether to add the "slow convergence" row when the mean
      loss of the last window is not below that of the window before.

  Example::

    monitor = StabilityMonitor(window=100)
    lines = monitor.update(10, {"loss": 3.2, "grad_norm": 1.1, "zclip/spike_count": 0})
  """

  def __init__(self, window: int = 100, thresholds: HealthThresholds = HealthThresholds(),
               score_target: float = 0.8, advice_every: Optional[int] = None,
               loss_plateau_check: bool = True):
    if not isinstance(window, int) or window < 1:
      raise ValueError(f"StabilityMonitor window must be a positive int of steps, got {window!r}")
    if not 0.0 <= score_target <= 1.0:
      raise ValueError(f"StabilityMonitor score_target must be in [0, 1], got {score_target!r}")
    if advice_every is not None and (not isinstance(advice_every, int) or advice_every < 1):
      raise ValueError(f"StabilityMonitor advice_every must be a positive int, got {advice_every!r}")
    if not isinstance(thresholds, HealthThresholds):
      raise ValueError("StabilityMonitor thresholds must be a HealthThresholds instance")
    self.window = window
    self.thresholds = thresholds
    self.score_target = float(score_target)
    self.advice_every = window if advice_every is None else advice_every
    self.loss_plateau_check = loss_plateau_check
    self._reset()

  def _reset(self):
    self._clock = 0                     # monotonic count of steps seen
    self._last_step: Optional[int] = None
    self._counters: dict[str, float] = {}
    # entries: [clock_end, {kind: [events, steps]}, {sampled_name: value}]
    self._entries: collections.deque = collections.deque()
    self._losses: collections.deque = collections.deque()   # [clock, loss]
    self._rollbacks: list[list] = []    # [clock, step, cause]
    self._level: Optional[str] = None
    self._level_counts: dict[str, int] = {}
    self._threshold: Optional[float] = None
    self._last_advice_clock: Optional[int] = None
    self._n_updates = 0
    self._n_warnings = 0
    self._max_grad_norm: Optional[float] = None
    self._last_loss: Optional[float] = None

  # ---- feeding ----

  def update(self, step: int, metrics: Mapping[str, Any]) -> list[str]:
    """Adds one logged train record and returns the new warning lines.

    Args:
      step: the training step of the record.
      metrics: the record (loss, grad_norm and ``stability_metrics`` keys as
        Python or numpy scalars; other keys are ignored, missing keys tolerated).

    Returns:
      Warning lines (possibly empty), each starting with ``"step N:"``.
    """
    step = int(step)
    if self._last_step is None or step <= self._last_step:
      steps = 1  # first record, or the step went backwards (rollback / restart)
      have_baseline = False
    else:
      steps = step - self._last_step
      have_baseline = True
    self._clock += steps
    self._last_step = step
    self._n_updates += 1

    events: dict[str, list] = {}
    prev = self._counters if have_baseline else {}
    new_counters = {}
    for kind, (counter_keys, _) in _EVENT_KINDS.items():
      n, how, c = _event_sample(kind, metrics, prev, steps)
      for key in counter_keys:
        value = _as_float(metrics.get(key))
        if value is not None and math.isfinite(value):
          new_counters[key] = value
      if n is not None:
        events[kind] = [n, steps if how == "counter" else 1]
    self._counters = new_counters

    sampled = {}
    for name, key in _SAMPLED.items():
      v = _as_float(metrics.get(key))
      if v is not None and math.isfinite(v):
        sampled[name] = v
    thr = _as_float(metrics.get("zclip/threshold"))
    if thr is not None and math.isfinite(thr):
      self._threshold = thr

    self._entries.append([self._clock, events, sampled])
    loss = _as_float(metrics.get("loss"))
    if loss is not None:
      self._last_loss = loss
      if math.isfinite(loss):
        self._losses.append([self._clock, loss])
    self._trim()

    lines = []
    lines += self._update_level(step, metrics, loss)
    lines += self._advice_lines(step)
    self._n_warnings += len(lines)
    return lines

  def record_rollback(self, step: int, cause: str = "") -> None:
    """Records a rollback (restore of an earlier checkpoint) at ``step``.

    Args:
      step: the step at which the trainer decided to roll back.
      cause: short reason, kept for :meth:`summary`.
    """
    self._rollbacks.append([self._clock, int(step), str(cause)])

  def _trim(self):
    start = self._clock - self.window
    while self._entries and self._entries[0][0] <= start:
      self._entries.popleft()
    while self._losses and self._losses[0][0] <= self._clock - 2 * self.window:
      self._losses.popleft()

  def _update_level(self, step: int, metrics: Mapping[str, Any], loss: Optional[float]) -> list[str]:
    g = None
    for key in _GRAD_NORM_KEYS:
      g = _as_float(metrics.get(key))
      if g is not None:
        break
    # a non-finite skip means this step's gradient was NaN/Inf; the optimizer-state norms then
    # still show the last accepted step, so the flag decides.
    skipped_nonfinite = (_as_float(metrics.get("skip_nonfinite/skipped")) or 0.0) > 0
    if skipped_nonfinite or (loss is not None and not math.isfinite(loss)):
      level = "exploded"
    elif g is not None:
      level = grad_health_level(g, self.thresholds)
    else:
      return []
    if g is not None and math.isfinite(g):
      self._max_grad_norm = g if self._max_grad_norm is None else max(self._max_grad_norm, g)
    self._level_counts[level] = self._level_counts.get(level, 0) + 1
    old, self._level = self._level, level
    if level == old or (old is None and level == "healthy"):
      return []
    t = self.thresholds
    norm = "n/a" if g is None else f"{g:.4g}"
    if level == "healthy":
      return [f"step {step}: gradient health back to healthy (grad norm {norm})"]
    if level == "low":
      detail = f"grad norm < {t.low:g}"
    elif level == "high":
      detail = f"{t.high:g} < grad norm <= {t.critical:g}"
    elif level == "critical":
      detail = f"grad norm > {t.critical:g}"
    else:
      detail = "non-finite grad norm or loss"
    return [f"step {step}: gradient health {level} (grad norm {norm}; {detail})"]

  def _loss_plateau(self) -> bool:
    if not self.loss_plateau_check or not self._losses:
      return False
    if self._clock < 2 * self.window:
      return False
    mid = self._clock - self.window
    recent = [l for c, l in self._losses if c > mid]
    older = [l for c, l in self._losses if c <= mid]
    if len(recent) < 2 or len(older) < 2:
      return False
    return sum(recent) / len(recent) >= sum(older) / len(older)

  def _advice_lines(self, step: int) -> list[str]:
    rates = self.rates()
    score = stability_score(rates)
    advice = troubleshooting_advice(rates, self._loss_plateau())
    below = score < self.score_target
    if (not below and not advice) or self._clock < self.window:
      return []  # rates over less than a window are too noisy to advise on
    if (self._last_advice_clock is not None
        and self._clock - self._last_advice_clock < self.advice_every):
      return []
    self._last_advice_clock = self._clock
    if below:
      head = f"step {step}: stability score {score:.2f} < target {self.score_target:.2f}"
    else:
      head = f"step {step}: stability score {score:.2f}"
    if advice:
      return [head + "; " + "; ".join(advice)]
    worst = _worst_signal(rates)
    return [head + (f" (largest contribution: {worst})" if worst else "")]

  # ---- reading ----

  @property
  def level(self) -> Optional[str]:
    """Gradient health level of the latest update (None before any grad norm)."""
    return self._level

  @property
  def step(self) -> Optional[int]:
    """Step of the latest update."""
    return self._last_step

  def rates(self) -> dict[str, float]:
    """Rates over the window.

    Returns:
      A dict with (only for signals that have been seen):
      ``zclip_spike_rate``, ``zclip_clip_rate`` (events per step),
      ``zclip_threshold`` (latest clip value in effect),
      ``adagc_clip_rate`` (mean fraction of tensors clipped),
      ``muon_outlier_rate``, ``muon_ns_instability_rate`` (mean per-step
      fractions), ``muon_fallback_rate`` (emergency fallbacks per step; counts
      tensors, so it can exceed 1), ``skip_nonfinite_rate``,
      ``skip_spikes_rate``, ``skip_rate`` (their sum, skipped steps per step);
      and always ``rollbacks`` (number in the window).
    """
    sums: dict[str, list] = {}
    samples: dict[str, list] = {}
    for _, events, sampled in self._entries:
      for kind, (n, s) in events.items():
        acc = sums.setdefault(kind, [0.0, 0])
        acc[0] += n
        acc[1] += s
      for name, v in sampled.items():
        samples.setdefault(name, []).append(v)
    out: dict[str, float] = {}

    def _rate(kind):
      n, s = sums[kind]
      r = n / s if s else 0.0
      return r if kind == "muon_fallback" else min(r, 1.0)

    for kind, name in (("zclip_spike", "zclip_spike_rate"), ("zclip_clip", "zclip_clip_rate")):
      if kind in sums:
        out[name] = _rate(kind)
    if self._threshold is not None:
      out["zclip_threshold"] = self._threshold
    for name, values in samples.items():
      out[name] = sum(values) / len(values)
    if "muon_fallback" in sums:
      out["muon_fallback_rate"] = _rate("muon_fallback")
    skip = None
    for kind in ("skip_nonfinite", "skip_spikes"):
      if kind in sums:
        out[f"{kind}_rate"] = _rate(kind)
        skip = (skip or 0.0) + out[f"{kind}_rate"]
    if skip is not None:
      out["skip_rate"] = min(skip, 1.0)
    start = self._clock - self.window
    out["rollbacks"] = float(sum(1 for c, _, _ in self._rollbacks if c > start))
    return out

  def score(self) -> float:
    """:func:`stability_score` of the current window rates (1.0 with no data)."""
    return stability_score(self.rates())

  def advice(self) -> list[str]:
    """Troubleshooting rows that fire for the current window (not rate-limited)."""
    return troubleshooting_advice(self.rates(), self._loss_plateau())

  def summary(self) -> dict[str, Any]:
    """A JSON-able overview: step, level, score, rates, counts.

    Returns:
      ``{"step", "updates", "level", "score", "score_target", "rates",
      "level_counts", "max_grad_norm", "last_loss", "warnings", "rollbacks_total",
      "rollbacks": [{"step", "cause"}, ...], "advice"}``.
    """
    return {
        "step": self._last_step,
        "updates": self._n_updates,
        "level": self._level,
        "score": self.score(),
        "score_target": self.score_target,
        "rates": self.rates(),
        "level_counts": dict(self._level_counts),
        "max_grad_norm": self._max_grad_norm,
        "last_loss": self._last_loss,
        "warnings": self._n_warnings,
        "rollbacks_total": len(self._rollbacks),
        "rollbacks": [{"step": s, "cause": c} for _, s, c in self._rollbacks],
        "advice": self.advice(),
    }

  # ---- persistence ----

  def state_dict(self) -> dict[str, Any]:
    """The monitor's state as plain JSON-able Python data (for checkpoints)."""
    return {
        "version": 1,
        "clock": self._clock,
        "last_step": self._last_step,
        "counters": dict(self._counters),
        "entries": [[c, {k: list(v) for k, v in e.items()}, dict(s)] for c, e, s in self._entries],
        "losses": [list(x) for x in self._losses],
        "rollbacks": [list(x) for x in self._rollbacks],
        "level": self._level,
        "level_counts": dict(self._level_counts),
        "threshold": self._threshold,
        "last_advice_clock": self._last_advice_clock,
        "updates": self._n_updates,
        "warnings": self._n_warnings,
        "max_grad_norm": self._max_grad_norm,
        "last_loss": self._last_loss,
    }

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    """Restores what :meth:`state_dict` returned (the constructor arguments stay)."""
    if not isinstance(state, Mapping) or state.get("version") != 1:
      raise ValueError("StabilityMonitor.load_state_dict needs a dict from state_dict() (version 1)")
    self._reset()
    self._clock = int(state["clock"])
    self._last_step = None if state["last_step"] is None else int(state["last_step"])
    self._counters = {k: float(v) for k, v in state["counters"].items()}
    self._entries = collections.deque(
        [int(c), {k: [float(v[0]), int(v[1])] for k, v in e.items()},
         {k: float(v) for k, v in s.items()}] for c, e, s in state["entries"])
    self._losses = collections.deque([int(c), float(l)] for c, l in state["losses"])
    self._rollbacks = [[int(c), int(s), str(m)] for c, s, m in state["rollbacks"]]
    self._level = state["level"]
    self._level_counts = {str(k): int(v) for k, v in state["level_counts"].items()}
    self._threshold = state["threshold"]
    self._last_advice_clock = state["last_advice_clock"]
    self._n_updates = int(state["updates"])
    self._n_warnings = int(state["warnings"])
    self._max_grad_norm = state["max_grad_norm"]
    self._last_loss = state["last_loss"]
    self._trim()


def _worst_signal(rates: Mapping[str, Any]) -> Optional[str]:
  best, name = 0.0, None
  for key, budget in SCORE_BUDGETS.items():
    r = _as_float(rates.get(key))
    if r is not None and math.isfinite(r) and r / budget > best:
      best, name = r / budget, f"{key} {r:.3g}"
  return name


# --------------------------------------------------------------------------
# Paths and parameter groups
# --------------------------------------------------------------------------

def path_str(path: Iterable[Any]) -> str:
  """``"a/b/0"`` from a ``jax.tree_util`` key path."""
  parts = []
  for k in path:
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        parts.append(str(getattr(k, attr)))
        break
    else:
      parts.append(str(k))
  return "/".join(parts)


_GROUP_PATTERNS = (
    ("embedding", re.compile(r"(embed|wte|wpe|tok_emb|pos_emb)")),
    ("head", re.compile(r"^(lm_head|head|unembed|output|logits|out_head)(_\d+)?$")),
    ("norm", re.compile(r"(norm|^ln(_|\d|$)|^layer_?norm|^rms)")),
    ("attention", re.compile(r"(attn|attention|^q_?proj|^k_?proj|^v_?proj|^o_?proj|^qkv|^query|^key$|^value)")),
    ("mlp", re.compile(r"(mlp|ffn|feed_?forward|(^|_)fc|^dense|^w[123]$|^up_?proj|^down_?proj|^gate)")),
)


def default_group(path: str) -> str:
  """Parameter group of a ``"a/b/c"`` path by its names.

  The first match over the path components, checked in order, wins:
  ``embedding`` (embed, wte, wpe), ``head`` (lm_head, head, unembed),
  ``norm`` (norm, ln_*, scale of a norm layer), ``attention`` (attn, q/k/v/o
  projections), ``mlp`` (mlp, ffn, fc, dense, w1/w2/w3); else ``other``.

  Example::

    default_group("blocks/attn/q_proj/kernel")  # "attention"
    default_group("blocks/ln_1/scale")           # "norm"
  """
  components = [c.lower() for c in path.split("/") if c]
  for group, pattern in _GROUP_PATTERNS:
    if any(pattern.search(c) for c in components):
      return group
  return "other"


def _leaf_groups(params: Any, labels: Union[None, Any, Callable[[str], str]]):
  """[(path_str, group, leaf)] for the array leaves of ``params``."""
  leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(params)
  if labels is None or callable(labels):
    fn = default_group if labels is None else labels
    groups = [str(fn(path_str(p))) for p, _ in leaves_with_path]
  else:
    label_leaves = treedef.flatten_up_to(labels)
    groups = [str(g) for g in label_leaves]
  return [(path_str(p), g, leaf) for (p, leaf), g in zip(leaves_with_path, groups)]


# --------------------------------------------------------------------------
# Device side: parameter movement and per-layer gradient norms
# --------------------------------------------------------------------------

def param_movement(prev_params: Any, params: Any,
                   labels: Union[None, Any, Callable[[str], str]] = None) -> dict[str, dict[str, jax.Array]]:
  """How far each parameter group moved, and whether its updates are resolvable.

  Per group ``G`` (sums over all float leaves in the group, in float32)::

    rel_change            = ||p - p_prev|| / ||p_prev||
    resolution_ratio      = rms(p - p_prev) / (eps(dtype) * rms(p_prev))
    resolution_ratio_bf16 = rms(p - p_prev) / (eps(bfloat16) * rms(p_prev))
    frozen_fraction       = fraction of entries with p == p_prev
    param_rms             = rms(p)

  ``eps(dtype) * |p|`` is the dtype's spacing at ``|p|`` (within a factor 2),
  so a ratio below 1 means typical updates are at or below the resolution of
  the parameter values: they are mostly rounded away. ``dtype`` is the
  group's own parameter dtype (the lowest-precision one if mixed);
  ``resolution_ratio_bf16`` tells an fp32-parameter run what a bf16 copy of
  the parameters would lose. ``prev_params`` must be a separate copy (not a
  buffer the train step donates).

  Jittable: call it inside a jitted function with ``labels`` closed over
  (``jax.jit(functools.partial(param_movement, labels=labels))``); the result
  is a dict of scalar arrays. Fetch it with ``jax.device_get`` and read it with
  :func:`movement_warnings`.

  Args:
    prev_params: parameter pytree at the last check.
    params: current parameter pytree (same structure).
    labels: ``None`` (group by path with :func:`default_group`), a callable
      ``path_str -> group``, or a pytree of group-name strings matching
      ``params`` (like ``optax.multi_transform`` labels).

  Returns:
    ``{group: {"rel_change", "resolution_ratio", "resolution_ratio_bf16",
    "frozen_fraction", "param_rms"}}`` with float32 scalars.

  Example::

    move = jax.jit(param_movement)(old_params, new_params)
    print(movement_warnings(jax.device_get(move), dtypes=param_dtypes(new_params)))
  """
  prev_leaves = jax.tree_util.tree_leaves(prev_params)
  groups = _leaf_groups(params, labels)
  if len(prev_leaves) != len(groups):
    raise ValueError(
        "param_movement: prev_params and params have different structures; pass snapshots of "
        "the same parameter tree")
  acc: dict[str, dict[str, Any]] = {}
  for (_, group, p), q in zip(groups, prev_leaves):
    p = jnp.asarray(p)
    if not jnp.issubdtype(p.dtype, jnp.floating):
      continue
    p32 = p.astype(jnp.float32)
    q32 = jnp.asarray(q).astype(jnp.float32)
    d = p32 - q32
    a = acc.setdefault(group, {"dd": 0.0, "qq": 0.0, "pp": 0.0, "frozen": 0.0, "n": 0,
                               "eps": 0.0})
    a["dd"] = a["dd"] + jnp.sum(d * d)
    a["qq"] = a["qq"] + jnp.sum(q32 * q32)
    a["pp"] = a["pp"] + jnp.sum(p32 * p32)
    a["frozen"] = a["frozen"] + jnp.sum((d == 0).astype(jnp.float32))
    a["n"] += p.size
    a["eps"] = max(a["eps"], float(jnp.finfo(p.dtype).eps))
  eps_bf16 = float(jnp.finfo(jnp.bfloat16).eps)
  tiny = jnp.float32(1e-30)
  out = {}
  for group, a in acc.items():
    n = max(a["n"], 1)
    rms_d = jnp.sqrt(a["dd"] / n)
    rms_q = jnp.sqrt(a["qq"] / n)
    out[group] = {
        "rel_change": jnp.sqrt(a["dd"]) / jnp.maximum(jnp.sqrt(a["qq"]), tiny),
        "resolution_ratio": rms_d / jnp.maximum(a["eps"] * rms_q, tiny),
        "resolution_ratio_bf16": rms_d / jnp.maximum(eps_bf16 * rms_q, tiny),
        "frozen_fraction": jnp.asarray(a["frozen"] / n, jnp.float32),
        "param_rms": jnp.sqrt(a["pp"] / n),
    }
  return out


def param_dtypes(params: Any, labels: Union[None, Any, Callable[[str], str]] = None) -> dict[str, str]:
  """``{group: dtype name}`` of the parameters (lowest precision in a mixed group)."""
  out: dict[str, str] = {}
  for _, group, p in _leaf_groups(params, labels):
    dt = jnp.asarray(p).dtype if not hasattr(p, "dtype") else p.dtype
    if not jnp.issubdtype(dt, jnp.floating):
      continue
    old = out.get(group)
    if old is None or jnp.finfo(dt).eps > jnp.finfo(old).eps:
      out[group] = jnp.dtype(dt).name
  return out


def movement_warnings(movement: Mapping[str, Mapping[str, Any]], min_rel_change: float = 1e-6,
                      min_resolution_ratio: float = 1.0,
                      dtypes: Optional[Mapping[str, str]] = None, step: Optional[int] = None) -> list[str]:
  """The "parameters are not moving" warning from :func:`param_movement` results.

  A group is stuck when its relative change since the last check is below
  ``min_rel_change`` or its typical update is below the resolution of its own
  dtype (``resolution_ratio < min_resolution_ratio``). The cause is named:
  updates underflowing a low-precision (bf16/fp16) parameter copy, or a
  learning rate that is too low. Norm scales sitting at 1.0 are called out.
  Groups whose values are non-finite get their own line.

  Args:
    movement: ``{group: {"rel_change", "resolution_ratio", ...}}`` as Python
      floats or scalars (``jax.device_get(param_movement(...))``).
    min_rel_change: relative change since the last check below which a group
      counts as not moving (default 1e-6).
    min_resolution_ratio: resolution ratio below which updates count as
      underflowing the parameter dtype (default 1.0).
    dtypes: optional ``{group: dtype name}`` (:func:`param_dtypes`) to name the
      cause; without it the cause is stated as either.
    step: optional step for the line prefix.

  Returns:
    Zero, one or two warning lines.
  """
  stuck, nonfinite = [], []
  low_precision = False
  for group in sorted(movement):
    m = movement[group]
    rel = _as_float(m.get("rel_change"))
    ratio = _as_float(m.get("resolution_ratio"))
    rms = _as_float(m.get("param_rms"))
    if rel is None:
      continue
    if not math.isfinite(rel) or (ratio is not None and math.isnan(ratio)):
      nonfinite.append(group)
      continue
    if rel < min_rel_change or (ratio is not None and ratio < min_resolution_ratio):
      dtype = (dtypes or {}).get(group)
      desc = f"{group} (rel change {rel:.2g}"
      if ratio is not None:
        desc += f", updates {ratio:.2g}x the {dtype or 'dtype'} resolution"
      desc += ")"
      if group == "norm" and rms is not None and abs(rms - 1.0) < 1e-3:
        desc = f"norm scales stuck at {rms:.3f}: " + desc
      if dtype in ("bfloat16", "float16"):
        low_precision = True
      stuck.append(desc)
  prefix = "" if step is None else f"step {step}: "
  lines = []
  if stuck:
    if dtypes is None:
      cause = "learning rate too low, or updates underflowing a low-precision parameter copy"
    elif low_precision:
      cause = ("updates underflow the low-precision parameters: keep float32 master parameters "
               "(compute in bf16), or raise the learning rate")
    else:
      cause = "learning rate too low"
    lines.append(f"{prefix}parameters are not moving: {'; '.join(stuck)}; {cause}")
  if nonfinite:
    lines.append(f"{prefix}non-finite parameters or movement in groups: {', '.join(nonfinite)}")
  return lines


def movement_record(movement: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
  """Flat ``metrics.jsonl`` keys from :func:`param_movement` results.

  Returns:
    ``{"param_move/<group>": rel_change, "param_move/<group>/resolution_ratio": ...,
    "param_move/<group>/resolution_ratio_bf16": ...}`` as Python floats.
  """
  out = {}
  for group, m in movement.items():
    out[f"param_move/{group}"] = float(m["rel_change"])
    for key in ("resolution_ratio", "resolution_ratio_bf16"):
      if key in m:
        out[f"param_move/{group}/{key}"] = float(m[key])
  return out


STACKED_NAMES = ("layers", "blocks", "scan", "h")
"""Path components whose leaves are scan-stacked ``[L, ...]`` by default."""


def per_layer_grad_norms(grads: Any, stacked_names: Iterable[str] = STACKED_NAMES) -> dict[str, jax.Array]:
  """L2 norm of every gradient leaf, per layer slice for scan-stacked parameters.

  A leaf is scan-stacked when one of its path components is in
  ``stacked_names`` (exact match, case-insensitive); its leading axis is the
  layer, and it yields one entry per layer with the layer index inserted after
  that component (``blocks/attn/kernel`` -> ``blocks/0/attn/kernel``, ...), the
  names an unrolled model would have. Jittable.

  Args:
    grads: gradient pytree.
    stacked_names: component names that mark stacked leaves (``()`` disables).

  Returns:
    ``{path: float32 scalar}``; log them as a TensorBoard histogram
    (``grads/norms``) and, at a lower rate, as scalars ``grads/<path>``.

  Example::

    norms = jax.jit(per_layer_grad_norms)(grads)
  """
  names = {n.lower() for n in stacked_names}
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(grads)[0]:
    key = path_str(path)
    x = jnp.asarray(leaf)
    if not jnp.issubdtype(x.dtype, jnp.inexact):
      continue
    parts = key.split("/")
    idx = next((i for i, c in enumerate(parts) if c.lower() in names), None)
    x32 = x.astype(jnp.float32)
    if idx is not None and x.ndim >= 1:
      norms = jnp.sqrt(jnp.sum(jnp.reshape(x32 * x32, (x.shape[0], -1)), axis=1))
      for layer in range(x.shape[0]):
        out["/".join(parts[:idx + 1] + [str(layer)] + parts[idx + 1:])] = norms[layer]
    else:
      out[key] = jnp.sqrt(jnp.sum(x32 * x32))
  return out


# --------------------------------------------------------------------------
# TensorBoard tag names
# --------------------------------------------------------------------------

_TOP_LEVEL_TAGS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_sec": "train/tokens_per_sec",
    "val_loss": "eval/loss",
    "stability_score": "stability/score",
    "act_rms": "activations/rms",
    "act_max": "activations/max",
    "logit_max": "activations/logit_max",
    "excess_kurtosis": "activations/excess_kurtosis",
    "lambda": "train/quant_lambda",
}
_STABILITY_PREFIXES = ("zclip/", "adagc/", "skip_nonfinite/", "skip_spikes/", "muon/",
                       "loss_scale/")


def tensorboard_scalars(record: Mapping[str, Any],
                        rates: Optional[Mapping[str, Any]] = None) -> dict[str, float]:
  """Maps one ``metrics.jsonl`` record (and optional monitor rates) to TensorBoard tags.

  Tags: ``train/loss``, ``train/lr``, ``train/grad_norm``,
  ``train/tokens_per_sec``, ``train/quant_lambda``, ``eval/loss``;
  ``stability/<metric key>`` for every ``stability_metrics`` key (e.g.
  ``stability/zclip/grad_norm``, ``stability/muon/update_rms/adam``);
  ``stability/score``; ``health/level`` (-1 low, 0 healthy, 1 high,
  2 critical, 3 exploded); ``movement/<group>`` and
  ``movement/<group>/<ratio>`` for ``param_move/...``;
  ``activations/{rms,max,logit_max,excess_kurtosis}``;
  ``stability/rate/<name>`` for each monitor rate; ``events/<event>`` = 1
  for event records; ``other/<key>`` for any other numeric key. Booleans
  become 0/1, strings (other than ``health``) and ``step`` are dropped, as
  are non-numeric values. Non-finite values are kept (the caller decides).

  Args:
    record: one train, eval or event record.
    rates: optional :meth:`StabilityMonitor.rates` to add as
      ``stability/rate/<name>``.

  Returns:
    ``{tag: float}``.
  """
  out: dict[str, float] = {}
  if "event" in record:
    out[f"events/{record['event']}"] = 1.0
  for key, value in record.items():
    if key in ("step", "event", "cause"):
      continue
    if key == "health":
      out["health/level"] = health_code(value if isinstance(value, str) else None)
      continue
    v = _as_float(value)
    if v is None:
      continue
    if key in _TOP_LEVEL_TAGS:
      out[_TOP_LEVEL_TAGS[key]] = v
    elif key.startswith(_STABILITY_PREFIXES):
      out[f"stability/{key}"] = v
    elif key.startswith("param_move/"):
      out["movement/" + key[len("param_move/"):]] = v
    else:
      out[f"other/{key}"] = v
  for name, value in (rates or {}).items():
    v = _as_float(value)
    if v is not None:
      out[f"stability/rate/{name}"] = v
  return out
