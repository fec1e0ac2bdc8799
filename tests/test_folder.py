"""One writer per folder: the lock of stablejax.data.folder between real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from stablejax.data.folder import LOCK_NAME, FolderBusy, FolderLock

HOLD = textwrap.dedent("""
    import sys, time
    from stablejax.data.folder import FolderLock
    FolderLock(sys.argv[1], "prepare").acquire()
    print("locked", flush=True)
    time.sleep(120)
""")


def _holder(folder):
  proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE,
                          text=True)
  assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
  return proc


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
