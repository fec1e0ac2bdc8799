"""The periodic actions of the training loop, each saying when it is due.

:class:`Logging` (step 1 and every ``train.log_every`` steps, read one step late),
:class:`Evaluation` (``train.eval_every``), :class:`Sampling` (``logging.sample_every``),
:class:`Diagnostics` (``logging.activation_every`` / ``histogram_every``), :class:`Checkpointing`
(``checkpoint.every``, deferred while the loss is elevated) and :class:`TimeBudget` (the time
budget's early stop, checked at log steps). An action that finds a reason to roll back returns it
(a string); the loop then asks the recovery. Only these actions fetch from the device, and only at
their steps.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from stablejax.monitor.movement import movement_record, movement_warnings, param_dtypes
from stablejax.monitor.specs import skip_flag_keys
from stablejax.monitor.stability_monitor import StabilityMonitor
from stablejax.monitor.tensorboard import tensorboard_scalars
from stablejax.training.launch import compilation_cache
from stablejax.training.loop.batches import Batches, fetch, kill_if_due, total_skips
from stablejax.training.loop.budget import Budget
from stablejax.training.checkpoint import Checkpoints
from stablejax.training.loop.components import Components
from stablejax.training.run_folder.logger import RunLogger
from stablejax.training.recovery.policy import Recovery
from stablejax.training.loop.step import TrainState
from stablejax.transforms import defence

Agree = Callable[[Optional[str]], Optional[str]]
Reject = Callable[[list[tuple[int, int]], str], None]  # ([(position, step index)], cause)


class Logging:
  """At step 1 and every ``train.log_every`` steps: the step's metrics (with the attention-logit
  telemetry), read one step late so the host never stalls the device; the monitor's warnings;
  the record in metrics.jsonl and TensorBoard; the recovery's check of the record. Step 1 is
  logged too so that the monitor sees a run from its first update: a learning rate high enough
  to break a model breaks it within the first log interval."""

  def __init__(self, components: Components, log: RunLogger, monitor: StabilityMonitor,
               recovery: Recovery, agree: Agree, progress: Any,
               abandoned_skips: Callable[[], int], reject: Reject = lambda batches, cause: None,
               extras: tuple[Callable[[], dict], ...] = ()):
    self.components, self.log, self.monitor, self.recovery = components, log, monitor, recovery
    self.agree, self.progress, self.abandoned_skips = agree, progress, abandoned_skips
    self.reject, self.extras = reject, extras
    self.seconds_per_step = float("nan")  # of the latest interval between two records
    self.intervals = 0                     # intervals measured since the start
    self.pending: Optional[tuple[int, Any]] = None
    # (step index, batch position, skip flags on device) of the steps not read yet
    self.skip_flags: list[tuple[int, int, dict]] = []
    self.initial: Any = None            # the initial parameters' telemetry, until written
    self.initial_record: dict = {}      # ... and after
    self.last_record: dict = {}
    self.tokens_per_sec = float("nan")
    self.t_interval, self.tokens_interval = time.time(), 0

  def due(self, step: int) -> bool:
    return step == 1 or step % self.components.cfg.train.log_every == 0

  def stepped(self, index: int = -1, position: int = -1, metrics: Optional[dict] = None) -> None:
    """Counts one step's tokens for the throughput, and keeps the skip wrappers' flags of step
    ``index`` (batch ``position``): read with the next record, never on their own."""
    self.tokens_interval += self.components.cfg.train.batch_size * self.components.cfg.train.seq_len
    if metrics is not None:
      flags = {key: metrics[key] for key in skip_flag_keys(metrics)}
      if flags:
        self.skip_flags.append((index, position, flags))

  def skipped_until(self, step: int) -> list[tuple[int, int, list[str]]]:
    """The kept steps before ``step`` (a step index) that a skip wrapper skipped, as (step index,
    batch position, the wrappers); the steps from ``step`` on stay kept (still running)."""
    due = [entry for entry in self.skip_flags if entry[0] < step]
    self.skip_flags = [entry for entry in self.skip_flags if entry[0] >= step]
    if not due:
      return []
    values = jax.device_get([flags for _, _, flags in due])
    return [(index, position, names) for (index, position, _), flags in zip(due, values)
            if (names := [key.split("/")[0] for key, flag in flags.items() if bool(flag)])]

  def baseline(self, state: TrainState, tokens: jax.Array) -> None:
    """Dispatches the attention telemetry of the initial parameters (before the first update of a
    fresh start); the monitor gets it with step 1's record, as the base of its growth."""
    if self.components.telemetry:
      self.initial = self.components.logit_telemetry(state.params, tokens, np.int32(0))

  def hold(self, step: int, metrics: dict, state: TrainState, tokens: jax.Array) -> None:
    """Keeps ``step``'s device metrics (and dispatches its telemetry) for :meth:`write_held`."""
    if self.components.telemetry:
      metrics = {**metrics, **self.components.logit_telemetry(state.params, tokens, np.int32(step))}
    self.pending = (step, metrics)

  def write_held(self) -> Optional[str]:
    """Writes the held record, if any; returns the rollback cause the recovery finds in it (agreed
    by all processes) or None."""
    if self.pending is None:
      return None
    (step, metrics), self.pending = self.pending, None
    return self.write(step, metrics)

  def write(self, step: int, device_metrics: Any) -> Optional[str]:
    """Writes ``step``'s record (console, metrics.jsonl, TensorBoard); returns the rollback cause
    the recovery finds in it or None."""
    record = {"step": step, **fetch(device_metrics)}
    skipped = self.skipped_until(step)
    if skipped:
      self.reject([(position, index) for index, position, _ in skipped], skip_cause(skipped))
    for extra in self.extras:
      record.update(extra())
    self.publish(record)
    enabled = self.components.cfg.stability.recovery.enabled
    return self.agree(self.recovery.check_train(record) if enabled else None)

  def publish(self, record: dict) -> None:
    """Writes a fetched record: the monitor's warnings, metrics.jsonl, TensorBoard, the bar."""
    step, now = record["step"], time.time()
    if self.tokens_interval:
      self.tokens_per_sec = self.tokens_interval / max(now - self.t_interval, 1e-9)
      t = self.components.cfg.train
      self.seconds_per_step = t.batch_size * t.seq_len / max(self.tokens_per_sec, 1e-9)
      self.intervals += 1
    self.t_interval, self.tokens_interval = now, 0
    record["tokens_per_sec"] = self.tokens_per_sec
    if self.initial is not None:
      self.initial_record, self.initial = fetch(self.initial), None
      self.monitor.observe_initial(self.initial_record)
    for line in self.monitor.update(step, record):
      self.log.console(f"warning: {line}")
      self.log.record({"step": step, "event": "warning", "cause": line})
    record["stability_score"] = self.monitor.score()
    record["health"] = self.monitor.level
    if self.intervals == 1 and (cached := compilation_cache.summary()):  # the start's first
      self.log.console(f"step {step}: {cached}")
    self.log.record(record, tensorboard_scalars(record, rates=self.monitor.rates()))
    self.progress.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{self.tokens_per_sec:,.0f}",
                              skipped=total_skips(record) + self.abandoned_skips(),
                              refresh=False)
    self.last_record = record


