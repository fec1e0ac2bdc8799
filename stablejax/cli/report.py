"""Plot and summarise a stablejax run's metrics.jsonl.

    python -m stablejax report RUN_DIR [--out PATH] [--window STEPS]

The command line of :func:`stablejax.monitor.report.make_report`: writes ``RUN_DIR/report.png``
and prints the summary.

Exit codes: 0 done; 2 unusable run directory or bad arguments.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

from stablejax.monitor.report import ReportError, make_report


def main(argv: Optional[Sequence[str]] = None) -> int:
  """Command line entry point; returns the exit code (0 ok, 2 unusable run dir).

  Args:
    argv: arguments without the program name (default ``sys.argv[1:]``).
  """
  parser = argparse.ArgumentParser(
      prog="python -m stablejax report",
      description="Plot and summarise a stablejax run's metrics.jsonl.")
  parser.add_argument("run_dir", help="run directory containing metrics.jsonl")
  parser.add_argument("--out", default=None, help="PNG path (default RUN_DIR/report.png)")
  parser.add_argument("--window", type=int, default=100,
                      help="window in steps for the replayed rates and score (default 100)")
  args = parser.parse_args(argv)
  if args.window < 1:
    print("error: --window must be a positive number of steps", file=sys.stderr)
    return 2
  try:
    out, text = make_report(Path(args.run_dir), Path(args.out) if args.out else None, args.window)
  except ReportError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(text)
  print(f"report written to {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
