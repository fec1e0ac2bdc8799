"""What the programs do about stop signals, a closed output and the garbage collector, from
their first line.

Stop signals. SIGINT (Ctrl-C), SIGTERM (``kill``, a scheduler's time limit, ``docker stop``) and
SIGHUP (a closed terminal) mean the same to every program: stop at the next safe point, remove
what is half-written, print one line naming the signal and exit with `EXIT_INTERRUPTED` (130,
the trainer's code for the same three signals). `install` makes each of them only record itself
(the first one counts; later ones are ignored while the program stops); the program calls `check`
at its safe points, which raises `Interrupted`. Nothing is thrown into the middle of an import,
an XLA compilation or a worker pool's bookkeeping, so a signal at any moment ends the same way.
The ``stablejax`` command installs the handlers before it imports the command's module, and each
command's ``main`` installs them too (for ``python -m stablejax.cli.NAME``); ``stablejax train``
keeps its own (the trainer saves a checkpoint first).

A closed output. When the reader of the standard output or error goes away (``| head``), the
rest of that stream is discarded instead of raising `BrokenPipeError` (a traceback, or a
prepare that stops half way because its log could not be printed); the program runs on and
exits with its own code.

Python's cyclic garbage collector. Tracing and lowering a JAX program allocate millions of
short-lived objects, and at Python's default thresholds (700, 10, 10) the youngest generation is
collected every 700 allocations: a tiny run started with its programs in the compilation cache
spent 0.76-0.79 of its 9.6-10.3 CPU-seconds in 689 collections (``gc.callbacks``). A program
collects every 50,000 instead (`collect_garbage_less_often`): 0.20-0.23 in 16. What a collection
frees is the same, only later; training steps allocate little on the host, so a long run's
collections stay rare.

All three are set up for the life of the process when a program runs (``main()`` without
arguments); ``main(argv)`` called from Python (tests, notebooks) restores the previous signal
handlers when it returns and leaves the streams and the collector alone. A program's ``main``
that returned has said its last line: the stop signals are ignored from then on
(`ignore_stop_signals`), so a second Ctrl-C during the interpreter's shutdown, when Python puts
the default handlers back, cannot kill the process by the signal after its line (it exits with
its own code).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import logging
import os
import signal
import sys
import threading
from typing import Any, Callable, Iterator, NoReturn, Optional, Sequence

STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP")
                     if hasattr(signal, name))
EXIT_INTERRUPTED = 130

_received: list[int] = []  # the first stop signal received, once one came


class Interrupted(KeyboardInterrupt):
  """A stop signal was received; raised by `check` at a safe point. A KeyboardInterrupt, so code
  that already cleans up after Ctrl-C cleans up after SIGTERM and SIGHUP the same way."""

  def __init__(self, signum: int) -> None:
    super().__init__(signal_name(signum))
    self.signum = signum


def signal_name(signum: Optional[int]) -> str:
  try:
    return signal.Signals(signum).name if signum is not None else "SIGINT"
  except ValueError:
    return f"signal {signum}"


def interrupted_name(error: BaseException) -> str:
  """The signal an `Interrupted` (or a plain KeyboardInterrupt: SIGINT) stands for."""
  return signal_name(getattr(error, "signum", None))


def _record(signum: int, frame: object) -> None:
  if not _received:
    _received.append(signum)


def install() -> dict[int, Any]:
  """Makes each stop signal only record itself; returns the handlers it replaced. Idempotent."""
  if threading.current_thread() is not threading.main_thread():
    return {}  # only the main thread may set handlers; a caller in a thread keeps Python's
  return {s: signal.signal(s, _record) for s in STOP_SIGNALS}


def restore(previous: dict[int, Any]) -> None:
  for s, handler in previous.items():
    signal.signal(s, handler if handler is not None else signal.SIG_DFL)


def received() -> Optional[int]:
  """The stop signal received so far (None: none)."""
  return _received[0] if _received else None


def check() -> None:
  """A safe point: raises `Interrupted` when a stop signal has been received."""
  if _received:
    raise Interrupted(_received[0])


def forget() -> None:
  """Clears a received signal (for a caller that handled it and goes on, e.g. a test)."""
  _received.clear()


GC_THRESHOLDS = (50_000, 50, 100)  # a program process's, instead of Python's (700, 10, 10)


def collect_garbage_less_often() -> None:
  """Raises the process's garbage-collection thresholds to `GC_THRESHOLDS` (see the module's
  docstring); for a program's process, not a library call's."""
  gc.set_threshold(*GC_THRESHOLDS)


@contextlib.contextmanager
def program(as_program: bool) -> Iterator[None]:
  """The signal handling (and, for a program, the closed-output handling and the garbage
  collector's thresholds) of one ``main``.

  Args:
    as_program: True when ``main`` runs as the process's program (called without arguments):
      everything stays set up until the process exits. False (``main(argv)`` from Python): the
      previous handlers come back when ``main`` returns, the streams are left alone, and a
      signal received during it is forgotten.
  """
  previous = install()
  if as_program:
    tolerate_closed_output()
    collect_garbage_less_often()
  try:
    yield
  finally:
    if as_program:
      ignore_stop_signals()
    else:
      restore(previous)
      forget()


class UsageError(Exception):
  """A bad command line, raised by a program's parser instead of exiting (one line, exit 2)."""


class ArgumentParser(argparse.ArgumentParser):
  """An ``argparse`` parser whose errors raise `UsageError` naming ``--help``."""

  def error(self, message: str) -> NoReturn:
    raise UsageError(f"{message} (see {self.prog} --help)")


def path_argument(text: str) -> str:
  """The ``type=`` of every path argument of the programs: the path as given, once
  :func:`stablejax.data.paths.checked_path` let it through (an empty path, a loop of symbolic
  links, a name too long: the parser's one line, exit 2, before anything is read or written)."""
  from stablejax.data.paths import PathError, checked_path
  try:
    checked_path(text)
  except PathError as e:
    raise argparse.ArgumentTypeError(str(e)) from None
  return text


def run(argv: Optional[Sequence[str]], parse: Callable[[Optional[Sequence[str]]], Any],
        body: Callable[[Any], int], *, refused: Callable[[], tuple[type[BaseException], ...]],
        stopped: str, startup: Optional[str] = None, orbax: bool = False) -> int:
  """The frame every program's ``main`` shares: the signals handled from the first line
  (`program`), the arguments parsed, ``body(args)`` run; returns its exit code.

  Args:
    argv: the arguments (None: the process's, as the program).
    parse: ``argv -> args``; it may raise `UsageError` (one line, exit 2).
    body: the program's work, ``args -> exit code``; it imports what it needs, calls `check` at
      its safe points, and `started` once its imports are done.
    refused: ``() -> exception types`` that mean bad input (one ``error:`` line, exit 2), asked
      only when an exception comes, so the body imports them.
    stopped: what a stop signal left, after ``interrupted by SIGNAL: `` (exit 130).
    startup: the same for a signal before `started` (``interrupted by SIGNAL during start-up:
      ``); None: ``stopped`` then too.
    orbax: drop Orbax's leftover tracebacks (`quiet_orbax_leftovers`).
  """
  with program(argv is None):
    if orbax:
      quiet_orbax_leftovers()
    _started.clear()
    try:
      args = parse(argv)
    except UsageError as e:
      print(f"error: {e}", file=sys.stderr)
      return 2
    try:
      return body(args)
    except KeyboardInterrupt as e:
      phase = " during start-up" if startup is not None and not _started else ""
      left = startup if phase else stopped
      print(f"interrupted by {interrupted_name(e)}{phase}: {left}", file=sys.stderr)
      return EXIT_INTERRUPTED
    except Exception as e:  # noqa: BLE001 - refusals are one line, anything else propagates
      if not isinstance(e, refused()):
        raise
      print(f"error: {e}", file=sys.stderr)
      return 2


def run_refusals() -> tuple[type[BaseException], ...]:
  """What a program that reads a run refuses in one line: an unusable run, an output it may not
  write."""
  from stablejax.training.run_folder import outputs
  from stablejax.training.trained.run import RunError
  return RunError, outputs.OutputError


def checkpoint_fallback(step: int, reason: str) -> None:
  """The warning when a program reading a run passes over an unusable checkpoint."""
  print(f"warning: checkpoint {step} is unusable ({reason}); trying the previous one",
        file=sys.stderr)


_started: list[bool] = []


def started() -> None:
  """Marks the end of a program's start-up (its imports): a stop signal from here on gets the
  program's ``stopped`` line."""
  _started.append(True)


def ignore_stop_signals() -> None:
  """Ignores the stop signals for the rest of the process (a program that said its last line).
  Python's shutdown restores the default handler of a signal it handles, but leaves an ignored
  one ignored: a signal then can no longer kill the process after its exit code was decided."""
  if threading.current_thread() is threading.main_thread():
    for s in STOP_SIGNALS:
      signal.signal(s, signal.SIG_IGN)


# ----------------------------------------------------------------------------- closed output


class _TolerantWriter(io.RawIOBase):
  """Writes to a file descriptor; once its reader is gone (EPIPE), swallows what is written."""

  def __init__(self, fd: int) -> None:
    super().__init__()
    self._fd = fd
    self.reader_gone = False

  def writable(self) -> bool:
    return True

  def fileno(self) -> int:
    return self._fd

  def isatty(self) -> bool:
    return os.isatty(self._fd)

  def write(self, data: Any) -> int:
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view) and not self.reader_gone:  # all of it: a text layer may sit on top
      try:
        done += os.write(self._fd, view[done:])
      except BrokenPipeError:
        self.reader_gone = True
    return len(view)


