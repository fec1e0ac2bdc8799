"""The batches a run rejected: ``rejected_batches.json`` in the run directory.

A batch is rejected when a step that trained on it was skipped (``skip_nonfinite``,
``skip_spikes``: the batch itself was refused), and when a failure that the replay reproduced
rolls back over it (the batches read since the rollback's checkpoint: suspects, which the
rollback skips). Each rejection is recorded with the step, the position of the batch in the data
stream (``Batches.consumed`` when it was read) and the cause, the moment it is known (an atomic
write, so a SIGKILL leaves the old file or the new one). A replay that finds a failure transient
withdraws the rejections its window made: the device, not the data, failed.

A position whose step was skipped ``stability.recovery.reject_after`` times (2: in two
executions, such as a first run and its replay, or two starts of the run) is never trained on
again: the run reads it from the stream and drops it, at once and at every later start. A
rollback's window does not count toward that: a window holds good batches beside the bad one.
Positions are positions in this run's data order (its seed and sources); ``--data-changed`` or
another order makes the record describe other batches, so the trainer sets it aside then.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable, Optional

from stablejax.training.checkpoint import read_json, write_json_atomic
from stablejax.training.run_folder.folder import RunDirectory

REJECTED_FILE = "rejected_batches.json"


class RejectedBatches:
  """The run's record of rejected batches (process 0 writes it; every process reads it).

  Args:
    run_dir: the run directory.
    threshold: rejections after which a position is dropped from the stream (0: never).
    order: the run's data order (:func:`stablejax.training.run_folder.data_order.data_order`); a
      record of another order is not applied.

  Example:
    >>> import pathlib, tempfile
    >>> from stablejax.training.recovery.rejected import RejectedBatches
    >>> from stablejax.training.run_folder.folder import RunDirectory
    >>> run_dir = RunDirectory.open(pathlib.Path(tempfile.mkdtemp()))
    >>> rejected = RejectedBatches(run_dir, threshold=2, order={"seed": 0})
    >>> rejected.reject([(12, 12)], "skip_nonfinite skipped step 13")
    []
    >>> rejected.reject([(12, 12), (13, 13)], "rollback at step 14", counts=False)
    []
    >>> rejected.reject([(12, 12)], "skip_nonfinite skipped step 13 (replay)")
    [12]
    >>> sorted(rejected.blocked)
    [12]
    >>> run_dir.close()
  """

  def __init__(self, run_dir: RunDirectory, threshold: int, order: Optional[dict]):
    self.run_dir = run_dir
    self.threshold = threshold
    self.order = order
    self.entries: dict[int, list[dict]] = {}  # position -> its rejections

  @property
  def path(self) -> Path:
    return self.run_dir.root / REJECTED_FILE

  def load(self) -> Optional[str]:
    """Reads the record a previous start left; returns a line to print when it blocks batches
    (or why it was set aside), else None."""
    if REJECTED_FILE not in self.run_dir.recorded:
      return None
    saved = read_json(self.path)
    if saved is None:
      return None
    if saved.get("order") != self.order:
      self.entries = {}
      return (f"{REJECTED_FILE} describes another data order than this start's: its "
              f"{len(saved.get('batches', {}))} rejected batches are not applied")
    self.entries = {int(k): list(v) for k, v in saved.get("batches", {}).items()}
    blocked = sorted(self.blocked)
    if not blocked:
      return None
    shown = ", ".join(map(str, blocked[:8])) + (", ..." if len(blocked) > 8 else "")
    return (f"skipping {len(blocked)} batch{'es' if len(blocked) > 1 else ''} rejected "
            f"{self.threshold} times or more (positions {shown}; {REJECTED_FILE}): never "
            "trained on again")

  @property
  def blocked(self) -> set[int]:
    """The positions the run no longer trains on."""
    if not self.threshold:
      return set()
    return {p for p, events in self.entries.items()
            if sum(e.get("counts", True) for e in events) >= self.threshold}

  def reject(self, batches: Iterable[tuple[int, int]], cause: str, counts: bool = True
             ) -> list[int]:
    """Records one rejection of each ``(position, step)`` (``counts``: toward blocking it);
    returns the positions that became blocked by it."""
    before = self.blocked
    changed = False
    for position, step in batches:
      self.entries.setdefault(int(position), []).append(
          {"step": int(step), "cause": cause, "counts": counts})
      changed = True
    if changed:
      self._write()
    return sorted(self.blocked - before)

  def withdraw(self, keep: Callable[[int, dict], bool]) -> int:
    """Removes the rejections for which ``keep(position, event)`` is False; returns how many."""
    removed = 0
    for position in list(self.entries):
      kept = [e for e in self.entries[position] if keep(position, e)]
      removed += len(self.entries[position]) - len(kept)
      if kept:
        self.entries[position] = kept
      else:
        del self.entries[position]
    if removed:
      self._write()
    return removed

  def _write(self) -> None:
    if not self.run_dir.is_main:
      return
    path = self.run_dir.path(REJECTED_FILE)
    self.run_dir.record_written()  # recorded before it is there
    write_json_atomic(path, {"order": self.order,
                             "batches": {str(p): e for p, e in sorted(self.entries.items())}})
