"""One writer per folder: the lock of stablejax.data.folder between real processes."""

from __future__ import annotations

import os
import signal

import pytest

from helpers import lock_holder
from stablejax.data.folder import LOCK_NAME, FolderBusy, FolderLock


def _holder(folder):
  return lock_holder(folder, "prepare")


def test_a_second_writer_is_refused_with_the_holder_named(tmp_path):
  proc = _holder(tmp_path)
  try:
    with pytest.raises(FolderBusy) as e:
      FolderLock(tmp_path, "train").acquire()
    message = str(e.value)
    assert "\n" not in message
    assert f"in use by prepare (process {proc.pid} on " in message
    assert "write to another folder" in message
  finally:
    proc.kill()
    proc.wait(timeout=30)


def test_the_lock_dies_with_its_holder_even_on_sigkill(tmp_path):
  proc = _holder(tmp_path)
  os.kill(proc.pid, signal.SIGKILL)
  proc.wait(timeout=30)
  lock = FolderLock(tmp_path, "train").acquire()  # no stale lock to clean up by hand
  assert lock.held and (tmp_path / LOCK_NAME).is_file()
  lock.release()


def test_release_and_reacquire_in_one_process(tmp_path):
  with FolderLock(tmp_path, "train") as lock:
    assert lock.held
    with pytest.raises(FolderBusy):
      FolderLock(tmp_path, "train").acquire()
  assert not lock.held
  FolderLock(tmp_path, "train").acquire().release()


def test_a_missing_folder_is_an_os_error_not_a_busy_folder(tmp_path):
  with pytest.raises(FileNotFoundError):
    FolderLock(tmp_path / "missing", "train").acquire()


def test_release_removes_the_lock_file_and_a_stale_one_is_taken_over(tmp_path):
  lock = FolderLock(tmp_path, "prepare").acquire()
  assert (tmp_path / LOCK_NAME).is_file()
  lock.release()
  assert list(tmp_path.iterdir()) == []
  proc = _holder(tmp_path)  # killed: its lock file stays, unlocked
  os.kill(proc.pid, signal.SIGKILL)
  proc.wait(timeout=30)
  assert (tmp_path / LOCK_NAME).is_file()
  FolderLock(tmp_path, "train").acquire().release()
  assert list(tmp_path.iterdir()) == []


def test_a_lock_file_removed_by_its_holder_while_being_taken_is_not_held(tmp_path, monkeypatch):
  """The race release() opens: B opens .lock, A releases (removes it), B's flock then succeeds
  on a file no longer in the folder. B must notice and lock the file that is there."""
  import fcntl
  from stablejax.data import folder
  first = FolderLock(tmp_path, "prepare").acquire()
  real_flock = fcntl.flock
  calls = []

  def flock_after_the_holder_left(fd, operation):
    if not calls:
      first.release()  # between B's open and B's flock
    calls.append(fd)
    return real_flock(fd, operation)

  # (a file system that cannot lock the folder itself, e.g. NFS: the lock file alone)
  monkeypatch.setattr(FolderLock, "_lock_folder", lambda self: None)
  monkeypatch.setattr(folder.fcntl, "flock", flock_after_the_holder_left)
  second = FolderLock(tmp_path, "train").acquire()
  assert len(calls) == 2  # it tried again
  monkeypatch.undo()
  assert os.fstat(second._fd).st_ino == os.stat(tmp_path / LOCK_NAME).st_ino
  monkeypatch.setattr(FolderLock, "_lock_folder", lambda self: None)
  with pytest.raises(FolderBusy):  # and a third writer sees it held
    FolderLock(tmp_path, "prepare").acquire()
  second.release()


def test_a_lock_file_that_is_not_one_is_never_written(tmp_path):
  (tmp_path / LOCK_NAME).write_text("my own notes\n")
  with pytest.raises(FolderBusy, match="is not a lock file of stablejax"):
    FolderLock(tmp_path, "prepare").acquire()
  assert (tmp_path / LOCK_NAME).read_text() == "my own notes\n"
  other = tmp_path / "other"
  other.mkdir()
  target = tmp_path / "target.txt"
  target.write_text("keep")
  os.symlink(target, other / LOCK_NAME)
  with pytest.raises(FolderBusy, match="symbolic link"):
    FolderLock(other, "prepare").acquire()
  assert target.read_text() == "keep"


# ----------------------------------------------------------------------------- a removed .lock


def test_a_lock_file_removed_by_hand_frees_nothing(tmp_path):
  """A "stale lock" clean-up under a live holder: the next writer is still refused, named by its
  process id, and the holder puts its .lock back at its next write."""
  proc = _holder(tmp_path)
  try:
    (tmp_path / LOCK_NAME).unlink()
    with pytest.raises(FolderBusy) as e:
      FolderLock(tmp_path, "train").acquire()
    assert f"in use by process {proc.pid} (" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / LOCK_NAME).exists()  # the refused writer created nothing
  finally:
    proc.kill()
    proc.wait(timeout=30)
  FolderLock(tmp_path, "train").acquire().release()  # free once the holder is gone


def test_the_holder_puts_a_removed_lock_file_back(tmp_path):
  lock = FolderLock(tmp_path, "train").acquire()
  assert lock.rests_on_folder
  (tmp_path / LOCK_NAME).unlink()
  lock.verify()
  assert '"program": "train"' in (tmp_path / LOCK_NAME).read_text()
  with pytest.raises(FolderBusy, match="in use by train"):
    FolderLock(tmp_path, "prepare").acquire()
  lock.release()
  assert list(tmp_path.iterdir()) == []


def test_on_a_file_system_without_folder_locks_verify_notices_another_writer(tmp_path,
                                                                            monkeypatch):
  monkeypatch.setattr(FolderLock, "_lock_folder", lambda self: None)
  first = FolderLock(tmp_path, "train").acquire()
  assert not first.rests_on_folder
  (tmp_path / LOCK_NAME).unlink()
  first.verify()  # nobody else came: it locks the new file
  with pytest.raises(FolderBusy):
    FolderLock(tmp_path, "train").acquire()
  (tmp_path / LOCK_NAME).unlink()
  second = FolderLock(tmp_path, "prepare").acquire()  # came in after the second deletion
  with pytest.raises(FolderBusy, match="was removed while this train held it, and another "
                                       "process took the folder"):
    first.verify()
  second.release()
  first.release()


def test_a_lock_whose_holder_cannot_be_written_leaves_nothing(tmp_path, monkeypatch):
  """A full disk at the lock's first write: an OSError, and no empty .lock left behind."""
  import errno
  from stablejax.data import folder

  def full(fd, data, offset):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
  monkeypatch.setattr(folder.os, "pwrite", full)
  with pytest.raises(OSError, match="No space left"):
    FolderLock(tmp_path, "train").acquire()
  monkeypatch.undo()
  assert list(tmp_path.iterdir()) == []
  FolderLock(tmp_path, "train").acquire().release()


def test_a_folder_replaced_under_its_holder_stops_it(tmp_path):
  folder = tmp_path / "run"
  folder.mkdir()
  lock = FolderLock(folder, "train").acquire()
  folder.rename(tmp_path / "moved")
  folder.mkdir()  # a folder of the same name, which nobody locked
  with pytest.raises(FolderBusy, match="was removed or replaced"):
    lock.verify()
  lock.release()
