"""Plot and summarise a stablejax run's metrics.jsonl.

    python -m stablejax report RUN_DIR [--out PATH] [--window STEPS]

The command line of :func:`stablejax.monitor.report.make_report`: writes ``RUN_DIR/report.png``
and prints the summary.

Exit codes: 0 done; 2 unusable run directory or bad arguments; 130 interrupted by SIGINT, SIGTERM
or SIGHUP before the report was written.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

from stablejax.cli import _process


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="python -m stablejax report",
      description="Plot and summarise a stablejax run's metrics.jsonl. SIGINT, SIGTERM or SIGHUP "
                  "stops it with exit code 130.")
  p.add_argument("run_dir", help="run directory containing metrics.jsonl")
  p.add_argument("--out", default=None, help="PNG path (default RUN_DIR/report.png)")
  p.add_argument("--window", type=int, default=100,
                 help="window in steps for the replayed rates and score (default 100)")
  return p


def main(argv: Optional[Sequence[str]] = None) -> int:
  """Command line entry point; returns the exit code (0 ok, 2 unusable run dir, 130 stopped).

  Args:
    argv: arguments without the program name (default ``sys.argv[1:]``, as the program: see
      :mod:`stablejax.cli._process`).
  """
  with _process.program(argv is None):
    args = parser().parse_args(argv)
    if args.window < 1:
      print("error: --window must be a positive number of steps", file=sys.stderr)
      return 2
    try:
      _process.check()
      # Imported once the signals are handled (matplotlib and JAX take a second to load).
      from stablejax.monitor.report import ReportError, make_report
      _process.check()
    except KeyboardInterrupt as e:
      print(f"interrupted by {_process.interrupted_name(e)}: no report written", file=sys.stderr)
      return _process.EXIT_INTERRUPTED
    _import_plugins(Path(args.run_dir))
    try:
      out, text = make_report(Path(args.run_dir), Path(args.out) if args.out else None,
                              args.window)
    except ReportError as e:
      print(f"error: {e}", file=sys.stderr)
      return 2
    finally:
      stopped = _process.received()
    if stopped is not None:  # (the report is drawn in one go; it stops only after it)
      print(f"interrupted by {_process.signal_name(stopped)}: the report was written to {out}, "
            f"its summary not printed", file=sys.stderr)
      return _process.EXIT_INTERRUPTED
    print(text)
    print(f"report written to {out}")
    return 0


def _import_plugins(run_dir: Path) -> None:
  """The run's plugins, so that the rates of their defences are read (a warning line when one
  cannot be imported: the report is drawn without them)."""
  from stablejax.training import plugins
  from stablejax.training.run_dir import recorded_plugins
  try:
    plugins.load(recorded_plugins(run_dir), str(run_dir / "config.json"))
  except plugins.PluginError as e:
    print(f"warning: {e}; its defences' rates are not reported", file=sys.stderr)


if __name__ == "__main__":
  sys.exit(main())
