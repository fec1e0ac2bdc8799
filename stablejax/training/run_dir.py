"""The run directory: one writer, a record of what it wrote, nothing touched until the checks pass.

``python -m stablejax train --out DIR`` owns what it writes in DIR and nothing else:

* **One writer.** The trainer holds an exclusive lock on DIR for its whole life
  (:class:`stablejax.data.folder.FolderLock`, released by the operating system however the process
  ends); a second trainer on the same DIR stops at once with one line naming the holder.
* **A record.** ``DIR/run.json`` lists every name the trainer created in DIR (files and folders),
  and the identity of the data the run trains on. ``--fresh`` removes only recorded names, and
  only when a recorded folder holds nothing but what the trainer writes there (Orbax step folders,
  TensorBoard event files, ...). A trainer name (``checkpoints``, ``metrics.jsonl``, ...) that
  the record does not list, or a folder with anything else in it, is refused with one line naming
  it: nothing is deleted, appended to or read as a checkpoint. Other files in DIR are never
  touched. A run directory written before the record existed (stablejax 0.1) is recognised by its
  ``config.json`` and adopted.
* **Check before write.** Opening DIR changes nothing; the trainer writes ``config.json`` and the
  record only after the resume checks passed (checkpoint restored, tokenizer and data the ones the
  run recorded), so a refused resume leaves the run as it was.

Example:
  >>> import pathlib, tempfile
  >>> from stablejax.training.run_dir import RunDirectory, RunDirError
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

import errno
import json
import re
import shutil
from pathlib import Path
from typing import Any, Iterable, Optional

from stablejax.data.folder import LOCK_NAME, FolderBusy, FolderLock
from stablejax.training.checkpoint import write_json_atomic

RECORD = "run.json"
PROGRAM = "stablejax train"

_STEP = re.compile(r"^\d+$")
_ORBAX_TMP = re.compile(r"^\d+\.orbax-checkpoint-tmp(-\d+)?$")
_DAMAGED = re.compile(r"^\d+(\.\d+)?$")
_EVENTS = re.compile(r"^events\.out\.tfevents\.")

# What the trainer writes in a run directory: a file name -> None, a folder name -> what may be
# inside it. Atomic writes go through ".<name>.tmp" first. The programs that read a run write
# their own outputs beside (report.png, quantize_eval.json): those are theirs, and the trainer
# neither checks nor removes them.
WRITES: dict[str, Optional[Any]] = {
    "config.json": None,
    "metrics.jsonl": None,
    "summary.json": None,
    "recovery.json": None,
    "recovery.json.stale": None,
    "budget_clock.json": None,
    "checkpoints": (_STEP, _ORBAX_TMP),
    "damaged_checkpoints": (_DAMAGED,),
    "budget_probe": (_STEP, _ORBAX_TMP),
    "tensorboard": (_EVENTS,),
    "tokenizer": (re.compile(r"^(record|tokenizer)\.json$"),
                  re.compile(r"^\.(record|tokenizer)\.json\.tmp$")),
}


class RunDirError(Exception):
  """A run directory the trainer may not use as it is; one line naming the problem and the fix."""


def _tmp_name(name: str) -> str:
  return f".{name}.tmp"


def foreign_content(folder: Path, patterns: Iterable[re.Pattern]) -> list[str]:
  """Entries of ``folder`` that match none of ``patterns`` (what the trainer does not write)."""
  patterns = tuple(patterns)
  return sorted(p.name for p in folder.iterdir() if not any(r.match(p.name) for r in patterns))


class RunDirectory:
  """An open run directory: locked, its record read, nothing written yet.

  Use :meth:`open`; :meth:`path` returns the path of a name the trainer is about to write and
  records the name; :meth:`record_written` saves the record (process 0 only).
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

  # ---------------------------------------------------------------- opening

  @classmethod
  def open(cls, root: Path | str, *, fresh: bool = False, is_main: bool = True) -> "RunDirectory":
    """Locks ``root`` (created if missing) and checks what is in it; with ``fresh``, removes what
    the trainer wrote there before. Only process 0 (``is_main``) locks, checks and deletes.

    Raises:
      RunDirError: ``root`` is a file or cannot be created or written, another process holds
        it, or it holds trainer names the trainer did not write (named in the message).
    """
    root = Path(root)
    if not is_main:  # reads the record (the resume checks decide alike on every process)
      return cls(root, None, cls._read_record(root) if (root / RECORD).is_file() else {},
                 is_main=False)
    if root.exists() and not root.is_dir():
      raise RunDirError(f"--out {root} is a file: pass a folder for the run (it is created if "
                        "missing)")
    created = not root.exists()
    try:
      root.mkdir(parents=True, exist_ok=True)
      lock = FolderLock(root, "train").acquire()
    except FolderBusy as e:
      raise RunDirError(f"{e} (two trainers on one run directory would interleave its logs and "
                        "checkpoints)") from None
    except OSError as e:
      raise RunDirError(environment_error(e, root, "the run directory")) from None
    try:
      run = cls(root, lock, cls._read_record(root), is_main=True, created=created)
      run._adopt_v0_1()
      if fresh:
        run._remove_recorded()
      run._check_no_foreign_files()
      return run
    except BaseException:
      lock.release()
      raise

  @staticmethod
  def _read_record(root: Path) -> dict:
    path = root / RECORD
    if not path.exists():
      return {}
    try:
      record = json.loads(path.read_text())
    except (OSError, ValueError) as e:
      raise RunDirError(f"{path} is unreadable ({e}): it records what the trainer wrote in "
                        f"{root}; restore it, or move the run's files away and start again"
                        ) from None
    if not isinstance(record, dict) or record.get("program") != PROGRAM:
      raise RunDirError(f"{path} was not written by {PROGRAM}: choose another --out")
    return record

  def _adopt_v0_1(self) -> None:
    """A run directory of stablejax 0.1 has no record but a config.json the trainer wrote: its
    trainer names are the trainer's (checked for foreign content like any recorded folder)."""
    if self._record or not (self.root / "config.json").is_file():
      return
    from stablejax.training.config import ConfigError, load_run_file
    try:
      load_run_file(self.root / "config.json")
    except ConfigError:
      return  # not a trainer's config: its trainer names are foreign
    self.recorded = {name for name in WRITES if (self.root / name).exists()}
    self._record = {"program": PROGRAM, "adopted": "a run directory of stablejax 0.1"}
    self._dirty = True

  def _present(self) -> list[str]:
    return [name for name in WRITES if (self.root / name).exists()]

  def _check_no_foreign_files(self) -> None:
    for name in self._present():
      if name not in self.recorded:
        raise RunDirError(
            f"{self.root / name} was not written by this trainer (no record of it in "
            f"{self.root / RECORD}): move it away or choose another --out; nothing was changed")
      self._check_content(name)

  def _check_content(self, name: str) -> None:
    patterns = WRITES[name]
    path = self.root / name
    if patterns is None:
      if path.is_dir():
        raise RunDirError(f"{path} is a folder where the trainer writes a file: move it away or "
                          "choose another --out; nothing was changed")
      return
    if not path.is_dir():
      raise RunDirError(f"{path} is a file where the trainer keeps a folder: move it away or "
                        "choose another --out; nothing was changed")
    foreign = foreign_content(path, patterns)
    if foreign:
      shown = ", ".join(str(path / f) for f in foreign[:3]) + (" ..." if len(foreign) > 3 else "")
      raise RunDirError(f"{shown}: not written by this trainer, inside its {name}/ folder: move "
                        "it away or choose another --out; nothing was changed")

  def _remove_recorded(self) -> None:
    """--fresh: every recorded name goes, after all of them were checked (all or nothing)."""
    present = [name for name in self._present()]
    for name in present:
      if name not in self.recorded:
        raise RunDirError(
            f"--fresh: {self.root / name} was not written by this trainer (no record of it in "
            f"{self.root / RECORD}), so it is not deleted: move it away or choose another --out")
      self._check_content(name)
    for name in present:
      path = self.root / name
      shutil.rmtree(path) if path.is_dir() else path.unlink()
    for name in WRITES:
      (self.root / _tmp_name(name)).unlink(missing_ok=True)
    self.recorded = set()
    self._record = {"program": PROGRAM}
    self._dirty = True

  # ---------------------------------------------------------------- writing

  def path(self, name: str) -> Path:
    """The path of trainer name ``name``, recorded as written (saved by :meth:`record_written`)."""
    if name not in WRITES:
      raise ValueError(f"{name!r} is not a name the trainer writes; add it to WRITES")
    if name not in self.recorded:
      self.recorded.add(name)
      self._dirty = True
    return self.root / name

  @property
  def data_identity(self) -> Optional[dict]:
    """The identity of the data this run trained on, as recorded (None: not recorded yet)."""
    return self._record.get("data")

  def set_data_identity(self, identity: dict) -> None:
    if self._record.get("data") != identity:
      self._record["data"] = identity
      self._dirty = True

  def record_written(self) -> None:
    """Saves the record atomically (process 0; a no-op when nothing changed)."""
    if not self.is_main or not self._dirty:
      return
    record = dict(self._record, program=PROGRAM, written=sorted(self.recorded))
    write_json_atomic(self.root / RECORD, record, indent=2)
    self._record, self._dirty = record, False

  def close(self) -> None:
    """Releases the lock (process exit does the same). A folder the trainer created and wrote
    nothing into (a start that failed early) is removed: no empty --out is left behind."""
    if self._lock is None:
      return
    if self.created and not self.recorded:
      for name in (LOCK_NAME, RECORD):
        (self.root / name).unlink(missing_ok=True)
      try:
        self.root.rmdir()
      except OSError:
        pass  # something else appeared in it: it stays
    self._lock.release()
    self._lock = None


