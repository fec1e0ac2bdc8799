"""StabilityMonitor: window rates, health level and warnings from the logged train records."""

from __future__ import annotations

import collections
import math
from typing import Any, Mapping, Optional

from stablejax.monitor import specs
from stablejax.monitor._numbers import _as_float
from stablejax.monitor.attention_rule import ATTENTION_ADVICE, AttentionLogitRule
from stablejax.monitor.health import AttentionLogitThresholds, GradientHealth, HealthThresholds
from stablejax.monitor.score import (_worst_signal, stability_score, troubleshooting_advice)
from stablejax.monitor.update_norm import HandledTransitions, UpdateNormRule, UpdateNormThresholds
from stablejax.transforms.metrics import MetricsSpec, Rate


_V1_EVENT_KINDS = {"zclip_spike": "zclip_spike_rate", "zclip_clip": "zclip_clip_rate",
                   "skip_nonfinite": "skip_nonfinite_rate", "skip_spikes": "skip_spikes_rate",
                   "muon_fallback": "muon_fallback_rate"}


def _event_sample(spec: MetricsSpec, rate: Rate, metrics: Mapping[str, Any],
                  prev_counters: Mapping[str, float],
                  steps: int) -> tuple[Optional[float], Optional[str]]:
  """(events, how): events over ``steps`` from the counter, or a one-step sample of the flag."""
  assert rate.counter is not None
  key = spec.key(rate.counter)
  c = _as_float(metrics.get(key))
  if c is not None and math.isfinite(c):
    prev = prev_counters.get(key)
    if prev is not None and steps > 0 and c >= prev:
      return c - prev, "counter"
    # counter present but no usable baseline: fall through to the flag
  f = _as_float(metrics.get(spec.key(rate.flag)))
  if f is None or not math.isfinite(f):
    return None, None
  if rate.tensors:
    f = 1.0 if f > 0 else 0.0  # fraction of tensors -> "it happened this step"
  return min(max(f, 0.0), 1.0), "flag"


