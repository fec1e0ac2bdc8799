"""The ``stablejax`` command: one program, a subcommand per tool.

    python -m stablejax COMMAND [ARGS...]      (or the console script: stablejax COMMAND ...)

Each subcommand is a thin ``main(argv) -> int`` in this package over a library function; it is
imported only when it runs, so ``stablejax --help`` answers at once. ``python -m
stablejax.cli.<module>`` runs one directly.
"""

from __future__ import annotations

import importlib
import sys
from typing import NamedTuple, Optional, Sequence

from stablejax.cli._extras import missing_extra


class Command(NamedTuple):
  module: str   # the module whose main(argv) runs it
  summary: str  # one line for stablejax --help


COMMANDS = {
    "train": Command("stablejax.cli.train",
                     "train a Pre-LN GPT with the stability stack (checkpoints, logs, recovery)"),
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
  lines += ["", "python -m stablejax COMMAND --help describes a command's arguments."]
  return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
  """Runs ``stablejax COMMAND ARGS...``; returns the command's exit code (2: no such command, or
  a program's dependencies not installed)."""
  argv = list(sys.argv[1:] if argv is None else argv)
  if argv and argv[0] in COMMANDS:
    try:
      return importlib.import_module(COMMANDS[argv[0]].module).main(argv[1:])
    except ModuleNotFoundError as e:
      line = missing_extra(e, argv[0])
      if line is None:
        raise
      print(line, file=sys.stderr)
      return 2
  if argv and argv[0] in ("-h", "--help"):
    print(usage())
    return 0
  choices = ", ".join(COMMANDS)
  problem = f"unknown command {argv[0]!r}" if argv else "no command given"
  print(f"error: {problem}: choose one of {choices} (see python -m stablejax --help)",
        file=sys.stderr)
  return 2
