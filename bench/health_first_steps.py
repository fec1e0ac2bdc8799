"""Gradient health in a config's first steps: the trainer's own step on the embedded corpus.

Usage:
  python -m bench.health_first_steps                  # gpt2_small, batch 2 x 256, 20 steps
  python -m bench.health_first_steps --config default --steps 50 --batch 16 --seq-len 128
  python -m bench.health_first_steps --json tests/data/gpt2_small_first_steps.json

Runs the first `--steps` steps of the config's train step (`bench._common.trainer_step`: its
model, optimizer stack and learning-rate schedule; the data replaced by the embedded corpus and
the batch reduced so that it runs on a CPU), logs every step, and feeds each step's record to two
`stablejax.StabilityMonitor`s: one with the default thresholds (relative to the run's own median
gradient norm) and one with the same boundaries as absolute norms
(`HealthThresholds(relative=False)`). Prints each step's loss, gradient norm and both levels, and
the warning lines of each; `--json` also writes them, with the command, to a file.

A healthy initialisation must give no warning with the default thresholds.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import numpy as np

import stablejax
from bench import _common


def first_steps(config: str, steps: int, batch: int, seq_len: int, seed: int = 0) -> dict:
  """Grad norms, losses and the levels and warnings of both monitors for the first steps."""
  from stablejax.data.pipeline import build_data
  cfg = _common.trainer_config(config, ["data.train=pydoc", "data.val=null",
                                        f"train.batch_size={batch}", f"train.seq_len={seq_len}",
                                        "train.grad_accum=1", f"train.seed={seed}"])
  data = iter(build_data(cfg.data, seq_len=seq_len, batch_size=batch, seed=seed).train_iter())

  def next_batch() -> dict:
    tokens = np.asarray(next(data)["tokens"], np.int32)[None]  # (grad_accum, B, T + 1)
    return {"tokens": jax.numpy.asarray(tokens), "grad_scale": jax.numpy.float32(1.0),
            "run_steps": jax.numpy.int32(cfg.train.steps),
            "read_metrics": jax.numpy.bool_(True)}  # every step's metrics are read here

  run = _common.trainer_step(cfg, "full", next_batch(), seed=seed)
  monitors = {"relative": stablejax.StabilityMonitor(),
              "absolute": stablejax.StabilityMonitor(
                  thresholds=stablejax.HealthThresholds(relative=False))}
  out: dict = {"config": config, "batch": batch, "seq_len": seq_len, "steps": [],
               "warnings": {name: [] for name in monitors}}
  state, batch_tokens = run.state, run.batch
  for step in range(1, steps + 1):
    state, metrics = run.compiled(state, batch_tokens)
    record = {k: np.asarray(v).item() for k, v in jax.device_get(metrics).items()}
    row = {"step": step, "loss": record["loss"], "grad_norm": record["grad_norm"]}
    for name, monitor in monitors.items():
      lines = monitor.update(step, record)
      out["warnings"][name] += lines
      row[name] = monitor.level
    out["steps"].append(row)
    print(f"step {step:3d}  loss {row['loss']:.4f}  grad norm {row['grad_norm']:9.4f}  "
          f"relative {row['relative']:9s} absolute {row['absolute']}", flush=True)
    batch_tokens = next_batch()
  return out


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--config", default="gpt2_small")
  p.add_argument("--steps", type=int, default=20)
  p.add_argument("--batch", type=int, default=2)
  p.add_argument("--seq-len", type=int, default=256)
  p.add_argument("--json", default=None, help="also write the steps and warnings to this file")
  a = p.parse_args(argv)
  _common.print_machine()
  result = first_steps(a.config, a.steps, a.batch, a.seq_len)
  result["command"] = "python -m bench.health_first_steps " + " ".join(
      sys.argv[1:] if argv is None else argv)
  for name, lines in result["warnings"].items():
    print(f"\n{name} thresholds: {len(lines)} warning(s)")
    for line in lines:
      print(f"  {line}")
  if a.json:
    Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
