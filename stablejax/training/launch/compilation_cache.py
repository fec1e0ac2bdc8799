"""The persistent compilation cache: a program's XLA executables compiled once per machine.

Every start of a program compiles its steps; a resume after preemption, a relaunch by a
scheduler, a ``sample`` or ``report`` of a run would otherwise pay the whole compilation again.
JAX's persistent compilation cache keeps each compiled executable on disk, keyed by the program,
the JAX and XLA versions, the compile options and the devices, and a later start loads it
instead of compiling. stablejax turns it on for every program it runs (``train``, the processes
of ``launch``, ``sample``, ``quantize-eval``), in one folder per user:

1. ``--no-compilation-cache`` (or the value ``off`` below): off;
2. ``train.compilation_cache`` (``train``'s config): a folder, or ``off``;
3. ``$STABLEJAX_COMPILATION_CACHE``: a folder, or ``off``;
4. ``$JAX_COMPILATION_CACHE_DIR``, JAX's own variable, when set: left to JAX;
5. the platform's cache folder: ``$XDG_CACHE_HOME/stablejax/xla`` (``~/.cache/stablejax/xla``) on
   Linux, ``~/Library/Caches/stablejax/xla`` on macOS, ``%LOCALAPPDATA%\\stablejax\\xla`` on
   Windows.

In a job of several CPU processes the trainer turns the platform's folder (5.) off
(:func:`turn_off_for_multiprocess_cpu`): only process 0 could load from it there.

Never inside a run or data folder unless named there. Processes share it safely: JAX writes an
entry from process 0 only, and here through a temporary file renamed into place, so a reader
meets a whole entry or none (JAX's own write is not atomic: a writer killed mid-way would leave a
damaged entry for good). A folder that cannot be created or written (a read-only disk) turns the
cache off with one line; an entry that cannot be read (damaged by hand, or by another tool) is
said in one line and compiled instead. Nothing about it ever stops a program. Entries are
compressed with zstd (JAX's choice when ``zstandard``, a dependency of the ``train`` extra, is
installed; zlib, several times slower to write, otherwise).
"""

from __future__ import annotations

import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Callable, Optional

ENV = "STABLEJAX_COMPILATION_CACHE"
JAX_ENV = "JAX_COMPILATION_CACHE_DIR"
OFF = "off"
DEFAULT_SOURCE = "the user's cache folder"  # what choose() says of the platform's folder
# Every program is kept, however fast it compiled (JAX's default keeps those over 1 s): a start's
# small programs (the schedules, the stability metrics, the data's staging, the seed) compile in
# 0.02-0.1 s each, together about 0.4 s of a warm start, and load in milliseconds.
MIN_COMPILE_SECONDS = 0.0


def default_folder() -> Path:
  """The per-user cache folder of this platform."""
  home = Path.home()
  if sys.platform == "darwin":
    return home / "Library" / "Caches" / "stablejax" / "xla"
  if os.name == "nt":
    base = os.environ.get("LOCALAPPDATA") or str(home / "AppData" / "Local")
    return Path(base) / "stablejax" / "xla"
  base = os.environ.get("XDG_CACHE_HOME") or str(home / ".cache")
  return Path(base) / "stablejax" / "xla"


def choose(setting: Optional[str] = None, disabled: bool = False) -> tuple[Optional[Path], str]:
  """The folder to use (None: off, or left to ``$JAX_COMPILATION_CACHE_DIR``) and where the
  choice came from, by the order of this module's docstring.

  Example:
    >>> from stablejax.training.launch.compilation_cache import choose
    >>> choose("off")
    (None, 'train.compilation_cache')
    >>> choose("/tmp/xla-cache")
    (PosixPath('/tmp/xla-cache'), 'train.compilation_cache')
  """
  if disabled:
    return None, "--no-compilation-cache"
  for value, source in ((setting, "train.compilation_cache"), (os.environ.get(ENV), f"${ENV}")):
    if value is not None and value.strip():
      return (None, source) if value.strip().lower() == OFF else (Path(value).expanduser(),
                                                                  source)
  if os.environ.get(JAX_ENV):
    return None, f"${JAX_ENV}"
  return default_folder(), DEFAULT_SOURCE


def _usable(folder: Path) -> Optional[str]:
  """Why ``folder`` cannot hold the cache, or None when it can (created, and a file written)."""
  try:
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=folder, prefix=".probe-"):
      pass
  except OSError as e:
    return f"{type(e).__name__}: {e.strerror or e}"
  return None


def enable(setting: Optional[str] = None, disabled: bool = False,
           say: Callable[[str], None] = print) -> Optional[Path]:
  """Turns JAX's persistent compilation cache on for this process (before anything compiles);
  returns its folder, or None when it is off or left to ``$JAX_COMPILATION_CACHE_DIR``.

  Args:
    setting: ``train.compilation_cache`` (a folder, ``"off"``, or None for the default).
    disabled: ``--no-compilation-cache``.
    say: where the one line goes when the cache is turned off by a problem.
  """
  import jax
  folder, source = choose(setting, disabled)
  _one_line_cache_warnings(say)
  if folder is None:
    if source != f"${JAX_ENV}":
      jax.config.update("jax_enable_compilation_cache", False)
    return None
  problem = _usable(folder)
  if problem is not None:
    say(f"warning: compilation cache off: {folder} ({source}) cannot be used ({problem}); every "
        f"start compiles (set {ENV} to another folder, or 'off')")
    jax.config.update("jax_enable_compilation_cache", False)
    return None
  _atomic_writes()
  global _use, _chosen_by
  if _use is None:
    _use = CacheUse(folder)
  _chosen_by = source
  jax.config.update("jax_enable_compilation_cache", True)
  jax.config.update("jax_compilation_cache_dir", str(folder))
  if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:  # JAX's own, when given
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
  return folder