class Evaluation:
  """Every ``train.eval_every`` steps (not at the last, which has the final eval): the validation
  loss on the fixed batches, the target-loss record, and the recovery's check of it."""

  def __init__(self, components: Components, val_batches: list[jax.Array], log: RunLogger,
               recovery: Recovery, budget: Budget, agree: Agree,
               sample: Callable[[int, Any], None]):
    self.components, self.val_batches = components, val_batches
    self.log, self.recovery = log, recovery
    self.budget, self.agree, self.sample = budget, agree, sample
    self.last_val_loss: Optional[float] = None

  def due(self, step: int) -> bool:
    return step % self.components.cfg.train.eval_every == 0 and step < self.components.total_steps

  def __call__(self, step: int, state: TrainState, final: bool = False) -> Optional[str]:
    losses = [self.components.eval_step(state.params, b, np.int32(step)) for b in self.val_batches]
    val_loss = float(np.mean(jax.device_get(losses)))
    self.last_val_loss = val_loss
    record = {"step": step, "val_loss": val_loss}
    self.log.record(record, tensorboard_scalars(record))
    self.log.console(f"step {step}: val_loss {val_loss:.4f}" + (" (final)" if final else ""))
    if self.budget.check_target(step, val_loss):
      self.log.console(f"step {step}: val_loss below the target {self.budget.target} after "
                       f"{self.budget.time_to_target:.0f} s")
    if final and self.components.sampler is not None:
      self.sample(step, state)
    if final or not self.components.cfg.stability.recovery.enabled:
      return None
    return self.agree(self.recovery.check_val(val_loss))


