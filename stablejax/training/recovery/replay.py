"""Replaying a failing window before the recovery acts on it: transient or reproduced.

When the recovery is about to roll back (:mod:`stablejax.training.recovery.policy`), the trainer
first asks why the run failed. It restores the checkpoint this branch of the run started from (the
newest, with the rollback or re-warmup that started the branch there applied again), runs the
same steps again on the same batches (the data stream is restored with the state) with the same
learning rate (no new backoff), reads the records at the same steps as the first run did and
hands them to the same rollback rules:

- **reproduced**: the replay fails too, so the batches or the optimisation are at fault; the
  rollback goes ahead as without the replay (LR backoff, the window's batches skipped), and the
  window's batches are recorded as rejected (:mod:`stablejax.training.recovery.rejected`);
- **transient**: the replay trains through the window without a trigger: the first run met a
  fault of the hardware (a flaky device, silent data corruption). Training goes on from the
  replayed state, which is the state a run without the fault has at that step: no backoff, no
  skipped data, and the first run's rejections in the window are withdrawn.

Like Megatron-LM's rerun state machine, a failure is only blamed on the data once it came back.
The replay is deterministic where the step is (XLA on CPU, TPU; GPU kernels without atomics): it
reads the checkpoint's bits and the same batches and calls the same compiled step. The failing
state is freed before the checkpoint is read, so the replay never holds two train states. Which
device failed is read from the train state's ``device_faults`` (per device, the steps whose loss
on that device's rows was non-finite): a device whose count rose in the first run and not in the
replay is named; a fault that never reached a loss (a gradient-only fault) names the process.
"""

from __future__ import annotations

import dataclasses
import math
import socket
import time
from typing import Any, Callable, Optional

import jax
import numpy as np

from stablejax.training.launch import distributed
from stablejax.training.loop.batches import Batches, fetch
from stablejax.training.checkpoint import CheckpointError
from stablejax.training.loop.components import Components
from stablejax.training.recovery.policy import Recovery
from stablejax.training.recovery.restorer import Restorer
from stablejax.training.loop.step import TrainState, metrics_read


@dataclasses.dataclass
class Replay:
  """What a replay of a failing window found (:meth:`Replayer.replay`)."""

  transient: bool
  cause: str                     # the first run's rollback cause
  step: int                      # the step at which it was seen
  restored_step: int
  steps: int                     # steps replayed
  seconds: float
  first: dict                    # the first run's failing record: step, loss, grad_norm
  again: dict                    # the replay's record at that step ({} when it stopped earlier)
  again_cause: Optional[str]     # the rollback cause the replay met (reproduced)
  device: str                    # the suspect (transient): a device, or what is known
  failed_at: int                 # the data position the first run had reached
  skip_from: Optional[int]       # the position a rollback skips from (its target checkpoint's)
  records: list[dict] = dataclasses.field(default_factory=list)  # the replay's records
  skipped: list[tuple[int, int, list[str]]] = dataclasses.field(default_factory=list)
  state: Optional[TrainState] = None  # the replayed state (transient)

  @property
  def verdict(self) -> str:
    return "transient" if self.transient else "reproduced"

  def describe(self) -> str:
    """One line: what was replayed, what came out, and why that is the verdict."""
    def values(record: dict) -> str:
      return ", ".join(f"{key} {_number(record.get(key))}" for key in ("loss", "grad_norm"))
    head = (f"step {self.step}: {self.cause}; replayed steps {self.restored_step}..{self.step} "
            f"from checkpoint {self.restored_step} ({self.steps} steps, {self.seconds:.1f} s): ")
    at = self.first.get("step")
    if self.transient:
      return (head + f"not reproduced (step {at}: {values(self.first)} in the first run, "
              f"{values(self.again)} in the replay): transient, a fault of {self.device}; "
              "training goes on from the replayed state (no learning-rate backoff, no data "
              "skipped)")
    return head + f"reproduced ({self.again_cause}): the data or the optimisation; rolling back"

  def event(self) -> dict:
    """The metrics.jsonl event."""
    return {"step": self.step, "event": "replay", "verdict": self.verdict, "cause": self.cause,
            "restored_step": self.restored_step, "replayed_steps": self.steps,
            "replay_seconds": round(self.seconds, 3), "first": self.first, "again": self.again,
            "again_cause": self.again_cause, "device": self.device if self.transient else None}


def _number(value: Any) -> str:
  if value is None:
    return "-"
  return f"{value:.4g}" if isinstance(value, float) and math.isfinite(value) else str(value)


