"""One writer per folder: an exclusive lock that a program holds on the folder it writes.

``python -m stablejax prepare --out DIR`` and ``python -m stablejax train --out DIR`` each take
the lock of DIR before they change anything in it, and hold it until they exit. The lock is
``fcntl.flock`` on ``DIR/.lock``: the operating system releases it when the process dies, however
it dies (SIGKILL, a crash, a lost node), so a crashed run never blocks the next one and no stale
lock has to be cleaned up by hand. A second writer gets `FolderBusy`, a one-line message naming
the holder (program, process id, host, start time, command line), which the lock file records.

The lock file stays in the folder (removing it on exit would let two later writers lock two
different files); it is this program's own file, never data.

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


class FolderBusy(Exception):
  """Another process holds the folder's lock (the message names it and what to do)."""


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
      FolderBusy: another process holds it.
      OSError: the folder cannot hold a lock file (missing, read-only, not a folder).
    """
    if self._fd is not None:
      return self
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      os.close(fd)
      if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
        raise
      raise FolderBusy(f"{self.folder} is in use by {self._holder()}: wait for it to finish, or "
                       "write to another folder") from None
    self._fd = fd
    holder = {"program": self.program, "pid": os.getpid(), "host": socket.gethostname(),
              "since": time.strftime("%Y-%m-%d %H:%M:%S"),
              "command": shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]])}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
    return self

  def release(self) -> None:
    """Gives the lock up (process exit does the same)."""
    if self._fd is not None:
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