def _tolerant(stream: Any) -> Any:
  if stream is None or getattr(stream, "_stablejax_tolerant", False):
    return stream
  try:
    fd = stream.fileno()
    stream.flush()
  except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
    return stream  # not a real file (already captured or replaced by someone): leave it
  raw = _TolerantWriter(fd)
  # Buffered as the stream was (python -u, PYTHONUNBUFFERED: straight through, line by line).
  buffered = isinstance(getattr(stream, "buffer", None), io.BufferedWriter)
  layer: Any = io.BufferedWriter(raw) if buffered else raw
  wrapper = io.TextIOWrapper(layer, encoding=stream.encoding, errors=stream.errors,
                             line_buffering=stream.line_buffering,
                             write_through=getattr(stream, "write_through", False) or not buffered)
  wrapper._stablejax_tolerant = True  # type: ignore[attr-defined]
  return wrapper


def tolerate_closed_output() -> None:
  """Replaces ``sys.stdout`` and ``sys.stderr`` (when they are the process's own) with streams
  that discard what is written once their reader is gone."""
  if sys.stdout is sys.__stdout__:
    sys.stdout = _tolerant(sys.stdout)
  if sys.stderr is sys.__stderr__:
    sys.stderr = _tolerant(sys.stderr)


def own_output() -> None:
  """Puts the process's own ``sys.stdout`` and ``sys.stderr`` back, for a program that handles a
  closed output itself from here on (the launcher says so on its other stream)."""
  for name in ("stdout", "stderr"):
    stream = getattr(sys, name)
    if getattr(stream, "_stablejax_tolerant", False):
      with contextlib.suppress(OSError, ValueError):
        stream.flush()
      setattr(sys, name, getattr(sys, f"__{name}__"))


