"""Sample text from a trained run.

    python -m stablejax sample RUN_DIR --prompt "..." [--max-new-tokens 200] [--temperature 0.8]
                               [--top-k 50] [--seed 0] [--num-samples 1] [--tokenizer T]

The command line of :func:`stablejax.training.sampling.sample`: prints each sample (the prompt
and its continuation) and, on stderr, the speed. The tokenizer is the one the run recorded in
``RUN_DIR/tokenizer/`` (runs trained before that read their data paths in config.json as given:
run those from where the run was started, or pass ``--tokenizer``).

Exit codes: 0 done; 2 missing run directory, config or usable checkpoint, unknown tokenizer, a
recorded tokenizer that is missing or differs (or a ``--tokenizer`` that differs from it), bad
arguments.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn, Optional, Sequence

from stablejax.training.runs import RunError
from stablejax.training.sampling import sample

PROG = "python -m stablejax sample"
SEPARATOR = "\n" + "-" * 40


class _ArgumentParser(argparse.ArgumentParser):
  def error(self, message: str) -> NoReturn:
    raise RunError(f"{message} (see {PROG} --help)")


def main(argv: Optional[Sequence[str]] = None) -> int:
  p = _ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
  p.add_argument("run_dir", help="a training run's output directory (train.py --out)")
  p.add_argument("--prompt", default="", help="text to continue (default: a new document)")
  p.add_argument("--max-new-tokens", type=int, default=200)
  p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
  p.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest (0: all)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--num-samples", type=int, default=1)
  p.add_argument("--tokenizer", default=None,
                 help="the run's tokenizer when it has no usable record (bytes, gpt2 or a "
                      "tokenizer.json); it must match a recorded one")

  def fallback(step: int, reason: str) -> None:
    print(f"warning: checkpoint {step} is unusable ({reason}); trying the previous one",
          file=sys.stderr)

  try:
    args = p.parse_args(argv)
    result = sample(args.run_dir, args.prompt, max_new_tokens=args.max_new_tokens,
                    temperature=args.temperature, top_k=args.top_k, seed=args.seed,
                    num_samples=args.num_samples, tokenizer=args.tokenizer, on_fallback=fallback)
  except RunError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  for i, text in enumerate(result["samples"]):
    print(text + (SEPARATOR if i < len(result["samples"]) - 1 else ""))
  n = args.max_new_tokens * args.num_samples
  print(f"checkpoint step {result['step']}: {n} tokens in {result['seconds']:.2f} s "
        f"({n / max(result['seconds'], 1e-9):.0f} tokens/s; compile {result['compile_seconds']:.1f}"
        f" s)", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
