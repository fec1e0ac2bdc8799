"""Prepare a corpus for the trainer: documents -> tokens -> ``train.bin``, ``val.bin``, meta.json.

    python -m stablejax prepare INPUT... --out DIR --tokenizer T [--weights W...] [--workers N]

The command line of :func:`stablejax.data.prepare.prepare`; its docstring describes the inputs,
the tokenizers and the files written.

Exit codes: 0 done (or already done); 2 bad input; 130 interrupted (partial files removed).
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn, Optional, Sequence

from stablejax.data import tokenizer as tokenizer_lib
from stablejax.data.prepare import SEPARATOR, TEXT_FIELD, Options, PrepareError, prepare

PROG = "python -m stablejax prepare"


class _ArgumentParser(argparse.ArgumentParser):
  def error(self, message: str) -> NoReturn:
    print(f"error: {message} (see {PROG} --help)", file=sys.stderr)
    sys.exit(2)


def main(argv: Optional[Sequence[str]] = None) -> int:
  p = _ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
  p.add_argument("inputs", nargs="+", metavar="INPUT",
                 help="text/.jsonl/.json/.parquet files or folders, pydoc, or hf:NAME[:CONFIG]")
  p.add_argument("--out", required=True, help="output directory")
  p.add_argument("--tokenizer", required=True, help=tokenizer_lib.KINDS_HELP)
  p.add_argument("--weights", type=float, nargs="+", help="mixing weight per input")
  p.add_argument("--workers", type=int, default=1, help="tokenizing processes (default 1)")
  p.add_argument("--text-field", default=TEXT_FIELD, help="JSON/Parquet/datasets text field")
  p.add_argument("--separator", default=SEPARATOR, help="document separator in text files")
  p.add_argument("--hf-split", default="train", help="split of hf: datasets (default train)")
  p.add_argument("--val-fraction", type=float, default=0.005,
                 help="fraction of documents held out for validation, in (0, 1) (default 0.005)")
  p.add_argument("--dtype", choices=("auto", "uint16", "uint32"), default="auto")
  p.add_argument("--eot-token", default=None, help="end-of-text token of a tokenizer.json")
  p.add_argument("--bpe-train-bytes", type=float, default=None,
                 help="bpe:N trains on at most this many bytes (default: the whole train split)")
  p.add_argument("--filter-max-repeat", type=int, default=256,
                 help="drop documents with a longer run of one byte (0 disables)")
  p.add_argument("--filter-max-nontext", type=float, default=0.3,
                 help="drop documents with a larger fraction of non-text bytes (1 disables)")
  p.add_argument("--force", action="store_true",
                 help="replace a corpus prepared differently, or files of the same names that "
                      "prepare did not write")
  p.add_argument("--no-progress", action="store_true", help="no progress bars")
  args = p.parse_args(argv)
  opts = Options(text_field=args.text_field, separator=args.separator, hf_split=args.hf_split,
                 val_fraction=args.val_fraction, filter_max_repeat=args.filter_max_repeat,
                 filter_max_nontext=args.filter_max_nontext)
  try:
    prepare(args.inputs, args.out, args.tokenizer, weights=args.weights, workers=args.workers,
            dtype=args.dtype, opts=opts, eot_token=args.eot_token,
            bpe_train_bytes=int(args.bpe_train_bytes) if args.bpe_train_bytes else None,
            force=args.force, progress=not args.no_progress)
  except PrepareError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print(f"interrupted: partial files in {args.out} removed; run the same command again",
          file=sys.stderr)
    return 130
  return 0


if __name__ == "__main__":
  sys.exit(main())