# ----------------------------------------------------------------------------- Orbax's leftovers


def _is_orbax_leftover(unraisable: Any) -> bool:
  """What Orbax's background work leaves after a read or write that failed (an error the program
  reports itself, in one line): tensorstore's late callbacks find Orbax's short-lived event loop
  closed, and a read's coroutine is dropped unfinished. Each is one traceback of Python's
  'unraisable exception' report, and says nothing the error line does not."""
  error = unraisable.exc_value
  if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
    return True
  code = getattr(unraisable.object, "cr_code", None)  # a coroutine
  return code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename


class _CheckpointMetadataNote(logging.Filter):
  """Orbax's log records (through absl) of a checkpoint's metadata file it cannot read
  (``_CHECKPOINT_METADATA``: when it was saved, which Orbax then does without) become one warning
  line per file, instead of an ``ERROR:absl`` record that prints the file's content over several
  lines. The checkpoint's own files are read and checked as before."""

  # orbax/checkpoint/_src/metadata/checkpoint.py, MetadataStore.read
  PREFIXES = ("Failed to json parse Metadata file", "Failed to read Metadata file")

  def __init__(self) -> None:
    super().__init__()
    self.noted: set[str] = set()

  def filter(self, record: logging.LogRecord) -> bool:
    if not (isinstance(record.msg, str) and record.msg.startswith(self.PREFIXES)):
      return True
    path = str(record.args[0]) if isinstance(record.args, tuple) and record.args else "?"
    if path not in self.noted:
      self.noted.add(path)
      print(f"warning: {path} (Orbax's metadata of the checkpoint: when it was saved) cannot be "
            "read; the checkpoint is read without it", file=sys.stderr, flush=True)
    return False


