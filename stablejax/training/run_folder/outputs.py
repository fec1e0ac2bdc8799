"""The files a program writes where the user says: one rule for ``report``, ``sample --out`` and
``quantize-eval``.

A program that reads a run and writes a file of its own (a PNG, a JSON of results) writes only
that file, and only where it may:

* **Never the run's records or inputs**, even with ``--force``: a name the trainer writes in the
  run directory (``run.json``, ``config.json``, ``metrics.jsonl``, anything inside
  ``checkpoints/`` or ``tensorboard/`` ...), in that run's directory or in any run directory of
  the trainer (one with its ``run.json``), and the run's data (the paths its ``config.json``
  names, and anything inside them). Nor anything that is not a regular file (``/dev/null``, a
  pipe).
* **Never a file it did not write, unless ``--force``**: an existing file is replaced only when
  the program recognises it as its own output (the report's PNG carries ``Software: stablejax
  report``; a JSON result carries ``"program"``). A symbolic link is not followed: with
  ``--force`` the link itself is replaced.
* **Whole or not at all**: the file is written beside its place under a temporary name of its own
  and renamed over it, so an error, a full disk or a signal leaves the old file or the new one.

A path that is a directory, a folder that does not exist or cannot be written, a full disk: one
line (`OutputError`), the programs exit 2.

Example:
  >>> import pathlib, tempfile
  >>> from stablejax.training.run_folder.outputs import OutputError, check_output, write_output
  >>> folder = pathlib.Path(tempfile.mkdtemp())
  >>> _ = (folder / "notes.txt").write_text("mine")
  >>> try:
  ...   check_output(folder / "notes.txt", program="report", ours=lambda p: False)
  ... except OutputError as e:
  ...   print(str(e).split(":")[-1].strip())
  pass --force to replace it, or another --out
  >>> out = check_output(folder / "result.json", program="report", ours=lambda p: False)
  >>> write_output(out, lambda tmp: tmp.write_text("{}"), program="report")
  >>> (folder / "result.json").read_text()
  '{}'
"""

from __future__ import annotations

import errno
import json
import os
import secrets
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

from stablejax.data.folder import LOCK_NAME


class OutputError(Exception):
  """A file a program may not write there, or cannot; one line naming it and the fix."""


_REASONS = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded",
            errno.EROFS: "the file system is read-only", errno.EACCES: "permission denied",
            errno.EPERM: "permission denied", errno.ENOENT: "its folder does not exist",
            errno.ENOTDIR: "a file is in the way", errno.EISDIR: "it is a directory"}


def run_records(run_dir: Path) -> list[Path]:
  """The names the trainer writes in ``run_dir`` (its records; a folder counts with all it
  holds)."""
  from stablejax.training.run_folder.record import RECORD, TRASH, WRITES
  return [Path(run_dir) / name for name in (*WRITES, RECORD, LOCK_NAME, TRASH)]


def run_data(run_dir: Path) -> list[Path]:
  """The data paths the run's ``config.json`` names (read from the current directory, as the
  programs read them); none when it cannot be read."""
  try:
    data = json.loads((Path(run_dir) / "config.json").read_text()).get("data", {})
  except (OSError, ValueError, AttributeError):
    return []
  paths = []
  for split in ("train", "val"):
    value = data.get(split) if isinstance(data, dict) else None
    for entry in [value] if isinstance(value, str) else value if isinstance(value, list) else []:
      if isinstance(entry, str) and entry != "pydoc":
        paths.append(Path(os.path.expanduser(entry)))
  return paths


def _place(path: Path) -> Path:
  """``path`` with its folder resolved and its last name kept (a link there is not followed)."""
  path = Path(os.path.expanduser(str(path)))
  return path.parent.resolve() / path.name


def _inside(path: Path, roots: Iterable[Path]) -> Optional[Path]:
  for root in roots:
    for candidate in {_place(root), Path(os.path.realpath(root))}:
      if path == candidate or candidate in path.parents:
        return root
  return None


