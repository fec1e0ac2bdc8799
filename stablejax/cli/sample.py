"""Sample text from a trained run.

    python -m stablejax sample RUN_DIR --prompt "..." [--max-new-tokens 200] [--temperature 0.8]
                               [--top-k 50] [--seed 0] [--num-samples 1] [--tokenizer T]
                               [--out FILE.json [--force]]

The command line of :func:`stablejax.training.trained.sampling.sample`: prints each sample (the
prompt and its continuation) and, on stderr, the speed. ``--out`` also writes them as JSON
(``{"program": "stablejax sample", "run_dir", "step", "prompt", ..., "samples"}``), that one file
and nothing else, whole or not at all (:mod:`stablejax.training.run_folder.outputs`): never the
run's records or inputs, and never a file it did not write unless ``--force``. The tokenizer is the
one the run recorded in ``RUN_DIR/tokenizer/`` (runs trained before that read their data paths
in config.json as given: run those from where the run was started, or pass ``--tokenizer``).

Exit codes: 0 done; 2 missing run directory, config or usable checkpoint, unknown tokenizer, a
recorded tokenizer that is missing or differs (or a ``--tokenizer`` that differs from it), bad
arguments, an ``--out`` it may not or cannot write; 130 interrupted by SIGINT, SIGTERM or SIGHUP
(it stops once the step under way, such as a compilation, returns: before the samples exist,
nothing is written; once they exist, they are printed and written, only the speed is not
measured).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

from stablejax.cli import _process

PROG = "python -m stablejax sample"
PROGRAM_NAME = "stablejax sample"  # the "program" of the JSON it writes: how it knows its own
SEPARATOR = "\n" + "-" * 40


def parser() -> argparse.ArgumentParser:
  p = _process.ArgumentParser(
      prog=PROG, description="Sample text from a trained run's newest usable checkpoint. SIGINT, "
      "SIGTERM or SIGHUP stops it with exit code 130.")
  _process.add_trained_run_argument(p)
  p.add_argument("--prompt", default="", help="text to continue (default: a new document)")
  p.add_argument("--max-new-tokens", type=int, default=200,
                 help="tokens to generate after the prompt (default 200)")
  p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
  p.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest (0: all)")
  p.add_argument("--seed", type=int, default=0,
                 help="random seed; the same seed, prompt and checkpoint give the same samples "
                      "(default 0)")
  p.add_argument("--num-samples", type=int, default=1,
                 help="independent samples of the prompt, generated together (default 1)")
  p.add_argument("--tokenizer", default=None,
                 help="the run's tokenizer when it has no usable record (bytes, gpt2 or a "
                      "tokenizer.json); it must match a recorded one")
  _process.add_result_file_flags(
      p, "also write the samples to FILE as JSON (never one of the run's files)", "sample",
      metavar="FILE")
  _process.add_compilation_cache_flag(p)
  return p


def main(argv: Optional[Sequence[str]] = None) -> int:
  """The program (``argv``: its arguments, default ``sys.argv[1:]``); returns its exit code."""
  return _process.run(argv, parser().parse_args, _sample, refused=_process.run_refusals,
                      orbax=True, stopped="stopped before the samples were done; nothing was "
                      "written")


def _sample(args: argparse.Namespace) -> int:
  _process.check()
  _process.use_compilation_cache(args)
  # Imported once the signals are handled, like everything JAX does from here on: a signal only
  # takes effect at the next safe point, never inside an import or a compilation.
  from stablejax.training.run_folder import outputs
  from stablejax.training.trained.sampling import sample
  check = functools.partial(
      outputs.check_output, args.out or "", program="sample", force=args.force,
      ours=lambda p: outputs.json_program(p) == PROGRAM_NAME,
      protected=outputs.run_records(Path(args.run_dir)),
      inputs=outputs.run_data(Path(args.run_dir)))
  out = check() if args.out is not None else None  # before the work: a bad --out fails at once
  result = sample(args.run_dir, args.prompt, max_new_tokens=args.max_new_tokens,
                  temperature=args.temperature, top_k=args.top_k, seed=args.seed,
                  num_samples=args.num_samples, tokenizer=args.tokenizer,
                  on_fallback=_process.checkpoint_fallback, check_stop=_process.check)
  if out is not None:
    record = {"program": PROGRAM_NAME, "run_dir": str(args.run_dir), "step": result["step"],
              "prompt": args.prompt, "max_new_tokens": args.max_new_tokens,
              "temperature": args.temperature, "top_k": args.top_k, "seed": args.seed,
              "samples": result["samples"], "tokens": result["tokens"]}
    check()  # still free to replace
    outputs.write_output(out, lambda tmp: tmp.write_text(json.dumps(record, indent=1)),
                         program="sample")
  for i, text in enumerate(result["samples"]):
    print(text + (SEPARATOR if i < len(result["samples"]) - 1 else ""))
  written = f", and written to {args.out}" if out is not None else ""
  if result["stopped"]:
    print(f"interrupted by {_process.signal_name(_process.received())}: the samples were done "
          f"and are printed above{written}; their speed was not measured", file=sys.stderr)
    return _process.EXIT_INTERRUPTED
  n = args.max_new_tokens * args.num_samples
  print(f"checkpoint step {result['step']}: {n} tokens in {result['seconds']:.2f} s "
        f"({n / max(result['seconds'], 1e-9):.0f} tokens/s, {result['decoding']}; compile "
        f"{result['compile_seconds']:.1f} s){written}", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
