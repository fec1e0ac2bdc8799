"""Diagnose before healing: is each injected fault told right, and what do the checks cost?

Usage:
  python -m bench.diagnosis                # --sweep and --overhead (about 10 minutes on 2 cores)
  python -m bench.diagnosis --sweep        # each fault kind at several steps: the verdict table
  python -m bench.diagnosis --overhead     # step time, the checks at their defaults vs off
  python -m bench.diagnosis --overhead --devices 2   # with a replica check to pay for

--sweep trains a tiny GPT (the tests' size, 40 steps) once without faults and once per fault:

  transient_nan    NaN gradients on the first execution of three steps in a row (a flaky
                   device); expected: transient, and the run ends on the clean run's loss
  transient_spike  the gradient x 1e8 on the first execution of two steps (skip_spikes skips
                   them, two in a row ask for a rollback); expected: transient, as above
  batch_nan        NaN gradients from three batches in a row (the data); expected: reproduced,
                   a rollback, the batches rejected
  step_spike       the gradient x 1e8 at two steps in a row, on every execution (a fault of the
                   step itself, not of the device); expected: reproduced, rollbacks (the steps
                   fail again after each, so the run ends with exit code 3 once the recovery
                   budget is spent: every replay on the way must say reproduced)

and prints one row per run: the verdicts of its replays, its rollbacks, its final validation
loss against the clean run's, the steps and seconds the replays cost, and whether the verdict is
the expected one. A right verdict for a transient fault also needs the clean run's final loss to
the bit (no backoff, no skipped data). The last line is the share of right verdicts.

--overhead runs the default config's trainer (stablejax/configs/default.json, 60 steps) with the
diagnosis at its defaults (replay on, which keeps the per-device fault counts in the step; the
watchdog's thread; the replica check every 100 steps and before every save when parameters have
copies on several devices) and with all of it off, in interleaved rounds, and prints the median
seconds per step of each after the first logging interval (which holds the compilation) and
their ratio. Target: within 2%.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.max_seq_len=32",
        "model.compute_dtype=\"float32\"", "model.qk_norm=false", "train.seq_len=32",
        "train.batch_size=8", "train.steps=40", "train.warmup_steps=4", "train.log_every=2",
        "train.eval_every=20", "train.eval_batches=2", "optimizer.learning_rate=0.01",
        "optimizer.adam_learning_rate=0.01", "optimizer.embedding_learning_rate=0.01",
        "optimizer.head_learning_rate=0.01", "stability.skip_spikes.min_history=8",
        "stability.skip_spikes.window=16", "stability.zclip.warmup_steps=5",
        "checkpoint.every=10", "checkpoint.async_save=false", "logging.tensorboard=false",
        "logging.progress=false", "logging.histogram_every=0", "logging.activation_every=0",
        "logging.sample_every=0", "train.peak_flops_per_device=1e12",
        "stability.skip_nonfinite.max_consecutive=3", "stability.skip_spikes.max_consecutive=2",
        "stability.recovery.max_transients=10"]

# kind -> (expected verdict, faults for a start step s)
KINDS = {
    "transient_nan": ("transient", lambda s: [f"faults.transient_nan_steps={[s, s + 1, s + 2]}"]),
    "transient_spike": ("transient", lambda s: [f"faults.transient_grad_scale_steps={[s, s + 1]}",
                                                "faults.grad_scale_factor=1e8"]),
    "batch_nan": ("reproduced", lambda s: [f"faults.nan_grad_batch_indices={[s, s + 1, s + 2]}"]),
    "step_spike": ("reproduced", lambda s: [f"faults.grad_scale_steps={[s, s + 1]}",
                                            "faults.grad_scale_factor=1e8"]),
}
STEPS = (12, 22, 32)


def _run(out: Path, overrides: list[str]) -> dict:
  import contextlib
  import io
  import json
  from stablejax.training.config import load_config
  from stablejax.training.loop.trainer import Trainer
  cfg = load_config(ROOT / "stablejax" / "configs" / "default.json", overrides)
  with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    code = Trainer(cfg, out, fresh=True).train()
  records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
  summary = json.loads((out / "summary.json").read_text())
  return {"code": code, "records": records, "summary": summary}


def sweep() -> int:
  from bench import _common
  rows, right = [], 0
  with tempfile.TemporaryDirectory() as tmp:
    clean = _run(Path(tmp) / "clean", TINY)["summary"]["final_val_loss"]
    for kind, (expected, faults) in KINDS.items():
      for step in STEPS:
        run = _run(Path(tmp) / f"{kind}_{step}", TINY + faults(step))
        replays = [r for r in run["records"] if r.get("event") == "replay"]
        verdicts = [r["verdict"] for r in replays]
        loss = run["summary"]["final_val_loss"]  # None: stopped (a step fault that comes back
        ok = bool(verdicts) and all(v == expected for v in verdicts)  # ends in exit code 3)
        if expected == "transient":
          ok = ok and loss == clean and run["summary"]["rollbacks"] == 0
        else:
          ok = ok and run["summary"]["rollbacks"] >= 1
        right += ok
        rows.append([kind, step, expected, ",".join(verdicts) or "-", run["summary"]["rollbacks"],
                     f"{loss:.6f}" if loss is not None else f"- (exit {run['code']})",
                     f"{loss - clean:+.2e}" if loss is not None else "-",
                     sum(r["replayed_steps"] for r in replays),
                     f"{sum(r['replay_seconds'] for r in replays):.2f}", "yes" if ok else "NO"])
  print(f"clean run: final val loss {clean:.6f}")
  print(_common.table(rows, ["fault", "at step", "expected", "verdicts", "rollbacks",
                             "final val loss", "vs clean", "replayed steps", "replay s", "right"]))
  print(f"right verdicts: {right}/{len(rows)} ({100 * right / len(rows):.0f}%)")
  return 0 if right == len(rows) else 1


OFF = ["stability.recovery.replay=false", "stability.watchdog.enabled=false",
       "stability.replicas.check_every=0"]


def overhead(rounds: int) -> int:
  import statistics
  from bench import _common
  base = ["train.steps=60", "train.eval_every=1000", "logging.progress=false",
          "logging.sample_every=0", "logging.tensorboard=false", "checkpoint.every=30",
          "train.peak_flops_per_device=1e12"]
  per_step: dict[str, list[float]] = {"checks at defaults": [], "checks off": []}
  with tempfile.TemporaryDirectory() as tmp:
    for i in range(rounds):
      for name, extra in (("checks at defaults", []), ("checks off", OFF)):
        run = _run(Path(tmp) / f"{name}_{i}".replace(" ", "_"), base + extra)
        tokens = [r["tokens_per_sec"] for r in run["records"]
                  if "tokens_per_sec" in r and "event" not in r][2:]  # after the compilation
        per_step[name].append(statistics.median(16 * 128 / t for t in tokens))
  on, off = (per_step[k] for k in ("checks at defaults", "checks off"))
  rows = [[name, _common.ms(_common.median(v))] for name, v in per_step.items()]
  print(_common.table(rows, ["variant", "median s/step"]))
  ratio, low, high = _common.paired_ratio(on, off)
  print(f"checks at defaults / off: {ratio:.3f} (quartiles of the per-round ratios {low:.3f} .. "
        f"{high:.3f}; target <= 1.02)")
  return 0


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sweep", action="store_true", help="the verdict table")
  parser.add_argument("--overhead", action="store_true", help="the step time with the checks")
  parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds of --overhead")
  parser.add_argument("--devices", type=int, default=None,
                      help="simulated CPU devices (XLA_FLAGS); the replica check needs two")
  args = parser.parse_args(argv)
  if args.devices and "JAX_PLATFORMS" not in os.environ and "--xla_force_host" not in \
      os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={args.devices}").strip()
  from bench import _common
  _common.print_machine()
  both = not (args.sweep or args.overhead)
  code = 0
  if args.sweep or both:
    code |= sweep()
  if args.overhead or both:
    code |= overhead(args.rounds)
  return code


if __name__ == "__main__":
  sys.exit(main())