def recorded_plugins(root: Path | str) -> list[str]:
  """The plugins of the run in ``root`` (its ``config.json``, when the trainer's record says the
  trainer wrote it), for a resume to import again; [] for no run, or a folder that is not one (a
  config the trainer did not write names nothing to import)."""
  from stablejax.training.config import recorded_plugins as listed
  root = Path(root)
  try:
    record = RunDirectory._read_record(root)
  except RunDirError:
    return []
  return listed(root / "config.json") if "config.json" in record.get("written", []) else []


def environment_error(e: OSError, path: Path, what: str) -> str:
  """One line for an error of the environment (disk full, read-only, a file in the way)."""
  reasons = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded",
             errno.EROFS: "the file system is read-only", errno.EACCES: "permission denied",
             errno.EPERM: "permission denied", errno.ENOTDIR: "a file is in the way",
             errno.EEXIST: "a file is in the way"}
  reason = reasons.get(e.errno or 0, e.strerror or str(e))
  where = e.filename or path
  fix = {errno.ENOSPC: "free space or choose another --out",
         errno.EDQUOT: "free space or choose another --out"}.get(e.errno or 0,
                                                                 "choose another --out")
  return f"cannot write {what} {where}: {reason}; {fix}"


_DISK_FULL = (("No space left on device", "Disk quota exceeded"), (errno.ENOSPC, errno.EDQUOT))
_READ_ONLY = (("Read-only file system",), (errno.EROFS,))


