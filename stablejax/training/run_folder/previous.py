"""``--fresh``: the previous run in a run directory, removed all or nothing.

``python -m stablejax train --fresh`` deletes nothing until every check of the new start passed
(config, data, the model built). Then the previous run's names, every one checked when the
directory was opened (:mod:`stablejax.training.run_folder.checks`), are moved into one folder,
``.fresh-removing`` (`TRASH`), and that folder is deleted. A name that cannot be moved (a mount
point, no permission) puts the others back and is one line: nothing is deleted. The record
lists the folder while it exists, so a ``--fresh`` killed while deleting is finished by the
next start, and a file put into the folder meanwhile is refused, never deleted.

Example:
  >>> import pathlib, tempfile
  >>> from stablejax.training.run_folder.previous import PreviousRun
  >>> out = pathlib.Path(tempfile.mkdtemp())
  >>> _ = (out / "metrics.jsonl").write_text("{}")
  >>> _ = (out / "notes.txt").write_text("mine")
  >>> records = []
  >>> previous = PreviousRun(out, {"metrics.jsonl"}, {"program": "stablejax train"})
  >>> previous.move_aside(records.append)
  >>> sorted(p.name for p in out.iterdir())
  ['.fresh-removing', 'notes.txt']
  >>> records[-1]["written"]      # recorded before the move: the next start finishes it
  ['.fresh-removing', 'metrics.jsonl']
  >>> previous.delete()
  >>> sorted(p.name for p in out.iterdir())
  ['notes.txt']
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable

from stablejax.training.run_folder.environment_errors import reason
from stablejax.training.run_folder.record import RECORD, TRASH, WRITES, RunDirError, tmp_name


class PreviousRun:
  """The names an earlier run wrote in ``root`` (checked), and its record as it was.

  Args:
    root: the run directory.
    names: the previous run's names in ``root`` (a ``--fresh`` folder left behind included).
    record: its record, with the ``written`` list.
  """

  def __init__(self, root: Path, names: set[str], record: dict) -> None:
    self.root = root
    self.names = sorted(names)
    self.record = record

  def move_aside(self, write_record: Callable[[dict], None]) -> None:
    """Moves the names into the ``--fresh`` folder, after recording it with ``write_record``. A
    name that cannot be moved puts the others back and the record as it was.

    Raises:
      RunDirError: a name could not be moved; nothing was deleted.
    """
    if not self.names:
      return
    trash = self.root / TRASH
    if TRASH in self.names:  # left by a --fresh that was killed while deleting: finish it first
      shutil.rmtree(trash, ignore_errors=True)
    write_record(dict(self.record, written=sorted({*self.names, TRASH})))
    moved: list[str] = []
    try:
      trash.mkdir(exist_ok=True)
      for name in self.names:
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
        write_record(self.record)  # the record as it was
      except (OSError, RunDirError):
        pass
      where = e.filename or trash
      raise RunDirError(f"--fresh: cannot move {where} aside to delete it ({reason(e)}): nothing "
                        "was deleted; fix that, or delete the previous run's files yourself"
                        ) from None

  def delete(self) -> None:
    """Deletes the ``--fresh`` folder (once the new record no longer lists the previous run's
    names) and the temporary files of interrupted atomic writes.

    Raises:
      RunDirError: the folder could not all be deleted.
    """
    trash = self.root / TRASH
    try:
      if os.path.lexists(trash):
        shutil.rmtree(trash)
    except OSError as e:
      raise RunDirError(f"--fresh: the previous run's files, moved to {trash}, could not all be "
                        f"deleted ({e.strerror or e}): delete that folder yourself") from None
    for name in (*WRITES, RECORD):
      (self.root / tmp_name(name)).unlink(missing_ok=True)
