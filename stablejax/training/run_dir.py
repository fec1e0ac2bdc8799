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
import os
import re
import shutil
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from stablejax.data.folder import LOCK_NAME, FolderBusy, FolderLock
from stablejax.training.checkpoint import write_json_atomic

RECORD = "run.json"
PROGRAM = "stablejax train"
TRASH = ".fresh-removing"  # --fresh moves the previous run's names here, then deletes it

_STEP = re.compile(r"^\d+$")
_ORBAX_TMP = re.compile(r"^\d+\.orbax-checkpoint-tmp(-\d+)?$")
_DAMAGED = re.compile(r"^\d+(\.\d+)?$")
_EVENTS = re.compile(r"^events\.out\.tfevents\.")
# What a step folder of `Checkpoints` holds: Orbax's own files and the items state, data, meta.
STEP_ENTRIES = frozenset({"_CHECKPOINT_METADATA", "commit_success.txt", "state", "data", "meta"})

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
_STEP_FOLDERS = {"checkpoints": _STEP, "budget_probe": _STEP, "damaged_checkpoints": _DAMAGED}
# The sections of the config the trainer writes, every one of them in full (0.1 wrote the same).
_CONFIG_SECTIONS = ("model", "data", "optimizer", "stability", "train", "checkpoint", "logging",
                    "mesh", "faults")


class RunDirError(Exception):
  """A run directory the trainer may not use as it is; one line naming the problem and the fix.

  ``quiet``: another process (process 0) printed the line; this one exits without repeating it.
  ``agreed``: every process of the job raised it (they may leave together).
  """

  def __init__(self, message: str, *, quiet: bool = False, agreed: bool = False) -> None:
    super().__init__(message)
    self.quiet = quiet
    self.agreed = agreed


def _tmp_name(name: str) -> str:
  return f".{name}.tmp"


def foreign_content(folder: Path, patterns: Iterable[re.Pattern]) -> list[str]:
  """Entries of ``folder`` that match none of ``patterns`` (what the trainer does not write)."""
  patterns = tuple(patterns)
  return sorted(p.name for p in folder.iterdir() if not any(r.match(p.name) for r in patterns))


def step_meta(step_dir: Path) -> Optional[dict]:
  """The ``meta`` item a checkpoint step holds (its step, fingerprint, ...); None when it has
  none that can be read (damage is the restore's to judge)."""
  try:
    meta = json.loads((Path(step_dir) / "meta" / "metadata").read_text())
  except (OSError, ValueError):
    return None
  return meta if isinstance(meta, dict) else None


def _joined_job() -> bool:
  """Whether this process is one of several of a JAX job (without starting a backend when not)."""
  import jax
  return bool(jax.distributed.is_initialized()) and jax.process_count() > 1


