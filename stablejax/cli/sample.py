"""Sample text from a trained run.

    python -m stablejax sample RUN_DIR --prompt "..." [--max-new-tokens 200] [--temperature 0.8]
                               [--top-k 50] [--seed 0] [--num-samples 1] [--tokenizer T]

The command line of :func:`stablejax.training.sampling.sample`: prints each sample (the prompt
and its continuation) and, on stderr, the speed. The tokenizer is the one the run recorded in
``RUN_DIR/tokenizer/`` (runs trained before that read their data paths in config.json as given:
run those from where the run was started, or pass ``--tokenizer``).

Exit codes: 0 done; 2 missing run directory, config or usable checkpoint, unknown tokenizer, a
recorded tokenizer that is missing or differs (or a ``--tokenizer`` that differs from it), bad
arguments; 130 interrupted by SIGINT, SIGTERM or SIGHUP (it stops once the step under way, such
as a compilation, returns; nothing is written).
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn, Optional, Sequence

from stablejax.cli import _process

PROG = "python -m stablejax sample"
SEPARATOR = "\n" + "-" * 40


class _UsageError(Exception):
  """A bad command line (one line, exit code 2)."""


class _ArgumentParser(argparse.ArgumentParser):
  def error(self, message: str) -> NoReturn:
    raise _UsageError(f"{message} (see {PROG} --help)")


def parser() -> argparse.ArgumentParser:
  p = _ArgumentParser(prog=PROG, description="Sample text from a trained run's newest usable "
                      "checkpoint. SIGINT, SIGTERM or SIGHUP stops it with exit code 130.")
  p.add_argument("run_dir", help="a training run's output directory (train --out)")
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
      # Imported once the signals are handled, like everything JAX does from here on: a signal
      # only takes effect at the next safe point, never inside an import or a compilation.
      from stablejax.training.runs import RunError
      from stablejax.training.sampling import sample
      try:
        result = sample(args.run_dir, args.prompt, max_new_tokens=args.max_new_tokens,
                        temperature=args.temperature, top_k=args.top_k, seed=args.seed,
                        num_samples=args.num_samples, tokenizer=args.tokenizer,
                        on_fallback=fallback, check_stop=_process.check)
      except RunError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
      print(f"interrupted by {_process.interrupted_name(e)}: stopped before the samples were "
            f"done; nothing was written", file=sys.stderr)
      return _process.EXIT_INTERRUPTED
    for i, text in enumerate(result["samples"]):
      print(text + (SEPARATOR if i < len(result["samples"]) - 1 else ""))
    n = args.max_new_tokens * args.num_samples
    print(f"checkpoint step {result['step']}: {n} tokens in {result['seconds']:.2f} s "
          f"({n / max(result['seconds'], 1e-9):.0f} tokens/s; compile "
          f"{result['compile_seconds']:.1f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
  sys.exit(main())
