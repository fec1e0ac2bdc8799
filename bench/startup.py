"""Time from the command to the first finished step: cold, warm, and a resume.

Usage:
  python -m bench.startup                  # the default model and gpt2_small, 3 rounds
  python -m bench.startup --models default --rounds 5
  python -m bench.startup --quick          # the default model, 1 round

Each measurement is one `python -m stablejax train` process, timed from its start to the moment
the record of its first step appears in metrics.jsonl (every step is logged here; a record is
written once the next step is dispatched), then stopped with SIGTERM (it saves and exits 130).
Per round and model, with a new empty compilation cache folder (`STABLEJAX_COMPILATION_CACHE`):

  cold     a new run, the cache empty: every program compiles (and is written to the cache)
  warm     a second new run of the same config: the programs come from the cache
  resume   the cold run's command again: it resumes from the checkpoint its SIGTERM saved
  no cache the resume once more with --no-compilation-cache: a resume as it was before

Python's bytecode is compiled before the rounds by one unmeasured start, as pip compiles it
when it installs a package, so no measured start compiles Python source: where the environment
turns bytecode off (``PYTHONDONTWRITEBYTECODE``) every start would otherwise compile stablejax's
modules again (~0.25 s). The measured processes then read it from a folder of the benchmark's
(``PYTHONPYCACHEPREFIX``), never from the source tree.

Rounds interleave the models and the variants, so load from other processes hits all alike.
Printed: the median seconds of each, warm / cold and resume / cold (target: at most 0.4), and
resume / no cache (what the cache saves a resume). gpt2_small runs at a reduced batch (2 x 256
tokens), on the embedded corpus, so that one step is seconds on a CPU; the compilation, which
the cache saves, does not depend on the batch much.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Every step logged (train.log_every=1), so that a resume's first step has its record too.
COMMON = ["logging.progress=false", "train.steps=1000", "checkpoint.every=1000",
          "train.log_every=1", "logging.sample_every=0", "train.peak_flops_per_device=1e12"]
MODELS = {
    "default": ("default", []),
    "gpt2_small": ("gpt2_small", ["train.batch_size=2", "train.seq_len=256",
                                  "model.max_seq_len=256", "train.grad_accum=1",
                                  'data.train="pydoc"', "data.val=null", "train.eval_batches=1",
                                  "train.warmup_steps=10"]),
}


def first_step(config: str, overrides: list[str], out: Path, cache: Path,
               extra: tuple[str, ...] = (), timeout: float = 1800) -> float:
  """Seconds from the start of a train process to its first train record after its start; the
  process is then stopped (SIGTERM: it saves and exits 130)."""
  env = dict(os.environ, **_BYTECODE_ENV, STABLEJAX_COMPILATION_CACHE=str(cache))
  env.pop("JAX_COMPILATION_CACHE_DIR", None)  # the program's own cache, not a caller's
  if "PYTHONPYCACHEPREFIX" in _BYTECODE_ENV:
    env.pop("PYTHONDONTWRITEBYTECODE", None)
  args = [a for o in COMMON + overrides for a in ("--set", o)]
  before = _records(out)
  t0 = time.perf_counter()
  proc = subprocess.Popen([sys.executable, "-m", "stablejax", "train", "--config", config, *args,
                           "--out", str(out), *extra], cwd=ROOT, env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  try:
    while _records(out) <= before:
      if proc.poll() is not None:
        raise RuntimeError(f"train exited with {proc.returncode} before its first step: "
                           f"{proc.stderr.read()[-2000:] if proc.stderr else ''}")
      if time.perf_counter() - t0 > timeout:
        raise RuntimeError(f"no first step within {timeout} s")
      time.sleep(0.05)
    seconds = time.perf_counter() - t0
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=timeout)
    return seconds
  finally:
    if proc.poll() is None:
      proc.kill()


def _records(out: Path) -> int:
  """Train records in the run's metrics.jsonl (0 when there is none yet)."""
  try:
    lines = (out / "metrics.jsonl").read_text().splitlines()
  except OSError:
    return 0
  count = 0
  for line in lines:
    try:
      record = json.loads(line)
    except ValueError:
      continue  # a line being written
    count += "loss" in record and "event" not in record
  return count


# The measured processes' bytecode settings (compile_bytecode).
_BYTECODE_ENV: dict[str, str] = {}


def compile_bytecode(folder: Path) -> None:
  """One unmeasured start of the default model (its own cache and run), so that the bytecode of
  everything a start imports exists: in ``folder/bytecode`` when the environment turns bytecode
  off, else where Python keeps it."""
  _BYTECODE_ENV.clear()
  if os.environ.get("PYTHONDONTWRITEBYTECODE"):
    _BYTECODE_ENV["PYTHONPYCACHEPREFIX"] = str(folder / "bytecode")
  config, overrides = MODELS["default"]
  first_step(config, overrides, folder / "run", folder / "cache", ("--fresh",))


def measure(models: list[str], rounds: int) -> dict[str, dict[str, list[float]]]:
  times: dict[str, dict[str, list[float]]] = {m: {} for m in models}
  with tempfile.TemporaryDirectory(prefix="stablejax-startup-") as tmp:
    compile_bytecode(Path(tmp) / "first_start")
    for r in range(rounds):
      for model in models:
        config, overrides = MODELS[model]
        base = Path(tmp) / f"{model}_{r}"
        cache, run, other = base / "cache", base / "run", base / "other"
        row = times[model]
        row.setdefault("cold", []).append(first_step(config, overrides, run, cache, ("--fresh",)))
        row.setdefault("warm", []).append(first_step(config, overrides, other, cache,
                                                     ("--fresh",)))
        row.setdefault("resume", []).append(first_step(config, overrides, run, cache))
        row.setdefault("no cache", []).append(first_step(config, overrides, run, cache,
                                                         ("--no-compilation-cache",)))
        print(f"round {r + 1} {model}: " + ", ".join(f"{k} {v[-1]:.1f} s" for k, v in row.items()),
              flush=True)
  return times


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", default="default,gpt2_small",
                      help=f"comma list of {', '.join(MODELS)}")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--quick", action="store_true", help="the default model, one round")
  args = parser.parse_args(argv)
  from bench import _common
  _common.print_machine()
  models = ["default"] if args.quick else args.models.split(",")
  times = measure(models, 1 if args.quick else args.rounds)
  rows = []
  for model, row in times.items():
    med = {k: statistics.median(v) for k, v in row.items()}
    rows.append([model, *(f"{med[k]:.1f}" for k in ("cold", "warm", "resume", "no cache")),
                 f"{med['warm'] / med['cold']:.2f}", f"{med['resume'] / med['cold']:.2f}",
                 f"{med['resume'] / med['no cache']:.2f}"])
  print(_common.table(rows, ["model", "cold s", "warm s", "resume s", "resume, no cache s",
                             "warm / cold", "resume / cold", "resume / no cache"]))
  print("target: warm / cold and resume / cold <= 0.40 (seconds from the command to the first "
        "step's record)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
