"""Train a language model with the stablejax stability stack (a Pre-LN GPT by default).

    python -m stablejax train                    # the packaged config "default" into runs/default
    python -m stablejax train --config gpt2_small --set train.steps=100 --set data.train=my.txt \
        --out DIR
    python -m stablejax train --config my_config.json

``--config`` takes a packaged config's name (``default``, ``gpt2_small``, ``openwebtext_stable``,
``openwebtext_stable_cpu``) or a JSON file. ``python train.py ...`` at the repository root is the
same program.

``--plugin MODULE`` imports a module of the user's that declares defences or model families
(``stablejax.training.plugins``); the run records it, and a resume imports it again. A resume may
switch defences on or off and change their settings: it says in one line what changed and what
became of each defence's state. Switching between Muon and AdamW needs ``--reset-optimizer``.

The run directory is the trainer's: it holds its lock while it runs (a second trainer on it stops
with one line naming the first), records what it wrote in ``run.json``, and never deletes, appends
to or reads as a checkpoint a file it did not write (``--fresh`` removes only what the record
lists, once the new start's checks passed). A checkpoint in ``--out`` resumes the run: run the
same command again. It resumes on the data and tokenizer it recorded (another corpus is refused
unless ``--data-changed``; another tokenizer always), and writes ``config.json`` only once the
resume checks passed. Every name it writes in ``--out`` is listed in docs/trainer.md, "The run
directory".

``--rewarmup-steps N`` with a resume that changes the model (``--set model.qk_norm=true``: the new
tensors are initialised, every other one restored) ramps the learning rate back up over N steps.

Exit codes: 0 done; 2 bad command line, config, data, checkpoints or run directory, or an error
of the environment (disk full, read-only folder); 3 diverged beyond the recovery budget; 16
transient faults on one device (the hardware is suspect: a checkpoint was saved, resume on other
hardware); 17 the replicas of the parameters differ (silent data corruption; nothing was saved
since the last check); 18 hung (no progress within the watchdog's timeout; every thread's stack
is in hang_stacks/); 130 interrupted (SIGINT, SIGTERM or SIGHUP: a checkpoint was saved, or none
was needed yet, or the run was stuck and stopped after stability.watchdog.grace_seconds).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import NoReturn, Optional, Sequence

from stablejax.cli import _process
from stablejax.training.launch.signals import StopSignals

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
  parser.add_argument("--out", default=None, type=_process.path_argument,
                      help="run directory (default runs/<config name>); a checkpoint there "
                           "resumes")
  parser.add_argument("--fresh", action="store_true",
                      help="start over: delete what an earlier run wrote in --out (only what its "
                           "run.json lists, and only once the new start's checks passed)")
  parser.add_argument("--data-changed", action="store_true",
                      help="resume on data other than the run recorded, on purpose (the "
                           "validation set and the data order change; the tokenizer must stay "
                           "the run's)")
  parser.add_argument("--reset-optimizer", action="store_true",
                      help="resume with the optimizer's state started afresh (keeping the "
                           "parameters, step, data position and monitor): to switch between "
                           "muon and adamw")
  parser.add_argument("--rewarmup-steps", type=int, default=None, metavar="N",
                      help="at this resume, ramp the learning rate from 0 back to the schedule "
                           "over N steps (the config key train.rewarmup_steps; recorded, so the "
                           "same command again does not ramp again)")
  parser.add_argument("--no-compilation-cache", action="store_true",
                      help="compile everything anew, without the persistent compilation cache "
                           "(default: on, in the user's cache folder, $STABLEJAX_COMPILATION_CACHE"
                           " or train.compilation_cache; a job of several CPU processes leaves the "
                           "user's folder off)")
  parser.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                      help="import a module that declares defences or model families (a module "
                           "name or a .py path), repeatable; recorded in config.json, so a resume, "
                           "sample, report and quantize-eval import it again")
  return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
  # First, before the heavy imports: a signal from here on stops the program at a safe point.
  signals = StopSignals()
  signals.install()
  if argv is None:  # the process's program (train.py, python -m stablejax.cli.train)
    _process.collect_garbage_less_often()
  args = parse_args(argv)
  try:
    return _main(args, signals)
  except ModuleNotFoundError as e:
    from stablejax.cli._extras import missing_extra
    line = missing_extra(e, "train")
    if line is None:
      raise
    print(line, file=sys.stderr)
    return 2
  except KeyboardInterrupt:  # a handler replaced by a library; nothing written yet
    print("interrupted during start-up: stopped before the first step; run the same command to "
          "start again", flush=True)
    return 130


class _ReportedOnce(logging.Filter):
  """Drops the log records of Orbax's and tensorstore's background threads and tasks that carry
  an error of the environment (disk full, read-only): the trainer reports that error itself, in
  one line, when it reaches the main thread."""

  def filter(self, record: logging.LogRecord) -> bool:
    from stablejax.training.run_folder.environment_errors import is_environment_error
    error = record.exc_info[1] if record.exc_info else None
    if error is not None and is_environment_error(error):
      return False
    return not is_environment_error(record.getMessage())


def _main(args: argparse.Namespace, signals: StopSignals) -> int:
  # Imported here so that --help and argument errors answer instantly.
  import jax
  for name in ("absl", "asyncio"):
    logging.getLogger(name).addFilter(_ReportedOnce())
  _process.quiet_orbax_leftovers()

  from stablejax.data.config import DataError
  from stablejax.training.launch import distributed
  from stablejax.training.checkpoint import CheckpointError
  from stablejax.training.config import (ConfigError, config_name, config_path, load_config,
                                         load_plugins)
  from stablejax.training.loop.trainer import Interrupted, Trainer
  from stablejax.training.run_folder.environment_errors import environment_message
  from stablejax.training.run_folder.record import RunDirError, recorded_plugins

  out = Path(args.out if args.out is not None else Path("runs") / config_name(args.config))
  try:
    signals.check_startup("importing")
    # A resume imports the plugins the run recorded, before the config names their sections
    # (and a plugin that fails is named as the record's, not the command line's).
    recorded = [] if args.fresh else recorded_plugins(out)
    load_plugins(recorded, str(out / "config.json"))
    overrides = list(args.set)
    if args.rewarmup_steps is not None:
      overrides.append(f"train.rewarmup_steps={args.rewarmup_steps}")
    cfg = load_config(args.config, overrides, plugins=recorded + args.plugin)
    from stablejax.training.launch import compilation_cache
    compilation_cache.enable(cfg.train.compilation_cache, disabled=args.no_compilation_cache,
                             say=lambda line: print(line, file=sys.stderr))
    return Trainer(cfg, out, fresh=args.fresh, data_changed=args.data_changed,
               reset_optimizer=args.reset_optimizer, signals=signals,
               config_file=config_path(args.config)).train()
  except Interrupted as e:  # a signal while the run was set up (Trainer.train reports its own)
    if distributed.is_main():
      print(e, flush=True)
    return distributed.leave(130)
  except RunDirError as e:
    if not e.quiet:  # (quiet: process 0 said it, and every process knows)
      print(f"error: {e}", file=sys.stderr)
    if not e.agreed:
      return distributed.leave(2)
    jax.distributed.shutdown()  # every process refused: they leave together, none waits alone
    return 2
  except (ConfigError, DataError, CheckpointError) as e:
    print(f"error: {e}", file=sys.stderr)
    return distributed.leave(2)
  except jax.errors.JaxRuntimeError as e:
    message = environment_message(e, out)
    if message is None and not (jax.distributed.is_initialized() and jax.process_count() > 1):
      raise
    print(f"error: {message or distributed.lost_peer_message(e)}", file=sys.stderr)
    return distributed.leave(2 if message else 1)
  except (OSError, ValueError, RuntimeError) as e:
    message = environment_message(e, out)
    if message is None:
      raise
    print(f"error: {message}", file=sys.stderr)
    return distributed.leave(2)


if __name__ == "__main__":
  sys.exit(main())
