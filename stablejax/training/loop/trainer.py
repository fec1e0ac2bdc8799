"""The training run: open the run directory, build, restore, train with the periodic actions,
summarise.

Exit codes: 0 done, 2 bad config/data/checkpoints/run directory (raised as errors and reported
by ``python -m stablejax train``), 3 diverged beyond the recovery budget, 16 transient faults on
one device (hardware suspect; a checkpoint was saved: restart elsewhere), 17 replicas of the
parameters differ (silent data corruption; nothing saved since the last check), 18 hung (the
watchdog wrote every thread's stack), 130 interrupted (SIGINT/SIGTERM/SIGHUP; a checkpoint was
saved, unless the run was stuck past ``stability.watchdog.grace_seconds``).

What is built once is :class:`stablejax.training.loop.components.Components`; what happens every so
many steps is in :mod:`stablejax.training.loop.actions`; restoring and rolling back is
:mod:`stablejax.training.recovery.restorer`; what a failure is answered with (replay, then go on or
roll back) is :mod:`stablejax.training.recovery.healing`; the watchdog is
:mod:`stablejax.training.recovery.watchdog`; the run directory's ownership and lock are
:mod:`stablejax.training.run_folder.folder`; the banner and the summary are
:mod:`stablejax.training.run_folder.summary`. :meth:`Trainer._train_from` is the step loop.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Optional

import jax
import numpy as np
import optax
from tqdm import tqdm

from stablejax.data.identity import data_identity
from stablejax.data.pipeline import build_data
from stablejax.monitor.health import HealthThresholds
from stablejax.monitor.stability_monitor import StabilityMonitor
from stablejax.training.loop import actions
from stablejax.training.launch import compilation_cache, distributed
from stablejax.training.recovery import resume
from stablejax.training.run_folder import summary as run_summary
from stablejax.training.loop.components import OptimizerFactory, build_components, with_steps
from stablejax.training.loop.batches import (Batches, hang_if_due, hang_in_pipeline, kill_if_due,
                                       state_faults)
from stablejax.training.loop.budget import CLOCK_FILE, PROBE_DIR, Budget
from stablejax.training.checkpoint import Checkpoints, write_json_atomic
from stablejax.training.config import Config, ConfigError, load_run_file
from stablejax.training.run_folder.data_order import data_order
from stablejax.training.recovery.healing import EXIT_TRANSIENT, Healing
from stablejax.training.run_folder.logger import RunLogger
from stablejax.training.recovery.policy import Recovery
from stablejax.training.recovery.rejected import RejectedBatches
from stablejax.training.recovery.replay import Replayer
from stablejax.training.recovery.replicas import EXIT_REPLICAS_DIFFER, ReplicaCheck, ReplicasDiffer
from stablejax.training.recovery.restorer import RECOVERY_FILE, Restorer
from stablejax.training.run_folder.folder import RunDirectory
from stablejax.training.run_folder.checks import run_inputs
from stablejax.training.launch.signals import Interrupted, StopSignals
from stablejax.training.recovery.watchdog import EXIT_HUNG, Watchdog

EXIT_OK, EXIT_DIVERGED, EXIT_INTERRUPTED = 0, 3, 130

__all__ = [
    "EXIT_DIVERGED", "EXIT_HUNG", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_REPLICAS_DIFFER",
    "EXIT_TRANSIENT", "Interrupted", "RECOVERY_FILE", "Trainer",
]


class Trainer:
  """One training run in ``out_dir``; ``Trainer(cfg, out_dir, fresh).train()`` returns the exit
  code.

  ``out_dir`` receives the checkpoints, ``config.json``, ``metrics.jsonl``, ``summary.json`` and
  the TensorBoard logs, and ``run.json``, the record of what the run wrote there; a checkpoint
  there resumes. The run holds the directory's lock until :meth:`train` returns.

  Args:
    cfg: the run's config.
    out_dir: the run directory.
    fresh: remove what an earlier run wrote in ``out_dir`` first (only what its record lists).
    tx: a whole chain instead of the configured one (its schedules are the caller's); it must
      contain one ``optax.inject_hyperparams(optax.scale)(step_size=1.0)``, the learning-rate
      scale that the recovery backs off.
    optimizer: ``(cfg, main) -> chain`` around the configured main optimizer instead of
      ``build_optimizer`` (rebuilt when the time budget fixes the step count).
    data_changed: resume on data other than the run recorded (its identity is updated; the
      tokenizer must stay the run's).
    reset_optimizer: at resume, start the optimizer's state afresh (keeping the parameters, the
      step, the data position and the monitor): needed to switch between Muon and AdamW.
    signals: the stop-signal handler a program installed before its imports.
    config_file: the config file the run was given (``--config``): it must not lie where the
      trainer writes in ``out_dir``.

  Example:
    >>> import contextlib, io, json, pathlib, tempfile
    >>> from stablejax.training.config import load_config
    >>> from stablejax.training.loop.trainer import Trainer
    >>> cfg = load_config(None, [
    ...     "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.max_seq_len=16",
    ...     "train.seq_len=16", "train.batch_size=4", "train.steps=4", "train.warmup_steps=1",
    ...     "train.eval_every=4", "train.eval_batches=1", "train.peak_flops_per_device=1e12",
    ...     "logging.sample_every=0", "logging.progress=false", "checkpoint.every=4"])
    >>> out = pathlib.Path(tempfile.mkdtemp())
    >>> with contextlib.redirect_stdout(io.StringIO()):
    ...   code = Trainer(cfg, out).train()
    >>> code, json.loads((out / "summary.json").read_text())["steps"]
    (0, 4)
  """

  def __init__(self, cfg: Config, out_dir: Path | str, fresh: bool = False,
               tx: Optional[optax.GradientTransformationExtraArgs] = None,
               optimizer: Optional[OptimizerFactory] = None,
               data_changed: bool = False, reset_optimizer: bool = False,
               signals: Optional[StopSignals] = None, config_file: Optional[Path] = None):
    self.t_start = time.time()
    # From here a signal stops the run at the next safe point (between start-up phases, or at a
    # step), never in the middle of a compilation, a checkpoint save or the budget's probe.
    self.signals = signals or StopSignals()
    self.signals.install()
    distributed.initialize(cfg.mesh)  # before anything touches a JAX backend
    # Joining a job starts XLA's preemption notifier, which takes SIGTERM for itself: the
    # trainer's handler takes it back (a signal received meanwhile stays recorded).
    if cfg.mesh.distributed:
      self.signals.reclaim()
    self.is_main = distributed.is_main()
    self.run_dir = RunDirectory.open(out_dir, fresh=fresh, is_main=self.is_main,
                                     inputs=run_inputs(cfg, config_file))
    self.fresh = fresh
    try:
      self._build(cfg, tx, optimizer, data_changed, reset_optimizer)
    except BaseException:
      if hasattr(self, "checkpoints"):
        self.checkpoints.close()  # no Orbax thread may outlive a refused start
      self.run_dir.close()
      raise

  def _build(self, cfg: Config, tx: Optional[optax.GradientTransformationExtraArgs],
             optimizer: Optional[OptimizerFactory], data_changed: bool,
             reset_optimizer: bool) -> None:
    self.custom_tx, self.data_changed = tx, data_changed
    self.recorded = None if self.fresh else self._recorded_config()
    self.log = RunLogger(self.run_dir, tensorboard=cfg.logging.tensorboard)  # console until opened
    if cfg.mesh.distributed:  # before the first compilation
      compilation_cache.turn_off_for_multiprocess_cpu(jax.process_count(), jax.default_backend(),
                                                      say=self.log.console)
    # Data first: a bad path is the commonest mistake and should fail before any compilation.
    t = cfg.train
    data = build_data(cfg.data, seq_len=t.seq_len, batch_size=t.batch_size, seed=t.seed,
                      process_index=jax.process_index(), process_count=jax.process_count())
    if data.vocab_size > cfg.model.vocab_size:
      raise ConfigError(f"the data has {data.vocab_size} token ids but model.vocab_size="
                        f"{cfg.model.vocab_size}: set model.vocab_size >= {data.vocab_size}")
    self.signals.check_startup("loading the data")
    self.budget = Budget(cfg.train, self.t_start, clock_file=self.run_dir.root / CLOCK_FILE)
    if cfg.train.steps is None:
      # The time budget fixes the count (Budget.plan) after timing the compiled step, which does
      # not depend on it (an argument of the step): until then it is a provisional count.
      cfg = dataclasses.replace(cfg, train=dataclasses.replace(t, steps=t.warmup_steps + 1))
    self.components = build_components(cfg, data, tx=tx, optimizer=optimizer, warn=self.log.console)
    self.recovery = Recovery(cfg.stability)
    self.monitor = StabilityMonitor(thresholds=HealthThresholds(
        high=cfg.logging.grad_norm_high, critical=cfg.logging.grad_norm_critical))
    self.run_dir.remove_previous()  # --fresh: every check of the new start passed
    distributed.barrier("run_dir")  # no process looks for checkpoints before --fresh is done
    checkpoint_dir = self.run_dir.path("checkpoints")
    self.run_dir.record_written()  # before Orbax creates the folder
    self.checkpoints = Checkpoints(checkpoint_dir, cfg.checkpoint.keep, cfg.checkpoint.async_save,
                                   record_step=self.run_dir.record_checkpoint)
    data.train_dataset = hang_in_pipeline(data.train_dataset, cfg.faults)
    self.batches = Batches(data.train_iter(), cfg.faults, data.vocab_size,
                           lambda *args, **kwargs: self.components.step_batch(*args, **kwargs))
    r = cfg.stability.recovery
    self.rejected = RejectedBatches(self.run_dir, r.reject_after if r.enabled else 0,
                                    {**data_order(cfg), "data": data_identity(cfg.data)})
    self.watchdog = Watchdog(cfg.stability.watchdog, cfg.train.log_every, self.run_dir.root,
                             self.log.record, lambda: self.signals.received is not None)
    self.restorer = Restorer(lambda: self.components, self.run_dir, self.checkpoints, self.batches,
                             self.recovery, self.monitor, self.log, recorded=self.recorded,
                             reset_optimizer=reset_optimizer)

  def _recorded_config(self) -> Optional[Config]:
    """The config of the run's previous start (its ``config.json``), or None: a new run, or one
    whose recorded config this version cannot read (then only a keyed checkpoint resumes, and a
    warning says that what changed since the last start cannot be listed)."""
    path = self.run_dir.root / "config.json"
    if "config.json" not in self.run_dir.recorded or not path.is_file():
      return None
    try:
      return load_run_file(path)
    except ConfigError as e:
      if self.is_main:  # (before the run's logger exists)
        import sys
        print(f"warning: the config of the run's last start cannot be read ({e}): what changed "
              "since then is not listed", file=sys.stderr, flush=True)
      return None

  @property
  def cfg(self) -> Config:
    return self.components.cfg

  @property
  def out_dir(self) -> Path:
    return self.run_dir.root

  # ------------------------------------------------------------------ start

  def train(self) -> int:
    """Trains to the end, a stop signal, or divergence; returns the exit code."""
    self.watchdog.start()
    try:
      try:
        step = self._start()
      except Interrupted as e:
        self.log.console(str(e))
        code = EXIT_INTERRUPTED
      else:
        code = self._train_from(step)
    except BaseException:
      self.close(quiet=True)  # the error that stopped the run is the one to report
      raise
    self.close()
    return code

  def close(self, quiet: bool = False) -> None:
    """Ends the run's hold on its directory: a save in flight completes, no Orbax thread outlives
    the run, the logs are closed and the lock released (:meth:`train` does it when it returns).
    Each part is closed even when another fails; the first failure is raised unless ``quiet``."""
    errors = []
    for close in (self.watchdog.stop, self.budget.stop_heartbeat, self.checkpoints.close,
                  self.log.close, self.run_dir.close):
      try:
        close()
      except Exception as e:  # noqa: BLE001 - every part gets its chance to close
        errors.append(e)
    if errors and not quiet:
      raise errors[0]

  def _start(self) -> int:
    """Restores or initialises the state, checks it is this run's (tokenizer, data), then writes:
    config.json, the records, the step count of the time budget, checkpoint 0. Returns the step
    to continue from. Raises Interrupted when a signal came in the meantime."""
    self.state, meta = self.restorer.restore_or_init()
    resuming = bool(meta)
    self.tokenizer = resume.check_resume(self.cfg, self.run_dir, meta, self.data_changed,
                                         self.log.console)
    notes = resume.changes(self.recorded, self.cfg, meta) if resuming else []
    self._record_start()
    notes += [line] if (line := self.rejected.load()) else []
    self.batches.blocked = self.rejected.blocked
    if resuming:
      self.state = self.restorer.rewarm(self.state, int(meta["step"]))
    self.signals.check_startup("restoring the checkpoint" if resuming else "initialising the model")
    self.budget.load_state_dict(meta, owns_clock=CLOCK_FILE in self.run_dir.recorded)
    self.budget.tick(force=True)  # a start killed from here on still counts in the budget
    self.budget.start_heartbeat()  # up to its last beat: the probe, the compilations
    self._apply_budget()
    step = int(meta.get("step", 0))
    components = self.components
    self.replicas = ReplicaCheck(components.mesh, components.state_sharding.params)
    checked = self.replicas.active and components.cfg.stability.replicas.check_every
    self.checkpointing = actions.Checkpointing(
        components, self.checkpoints, self.batches, self._meta, self.recovery, self.log,
        verify=lambda step, state: self.replicas.verify(step, state.params) if checked else None)
    if step == 0 and not self.checkpoints.all_steps():
      self.checkpointing.save(0, self.state)  # the initial state is a rollback target
      self.signals.check_startup("saving step 0")
    self._banner(step)
    for line in notes:
      self.log.console(line)
      self.log.record({"step": step, "event": "resumed", "cause": line})
    self.val_batches = self.components.val_batches()
    if self.budget.active and self.val_batches:
      # Compile the eval (and sample) now, at start-up: the budget's margin for the final eval
      # holds their compiled times, and a resumed segment has not compiled them yet.
      jax.block_until_ready(self.components.eval_step(self.state.params, self.val_batches[0],
                                             np.int32(step)))
      if self.components.sampler is not None:
        self.components.sampler(self.state.params, step)
      self.signals.check_startup("compiling the evaluation")
    return step

  def _record_start(self) -> None:
    """The checks passed: the run's records, then its log files."""
    if self.is_main:
      resume.record_start(self.run_dir, self.cfg, self.tokenizer,
                          ("tokenizer", CLOCK_FILE, PROBE_DIR, "config.json", "metrics.jsonl",
                           "tensorboard", "hang_stacks"))
    self.log.open()
    self.run_dir.record_written()

  def _apply_budget(self) -> None:
    """train.time_budget_minutes: fix the step count and lay the schedule over it (budget.py)."""
    steps = self.budget.plan(self.components, self.state, self.run_dir.root,
                             self.signals.check_startup)
    if steps is None:
      return
    if self.custom_tx is not None:
      self.log.console("warning: train.time_budget_minutes with Trainer(tx=...): the step count is "
                       "fixed, but the schedules inside that tx are the caller's")
    if steps != self.components.total_steps:
      # the restorer reads self.components
      self.components = with_steps(self.components, steps, self.custom_tx)
    self.log.console(self.budget.describe())

  # ------------------------------------------------------------------ the step loop

  def _train_from(self, step: int) -> int:
    components, total = self.components, self.components.total_steps
    show_progress = self.is_main and components.cfg.logging.progress
    bar = tqdm(total=total, initial=step, disable=not show_progress,
               dynamic_ncols=True, desc="train")
    self._actions(bar)
    self.time_budget.start(step)  # the steps since this one are timed at the next check
    try:
      step, exit_code = self._loop(step, bar)
    except ReplicasDiffer as e:  # raised before anything was saved: the last checkpoint is good
      self.log.console(f"error: {e} (exit code {EXIT_REPLICAS_DIFFER})")
      self.log.record({"step": e.step, "event": "replicas_differ", "cause": str(e)})
      step, exit_code = e.step, EXIT_REPLICAS_DIFFER
    bar.close()
    if exit_code == EXIT_OK:
      self.evaluation(step, self.state, final=True)
    return self._finish(step, exit_code)

  def _loop(self, step: int, bar: Any) -> tuple[int, int]:
    """The steps from ``step``; returns the step reached and the exit code."""
    components, total = self.components, self.components.total_steps
    logging, checkpointing, budget = self.logging, self.checkpointing, self.time_budget
    faults = components.cfg.faults
    limit, exit_code = total, EXIT_OK
    if step < total and budget.out_of_time():  # earlier segments used up the budget
      budget.stop(step, total, None if step in self.checkpoints.all_steps() else
                  self._save_if_healthy)
      limit = step
    while step < limit:
      self.watchdog.beat(step)
      if self.signals.requested():
        return step, self._interrupted(step)
      kill_if_due(faults, step, "step")
      hang_if_due(faults, step)
      batch = self.batches.next(step)
      self.state = state_faults(self.state, faults, step, self.batches.first_execution)
      self.healing.note_dropped()
      if self.determinism.due(step):
        self.determinism(step, self.state, batch)
      if step == 0:  # the logits before the first update: the base of the monitor's growth
        logging.baseline(self.state, batch["tokens"])
      self.state, metrics = components.train_step(self.state, batch)
      step += 1
      logging.stepped(step - 1, self.batches.positions[step - 1], metrics)
      bar.update(1)
      cause = logging.write_held()  # step - 1's metrics, read after this step was dispatched
      save_now = checkpointing.due(step)
      if logging.due(step) or save_now:
        logging.hold(step, metrics, self.state, batch["tokens"])
      if save_now and cause is None:
        cause = logging.write_held()  # a checkpoint needs this step's health now
      if cause is None:
        cause = self._periodic(step, save_now)
      if logging.due(step):
        self.budget.tick()
        if logging.intervals > 1:  # the first interval of a start holds the compilation
          self.watchdog.measured(logging.seconds_per_step)
        if cause is None and step < total and budget.out_of_time(step):
          budget.stop(step, total, None if save_now else self._save_if_healthy)
          break
      if cause is not None:  # replay, then go on, roll back or stop (healing.py)
        healed = self.healing.answer(self.state, step, cause, logging.last_record,
                                     save=checkpointing.save)
        if healed.exit_code is not None:
          return healed.step, healed.exit_code
        assert healed.state is not None, "a run that goes on has a state"
        self.state, step = healed.state, healed.step
        bar.reset(total=total)
        bar.update(step)
        logging.pending, logging.skip_flags = None, []
        checkpointing.deferred = healed.replayed_checkpoint_due
    return step, exit_code

  def _periodic(self, step: int, save_now: bool) -> Optional[str]:
    """The evaluation, samples, diagnostics, replica check and checkpoint due at ``step``;
    returns the evaluation's rollback cause, if any."""
    if self.evaluation.due(step):
      cause = self.evaluation(step, self.state)
      if cause is not None:
        return cause
    for action in (self.sampling, self.diagnostics):
      if action.due(step):
        action(step, self.state)
    every = self.components.cfg.stability.replicas.check_every
    if every and step % every == 0 and not save_now:  # a save checks them itself
      self.replicas.verify(step, self.state.params)
    if save_now:
      self.checkpointing(step, self.state)
    return None

  def _actions(self, bar: Any) -> None:
    """The periodic actions over the final components (after the time budget's plan), and the
    healing that answers a failure."""
    components, agree = self.components, self.signals.agree
    self.determinism = actions.DeterminismCheck(components, self.batches, self.log)
    self.logging = actions.Logging(components, self.log, self.monitor, self.recovery, agree, bar,
                                   lambda: self.restorer.abandoned_skips,
                                   reject=lambda batches, why: self.healing.reject(batches, why),
                                   extras=(self.determinism.record,))
    self.sampling = actions.Sampling(components, self.log)
    self.evaluation = actions.Evaluation(components, self.val_batches, self.log, self.recovery,
                                         self.budget, agree, self.sampling)
    first_val_batch = self.val_batches[0] if self.val_batches else None
    self.diagnostics = actions.Diagnostics(components, first_val_batch,
                                           self.log)
    self.time_budget = actions.TimeBudget(self.budget, self.log, distributed.agree_any)
    replayer = Replayer(lambda: self.components, self.restorer, self.batches, self.recovery,
                        beat=self.watchdog.beat)
    self.healing = Healing(self.restorer, replayer, self.recovery, self.rejected, self.batches,
                           self.log, self.logging.publish, self.checkpointing.due)

  def _meta(self) -> dict:
    return {**self.restorer.meta(), **self.budget.state_dict(), "tokenizer": self.tokenizer}

  def _save_if_healthy(self, step: int) -> None:
    if self.recovery.healthy():
      self.checkpointing.save(step, self.state)

  # ------------------------------------------------------------------ endings

  def _interrupted(self, step: int) -> int:
    if self.recovery.healthy() and step not in self.checkpoints.all_steps():
      self.checkpointing.save(step, self.state)
    self.log.console(f"{self.signals.name} at step {step}: checkpoint saved; run the same command"
                     " to resume")
    return EXIT_INTERRUPTED

  def _banner(self, step: int) -> None:
    if self.is_main:
      for line in run_summary.banner(self.components, self.state.params, self.budget,
                                     self.run_dir.root,
                                     step):
        self.log.console(line)

  def _finish(self, step: int, exit_code: int) -> int:
    self.checkpoints.close()
    self.budget.tick(force=True)
    summary = run_summary.summary(
        self.components, step=step, exit_code=exit_code, wall=time.time() - self.t_start,
        logging=self.logging, evaluation=self.evaluation, diagnostics=self.diagnostics,
        recovery=self.recovery, monitor=self.monitor, budget=self.budget,
        abandoned_skips=self.restorer.abandoned_skips)
    if self.is_main:
      path = self.run_dir.path("summary.json")
      self.run_dir.record_written()
      write_json_atomic(path, summary, indent=2)
      if exit_code == EXIT_OK:
        for line in run_summary.done(summary, self.run_dir.root, self.monitor):
          self.log.console(line)
    return exit_code

