"""Train a Pre-LN GPT with the stablejax stability stack.

    python -m stablejax train                    # the packaged config "default" into runs/default
    python -m stablejax train --config gpt2_small --set train.steps=100 --set data.train=my.txt \
        --out DIR
    python -m stablejax train --config my_config.json

``--config`` takes a packaged config's name (``default``, ``gpt2_small``, ``openwebtext_stable``,
``openwebtext_stable_cpu``) or a JSON file. ``python train.py ...`` at the repository root is the
same program.

A checkpoint in --out resumes the run; --fresh starts over. Exit codes: 0 done; 2 bad command
line, config, data or checkpoints; 3 diverged beyond the recovery budget; 130 interrupted
(checkpoint saved).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NoReturn, Optional, Sequence

PROG = "python -m stablejax train"


class ArgumentParser(argparse.ArgumentParser):
  def error(self, message: str) -> NoReturn:  # one line and exit code 2, like every input error
    print(f"error: {message} (see {PROG} --help)", file=sys.stderr)
    sys.exit(2)


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
  parser = ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="default",
                      help="a packaged config's name (default, gpt2_small, ...) or a JSON file")
  parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                      help="override a config value (JSON-parsed), repeatable")
  parser.add_argument("--out", default=None, help="run directory (default runs/<config name>)")
  parser.add_argument("--fresh", action="store_true",
                      help="delete checkpoints and logs in --out first")
  return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
  args = parse_args(argv)
  try:
    return _main(args)
  except KeyboardInterrupt:  # before the trainer's own handler is installed: nothing written yet
    print("interrupted during start-up: stopped before the first step; run the same command to "
          "start again", flush=True)
    return 130


def _main(args: argparse.Namespace) -> int:
  # Imported here so that --help and argument errors answer instantly.
  import jax
  from stablejax.data.pipeline import DataError
  from stablejax.training import distributed
  from stablejax.training.checkpoint import CheckpointError
  from stablejax.training.config import ConfigError, config_name, load_config
  from stablejax.training.loop import Interrupted, Run, write_config

  out = Path(args.out or Path("runs") / config_name(args.config))
  try:
    cfg = load_config(args.config, args.set)
    write_config(cfg, out)  # joins a multi-process job first when mesh.distributed=true
    return Run(cfg, out, fresh=args.fresh).train()
  except Interrupted as e:  # a signal while the run was being set up (Run.train reports its own)
    if distributed.is_main():
      print(e, flush=True)
    return distributed.leave(130)
  except (ConfigError, DataError, CheckpointError) as e:
    print(f"error: {e}", file=sys.stderr)
    return distributed.leave(2)
  except jax.errors.JaxRuntimeError as e:
    if not (jax.distributed.is_initialized() and jax.process_count() > 1):
      raise
    print(f"error: {distributed.lost_peer_message(e)}", file=sys.stderr)
    return distributed.leave(1)


if __name__ == "__main__":
  sys.exit(main())
