"""One writer per folder: an exclusive lock that a program holds on the folder it writes.

``python -m stablejax prepare --out DIR`` and ``python -m stablejax train --out DIR`` each take
the lock of DIR before they change anything in it, and hold it until they exit. The lock is
``fcntl.flock`` on DIR itself, and on ``DIR/.lock``, the file that names the holder: the operating
system releases both when the process dies, however it dies (SIGKILL, a crash, a lost node), so a
crashed run never blocks the next one and no stale lock has to be cleaned up by hand. A second
writer gets `FolderBusy`, a one-line message naming the holder (program, process id, host, start
time, command line), which the lock file records.

The lock rests on the folder, which cannot be removed under its holder: a ``.lock`` deleted by
hand (a "stale lock" clean-up) frees nothing, the next writer is still refused (named from
``/proc/locks``), and `FolderLock.verify`, which the trainer calls before each write of its
record, puts the holder's ``.lock`` back. Where the file system cannot lock a folder (NFS
emulates ``flock`` with byte-range locks, which need a file opened for writing), the lock rests
on ``DIR/.lock`` alone (NFSv4, Lustre mounted with ``-o flock``): `FolderLock.verify` then takes
the lock of a ``.lock`` created again after a deletion, and raises `FolderBusy` when another
writer got there first. It also raises when DIR itself was removed or replaced.

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

import contextlib
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
_BUSY = (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK)
# What flock says on a file system that cannot lock a folder (NFS: a file opened for writing only).
_NO_FOLDER_LOCK = (errno.EBADF, errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS)


class FolderBusy(Exception):
  """Another process holds the folder's lock, or its ``.lock`` is not a lock file (the message
  is one line naming it and what to do)."""


class FolderLock:
  """An exclusive, process-lifetime lock on ``folder`` (the folder itself and ``folder/.lock``).

  Args:
    folder: the folder to lock; it must exist (creating it is the caller's decision).
    program: what the holder is, for the message a second writer gets (``"prepare"``).
  """

  def __init__(self, folder: Path | str, program: str) -> None:
    self.folder = Path(folder)
    self.program = program
    self.path = self.folder / LOCK_NAME
    self._fd: Optional[int] = None       # DIR/.lock, locked
    self._dir_fd: Optional[int] = None   # DIR, locked (None where the file system cannot)

  @property
  def held(self) -> bool:
    return self._fd is not None

  @property
  def rests_on_folder(self) -> bool:
    """Whether the folder itself is locked (False: the lock file alone, e.g. on NFS)."""
    return self._dir_fd is not None

  def acquire(self) -> "FolderLock":
    """Takes the lock or raises `FolderBusy` at once (never waits); returns self.

    Raises:
      FolderBusy: another process holds it, or ``folder/.lock`` is not a lock file.
      OSError: the folder cannot hold a lock file (missing, read-only, full, not a folder).
    """
    if self._fd is not None:
      return self
    dir_fd = self._lock_folder()
    try:
      self._fd = self._lock_file()
      self._write_holder()
    except BaseException:
      if self._fd is not None:  # locked, but its holder could not be written (a full disk)
        self._unlink_own_file()
        os.close(self._fd)
        self._fd = None
      if dir_fd is not None:
        os.close(dir_fd)
      raise
    self._dir_fd = dir_fd
    return self

  def _lock_folder(self) -> Optional[int]:
    """Locks the folder itself; None where its file system cannot lock a folder."""
    fd = os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      os.close(fd)
      if e.errno in _BUSY:
        raise FolderBusy(self._busy_message()) from None
      if e.errno in _NO_FOLDER_LOCK:
        return None
      raise
    return fd

  def _lock_file(self) -> int:
    """Opens and locks ``.lock``; returns its descriptor."""
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
        if e.errno not in _BUSY:
          raise
        raise FolderBusy(self._busy_message()) from None
      if not self._is_there(fd):  # its holder removed it as we opened it: lock the file there now
        os.close(fd)
        continue
      content = os.pread(fd, 65536, 0)
      if content.strip() and not _is_holder_record(content):
        os.close(fd)
        raise FolderBusy(f"{self.path} is not a lock file of stablejax (a file of the same name "
                         f"is there): move it, or write to another folder")
      return fd
    raise FolderBusy(f"{self.path} keeps being removed and created again by other processes: "
                     f"write to another folder")

  def _is_there(self, fd: int) -> bool:
    """Whether ``.lock`` in the folder is the file open as ``fd``."""
    try:
      here, locked = os.lstat(self.path), os.fstat(fd)
    except FileNotFoundError:
      return False
    return (here.st_ino, here.st_dev) == (locked.st_ino, locked.st_dev)

  def _write_holder(self) -> None:
    assert self._fd is not None
    holder = {"program": self.program, "pid": os.getpid(), "host": socket.gethostname(),
              "since": time.strftime("%Y-%m-%d %H:%M:%S"),
              "command": _command_line()}
    os.ftruncate(self._fd, 0)
    os.pwrite(self._fd, (json.dumps(holder) + "\n").encode(), 0)

  def verify(self) -> None:
    """Before a write: the folder is still this process's. A ``.lock`` removed by hand is put
    back (the lock of the folder still holds); where the lock rests on the file alone, the new
    file is locked, or `FolderBusy` is raised when another writer holds it.

    Raises:
      FolderBusy: the folder was removed or replaced (another folder of the same name is not
        locked), or the lock rested on ``.lock`` alone, it was removed, and another process
        locked the file created in its place.
    """
    if self._fd is None:
      return
    if self._dir_fd is not None:
      try:
        here, locked = os.stat(self.folder), os.fstat(self._dir_fd)
        same = (here.st_ino, here.st_dev) == (locked.st_ino, locked.st_dev)
      except OSError:
        same = False
      if not same:
        raise FolderBusy(f"{self.folder} was removed or replaced while this {self.program} held "
                         f"its lock (the folder there now is another one): this {self.program} "
                         "stops")
    if self._is_there(self._fd):
      return
    old = self._fd
    try:
      if self._dir_fd is not None:
        if not os.path.lexists(self.path):  # no other writer can be in the folder: name it again
          with contextlib.suppress(OSError, FolderBusy):
            self._fd = self._lock_file()
            self._write_holder()
        return
      self._fd = None
      try:
        self._fd = self._lock_file()
      except FolderBusy as e:
        raise FolderBusy(f"{self.folder}: its {LOCK_NAME} was removed while this {self.program} "
                         f"held it, and another process took the folder ({e}): this "
                         f"{self.program} stops") from None
      self._write_holder()
    finally:
      if self._fd != old:
        os.close(old)

  def release(self) -> None:
    """Removes the lock file and gives the lock up (process exit gives it up too, leaving the
    file for the next writer to take over)."""
    if self._fd is not None:
      self._unlink_own_file()  # still holding the lock, so no other writer is using this file
      os.close(self._fd)  # closing the descriptor releases the flock
      self._fd = None
    if self._dir_fd is not None:
      os.close(self._dir_fd)
      self._dir_fd = None

  def _unlink_own_file(self) -> None:
    assert self._fd is not None
    if self._is_there(self._fd):  # never a .lock someone else put there since
      try:
        os.unlink(self.path)
      except OSError:
        pass  # a read-only folder: the lock goes with the descriptor

  def _busy_message(self) -> str:
    return (f"{self.folder} is in use by {self._holder()}: wait for it to finish, or write to "
            f"another folder")

  def _holder(self) -> str:
    try:
      info: Any = json.loads(self.path.read_text())
      return (f"{info['program']} (process {info['pid']} on {info['host']}, since "
              f"{info['since']}: {info['command']})")
    except (OSError, ValueError, KeyError, TypeError):
      pass
    pid = _folder_lock_holder(self.folder)  # its .lock removed by hand, or not written yet
    if pid is None:
      return "another process"
    return f"process {pid} ({_process_command(pid)}; its {LOCK_NAME} was removed)"

  def __enter__(self) -> "FolderLock":
    return self.acquire()

  def __exit__(self, *exc: object) -> None:
    self.release()


def _folder_lock_holder(folder: Path) -> Optional[int]:
  """The process holding a ``flock`` on ``folder``, from ``/proc/locks`` (Linux); None when it
  cannot be told."""
  try:
    st = os.stat(folder)
    wanted = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    with open("/proc/locks") as f:
      for line in f:
        fields = line.split()
        if len(fields) > 5 and fields[1] == "FLOCK" and fields[5] == wanted:
          return int(fields[4])
  except (OSError, ValueError):
    pass
  return None


def _process_command(pid: int) -> str:
  try:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
      argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
  except OSError:
    return "its command line is not readable"
  line = shlex.join([Path(argv[0]).name, *argv[1:]]).replace("\n", "\\n") if argv else "?"
  return line if len(line) <= 300 else line[:297] + "..."


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