_SAID: set[str] = set()


def _atomic_writes() -> None:
  """JAX's file cache (``jax._src.lru_cache.LRUCache``) writes an entry in place; without its
  size limit (the default) nothing locks it. Here an entry goes to a temporary file in the same
  folder, then is renamed into place (atomic on POSIX and Windows)."""
  from jax._src import lru_cache
  cls = lru_cache.LRUCache
  if getattr(cls.put, "_stablejax_atomic", False):
    return
  original = cls.put

  def put(self: lru_cache.LRUCache, key: str, value: bytes) -> None:
    if self.eviction_enabled or not key or "://" in str(self.path):  # locked, or remote
      return original(self, key, value)
    path = Path(str(self.path)) / f"{key}{lru_cache._CACHE_SUFFIX}"
    if path.exists():
      return None
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
      tmp.write_bytes(value)
      os.replace(tmp, path)
    finally:
      tmp.unlink(missing_ok=True)
    return None
  put._stablejax_atomic = True  # type: ignore[attr-defined]
  cls.put = put  # type: ignore[method-assign]


def _one_line_cache_warnings(say: Callable[[str], None]) -> None:
  """JAX reports an entry it cannot read or write as a warning with a traceback-like text; a
  program says it once, in one line, and goes on (JAX compiles instead)."""
  previous = warnings.showwarning

  def show(message, category, filename, lineno, file=None, line=None):  # type: ignore[no-untyped-def]
    text = str(message)
    for kind in ("reading", "writing"):
      if text.startswith(f"Error {kind} persistent compilation cache entry"):
        if kind not in _SAID:
          _SAID.add(kind)
          detail = text.split(": ", 1)[-1].splitlines()[0][:200]
          verb = "read" if kind == "reading" else "written"
          say(f"warning: a compilation cache entry could not be {verb} ({detail}); compiling "
              "instead")
        return
    previous(message, category, filename, lineno, file, line)

  if getattr(warnings.showwarning, "__name__", "") != "show":
    warnings.showwarning = show


class CacheUse:
  """Counts the programs this process asked the cache for and those it found there (JAX's
  monitoring events)."""

  def __init__(self, folder: Path) -> None:
    import jax
    self.folder, self.hits, self.requests = folder, 0, 0

    def count(event: str, **kwargs: object) -> None:
      if event == "/jax/compilation_cache/cache_hits":
        self.hits += 1
      elif event == "/jax/compilation_cache/compile_requests_use_cache":
        self.requests += 1
    jax.monitoring.register_event_listener(count)


_use: Optional[CacheUse] = None
_chosen_by: Optional[str] = None  # where enable()'s folder came from


def multiprocess_cpu_reason(chosen_by: Optional[str], process_count: int,
                            platform: str) -> Optional[str]:
  """Why the cache is off for a job (the one line), or None when it stays as chosen.

  On CPU, JAX keys each process's programs by that process's own view of the devices, and it
  writes entries from process 0 only: in a job of several CPU processes only process 0 ever
  loads, and it reaches the first collective while the others still compile, past gloo's 30 s
  wait for the other processes (a relaunch failed so). A folder the user named is kept.

  Example:
    >>> multiprocess_cpu_reason(DEFAULT_SOURCE, 1, "cpu") is None
    True
    >>> multiprocess_cpu_reason("train.compilation_cache", 2, "cpu") is None  # named: kept
    True
  """
  if chosen_by != DEFAULT_SOURCE or process_count < 2 or platform != "cpu":
    return None
  return (f"compilation cache off: in a job of {process_count} CPU processes only process 0 "
          f"could load from it (JAX keys each process's programs by its own devices and writes "
          f"from process 0 only), and it would wait at the first collective for the others' "
          f"compilation; set train.compilation_cache or ${ENV} to keep one")


def turn_off_for_multiprocess_cpu(process_count: int, platform: str,
                                  say: Callable[[str], None] = print) -> bool:
  """Turns the cache :func:`enable` chose off for a job of several CPU processes (see
  :func:`multiprocess_cpu_reason`); call it before anything compiles. True when it did."""
  global _use
  reason = multiprocess_cpu_reason(_chosen_by if _use is not None else None, process_count,
                                   platform)
  if reason is None:
    return False
  import jax
  jax.config.update("jax_enable_compilation_cache", False)
  _use = None  # the banner says nothing about a cache this process does not use
  say(reason)
  return True


def summary() -> Optional[str]:
  """``"3 programs loaded from the compilation cache (folder), 1 compiled"`` for this process
  so far; None when the cache is off here."""
  if _use is None:
    return None
  return (f"{_use.hits} program{'s' if _use.hits != 1 else ''} loaded from the compilation "
          f"cache ({_use.folder}), {_use.requests - _use.hits} compiled")
