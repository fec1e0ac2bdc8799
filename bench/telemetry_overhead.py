"""Cost of the attention-logit telemetry and of QK-clip, per train step, measured side by side.

Usage:
  python -m bench.telemetry_overhead   # the default config's model and stack, 12 rounds
  python -m bench.telemetry_overhead --quick    # a smaller model, 6 rounds

Three variants of the trainer's own jitted `train_step` (`stablejax.training.loop.step`), same model
(the default config's, without QK-norm so that QK-clip can run), same batch of the embedded
corpus, same optimizer (the default stack of stablejax/configs/default.json),
called in turn (A, B, C, A, B, C, ...) in one process; each call runs one log interval
(`train.log_every` steps, 10) back to back and waits once:

  plain      log_every train steps (`logging.attention_logits=false`)
  telemetry  log_every train steps + the loop's telemetry at the log step, dispatched after the
             last step as the loop does (`make_logit_telemetry`: one forward pass of
             `logging.attention_sequences` sequences, per-layer max attention logit, output max
             logit and log Z)
  qk_clip    log_every train steps with `stability.qk_clip.enabled=true` (the step's forward pass
             computes every head's max logit; QK-clip rescales W_q, W_k after the update)

Reported: median ms per train step after compilation and a warm-up round, and the median of the
per-round ratios to `plain` (each ratio pairs calls made moments apart, so load from other
processes on a shared machine hits both sides alike). Target for the telemetry: <= 1.03.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax

from bench import _common
from stablejax.modeling.gpt import count_params
from stablejax.training.config import model_of
from stablejax.training.optim import build_optimizer
from stablejax.training.loop.step import make_logit_telemetry

ROOT = Path(__file__).resolve().parent.parent

DEFAULT_CONFIG = ROOT / "stablejax" / "configs" / "default.json"
QUICK_MODEL = {"model": {"d_model": 64, "n_layers": 4, "n_heads": 4, "max_seq_len": 64},
               "train": {"seq_len": 64, "batch_size": 8}}
TARGET = 1.03


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--quick", action="store_true")
  p.add_argument("--rounds", type=int, default=None)
  p.add_argument("--tau", type=float, default=100.0, help="QK-clip threshold of the qk_clip side")
  args = p.parse_args(argv)
  rounds = args.rounds or (6 if args.quick else 12)

  base = json.loads(DEFAULT_CONFIG.read_text())
  # QK-clip acts on models without QK-norm (the trainer refuses it with QK-norm): all three
  # variants use the same model without it.
  base = _common.deep_merge(base, {"model": {"qk_norm": False}})
  if args.quick:
    base = _common.deep_merge(base, QUICK_MODEL)
  _common.print_machine()
  cfg = _common.make_config(base)
  cfg_qk = _common.make_config(base, {"stability": {"qk_clip": {"enabled": True, "tau": args.tau}}})
  batch = _common.fixed_batch(cfg)
  every = cfg.train.log_every
  steps = {"plain": _common.CompiledStep(cfg, build_optimizer(cfg), batch),
           "telemetry": _common.CompiledStep(cfg, build_optimizer(cfg), batch),
           "qk_clip": _common.CompiledStep(cfg_qk, build_optimizer(cfg_qk), batch)}
  telemetry = jax.jit(make_logit_telemetry(model_of(cfg), cfg))
  jax.block_until_ready(telemetry(steps["telemetry"].state.params, batch["tokens"], 0))

  def interval_with_telemetry() -> float:
    # As the loop does it: log_every steps, the telemetry dispatched after the last one (no
    # wait in between), then one wait for everything.
    s = steps["telemetry"]
    t0 = time.perf_counter()
    state = s.state
    for _ in range(every):
      state, metrics = s.compiled(state, s.batch)
    extra = telemetry(state.params, s.batch["tokens"], 0)
    jax.block_until_ready((state, metrics, extra))
    s.state = state
    return (time.perf_counter() - t0) / every

  runners = {"plain": lambda: steps["plain"].run(every),
             "telemetry": interval_with_telemetry,
             "qk_clip": lambda: steps["qk_clip"].run(every)}
  m, t = cfg.model, cfg.train
  print(f"model: GPT d_model {m.d_model}, {m.n_layers} layers, {m.n_heads} heads, "
        f"{count_params(steps['plain'].state.params) / 1e6:.2f}M params, compute "
        f"{m.compute_dtype}; batch {t.batch_size} x seq {t.seq_len}; optimizer {cfg.optimizer.name}"
        f" with the default stack; telemetry on {cfg.logging.attention_sequences} sequences every "
        f"{every} steps; QK-clip tau {args.tau:g}")
  print(f"timing: {rounds} interleaved rounds of {every} steps per variant after 1 warm-up round;"
        " ms per train step")
  print()
  times = _common.interleaved(runners, rounds)
  rows = []
  for name in runners:
    ratio, r1, r3 = _common.paired_ratio(times[name], times["plain"])
    rows.append([name, *_common.ms_median_and_iqr(times[name]), f"{ratio:.3f}",
                 f"{r1:.3f}-{r3:.3f}"])
  print(_common.table(rows, ["variant", "median ms/step", "IQR", "ratio to plain", "ratio IQR"]))
  ratio = _common.paired_ratio(times["telemetry"], times["plain"])[0]
  print()
  print(f"telemetry / plain = {ratio:.3f} (median of {rounds} paired rounds); target <= {TARGET}: "
        f"{'met' if ratio <= TARGET else 'NOT met'}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
