"""Errors of the environment, in one line each: a full disk, a read-only file system, no
permission, the device's memory.

The trainer meets them in its own writes and in those of Orbax and tensorstore, which wrap the
operating system's error in their own (a ValueError "RESOURCE_EXHAUSTED: ... No space left on
device"): `is_environment_error` and `environment_message` look through the whole chain of an
exception, and at log messages, for the error's words or its errno. ``python -m stablejax train``
turns them into one line and exit code 2 (the last complete checkpoint resumes the run).

Example:
  >>> import errno, os, pathlib
  >>> from stablejax.training.run_folder.environment_errors import environment_message
  >>> full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
  >>> wrapped = ValueError("RESOURCE_EXHAUSTED: writing the checkpoint")
  >>> wrapped.__cause__ = full
  >>> print(environment_message(wrapped, pathlib.Path("exp")))
  cannot write into the run directory exp: the disk is full; free space or choose another --out
  (the last complete checkpoint resumes the run)
  >>> environment_message(KeyError("model"), pathlib.Path("exp")) is None
  True
"""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Optional

# The operating system's errors, as the one-line messages name them.
REASONS = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded",
           errno.EROFS: "the file system is read-only", errno.EACCES: "permission denied",
           errno.EPERM: "permission denied", errno.ENOTDIR: "a file is in the way",
           errno.EEXIST: "a file is in the way",
           errno.EXDEV: "it is on another file system (a mount point)",
           errno.EBUSY: "it is in use (a mount point)"}

_DISK_FULL = (("No space left on device", "Disk quota exceeded"), (errno.ENOSPC, errno.EDQUOT))
_READ_ONLY = (("Read-only file system",), (errno.EROFS,))


def reason(e: OSError) -> str:
  """What went wrong, in words (``the disk is full``)."""
  return REASONS.get(e.errno or 0, e.strerror or str(e))


def environment_error(e: OSError, path: Path, what: str) -> str:
  """One line for an error of the environment (disk full, read-only, a file in the way)."""
  where = e.filename or path
  fix = {errno.ENOSPC: "free space or choose another --out",
         errno.EDQUOT: "free space or choose another --out"}.get(e.errno or 0,
                                                                 "choose another --out")
  return f"cannot write {what} {where}: {reason(e)}; {fix}"


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
