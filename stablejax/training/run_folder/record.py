"""What the trainer writes in a run directory, and ``run.json``, its record of what it wrote.

``python -m stablejax train --out DIR`` writes only the names of `WRITES` in DIR: a file, or a
folder holding entries of the patterns given (atomic writes go through ``.<name>.tmp`` first,
`tmp_name`). ``DIR/run.json`` (`RECORD`) lists the names it created there, with ``"program"``
`PROGRAM`; `read_record` reads it back, refusing a ``run.json`` of another program. A place at
or inside one of those names, in a folder with the trainer's record, is the run's alone
(`trainer_folder_of`): the other programs never write there, and no run starts there.

`RunDirError` is the one-line error of a run directory the trainer may not use as it is; the
checks of :mod:`stablejax.training.run_folder.checks`, the removal of
:mod:`stablejax.training.run_folder.previous` and
:class:`stablejax.training.run_folder.folder.RunDirectory` raise it.

Example:
  >>> import json, pathlib, tempfile
  >>> from stablejax.training.run_folder.record import PROGRAM, RECORD, trainer_folder_of
  >>> run = pathlib.Path(tempfile.mkdtemp())
  >>> _ = (run / RECORD).write_text(json.dumps({"program": PROGRAM, "written": []}))
  >>> trainer_folder_of(run / "checkpoints" / "100")[1]   # the run's, even before it exists
  'checkpoints'
  >>> trainer_folder_of(run / "report.png") is None       # beside the records: anyone's
  True
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Optional

from stablejax.data.folder import LOCK_NAME

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
    "rejected_batches.json": None,
    "hang_stacks": (re.compile(r"^process_\d+\.txt$"),),
    "budget_clock.json": None,
    "checkpoints": (_STEP, _ORBAX_TMP),
    "damaged_checkpoints": (_DAMAGED,),
    "budget_probe": (_STEP, _ORBAX_TMP),
    "tensorboard": (_EVENTS,),
    "tokenizer": (re.compile(r"^(record|tokenizer)\.json$"),
                  re.compile(r"^\.(record|tokenizer)\.json\.tmp$")),
}
# The folders of WRITES that hold one folder per checkpoint step, and the names of those.
STEP_FOLDERS = {"checkpoints": _STEP, "budget_probe": _STEP, "damaged_checkpoints": _DAMAGED}


class RunDirError(Exception):
  """A run directory the trainer may not use as it is; one line naming the problem and the fix.

  ``quiet``: another process (process 0) printed the line; this one exits without repeating it.
  ``agreed``: every process of the job raised it (they may leave together).
  """

  def __init__(self, message: str, *, quiet: bool = False, agreed: bool = False) -> None:
    super().__init__(message)
    self.quiet = quiet
    self.agreed = agreed


def tmp_name(name: str) -> str:
  """The name an atomic write of ``name`` goes through first."""
  return f".{name}.tmp"


def read_record(root: Path) -> dict:
  """The record in ``root`` ({} when there is none).

  Raises:
    RunDirError: it cannot be read, or it is not the trainer's.
  """
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


def resolved(path: Path) -> Path:
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
  place = resolved(Path(path))
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


def recorded_plugins(root: Path | str) -> list[str]:
  """The plugins of the run in ``root`` (its ``config.json``, when the trainer's record says the
  trainer wrote it), for a resume to import again; [] for no run, or a folder that is not one (a
  config the trainer did not write names nothing to import)."""
  from stablejax.training.config import recorded_plugins as listed
  root = Path(root)
  try:
    record = read_record(root)
  except RunDirError:
    return []
  return listed(root / "config.json") if "config.json" in record.get("written", []) else []
