"""Stopping a run at a safe point: SIGINT, SIGTERM and SIGHUP, and what every process agrees on.

A signal only sets a flag; the run stops at the next safe point (between start-up phases, or
before a step), never in the middle of a compilation, a checkpoint save or the budget's probe.
SIGHUP too: a closed terminal (or ``stablejax launch`` passing one on) saves like SIGTERM.

Multi-process: every process must take the same branch, or the next collective deadlocks.
Rollback causes come from values fetched from replicated arrays, identical on every process;
:meth:`StopSignals.agree` still reduces the decision (any process's trigger rolls back all) and
carries the host-local stop signal, at the log and eval steps, where the host already waits for
the device. A signal therefore takes effect at the next log step (within ``train.log_every``
steps) on a multi-process run.
"""

from __future__ import annotations

import signal
from typing import Any, Optional

# Nothing heavy is imported here: a program installs these handlers before it imports jax, so a
# signal during its imports is handled like any other.
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(Exception):
  """A signal during start-up: the run stopped at a safe point before its first step (the
  message is the one line to print; exit code 130). Nothing half-written is left behind: a
  checkpoint save or the time budget's probe in progress completes or is removed first."""


class StopSignals:
  """The stop request of this process (``received``) and of the job (``agreed``)."""

  def __init__(self) -> None:
    self.received: Optional[int] = None
    self.agreed: Optional[int] = None

  def _handler(self, signum: int, frame: Any) -> None:
    self.received = signum

  def install(self) -> None:
    """Takes SIGINT, SIGTERM and SIGHUP (a second call does nothing)."""
    for sig in SIGNALS:
      if signal.getsignal(sig) != self._handler:
        signal.signal(sig, self._handler)

  def reclaim(self) -> None:
    """Takes the signals back after joining a multi-process job: XLA's preemption notifier
    installs its own SIGTERM handler in C, which Python's ``signal.getsignal`` does not see."""
    for sig in SIGNALS:
      signal.signal(sig, self._handler)

  def check_startup(self, phase: str) -> None:
    """Raises Interrupted when a signal came during start-up (all processes agree on it)."""
    import jax
    import numpy as np

    from stablejax.training.launch import distributed
    stop = self.received or 0
    # Only a joined multi-process job agrees; asking for the process count before the job is
    # joined would start a single-process backend (jax.distributed.initialize must come first).
    if jax.distributed.is_initialized() and jax.process_count() > 1:
      stop = int(distributed.agree_max(np.array(stop)))
    if stop:
      raise Interrupted(f"{signal.Signals(stop).name} during start-up ({phase}): stopped before "
                        "the first step; run the same command to start again")

  def requested(self) -> bool:
    """Whether the run stops before its next step (on several processes: once all agreed)."""
    import jax
    if jax.process_count() == 1:
      return self.received is not None
    return self.agreed is not None

  def agree(self, cause: Optional[str]) -> Optional[str]:
    """The job's rollback cause (any process's), noting a stop request of any process."""
    import jax
    import numpy as np

    from stablejax.training.launch import distributed
    if jax.process_count() == 1:
      return cause
    rollback, stop = distributed.agree_max(np.array([cause is not None, self.received or 0]))
    if stop:
      self.agreed = int(stop)
    if rollback and cause is None:
      cause = "a rollback trigger on another process"
    return cause

  @property
  def name(self) -> str:
    signum = self.agreed or self.received
    return signal.Signals(signum).name if signum is not None else "a stop request"
