"""Validation loss of a trained run before and after round-to-nearest weight quantisation.

    python -m stablejax quantize-eval RUN_DIR [--bits 4] [--batches N] [--exclude lm_head ...]

The command line of :func:`stablejax.training.quantized_eval.quantize_eval`; its module describes
what is measured. Prints both losses and the difference and writes ``RUN_DIR/quantize_eval.json``.
Run it from where the run was started (data paths in config.json are read as given).

Exit codes: 0 done; 2 missing run directory, missing or bad config, no usable checkpoint, bad
arguments, a run directory it cannot write; 130 interrupted by SIGINT, SIGTERM or SIGHUP (it stops
once the step under way, such as a compilation, returns; nothing is written).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NoReturn, Optional, Sequence

from stablejax.cli import _process

PROG = "python -m stablejax quantize-eval"


class _UsageError(Exception):
  """A bad command line (one line, exit code 2)."""


class _ArgumentParser(argparse.ArgumentParser):
  # One line and exit code 2, like the trainer (main returns it).
  def error(self, message: str) -> NoReturn:
    raise _UsageError(f"{message} (see {PROG} --help)")


def parser() -> argparse.ArgumentParser:
  p = _ArgumentParser(prog=PROG, description="Validation loss of a trained run before and after "
                      "round-to-nearest weight quantisation. SIGINT, SIGTERM or SIGHUP stops it "
                      "with exit code 130.")
  p.add_argument("run_dir", help="a training run's output directory (train --out)")
  p.add_argument("--bits", type=int, default=4, help="weight bits, 2..8 (default 4)")
  p.add_argument("--batches", type=int, default=None,
                 help="validation batches (default: the run's train.eval_batches)")
  p.add_argument("--exclude", nargs="+", default=[], metavar="SUBSTRING",
                 help="keep parameters whose path contains any of these in full precision")
  p.add_argument("--no-merge", action="store_true",
                 help="quantise an EmbProj model without merging the projections first")
  return p


def main(argv: Optional[Sequence[str]] = None) -> int:
  """Runs the program; returns its exit code (0, 2 or 130).

  Args:
    argv: the arguments (default ``sys.argv[1:]``, as the program: see
      :mod:`stablejax.cli._process`).
  """
  with _process.program(argv is None):
    _process.quiet_orbax_leftovers()
    try:
      args = parser().parse_args(argv)
    except _UsageError as e:
      print(f"error: {e}", file=sys.stderr)
      return 2

    def fallback(step: int, reason: str) -> None:
      print(f"warning: checkpoint {step} is unusable ({reason}); trying the previous one",
            file=sys.stderr)

    try:
      _process.check()
      # Imported once the signals are handled (JAX).
      from stablejax.training.quantized_eval import RESULT_FILE, quantize_eval
      from stablejax.training.runs import RunError
      try:
        r = quantize_eval(args.run_dir, args.bits, batches=args.batches, exclude=args.exclude,
                          merge=not args.no_merge, on_fallback=fallback,
                          check_stop=_process.check)
      except RunError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
      print(f"interrupted by {_process.interrupted_name(e)}: stopped before the evaluation was "
            f"done; nothing was written", file=sys.stderr)
      return _process.EXIT_INTERRUPTED
    note = " (EmbProj merged)" if r["merged_emb_proj"] else ""
    note += f", excluded {', '.join(r['exclude'])}" if r["exclude"] else ""
    print(f"checkpoint step {r['checkpoint_step']}, {r['batches']} validation batches{note}")
    print(f"val loss full precision: {r['val_loss_before']:.4f}")
    print(f"val loss {r['bits']}-bit RTN:      {r['val_loss_after']:.4f}")
    print(f"difference:              {r['delta']:+.4f} ({100 * r['relative_delta']:+.2f}%)")
    print(f"wrote {Path(args.run_dir) / RESULT_FILE}")
    return 0


if __name__ == "__main__":
  sys.exit(main())