class StabilityMonitor:
  """Sliding-window stability rates, gradient health and warnings, on the host.

  Feed it one train record every log interval with :meth:`update`; it returns
  new warning lines: a gradient health level entered (once, not repeated while
  the level stays; by default relative to the run's own median gradient norm,
  see :class:`HealthThresholds`), the return to healthy, and (once a full ``window`` of steps
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
      loss of the last window is not below that of the window before. Not while
      the logged learning rate (``lr``) is below half of its largest value so far:
      in the decay phase of a schedule a flattening loss is expected (and the
      row's advice, a longer warmup, does not apply).
    attention: thresholds of the attention-logit rule; None turns it off.
    update_norm: thresholds of the update-norm rule (:mod:`stablejax.monitor.update_norm`); None
      turns it off.

  Example:
    A gradient norm that falls from its value at initialisation sets the reference; one 14
    times the median of the norms before it is critical:

    >>> from stablejax import StabilityMonitor
    >>> monitor = StabilityMonitor(window=100)
    >>> [monitor.update(step, {"loss": 3.2, "grad_norm": g, "zclip/spike_count": 0})
    ...  for step, g in [(10, 55.0), (20, 3.0), (30, 1.2), (40, 1.1)]]
    [[], [], [], []]
    >>> print(*monitor.update(50, {"loss": 3.1, "grad_norm": 30.0}))
    step 50: gradient health critical (grad norm 30; grad norm > 10 x 2.1, the median grad
    norm of the last 200 steps)
    >>> monitor.update(60, {"loss": 3.0, "grad_norm": 1.0})
    ['step 60: gradient health back to healthy (grad norm 1)']
  """

  def __init__(self, window: int = 100, thresholds: HealthThresholds = HealthThresholds(),
               score_target: float = 0.8, advice_every: Optional[int] = None,
               loss_plateau_check: bool = True,
               attention: Optional[AttentionLogitThresholds] = AttentionLogitThresholds(),
               update_norm: Optional[UpdateNormThresholds] = UpdateNormThresholds()):
    if not isinstance(window, int) or window < 1:
      raise ValueError(f"StabilityMonitor window must be a positive int of steps, got {window!r}")
    if not 0.0 <= score_target <= 1.0:
      raise ValueError(f"StabilityMonitor score_target must be in [0, 1], got {score_target!r}")
    if advice_every is not None and (not isinstance(advice_every, int) or advice_every < 1):
      raise ValueError(
          f"StabilityMonitor advice_every must be a positive int, got {advice_every!r}")
    if not isinstance(thresholds, HealthThresholds):
      raise ValueError("StabilityMonitor thresholds must be a HealthThresholds instance")
    if attention is not None and not isinstance(attention, AttentionLogitThresholds):
      raise ValueError("StabilityMonitor attention must be an AttentionLogitThresholds or None")
    if update_norm is not None and not isinstance(update_norm, UpdateNormThresholds):
      raise ValueError("StabilityMonitor update_norm must be an UpdateNormThresholds or None")
    self.attention = attention
    self.update_norm = update_norm
    self.window = window
    self.thresholds = thresholds
    self.score_target = float(score_target)
    self.advice_every = window if advice_every is None else advice_every
    self.loss_plateau_check = loss_plateau_check
    self._reset()

  def _reset(self) -> None:
    self._clock = 0                     # monotonic count of steps seen
    self._last_step: Optional[int] = None
    self._counters: dict[str, float] = {}
    # entries: [clock_end, {kind: [events, steps]}, {sampled_name: value}]
    self._entries: collections.deque = collections.deque()
    self._losses: collections.deque = collections.deque()   # [clock, loss]
    self._rollbacks: list[list] = []    # [clock, step, cause]
    self._health = GradientHealth(self.thresholds)
    self._thresholds: dict[str, float] = {}   # spec prefix -> latest clip value in effect
    self._last_advice_clock: Optional[int] = None
    self._n_updates = 0
    self._n_warnings = 0
    self._last_loss: Optional[float] = None
    self._peak_lr: Optional[float] = None   # largest logged lr, and the latest
    self._last_lr: Optional[float] = None
    self._attention = AttentionLogitRule(self.attention) if self.attention is not None else None
    self._updates = UpdateNormRule(self.update_norm) if self.update_norm is not None else None
    self._transitions = HandledTransitions()    # a handled single-step transition held back

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
    sampled: dict[str, float] = {}
    prev = self._counters if have_baseline else {}
    new_counters = {}
    for spec, rate in specs.rates():
      if rate.counter is None:  # a per-step fraction, averaged over the window's records
        v = _as_float(metrics.get(spec.key(rate.flag)))
        if v is not None and math.isfinite(v):
          sampled[rate.name] = v
        continue
      n, how = _event_sample(spec, rate, metrics, prev, steps)
      value = _as_float(metrics.get(spec.key(rate.counter)))
      if value is not None and math.isfinite(value):
        new_counters[spec.key(rate.counter)] = value
      if n is not None:
        events[rate.name] = [n, steps if how == "counter" else 1]
    self._counters = new_counters
    for spec in specs.metric_specs():
      thr = _as_float(metrics.get(spec.key(spec.threshold))) if spec.threshold else None
      if thr is not None and math.isfinite(thr):
        self._thresholds[spec.prefix] = thr

    self._entries.append([self._clock, events, sampled])
    lr = _as_float(metrics.get("lr"))
    if lr is not None and math.isfinite(lr):
      self._last_lr = lr
      self._peak_lr = lr if self._peak_lr is None else max(self._peak_lr, lr)
    loss = _as_float(metrics.get("loss"))
    if loss is not None:
      self._last_loss = loss
      if math.isfinite(loss):
        self._losses.append([self._clock, loss])
    self._trim()

    lines = []
    old_level, levels_read = self._health.level, sum(self._health.level_counts.values())
    handled = any((_as_float(metrics.get(key)) or 0.0) > 0 for key in specs.acted_keys())
    lines += self._transitions.filter(
        self._update_level(step, metrics, loss), old_level, self._health.level, handled,
        measured=sum(self._health.level_counts.values()) > levels_read)
    if self._attention is not None:
      lines += self._attention.update(step, self._clock, metrics)
    if self._updates is not None:
      lines += self._updates.update(step, self._clock, metrics)
    lines += self._advice_lines(step)
    self._n_warnings += len(lines)
    return lines

  def observe_initial(self, metrics: Mapping[str, Any]) -> None:
    """The telemetry of the initial parameters (step 0), before the first record: the attention
    rule's rate condition measures the first logged step's growth from it. Nothing is counted
    and no warning is given."""
    if self._attention is not None:
      self._attention.observe_initial(metrics)

  def record_rollback(self, step: int, cause: str = "") -> None:
    """Records a rollback (restore of an earlier checkpoint) at ``step``.

    Args:
      step: the step at which the trainer decided to roll back.
      cause: short reason, kept for :meth:`summary`.
    """
    self._rollbacks.append([self._clock, int(step), str(cause)])

  def _trim(self) -> None:
    start = self._clock - self.window
    while self._entries and self._entries[0][0] <= start:
      self._entries.popleft()
    while self._losses and self._losses[0][0] <= self._clock - 2 * self.window:
      self._losses.popleft()

  def _update_level(self, step: int, metrics: Mapping[str, Any],
                    loss: Optional[float]) -> list[str]:
    g = None
    for key in specs.grad_norm_keys():
      g = _as_float(metrics.get(key))
      if g is not None:
        break
    # a non-finite skip means this step's gradient was NaN/Inf; the optimizer-state norms then
    # still show the last accepted step, so the flag decides.
    skipped_nonfinite = any((_as_float(metrics.get(key)) or 0.0) > 0
                            for key in specs.nonfinite_keys())
    exploded = skipped_nonfinite or (loss is not None and not math.isfinite(loss))
    return self._health.update(step, self._clock, g, exploded)

  def _loss_plateau(self) -> bool:
    if not self.loss_plateau_check or not self._losses:
      return False
    if self._peak_lr is not None and self._last_lr is not None \
        and self._last_lr < 0.5 * self._peak_lr:
      return False  # the schedule's decay phase: a flatter loss is expected
    if self._clock < 2 * self.window:
      return False
    mid = self._clock - self.window
    recent = [value for c, value in self._losses if c > mid]
    older = [value for c, value in self._losses if c <= mid]
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
      # Enough decimals to show the difference (0.7996 is not "0.80 < target 0.80").
      digits = next((d for d in range(2, 6) if f"{score:.{d}f}" != f"{self.score_target:.{d}f}"),
                    6)
      head = (f"step {step}: stability score {score:.{digits}f} < target "
              f"{self.score_target:.{digits}f}")
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
    return self._health.level

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
    skip = None
    for spec in specs.metric_specs():
      for rate in spec.rates:
        if rate.name in sums:
          n, s = sums[rate.name]
          r = n / s if s else 0.0
          out[rate.name] = r if rate.tensors else min(r, 1.0)
        elif rate.name in samples:
          out[rate.name] = sum(samples[rate.name]) / len(samples[rate.name])
        else:
          continue
        if rate.skip:
          skip = (skip or 0.0) + out[rate.name]
      if spec.prefix in self._thresholds:
        out[f"{spec.prefix}_threshold"] = self._thresholds[spec.prefix]
    if skip is not None:
      out[specs.SKIP_RATE] = min(skip, 1.0)
    start = self._clock - self.window
    out[specs.ROLLBACKS] = float(sum(1 for c, _, _ in self._rollbacks if c > start))
    return out

  def score(self) -> float:
    """:func:`stability_score` of the current window rates (1.0 with no data)."""
    return stability_score(self.rates())

  def advice(self) -> list[str]:
    """Troubleshooting rows that fire for the current window (not rate-limited), and the
    attention-logit advice while that rule holds."""
    lines = troubleshooting_advice(self.rates(), self._loss_plateau())
    if self._attention is not None and self._attention.active:
      lines.append(f"attention logits growing: {ATTENTION_ADVICE}")
    return lines

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
        "level": self._health.level,
        "score": self.score(),
        "score_target": self.score_target,
        "rates": self.rates(),
        "level_counts": dict(self._health.level_counts),
        "max_grad_norm": self._health.max_grad_norm,
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
        "version": 2,
        "clock": self._clock,
        "last_step": self._last_step,
        "counters": dict(self._counters),
        "entries": [[c, {k: list(v) for k, v in e.items()}, dict(s)] for c, e, s in self._entries],
        "losses": [list(x) for x in self._losses],
        "rollbacks": [list(x) for x in self._rollbacks],
        **self._health.state_dict(),
        "thresholds": dict(self._thresholds),
        "last_advice_clock": self._last_advice_clock,
        "updates": self._n_updates,
        "warnings": self._n_warnings,
        "last_loss": self._last_loss,
        "peak_lr": self._peak_lr,
        "last_lr": self._last_lr,
        **({} if self._attention is None else self._attention.state_dict()),
        "update_norm": None if self._updates is None else self._updates.state_dict(),
        "held_transition": self._transitions.state_dict(),
    }

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    """Restores what :meth:`state_dict` returned (the constructor arguments stay)."""
    if not isinstance(state, Mapping) or state.get("version") not in (1, 2):
      raise ValueError(
          "StabilityMonitor.load_state_dict needs a dict from state_dict() (version 1 or 2)")
    # Version 1 (checkpoints of stablejax 0.1) named its event counts by kind, not by rate, and
    # kept ZClip's threshold alone.
    renamed = _V1_EVENT_KINDS if state["version"] == 1 else {}
    self._reset()
    self._clock = int(state["clock"])
    self._last_step = None if state["last_step"] is None else int(state["last_step"])
    self._counters = {k: float(v) for k, v in state["counters"].items()}
    self._entries = collections.deque(
        [int(c), {renamed.get(k, k): [float(v[0]), int(v[1])] for k, v in e.items()},
         {k: float(v) for k, v in s.items()}] for c, e, s in state["entries"])
    self._losses = collections.deque([int(c), float(value)] for c, value in state["losses"])
    self._rollbacks = [[int(c), int(s), str(m)] for c, s, m in state["rollbacks"]]
    self._health.load_state_dict(state)
    if state["version"] == 1:
      self._thresholds = {} if state["threshold"] is None else {"zclip": state["threshold"]}
    else:
      self._thresholds = {str(k): float(v) for k, v in state["thresholds"].items()}
    self._last_advice_clock = state["last_advice_clock"]
    self._n_updates = int(state["updates"])
    self._n_warnings = int(state["warnings"])
    self._last_loss = state["last_loss"]
    # Absent from states saved before the attention rule and the lr-aware plateau existed.
    self._peak_lr = state.get("peak_lr")
    self._last_lr = state.get("last_lr")
    if self._attention is not None:
      self._attention.load_state_dict(state)
    # Absent from states saved before the update-norm rule and the handled-transition hold.
    if self._updates is not None and state.get("update_norm"):
      self._updates.load_state_dict(state["update_norm"])
    self._transitions.load_state_dict(state.get("held_transition"))
    self._trim()