class Sampling:
  """``logging.sample_every``: a sample at the steps it names (None: at each eval), printed and
  sent to TensorBoard; the final eval samples too."""

  def __init__(self, components: Components, log: RunLogger):
    self.components, self.log = components, log

  def due(self, step: int) -> bool:
    every = self.components.cfg.logging.sample_every
    if self.components.sampler is None or step >= self.components.total_steps:
      return False
    return step % (self.components.cfg.train.eval_every if every is None else every) == 0

  def __call__(self, step: int, state: TrainState) -> None:
    assert self.components.sampler is not None
    text = self.components.sampler(state.params, step)
    self.log.console(f"step {step}: sample {json.dumps(text, ensure_ascii=False)}")
    self.log.text("samples", f"```\n{text}\n```", step)


class Diagnostics:
  """Activation statistics with the parameter-movement check (``logging.activation_every``) and
  per-layer gradient norms (``logging.histogram_every``) on a fixed validation batch."""

  def __init__(self, components: Components, batch: Optional[jax.Array], log: RunLogger):
    self.components, self.batch, self.log = components, batch, log
    self.previous_params: Any = None
    self.last_kurtosis: Optional[float] = None

  def due(self, step: int) -> bool:
    lg = self.components.cfg.logging
    return self.batch is not None and any(
        n and step % n == 0 for n in (lg.activation_every, lg.histogram_every))

  def __call__(self, step: int, state: TrainState) -> None:
    lg = self.components.cfg.logging
    assert self.batch is not None, "due() is False without a validation batch"
    record: dict[str, Any] = {"step": step}
    if lg.activation_every and step % lg.activation_every == 0:
      if self.components.activation_statistics:  # the model family offers its residual stream
        stats = self.components.activation_stats(state.params, self.batch, np.int32(step))
        record.update(fetch(stats))
        self.last_kurtosis = record["excess_kurtosis"]
      record.update(self._movement(step, state))
    if lg.histogram_every and step % lg.histogram_every == 0:
      norms = fetch(self.components.grad_norms(state.params, self.batch))
      self.log.histogram("grads/layer_norms", list(norms.values()), step)
      for name, value in norms.items():
        record[f"grad_norm/{name}"] = value
    self.log.record(record, tensorboard_scalars(record))

  def _movement(self, step: int, state: TrainState) -> dict:
    """Per-group relative parameter change since the previous check ("are parameters moving?")."""
    previous, self.previous_params = self.previous_params, jax.tree.map(jnp.copy, state.params)
    if previous is None:
      return {}
    movement = jax.device_get(self.components.param_movement(previous, state.params))
    # Compensated low-precision updates (stablejax.compensated_updates) keep what rounds away, so
    # an update below the parameters' resolution is not lost: only a group that does not move
    # at all is stuck then.
    compensated = any(d.changes_update_application for d in defence.in_state(state.opt_state))
    for line in movement_warnings(movement, dtypes=param_dtypes(state.params), step=step,
                                  min_resolution_ratio=0.0 if compensated else 1.0):
      self.log.console(f"warning: {line}")
      self.log.record({"step": step, "event": "warning", "cause": line})
    return movement_record(movement)


class Checkpointing:
  """``checkpoint.every`` steps and the last: a save, unless the latest loss is elevated (then
  deferred to the next log step, so only a healthy state becomes a rollback target)."""

  def __init__(self, components: Components, checkpoints: Checkpoints, batches: Batches,
               meta: Callable[[], dict], recovery: Recovery, log: RunLogger,
               verify: Callable[[int, TrainState], None] = lambda step, state: None):
    self.components, self.checkpoints = components, checkpoints
    self.batches, self.meta = batches, meta
    self.recovery, self.log = recovery, log
    self.verify = verify  # raises when the state must not be saved (replicas that differ)
    self.deferred = False

  def due(self, step: int) -> bool:
    cfg = self.components.cfg
    return step % cfg.checkpoint.every == 0 or step == self.components.total_steps or (
        self.deferred and step % cfg.train.log_every == 0)

  def __call__(self, step: int, state: TrainState) -> None:
    self.deferred = not self.recovery.healthy()
    if self.deferred:
      self.log.record({"step": step, "event": "checkpoint_deferred",
                       "cause": "train loss elevated"})
    else:
      self.save(step, state)

  def save(self, step: int, state: TrainState) -> None:
    self.verify(step, state)
    on_disk = set(self.checkpoints.all_steps())
    meta = {"step": step, **self.batches.state_dict(step, on_disk), **self.meta(), "good": True}
    self.checkpoints.save(step, state, self.batches.stream, meta)
    kill_if_due(self.components.cfg.faults, step, "save")


