"""AdamW vs outlier-safe Muon + SSNorm + EmbProj: activation kurtosis and 4-bit RTN val loss.

Usage:
  python -m bench.outlier_experiment            # 300 steps per setup, ~5-10 minutes on 2 CPU cores
  python -m bench.outlier_experiment --quick    # 40 steps, ~1-2 minutes (a smoke test, no CSV)
  python -m bench.outlier_experiment --steps 1000 --out runs/outlier

Trains the same model (d_model 128, 4 layers, 4 heads, seq 128, batch 16, float32 on CPU) on the
embedded corpus with the same seed and data order, twice, through the trainer
(``stablejax.training.loop.Trainer``, full stability stack in both):

  adamw        AdamW on every parameter, standard RMSNorm (vector gains)
  outlier_safe outlier-safe Muon (AdamW for embedding, head and gains), Single-Scale RMSNorm and
               EmbProj (Outlier-Safe Pre-Training, arXiv 2506.19697)

and reports for each: final val loss; ``excess_kurtosis`` from summary.json (mean over blocks of
the excess kurtosis of the residual stream on a fixed validation batch, measured at the last step);
``act_max / act_rms`` of the residual stream from the same measurement; and the val loss after
per-channel round-to-nearest weight quantisation to 4 and 3 bits
(``stablejax.training.trained.quantized_eval``; EmbProj merged first) with its increase. The table
is printed and written to ``bench/results/outlier_experiment.csv`` (``--quick`` writes a CSV only
when given ``--csv``, so a smoke test never replaces the recorded result).

One seed on a ~1M-parameter model trained for minutes is a small sample: the paper's effect is
about outliers that grow over long training of large models. Read the numbers as this project's
measurement on this setup, not as a verdict on the method.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"

ADAMW_LR = 3e-3   # AdamW, and the AdamW groups of the Muon run
MUON_LR = 0.01    # Muon matrices (stablejax/configs/default.json)

BASE = {
    "model": {"vocab_size": 256, "d_model": 128, "n_layers": 4, "n_heads": 4, "max_seq_len": 128,
              "compute_dtype": "float32"},
    "data": {"train": "pydoc"},
    "stability": {"zclip_warmup_steps": 25, "adagc_warmup_steps": 50, "spike_window": 64,
                  "spike_min_history": 32},
    "train": {"batch_size": 16, "seq_len": 128, "seed": 0, "eval_batches": 8, "log_every": 10,
              "peak_flops_per_device": 1e11},
    "checkpoint": {"keep": 1, "async_save": False},
    "logging": {"tensorboard": False, "progress": False, "histogram_every": 0},
}

SETUPS = {
    "adamw": {
        "model": {"norm": "rmsnorm", "emb_proj": False},
        "optimizer": {"name": "adamw", "learning_rate": ADAMW_LR},
    },
    "outlier_safe": {
        "model": {"norm": "ssnorm", "emb_proj": True},
        "optimizer": {"name": "muon", "learning_rate": MUON_LR, "adam_learning_rate": ADAMW_LR,
                      "embedding_learning_rate": ADAMW_LR, "head_learning_rate": ADAMW_LR},
    },
}

COLUMNS = ("setup", "steps", "final_val_loss", "excess_kurtosis", "act_max_over_rms",
           "val_loss_4bit", "increase_4bit", "val_loss_3bit", "increase_3bit", "skipped_steps",
           "rollbacks", "train_seconds")


def setup_config(name: str, steps: int, seed: int) -> dict:
  """The raw config dict of one setup (``config_from_dict`` validates it)."""
  from bench._common import deep_merge  # after main() put the repository on sys.path
  raw = deep_merge(BASE, SETUPS[name])
  raw["train"].update(steps=steps, seed=seed, warmup_steps=max(2, steps // 10),
                      eval_every=steps)          # one evaluation, at the end
  raw["checkpoint"]["every"] = steps            # the final state is the one quantised
  raw["logging"]["activation_every"] = steps    # kurtosis of the final state
  return raw


def _last_activation_record(run_dir: Path) -> dict:
  last = {}
  for line in (run_dir / "metrics.jsonl").read_text().splitlines():
    try:
      record = json.loads(line)
    except json.JSONDecodeError:
      continue  # a truncated last line
    if "excess_kurtosis" in record:
      last = record
  return last


def run_setup(name: str, steps: int, seed: int, out_root: Path) -> dict:
  """Trains one setup in-process, then measures it; returns one table row."""
  from stablejax.training.config import config_from_dict
  from stablejax.training.loop.trainer import Trainer, write_config
  from stablejax.training.trained.quantized_eval import quantize_eval

  cfg = config_from_dict(setup_config(name, steps, seed))
  out = out_root / name
  write_config(cfg, out)  # quantize_eval reads it, as for any train.py run
  t0 = time.time()
  code = Trainer(cfg, out, fresh=True).train()
  seconds = time.time() - t0
  summary = json.loads((out / "summary.json").read_text())
  if code != 0:
    raise SystemExit(f"error: the {name} run ended with exit code {code}: see {out}")
  acts = _last_activation_record(out)
  row = {
      "setup": name,
      "steps": summary["steps"],
      "final_val_loss": summary["final_val_loss"],
      "excess_kurtosis": summary["excess_kurtosis"],
      "act_max_over_rms": acts["act_max"] / acts["act_rms"] if acts else float("nan"),
      "skipped_steps": summary["skipped_steps"],
      "rollbacks": summary["rollbacks"],
      "train_seconds": seconds,
  }
  for bits in (4, 3):
    q = quantize_eval(out, bits, write=bits == 4)
    row[f"val_loss_{bits}bit"] = q["val_loss_after"]
    row[f"increase_{bits}bit"] = q["delta"]
  return row


def _fmt(value) -> str:
  if isinstance(value, float):
    return f"{value:.4f}" if abs(value) < 1e4 else f"{value:.3g}"
  return str(value)


def print_table(rows: list[dict]) -> None:
  cells = [list(COLUMNS)] + [[_fmt(r[c]) for c in COLUMNS] for r in rows]
  widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
  for k, row in enumerate(cells):
    print("  ".join(cell.rjust(w) if k else cell.ljust(w) for cell, w in zip(row, widths)))


def machine_line() -> str:
  import jax
  return (f"machine: {platform.machine()}, {os.cpu_count()} CPUs, {jax.devices()[0].device_kind},"
          f" jax {jax.__version__}, python {platform.python_version()}")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="40 steps per setup (~1-2 minutes)")
  parser.add_argument("--steps", type=int, default=None, help="steps per setup (default 300)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", default=None,
                      help="directory for the two runs (default: a temporary directory)")
  parser.add_argument("--csv", default=None, help="CSV path (default bench/results/...)")
  args = parser.parse_args(argv)
  steps = args.steps or (40 if args.quick else 300)
  if steps < 20:
    parser.error("--steps must be at least 20")
  csv_path = Path(args.csv) if args.csv else (None if args.quick else
                                               RESULTS / "outlier_experiment.csv")

  sys.path.insert(0, str(ROOT))
  print(machine_line())
  print(f"{steps} steps per setup, seed {args.seed}, d_model 128, 4 layers, seq 128, batch 16")
  t0 = time.time()
  with tempfile.TemporaryDirectory(prefix="outlier_experiment_") as tmp:
    out_root = Path(args.out) if args.out else Path(tmp)
    rows = []
    for name in SETUPS:
      print(f"--- {name}: {json.dumps(SETUPS[name])}", flush=True)
      rows.append(run_setup(name, steps, args.seed, out_root))
  print()
  print_table(rows)
  a, b = rows
  print()
  print(f"outlier_safe vs adamw: excess kurtosis {b['excess_kurtosis']:.3f} vs "
        f"{a['excess_kurtosis']:.3f}; 4-bit increase {b['increase_4bit']:+.4f} vs "
        f"{a['increase_4bit']:+.4f}; 3-bit increase {b['increase_3bit']:+.4f} vs "
        f"{a['increase_3bit']:+.4f}; val loss {b['final_val_loss']:.4f} vs "
        f"{a['final_val_loss']:.4f}")
  if csv_path is None:
    print(f"--quick: no CSV written ({time.time() - t0:.0f}s in all)")
    return 0
  csv_path.parent.mkdir(parents=True, exist_ok=True)
  with open(csv_path, "w", newline="") as f:
    f.write(f"# {machine_line()}\n# {steps} steps, seed {args.seed}; "
            f"python -m bench.outlier_experiment{' --quick' if args.quick else ''}\n")
    writer = csv.DictWriter(f, fieldnames=COLUMNS)
    writer.writeheader()
    for row in rows:
      writer.writerow({k: row[k] for k in COLUMNS})
  print(f"wrote {csv_path} ({time.time() - t0:.0f}s in all)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
