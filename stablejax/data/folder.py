"""One writer per folder: an exclusive lock that a program holds on the folder it writes.

``python -m stablejax prepare --out DIR`` and ``python -m stablejax train --out DIR`` each take
the lock of DIR before they change anything in it, and hold it until they exit. The lock is
``fcntl.flock`` on ``DIR/.lock``: the operating system releases it when the process dies, however
it dies (SIGKILL, a crash, a lost node), so a crashed run never blocks the next one and no stale
lock has to be cleaned up by hand. A second writer gets `FolderBusy`, a one-line message naming
the holder (program, process id, host, start time, command line), which the lock file records.
On a shared filesystem the lock holds across machines where the filesystem supports ``flock``
(NFSv4, Lustre mounted with ``-o flock``, local disks).

`FolderLock.release` removes the lock file; a process that dies without releasing leaves it
behind, unlocked, and the next writer takes it over. That is safe because `FolderLock.acquire`
checks, once it holds the lock, that ``DIR/.lock`` is still the file it locked (a writer that
opened the file just before its holder removed it would otherwise hold a lock nobody else
sees), and tries again when it is not. A ``.lock`` that is not a lock file of this module (a
user's own file, a symbolic link) is never written to: `FolderBusy` says so.

Example:
  >>> import os, pathlib, tempfile
  >>> from stablejax.data.folder import FolderBusy, FolderLock
  >>> out = pathlib.Path(tempfile.mkdtemp())
  >>> first = FolderLock(out, "prepare").acquire()
  >>> try:
  ...   FolderLock(out, "prepare").acquire()
  ... except FolderBusy as e:
  ...   print("busy:", f"in use by prepare (process {os.getpid()}" in str(e))
  busy: True
  >>> first.release()
  >>> FolderLock(out, "train").acquire().release()  # free again
  >>> os.listdir(out)                              # and no lock file left behind
  []
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shlex
import socket
import sys
import time
from pathlib import Path
from typing import Any, Optional

LOCK_NAME = ".lock"
_HOLDER_KEYS = {"program", "pid", "host", "since", "command"}


class FolderBusy(Exception):
  """Another process holds the folder's lock, or its ``.lock`` is not a lock file (the message
  is one line naming it and what to do)."""


class FolderLock:
  """An exclusive, process-lifetime lock on ``folder`` (``folder/.lock``).

  Args:
    folder: the folder to lock; it must exist (creating it is the caller's decision).
    program: what the holder is, for the message a second writer gets (``"prepare"``).
  """

  def __init__(self, folder: Path | str, program: str) -> None:
    self.folder = Path(folder)
    self.program = program
    self.path = self.folder / LOCK_NAME
    self._fd: Optional[int] = None

  @property
  def held(self) -> bool:
    return self._fd is not None

  def acquire(self) -> "FolderLock":
    """Takes the lock or raises `FolderBusy` at once (never waits); returns self.

    Raises:
      FolderBusy: another process holds it, or ``folder/.lock`` is not a lock file.
      OSError: the folder cannot hold a lock file (missing, read-only, not a folder).
    """
    if self._fd is not None:
      return self
    for _ in range(100):  # another try each time its holder removed the file as it was opened
      try:  # O_NOFOLLOW: a symbolic link named .lock is never followed to a file elsewhere
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
      except OSError as e:
        if e.errno == errno.ELOOP:
          raise FolderBusy(f"{self.path} is a symbolic link, not a lock file: remove it, or "
                           f"write to another folder") from None
        raise
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except OSError as e:
        os.close(fd)
        if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
          raise
        raise FolderBusy(f"{self.folder} is in use by {self._holder()}: wait for it to finish, "
                         "or write to another folder") from None
      try:
        here, locked = os.lstat(self.path), os.fstat(fd)
        same = (here.st_ino, here.st_dev) == (locked.st_ino, locked.st_dev)
      except FileNotFoundError:
        same = False
      if not same:  # its holder removed it as we opened it: lock the file there now
        os.close(fd)
        continue
      content = os.pread(fd, 65536, 0)
      if content.strip() and not _is_holder_record(content):
        os.close(fd)
        raise FolderBusy(f"{self.path} is not a lock file of stablejax (a file of the same name "
                         f"is there): move it, or write to another folder")
      self._fd = fd
      break
    if self._fd is None:
      raise FolderBusy(f"{self.path} keeps being removed and created again by other processes: "
                       f"write to another folder")
    holder = {"program": self.program, "pid": os.getpid(), "host": socket.gethostname(),
              "since": time.strftime("%Y-%m-%d %H:%M:%S"),
              "command": _command_line()}
    os.ftruncate(self._fd, 0)
    os.pwrite(self._fd, (json.dumps(holder) + "\n").encode(), 0)
    return self

  def release(self) -> None:
    """Removes the lock file and gives the lock up (process exit gives it up too, leaving the
    file for the next writer to take over)."""
    if self._fd is not None:
      try:  # still holding the lock, so no other writer can be using this file
        os.unlink(self.path)
      except OSError:
        pass  # a read-only folder, or removed by hand: the lock goes with the descriptor
      os.close(self._fd)  # closing the descriptor releases the flock
      self._fd = None

  def _holder(self) -> str:
    try:
      info: Any = json.loads(self.path.read_text())
      return (f"{info['program']} (process {info['pid']} on {info['host']}, since "
              f"{info['since']}: {info['command']})")
    except (OSError, ValueError, KeyError, TypeError):
      return "another process"  # it has the lock but has not written its name yet

  def __enter__(self) -> "FolderLock":
    return self.acquire()

  def __exit__(self, *exc: object) -> None:
    self.release()


def _is_holder_record(content: bytes) -> bool:
  """Whether ``content`` is what `FolderLock.acquire` writes (a JSON object naming a holder)."""
  try:
    info = json.loads(content)
  except ValueError:
    return False
  return isinstance(info, dict) and _HOLDER_KEYS <= set(info)


def _command_line() -> str:
  """This process's command line as it was typed (``python -m stablejax prepare ...``), on one
  line and at most 300 characters, for the one-line message a second writer gets."""
  argv = list(getattr(sys, "orig_argv", None) or sys.argv)
  line = shlex.join([Path(argv[0]).name, *argv[1:]]).replace("\n", "\\n")
  return line if len(line) <= 300 else line[:297] + "..."