def _shown(paths: Sequence[Path], most: int = 3) -> str:
  return ", ".join(str(p) for p in paths[:most]) + (" ..." if len(paths) > most else "")


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
    self._previous: Optional[set[str]] = None  # --fresh: the names still to remove
    self._previous_record: dict = {}

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
        ``("data.train", "corpus/")``): none may lie where the trainer writes.

    Raises:
      RunDirError: ``root`` is a file or cannot be created or written, another process holds
        it, it holds trainer names the trainer did not write or checkpoints it did not save
        (named in the message), or an input lies where the trainer writes.
    """
    root = Path(root)
    if _joined_job():  # process 0 decides; the others learn its answer, never wait on a peer gone
      from stablejax.training import distributed
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
                 else cls._read_record(root), is_main=False)
    return cls._open_main(root, fresh, inputs)

  @classmethod
  def _open_main(cls, root: Path, fresh: bool, inputs: Sequence[tuple[str, Any]]
                 ) -> "RunDirectory":
    if os.path.lexists(root) and not root.is_dir():
      raise RunDirError(f"--out {root} is a file: pass a folder for the run (it is created if "
                        "missing)")
    owner = trainer_folder_of(root)
    if owner is not None and owner[0] != _resolved(root):
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
      run._record = cls._read_record(root)
      run.recorded = set(run._record.get("written", []))
      run._check_inputs(inputs)
      if not run._record:
        run._recognise_v0_1()
      run._check_names(fresh)
      if fresh:
        run._previous = {n for n in (*run._present(), TRASH) if os.path.lexists(root / n)}
        run._previous_record = dict(run._record, written=sorted(run.recorded))
        run._record, run.recorded, run._dirty = {"program": PROGRAM}, set(), False
      return run
    except BaseException:
      run.close()
      raise

  @staticmethod
  def _read_record(root: Path) -> dict:
    path = root / RECORD
    if not os.path.lexists(path):
      return {}
    try:
      record = json.loads(path.read_text())
    except (OSError, ValueError) as e:
      raise RunDirError(f"{path} is unreadable ({e}): it records what the trainer wrote in "
                        f"{root}; restore it, or move the run's files away and start again"
                        ) from None
    if not isinstance(record, dict) or record.get("program") != PROGRAM or not isinstance(
        record.get("written", []), list):
      raise RunDirError(f"{path} was not written by {PROGRAM}: choose another --out")
    return record

  def _check_inputs(self, inputs: Sequence[tuple[str, Any]]) -> None:
    """No input of the run lies where the trainer writes (it would be overwritten or read while
    being written). The run's own config.json, given back as --config to resume, may."""
    try:
      root = self.root.resolve()
    except OSError:
      return
    for what, given in inputs:
      try:
        path = Path(os.path.expanduser(str(given))).resolve()
        parts = path.relative_to(root).parts
      except (OSError, ValueError):  # not inside the run directory
        continue
      if not parts:
        raise RunDirError(f"{what} {given} is the run directory --out {self.root}: the trainer "
                          "writes there; choose another --out")
      if parts[0] not in (*WRITES, RECORD, LOCK_NAME, TRASH):
        continue
      if what == "--config" and parts == ("config.json",) and "config.json" in self.recorded:
        continue  # the run's own config, resumed from: rewritten with the same content
      if what == "--config":
        raise RunDirError(
            f"--config {given} is where the trainer writes the run's {parts[0]} in --out "
            f"{self.root}, and it did not write that file: move your config elsewhere (e.g. "
            f"{self.root.parent / (self.root.name + '.json')}) and pass that, or choose another "
            "--out; nothing was changed")
      raise RunDirError(f"{what} {given} lies in {self.root / parts[0]}, which the trainer writes "
                        "in --out: move the data out of the run directory, or choose another "
                        "--out; nothing was changed")

  def _recognise_v0_1(self) -> None:
    """A folder without a record: new (no trainer name in it), a run directory of stablejax 0.1
    (recognised by what only the trainer writes; its names are adopted), or refused."""
    present = self._present()
    if not present:
      return
    problem = self._not_v0_1()
    if problem is not None:
      one = len(present) == 1
      names = _shown([self.root / n for n in present], 6)
      raise RunDirError(
          f"{names} {'was' if one else 'were'} not written by this trainer (no record of "
          f"{'it' if one else 'them'} in {self.root / RECORD}, and "
          f"{problem}; a run directory of stablejax 0.1 is recognised by its checkpoints): move "
          f"{'it' if one else 'them'} away or choose another --out; nothing was changed")
    self.recorded = set(present)
    self._record = {"program": PROGRAM, "adopted": "a run directory of stablejax 0.1",
                    "checkpoints": self._fingerprints_on_disk()}
    self._dirty = True

  def _not_v0_1(self) -> Optional[str]:
    """Why the folder is not a run directory of stablejax 0.1 (None: it is one)."""
    try:
      raw = json.loads((self.root / "config.json").read_text())
    except (OSError, ValueError):
      return "no config.json of the trainer"
    if not isinstance(raw, dict) or not all(
        isinstance(raw.get(s), dict) and raw[s] for s in _CONFIG_SECTIONS):
      return "its config.json is not one the trainer wrote (it writes every section in full)"
    from stablejax.training.config import ConfigError, load_run_file
    try:
      load_run_file(self.root / "config.json")
    except ConfigError:
      return "its config.json is not a config of the trainer"
    metas = [step_meta(p) for p in self._step_dirs("checkpoints")]
    if not any(m is not None and "fingerprint" in m and "step" in m for m in metas):
      return "no checkpoint the trainer saved in checkpoints/"
    if any(m is not None and "tokenizer" in m for m in metas):
      return (f"its checkpoints were saved by a trainer that keeps {RECORD} (restore {RECORD} to "
              "resume)")
    return None

  def _present(self) -> list[str]:
    return [name for name in WRITES if os.path.lexists(self.root / name)]

  def _step_dirs(self, name: str) -> list[Path]:
    folder = self.root / name
    try:
      return sorted((p for p in folder.iterdir() if _STEP_FOLDERS[name].match(p.name)),
                    key=lambda p: p.name)
    except OSError:
      return []

  def _check_names(self, fresh: bool) -> None:
    """Every trainer name in the folder is recorded, holds only what the trainer writes, and
    every checkpoint is one the run saved; with ``fresh``, none is a symbolic link either."""
    for name in self._present():
      path = self.root / name
      if name not in self.recorded:
        raise RunDirError(
            f"{'--fresh: ' if fresh else ''}{path} was not written by this trainer (no record of "
            f"it in {self.root / RECORD}): move it away or choose another --out; nothing was "
            "changed")
      if WRITES[name] is None and path.is_symlink():
        raise RunDirError(
            f"{path} is a symbolic link (to {os.readlink(path)}), not the file the trainer "
            "wrote: it writes nothing through a link; move it away or choose another --out; "
            "nothing was changed")
      if name == "metrics.jsonl" and not path.is_dir() and path.stat().st_nlink > 1:
        raise RunDirError(
            f"{path} has other names (hard links): the trainer appends to it, and would write "
            "into them too; copy it (cp) instead of linking, or choose another --out; nothing "
            "was changed")
      if fresh and path.is_symlink():
        raise RunDirError(
            f"--fresh: {path} is a symbolic link (to {os.readlink(path)}), not the folder the "
            "trainer made: --fresh deletes nothing through a link; remove the link (or empty "
            "what it points to) yourself, or choose another --out; nothing was deleted")
      self._check_content(name)
    trash = self.root / TRASH
    if os.path.lexists(trash):
      foreign = ([] if TRASH in self.recorded and trash.is_dir() and not trash.is_symlink()
                 else [trash])
      foreign += [trash / n for n in (os.listdir(trash) if not foreign else []) if n not in WRITES]
      if foreign:
        raise RunDirError(f"{_shown(foreign)}: not written by this trainer (its --fresh leaves "
                          "only the previous run's names there): move it away or choose another "
                          "--out; nothing was changed")
    self._check_checkpoints()

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
    foreign = [path / f for f in foreign_content(path, patterns)]
    if name in _STEP_FOLDERS:  # a step folder holds what Orbax writes, nothing else
      for step_dir in self._step_dirs(name):
        if not step_dir.is_dir():
          foreign.append(step_dir)
          continue
        foreign += [step_dir / f for f in sorted(os.listdir(step_dir)) if f not in STEP_ENTRIES]
    if foreign:
      raise RunDirError(f"{_shown(foreign)}: not written by this trainer, inside its {name}/ "
                        "folder: move it away or choose another --out; nothing was changed")

  def _fingerprints_on_disk(self) -> dict[str, list]:
    """{step: fingerprint} of the checkpoints in checkpoints/ whose metadata can be read."""
    found = {}
    for step_dir in self._step_dirs("checkpoints"):
      meta = step_meta(step_dir)
      if meta is not None and isinstance(meta.get("fingerprint"), list):
        found[step_dir.name] = meta["fingerprint"]
    return found

  def _check_checkpoints(self) -> None:
    """Every step in checkpoints/ is one this run saved: the record lists it with the fingerprint
    its metadata holds. (A step whose metadata cannot be read is the restore's to judge: damaged
    ones are set aside, never deleted.) A record of an earlier release, without fingerprints,
    adopts the steps there."""
    if "checkpoints" not in self.recorded:
      return
    saved = self._record.get("checkpoints")
    if not isinstance(saved, dict):
      self._record["checkpoints"] = self._fingerprints_on_disk()
      self._dirty = True
      return
    for step_dir in self._step_dirs("checkpoints"):
      meta = step_meta(step_dir)
      if step_dir.name not in saved:
        listed = ", ".join(sorted(saved, key=int)) or "none"
        raise RunDirError(
            f"{step_dir} is not a checkpoint this run saved ({self.root / RECORD} lists steps "
            f"{listed}): move it away or choose another --out; nothing was changed")
      if meta is None:
        continue
      if meta.get("fingerprint") != saved[step_dir.name] or str(meta.get("step")) != step_dir.name:
        raise RunDirError(
            f"{step_dir} is not the checkpoint this run saved at step {step_dir.name} (its "
            f"fingerprint is not the one {self.root / RECORD} records; another run's step?): move "
            "it away or choose another --out; nothing was changed")

  # ---------------------------------------------------------------- --fresh

  @property
  def removing_previous(self) -> bool:
    """--fresh, and the previous run is still there (:meth:`remove_previous` has not run)."""
    return self._previous is not None

  def remove_previous(self) -> None:
    """--fresh, once every check of the new start passed: the previous run's names (all checked
    when the directory was opened) are moved into one folder, then deleted. A name that cannot
    be moved puts the others back: nothing is deleted. Process 0; a no-op without ``fresh``."""
    if self._previous is None or not self.is_main:
      self._previous = None
      return
    previous, self._previous = sorted(self._previous), None
    trash = self.root / TRASH
    if previous:
      if TRASH in previous:  # left by a --fresh that was killed while deleting: finish it first
        shutil.rmtree(trash, ignore_errors=True)
      self._write_record(dict(self._previous_record, written=sorted({*previous, TRASH})))
      moved: list[str] = []
      try:
        trash.mkdir(exist_ok=True)
        for name in previous:
          if name != TRASH:
            os.rename(self.root / name, trash / name)
            moved.append(name)
      except OSError as e:
        for name in reversed(moved):  # back where they were
          try:
            os.rename(trash / name, self.root / name)
          except OSError:
            pass
        try:
          trash.rmdir()
          self._write_record(self._previous_record)  # the record as it was
        except (OSError, RunDirError):
          pass
        where = e.filename or trash
        reason = _REASONS.get(e.errno or 0, e.strerror or str(e))
        raise RunDirError(f"--fresh: cannot move {where} aside to delete it ({reason}): nothing "
                          "was deleted; fix that, or delete the previous run's files yourself"
                          ) from None
    self.recorded.add(TRASH)  # the previous run's record ends here
    self._write_record(dict(self._record, written=sorted(self.recorded)))
    try:
      if os.path.lexists(trash):
        shutil.rmtree(trash)
    except OSError as e:
      raise RunDirError(f"--fresh: the previous run's files, moved to {trash}, could not all be "
                        f"deleted ({e.strerror or e}): delete that folder yourself") from None
    for name in (*WRITES, RECORD):
      (self.root / _tmp_name(name)).unlink(missing_ok=True)
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
    value = self._record.get("tokenizer")
    return value if isinstance(value, dict) else None

  def set_tokenizer(self, identity: dict) -> None:
    self._set("tokenizer", identity)

  @property
  def data_order(self) -> Optional[dict]:
    """The settings that fix the order of the batches, as recorded (None: not recorded)."""
    value = self._record.get("data_order")
    return value if isinstance(value, dict) else None

  def set_data_order(self, settings: dict) -> None:
    self._set("data_order", settings)

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
    on_disk = [int(p.name) for p in self._step_dirs("checkpoints")]
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
    bookkeeping = {LOCK_NAME, RECORD, _tmp_name(RECORD)}
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
    for name in (RECORD, _tmp_name(RECORD)):
      try:
        (self.root / name).unlink(missing_ok=True)
      except OSError:
        pass


