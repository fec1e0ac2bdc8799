"""The run directory: one writer, a record of what it wrote, nothing touched until the checks pass.

``python -m stablejax train --out DIR`` owns what it writes in DIR and nothing else:

* **One writer.** The trainer holds an exclusive lock on DIR for its whole life
  (:class:`stablejax.data.folder.FolderLock`: on the folder itself, so a ``.lock`` deleted by
  hand frees nothing; released by the operating system however the process ends); a second
  trainer on the same DIR stops at once with one line naming the holder. In a job of several
  processes, process 0 decides and every process learns its answer, so a refused start is one
  line and every process exits 2.
* **A record.** ``DIR/run.json`` lists every name the trainer created in DIR (files and folders,
  each listed before it is created), the fingerprint of every checkpoint it saved (recorded before
  the save), the tokenizer and the identity of the data the run trains on, and the settings of its
  data order. A trainer name (``checkpoints``, ``metrics.jsonl``, ...) that the record does not
  list, a recorded folder with anything else in it (a file of yours in ``checkpoints/``, a step
  folder holding more than Orbax writes), or a step in ``checkpoints/`` that the record does not
  list with that fingerprint (another run's step copied in) is refused with one line naming it:
  nothing is deleted, appended to or read as a checkpoint. Other files in DIR are never touched.
* **A run of stablejax 0.1** (no record) is recognised by what only the trainer writes: a
  ``config.json`` with every section of the trainer's config, and checkpoints in ``checkpoints/``
  whose metadata is the trainer's (the step and the fingerprint it saves with each). Then its
  trainer names are adopted; a ``config.json`` alone, or checkpoints of another program, are not.
* **Inputs are not outputs.** A ``--config`` or data path that lies where the trainer writes
  (``--config exp/config.json --out exp`` on a folder the trainer has not written) is refused: the
  user's file stays as it was.
* **Check before write.** Opening DIR changes nothing; the trainer writes ``config.json`` and the
  record only after the resume checks passed (checkpoint restored, tokenizer and data the ones the
  run recorded), so a refused resume leaves the run as it was. ``--fresh`` deletes nothing until
  every check of the new start passed (config, data, the model built): then the previous run's
  names are moved into one folder and deleted, all or nothing (a name that cannot be moved, or a
  symbolic link among them, is one line and nothing is deleted).

This module holds :class:`RunDirectory`, which opens, locks and closes the folder and keeps the
record. The names the trainer writes and the record's file are
:mod:`stablejax.training.run_folder.record`, the checks of what is in the folder
:mod:`stablejax.training.run_folder.checks`, and ``--fresh``'s removal
:mod:`stablejax.training.run_folder.previous`.

Example:
  >>> import pathlib, tempfile
  >>> from stablejax.training.run_folder.folder import RunDirectory
  >>> from stablejax.training.run_folder.record import RunDirError
  >>> out = pathlib.Path(tempfile.mkdtemp()) / "run"
  >>> run = RunDirectory.open(out)
  >>> _ = run.path("metrics.jsonl").write_text("")   # created through the record
  >>> run.record_written()
  >>> sorted(run.recorded)
  ['metrics.jsonl']
  >>> try:
  ...   RunDirectory.open(out)          # a second trainer on the same folder
  ... except RunDirError as e:
  ...   print("in use" in str(e))
  True
  >>> run.close()
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Optional, Sequence

from stablejax.data.folder import LOCK_NAME, FolderBusy, FolderLock
from stablejax.data.paths import PathError, checked_path
from stablejax.training.checkpoint import write_json_atomic
from stablejax.training.run_folder.environment_errors import environment_error
from stablejax.training.run_folder.previous import PreviousRun
from stablejax.training.run_folder.checks import (check_checkpoints, check_inputs, check_names,
                                               fingerprints_on_disk, present_names,
                                               recognise_v0_1, step_dirs)
from stablejax.training.run_folder.record import (PROGRAM, RECORD, TRASH, WRITES, RunDirError,
                                           read_record, resolved, tmp_name, trainer_folder_of)


def _joined_job() -> bool:
  """Whether this process is one of several of a JAX job (without starting a backend when not)."""
  import jax
  return bool(jax.distributed.is_initialized()) and jax.process_count() > 1


class RunDirectory:
  """An open run directory: locked, its record read and checked, nothing written yet.

  Use :meth:`open`; :meth:`path` returns the path of a name the trainer is about to write and
  records the name; :meth:`record_written` saves the record (process 0 only). With ``fresh``,
  :meth:`remove_previous` deletes the previous run once the new start's checks passed (the first
  :meth:`record_written` does it at the latest).
  """

  def __init__(self, root: Path, lock: Optional[FolderLock], record: dict, is_main: bool,
               created: bool = False):
    self.root = root
    self.created = created  # the trainer made the folder: it removes it again if it wrote nothing
    self._lock = lock
    self._record = record
    self.is_main = is_main
    self.recorded: set[str] = set(record.get("written", []))
    self._dirty = False
    self._previous: Optional[PreviousRun] = None  # --fresh: the names still to remove

  # ---------------------------------------------------------------- opening

  @classmethod
  def open(cls, root: Path | str, *, fresh: bool = False, is_main: bool = True,
           inputs: Sequence[tuple[str, Any]] = ()) -> "RunDirectory":
    """Locks ``root`` (created if missing) and checks what is in it and the run's ``inputs``.
    Only process 0 (``is_main``) locks and checks; in a job of several processes every process
    gets its answer. With ``fresh`` the previous run is checked here and removed later
    (:meth:`remove_previous`).

    Args:
      root: the run directory.
      fresh: start over: the previous run's names are to be removed.
      is_main: whether this is process 0.
      inputs: what the run reads, as ``(what, path)`` pairs (``("--config", "exp/c.json")``,
        ``("data.train", "corpus/")``, :func:`~stablejax.training.run_folder.checks.run_inputs`):
        none may lie where the trainer writes.

    Raises:
      RunDirError: ``root`` is no usable path (empty, a loop of symbolic links, a name too long:
        :func:`stablejax.data.paths.checked_path`), is a file or cannot be created or written,
        another process holds it, it holds trainer names the trainer did not write or
        checkpoints it did not save (named in the message), or an input lies where the trainer
        writes.
    """
    try:
      root = checked_path(root, "--out")
    except PathError as e:  # alike on every process: each refuses it before any collective
      raise RunDirError(str(e)) from None
    if _joined_job():  # process 0 decides; the others learn its answer, never wait on a peer gone
      from stablejax.training.launch import distributed
      run: Optional[RunDirectory] = None
      refused: Optional[RunDirError] = None
      if is_main:
        try:
          run = cls._open_main(root, fresh, inputs)
        except RunDirError as e:
          refused = e
      if distributed.agree_any(refused is not None):
        if refused is not None:
          refused.agreed = True
          raise refused
        raise RunDirError(f"process 0 refused the run directory {root}", quiet=True, agreed=True)
      if run is not None:
        return run
    if not is_main:  # reads the record (the resume checks decide alike on every process)
      return cls(root, None, {} if fresh or not (root / RECORD).is_file()
                 else read_record(root), is_main=False)
    return cls._open_main(root, fresh, inputs)

  @classmethod
  def _open_main(cls, root: Path, fresh: bool, inputs: Sequence[tuple[str, Any]]
                 ) -> "RunDirectory":
    if os.path.lexists(root) and not root.is_dir():
      raise RunDirError(f"--out {root} is a file: pass a folder for the run (it is created if "
                        "missing)")
    owner = trainer_folder_of(root)
    if owner is not None and owner[0] != resolved(root):
      raise RunDirError(f"--out {root} lies in {owner[0] / owner[1]}, which the trainer keeps for "
                        f"the run in {owner[0]}: choose another --out")
    created = not root.exists()
    try:
      root.mkdir(parents=True, exist_ok=True)
      lock = FolderLock(root, "train").acquire()
    except FolderBusy as e:
      raise RunDirError(f"{e} (two trainers on one run directory would interleave its logs and "
                        "checkpoints)") from None
    except OSError as e:
      if created:
        _remove_empty(root)
      raise RunDirError(environment_error(e, root, "the run directory")) from None
    run = cls(root, lock, {}, is_main=True, created=created)
    try:
      run._record = read_record(root)
      run.recorded = set(run._record.get("written", []))
      run._check(inputs, fresh)
      if fresh:
        previous = {n for n in (*present_names(root), TRASH) if os.path.lexists(root / n)}
        run._previous = PreviousRun(root, previous, dict(run._record, written=sorted(run.recorded)))
        run._record, run.recorded, run._dirty = {"program": PROGRAM}, set(), False
      return run
    except BaseException:
      run.close()
      raise

  def _check(self, inputs: Sequence[tuple[str, Any]], fresh: bool) -> None:
    """What is in the folder is this run's (a folder without a record: new, or a run of
    stablejax 0.1, adopted), and no input lies where the trainer writes."""
    check_inputs(self.root, self.recorded, inputs)
    if not self._record:
      adopted = recognise_v0_1(self.root)
      if adopted is not None:
        self._record, self.recorded, self._dirty = adopted, set(adopted["written"]), True
    check_names(self.root, self.recorded, fresh)
    if "checkpoints" not in self.recorded:
      return
    saved = self._record.get("checkpoints")
    if isinstance(saved, dict):
      check_checkpoints(self.root, saved)
    else:  # a record of an earlier release, without fingerprints: adopts the steps there
      self._record["checkpoints"] = fingerprints_on_disk(self.root)
      self._dirty = True

  # ---------------------------------------------------------------- --fresh

  @property
  def removing_previous(self) -> bool:
    """--fresh, and the previous run is still there (:meth:`remove_previous` has not run)."""
    return self._previous is not None

  def remove_previous(self) -> None:
    """--fresh, once every check of the new start passed: the previous run's names (all checked
    when the directory was opened) are moved into one folder, then deleted. A name that cannot
    be moved puts the others back: nothing is deleted. Process 0; a no-op without ``fresh``."""
    previous, self._previous = self._previous, None
    if previous is None or not self.is_main:
      return
    previous.move_aside(self._write_record)
    self.recorded.add(TRASH)  # the previous run's record ends here
    self._write_record(dict(self._record, written=sorted(self.recorded)))
    previous.delete()
    self.recorded.discard(TRASH)
    self._dirty = True

  # ---------------------------------------------------------------- writing

  def path(self, name: str) -> Path:
    """The path of trainer name ``name``, recorded as written (saved by :meth:`record_written`)."""
    if name not in WRITES:
      raise ValueError(f"{name!r} is not a name the trainer writes; add it to WRITES")
    if name not in self.recorded:
      self.recorded.add(name)
      self._dirty = True
    if name == "checkpoints" and not isinstance(self._record.get("checkpoints"), dict):
      self._record["checkpoints"] = {}  # the steps it saves, as it saves them
      self._dirty = True
    return self.root / name

  @property
  def data_identity(self) -> Optional[dict]:
    """The identity of the data this run trained on, as recorded (None: not recorded yet)."""
    return self._record.get("data")

  def set_data_identity(self, identity: dict) -> None:
    self._set("data", identity)

  @property
  def tokenizer(self) -> Optional[dict]:
    """The tokenizer this run trained with, as recorded (None: not recorded)."""
    return self._recorded_dict("tokenizer")

  def set_tokenizer(self, identity: dict) -> None:
    self._set("tokenizer", identity)

  @property
  def data_order(self) -> Optional[dict]:
    """The settings that fix the order of the batches, as recorded (None: not recorded)."""
    return self._recorded_dict("data_order")

  def set_data_order(self, settings: dict) -> None:
    self._set("data_order", settings)

  @property
  def rewarmup(self) -> Optional[dict]:
    """The latest re-warmup a start applied, ``{"step": S, "steps": N}`` (None: none)."""
    return self._recorded_dict("rewarmup")

  def set_rewarmup(self, rewarmup: dict) -> None:
    self._set("rewarmup", rewarmup)

  def _recorded_dict(self, key: str) -> Optional[dict]:
    """The record's ``key`` when it holds a dict (None: not recorded, or not a dict)."""
    value = self._record.get(key)
    return value if isinstance(value, dict) else None

  def _set(self, key: str, value: Any) -> None:
    value = json.loads(json.dumps(value))  # as it reads back
    if self._record.get(key) != value:
      self._record[key] = value
      self._dirty = True

  def record_checkpoint(self, step: int, fingerprint: Sequence[float]) -> None:
    """Records the checkpoint about to be saved at ``step`` (its fingerprint) and saves the
    record, before Orbax writes it: a step on disk is always in the record. Records of steps
    older than every step on disk (removed by ``checkpoint.keep``) are dropped."""
    if not self.is_main:
      return
    saved = self._record.get("checkpoints")
    saved = dict(saved) if isinstance(saved, dict) else {}
    on_disk = [int(p.name) for p in step_dirs(self.root, "checkpoints")]
    if on_disk:
      saved = {s: fp for s, fp in saved.items() if int(s) >= min(on_disk)}
    saved[str(int(step))] = [float(v) for v in fingerprint]
    self._record["checkpoints"] = json.loads(json.dumps(saved))
    self._dirty = True
    self.record_written()

  def record_written(self) -> None:
    """Saves the record atomically (process 0; a no-op when nothing changed). Checks first that
    the folder is still this process's (:meth:`FolderLock.verify`)."""
    if not self.is_main:
      return
    if self._previous is not None:
      self.remove_previous()
    elif TRASH in self.recorded:  # a --fresh killed while deleting: the deletion is finished now
      shutil.rmtree(self.root / TRASH, ignore_errors=True)
      if not os.path.lexists(self.root / TRASH):
        self.recorded.discard(TRASH)
        self._dirty = True
    if not self._dirty:
      return
    record = dict(self._record, program=PROGRAM, written=sorted(self.recorded))
    self._write_record(record)
    self._record, self._dirty = record, False

  def _write_record(self, record: dict) -> None:
    """Writes ``record`` (with its ``written`` list) as run.json, once the lock is verified."""
    if self._lock is not None:
      try:
        self._lock.verify()
      except FolderBusy as e:
        raise RunDirError(str(e)) from None
    write_json_atomic(self.root / RECORD, dict(record, program=PROGRAM), indent=2)

  # ---------------------------------------------------------------- closing

  def close(self) -> None:
    """Releases the lock (process exit does the same). A folder the trainer created that holds
    nothing but its bookkeeping (a start that failed early, e.g. on a full disk) is removed: no
    empty --out is left behind."""
    if self._lock is None:
      return
    if self.created:
      self._remove_if_unused()
    self._lock.release()
    self._lock = None
    if self.created:
      _remove_empty(self.root)

  def _remove_if_unused(self) -> None:
    bookkeeping = {LOCK_NAME, RECORD, tmp_name(RECORD)}
    try:
      entries = os.listdir(self.root)
    except OSError:
      return
    empty_folders = {n for n in entries if n in WRITES and (self.root / n).is_dir()
                     and not (self.root / n).is_symlink() and not os.listdir(self.root / n)}
    if set(entries) - bookkeeping - empty_folders:
      return
    for name in empty_folders:
      try:
        (self.root / name).rmdir()
      except OSError:
        pass
    for name in (RECORD, tmp_name(RECORD)):
      try:
        (self.root / name).unlink(missing_ok=True)
      except OSError:
        pass


def _remove_empty(folder: Path) -> None:
  try:
    folder.rmdir()
  except OSError:
    pass  # something is in it: it stays
