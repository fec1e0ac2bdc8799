"""Start a multi-process JAX job on this machine, the way `torchrun --standalone` does.

    python -m stablejax launch --nproc 2 --devices-per-proc 2 -- \\
        train.py --set mesh.distributed=true --out runs/mp

The command line of :func:`stablejax.training.launch.launcher.launch`; its module describes the
environment each process gets, the output, the signals and the exit code. A SIGINT, SIGTERM or
SIGHUP before any process is started ends the launcher with one line and exit code 130; once
they run, it is passed on to them and the launcher exits with their code.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn, Optional, Sequence

from stablejax.cli import _process
from stablejax.training.launch.launcher import PLATFORMS, launch  # standard library only

PROG = "python -m stablejax launch"


class ArgumentParser(argparse.ArgumentParser):
  def error(self, message: str) -> NoReturn:  # one line and exit code 2, like train.py
    print(f"error: {message} (see {PROG} --help)", file=sys.stderr)
    sys.exit(2)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
  p = ArgumentParser(prog=PROG, description=__doc__.splitlines()[0].replace("`", ""),
                     usage="%(prog)s [options] -- COMMAND [ARGS...]")
  p.add_argument("--nproc", type=int, default=2, help="processes to start (default 2)")
  p.add_argument("--devices-per-proc", type=int, default=None, metavar="N",
                 help="devices per process: N simulated CPU devices (XLA_FLAGS), or on a GPU/TPU "
                      "host process r's own devices r*N..r*N+N-1; default: CPU as is, GPUs/TPU "
                      "chips divided evenly")
  p.add_argument("--platform", choices=PLATFORMS, default="auto",
                 help="devices to divide: auto (TPU chips, else NVIDIA GPUs, else CPU), cpu, gpu "
                      "or tpu (default auto)")
  p.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
  p.add_argument("--grace", type=float, default=30.0, metavar="SECONDS",
                 help="after a process fails, how long the others may take to stop (default 30)")
  p.add_argument("command", nargs=argparse.REMAINDER,
                 help="after --: the command and its arguments")
  args = p.parse_args(argv)
  if args.command and args.command[0] == "--":
    args.command = args.command[1:]
  if not args.command:
    p.error("no command given: put it after --, e.g. -- train.py --set mesh.distributed=true")
  if args.nproc < 1:
    p.error(f"--nproc {args.nproc} must be at least 1")
  if args.devices_per_proc is not None and args.devices_per_proc < 1:
    p.error(f"--devices-per-proc {args.devices_per_proc} must be at least 1")
  if args.port is not None and not 0 < args.port < 65536:
    p.error(f"--port {args.port} is not a TCP port (1..65535)")
  if args.grace < 0:
    p.error(f"--grace {args.grace} must be >= 0")
  return args


def main(argv: Optional[Sequence[str]] = None) -> int:
  """Runs the program; returns its exit code (see :mod:`stablejax.training.launch.launcher`).

  Args:
    argv: the arguments (default ``sys.argv[1:]``, as the program: see
      :mod:`stablejax.cli._process`).
  """
  with _process.program(argv is None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    _process.own_output()  # the launcher notices a closed output itself, and says so
    return launch(args.command, args.nproc, devices_per_proc=args.devices_per_proc,
                  port=args.port, grace=args.grace, platform=args.platform,
                  stop_requested=_process.received)


if __name__ == "__main__":
  sys.exit(main())
