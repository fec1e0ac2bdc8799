"""What the step loop does when the recovery finds a reason to roll back: diagnose, then heal.

The order (docs/recovery.md has the whole state machine):

1. ``stability.recovery.replay`` (on by default): replay the failing window
   (:mod:`stablejax.training.recovery.replay`).
2. Not reproduced: a transient fault. Training goes on from the replayed state, the event names
   the device; after ``max_transients`` on one device within ``transient_window`` steps the run
   saves and exits with code 16 (:data:`EXIT_TRANSIENT`), for the scheduler to move it.
3. Reproduced (or no replay): roll back as before (:mod:`stablejax.training.recovery.restorer`)
   while the recovery budget lasts, else stop with code 3; the window's batches are recorded as
   rejected (:mod:`stablejax.training.recovery.rejected`).

Every decision comes from fetched, replicated records, so every process takes the same one.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from stablejax.training.loop.actions import skip_cause
from stablejax.training.loop.batches import Batches
from stablejax.training.run_folder.logger import RunLogger
from stablejax.training.recovery.policy import Recovery, TransientEvent
from stablejax.training.recovery.rejected import RejectedBatches
from stablejax.training.recovery.replay import Replay, Replayer, free
from stablejax.training.recovery.restorer import Restorer
from stablejax.training.loop.step import TrainState

EXIT_DIVERGED, EXIT_TRANSIENT = 3, 16


@dataclasses.dataclass
class Healed:
  """What the loop goes on with: the state and step, or the exit code that ends the run (with the
  state to save first, for a run stopped for its transient faults)."""
  state: Optional[TrainState]
  step: int
  exit_code: Optional[int] = None
  stop: Optional[str] = None  # why the run stops (the transients' line)
  replayed_checkpoint_due: bool = False  # a checkpoint step was replayed: save at the next log


class Healing:
  """Diagnoses a failure (replay) and heals it (go on, roll back, or stop).

  Args:
    restorer: the run's restorer (rollbacks).
    replayer: the run's replayer.
    recovery: the rollback rules and budget.
    rejected: the record of rejected batches.
    batches: the data stream (its blocked positions follow the record).
    log: the run's logger.
    publish: writes a replayed record (monitor, metrics.jsonl, TensorBoard) without checking it
      again.
    checkpoint_due: ``step -> bool``: whether a checkpoint is due at ``step``.
  """

  def __init__(self, restorer: Restorer, replayer: Replayer, recovery: Recovery,
               rejected: RejectedBatches, batches: Batches, log: RunLogger,
               publish: Callable[[dict], None], checkpoint_due: Callable[[int], bool]):
    self.restorer, self.replayer, self.recovery = restorer, replayer, recovery
    self.rejected, self.batches, self.log = rejected, batches, log
    self.publish, self.checkpoint_due = publish, checkpoint_due
    self.replays: list[dict] = []  # the replay events of this start (the summary counts them)

  def reject(self, batches: list[tuple[int, int]], cause: str, counts: bool = True) -> None:
    """Records rejected batches ``[(position, step index)]``; a position rejected often enough
    is never trained on again from now on (said once)."""
    blocked = self.rejected.reject(batches, cause, counts)
    self.batches.blocked = self.rejected.blocked
    if blocked:
      plural = "es" if len(blocked) > 1 else ""
      line = (f"batch{plural} at position {', '.join(map(str, blocked))} rejected "
              f"{self.rejected.threshold} times: never trained on again")
      self.log.console(f"warning: {line}")
      self.log.record({"step": max(s for _, s in batches) + 1, "event": "batch_blocked",
                       "positions": blocked, "cause": line},
                      {"recovery/blocked_batches": len(self.rejected.blocked)})

  def answer(self, state: TrainState, step: int, cause: str, record: dict,
             save: Callable[[int, TrainState], None]) -> Healed:
    """What the loop goes on with after ``cause`` at ``step``: stop with code 3 when the recovery
    is off or its budget is spent (after a replay that did not clear the failure), go on after a
    transient fault, or roll back. A run stopped for its transient faults saves first (``save``).
    """
    if not self.recovery.cfg.enabled:
      return self._diverged(step, cause)
    healed = self.heal(state, step, cause, record, rollback_allowed=self.recovery.budget_left)
    if healed.exit_code == EXIT_DIVERGED:
      return self._diverged(step, cause)
    if healed.exit_code == EXIT_TRANSIENT and healed.state is not None:
      if step not in self.restorer.checkpoints.all_steps():
        save(step, healed.state)
      line = (f"{healed.stop}: checkpoint saved at step {step}; run the same command on other "
              f"hardware to resume (exit code {EXIT_TRANSIENT})")
      self.log.console(f"error: {line}")
      self.log.record({"step": step, "event": "transient_exit", "cause": line})
    return healed

  def note_dropped(self) -> None:
    """Logs the batches the stream dropped because they were rejected too often."""
    for position, index in self.batches.dropped:
      self.log.record({"step": index + 1, "event": "rejected_batch_dropped",
                       "position": position})
    self.batches.dropped = []

  def _diverged(self, step: int, cause: str) -> Healed:
    for line in self.restorer.diverged(step, cause):
      self.log.console(line)
    return Healed(state=None, step=step, exit_code=EXIT_DIVERGED)

  def heal(self, state: TrainState, step: int, cause: str, record: dict,
           rollback_allowed: bool) -> Healed:
    """The answer to ``cause`` seen at ``step`` (in ``record``): the state to go on with, or an
    exit. ``state`` (the failing one) is freed before any checkpoint is read."""
    replay: Optional[Replay] = None
    if self.recovery.cfg.replay:
      replay = self.replayer.replay(state, step, cause, record)
      self._report(replay)
      if replay.skipped:
        self.reject([(position, index) for index, position, _ in replay.skipped],
                    skip_cause(replay.skipped) + " (replay)")
      if replay.transient:
        return self._transient(replay)
    else:
      self.restorer.checkpoints.wait()  # a save in flight may still read it
      free(state)
    if not rollback_allowed:
      return Healed(state=None, step=step, exit_code=EXIT_DIVERGED)
    failed_at = replay.failed_at if replay is not None else None
    skip_from = replay.skip_from if replay is not None else None
    new_state, restored_step = self.restorer.rollback(
        step, cause, record, failed_at=failed_at, skip_from=skip_from,
        reproduced=None if replay is None else True)
    event = self.recovery.events[-1]
    first, last = event.skipped_batches
    steps = {position: index for index, position in self.batches.positions.items()}
    self.reject([(p, steps.get(p, -1)) for p in range(first, last)],
                f"rollback at step {step}: {cause}" + (" (reproduced)" if replay else ""),
                counts=False)
    return Healed(state=new_state, step=restored_step)

  def _transient(self, replay: Replay) -> Healed:
    """Goes on from the replayed state; withdraws the window's rejections the replay cleared."""
    for record in replay.records:
      self.publish(record)
    replayed = {p for i, p in self.batches.positions.items()
                if replay.restored_step <= i < replay.step}
    skipped_again = {position for _, position, _ in replay.skipped}
    self.rejected.withdraw(lambda position, event: not (position in replayed
                                                        and position not in skipped_again))
    self.batches.blocked = self.rejected.blocked
    event = TransientEvent(step=replay.step, cause=replay.cause,
                           restored_step=replay.restored_step, device=replay.device)
    stop = self.recovery.record_transient(event)
    due = any(self.checkpoint_due(s) for s in range(replay.restored_step + 1, replay.step + 1))
    return Healed(state=replay.state, step=replay.step,
                  exit_code=EXIT_TRANSIENT if stop else None, stop=stop,
                  replayed_checkpoint_due=due)

  def _report(self, replay: Replay) -> None:
    line = replay.describe()
    self.log.console(f"warning: {line}")
    event = replay.event()
    self.replays.append(event)
    transients = sum(r["verdict"] == "transient" for r in self.replays)
    self.log.record(event, {"recovery/replays": len(self.replays),
                            "recovery/transients": transients,
                            "recovery/replay_seconds": replay.seconds,
                            f"events/replay/{replay.verdict}": 1.0})
    self.log.text("recovery/events", line, replay.step)