class DeterminismCheck:
  """``stability.determinism.check_every``: before every N-th step, its forward and backward run
  twice more (two executions of one compiled program, on the step's own inputs); the largest
  difference of loss and of gradient norm between the two is recorded with the next logged
  record (``determinism/*``) and said once when it is not zero: a nondeterministic kernel, or a
  device that computes differently from one execution to the next. Zero on XLA:CPU."""

  def __init__(self, components: Components, batches: Batches, log: RunLogger):
    self.components, self.batches, self.log = components, batches, log
    self.pending: list[tuple[int, list[dict]]] = []
    self.checks, self.max_loss_diff, self.max_grad_norm_diff = 0, 0.0, 0.0
    self.said = False

  def due(self, step: int) -> bool:
    every = self.components.cfg.stability.determinism.check_every
    return bool(every) and step % every == 0

  def __call__(self, step: int, state: TrainState, batch: dict) -> None:
    """Runs the check on ``step``'s inputs (before the step, which donates the state)."""
    position = self.batches.positions[step]
    runs = []
    for _ in range(2):  # each execution draws its own fault factor (faults.nondeterministic_*)
      scale = self.batches.grad_scale(step, position, first_execution=False)
      runs.append(self.components.gradient_check(
          state.params, {**batch, "grad_scale": np.float32(scale)}, np.int32(step)))
    self.pending.append((step, runs))

  def record(self) -> dict:
    """The checks since the last record, read now (with a logged record)."""
    if not self.pending and not self.checks:
      return {}
    pending, self.pending = self.pending, []
    for step, (a, b) in zip([s for s, _ in pending], jax.device_get([r for _, r in pending])):
      diffs = {key: _difference(float(a[key]), float(b[key])) for key in ("loss", "grad_norm")}
      self.checks += 1
      self.max_loss_diff = max(self.max_loss_diff, diffs["loss"])
      self.max_grad_norm_diff = max(self.max_grad_norm_diff, diffs["grad_norm"])
      if (diffs["loss"] or diffs["grad_norm"]) and not self.said:
        self.said = True
        line = (f"step {step + 1}: two executions of the same step differ (loss by "
                f"{diffs['loss']:.3g}, gradient norm by {diffs['grad_norm']:.3g}): a "
                "nondeterministic kernel or a flaky device; replays may not reproduce exactly")
        self.log.console(f"warning: {line}")
        self.log.record({"step": step + 1, "event": "nondeterminism", "cause": line, **diffs})
    return {"determinism/checks": self.checks, "determinism/max_loss_diff": self.max_loss_diff,
            "determinism/max_grad_norm_diff": self.max_grad_norm_diff}


def skip_cause(skipped: list[tuple[int, int, list[str]]]) -> str:
  """``skip_nonfinite skipped steps 13, 14`` for (step index, position, wrappers) entries."""
  names = sorted({name for _, _, wrappers in skipped for name in wrappers})
  steps = ", ".join(str(index + 1) for index, _, _ in skipped)
  return f"{' and '.join(names)} skipped step{'s' if len(skipped) > 1 else ''} {steps}"


def _difference(a: float, b: float) -> float:
  """|a - b|, 0 when both are the same non-finite value, inf when only one is finite."""
  if a == b or (np.isnan(a) and np.isnan(b)):
    return 0.0
  return abs(a - b) if np.isfinite(a) and np.isfinite(b) else float("inf")


class TimeBudget:
  """``train.time_budget_minutes``: at log steps, whether another step, the final eval and the
  final save still fit; if not, the run ends early with a checkpoint. Processes read their own
  clocks, so they agree on it. The next step is taken to last as long as the steps since the
  previous check did, when longer than measured (a busier machine, or a slower one on resume)."""

  def __init__(self, budget: Budget, log: RunLogger, agree_any: Callable[[bool], bool]):
    self.budget, self.log, self.agree_any = budget, log, agree_any
    self.checked = (time.time(), 0)  # (when, at which step) the last check ran

  def start(self, step: int) -> None:
    self.checked = (time.time(), step)

  def out_of_time(self, step: Optional[int] = None) -> bool:
    recent = None
    if step is not None:
      (then, previous), now = self.checked, time.time()
      if step > previous:
        recent = (now - then) / (step - previous)
      self.checked = (now, step)
    return self.agree_any(self.budget.out_of_time(recent))

  def stop(self, step: int, total: int, save: Optional[Callable[[int], None]]) -> None:
    """Ends the run early at ``step`` (``save``: the checkpoint to write first, or None)."""
    why = ("earlier segments of this run used the rest of it" if self.budget.segments > 1
           else "steps ran slower than measured")
    self.log.console(f"warning: step {step}: stopping before the planned {total} steps to stay "
                     f"within train.time_budget_minutes ({why}); the learning rate is not at its "
                     "floor")
    self.budget.stopped_at = step
    if save is not None:
      save(step)
