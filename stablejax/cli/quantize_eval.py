"""Validation loss of a trained run before and after round-to-nearest weight quantisation.

    python -m stablejax quantize-eval RUN_DIR [--bits 4] [--batches N] [--exclude lm_head ...]
                                      [--out FILE.json [--force]]

The command line of :func:`stablejax.training.trained.quantized_eval.quantize_eval`; its module
describes what is measured. Prints both losses and the difference and writes
``RUN_DIR/quantize_eval.json`` (or ``--out``): that one file and nothing else, whole or not at all
(:mod:`stablejax.training.run_folder.outputs`): never the run's records or inputs, and never a file
it did not write unless ``--force`` (its own JSON says ``"program": "stablejax quantize-eval"``).
Run it from where the run was started (data paths in config.json are read as given).

Exit codes: 0 done; 2 missing run directory, missing or bad config, no usable checkpoint, bad
arguments, an output it may not or cannot write (a read-only run directory: pass ``--out``); 130
interrupted by SIGINT, SIGTERM or SIGHUP (it stops once the step under way, such as a
compilation, returns; nothing is written).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

from stablejax.cli import _process

PROG = "python -m stablejax quantize-eval"
PROGRAM_NAME = "stablejax quantize-eval"  # the "program" of the JSON it writes


def parser() -> argparse.ArgumentParser:
  p = _process.ArgumentParser(
      prog=PROG, description="Validation loss of a trained run before and after round-to-nearest "
      "weight quantisation. SIGINT, SIGTERM or SIGHUP stops it with exit code 130.")
  _process.add_trained_run_argument(p)
  p.add_argument("--bits", type=int, default=4, help="weight bits, 2..8 (default 4)")
  p.add_argument("--batches", type=int, default=None,
                 help="validation batches (default: the run's train.eval_batches)")
  p.add_argument("--exclude", nargs="+", default=[], metavar="SUBSTRING",
                 help="keep parameters whose path contains any of these in full precision")
  p.add_argument("--no-merge", action="store_true",
                 help="quantise an EmbProj model without merging the projections first")
  _process.add_result_file_flags(
      p, "where to write the result (default RUN_DIR/quantize_eval.json); never one of the "
      "run's files", "quantize-eval", metavar="FILE")
  _process.add_compilation_cache_flag(p)
  return p


def main(argv: Optional[Sequence[str]] = None) -> int:
  """The program (``argv``: its arguments, default ``sys.argv[1:]``); returns its exit code."""
  return _process.run(argv, parser().parse_args, _evaluate, refused=_process.run_refusals,
                      orbax=True,
                      stopped="stopped before the evaluation was done; nothing was written")


def _evaluate(args: argparse.Namespace) -> int:
  _process.check()
  _process.use_compilation_cache(args)
  # Imported once the signals are handled (JAX).
  from stablejax.training.run_folder import outputs
  from stablejax.training.trained.quantized_eval import RESULT_FILE, quantize_eval
  run_dir = Path(args.run_dir)
  given = Path(args.out) if args.out is not None else run_dir / RESULT_FILE
  check = functools.partial(
      outputs.check_output, given, program="quantize-eval", force=args.force, ours=_ours,
      protected=outputs.run_records(run_dir), inputs=outputs.run_data(run_dir))
  if run_dir.is_dir():  # (a missing run directory: the evaluation's own line)
    check()  # before the work: an output it may not write fails at once
  r = quantize_eval(args.run_dir, args.bits, batches=args.batches, exclude=args.exclude,
                    merge=not args.no_merge, on_fallback=_process.checkpoint_fallback,
                    check_stop=_process.check, write=False)
  result = {"program": PROGRAM_NAME, **r}
  outputs.write_output(check(), lambda tmp: tmp.write_text(json.dumps(result, indent=2) + "\n"),
                       program="quantize-eval")
  note = " (EmbProj merged)" if r["merged_emb_proj"] else ""
  note += f", excluded {', '.join(r['exclude'])}" if r["exclude"] else ""
  print(f"checkpoint step {r['checkpoint_step']}, {r['batches']} validation batches{note}")
  print(f"val loss full precision: {r['val_loss_before']:.4f}")
  print(f"val loss {r['bits']}-bit RTN:      {r['val_loss_after']:.4f}")
  print(f"difference:              {r['delta']:+.4f} ({100 * r['relative_delta']:+.2f}%)")
  print(f"wrote {given}")
  return 0


# The keys of the result written before it named its program: such a file is this program's too.
_EARLIER_KEYS = {"run_dir", "checkpoint_step", "bits", "exclude", "batches", "merged_emb_proj",
                 "val_loss_before", "val_loss_after", "delta", "relative_delta"}


def _ours(path: Path) -> bool:
  """Whether ``path`` is a result quantize-eval wrote (it may be replaced)."""
  from stablejax.training.run_folder import outputs
  if outputs.json_program(path) == PROGRAM_NAME:
    return True
  try:
    return set(json.loads(path.read_text())) == _EARLIER_KEYS
  except (OSError, ValueError, TypeError):
    return False


if __name__ == "__main__":
  sys.exit(main())
