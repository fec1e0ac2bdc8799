"""Train-step time of the stablejax stability stack over plain `clip_by_global_norm + AdamW`.

Usage:
  python -m bench.overhead            # stablejax/configs/default.json model, 15 interleaved rounds
  python -m bench.overhead --quick    # a smaller model, 8 rounds, no per-component breakdown

Both sides run the trainer's own jitted `train_step`
(`stablejax.training.loop.step.make_train_step`, donated state) on the same GPT, the same batch of
the embedded corpus and the same compiled
shapes, in one process:

  baseline  optax.chain(clip_by_global_norm(1.0), adamw)
  stack     skip_nonfinite(skip_spikes(chain(zclip, adamw)))   (the trainer's defaults,
            built by stablejax.training.optim.build_optimizer with optimizer.name="adamw")

(both chains end in the trainer's one-multiply LR-backoff scale). Without `--quick`, single layers
are timed too (skip_nonfinite alone, skip_spikes alone, zclip, adagc, zclip+adagc) to show where
the time goes. Each call runs `--steps-per-call` steps back to back (asynchronous dispatch, one
wait at the end) and yields seconds per step; the variants are called in turn, A, B, A, B, ...,
and the report gives medians after compilation and warm-up, the quartiles, compile times
separately, and the median of the per-round ratios (each ratio pairs measurements taken
moments apart). Target: stack / baseline <= 1.05.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax

from bench import _common
from stablejax.modeling.gpt import count_params, model_flops_per_token
from stablejax.training.optim import build_optimizer

ROOT = Path(__file__).resolve().parent.parent

DEFAULT_CONFIG = ROOT / "stablejax" / "configs" / "default.json"
QUICK_MODEL = {"model": {"d_model": 128, "n_layers": 2, "n_heads": 4, "max_seq_len": 64},
               "train": {"seq_len": 64, "batch_size": 8}}
TARGET = 1.05


def variants(base: dict, breakdown: bool) -> dict[str, tuple[dict, bool]]:
  """name -> (config overrides, use the plain optax chain)."""
  on = _common.defences_on
  out = {"baseline": ({}, True),
         "stack": ({"stability": {}}, False)}
  if breakdown:
    out.update({
        "skip_nonfinite": ({"stability": on("skip_nonfinite", "clip")}, False),
        "skip_spikes": ({"stability": on("skip_spikes", "clip")}, False),
        "zclip": ({"stability": on("zclip")}, False),
        "adagc": ({"stability": on("adagc")}, False),
        "zclip+adagc": ({"stability": on("zclip", "adagc")}, False),
    })
  return out


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--quick", action="store_true")
  p.add_argument("--rounds", type=int, default=None)
  p.add_argument("--steps-per-call", type=int, default=3)
  args = p.parse_args(argv)
  rounds = args.rounds or (8 if args.quick else 15)

  base = json.loads(DEFAULT_CONFIG.read_text())
  base["optimizer"] = {"name": "adamw", "learning_rate": 1e-3}
  if args.quick:
    base = _common.deep_merge(base, QUICK_MODEL)
  specs = variants(base, breakdown=not args.quick)

  _common.print_machine()
  cfg0 = _common.make_config(base)
  m, t = cfg0.model, cfg0.train
  batch = _common.fixed_batch(cfg0)
  steps = {}
  for name, (extra, plain) in specs.items():
    cfg = _common.make_config(base, extra)
    tx = _common.plain_adamw_chain(cfg, 1.0) if plain else build_optimizer(cfg)
    steps[name] = _common.CompiledStep(cfg, tx, batch)
  n_params = count_params(steps["baseline"].state.params)
  print(f"model: GPT d_model {m.d_model}, {m.n_layers} layers, {n_params / 1e6:.2f}M params, "
        f"compute {m.compute_dtype}; batch {t.batch_size} x seq {t.seq_len} "
        f"({model_flops_per_token(m, t.seq_len) * t.batch_size * t.seq_len / 1e9:.1f} GFLOP/step)")
  calls = {k: (lambda s=s: s.run(args.steps_per_call)) for k, s in steps.items()}
  times = _common.time_steps(calls, rounds, args.steps_per_call)
  base_t = times["baseline"]
  rows = []
  for name, s in steps.items():
    ts = times[name]
    ratio, r1, r3 = _common.paired_ratio(ts, base_t)
    loss = float(jax.device_get(s.last_metrics["loss"]))
    rows.append([name, *_common.ms_median_and_iqr(ts), f"{ratio:.3f}", f"{r1:.3f}-{r3:.3f}",
                 f"{s.compile_seconds:.2f}", f"{loss:.4f}"])
  print(_common.table(rows, ["variant", "median ms", "IQR ms", "ratio", "ratio IQR",
                             "compile s", "loss after"]))
  ratio = _common.paired_ratio(times["stack"], base_t)[0]
  print()
  print(f"stack / baseline = {ratio:.3f} (median of {rounds} paired rounds; "
        f"ratio of medians {_common.median(times['stack']) / _common.median(base_t):.3f}); "
        f"target <= {TARGET}: {'met' if ratio <= TARGET else 'NOT met'}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
