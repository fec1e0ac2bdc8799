"""Plot and summarise a stablejax run's metrics.jsonl.

    python -m stablejax report RUN_DIR [--out PATH] [--window STEPS] [--force]

The command line of :func:`stablejax.monitor.report.make_report`: writes ``RUN_DIR/report.png``
(or ``--out``) and prints the summary. It writes that one file and nothing else, whole or not at
all (:mod:`stablejax.training.run_folder.outputs`): never the run's records or inputs
(``metrics.jsonl``, ``run.json``, ``config.json``, anything in ``checkpoints/``, the run's data),
and never a file it did not write unless ``--force`` (its own PNG carries ``Software: stablejax
report``).

Exit codes: 0 done; 2 unusable run directory, bad arguments, or an output it may not or cannot
write (a directory, a missing folder, a read-only run directory); 130 interrupted by SIGINT,
SIGTERM or SIGHUP before the report was written.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from typing import Optional, Sequence

from stablejax.cli import _process


def parser() -> argparse.ArgumentParser:
  p = _process.ArgumentParser(
      prog="python -m stablejax report",
      description="Plot and summarise a stablejax run's metrics.jsonl. SIGINT, SIGTERM or SIGHUP "
                  "stops it with exit code 130.")
  p.add_argument("run_dir", type=_process.path_argument,
                 help="run directory containing metrics.jsonl")
  _process.add_result_file_flags(
      p, "PNG path (default RUN_DIR/report.png); never one of the run's own files", "the report")
  p.add_argument("--window", type=int, default=100,
                 help="window in steps for the replayed rates and score (default 100)")
  return p


def main(argv: Optional[Sequence[str]] = None) -> int:
  """Command line entry point; returns the exit code (0 ok, 2 unusable run dir, 130 stopped).

  Args:
    argv: arguments without the program name (default ``sys.argv[1:]``, as the program: see
      :mod:`stablejax.cli._process`).
  """
  return _process.run(argv, _parse, _report, refused=_refused, stopped="no report written")


def _parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
  args = parser().parse_args(argv)
  if args.window < 1:
    raise _process.UsageError("--window must be a positive number of steps")
  return args


def _refused() -> tuple[type[BaseException], ...]:
  from stablejax.monitor.report import ReportError
  from stablejax.training.run_folder import outputs
  return ReportError, outputs.OutputError


def _report(args: argparse.Namespace) -> int:
  _process.check()
  # Imported once the signals are handled (matplotlib and JAX take a second to load).
  from stablejax.monitor.report import (METRICS_FILE, REPORT_FILE, REPORT_SOFTWARE, ReportError,
                                        make_report)
  from stablejax.training.run_folder import outputs
  _process.check()
  run_dir = Path(args.run_dir)
  _import_plugins(run_dir)
  given = Path(args.out) if args.out is not None else run_dir / REPORT_FILE
  inputs = [*outputs.run_data(run_dir), run_dir / METRICS_FILE]
  check = functools.partial(
      outputs.check_output, given, program="report", force=args.force, inputs=inputs,
      ours=lambda p: outputs.png_software(p) == REPORT_SOFTWARE,
      protected=outputs.run_records(run_dir))
  if not run_dir.is_dir():
    raise ReportError(f"run directory {run_dir} does not exist; pass the directory a run wrote "
                      f"{METRICS_FILE} into")
  out = check()  # before the work: an --out it may not write fails at once
  text = ""

  def draw(tmp: Path) -> None:
    nonlocal text
    text = make_report(run_dir, tmp, args.window)[1]
    check()  # still free to replace, now that it is drawn

  outputs.write_output(out, draw, program="report")
  stopped = _process.received()
  if stopped is not None:  # (the report is drawn in one go; it stops only after it)
    print(f"interrupted by {_process.signal_name(stopped)}: the report was written to {given}, "
          f"its summary not printed", file=sys.stderr)
    return _process.EXIT_INTERRUPTED
  print(text)
  print(f"report written to {given}")
  return 0


def _import_plugins(run_dir: Path) -> None:
  """The run's plugins, so that the rates of their defences are read (a warning line when one
  cannot be imported: the report is drawn without them; one whose declarations the registries
  refuse is refused: its rates would be read as another module's)."""
  from stablejax.monitor.report import ReportError
  from stablejax.training import plugins
  from stablejax.training.run_folder.record import recorded_plugins
  try:
    plugins.load(recorded_plugins(run_dir), str(run_dir / "config.json"))
  except plugins.DeclarationRefused as e:
    raise ReportError(str(e)) from None
  except plugins.PluginError as e:
    print(f"warning: {e}; its defences' rates are not reported", file=sys.stderr)


if __name__ == "__main__":
  sys.exit(main())