def _chain_has(error: BaseException | str, kind: tuple) -> bool:
  """Whether ``error`` (a log message, or an exception or anything in its chain) is of ``kind``:
  its words in a message, or its errno. Orbax and tensorstore wrap the operating system's error
  in their own (a ValueError "RESOURCE_EXHAUSTED: ... No space left on device")."""
  phrases, errnos = kind
  if isinstance(error, str):
    return any(phrase in error for phrase in phrases)
  seen: set[int] = set()
  node: Optional[BaseException] = error
  while node is not None and id(node) not in seen:
    seen.add(id(node))
    if (isinstance(node, OSError) and node.errno in errnos) or _chain_has(str(node), kind):
      return True
    node = node.__cause__ or node.__context__
  return False


def is_environment_error(error: BaseException | str) -> bool:
  """Whether an exception or a log message is a full disk or a read-only file system."""
  return _chain_has(error, _DISK_FULL) or _chain_has(error, _READ_ONLY)


def environment_message(e: BaseException, out: Path) -> Optional[str]:
  """One line for an error of the environment met while training into ``out`` (disk full,
  read-only, no permission, device memory), or None for any other error."""
  if _chain_has(e, _DISK_FULL):
    return (f"cannot write into the run directory {out}: the disk is full; free space or choose "
            "another --out (the last complete checkpoint resumes the run)")
  if _chain_has(e, _READ_ONLY):
    return (f"cannot write into the run directory {out}: the file system is read-only; choose "
            "another --out")
  if isinstance(e, OSError) and e.errno in (errno.EACCES, errno.EPERM):
    return environment_error(e, out, "into the run directory")
  if "RESOURCE_EXHAUSTED" in str(e) and "memory" in str(e).lower():
    return ("the device ran out of memory: lower train.batch_size (or raise train.grad_accum), "
            "model size or train.seq_len, or set model.remat=true")
  return None