def quiet_orbax_leftovers() -> None:
  """Drops the reports `_is_orbax_leftover` names; every other unraisable exception is reported
  as before (by the hook that was installed). Orbax's records of an unreadable
  ``_CHECKPOINT_METADATA`` become one line (`_CheckpointMetadataNote`)."""
  absl = logging.getLogger("absl")
  if not any(isinstance(f, _CheckpointMetadataNote) for f in absl.filters):
    absl.addFilter(_CheckpointMetadataNote())
  previous = sys.unraisablehook
  if getattr(previous, "drops_orbax_leftovers", False):
    return

  def hook(unraisable: Any) -> None:
    if not _is_orbax_leftover(unraisable):
      previous(unraisable)
  hook.drops_orbax_leftovers = True  # type: ignore[attr-defined]
  sys.unraisablehook = hook


def add_trained_run_argument(parser: argparse.ArgumentParser) -> None:
  """``run_dir``: the output directory of the training run a program reads (``train --out``)."""
  parser.add_argument("run_dir", type=path_argument,
                      help="a training run's output directory (train --out)")


def add_result_file_flags(parser: argparse.ArgumentParser, out_help: str, writer: str,
                          metavar: Optional[str] = None) -> None:
  """``--out`` and ``--force`` of a program that writes one file of its own beside a run: where
  (``out_help``), and leave to replace a file there that ``writer`` did not write."""
  parser.add_argument("--out", default=None, metavar=metavar, type=path_argument, help=out_help)
  parser.add_argument("--force", action="store_true",
                      help=f"replace a file at --out that {writer} did not write")


def add_compilation_cache_flag(parser: argparse.ArgumentParser) -> None:
  """``--no-compilation-cache``: every program that compiles takes it
  (:mod:`stablejax.training.launch.compilation_cache`)."""
  parser.add_argument("--no-compilation-cache", action="store_true",
                      help="compile everything anew, without the persistent compilation cache "
                           "(default: on, in the user's cache folder or $STABLEJAX_COMPILATION_"
                           "CACHE)")


def use_compilation_cache(args: argparse.Namespace, setting: Optional[str] = None) -> None:
  """Turns the persistent compilation cache on (or off, by ``--no-compilation-cache``) before
  the program compiles anything; a problem with its folder is one warning line."""
  from stablejax.training.launch import compilation_cache
  compilation_cache.enable(setting, disabled=getattr(args, "no_compilation_cache", False),
                           say=lambda line: print(line, file=sys.stderr))
