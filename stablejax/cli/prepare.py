"""Prepare a corpus for the trainer: documents -> tokens -> train.bin, val.bin and meta.json.

    python -m stablejax prepare INPUT... --out DIR --tokenizer T [--weights W...] [--workers N]

The command line of :func:`stablejax.data.prepare.prepare`; its docstring describes the inputs,
the tokenizers, the files written and what happens to other files in DIR.

Exit codes: 0 done (or already done); 2 bad input, DIR in use by another writer (one line naming
it), or DIR not writable (read-only, full disk); 130 interrupted by SIGINT, SIGTERM or SIGHUP (this
run's files removed).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Optional, Sequence

from stablejax.cli import _process
from stablejax.data import tokenizer as tokenizer_lib  # standard library only: --help is quick

PROG = "python -m stablejax prepare"
DESCRIPTION = ("Prepare a corpus for the trainer: documents -> tokens -> train.bin, val.bin and "
               "meta.json in --out. Another prepare into the same --out is refused while this "
               "one runs; SIGINT, SIGTERM or SIGHUP removes this run's files and exits 130.")


def parser() -> argparse.ArgumentParser:
  p = _process.ArgumentParser(prog=PROG, description=DESCRIPTION)
  p.add_argument("inputs", nargs="+", metavar="INPUT", type=_process.path_argument,
                 help="text/.jsonl/.json/.parquet files or folders, pydoc, or hf:NAME[:CONFIG]; "
                      "each at most once")
  p.add_argument("--out", required=True, type=_process.path_argument,
                 help="output directory (created when missing; only the files prepare writes "
                      "there are touched)")
  p.add_argument("--tokenizer", required=True, help=tokenizer_lib.KINDS_HELP)
  p.add_argument("--weights", type=float, nargs="+", help="mixing weight per input")
  p.add_argument("--workers", type=int, default=1, help="tokenizing processes (default 1)")
  p.add_argument("--text-field", default="text",
                 help="JSON/Parquet/datasets field holding the text (default text)")
  p.add_argument("--separator", default=tokenizer_lib.EOT_TEXT,
                 help=f"document separator in text files (default {tokenizer_lib.EOT_TEXT})")
  p.add_argument("--hf-split", default="train", help="split of hf: datasets (default train)")
  p.add_argument("--val-fraction", type=float, default=0.005,
                 help="fraction of documents held out for validation, in (0, 1) (default 0.005)")
  p.add_argument("--dtype", choices=("auto", "uint16", "uint32"), default="auto",
                 help="token file element type; auto: uint16 when every id fits (vocabulary up "
                      "to 65536), else uint32 (default auto)")
  p.add_argument("--eot-token", default=None,
                 help="the end-of-text token of a tokenizer.json, appended after each document "
                      "(default: the first of <|endoftext|>, </s>, <eos>, ... it has)")
  p.add_argument("--bpe-train-bytes", type=float, default=None,
                 help="bpe:N trains on at most this many bytes (default: the whole train split)")
  p.add_argument("--filter-max-repeat", type=int, default=256,
                 help="drop documents with a longer run of one byte (0 disables)")
  p.add_argument("--filter-max-nontext", type=float, default=0.3,
                 help="drop documents with a larger fraction of non-text bytes (1 disables)")
  p.add_argument("--force", action="store_true",
                 help="replace a corpus prepared differently, or files of the same names that "
                      "prepare did not write (or that changed since it wrote them)")
  p.add_argument("--no-progress", action="store_true", help="no progress bars")
  return p


def main(argv: Optional[Sequence[str]] = None) -> int:
  """The program (``argv``: its arguments, default ``sys.argv[1:]``); returns its exit code."""
  stopped = "this run's files in {out} removed; run the same command again"
  return _process.run(argv, parser().parse_args, _prepare, refused=_refused,
                      startup="nothing was written",
                      stopped=stopped.format(out=_out_of(argv)))


def _refused() -> tuple[type[BaseException], ...]:
  from stablejax.data.prepare import PrepareError
  return (PrepareError,)


def _out_of(argv: Optional[Sequence[str]]) -> str:
  """The --out of the command line (for the stop line, which comes after the work)."""
  args = list(sys.argv[1:] if argv is None else argv)
  for i, item in enumerate(args):
    if item == "--out" and i + 1 < len(args):
      return args[i + 1]
    if item.startswith("--out="):
      return item.split("=", 1)[1]
  return "--out"


def _prepare(args: argparse.Namespace) -> int:
  _process.check()
  # Imported once the signals are handled: a Ctrl-C while NumPy and Grain load is a clean exit
  # 130 too.
  from stablejax.data.prepare import Options, PrepareError, prepare
  from stablejax.training.run_folder.record import trainer_folder_of
  _process.check()
  # A folder a training run owns is the trainer's alone (its rule, read from its record): files
  # written there would be foreign content to the run's next resume.
  owner = trainer_folder_of(args.out)
  if owner is not None:
    raise PrepareError(f"--out {str(args.out)!r} is inside the {owner[1]} of the training run in "
                       f"{str(owner[0])!r}, which only the trainer writes: put --out outside it")
  _process.started()
  opts = Options(text_field=args.text_field, separator=args.separator, hf_split=args.hf_split,
                 val_fraction=args.val_fraction, filter_max_repeat=args.filter_max_repeat,
                 filter_max_nontext=args.filter_max_nontext)
  prepare(args.inputs, args.out, args.tokenizer, weights=args.weights, workers=args.workers,
          dtype=args.dtype, opts=opts, eot_token=args.eot_token,
          bpe_train_bytes=int(args.bpe_train_bytes) if args.bpe_train_bytes else None,
          force=args.force, progress=not args.no_progress, log=_log, check_stop=_process.check)
  return 0


def _log(line: Any) -> None:
  print(line, flush=True)


if __name__ == "__main__":
  sys.exit(main())
