"""prepare's tokenizing processes: a pool that can be stopped at any moment, in task order.

Each worker has a pipe of its own and one task at a time. No lock or queue is shared between
processes, so stopping them (`Workers.kill`) at any moment leaves nothing stuck (a
``multiprocessing.Pool`` worker killed while holding its queue's lock hangs ``Pool.terminate``).
Results come back in task order whatever the worker count, so what is written from them does not
depend on it. The workers ignore the stop signals (`STOP_SIGNALS`): the parent handles them and
stops its workers itself.
"""

from __future__ import annotations

import collections
import contextlib
import multiprocessing
import multiprocessing.connection
import multiprocessing.context
import multiprocessing.process
import os
import signal
import sys
from typing import Callable, Iterable, Iterator, Union

from stablejax.data.config import PrepareError

STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP")
                     if hasattr(signal, name))
Task = Callable[[tuple], dict]  # what the workers run on each task (prepare: encode_batch)


def _worker_main(conn: multiprocessing.connection.Connection, parent_pid: int, fn: Task) -> None:
  """A worker process: ``fn`` on each task its pipe brings, until None or the end.

  Stop signals are the parent's to handle (a terminal's Ctrl-C, ``kill`` of the process group, a
  scheduler's SIGTERM to every process of the job): the parent stops its workers itself. Without
  a parent (it died) the worker ends within a second.
  """
  for sig in STOP_SIGNALS:
    signal.signal(sig, signal.SIG_IGN)
  signal.pthread_sigmask(signal.SIG_UNBLOCK, set(STOP_SIGNALS))  # blocked while it started
  try:
    while True:
      if not conn.poll(1.0):
        if os.getppid() != parent_pid:
          return
        continue
      task = conn.recv()
      if task is None:
        return
      try:
        reply: tuple = (True, fn(task))
      except Exception as e:  # noqa: BLE001 - the parent raises it; it names the problem
        reply = (False, e)
      try:
        conn.send(reply)
      except Exception:  # noqa: BLE001 - an exception that cannot be pickled: its text
        conn.send((False, RuntimeError(f"{type(reply[1]).__name__}: {reply[1]}")))
  except (EOFError, OSError):
    return  # the parent closed the pipe or is gone


class Workers:
  """``count`` processes that run ``fn`` (a module-level function: spawned processes import it)
  on the tasks of `map`.

  Args:
    count: worker processes.
    fn: what each worker runs on a task.
  """

  def __init__(self, count: int, fn: Task) -> None:
    context = _pool_context()
    self.conns: list[multiprocessing.connection.Connection] = []
    self.procs: list[multiprocessing.process.BaseProcess] = []
    # Stop signals stay blocked while the workers start (they inherit the mask, and a spawned
    # interpreter would die of one before it ignores them); a pending one reaches this process
    # when they are unblocked here.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, set(STOP_SIGNALS))
    try:
      for _ in range(count):
        parent_end, child_end = context.Pipe()
        proc = context.Process(target=_worker_main, args=(child_end, os.getpid(), fn),
                               daemon=True)
        proc.start()
        child_end.close()
        self.conns.append(parent_end)
        self.procs.append(proc)
    except BaseException:
      self.kill()
      raise
    finally:
      signal.pthread_sigmask(signal.SIG_SETMASK, mask)

  def map(self, tasks: Iterable[tuple], check_stop: Callable[[], None]) -> Iterator[dict]:
    """The workers' ``fn`` of each task, in task order; at most one task per worker is read
    ahead, so memory stays bounded. ``check_stop`` is called while waiting."""
    idle = collections.deque(range(len(self.procs)))
    pending: collections.deque[int] = collections.deque()  # the worker of each task, in order
    task_iter = iter(tasks)
    more = True
    while True:
      while more and idle:
        task = next(task_iter, None)
        if task is None:
          more = False
          break
        worker = idle.popleft()
        self.conns[worker].send(task)
        pending.append(worker)
      if not pending:
        return
      worker = pending.popleft()
      while not self.conns[worker].poll(0.1):
        check_stop()
        if not self.procs[worker].is_alive():
          raise PrepareError(f"a tokenizing worker process died (exit code "
                             f"{self.procs[worker].exitcode}), out of memory or killed: run again "
                             f"with fewer --workers")
      try:
        ok, value = self.conns[worker].recv()
      except EOFError:
        raise PrepareError("a tokenizing worker process died while sending its result: run again "
                           "with fewer --workers") from None
      if not ok:
        raise value
      idle.append(worker)
      check_stop()
      yield value

  def close(self) -> None:
    """Lets the workers finish (they are idle once every result is read)."""
    for conn in self.conns:
      with contextlib.suppress(OSError):
        conn.send(None)
    for proc in self.procs:
      proc.join(timeout=10)
    self.kill()

  def kill(self) -> None:
    """Stops the workers now (SIGKILL: they hold nothing another process waits for)."""
    for proc in self.procs:
      if proc.is_alive():
        proc.kill()
    for proc in self.procs:
      proc.join()
    for conn in self.conns:
      conn.close()
    self.procs, self.conns = [], []


def map_in_process(fn: Task, tasks: Iterable[tuple], check_stop: Callable[[], None]
                   ) -> Iterator[dict]:
  """What `Workers.map` gives, computed in this process (one worker: no process started)."""
  for task in tasks:
    check_stop()
    yield fn(task)


def _pool_context() -> Union[multiprocessing.context.DefaultContext,
                           multiprocessing.context.SpawnContext,
                           multiprocessing.context.ForkContext]:
  """fork (cheap) unless this process has started JAX's backends, whose threads must not be
  forked (prepare() called from a training script or a bench); then spawn."""
  xla_bridge = sys.modules.get("jax._src.xla_bridge")
  if xla_bridge is not None and xla_bridge.backends_are_initialized():
    return multiprocessing.get_context("spawn")
  return multiprocessing.get_context("fork" if sys.platform == "linux" else None)
