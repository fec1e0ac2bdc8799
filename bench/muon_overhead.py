"""Train-step time of outlier-safe Muon over AdamW, next to the analytic Newton-Schulz cost.

Usage:
  python -m bench.muon_overhead      # the default config's model, 12 interleaved rounds
  python -m bench.muon_overhead --quick   # a smaller model, 6 rounds

Four trainer train steps (`stablejax.training.loop.step.make_train_step`, jitted with donation) on
the same GPT, batch and compiled shapes, timed interleaved in one process:

  adamw             AdamW alone (optimizer.name="adamw", every stability layer off)
  muon              stablejax.outlier_safe_muon alone (optimizer.name="muon": Muon for the
                    hidden matrices, AdamW for embedding, head and norms)
  adamw+stack       the trainer's stability stack around AdamW
  muon+stack        the trainer's default: the stack around outlier-safe Muon

The analytic estimate is the FLOPs of Newton-Schulz for the Muon-routed matrices,
``ns_steps * batch * (4 n^2 m + 2 n^3)`` for a stacked ``[batch, n, m]`` matrix with ``n <= m``
(three matmuls per quintic iteration), over the forward+backward FLOPs of the step
(``model_flops_per_token * tokens``, the trainer's MFU convention: 6 N + 12 L D T per token).
It is the extra time Muon should cost if NS ran at the same FLOP rate as the model's matmuls;
the Muon branch's elementwise work (momentum, outlier z-scores, health check) is not in it.
Also shown: the measured time of `stablejax.newton_schulz` alone on the same matrices.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import stablejax
from bench import _common
from stablejax.modeling.gpt import count_params, model_flops_per_token
from stablejax.training.optim import build_optimizer

ROOT = Path(__file__).resolve().parent.parent

DEFAULT_CONFIG = ROOT / "stablejax" / "configs" / "default.json"
QUICK_MODEL = {"model": {"d_model": 128, "n_layers": 2, "n_heads": 4, "max_seq_len": 64},
               "train": {"seq_len": 64, "batch_size": 8}}


def ns_flops(shape: tuple[int, ...], steps: int) -> float:
  *lead, r, c = shape
  n, m = min(r, c), max(r, c)
  return float(steps * int(np.prod(lead or [1])) * (4 * n * n * m + 2 * n ** 3))


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--quick", action="store_true")
  p.add_argument("--rounds", type=int, default=None)
  p.add_argument("--steps-per-call", type=int, default=3)
  args = p.parse_args(argv)
  rounds = args.rounds or (6 if args.quick else 12)

  base = json.loads(DEFAULT_CONFIG.read_text())  # Muon LRs of the default config
  if args.quick:
    base = _common.deep_merge(base, QUICK_MODEL)
  off = {"stability": _common.stability_off()}
  adamw = {"optimizer": {"name": "adamw", "learning_rate": 1e-3}}
  specs = {"adamw": [adamw, off], "muon": [off], "adamw+stack": [adamw], "muon+stack": []}

  _common.print_machine()
  cfg0 = _common.make_config(base)
  m, t = cfg0.model, cfg0.train
  batch = _common.fixed_batch(cfg0)
  steps = {name: None for name in specs}
  for name, extra in specs.items():
    cfg = _common.make_config(base, *extra)
    steps[name] = _common.CompiledStep(cfg, build_optimizer(cfg), batch)

  params = steps["adamw"].state.params
  labels = stablejax.label_params(params)
  muon_shapes = [tuple(x.shape) for x, g in zip(jax.tree.leaves(params), jax.tree.leaves(labels))
                 if g == "muon"]
  ns_steps = cfg0.optimizer.ns_steps
  ns = sum(ns_flops(s, ns_steps) for s in muon_shapes)
  fwd_bwd = model_flops_per_token(m, t.seq_len) * t.batch_size * t.seq_len
  print(f"model: GPT d_model {m.d_model}, {m.n_layers} layers, {count_params(params) / 1e6:.2f}M "
        f"params, compute {m.compute_dtype}; batch {t.batch_size} x seq {t.seq_len}")
  print(f"Muon matrices: {', '.join('x'.join(map(str, s)) for s in muon_shapes)}; "
        f"NS {ns_steps} steps ({cfg0.optimizer.ns_backend} backend -> XLA on CPU)")
  print(f"analytic: NS {ns / 1e9:.3f} GFLOP / forward+backward {fwd_bwd / 1e9:.2f} GFLOP "
        f"= {ns / fwd_bwd:.3f} (expected Muon/AdamW step ratio ~ {1 + ns / fwd_bwd:.3f} at equal "
        f"FLOP rate)")

  # Newton-Schulz alone on the same matrices (what the Muon branch runs per step).
  mats = [jax.random.normal(jax.random.key(i), s, jnp.float32) for i, s in enumerate(muon_shapes)]
  ns_fn = jax.jit(
      lambda xs: [stablejax.newton_schulz(x, steps=ns_steps, backend="xla") for x in xs])
  t0 = time.perf_counter()
  ns_compiled = ns_fn.lower(mats).compile()
  ns_compile = time.perf_counter() - t0

  def ns_run(n=args.steps_per_call):
    t0 = time.perf_counter()
    for _ in range(n):
      out = ns_compiled(mats)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / n

  runners = {k: (lambda s=s: s.run(args.steps_per_call)) for k, s in steps.items()}
  runners["newton_schulz"] = ns_run
  times = _common.time_steps(runners, rounds, args.steps_per_call)
  rows = []
  for name, ts in times.items():
    ref = "muon" if name == "newton_schulz" else ("adamw" if "stack" not in name else "adamw+stack")
    r = _common.paired_ratio(ts, times[ref]) if name != "newton_schulz" else (
        _common.paired_ratio(ts, times["adamw"]))
    compile_s = ns_compile if name == "newton_schulz" else steps[name].compile_seconds
    rows.append([name, *_common.ms_median_and_iqr(ts), f"{r[0]:.3f}",
                 "adamw" if name == "newton_schulz" else ref, f"{compile_s:.2f}"])
  print(_common.table(rows, ["variant", "median ms", "IQR ms", "ratio", "over", "compile s"]))
  bare = _common.paired_ratio(times["muon"], times["adamw"])[0]
  full = _common.paired_ratio(times["muon+stack"], times["adamw+stack"])[0]
  ns_share = _common.paired_ratio(times["newton_schulz"], times["adamw"])[0]
  print()
  print(f"Muon / AdamW step: {bare:.3f} alone, {full:.3f} inside the stack; analytic NS estimate "
        f"{1 + ns / fwd_bwd:.3f}; NS alone measured at {ns_share:.3f} of an AdamW step "
        f"(so NS accounts for ~{ns_share / max(bare - 1, 1e-9) * 100:.0f}% of Muon's extra time)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