def check_output(path: Path | str, *, program: str, ours: Callable[[Path], bool],
                 protected: Sequence[Path] = (), inputs: Sequence[Path] = (),
                 force: bool = False) -> Path:
  """Where ``program`` may write its file ``path``; raises `OutputError` otherwise.

  Args:
    path: the file the user named (or the program's default).
    program: the program's name, for the messages (``"report"``).
    ours: whether an existing file is one the program wrote (it may be replaced).
    protected: the run's records (`run_records`): never written, even with ``force``.
    inputs: what the program reads (`run_data`, the metrics file ...): never written either.
    force: replace an existing file the program did not write.

  Returns:
    The path to write (its folder resolved).

  Raises:
    OutputError: a directory, a missing folder, a record or input of the run, or (without
      ``force``) a file the program did not write.
  """
  given = Path(path)
  place = _place(given)
  if os.path.isdir(place) and not os.path.islink(place):
    raise OutputError(f"{given} is a directory: pass a file name for the {program}'s output")
  from stablejax.training.run_folder.record import trainer_folder_of
  record = _inside(place, protected)
  owner = trainer_folder_of(place)
  if record is not None or owner is not None:
    name = record.name if record is not None else owner[1] if owner is not None else ""
    raise OutputError(f"{given} is the run's own {name} (the trainer's record, never "
                      f"written by {program}, even with --force): pass another --out")
  source = _inside(place, inputs)
  if source is not None:
    raise OutputError(f"{given} is what {program} reads ({source}): pass another --out")
  if not place.parent.is_dir():
    raise OutputError(f"cannot write {given}: its folder {given.parent} does not exist; create "
                      "it or pass another --out")
  if not os.access(place.parent, os.W_OK):  # before the work, not after it
    read_only = bool(os.statvfs(place.parent).f_flag & os.ST_RDONLY)
    raise OutputError(f"cannot write {given}: "
                      f"{'the file system is read-only' if read_only else 'permission denied'}; "
                      "pass another --out (a folder you can write)")
  if os.path.lexists(place) and not os.path.islink(place) and not os.path.isfile(place):
    raise OutputError(f"{given} is not a regular file (a device, a pipe, a socket): {program} "
                      "replaces only files; pass another --out")
  if os.path.lexists(place) and not force:
    if os.path.islink(place):
      raise OutputError(f"{given} is a symbolic link, not a file {program} wrote: pass --force "
                        "to replace the link, or another --out")
    if not ours(place):
      raise OutputError(f"{given} exists and was not written by {program}: pass --force to "
                        "replace it, or another --out")
  return place


def write_output(path: Path, write: Callable[[Path], Any], *, program: str) -> None:
  """Calls ``write(temporary)`` for a new file beside ``path``, then renames it over ``path``
  (whole or not at all). An error of the environment is one `OutputError` line; the temporary
  file never stays."""
  path = Path(path)
  tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(3)}.tmp")
  try:
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)  # a name of its own
    os.close(fd)
    write(tmp)
    with open(tmp, "rb") as f:
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except OSError as e:
    _unlink(tmp)
    reason = _REASONS.get(e.errno or 0, e.strerror or str(e))
    fix = "free some space or pass another --out" if e.errno in (errno.ENOSPC, errno.EDQUOT) \
        else "pass another --out (a folder you can write)"
    raise OutputError(f"cannot write {path}: {reason}; {fix}") from None
  except BaseException:
    _unlink(tmp)
    raise


def _unlink(path: Path) -> None:
  try:
    path.unlink(missing_ok=True)
  except OSError:
    pass


# ----------------------------------------------------------------------------- own outputs

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_software(path: Path) -> Optional[str]:
  """The ``Software`` text of a PNG file (None: not a PNG, or it has none)."""
  try:
    with open(path, "rb") as f:
      if f.read(8) != PNG_SIGNATURE:
        return None
      while True:
        head = f.read(8)
        if len(head) < 8:
          return None
        length, kind = int.from_bytes(head[:4], "big"), head[4:]
        if kind in (b"IDAT", b"IEND") or length > 1 << 20:
          return None
        data = f.read(length)
        f.seek(4, os.SEEK_CUR)  # the chunk's CRC
        if kind == b"tEXt" and data.startswith(b"Software\0"):
          return data[len(b"Software\0"):].decode("latin-1")
  except OSError:
    return None


def json_program(path: Path) -> Optional[str]:
  """The ``"program"`` of a JSON object file (None: not one, or it names none)."""
  try:
    data = json.loads(Path(path).read_text())
  except (OSError, ValueError):
    return None
  return data.get("program") if isinstance(data, dict) else None
