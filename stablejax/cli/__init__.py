"""The ``stablejax`` command: one program, a subcommand per tool.

    python -m stablejax COMMAND [ARGS...]      (or the console script: stablejax COMMAND ...)

Each subcommand is a thin ``main(argv) -> int`` in this package over a library function; it is
imported only when it runs, so ``stablejax --help`` answers at once. ``python -m
stablejax.cli.<module>`` runs one directly.

Stop signals: SIGINT, SIGTERM and SIGHUP are handled from the start (before the command's module,
and so JAX, is imported): the command stops at its next safe point, removes what it left
half-written, prints one line and exits 130 (see :mod:`stablejax.cli._process`). ``train`` handles
them itself (it saves a checkpoint first; also 130); ``launch`` passes them on to its processes
once they run.
"""

from __future__ import annotations

import importlib
import sys
from typing import NamedTuple, Optional, Sequence

from stablejax.cli import _process
from stablejax.cli._extras import missing_extra


class Command(NamedTuple):
  module: str   # the module whose main(argv) runs it
  summary: str  # one line for stablejax --help
  own_signals: bool = False  # it installs its own signal handlers (the trainer)


COMMANDS = {
    "train": Command("stablejax.cli.train",
                     "train a language model with the stability stack (checkpoints, logs, "
                     "recovery)",
                     own_signals=True),
    "prepare": Command("stablejax.cli.prepare",
                       "prepare a corpus: documents -> tokens -> train.bin, val.bin, meta.json"),
    "sample": Command("stablejax.cli.sample", "sample text from a trained run"),
    "report": Command("stablejax.cli.report", "plot and summarise a run's metrics.jsonl"),
    "launch": Command("stablejax.cli.launch",
                      "start a multi-process JAX job on this machine (like torchrun)"),
    "quantize-eval": Command("stablejax.cli.quantize_eval",
                             "validation loss of a run before and after RTN weight quantisation"),
}


def usage() -> str:
  width = max(map(len, COMMANDS))
  lines = ["usage: python -m stablejax COMMAND [ARGS...]", "",
           "Training-stability tools of stablejax.", "",
           "commands:"]
  lines += [f"  {name:<{width}}  {cmd.summary}" for name, cmd in COMMANDS.items()]
  lines += ["", "python -m stablejax COMMAND --help describes a command's arguments.",
            "SIGINT, SIGTERM or SIGHUP stops a command cleanly with exit code 130."]
  return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
  """Runs ``stablejax COMMAND ARGS...``; returns the command's exit code (2: no such command, or
  a program's dependencies not installed).

  Args:
    argv: the arguments after the program name; None (the program itself) reads ``sys.argv``
      and keeps the signal and output handling until the process exits.
  """
  as_program = argv is None
  argv = list(sys.argv[1:] if argv is None else argv)
  command = COMMANDS.get(argv[0]) if argv else None
  if command is not None and command.own_signals:
    if as_program:
      _process.tolerate_closed_output()
      _process.collect_garbage_less_often()
    try:
      return _run(command, argv)
    finally:
      if as_program:
        _process.ignore_stop_signals()
  with _process.program(as_program):
    if command is not None:
      return _run(command, argv)
    if argv and argv[0] in ("-h", "--help"):
      print(usage())
      return 0
    choices = ", ".join(COMMANDS)
    problem = f"unknown command {argv[0]!r}" if argv else "no command given"
    print(f"error: {problem}: choose one of {choices} (see python -m stablejax --help)",
          file=sys.stderr)
    return 2


def _run(command: Command, argv: list[str]) -> int:
  """The command's ``main``; a program started without the extra it needs is one line, exit 2."""
  try:
    return importlib.import_module(command.module).main(argv[1:])
  except ModuleNotFoundError as e:
    line = missing_extra(e, argv[0])
    if line is None:
      raise
    print(line, file=sys.stderr)
    return 2
