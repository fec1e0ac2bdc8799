"""A path the user gave, checked once before anything uses it.

Every path a program takes from its user (``--out``, a run directory, ``data.train``, a plugin's
``.py`` file, prepare's inputs) goes through :func:`checked_path` first, so the few ways a path
can be unusable whatever the program does with it are one line, named the same way everywhere,
instead of an ``OSError`` or a ``RuntimeError`` from deep inside: an empty path (which
``pathlib`` reads as the current folder: ``--out ""`` would write there), a NUL character, a
loop of symbolic links, a name longer than its file system takes (255 bytes on most), or a whole
path longer than the system takes (4096 bytes on Linux). What a program expects at the path (a
folder, a file, its own records) it checks itself.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Optional, Union

# Where the file system does not say (os.pathconf): Linux's limits.
NAME_MAX, PATH_MAX = 255, 4096


class PathError(ValueError):
  """A path no program can use as given; one line naming it and the fix."""


def checked_path(given: Union[str, os.PathLike], what: Optional[str] = None) -> Path:
  """``given`` as a ``Path``, once it is a path that can be used.

  Args:
    given: the path as the user gave it (a string: ``""`` is refused, where ``Path("")`` would
      be the current folder).
    what: where it was given, put before the message (``"--out"``, ``"data.train"``); None: the
      message alone (an ``argparse`` type, which names the argument itself).

  Returns:
    ``Path(given)``.

  Raises:
    PathError: ``given`` is empty or holds a NUL character, leads through a loop of symbolic
      links, or has a name or is as a whole longer than the file system takes.

  Example:
    >>> import os, tempfile
    >>> from stablejax.data.paths import PathError, checked_path
    >>> folder = tempfile.mkdtemp()
    >>> checked_path(os.path.join(folder, "run")).name  # need not exist
    'run'
    >>> os.symlink("b", os.path.join(folder, "a")); os.symlink("a", os.path.join(folder, "b"))
    >>> for bad in ("", os.path.join(folder, "a", "run"), "x" * 300):
    ...   try:
    ...     checked_path(bad, "--out")
    ...   except PathError as e:
    ...     print(e)
    --out: the path is empty, which names no file or folder: give one
    --out: /tmp/.../a/run leads through a loop of symbolic links (/tmp/.../a): fix or remove the
    link, or give another path
    --out: the name xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx... is 300 bytes long, more than the
    255 the file system takes: choose a shorter name
  """
  def refused(problem: str) -> PathError:
    return PathError(f"{what}: {problem}" if what else problem)

  text = os.fspath(given)
  if isinstance(text, bytes):
    text = os.fsdecode(text)
  if text == "":
    raise refused("the path is empty, which names no file or folder: give one")
  if "\0" in text:
    raise refused(f"{_short(text)} holds a NUL character, which no file name can: remove it")
  path = Path(os.path.expanduser(text))
  loop = _loop_in(path)
  if loop is not None:
    raise refused(f"{_short(text)} leads through a loop of symbolic links ({_short(str(loop))}): "
                  "fix or remove the link, or give another path")
  name_max, path_max = _limits(path)
  for part in path.parts:
    size = len(os.fsencode(part))
    if size > name_max:
      raise refused(f"the name {_short(part)} is {size} bytes long, more than the {name_max} "
                    "the file system takes: choose a shorter name")
  size = len(os.fsencode(os.path.abspath(path)))
  if size >= path_max:
    raise refused(f"{_short(text)} is {size} bytes long as a full path, more than the "
                  f"{path_max - 1} the system takes: choose a shorter path")
  return Path(text)


def _loop_in(path: Path) -> Optional[Path]:
  """The first part of ``path`` whose symbolic links lead in a circle, or None."""
  try:
    os.stat(path)
    return None
  except OSError as e:
    if e.errno != errno.ELOOP:
      return None  # missing, not a folder, not allowed...: what the program says about it
  parts = path.parts
  for i in range(1, len(parts) + 1):
    try:
      os.stat(Path(*parts[:i]))
    except OSError as e:
      if e.errno == errno.ELOOP:
        return Path(*parts[:i])
  return path


def _limits(path: Path) -> tuple[int, int]:
  """The longest name and path the file system holding ``path`` (its nearest existing folder)
  takes."""
  folder = Path(os.path.abspath(path))
  while not os.path.isdir(folder) and folder != folder.parent:
    folder = folder.parent
  limits = []
  for name, default in (("PC_NAME_MAX", NAME_MAX), ("PC_PATH_MAX", PATH_MAX)):
    try:
      limits.append(os.pathconf(folder, name))
    except (OSError, ValueError, AttributeError):
      limits.append(default)
  return limits[0], limits[1]


def _short(text: str, keep: int = 40) -> str:
  """``text`` for a one-line message: a long one cut to its first ``keep`` characters."""
  return text if len(text) <= keep else text[:keep] + "..."
