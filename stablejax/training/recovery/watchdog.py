"""The progress watchdog: a run that stops making progress ends, with every thread's stack.

A hung collective, a stuck input pipeline or a device that stopped answering blocks the
trainer's main thread where it waits (a fetch of the metrics, a ``next`` on the data), and no
signal handler runs there: the job hangs until someone notices, and SIGTERM then waits for a
checkpoint that cannot come. The watchdog is a thread that the step loop feeds at every step
(:meth:`Watchdog.beat`, Levanter's progress watchdog does the same). When no beat comes within
the timeout, it writes every thread's Python stack to ``hang_stacks/process_<i>.txt`` in the run
directory (``faulthandler``, which needs neither the stuck thread nor the GIL holder), logs a
``watchdog`` event, and exits the process with code 18 (:data:`EXIT_HUNG`); the launcher treats
that like any failed process. A stop signal that the run has not acted on within
``grace_seconds`` ends it the same way with code 130: the stacks are written, nothing is saved,
and a save that was in flight leaves only Orbax's temporary folder, which the next start removes.

The timeout (``stability.watchdog``): ``timeout_seconds`` when set; else ``factor`` times the
measured time of a logging interval (``train.log_every`` steps, the longest of the recent ones),
at least ``floor_seconds``. Before the first interval is measured (restore, the first
compilation, the time budget's probe) it is ``startup_seconds``. A compilation in progress in the
main thread is never a hang, however long it takes: the watchdog reads the main thread's stack.
"""

from __future__ import annotations

import collections
import faulthandler
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import jax

EXIT_HUNG = 18

# Frames of JAX's compiler in the main thread's stack: a compilation, not a hang.
_COMPILER_FILES = ("jax/_src/compiler.py",)
_COMPILER_FUNCTIONS = frozenset({"_cached_compilation", "compile_or_get_cached",
                                 "backend_compile_and_load", "backend_compile"})


def main_thread_compiling() -> bool:
  """Whether the main thread is inside JAX's compiler (XLA compiles in C++, under these
  frames)."""
  frame = sys._current_frames().get(threading.main_thread().ident or -1)
  while frame is not None:
    code = frame.f_code
    if (code.co_name in _COMPILER_FUNCTIONS
        or code.co_filename.replace(os.sep, "/").endswith(_COMPILER_FILES)):
      return True
    frame = frame.f_back
  return False


class Watchdog:
  """Ends a run in which no step finishes in time, or that ignores a stop signal.

  Args:
    cfg: the ``stability.watchdog`` section.
    log_every: ``train.log_every`` (the measured interval covers that many steps).
    run_root: the run directory (the stacks go to ``hang_stacks/process_<i>.txt`` there), or
      None: no stacks file.
    record: ``event -> None``: logs the event (process 0 logs); every process prints its line.
    signal_received: ``() -> bool``: whether this process received a stop signal.
    on_fire: ``(code) -> None`` called last (default: ``os._exit(code)``, the only way out of a
      process whose main thread is stuck).
    poll: seconds between checks (default: a twentieth of the timeout, 0.2 to 5 s).

  Example:
    >>> import time
    >>> from stablejax.training.config import WatchdogConfig
    >>> from stablejax.training.recovery.watchdog import Watchdog
    >>> fired = []
    >>> dog = Watchdog(WatchdogConfig(timeout_seconds=0.3, startup_seconds=0.3), log_every=10,
    ...                run_root=None, record=fired.append, signal_received=lambda: False,
    ...                on_fire=fired.append, poll=0.05)
    >>> dog.start(); time.sleep(1.0); dog.stop()
    >>> fired[0]["event"], fired[-1]
    ('watchdog', 18)
  """

  def __init__(self, cfg: Any, log_every: int, run_root: Optional[Path],
               record: Callable[[dict], None], signal_received: Callable[[], bool],
               on_fire: Optional[Callable[[int], None]] = None, poll: Optional[float] = None):
    self.cfg, self.log_every = cfg, log_every
    self.run_root, self.record, self.signal_received = run_root, record, signal_received
    self.on_fire = on_fire or _exit
    self.poll = poll
    self.last_beat = time.monotonic()
    self.step = 0
    self.intervals: collections.deque = collections.deque(maxlen=8)  # seconds per step
    self.signal_at: Optional[float] = None
    self._stop = threading.Event()
    self._thread: Optional[threading.Thread] = None

  def timeout(self) -> float:
    """Seconds without a beat after which the run counts as hung."""
    if not self.intervals:
      return self.cfg.startup_seconds
    if self.cfg.timeout_seconds is not None:
      return self.cfg.timeout_seconds
    interval = max(self.intervals) * self.log_every
    return max(self.cfg.floor_seconds, self.cfg.factor * interval)

  def beat(self, step: Optional[int] = None) -> None:
    """Progress (the step loop finished a step or an action)."""
    self.last_beat = time.monotonic()
    if step is not None:
      self.step = step

  def measured(self, seconds_per_step: float) -> None:
    """A logging interval's seconds per step (steady state: not the one holding the first
    compilation)."""
    if seconds_per_step > 0:
      self.intervals.append(seconds_per_step)

  def start(self) -> None:
    if not self.cfg.enabled or self._thread is not None:
      return
    self.beat()
    self._thread = threading.Thread(target=self._watch, name="stablejax-watchdog", daemon=True)
    self._thread.start()

  def stop(self) -> None:
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout=10)
      self._thread = None

  def _watch(self) -> None:
    while not self._stop.wait(self._poll()):
      now = time.monotonic()
      if self.signal_at is None and self.signal_received():
        self.signal_at = now
      if self.signal_at is not None and now - self.signal_at > self.cfg.grace_seconds:
        self._fire(130, f"a stop signal was not acted on within {self.cfg.grace_seconds:g} s "
                        "(stability.watchdog.grace_seconds): the run is stuck; stopped without "
                        "saving (the last checkpoint resumes)")
        return
      waited, limit = now - self.last_beat, self.timeout()
      if waited > limit and not main_thread_compiling():
        self._fire(EXIT_HUNG, f"no progress for {waited:.0f} s after step {self.step} (timeout "
                              f"{limit:.0f} s, stability.watchdog): the run is hung")
        return

  def _poll(self) -> float:
    if self.poll is not None:
      return self.poll
    return min(5.0, max(0.2, self.timeout() / 20), max(0.2, self.cfg.grace_seconds / 4))

  def _fire(self, code: int, why: str) -> None:
    path = (self.run_root / "hang_stacks" / f"process_{jax.process_index()}.txt"
            if self.run_root is not None else None)
    where = ""
    if path is not None:
      try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
          f.write(f"\n# {time.strftime('%Y-%m-%d %H:%M:%S')} step {self.step}: {why}\n")
          f.flush()
          faulthandler.dump_traceback(file=f, all_threads=True)
        where = f"; every thread's stack in {path}"
      except OSError as e:  # a full or read-only disk: still end the run
        where = f"; the stacks could not be written ({e})"
    print(f"error: {why}{where} (exit code {code})", file=sys.stderr, flush=True)
    self.record({"step": self.step, "event": "watchdog", "cause": why, "exit_code": code,
                 "stacks": str(path) if path is not None else None})
    self.on_fire(code)


def _exit(code: int) -> None:
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)
