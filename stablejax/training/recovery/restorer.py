"""Restoring a run: at start (the newest good checkpoint, or step 0) and at a rollback.

A rollback is written to ``recovery.json`` in the run directory the moment it is decided (after
the restore succeeded, before anything on disk changes); a run killed before its next checkpoint
re-applies it on resume, so the skipped data, the LR backoff and the rollback count survive.
The policy (when to roll back, to which checkpoint, the learning-rate backoff) is
:class:`stablejax.training.recovery.policy.Recovery`; this module carries it out.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from stablejax.monitor.stability_monitor import StabilityMonitor
from stablejax.training.launch import mesh as mesh_lib
from stablejax.training.recovery import restore_plan
from stablejax.training.loop.batches import Batches, fetch, kill_if_due, total_skips
from stablejax.training.checkpoint import CheckpointError, Checkpoints, read_json, write_json_atomic
from stablejax.training.loop.components import Components
from stablejax.training.config import Config, changed_keys
from stablejax.training.run_folder.logger import RunLogger
from stablejax.training.recovery.policy import Recovery, RollbackEvent
from stablejax.training.run_folder.folder import RunDirectory
from stablejax.training.loop.step import TrainState
from stablejax.transforms import defence
from stablejax.transforms.keyed import to_positional
from stablejax.transforms.metrics import stability_metrics

RECOVERY_FILE = "recovery.json"  # the latest rollback decision, written atomically when it is made
# The defences' metrics of a restored state in one program (eagerly, each operation of each
# metric is a program of its own to compile or load at every start).
_state_metrics = jax.jit(stability_metrics)


class Restorer:
  """Restores the run's state from its checkpoints (``restore_or_init``, ``rollback``), matching
  the optimizer state by name (:mod:`stablejax.training.recovery.restore_plan`).

  Args:
    current_components: ``() -> Components``: the run's current components (the time budget
      replaces them once it has fixed the step count).
    recorded: the config the run's checkpoints were written with (the run directory's
      ``config.json``), or None for a new run: a checkpoint of a version before the optimizer
      state was keyed is read in its layout.
    reset_optimizer: a checkpoint whose optimizer state is another optimizer's may be restored
      with the configured optimizer's state started afresh (``--reset-optimizer``). Allowed
      without it too when the run's recorded config already has this optimizer: an earlier
      start switched with the flag, and this restore meets a checkpoint from before the switch
      (a rollback, a fall-back past a damaged checkpoint).
  """

  def __init__(self, current_components: Callable[[], Components], run_dir: RunDirectory,
               checkpoints: Checkpoints, batches: Batches, recovery: Recovery,
               monitor: StabilityMonitor, log: RunLogger, *, recorded: Optional[Config] = None,
               reset_optimizer: bool = False):
    self.current_components, self.run_dir = current_components, run_dir
    self.checkpoints = checkpoints
    self.batches, self.recovery, self.monitor, self.log = batches, recovery, monitor, log
    self.recorded, self.reset_optimizer = recorded, reset_optimizer
    self.abandoned_skips = 0  # skips counted on rolled-back branches

  @property
  def components(self) -> Components:
    """The trainer's components now (the time budget may rebuild them after the restorer)."""
    return self.current_components()

  @property
  def recovery_file(self) -> Path:
    return self.run_dir.root / RECOVERY_FILE

  def state_metrics(self, state: TrainState) -> dict:
    return fetch(_state_metrics(state.opt_state))

  @property
  def switched(self) -> bool:
    """Whether the run's recorded config has this start's optimizer settings: a checkpoint of
    another optimizer is then from before a switch an earlier start made (with the flag)."""
    recorded = self.recorded.optimizer if self.recorded is not None else None
    return recorded == self.components.cfg.optimizer

  def restore(self, at_most: Optional[int] = None) -> Optional[tuple[TrainState, dict]]:
    return self.checkpoints.restore(self.components.abstract_state, self.batches.stream,
                                    at_most=at_most,
                                    on_fallback=self._fallback, match=self)

  # ------------------------------------------------------------------ matching by name

  def plan(self, stored: Any) -> restore_plan.RestorePlan:
    return restore_plan.plan(stored, self.components.abstract_state,
                             reset_optimizer=self.reset_optimizer, switched=self.switched,
                             legacy=self._legacy_layout, explain=self._model_changes)

  def finish(self, plan: restore_plan.RestorePlan, restored: Any) -> Any:
    components = self.components
    state = plan.finish(restored, components.init_optimizer,
                        lambda: components.init_state(
                            jax.random.PRNGKey(components.cfg.train.seed)))
    return jax.device_put(state, components.state_sharding) if not plan.complete else state

  def _model_changes(self) -> str:
    """The model settings changed since the run's last start, or the fix without them."""
    if self.recorded is None:
      return "resume with the model settings the run was started with, or pass --fresh"
    changed = [line for line in changed_keys(self.recorded, self.components.cfg)
               if line.startswith("model.")]
    if not changed:
      return "resume with the model settings the run was started with, or pass --fresh"
    return ("changed since the last start: " + "; ".join(changed) + ": a resume may only add "
            "parameters; set the model back, or pass --fresh to start over")

  def _legacy_layout(self) -> Optional[restore_plan.LegacyLayout]:
    """The positional optimizer state the recorded config built before states were keyed."""
    if self.recorded is None or self.components.optimizer is not None:
      return None
    from stablejax.training.optim import build_optimizer
    recorded, components = self.recorded, self.components
    tx = build_optimizer(recorded)
    keyed = jax.eval_shape(tx.init, components.abstract_state.params)
    ctx = defence.DefenceContext(stability=recorded.stability, model=components.model)
    built = defence.built(recorded.stability, ctx)
    positions = [d.name for d, _ in built if d.position is not defence.Position.WRAPPER]
    wrappers = tuple(d.name for d, _ in built if d.position is defence.Position.WRAPPER)
    by_position = {d.name: d.position for d, _ in built}
    chain = ([n for n in positions if by_position[n] is defence.Position.GRADIENT]
             + [defence.OPTIMIZER_KEY]
             + [n for n in positions if by_position[n] is defence.Position.UPDATE]
             + [defence.LR_SCALE_KEY]
             + [n for n in positions if by_position[n] is defence.Position.FINAL])
    positional = to_positional(keyed, chain, wrappers)
    shardings = mesh_lib.state_shardings(components.mesh, positional)
    positional = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                              positional, shardings)
    return restore_plan.LegacyLayout(positional, tuple(chain), wrappers, recorded.optimizer.name)

  def _fallback(self, step: int, reason: str) -> None:
    if self.run_dir.is_main:  # the damaged step goes there: recorded before it is created
      self.run_dir.path("damaged_checkpoints")
      self.run_dir.record_written()
    self.log.console(f"warning: checkpoint {step} is damaged ({reason}); trying the previous one"
                     f" (the damaged one goes to {self.checkpoints.damaged_directory})")
    self.log.record({"step": step, "event": "fallback_checkpoint", "cause": reason})

  def restore_or_init(self) -> tuple[TrainState, dict]:
    """The newest undamaged checkpoint, with a rollback decided after it re-applied; or step 0.
    Loads the batches' position, the recovery's and the monitor's state with it."""
    state, meta = self._restore_checkpoint_or_init()
    self.recovery.acknowledge(self.state_metrics(state))  # requests the saved state already had
    self.batches.load(meta)
    self.abandoned_skips = int(meta.get("abandoned_skips", 0))
    self.recovery.load_state_dict(meta.get("recovery", {}))
    if meta.get("monitor"):
      self.monitor.load_state_dict(meta["monitor"])
    return state, meta

  def _restore_checkpoint_or_init(self) -> tuple[TrainState, dict]:
    restored = self.restore()
    if restored is None:
      stale = self.recovery_file
      if self.run_dir.is_main and stale.exists():  # its checkpoints are gone: another run's
        target = self.run_dir.path(RECOVERY_FILE + ".stale")
        self.run_dir.record_written()  # recorded before it is there
        stale.replace(target)
        self.log.console(f"warning: no checkpoint in {self.checkpoints.directory}: starting at step"
                         f" 0 and keeping the old rollback record as {RECOVERY_FILE}.stale")
      return self.components.init_state(jax.random.PRNGKey(self.components.cfg.train.seed)), {}
    state, meta = restored
    decision = read_json(self.recovery_file)
    saved_events = len(meta.get("recovery", {}).get("events", []))
    if decision is None or len(decision["recovery"]["events"]) <= saved_events:
      return state, meta
    # The run stopped after a rollback and before its next checkpoint: redo that rollback.
    event = RollbackEvent(**{**decision["recovery"]["events"][-1]})
    if int(meta["step"]) > event.restored_step:  # a checkpoint of the abandoned branch
      restored = self.restore(at_most=event.restored_step)
      if restored is None:
        raise CheckpointError(f"{self.recovery_file} records a rollback to step "
                              f"{event.restored_step}, but no checkpoint that old is left: pass "
                              "--fresh to start over")
      state, meta = restored
    self.checkpoints.delete_after(int(meta["step"]))
    self.batches.load(meta)
    self.batches.schedule_skip(*event.skipped_batches)
    self.log.console(f"re-applying rollback {len(decision['recovery']['events'])} "
                     f"({event.describe()}) recorded in {RECOVERY_FILE}")
    state = self.components.set_lr_backoff(state, jnp.float32(event.lr_scale),
                                           jnp.int32(meta["step"]), jnp.int32(-1))
    meta = {**meta, "batches_consumed": self.batches.consumed,
            "pending_skips": [list(r) for r in self.batches.pending],
            "abandoned_skips": decision["abandoned_skips"], "recovery": decision["recovery"],
            "monitor": decision["monitor"]}
    return state, meta

  def rollback(self, step: int, cause: str, record: dict, *, failed_at: Optional[int] = None,
               skip_from: Optional[int] = None, reproduced: Optional[bool] = None
               ) -> tuple[TrainState, int]:
    """Restores a good checkpoint with a lower LR and skips the data that led here; returns the
    restored state and its step.

    ``failed_at``: the data position the failure was seen at (default: the stream's now);
    ``skip_from``: where the skip starts (default: the target checkpoint's position; a replay
    that restored past a damaged target passes that target's); ``reproduced``: a replay
    reproduced the failure (recorded in the event). The decision is written to recovery.json as
    soon as the restore succeeded and before the abandoned branch's checkpoints are deleted: a
    crash from here on cannot undo it.
    """
    failed_at = self.batches.consumed if failed_at is None else failed_at
    self.checkpoints.wait()
    target = self.recovery.rollback_target(self.checkpoints.all_steps())
    restored = self.restore(at_most=target) if target is not None else None
    if restored is None:
      raise CheckpointError(f"no checkpoint left in {self.checkpoints.directory} to roll back to:"
                            " pass --fresh to start over")
    state, meta = restored
    restored_step = int(meta["step"])
    restored_metrics = self.state_metrics(state)
    self.abandoned_skips += max(0, total_skips(record) - total_skips(restored_metrics))
    # The data to skip is what was read since the target checkpoint. When the target was damaged
    # and an older one restored, the batches between the two were good: they are replayed, and
    # the skip waits until the stream reaches the target's position.
    target_position = skip_from
    if target_position is None and target is not None:
      target_position = self.batches.checkpoint_positions.get(target)
    self.batches.load(meta)
    first_skipped = self.batches.consumed if target_position is None else target_position
    self.batches.schedule_skip(first_skipped, failed_at)
    # The LR that failed, backed off; it returns to 1.0 over stability.recovery.lr_recovery_steps.
    r = self.components.cfg.stability.recovery
    lr_scale = float(record.get("lr_scale", 1.0)) * r.emergency_lr_factor
    state = self.components.set_lr_backoff(state, jnp.float32(lr_scale), jnp.int32(restored_step),
                                           jnp.int32(-1))
    event = RollbackEvent(step=step, cause=cause, restored_step=restored_step, lr_scale=lr_scale,
                          skipped_batches=(first_skipped, failed_at), reproduced=reproduced)
    self.recovery.record(event, restored_metrics)
    self.monitor.record_rollback(step, cause)
    if self.run_dir.is_main:
      path = self.run_dir.path(RECOVERY_FILE)
      self.run_dir.record_written()
      write_json_atomic(path, {"recovery": self.recovery.state_dict(),
                               "abandoned_skips": self.abandoned_skips,
                               "monitor": self.monitor.state_dict()})
    self.log.console(f"warning: rollback {self.recovery.rollbacks}/{r.max_rollbacks} at "
                     f"{event.describe()}")
    self.log.record({"step": step, "event": "rollback", **dataclasses.asdict(event)},
                    {"recovery/rollbacks": self.recovery.rollbacks, "recovery/lr_scale": lr_scale})
    self.log.text("recovery/events", event.describe(), step)
    kill_if_due(self.components.cfg.faults, self.recovery.rollbacks, "rollback")
    self.checkpoints.delete_after(restored_step)  # the abandoned branch
    return state, restored_step

  def branch_start(self, state: TrainState, step: int) -> TrainState:
    """``state``, restored from checkpoint ``step``, as the run's current branch started from
    it: the latest rollback's backoff and data skip when it restored that checkpoint, else the
    re-warmup a start applied there (a replay repeats the branch exactly)."""
    if self.recovery.events and self.recovery.events[-1].restored_step == step:
      event = self.recovery.events[-1]
      self.batches.schedule_skip(*event.skipped_batches)
      return self.components.set_lr_backoff(state, jnp.float32(event.lr_scale), jnp.int32(step),
                                            jnp.int32(-1))
    applied = self.run_dir.rewarmup
    if applied is not None and applied["step"] == step:
      return self.components.set_lr_backoff(state, jnp.float32(0.0), jnp.int32(step),
                                            jnp.int32(applied["steps"]))
    return state

  def rewarm(self, state: TrainState, step: int) -> TrainState:
    """``train.rewarmup_steps=N`` at a resume: the learning rate ramps from 0 back to the
    schedule over N steps from ``step`` (the restored step). Applied when the setting changed
    since the run's last start, and again when the restored checkpoint is the one the ramp was
    applied to (a start killed before the next checkpoint); the same command again does not
    ramp again. Recorded in run.json and, with the state, in every later checkpoint."""
    steps = self.components.cfg.train.rewarmup_steps
    before = self.recorded.train.rewarmup_steps if self.recorded is not None else 0
    applied = self.run_dir.rewarmup
    again = applied is not None and applied == {"step": step, "steps": steps}
    if not steps or (steps == before and not again):
      return state
    if self.run_dir.is_main:
      self.run_dir.set_rewarmup({"step": step, "steps": steps})
    line = (f"re-warming the learning rate from 0 back to the schedule over {steps} steps from "
            f"step {step} (train.rewarmup_steps)")
    self.log.console(line)
    self.log.record({"step": step, "event": "rewarmup", "steps": steps, "cause": line})
    return self.components.set_lr_backoff(state, jnp.float32(0.0), jnp.int32(step),
                                          jnp.int32(steps))

  def meta(self) -> dict:
    """What a checkpoint stores of the recovery and the monitor."""
    return {"abandoned_skips": self.abandoned_skips, "recovery": self.recovery.state_dict(),
            "monitor": self.monitor.state_dict()}

  def diverged(self, step: int, cause: str) -> list[str]:
    """The lines that end a run that diverged beyond its recovery budget."""
    self.log.record({"step": step, "event": "diverged", "cause": cause})
    lines = [f"error: training diverged at step {step}: {cause}",
             f"recovery budget used: {self.recovery.rollbacks} of "
             f"{self.components.cfg.stability.recovery.max_rollbacks} rollbacks"]
    lines += [f"  rollback {i + 1}: {e.describe()}" for i, e in enumerate(self.recovery.events)]
    lines.append("try: a lower optimizer.learning_rate, a longer train.warmup_steps, or check the "
                 f"data (see {self.run_dir.root / 'metrics.jsonl'})")
    return lines