class Replayer:
  """Replays the window of a failure from the checkpoint a rollback would restore.

  Args:
    components: ``() -> Components``: the run's current components.
    restorer: restores checkpoints (by name) for the run.
    batches: the run's data stream (positioned with each restore).
    recovery: the rollback rules the replay's records go through.
    beat: called at each replayed step (the watchdog's progress).
  """

  def __init__(self, components: Callable[[], Components], restorer: Restorer, batches: Batches,
               recovery: Recovery, beat: Callable[..., None] = lambda *step: None):
    self.current_components, self.restorer, self.batches = components, restorer, batches
    self.recovery, self.beat = recovery, beat

  def replay(self, failing: TrainState, step: int, cause: str, record: dict) -> Replay:
    """Replays the steps from the rollback's checkpoint to ``step`` (the step count when the
    trigger ``cause`` was seen in ``record``). ``failing`` is freed first. Raises
    CheckpointError when no checkpoint is left to replay from."""
    t0 = time.time()
    components = self.current_components()
    failed_at = self.batches.consumed
    first_faults = _local_counts(failing.device_faults)
    self.restorer.checkpoints.wait()  # a save in flight may still read the failing state
    free(failing)
    checkpoints = self.restorer.checkpoints
    steps = checkpoints.all_steps()
    target = self.recovery.rollback_target(steps)  # where a rollback would go: its skip starts
    skip_from = self.batches.checkpoint_positions.get(target) if target is not None else None
    # The replay starts where this branch of the run started: the newest checkpoint, with the
    # rollback or re-warmup that started the branch there applied again.
    restored = self.restorer.restore(at_most=max(steps)) if steps else None
    if restored is None:
      raise CheckpointError(f"no checkpoint left in {checkpoints.directory} to roll back to:"
                            " pass --fresh to start over")
    state, meta = restored
    restored_step = int(meta["step"])
    self.batches.load(meta)
    state = self.restorer.branch_start(state, restored_step)
    self.recovery.restart_window(self.restorer.state_metrics(state))
    restored_faults = _local_counts(state.device_faults)
    records: list[dict] = []
    flags: list[tuple[int, int, dict]] = []
    again_cause = None
    cfg = components.cfg
    for index in range(restored_step, step):
      self.beat()
      batch = self.batches.next(index)
      state, metrics = components.train_step(state, batch)
      flags.append((index, self.batches.positions[index], metrics))
      done = index + 1
      if not (metrics_read(cfg, done) or done == step):
        continue
      if components.telemetry:  # the record as the loop logs it (the monitor reads these)
        metrics = {**metrics, **components.logit_telemetry(state.params, batch["tokens"],
                                                            np.int32(done))}
      replayed = {"step": done, **fetch(metrics)}
      records.append(replayed)
      again_cause = self.recovery.check_train(replayed)
      if again_cause is not None:
        break
    skipped = _skipped(flags)
    first_step = record.get("step")
    again = next((r for r in records if r["step"] == first_step), {})
    transient = again_cause is None
    device = self._suspect(first_faults, restored_faults,
                           _local_counts(state.device_faults)) if transient else ""
    if not transient:
      free(state)
    return Replay(
        transient=transient, cause=cause, step=step, restored_step=restored_step,
        steps=(records[-1]["step"] if records else restored_step) - restored_step,
        seconds=time.time() - t0, first=_summary(record), again=_summary(again),
        again_cause=again_cause, device=device, failed_at=failed_at, skip_from=skip_from,
        records=records, skipped=skipped, state=state if transient else None)

  def _suspect(self, first: dict[int, int], restored: dict[int, int],
               replayed: dict[int, int]) -> str:
    """The device whose rows went non-finite in the first run and not in the replay; else what
    is known: the process (one process), or that the job's devices cannot be told apart."""
    mesh = self.current_components().mesh
    devices = list(mesh.devices.flat)
    local = np.zeros(len(devices), np.int32)
    for i, count in first.items():
      if count > restored.get(i, 0) and replayed.get(i, 0) == restored.get(i, 0):
        local[i] = 1
    flagged = np.asarray(distributed.agree_max(local)).reshape(-1) if devices else local
    named = [devices[i] for i in np.flatnonzero(flagged)]
    if named:
      return ", ".join(_device_name(d) for d in named)
    if len(devices) == 1:
      return _device_name(devices[0])
    if jax.process_count() == 1:
      return f"process 0 ({socket.gethostname()}), one of its {len(devices)} devices"
    return (f"one of the job's {jax.process_count()} processes (the fault did not reach a loss, "
            "so the gradients' all-reduce hides which)")


def _device_name(device: Any) -> str:
  host = f" ({socket.gethostname()})" if device.process_index == jax.process_index() else ""
  return f"process {device.process_index}{host}, device {device.platform}:{device.id}"


def _local_counts(counts: Optional[jax.Array]) -> dict[int, int]:
  """This process's entries of a per-device counter (``TrainState.device_faults``)."""
  if counts is None:
    return {}
  return {shard.index[0].start or 0: int(np.asarray(shard.data).reshape(-1)[0])
          for shard in counts.addressable_shards}


def _skipped(flags: list[tuple[int, int, dict]]) -> list[tuple[int, int, list[str]]]:
  """(step index, batch position, wrappers) of the replayed steps a skip wrapper skipped."""
  from stablejax.monitor.specs import skip_flag_keys
  kept = [(index, position, {k: m[k] for k in skip_flag_keys(m)}) for index, position, m in flags]
  values = jax.device_get([f for _, _, f in kept])
  return [(index, position, names) for (index, position, _), f in zip(kept, values)
          if (names := [key.split("/")[0] for key, flag in f.items() if bool(flag)])]


def _summary(record: dict) -> dict:
  return {key: record[key] for key in ("step", "loss", "grad_norm") if key in record}


def free(state: TrainState) -> None:
  """Frees a train state's device buffers now (the replay never holds two states)."""
  for leaf in jax.tree.leaves(state):
    if isinstance(leaf, jax.Array) and not leaf.is_deleted():
      leaf.delete()
