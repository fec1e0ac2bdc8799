"""Stop signals and a closed output in the programs other than the trainer: SIGINT, SIGTERM and
SIGHUP at any moment are one line and exit code 130 (start-up and imports included); `| head`
ends the output quietly; every option has help text without markup. And every program, the
trainer too, raises the garbage collector's thresholds for its own process only."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap

import pytest

from process_hooks import hooked_env
from helpers import ROOT

STOP = ["SIGINT", "SIGTERM", "SIGHUP"]


def run(args, env, timeout=120) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=timeout)


PREPARE = ["prepare", "pydoc", "--out", "{tmp}/out", "--tokenizer", "bytes"]
LAUNCH = ["launch", "--nproc", "1", "--", sys.executable, "-c", "open('{tmp}/started', 'w')"]
# The moment: the import of a module each program loads after its first line (NumPy for prepare
# and quantize-eval, JAX for sample and report, the launcher's library). Every signal
# for prepare and launch; one each for the programs whose start-up imports JAX (seconds of CPU).
CASES = [
    *[(PREPARE, "numpy", s, "during start-up: nothing was written") for s in STOP],
    *[(LAUNCH, "stablejax.training.launch.launcher", s, "before any process was started")
      for s in STOP],
    (["sample", "{tmp}/run"], "jax", "SIGTERM", "nothing was written"),
    (["quantize-eval", "{tmp}/run"], "numpy", "SIGHUP", "nothing was written"),
    (["report", "{tmp}/run"], "jax", "SIGINT", "no report written"),
]


@pytest.mark.parametrize("args,module,signal_name,expected", CASES,
                         ids=[f"{c[0][0]}-{c[2]}" for c in CASES])
def test_a_stop_signal_during_start_up_is_one_line_and_exit_130(tmp_path, args, module,
                                                                 signal_name, expected):
  env = hooked_env(tmp_path, HOOK_SIGNAL_AT_IMPORT=module, HOOK_SIGNAL=signal_name)
  proc = run(["-m", "stablejax", *[a.format(tmp=tmp_path) for a in args]], env)
  lines = proc.stderr.strip().splitlines()
  assert proc.returncode == 130, proc.stderr[-3000:]
  assert len(lines) == 1 and signal_name in lines[0] and expected in lines[0], proc.stderr
  leftovers = sorted(p.name for p in tmp_path.iterdir() if p.name != "hooks")
  assert leftovers == []  # no --out, no report, no process started


def test_a_stop_signal_is_one_line_when_a_program_runs_as_its_own_module(tmp_path):
  # python -m stablejax.cli.prepare: its own main installs the handlers (no dispatcher first).
  env = hooked_env(tmp_path, HOOK_SIGNAL_AT_IMPORT="numpy", HOOK_SIGNAL="SIGINT")
  proc = run(["-m", "stablejax.cli.prepare", "pydoc", "--out", str(tmp_path / "out"),
              "--tokenizer", "bytes"], env)
  assert proc.returncode == 130, proc.stderr[-3000:]
  assert proc.stderr.strip().splitlines() == [
      "interrupted by SIGINT during start-up: nothing was written"]
  assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- a closed output


HELPS = [["-m", "stablejax", "--help"], *[["-m", "stablejax", c, "--help"] for c in (
    "train", "prepare", "sample", "report", "launch", "quantize-eval")],
    ["-m", "stablejax.cli.prepare", "--help"]]


@pytest.mark.parametrize("buffered", [True, False])
def test_help_into_a_closed_pipe_ends_quietly(buffered):
  """`... --help | head`, the reader gone before anything is written (the worst case)."""
  env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
  if not buffered:
    env["PYTHONUNBUFFERED"] = "1"
  for args in HELPS:
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
      proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, stdout=write_end,
                            stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
      os.close(write_end)
    assert proc.returncode == 0 and proc.stderr == "", (args, proc.returncode, proc.stderr)


def test_prepare_finishes_its_corpus_when_its_output_is_closed(tmp_path):
  (tmp_path / "a.txt").write_text("<|endoftext|>".join(f"Document {i} about foxes." * 5
                                                        for i in range(200)))
  read_end, write_end = os.pipe()
  os.close(read_end)
  try:
    proc = subprocess.run([sys.executable, "-m", "stablejax", "prepare", str(tmp_path / "a.txt"),
                           "--out", str(tmp_path / "out"), "--tokenizer", "bytes",
                           "--val-fraction", "0.2"], cwd=ROOT, stdout=write_end,
                          stderr=write_end, timeout=120)
  finally:
    os.close(write_end)
  assert proc.returncode == 0
  assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["meta.json", "train.bin",
                                                                  "val.bin"]


# ----------------------------------------------------------------------------- help text


def _parsers() -> dict[str, argparse.ArgumentParser]:
  from stablejax.cli import prepare, quantize_eval, report, sample
  return {name: module.parser() for name, module in (
      ("prepare", prepare), ("sample", sample), ("report", report),
      ("quantize-eval", quantize_eval))}


@pytest.mark.parametrize("command", ["prepare", "sample", "report", "quantize-eval"])
def test_every_option_has_help_text(command):
  parser = _parsers()[command]
  missing = [a.option_strings or a.dest for a in parser._actions
             if not (a.help and a.help.strip()) and a.dest != "help"]
  assert missing == []


@pytest.mark.parametrize("command", ["train", "prepare", "sample", "report", "launch",
                                     "quantize-eval"])
def test_help_is_plain_text(command, capsys):
  import stablejax.cli
  with pytest.raises(SystemExit):
    stablejax.cli.main([command, "--help"])
  text = capsys.readouterr().out
  for markup in ("``", ":func:", ":mod:", ":class:", "`"):
    assert markup not in text, (command, markup)


def test_orbax_leftovers_are_not_reported_and_other_unraisables_are():
  # What Orbax leaves behind a failed read or write, made here as it happens there: tensorstore
  # calls back into an event loop that Orbax already closed. The report is Python's unraisable
  # hook (one traceback each on stderr); the programs drop these and keep every other report.
  code = textwrap.dedent("""
      import asyncio, gc, sys, time
      import tensorstore as ts
      from stablejax.cli import _process
      seen = []
      sys.unraisablehook = lambda u: seen.append(str(u.exc_value))
      _process.quiet_orbax_leftovers()
      _process.quiet_orbax_leftovers()  # once is enough: not stacked
      loop = asyncio.new_event_loop()
      loop.close()
      promise, future = ts.Promise.new()
      future.add_done_callback(lambda f: loop.call_soon_threadsafe(print))
      promise.set_result(1)
      time.sleep(0.5)

      class Noisy:
        def __del__(self):
          raise ValueError("a report of our own")
      Noisy()
      gc.collect()
      print(seen)
  """)
  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                        timeout=120)
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.strip() == "['a report of our own']"
  assert "Event loop is closed" not in proc.stderr


def test_a_program_that_said_its_last_line_ignores_stop_signals_until_it_exits():
  """Python puts the default handlers back while the interpreter shuts down: a second Ctrl-C
  then would kill the program by the signal after its line. Once main returned, the stop signals
  are ignored, and stay so through the shutdown."""
  code = textwrap.dedent("""
      import os, signal, sys
      from stablejax.cli import _process
      with _process.program(True):
        pass
      print(all(signal.getsignal(s) == signal.SIG_IGN for s in _process.STOP_SIGNALS))
      import atexit  # a second Ctrl-C in the shutdown, after the handlers would be put back
      atexit.register(lambda: os.kill(os.getpid(), signal.SIGINT))
      sys.exit(130)
  """)
  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                        timeout=60)
  assert proc.stdout.strip() == "True" and proc.returncode == 130, (proc.returncode, proc.stderr)


def test_a_programs_process_collects_garbage_less_often_and_a_library_call_leaves_it_alone():
  """Every way a program starts raises Python's garbage-collection thresholds for its process
  (tracing allocates millions of short-lived objects); ``main(argv)`` called from Python leaves
  the caller's as they are."""
  code = textwrap.dedent("""
      import gc, runpy, sys
      from stablejax.cli import _process, main

      def thresholds(start, argv):
        gc.set_threshold(700, 10, 10)  # Python's defaults, before each way in
        sys.argv = argv
        try:
          start()
        except SystemExit:  # --help
          pass
        return gc.get_threshold()

      ways = {
          "library": lambda: main(["report", "--help"]),
          "stablejax": lambda: runpy.run_module("stablejax", run_name="__main__"),
          "train.py": lambda: runpy.run_path("train.py", run_name="__main__"),
          "cli.report": lambda: runpy.run_module("stablejax.cli.report", run_name="__main__"),
      }
      argvs = {"library": ["-c"], "stablejax": ["stablejax", "train", "--help"],
               "train.py": ["train.py", "--help"], "cli.report": ["report", "--help"]}
      got = {name: thresholds(start, argvs[name]) for name, start in ways.items()}
      print(repr(got), file=sys.stderr)
  """)
  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                        timeout=60)
  assert proc.returncode == 0, proc.stderr[-3000:]
  got = eval(proc.stderr.strip().splitlines()[-1])
  program = (50_000, 50, 100)
  assert got == {"library": (700, 10, 10), "stablejax": program, "train.py": program,
                 "cli.report": program}