def _resolved(path: Path) -> Path:
  """``path`` resolved, as far as it exists (the rest appended as given)."""
  path = Path(os.path.abspath(os.path.expanduser(str(path))))
  missing: list[str] = []
  while not os.path.lexists(path) and path != path.parent:
    missing.insert(0, path.name)
    path = path.parent
  return path.resolve().joinpath(*missing)


def trainer_folder_of(path: Path | str) -> Optional[tuple[Path, str]]:
  """(run directory, name) when ``path`` is or lies in a name the trainer writes in a run
  directory of this trainer (one with its ``run.json``): such a place is the run's alone."""
  place = _resolved(Path(path))
  for folder in place.parents:
    name = place.relative_to(folder).parts[0]
    if name not in (*WRITES, RECORD, LOCK_NAME, TRASH):
      continue
    try:
      record = json.loads((folder / RECORD).read_text())
    except (OSError, ValueError):
      continue
    if isinstance(record, dict) and record.get("program") == PROGRAM:
      return folder, name
  return None


def run_inputs(cfg: Any, config_file: Optional[Path | str] = None) -> list[tuple[str, Any]]:
  """What a run of ``cfg`` reads, as ``(what, path)`` pairs for :meth:`RunDirectory.open`: the
  config file it was given and the data paths (the embedded corpus is no path)."""
  from stablejax.data.config import EMBEDDED
  inputs: list[tuple[str, Any]] = [("--config", config_file)] if config_file else []
  for split in ("train", "val"):
    value = getattr(cfg.data, split)
    for entry in [value] if isinstance(value, str) else list(value or []):
      if isinstance(entry, str) and entry != EMBEDDED:
        inputs.append((f"data.{split}", entry))
  return inputs


def data_order(cfg: Any) -> dict:
  """The settings that fix the order of the batches over the same data (recorded in run.json)."""
  return {"train.seed": cfg.train.seed, "train.batch_size": cfg.train.batch_size,
          "train.seq_len": cfg.train.seq_len, "data.shuffle_buffer": cfg.data.shuffle_buffer}


def order_difference(recorded: dict, current: dict) -> str:
  """``train.seed 0 -> 1, ...``: the settings of the data order that changed."""
  return ", ".join(f"{key} {recorded.get(key)} -> {value}" for key, value in current.items()
                   if recorded.get(key) != value)


def _remove_empty(folder: Path) -> None:
  try:
    folder.rmdir()
  except OSError:
    pass  # something is in it: it stays


_REASONS = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded",
            errno.EROFS: "the file system is read-only", errno.EACCES: "permission denied",
            errno.EPERM: "permission denied", errno.ENOTDIR: "a file is in the way",
            errno.EEXIST: "a file is in the way",
            errno.EXDEV: "it is on another file system (a mount point)",
            errno.EBUSY: "it is in use (a mount point)"}


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
  reason = _REASONS.get(e.errno or 0, e.strerror or str(e))
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
