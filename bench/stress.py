"""Learning-rate sensitivity of each defence (Wortsman et al., arXiv 2309.14322), real trainer runs.

Usage:
  python -m bench.stress                  # full sweep (about an hour on 2 cores):
                                          #   bench/results/stress*
  python -m bench.stress --quick          # minutes: Pre-LN only, 3 learning rates, 1 seed
  python -m bench.stress --diagnose       # variants of the stablejax stacks at 1x and 10x, 3 seeds
  python -m bench.stress --muon-methods --results bench/results/stress_long_muon_runs.jsonl
                                          # per-head Muon and NorMuon, long horizon (hours)
  python -m bench.stress --models preln --defences clip1,stablejax --lr-factors 1,10 --seeds 0,1,2 \
      --variant 'lam2=stablejax:stability.adagc.lambda_rel=2.0'
  python -m bench.stress --replot DIR/results.json   # rebuild the table, CSV, PNGs, markdown

What one cell is: a real `stablejax.training.loop.Trainer` (jitted train step, data pipeline,
evaluation, checkpoints, monitor, recovery) of a byte-level GPT on the embedded corpus, one seed
(model init and data order), one learning rate, one defence. The final validation loss is the
mean cross-entropy over fixed validation batches (the same for every run).

Learning rates. The grid is factors of a base rate, half a decade apart: 10^-0.5 .. 10^1.5 =
0.32x, 1x, 3.2x, 10x, 32x. The base AdamW rate is the best rate of plain clip-1.0 + AdamW on the
Pre-LN model (found by a sweep with this script, see bench/results/stress.md); the Muon defences
scale their base rates (Muon matrices and their AdamW groups together) by the same factors. A
factor multiplies every learning rate of the run; it is applied through the trainer's own
learning-rate scale, so the whole grid shares one compiled train step (see
`_common.trainer_run_class`).

Defences (the AdamW ones as in bench/scenarios.py; every stablejax chain is built by
`stablejax.training.optim.build_optimizer` from the config, so changed defaults show up here):
  none, clip1, apply_if_finite, zclip, adagc, skip_spikes  one technique each around AdamW
  stablejax        the trainer's default AdamW stack: skip_nonfinite(skip_spikes(ZClip + AdamW))
                   + rollback recovery
  stablejax_adagc  the same with AdaGC after ZClip, the default before this sweep
  muon_clip1       optax.clip_by_global_norm(1.0) + optax.contrib.muon (hidden matrices, same
                   routing as stablejax: embeddings, head and norms go to its AdamW branch)
  stablejax_muon   the trainer's default stack around outlier-safe Muon
  stablejax_muon_perhead, stablejax_muon_normuon, stablejax_muon_perhead_normuon
                   the same with optimizer.per_head (attention projections orthogonalised per
                   head), optimizer.normuon (NorMuon), or both (--muon-methods runs them)
`--variant NAME=BASE:section.key=value,...` adds a defence: BASE with config overrides (JSON
values), e.g. `lam2=stablejax:stability.adagc.lambda_rel=2.0`. `--diagnose` runs the predefined
variants of DIAGNOSIS.

Models (all 8 layers, d_model 64): preln, preln_qk (QK-norm), postln, postln_qk, preln_nowarmup
(no LR warmup), preln_fp16 (fp16 compute with the trainer's dynamic loss scaling).

Runs log every 10 steps, the trainer's default: the recovery's loss trigger and the monitor count
logged values, so they behave here as in a default run (`--variant` can set `train.log_every`).

Per run: final val loss, diverged (the run did not end with a finite val loss below the loss at
initialisation, or the trainer gave up after its rollback budget), loss spikes (a logged train
loss non-finite or > 1.25 x the median of the previous 5 logged losses, i.e. 50 steps;
`scenarios.count_spikes`), skipped steps, rollbacks, monitor warnings, ZClip clip rate, AdaGC
clipped-tensor fraction and the ratio of AdaGC's output norm to its input norm (after AdaGC's
warmup; these three sampled at the logged steps), wall and CPU seconds, ms per step.

Per defence (per model), over the grid, from the per-run losses clamped as the paper does,
min(loss, loss at init) (a diverged run counts as the loss at init):
  best-LR loss     the grid rate with the lowest seed-mean loss, its mean +/- sd over seeds;
  LR sensitivity   mean over the grid of (seed-mean loss at that rate - best seed-mean loss),
                   the paper's E_eta[min(l(eta), l_0) - l*] on the seed-mean curve; +/- the sd of
                   the same number computed per seed.
The comparison against clip1 (same model): best-LR loss gap, and the gap at clip1's best rate
against one standard error of clip1's mean there (sd / sqrt(seeds)); sensitivity ratio.
"""

from __future__ import annotations

import argparse
import concurrent.futures as futures
import contextlib
import csv
import io
import json
import math
import multiprocessing
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import textwrap
import time
import traceback
from pathlib import Path

from bench import _common
from bench import scenarios

ROOT = Path(__file__).resolve().parent.parent

RESULTS = ROOT / "bench" / "results"

# Base learning rates (factor 1 of the grid). ADAMW_LR: the best grid rate of clip1 on preln.
ADAMW_LR = 3e-3
# Muon: the trainer's default config has Muon 0.01 and AdamW groups 0.003; muon_clip1 was best at
# 3.16x those on preln (seed 0, 0.1x .. 31.6x), so the Muon grid is centred there.
MUON_LR = 0.03        # Muon matrices
MUON_ADAM_LR = 0.009  # AdamW groups of the Muon runs: embedding, head, norms
LR_FACTORS = tuple(round(10 ** (k / 2), 4) for k in range(-1, 4))   # 0.3162 .. 31.62
SEEDS = (0, 1, 2)

BASE = {
    "model": {"vocab_size": 256, "d_model": 64, "n_layers": 8, "n_heads": 4, "max_seq_len": 64,
              "compute_dtype": "float32", "qk_norm": False},
    "data": {"train": "pydoc"},
    "optimizer": {"name": "adamw", "learning_rate": ADAMW_LR},
    "stability": {"zclip": {"warmup_steps": 25}, "adagc": {"warmup_steps": 50},
                  "skip_spikes": {"window": 64, "min_history": 32}},
    "train": {"batch_size": 8, "seq_len": 64, "eval_batches": 16, "log_every": 10,
              "peak_flops_per_device": 1e11},
    "checkpoint": {"keep": 2},
    "logging": {"tensorboard": False, "progress": False, "histogram_every": 0,
                "activation_every": 0},
}
STEPS = 200
SPIKE_WINDOW = 5   # logged losses (50 steps at log_every 10)

MODELS = {
    "preln": {},
    "preln_qk": {"model": {"qk_norm": True}},
    "postln": {"model": {"post_ln": True}},
    "postln_qk": {"model": {"post_ln": True, "qk_norm": True}},
    "preln_nowarmup": {"train": {"warmup_steps": 0}},
    "preln_fp16": {"model": {"compute_dtype": "float16"}},
    # The long horizon (LONG_STEPS), where attention logits of Pre-LN models without QK-norm
    # grow until the loss degrades (Wortsman et al., section 3.1.1). A model fragment with
    # train.steps fixes the run length (--steps does not apply to it).
    "long": {"train": {"steps": 800, "warmup_steps": 0}},
    "long_warmup": {"train": {"steps": 800, "warmup_steps": 80}},
    "long_qk": {"model": {"qk_norm": True}, "train": {"steps": 800, "warmup_steps": 0}},
    "long_qk_warmup": {"model": {"qk_norm": True}, "train": {"steps": 800, "warmup_steps": 80}},
}
LONG_MODELS = ("long", "long_warmup", "long_qk", "long_qk_warmup")
QK_TWIN = {"long": "long_qk", "long_warmup": "long_qk_warmup"}  # the same model with QK-norm
QK_GAIN_MIN = 0.05

_MUON_OPT = {"name": "muon", "learning_rate": MUON_LR, "adam_learning_rate": MUON_ADAM_LR,
             "embedding_learning_rate": MUON_ADAM_LR, "head_learning_rate": MUON_ADAM_LR}
# name -> (config fragment, optional tx builder cfg -> chain). The AdamW ones are
# bench/scenarios.py's: the baselines, each declared defence alone, the default stack.
DEFENCES = {name: (fragment, None) for name, fragment in scenarios.DEFENCES.items()
            if name != "stablejax+muon"}
DEFENCES["apply_if_finite"] = (scenarios.DEFENCES["apply_if_finite"], "apply_if_finite")
DEFENCES["muon_clip1"] = ({"optimizer": _MUON_OPT, "stability": _common.defences_on("clip")},
                          "muon_clip1")
DEFENCES["stablejax_muon"] = ({"optimizer": _MUON_OPT}, None)
# The AdamW stack with AdaGC after ZClip, the trainer's default before this sweep.
DEFENCES["stablejax_adagc"] = ({"stability": {"adagc": {"enabled": True}}}, None)
# The stacks with QK-clip (Kimi K2, arXiv 2507.20534) at QK_TAU: healthy Muon runs' logits reach
# ~300 at this scale (README), so Kimi's tau = 100 clips healthy heads; 300 sits just above.
QK_TAU = 300.0
DEFENCES["stablejax_qkclip"] = ({"stability": {"qk_clip": {"enabled": True, "tau": QK_TAU}}},
                                None)
DEFENCES["stablejax_muon_qkclip"] = ({"optimizer": _MUON_OPT, "stability": {
    "qk_clip": {"enabled": True, "tau": QK_TAU}}}, None)
# Kimi K2's own tau (the main QK-clip defence of the long sweep), and tau = 30 (an ablation).
for _tau in (100, 30):
  _qk = {"qk_clip": {"enabled": True, "tau": float(_tau)}}
  DEFENCES[f"stablejax_qkclip{_tau}"] = ({"stability": _qk}, None)
  DEFENCES[f"stablejax_muon_qkclip{_tau}"] = ({"optimizer": _MUON_OPT, "stability": _qk}, None)
# The Muon stack with per-head orthogonalisation of the attention projections, with NorMuon
# (arXiv 2510.05491), and with both (--muon-methods).
for _name, _opt in (("perhead", {"per_head": True}), ("normuon", {"normuon": True}),
                    ("perhead_normuon", {"per_head": True, "normuon": True})):
  DEFENCES[f"stablejax_muon_{_name}"] = ({"optimizer": {**_MUON_OPT, **_opt}}, None)
# The stacks with Hyperball (Wen et al., Dec 2025; stablejax.hyperball): the Muon routing's
# matrices kept at their initial norm and moved by the normalised step at the optimizer's rate
# (AdamH, MuonH), the rest as in the stack (--hyperball).
_HYPERBALL = {"hyperball": {"enabled": True}}
DEFENCES["stablejax_hyperball"] = ({"stability": _HYPERBALL}, None)
DEFENCES["stablejax_muon_hyperball"] = ({"optimizer": _MUON_OPT, "stability": _HYPERBALL}, None)
ADAMW_DEFENCES = ("none", "clip1", "apply_if_finite", "zclip", "adagc", "skip_spikes", "stablejax",
                  "stablejax_adagc")
MUON_DEFENCES = ("muon_clip1", "stablejax_muon")

# The full run: every defence on Pre-LN; the baseline and the AdamW stack on the other models
# (postln_qk and the Muon defences on the other models are one --models/--defences away).
PAIR = ("clip1", "stablejax")
PLAN = {
    "preln": ADAMW_DEFENCES + MUON_DEFENCES,
    "preln_qk": PAIR,
    "postln": PAIR,
    "preln_nowarmup": PAIR,
    "preln_fp16": PAIR,
}
# --long: the long-horizon sweep. Learning rates up to where clip 1.0 degrades badly: AdamW
# 3e-3 .. 0.95 (factors 1 .. 316), Muon 0.03 .. 0.3 (factors 1 .. 10; its AdamW groups
# 0.009 .. 0.09). The QK-norm models are the architectural reference, with the baselines only.
# QK-clip runs at Kimi K2's tau = 100 (stablejax_qkclip100): on the first seed it beat tau = 300
# (stablejax_qkclip, QK_TAU) at every Muon rate and at AdamW's 10x and 100x (a tie at 1x; at
# 316x, where every model breaks in its first steps, tau = 300 ended lower), so tau = 300 stays
# a one-seed ablation.
LONG_DEFENCES = ("clip1", "stablejax", "stablejax_qkclip100", "muon_clip1", "stablejax_muon",
                 "stablejax_muon_qkclip100")
LONG_PLAN = {"long": LONG_DEFENCES, "long_warmup": LONG_DEFENCES,
             "long_qk": ("clip1", "muon_clip1"), "long_qk_warmup": ("clip1", "muon_clip1")}
# Sized to this shared 2-core machine (a run of 800 steps takes 2-8 minutes with the load of
# other jobs): a decade grid for AdamW plus its highest rate, half a decade for Muon.
LONG_FACTORS = {"adamw": (1.0, 10.0, 100.0, 316.2), "muon": (1.0, 3.162, 10.0)}
# The short-horizon rows planned in the first sweep and not run then.
SHORT_PLAN = {"preln_qk": PAIR, "preln_nowarmup": PAIR, "preln_fp16": PAIR}
# The order runs start in (--long without --models/--defences), stage by stage, so that an
# interrupted sweep still has whole comparisons: (models, defences, rates per optimizer or None
# for LONG_FACTORS, seeds). 1. one seed of everything on the main (no-warmup) pair, and the
# tau = 300 ablation; 2. the warmup pair at the rates that decide (one seed: the lead time of the
# attention-logit warning with warmup, and QK-clip with warmup); 3. seeds 1 and 2 of the main
# comparison; 4. the stacks without QK-clip on seeds 1 and 2 (does QK-clip earn its place?);
# 5. a one-seed ablation at tau = 30; 6. tau = 30 on the whole grid and all seeds, Muon first
# (its one-seed ablation beat tau = 100 at every rate it ran, by 0.08 to 0.36 nats).
LONG_LAST = ("stablejax", "stablejax_muon")
LONG_STAGES = (
    (("long", "long_qk"), None, None, (0,)),
    (("long",), ("stablejax_qkclip", "stablejax_muon_qkclip"), None, (0,)),
    (("long_warmup",), ("clip1", "muon_clip1"), {"adamw": (1.0, 100.0, 316.2), "muon": (1.0, 10.0)},
     (0,)),
    (("long_warmup",), ("stablejax_qkclip100", "stablejax_muon_qkclip100"),
     {"adamw": (100.0, 316.2), "muon": (10.0,)}, (0,)),
    (("long_qk_warmup",), ("clip1", "muon_clip1"), {"adamw": (100.0, 316.2), "muon": (10.0,)},
     (0,)),
    (("long", "long_qk"), "main", None, (1, 2)),
    (("long",), LONG_LAST, None, (1, 2)),
    (("long",), ("stablejax_qkclip30", "stablejax_muon_qkclip30"),
     {"adamw": (10.0, 100.0), "muon": (1.0, 3.162, 10.0)}, (0,)),
    (("long",), ("stablejax_muon_qkclip30",), None, (0, 1, 2)),
    (("long",), ("stablejax_qkclip30",), {"adamw": (1.0, 100.0, 316.2, 10.0)}, (0, 1, 2)),
)


def long_cells() -> list[tuple]:
  """The cells of --long in LONG_STAGES order (each once)."""
  cells: list[tuple] = []
  for models, defences, rates, seeds in LONG_STAGES:
    for s in seeds:
      for m in models:
        chosen = LONG_PLAN[m] if defences is None else (
            [d for d in LONG_PLAN[m] if d not in LONG_LAST] if defences == "main" else defences)
        for d in chosen:
          for f in (rates or LONG_FACTORS)[_family(d)]:
            if (m, d, f, s) not in cells:
              cells.append((m, d, f, s))
  return cells
# The short-horizon rows planned in the first sweep and not run then.
SHORT_PLAN = {"preln_qk": PAIR, "preln_nowarmup": PAIR, "preln_fp16": PAIR}
# --muon-methods: today's Muon stack against per-head orthogonalisation, NorMuon and both, on the
# long-horizon model without QK-norm (800 steps, no warmup) at the base rate and 10x, 3 seeds.
MUON_METHODS = {"models": ("long",), "defences": ("stablejax_muon", "stablejax_muon_perhead",
                                                  "stablejax_muon_normuon",
                                                  "stablejax_muon_perhead_normuon"),
                "lr_factors": (1.0, 10.0), "seeds": SEEDS}
# --hyperball: the learning-rate goal over seeds (README, "Measured"): AdamW and Muon, each with
# clip 1.0, the default stack and the stack + Hyperball, on the long-horizon model without QK-norm
# and with it, LONG_FACTORS, 3 seeds. The cells the earlier long-horizon sweeps ran (same model,
# defence, rate and seed; 800 steps) are taken from their files (`reuse`); AdamW's cells run
# first, so an interrupted sweep has the comparison the goal is about.
HYPERBALL = {"models": ("long", "long_qk"),
             "defences": ("clip1", "stablejax", "stablejax_hyperball", "muon_clip1",
                          "stablejax_muon", "stablejax_muon_hyperball"),
             "seeds": SEEDS,
             "reuse": tuple(str(RESULTS / f"{n}.jsonl") for n in (
                 "stress_long_runs", "stress_long_new_runs", "stress_long_muon_runs"))}
QUICK = {"models": ("preln",), "defences": ("clip1", "stablejax", "stablejax_muon"),
         "lr_factors": (1.0, 10.0, 31.62), "seeds": (0,), "steps": 100}

# --diagnose: what costs the stacks loss on clean runs and what makes them roll back. Each variant
# changes one thing of a default stack (two where named so); name -> (base defence, overrides).
DIAGNOSIS = {
    "adagc_lam1.5": ("stablejax_adagc", "stability.adagc.lambda_rel=1.5"),
    "adagc_lam2": ("stablejax_adagc", "stability.adagc.lambda_rel=2.0"),
    "adagc_lam3": ("stablejax_adagc", "stability.adagc.lambda_rel=3.0"),
    "zclip_no_ceiling": ("stablejax", "stability.zclip.max_grad_norm=null"),
    "adagc_no_ceiling": ("stablejax_adagc", "stability.zclip.max_grad_norm=null"),
    "no_spike_skip": ("stablejax", "stability.skip_spikes.enabled=false"),
    "no_recovery": ("stablejax", "stability.recovery.enabled=false"),
    # the recovery and the monitor see every step, as in bench/scenarios.py
    "log_every1": ("stablejax", "train.log_every=1"),
    "muon_adagc": ("stablejax_muon", "stability.adagc.enabled=true"),
    "muon_no_outlier_clamp": ("stablejax_muon", "optimizer.outlier_method=null"),
}
DIAGNOSE = {"models": ("preln",), "lr_factors": (1.0, 10.0), "seeds": SEEDS}


# ----------------------------------------------------------------------------- defences


def parse_overrides(text: str) -> dict:
  """`section.key=value,section.key=value` (values JSON, else strings) -> nested dict."""
  raw: dict = {}
  for item in filter(None, (s.strip() for s in text.split(","))):
    if "=" not in item or "." not in item.split("=", 1)[0]:
      raise ValueError(f"override {item!r} is not of the form section.key=value")
    dotted, value = item.split("=", 1)
    try:
      parsed = json.loads(value)
    except json.JSONDecodeError:
      parsed = value
    node = raw
    parts = dotted.split(".")
    for part in parts[:-1]:
      node = node.setdefault(part, {})
    node[parts[-1]] = parsed
  return raw


def parse_variant(spec: str) -> tuple[str, str, dict]:
  """`NAME=BASE:overrides` -> (name, base defence, overrides dict)."""
  if "=" not in spec:
    raise ValueError(f"--variant {spec!r} is not of the form NAME=BASE:section.key=value,...")
  name, rest = spec.split("=", 1)
  base, _, overrides = rest.partition(":")
  if base not in DEFENCES:
    raise ValueError(f"--variant {spec!r}: unknown base defence {base!r} "
                     f"(choose from {', '.join(DEFENCES)})")
  return name, base, parse_overrides(overrides)


def optax_muon_clip1(cfg):
  """clip_by_global_norm(1.0) + optax.contrib.muon, routed and scheduled like the trainer's Muon."""
  import optax
  from optax.contrib import muon
  import stablejax
  from stablejax.training.optim import lr_schedule
  o = cfg.optimizer
  # stablejax's routing: hidden matrices to Muon with their layouts, embedding, head and norms to
  # optax's AdamW branch (dimension numbers None).
  main = muon(learning_rate=lr_schedule(cfg, o.learning_rate),
              adam_learning_rate=lr_schedule(cfg, o.adam_learning_rate),
              beta=o.momentum, ns_steps=o.ns_steps, eps=o.eps, weight_decay=o.weight_decay,
              adam_b1=o.b1, adam_b2=o.b2, adam_weight_decay=o.adam_weight_decay,
              consistent_rms=o.consistent_rms,
              muon_weight_dimension_numbers=stablejax.muon_dimension_numbers)
  return optax.with_extra_args_support(optax.chain(
      optax.clip_by_global_norm(1.0), main, optax.inject_hyperparams(optax.scale)(step_size=1.0)))


def build_tx(kind: str | None, cfg):
  """The chain a defence swaps in (None: the trainer builds it from the config)."""
  if kind is None:
    return None
  if kind == "apply_if_finite":
    from stablejax.training.optim import main_optimizer
    return scenarios.optax_apply_if_finite(cfg, main_optimizer(cfg))
  if kind == "muon_clip1":
    return optax_muon_clip1(cfg)
  raise ValueError(f"unknown tx kind {kind!r}")


def cell_config(model: str, defence: str, seed: int, steps: int,
                variants: dict[str, tuple[str, dict]]) -> tuple[dict, str | None]:
  """(raw trainer config, tx kind) of one cell."""
  overrides: dict = {}
  base = defence
  if defence in variants:
    base, overrides = variants[defence]
  fragment, tx_kind = DEFENCES[base]
  raw = _common.deep_merge(BASE, MODELS[model])
  raw = _common.deep_merge(raw, fragment)
  raw = _common.deep_merge(raw, overrides)
  steps = model_steps(model, steps)
  warmup = raw["train"].get("warmup_steps", max(2, steps // 10))
  raw["train"].update(steps=steps, warmup_steps=warmup, seed=seed,
                      eval_every=max(1, steps // 2))
  raw["checkpoint"]["every"] = max(1, steps // 4)
  return raw, tx_kind


def model_steps(model: str, steps: int) -> int:
  """The run length of a model: its own train.steps (the long-horizon models), else `steps`."""
  return MODELS[model].get("train", {}).get("steps", steps)


def main_lr(raw: dict) -> float:
  return raw["optimizer"]["learning_rate"]


# ----------------------------------------------------------------------------- one run


def _mean(xs):
  xs = [x for x in xs if x is not None and math.isfinite(x)]
  return statistics.fmean(xs) if xs else None


def run_one(model: str, defence: str, factor: float, seed: int, steps: int,
            variants: dict, workdir: str) -> dict:
  """One cell, in this process (a pool worker)."""
  from stablejax.training.config import config_from_dict

  raw, tx_kind = cell_config(model, defence, seed, steps, variants)
  name = f"{model}__{defence}__x{factor:g}__s{seed}"
  out = Path(workdir) / name
  result = {"model": model, "defence": defence, "lr_factor": factor,
            "lr": main_lr(raw) * factor, "seed": seed, "steps": raw["train"]["steps"],
            "status": "crashed", "val_loss": None,
            "init_loss": None, "diverged": True, "spikes": None, "skipped": None,
            "rollbacks": None, "warnings": None, "zclip_clip_rate": None,
            "adagc_clip_frac": None, "adagc_norm_ratio": None, "wall_s": None, "ms_step": None,
            "events": [], "curve": [], "attn_curve": [], "warning_steps": [],
            "qk_clipped": None, "max_attn_logit": None, "error": ""}
  t0, cpu0 = time.time(), time.process_time()
  log = io.StringIO()
  try:
    cfg = config_from_dict(raw)
    run_cls = _common.trainer_run_class()
    with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
      run = run_cls(cfg, out, fresh=True, tx=build_tx(tx_kind, cfg))
      run.lr_factor = factor
      code = run.train()
    summary, records = _common.read_run(out)
    train = [r for r in records if "loss" in r and "step" in r]
    losses = [(r["step"], float(r["loss"])) for r in train]
    skipped = summary["skipped_steps"] + scenarios._optax_skips(run.state.opt_state)
    val, init = summary.get("final_val_loss"), run.init_val_loss
    status = scenarios.run_status(code, val)
    after = [r for r in train if r["step"] > cfg.stability.adagc.warmup_steps]
    step_times = [cfg.train.batch_size * cfg.train.seq_len / r["tokens_per_sec"]
                  for r in train[1:] if r.get("tokens_per_sec")]
    result.update(
        status=status, val_loss=val, init_loss=init,
        diverged=status != "ok" or val >= init,
        spikes=scenarios.count_spikes(losses, set(), window=SPIKE_WINDOW), skipped=skipped,
        rollbacks=summary["rollbacks"],
        warnings=sum(1 for r in records if r.get("event") == "warning"),
        zclip_clip_rate=_mean([float(r["zclip/was_clipped"]) for r in train
                               if "zclip/was_clipped" in r]),
        adagc_clip_frac=_mean([r["adagc/clipped_fraction"] for r in after
                               if "adagc/clipped_fraction" in r]),
        adagc_norm_ratio=_mean([r["adagc/clipped_grad_norm"] / r["adagc/grad_norm"] for r in after
                                if r.get("adagc/grad_norm")]),
        wall_s=summary["wall_seconds"],
        ms_step=1e3 * statistics.median(step_times) if step_times else None,
        events=summary.get("events", []), curve=losses,
        # Telemetry at the logged steps: max attention logit over layers, and per layer.
        attn_curve=[(r["step"], r["attn_logit_max"],
                     [r.get(f"attn_logit_max/layer_{i}") for i in range(cfg.model.n_layers)])
                    for r in train if "attn_logit_max" in r],
        max_attn_logit=max((float(r["attn_logit_max"]) for r in train
                            if r.get("attn_logit_max") is not None), default=None),
        warning_steps=[(r["step"], r.get("cause", "")) for r in records
                       if r.get("event") == "warning"],
        qk_clipped=(train[-1].get("qk_clip/total_clipped") if train else None),
        # The trainer's own measurement of the initial logits (its first batch), else the
        # bench's (the first validation batch).
        init_attn_logit_max=float(run.logging.initial_record.get(
            "attn_logit_max", run.init_attn_logit_max or float("nan"))),
        # The update norm before the learning rate at the logged steps (the monitor's indicator).
        update_curve=[(r["step"], r["update_norm"] / r["lr"]) for r in train
                      if r.get("update_norm") is not None and r.get("lr")])
  except Exception as e:  # a crashed cell is a result, not the end of the sweep
    result["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
    result["wall_s"] = time.time() - t0
    log.write(traceback.format_exc())
  finally:
    result["cpu_s"] = time.process_time() - cpu0
    (Path(workdir) / f"{name}.log").write_text(log.getvalue())
    shutil.rmtree(out, ignore_errors=True)
  return result


# ----------------------------------------------------------------------------- the metric


def clamped_loss(r: dict) -> float:
  """min(final val loss, loss at init); a diverged or failed run counts as the loss at init."""
  init = r["init_loss"]
  val = r["val_loss"]
  if r["status"] != "ok" or val is None or not math.isfinite(val):
    return init
  return min(val, init)


def lr_sensitivity(curve: list[float]) -> float:
  """Wortsman et al. (arXiv 2309.14322): mean over the LR grid of min(l(eta), l_0) - l*.

  `curve` holds the already clamped losses min(l(eta), l_0), one per grid rate; l* is its
  minimum (the best rate of the grid).
  """
  best = min(curve)
  return statistics.fmean(x - best for x in curve)


def summarize(results: list[dict], models, defences, factors, seeds) -> list[dict]:
  """One row per (model, defence) with the headline numbers and the clip1 comparison."""
  by = {(r["model"], r["defence"], r["lr_factor"], r["seed"]): r for r in results}
  rows = []
  for model in models:
    for defence in defences:
      cells = {f: [by[(model, defence, f, s)] for s in seeds if (model, defence, f, s) in by]
               for f in factors}
      cells = {f: rs for f, rs in cells.items() if rs and all(r["init_loss"] for r in rs)}
      if len(cells) < 2:
        continue
      fs = sorted(cells)
      loss = {f: [clamped_loss(r) for r in cells[f]] for f in fs}
      mean = {f: statistics.fmean(loss[f]) for f in fs}
      sd = {f: statistics.stdev(loss[f]) if len(loss[f]) > 1 else 0.0 for f in fs}
      best_f = min(fs, key=lambda f: mean[f])
      # Per seed (a seed run at every rate of the grid): its own curve's sensitivity.
      whole = [s for s in seeds if all((model, defence, f, s) in by for f in fs)]
      by_seed = {s: lr_sensitivity([clamped_loss(by[(model, defence, f, s)]) for f in fs])
                 for s in whole}
      per_seed = list(by_seed.values())
      runs = [r for f in fs for r in cells[f]]
      rows.append({
          "model": model, "defence": defence, "factors": fs, "mean": mean, "sd": sd,
          "n": {f: len(loss[f]) for f in fs},
          "best_factor": best_f, "best_lr": cells[best_f][0]["lr"], "best_mean": mean[best_f],
          "best_sd": sd[best_f],
          "sensitivity": lr_sensitivity([mean[f] for f in fs]),
          "sensitivity_sd": statistics.stdev(per_seed) if len(per_seed) > 1 else 0.0,
          "sensitivity_by_seed": by_seed,
          "runs": len(runs), "diverged": sum(r["diverged"] for r in runs),
          "rollbacks": sum(r["rollbacks"] or 0 for r in runs),
          "runs_rolled_back": sum(1 for r in runs if r["rollbacks"]),
          "spikes": sum(r["spikes"] or 0 for r in runs),
          "skipped": sum(r["skipped"] or 0 for r in runs),
          "warnings": sum(_warnings(r) for r in runs),
          "crashed": sum(1 for r in runs if r["error"]),
      })
  # The comparison with the baseline of the same optimizer family and model.
  index = {(r["model"], r["defence"]): r for r in rows}
  for row in rows:
    base_name = "muon_clip1" if _family(row["defence"]) == "muon" else "clip1"
    base = index.get((row["model"], base_name))
    row["baseline"] = base_name if base else None
    if not base or base is row:
      continue
    f = base["best_factor"]
    row["warnings_at_base_best"] = sum(
        _warnings(r) for r in results
        if (r["model"], r["defence"], r["lr_factor"]) == (row["model"], row["defence"], f))
    row["gap_best"] = row["best_mean"] - base["best_mean"]
    if f in row["mean"]:
      row["gap_at_base_best"] = row["mean"][f] - base["mean"][f]
      row["base_se"] = base["sd"][f] / math.sqrt(base["n"][f])
    # Sensitivities compare only over the same grid (the one-seed warmup stage runs a defence
    # at some of its baseline's rates).
    row["sensitivity_ratio"] = (row["sensitivity"] / base["sensitivity"]
                                if base["sensitivity"] > 0 and row["factors"] == base["factors"]
                                else None)
    # Its standard error: of the paired per-seed ratios (same seed: same initialisation and
    # data order), sd / sqrt(seeds); None with fewer than two seeds in both.
    pairs = [row["sensitivity_by_seed"][s] / base["sensitivity_by_seed"][s]
             for s in row["sensitivity_by_seed"] if base["sensitivity_by_seed"].get(s, 0) > 0]
    row["sensitivity_ratio_se"] = (statistics.stdev(pairs) / math.sqrt(len(pairs))
                                   if row["sensitivity_ratio"] is not None and len(pairs) > 1
                                   else None)
    # Rollbacks in runs whose baseline twin (same model, rate, seed) did not diverge.
    by_cell = {(r["lr_factor"], r["seed"]): r for r in results
               if r["model"] == row["model"] and r["defence"] == base_name}
    row["false_rollbacks"] = sum(
        r["rollbacks"] or 0 for r in results
        if r["model"] == row["model"] and r["defence"] == row["defence"]
        and (r["lr_factor"], r["seed"]) in by_cell
        and not by_cell[(r["lr_factor"], r["seed"])]["diverged"])
    row["extra_divergences"] = sum(
        1 for r in results
        if r["model"] == row["model"] and r["defence"] == row["defence"] and r["diverged"]
        and (r["lr_factor"], r["seed"]) in by_cell
        and not by_cell[(r["lr_factor"], r["seed"])]["diverged"])
  # Long horizon: the share of the QK-norm model's advantage over the baseline (same optimizer
  # family and warmup) that a defence recovers at the highest rate all three share where that
  # advantage exists (`qk_gain_floor`: at AdamW's 316x no-warmup rate every model breaks in its
  # first steps, and what separates them there is within the seed noise).
  for row in rows:
    twin = QK_TWIN.get(row["model"])
    base = index.get((row["model"], row.get("baseline")))
    ref = index.get((twin, row.get("baseline"))) if twin else None
    if not (base and ref):
      continue
    common = [f for f in row["factors"] if f in base["mean"] and f in ref["mean"]
              and base["mean"][f] - ref["mean"][f] > qk_gain_floor(base, ref, f)]
    if not common:
      continue
    top = max(common)
    gain = base["mean"][top] - ref["mean"][top]
    row["top_factor"] = top
    row["qk_recovery"] = (base["mean"][top] - row["mean"][top]) / gain if gain > 0 else None
  return rows


def qk_gain_floor(base: dict, ref: dict, factor: float) -> float:
  """The smallest advantage of the QK-norm model (`ref`) over the baseline (`base`) at `factor`
  that counts as one: QK_GAIN_MIN nats, and two standard errors of the difference of the two
  seed means (with one seed, QK_GAIN_MIN alone)."""
  se = math.sqrt(base["sd"][factor] ** 2 / base["n"][factor]
                 + ref["sd"][factor] ** 2 / ref["n"][factor])
  return max(QK_GAIN_MIN, 2.0 * se)


def _warnings(r: dict) -> int:
  """Monitor warnings of a run: under the current rules when the run saved what replaying them
  needs (`current_warnings`), else as the trainer printed them."""
  if r.get("warning_steps") is not None and r.get("attn_curve") is not None:
    return len(current_warnings(r))
  return r["warnings"] or 0


def _family(defence: str) -> str:
  return "muon" if "muon" in defence else "adamw"


# ----------------------------------------------------------------------------- output


RUN_HEADERS = ["model", "defence", "lr_factor", "lr", "seed", "status", "val_loss", "init_loss",
               "diverged", "spikes", "skipped", "rollbacks", "warnings", "zclip_clip_rate",
               "adagc_clip_frac", "adagc_norm_ratio", "max_attn_logit", "qk_clipped", "wall_s",
               "cpu_s", "ms_step", "events", "error"]


def _cell(x, fmt="%.4f"):
  if x is None:
    return "-"
  if isinstance(x, bool):
    return "yes" if x else "no"
  if isinstance(x, float):
    return fmt % x
  if isinstance(x, list):
    return " | ".join(x)
  return str(x)


def write_csv(results: list[dict], path: Path, header_lines: list[str]) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  with open(path, "w", newline="") as f:
    for line in header_lines:
      f.write(f"# {line}\n")
    w = csv.writer(f)
    w.writerow(RUN_HEADERS)
    for r in results:
      w.writerow([_cell(r.get(h), "%.7g") for h in RUN_HEADERS])


def _pm(mean, sd):
  return f"{mean:.3f} ± {sd:.3f}"


def summary_rows(rows: list[dict]) -> tuple[list[str], list[list]]:
  headers = ["model", "defence", "best LR", "best-LR loss", "LR sensitivity", "vs baseline",
             "gap at baseline's best LR (SE)", "share of QK-norm's gain at the top LR", "diverged",
             "rollbacks (false)", "spikes", "skips", "monitor warnings (at baseline's best LR)"]
  out = []
  for r in rows:
    ratio = r.get("sensitivity_ratio")
    gap = r.get("gap_at_base_best")
    share = r.get("qk_recovery")
    out.append([
        r["model"], r["defence"], f"{r['best_lr']:.3g} ({r['best_factor']:g}x)",
        _pm(r["best_mean"], r["best_sd"]), _pm(r["sensitivity"], r["sensitivity_sd"]),
        "-" if ratio is None else f"{ratio:.2f}x" + (
            "" if r.get("sensitivity_ratio_se") is None else f" ± {r['sensitivity_ratio_se']:.2f}"),
        "-" if gap is None else f"{gap:+.3f} ({r['base_se']:.3f})",
        "-" if share is None else f"{100 * share:.0f}% ({r['top_factor']:g}x)",
        f"{r['diverged']}/{r['runs']}",
        f"{r['rollbacks']} ({r.get('false_rollbacks', '-')})", r["spikes"], r["skipped"],
        f"{r['warnings']} ({r.get('warnings_at_base_best', '-')})"])
  return headers, out


def curve_rows(rows: list[dict], factors) -> tuple[list[str], list[list]]:
  headers = ["model", "defence"] + [f"{f:g}x" for f in factors]
  out = []
  for r in rows:
    out.append([r["model"], r["defence"]] + [
        _pm(r["mean"][f], r["sd"][f]) if f in r["mean"] else "-" for f in factors])
  return headers, out


def plot_curves(results: list[dict], rows: list[dict], path: Path, title: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  models = list(dict.fromkeys(r["model"] for r in rows))
  defences = list(dict.fromkeys(r["defence"] for r in rows))
  colors = {d: plt.cm.tab10(i % 10) for i, d in enumerate(defences)}
  cols = min(3, len(models))
  nrows = math.ceil(len(models) / cols)
  fig, axes = plt.subplots(nrows, cols, figsize=(max(7.5, 5.2 * cols), 3.8 * nrows + 0.6),
                           squeeze=False)
  for ax, model in zip(axes.flat, models):
    inits = [r["init_loss"] for r in results if r["model"] == model and r["init_loss"]]
    for row in rows:
      if row["model"] != model:
        continue
      fs = row["factors"]
      lrs = [row["best_lr"] / row["best_factor"] * f for f in fs]
      ax.errorbar(lrs, [row["mean"][f] for f in fs], yerr=[row["sd"][f] for f in fs],
                  color=colors[row["defence"]], marker="o", ms=3, lw=1, capsize=2,
                  ls="--" if _family(row["defence"]) == "muon" else "-",
                  label=f"{row['defence']} (sens. {row['sensitivity']:.2f})")
    for row in rows:  # the same model with QK-norm and its baselines, the reference
      if row["model"] != QK_TWIN.get(model) or row["defence"] not in ("clip1", "muon_clip1"):
        continue
      fs = row["factors"]
      lrs = [row["best_lr"] / row["best_factor"] * f for f in fs]
      ax.errorbar(lrs, [row["mean"][f] for f in fs], yerr=[row["sd"][f] for f in fs],
                  color="black", alpha=0.6, marker="s", ms=3, lw=1, capsize=2,
                  ls="--" if _family(row["defence"]) == "muon" else ":",
                  label=f"QK-norm model, {row['defence']} (sens. {row['sensitivity']:.2f})")
    top = max(row["mean"][f] + row["sd"][f] for row in rows if row["model"] == model
              for f in row["factors"])
    if inits:
      init = statistics.fmean(inits)
      ax.axhline(init, color="grey", lw=0.8, ls=":", label=f"loss at init ({init:.2f})")
      ax.set_ylim(None, min(init, top) + 0.15)
    ax.set_xscale("log")
    ax.set_title(model, fontsize=9)
    ax.set_xlabel("peak learning rate (Muon runs: Muon matrix rate)", fontsize=7)
    ax.set_ylabel("final val loss, min(loss, init)", fontsize=7)
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=6)
  for ax in list(axes.flat)[len(models):]:
    ax.axis("off")
  fig.suptitle("\n".join(textwrap.wrap(title, int(fig.get_figwidth() * 14))), fontsize=7)
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=70)
  plt.close(fig)


def plot_sensitivity(rows: list[dict], path: Path, title: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np

  models = list(dict.fromkeys(r["model"] for r in rows))
  defences = list(dict.fromkeys(r["defence"] for r in rows))
  colors = {d: plt.cm.tab10(i % 10) for i, d in enumerate(defences)}
  fig, axes = plt.subplots(1, 2, figsize=(max(9, 1.6 * len(models) + 6), 4.2))
  width = 0.8 / max(1, len(defences))
  for panel, (key, sd_key, label) in enumerate(
      (("sensitivity", "sensitivity_sd", "LR sensitivity (lower is better)"),
       ("best_mean", "best_sd", "best-LR val loss (lower is better)"))):
    ax = axes[panel]
    for j, defence in enumerate(defences):
      xs, ys, es = [], [], []
      for i, model in enumerate(models):
        row = next((r for r in rows if r["model"] == model and r["defence"] == defence), None)
        if row is not None:
          xs.append(i + (j - (len(defences) - 1) / 2) * width)
          ys.append(row[key])
          es.append(row[sd_key])
      ax.bar(xs, ys, width, yerr=es, color=colors[defence], label=defence, capsize=1.5)
      for x, y in zip(xs, ys):
        ax.text(x, y, f"{y:.2f}", ha="center", va="bottom", fontsize=5, rotation=90)
    ax.set_xticks(np.arange(len(models)), models, fontsize=7)
    ax.set_ylabel(label, fontsize=8)
    ax.tick_params(labelsize=7)
    if panel == 1:
      lo = min(r["best_mean"] for r in rows)
      ax.set_ylim(max(0.0, lo - 0.3), None)
  axes[0].legend(fontsize=6, ncol=2)
  fig.suptitle("\n".join(textwrap.wrap(title, int(fig.get_figwidth() * 14))), fontsize=7)
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=70)
  plt.close(fig)


def diagnostics_rows(results: list[dict], defences, models, factors) -> tuple[list[str], list]:
  """Per (model, defence, rate): mean losses and the clipping statistics behind them."""
  headers = ["model", "defence", "LR", "val loss (mean ± sd)", "diverged", "rollbacks",
             "skips", "ZClip clip rate", "AdaGC clipped tensors", "AdaGC out/in norm",
             "rollback causes"]
  out = []
  for model in models:
    for defence in defences:
      for f in factors:
        rs = [r for r in results
              if (r["model"], r["defence"], r["lr_factor"]) == (model, defence, f)]
        if not rs:
          continue
        losses = [clamped_loss(r) for r in rs if r["init_loss"]]
        causes = sorted({e.split(";")[0].split(": ", 1)[1] if ": " in e else e
                         for r in rs for e in r["events"]})
        out.append([model, defence, f"{rs[0]['lr']:.3g}",
                    _pm(statistics.fmean(losses),
                        statistics.stdev(losses) if len(losses) > 1 else 0.0)
                    if losses else "-",
                    sum(r["diverged"] for r in rs), sum(r["rollbacks"] or 0 for r in rs),
                    sum(r["skipped"] or 0 for r in rs),
                    _fmt_rate(_mean([r["zclip_clip_rate"] for r in rs])),
                    _fmt_rate(_mean([r["adagc_clip_frac"] for r in rs])),
                    _fmt_rate(_mean([r["adagc_norm_ratio"] for r in rs]), pct=False),
                    "; ".join(causes)[:160] or "-"])
  return headers, out


def _fmt_rate(x, pct=True):
  if x is None:
    return "-"
  return f"{100 * x:.0f}%" if pct else f"{x:.2f}"


# ----------------------------------------------------------------------------- attention logits
#
# How early the monitor's attention-logit rule warns, replayed over each run's logged telemetry
# (so the rule can be re-tuned without re-running the sweep), against when the loss degraded.

PLATEAU_WINDOW = 100   # steps, as the monitor's plateau rule (StabilityMonitor window)
TWIN_MARGIN = 0.1      # nats above the QK-norm twin that make a run "hurt by logit growth"


def attention_warning_steps(run: dict, rule=None) -> list[int]:
  """Steps at which StabilityMonitor's attention rule warns, replayed over `attn_curve`."""
  from stablejax.monitor import AttentionLogitThresholds, StabilityMonitor
  monitor = StabilityMonitor(attention=rule or AttentionLogitThresholds())
  if run.get("init_attn_logit_max") is not None:  # runs since the trainer measures it
    monitor.observe_initial({"attn_logit_max": run["init_attn_logit_max"]})
  steps = []
  for step, top, layers in run.get("attn_curve") or []:
    rec = {"attn_logit_max": top}
    rec.update({f"attn_logit_max/layer_{i}": v for i, v in enumerate(layers) if v is not None})
    if any("attention logits" in line for line in monitor.update(step, rec)):
      steps.append(step)
  return steps


def update_warning_steps(run: dict, rule=None) -> list[int]:
  """Steps at which StabilityMonitor's update-norm rule warns, replayed over `update_curve` (the
  update norm before the learning rate; runs from before the rule have none)."""
  from stablejax.monitor import StabilityMonitor, UpdateNormThresholds
  monitor = StabilityMonitor(attention=None, update_norm=rule or UpdateNormThresholds())
  return [step for step, value in run.get("update_curve") or []
          if any("update norm spike" in line
                 for line in monitor.update(step, {"update_norm": value, "lr": 1.0}))]


def first_warning(run: dict, rule=None) -> int | None:
  """The first step at which the attention rule or the update-norm rule warns."""
  steps = attention_warning_steps(run, rule)[:1] + update_warning_steps(run)[:1]
  return min(steps) if steps else None


def degradation_step(run: dict) -> int | None:
  """The first logged step where the train loss degraded: non-finite or above the loss at
  init, a spike (> 1.25 x the median of the previous SPIKE_WINDOW logged losses), or a plateau
  (from step 2 x PLATEAU_WINDOW on, the mean logged loss of the last PLATEAU_WINDOW steps not
  below that of the PLATEAU_WINDOW steps before, the monitor's plateau rule)."""
  # The loss logged at step s is measured before update s: step 1's is the initial parameters'
  # (logged since the trainer logs step 1 too), no degradation yet.
  curve = [(s, v) for s, v in run.get("curve") or [] if s > 1]
  init = run.get("init_loss") or float("inf")
  history: list[float] = []
  for i, (step, loss) in enumerate(curve):
    if not math.isfinite(loss) or loss > init:
      return step
    if len(history) >= SPIKE_WINDOW and loss > 1.25 * statistics.median(history[-SPIKE_WINDOW:]):
      return step
    history.append(loss)
    if step >= 2 * PLATEAU_WINDOW:
      recent = [v for s, v in curve[:i + 1] if s > step - PLATEAU_WINDOW]
      older = [v for s, v in curve[:i + 1]
               if step - 2 * PLATEAU_WINDOW < s <= step - PLATEAU_WINDOW]
      if recent and older and statistics.fmean(recent) >= statistics.fmean(older):
        return step
  return None


def behind_twin_step(run: dict, twin: dict, points: int = SPIKE_WINDOW) -> int | None:
  """The first logged step where the run's train loss, averaged over its last `points` logged
  values, is TWIN_MARGIN above its QK-norm twin's at the same steps (same data order): where
  the run fell behind the model that keeps its logits bounded."""
  theirs = dict((s, v) for s, v in twin.get("curve") or [])
  gaps: list[float] = []
  for step, loss in run.get("curve") or []:
    if step not in theirs or step <= 1:  # step 1's loss: the initial parameters
      continue
    gaps.append(loss - theirs[step] if math.isfinite(loss) else float("inf"))
    if statistics.fmean(gaps[-points:]) > TWIN_MARGIN:
      return step
  return None


def _twin(results: list[dict], r: dict) -> dict | None:
  """The QK-norm model's clip-1.0 run at the same rate, seed and warmup (the counterfactual)."""
  model = {"long": "long_qk", "long_warmup": "long_qk_warmup"}.get(r["model"])
  base = "muon_clip1" if _family(r["defence"]) == "muon" else "clip1"
  return next((t for t in results if (t["model"], t["defence"], t["lr_factor"], t["seed"])
               == (model, base, r["lr_factor"], r["seed"]) and t.get("val_loss") is not None),
              None)


def lead_time_rows(results: list[dict], rule=None) -> tuple[list[str], list[list], dict]:
  """Per clip-1.0 run hurt by logit growth: when its loss degraded, the first warning of the
  attention or the update-norm rule (`first_warning`; runs logged before the update norm was
  have attention warnings only).

  Hurt: a clip-1.0 run of a model without QK-norm, above the base rate, that ended more than
  TWIN_MARGIN above its QK-norm twin (same optimizer, rate, seed and warmup). Degraded: the first
  logged step where it fell behind the twin (`behind_twin_step`), and, the issue's wording,
  the first spike or plateau (`degradation_step`). Lead: degraded minus first warning.
  """
  headers = ["model", "defence", "LR", "seed", "val loss (QK-norm twin)", "max attn logit",
             "first warning (attention or update norm)", "behind QK-norm twin at (lead)",
             "spike/plateau at (lead)"]
  out, leads, leads_sp, hurt, before, before_sp = [], [], [], 0, 0, 0
  for r in results:
    if r["defence"] not in ("clip1", "muon_clip1") or r["model"] not in ("long", "long_warmup"):
      continue
    twin = _twin(results, r)
    if twin is None or r["val_loss"] is None or r["lr_factor"] == 1.0:
      continue
    if not r["val_loss"] > twin["val_loss"] + TWIN_MARGIN:
      continue
    hurt += 1
    first = first_warning(r, rule)
    cols = []
    for i, degraded in enumerate((behind_twin_step(r, twin), degradation_step(r))):
      lead = None if first is None or degraded is None else degraded - first
      if lead is not None:
        (leads, leads_sp)[i].append(lead)
      if first is not None and (degraded is None or first < degraded):
        if i == 0:
          before += 1
        else:
          before_sp += 1
      cols.append(f"{_cell(degraded)} ({_cell(lead)})")
    out.append([r["model"], r["defence"], f"{r['lr']:.3g}", r["seed"],
                f"{r['val_loss']:.3f} ({twin['val_loss']:.3f})",
                _cell(r.get("max_attn_logit"), "%.3g"), _cell(first), *cols])
  summary = {"hurt": hurt, "warned_before": before, "warned_before_sp": before_sp,
             "median_lead": statistics.median(leads) if leads else None,
             "median_lead_sp": statistics.median(leads_sp) if leads_sp else None}
  return headers, out, summary


def _lr_fraction(run: dict, step: int) -> float:
  """The run's learning rate at `step` as a fraction of its peak (warmup + cosine to 10%)."""
  train = MODELS[run["model"]].get("train", {})
  steps = train.get("steps", STEPS)
  warmup = train.get("warmup_steps", max(2, steps // 10))
  if step < warmup:
    return step / warmup
  t = min(1.0, (step - warmup) / max(1, steps - warmup))
  return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))


def current_warnings(run: dict, rule=None) -> list[tuple[int, str]]:
  """The monitor warnings of a run under the current rules, from what the run logged.

  The trainer's lines are kept, except two kinds, which are replayed instead: the attention
  rule's lines (replayed over the logged telemetry with `rule`), and a score line whose only
  reason was the loss-plateau row (kept only if that row still applies: the learning rate at
  least half its peak, from the run's schedule; the row ignores the decay phase since the
  long-horizon sweep)."""
  out = []
  for step, line in run.get("warning_steps") or []:
    if "attention logits" in line:
      continue
    if line.split(": ", 1)[-1].startswith("stability score") and "< target" not in line:
      reasons = [r.strip() for r in line.split(";")[1:]]
      if reasons and all(r.startswith(("loss plateau", "if early")) for r in reasons) \
          and _lr_fraction(run, step) < 0.5:
        continue
    out.append((step, line))
  out += [(step, "attention logits growing") for step in attention_warning_steps(run, rule)]
  return sorted(out)


def clean_run_warnings(results: list[dict], rule=None) -> tuple[int, int, int, int]:
  """(base-rate runs, their warnings under the current rules, QK-norm runs, their attention
  warnings)."""
  base = [r for r in results if r["lr_factor"] == 1.0 and r.get("attn_curve")]
  qk = [r for r in results if "qk" in r["model"].split("_") and r.get("attn_curve")]
  return (len(base), sum(len(current_warnings(r, rule)) for r in base), len(qk),
          sum(len(attention_warning_steps(r, rule)) for r in qk))


def report(results: list[dict], header: dict, out_dir: Path | None, name: str) -> None:
  models = list(dict.fromkeys(r["model"] for r in results))
  defences = list(dict.fromkeys(r["defence"] for r in results))
  factors = sorted({r["lr_factor"] for r in results})
  seeds = sorted({r["seed"] for r in results})
  rows = summarize(results, models, defences, factors, seeds)
  lines = header["machine"] + [header["setting"], header["timing"]]
  h, body = summary_rows(rows)
  csv_lines = lines + [f"command: {header['command']}"]
  print()
  print(_common.table(body, h))
  ch, cbody = curve_rows(rows, factors)
  print()
  print(_common.table(cbody, ch))
  dh, dbody = diagnostics_rows(results, defences, models, factors)
  print()
  print(_common.table(dbody, dh))
  lh, lbody, lead = lead_time_rows(results)
  n_base, w_base, n_qk, w_qk = clean_run_warnings(results)
  lead_lines = []
  if lead["hurt"]:
    lead_lines = [
        f"First warning of the attention-logit or the update-norm rule (the monitor's rules, "
        f"replayed over the logged telemetry) in the "
        f"{lead['hurt']} clip-1.0 runs above the base rate that ended more than {TWIN_MARGIN} "
        f"nats above their QK-norm twin: strictly before the run fell behind its twin in "
        f"{lead['warned_before']} of {lead['hurt']} (median lead "
        f"{_cell(lead['median_lead'], '%.0f')} steps), before its first spike or plateau in "
        f"{lead['warned_before_sp']} (median lead {_cell(lead['median_lead_sp'], '%.0f')} steps)."
        f" Monitor warnings under the current rules (`current_warnings`) in the {n_base} runs "
        f"at the base rate: {w_base}; attention warnings in the {n_qk} QK-norm runs: {w_qk}."]
    print()
    print(_common.table(lbody, lh))
    print(lead_lines[0])
  print(f"\n{header['timing']}")
  for r in results:
    if r["error"]:
      print(f"crashed: {r['model']} / {r['defence']} x{r['lr_factor']:g} seed {r['seed']}: "
            f"{r['error']}")
  if out_dir is None:
    return
  write_csv(results, out_dir / f"{name}.csv", csv_lines)
  title = header["setting"]
  if rows:
    plot_curves(results, rows, out_dir / f"{name}.png", title)
    plot_sensitivity(rows, out_dir / f"{name}_sensitivity.png", title)
  md = [f"<!-- written by bench/stress.py; {header['command']} -->", "",
        "Command: `" + header["command"] + "`", "", *[f"- {x}" for x in lines], "",
        "Per defence (loss = final validation loss, min(loss, loss at init); mean ± sd over "
        "seeds; LR sensitivity ± sd of the per-seed values; 'vs baseline' = sensitivity / the "
        "baseline's (clip1 for AdamW, muon_clip1 for Muon) ± the standard error of the per-seed "
        "ratios (each seed's curve against the baseline's of the same seed); gap = this defence "
        "minus the "
        "baseline at the baseline's best rate, (SE) = the baseline's standard error there; "
        "rollbacks (false) = rollbacks in runs whose baseline twin did not diverge; monitor "
        "warnings = warning lines the trainer printed (for the long-horizon runs: under the "
        "current rules, `current_warnings`), all rates, and at the baseline's best rate; share "
        "of QK-norm's gain = (baseline - defence) / (baseline - QK-norm model) at the highest "
        f"rate where the QK-norm model is better by more than {QK_GAIN_MIN} nats and two "
        "standard errors of the difference):", "",
        _common.markdown_table(body, h), "", "Loss over the grid:", "",
        _common.markdown_table(cbody, ch), "", "Clipping statistics per rate:", "",
        _common.markdown_table(dbody, dh), ""]
  if lead_lines:
    md += ["Lead time of the warnings: the first warning of the attention-logit or update-norm "
           "rule (replayed over the logged telemetry) against when the loss degraded, by two "
           "definitions: the first logged step where the run's train loss (mean of its last "
           f"{SPIKE_WINDOW} logged values) is {TWIN_MARGIN} nats above its QK-norm twin's, and the "
           "first logged step with a non-finite loss or one above the loss at init, a spike "
           f"(> 1.25 x the median of the previous {SPIKE_WINDOW}), or a plateau of the "
           f"{PLATEAU_WINDOW}-step mean; lead = degraded - first warning:", "",
           _common.markdown_table(lbody, lh), "", *lead_lines, ""]
  (out_dir / f"{name}.md").write_text("\n".join(md))
  print(f"wrote {out_dir / (name + '.csv')}, {name}.png, {name}_sensitivity.png, {name}.md "
        f"in {out_dir}")


# ----------------------------------------------------------------------------- main


_INT_FIELDS = ("seed", "spikes", "skipped", "rollbacks", "warnings", "qk_clipped")
_STR_FIELDS = ("model", "defence", "status", "error")


def read_csv(path: Path) -> tuple[list[dict], dict]:
  """The results and header of a CSV this script wrote (what --replot needs; no loss curves)."""
  lines = path.read_text().splitlines()
  comments = [line[2:] for line in lines if line.startswith("# ")]
  rows = list(csv.DictReader(line for line in lines if not line.startswith("# ")))
  results = []
  for row in rows:
    r: dict = {}
    for key, text in row.items():
      if key in _STR_FIELDS:
        r[key] = text
      elif key == "events":
        r[key] = [] if text in ("", "-") else text.split(" | ")
      elif key == "diverged":
        r[key] = text == "yes"
      elif text == "-":
        r[key] = None
      else:
        r[key] = int(text) if key in _INT_FIELDS else float(text)
    r["error"] = "" if r.get("error") in (None, "-") else r["error"]
    results.append(r)
  command = next((c[len("command: "):] for c in comments if c.startswith("command: ")), "")
  machine = [c for c in comments if c.startswith(("machine:", "jax "))]
  rest = [c for c in comments if c not in machine and not c.startswith("command: ")]
  return results, {"machine": machine, "setting": rest[0] if rest else "",
                   "timing": rest[1] if len(rest) > 1 else "", "command": command}


def _key(r: dict) -> tuple:
  return (r["model"], r["defence"], float(r["lr_factor"]), int(r["seed"]))


def _rounded(x):
  """Floats to 5 significant digits (the runs file stays small), recursively."""
  if isinstance(x, float):
    return float(f"{x:.5g}") if math.isfinite(x) else x
  if isinstance(x, (list, tuple)):
    return [_rounded(v) for v in x]
  if isinstance(x, dict):
    return {k: _rounded(v) for k, v in x.items()}
  return x


def append_run(path: Path, result: dict) -> None:
  """Appends one finished run as one JSON line (written whole and flushed at once: a killed
  sweep leaves at most a truncated last line, which read_runs skips and the next append leaves
  on a line of its own)."""
  path.parent.mkdir(parents=True, exist_ok=True)
  line = json.dumps(_rounded(result)) + "\n"
  with open(path, "a+b") as f:
    # A sweep killed mid-write leaves a last line without its newline: start on a fresh line, so
    # the fragment stays a line of its own (skipped) and does not swallow this run.
    if f.seek(0, os.SEEK_END) > 0:
      f.seek(-1, os.SEEK_END)
      if f.read(1) != b"\n":
        line = "\n" + line
    f.write(line.encode())
    f.flush()
    os.fsync(f.fileno())


def reusable_runs(paths: list[Path], cells: list[tuple], steps: int) -> dict[tuple, dict]:
  """The runs of earlier JSON-lines files (`--reuse`) that are cells of this sweep: same model,
  defence, rate factor and seed, and the same run length (a run that recorded its `steps`
  must match; one from before runs recorded it counts for the models that fix their own
  length, the long-horizon ones, and otherwise when its last logged step is the length). A
  later file's run of a cell wins."""
  wanted = set(cells)
  found: dict[tuple, dict] = {}
  for path in paths:
    for r in read_runs(path):
      key = _key(r)
      if key not in wanted:
        continue
      length = model_steps(r["model"], steps)
      if "steps" in r:
        same = r["steps"] == length
      elif "steps" in MODELS[r["model"]].get("train", {}):
        same = True
      else:
        same = bool(r.get("curve")) and r["curve"][-1][0] == length
      if same:
        found[key] = r
  return found


def read_runs(path: Path) -> list[dict]:
  """The runs of a JSON-lines file written by append_run (a later line of a run wins; a
  truncated line is skipped)."""
  runs: dict[tuple, dict] = {}
  for line in path.read_text().splitlines():
    try:
      r = json.loads(line)
      key = _key(r)
    except (json.JSONDecodeError, TypeError, KeyError, ValueError):
      continue
    runs[key] = r
  return list(runs.values())


def merge_saved(paths: list[Path]) -> tuple[list[dict], dict]:
  """Results and one header from saved results (.json or this script's .csv; a later file's
  cells win)."""
  cells: dict[tuple, dict] = {}
  headers = []
  for path in paths:
    if path.suffix == ".csv":
      results, header = read_csv(path)
    elif path.suffix == ".jsonl":
      results = read_runs(path)
      walls = sorted(r["wall_s"] for r in results if r.get("wall_s"))
      header = {"machine": _common.machine_lines()[1:],
                "setting": "",
                "timing": f"{len(results)} runs from {path.name}" + (
                    f" (per run median {statistics.median(walls):.0f}s wall, 2 in parallel, on "
                    "the 2 shared cores)" if walls else ""),
                "command": shlex.join(["python", "bench/stress.py", "--replot", str(path)])}
    else:
      saved = json.loads(path.read_text())
      results, header = saved["results"], saved["header"]
    headers.append(header)
    for r in results:
      cells[(r["model"], r["defence"], r["lr_factor"], r["seed"])] = r
  if len(headers) == 1:
    return list(cells.values()), headers[0]
  return list(cells.values()), {
      "machine": headers[0]["machine"],
      "setting": " | ".join(h["setting"] for h in headers),
      "timing": " | ".join(h["timing"] for h in headers),
      "command": " && ".join(h["command"] for h in headers) + " && " + shlex.join(
          ["python", "bench/stress.py", "--replot", ",".join(map(str, paths))])}


def _jobs(cells):
  """Pool order: the first run of each compiled program first, so that no two workers compile
  the same program at once; the rest then hit the shared compilation cache."""
  seen, first, rest = set(), [], []
  for cell in cells:
    key = (cell[0], cell[1])
    (rest if key in seen else first).append(cell)
    seen.add(key)
  return first + rest


def _base_model_setting() -> str:
  """The start of every setting line: the model and the batch of BASE."""
  b = BASE
  return (f"GPT d_model {b['model']['d_model']}, {b['model']['n_layers']} layers, seq "
          f"{b['train']['seq_len']}, batch {b['train']['batch_size']}")


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--quick", action="store_true", help="Pre-LN, 3 rates, 1 seed, 100 steps")
  p.add_argument("--long", action="store_true",
                 help="the long-horizon sweep: LONG_PLAN at 800 steps, LONG_FACTORS per "
                 "optimizer, 3 seeds")
  p.add_argument("--muon-methods", action="store_true",
                 help="today's Muon stack against per-head Muon, NorMuon and both (MUON_METHODS: "
                 "the long-horizon model, 1x and 10x, 3 seeds)")
  p.add_argument("--hyperball", action="store_true",
                 help="AdamW and Muon with clip 1.0, the stack and the stack + Hyperball on the "
                 "long-horizon models without and with QK-norm, 3 seeds (HYPERBALL; the cells of "
                 "the earlier long sweeps are reused from their files unless --reuse says else)")
  p.add_argument("--short-plan", action="store_true",
                 help="the short-horizon rows planned and not run in the first sweep "
                 "(SHORT_PLAN: QK-norm, no warmup, fp16)")
  p.add_argument("--results", default=None, metavar="RUNS_JSONL",
                 help="append each finished run to this JSON-lines file and skip the runs it "
                 "already holds (resume an interrupted sweep); also accepted by --replot")
  p.add_argument("--reuse", default=None, metavar="RUNS_JSONL[,RUNS_JSONL...]",
                 help="take the cells these earlier JSON-lines files hold (same model, defence, "
                 "rate factor, seed and run length) instead of running them again; they are "
                 "reported with this sweep's runs but not copied into --results")
  p.add_argument("--diagnose", action="store_true",
                 help="the DIAGNOSIS variants of the stacks (+ the baselines) at 1x and 10x, "
                 "3 seeds")
  p.add_argument("--models", default=None, help=f"comma list of {', '.join(MODELS)}")
  p.add_argument("--defences", default=None, help=f"comma list of {', '.join(DEFENCES)} and "
                 "--variant names (default: the full PLAN)")
  p.add_argument("--variant", action="append", default=[], metavar="NAME=BASE:key=value,...",
                 help="a defence BASE with config overrides, e.g. "
                 "lam2=stablejax:stability.adagc.lambda_rel=2.0 (repeatable)")
  p.add_argument("--lr-factors", default=None, help="comma list of factors of the base rates")
  p.add_argument("--seeds", default=None, help="comma list of seeds (default 0,1,2)")
  p.add_argument("--steps", type=int, default=None, help=f"train steps per run (default {STEPS})")
  p.add_argument("--jobs", type=int, default=2, help="runs in parallel (separate processes)")
  p.add_argument("--no-cache", action="store_true", help="no shared compilation cache")
  p.add_argument("--out", default=None, help="output directory (default bench/results, or a "
                 "temporary directory with --quick)")
  p.add_argument("--name", default=None, help="output file prefix (default stress, "
                 "stress_diagnosis with --diagnose)")
  p.add_argument("--replot", default=None, metavar="RESULTS_JSON[,RESULTS_JSON...]",
                 help="only rebuild the outputs from saved results.json files (several are "
                 "merged, e.g. a full run and a run of new variants)")
  args = p.parse_args(argv)
  name = args.name or ("stress_diagnosis" if args.diagnose else "stress_long" if args.long
                       else "stress_long_muon" if args.muon_methods
                       else "stress_long_hyperball" if args.hyperball
                       else "stress_short" if args.short_plan else "stress")

  if args.replot:
    results, header = merge_saved([Path(x) for x in args.replot.split(",")])
    if args.long and header["setting"] == "":
      header["setting"] = (
          _base_model_setting() + f", 800 steps, data pydoc; "
          f"models without QK-norm (long, long_warmup: warmup 0 / 80 steps) and with it "
          f"(long_qk, long_qk_warmup); base LR AdamW {ADAMW_LR:g}, Muon {MUON_LR:g} (its AdamW "
          f"groups {MUON_ADAM_LR:g}); QK-clip tau 100 (stablejax_qkclip100), 300 "
          f"(stablejax_qkclip), 30 (stablejax_qkclip30); command of the runs: python "
          f"bench/stress.py --long --results bench/results/stress_long_runs.jsonl")
    if args.muon_methods and header["setting"] == "":
      header["setting"] = (
          _base_model_setting() + f", 800 steps, no warmup, "
          f"data pydoc; the model without QK-norm (long) and with it (long_qk); base LR Muon "
          f"{MUON_LR:g} (its AdamW groups {MUON_ADAM_LR:g}), 1x and 10x; command of the runs: "
          f"python -m bench.stress --muon-methods --results "
          f"bench/results/stress_long_muon_runs.jsonl (long), and the same with --models "
          f"long_qk --defences stablejax_muon,stablejax_muon_normuon --lr-factors 1,10")
    if args.hyperball:  # the preset's cells of the merged files
      grid = {(m, d, f, s_) for m in HYPERBALL["models"] for d in HYPERBALL["defences"]
              for f in LONG_FACTORS[_family(d)] for s_ in HYPERBALL["seeds"]}
      results = [r for r in results if _key(r) in grid]
      if header["setting"] == "" or " | " in header["setting"]:
        header["setting"] = (
            _base_model_setting() + f", 800 steps, no warmup, "
            f"data pydoc; the model without QK-norm (long) and with it (long_qk); base LR AdamW "
            f"{ADAMW_LR:g}, Muon {MUON_LR:g} (its AdamW groups {MUON_ADAM_LR:g}), factors "
            + "; ".join(f"{k} {', '.join(f'{f:g}' for f in v)}" for k, v in LONG_FACTORS.items())
            + "; seeds 0, 1, 2; the Hyperball step at the optimizer's rate of each matrix; "
            "command of the runs: python -m bench.stress --hyperball --results "
            "bench/results/stress_long_hyperball_runs.jsonl (cells of the earlier long sweeps "
            "reused from their files)")
    report(results, header, Path(args.out) if args.out else RESULTS, name)
    return 0

  variants: dict[str, tuple[str, dict]] = {}
  try:
    for spec in args.variant:
      vname, base, overrides = parse_variant(spec)
      variants[vname] = (base, overrides)
    if args.diagnose:
      for vname, (base, text) in DIAGNOSIS.items():
        variants.setdefault(vname, (base, parse_overrides(text)))
  except ValueError as e:
    p.error(str(e))

  preset = (QUICK if args.quick else DIAGNOSE if args.diagnose else MUON_METHODS
            if args.muon_methods else HYPERBALL if args.hyperball else {})
  long_grid = args.long or args.hyperball  # LONG_FACTORS per optimizer unless --lr-factors
  plan = LONG_PLAN if args.long else SHORT_PLAN if args.short_plan else PLAN
  steps = args.steps or preset.get("steps", STEPS)
  default_models = LONG_MODELS if args.long else preset.get("models", plan)
  models = args.models.split(",") if args.models else list(default_models)
  factors = ([float(x) for x in args.lr_factors.split(",")] if args.lr_factors
             else None if long_grid else list(preset.get("lr_factors", LR_FACTORS)))
  seeds = ([int(x) for x in args.seeds.split(",")] if args.seeds
           else list(preset.get("seeds", SEEDS)))
  if args.defences:
    chosen = args.defences.split(",")
  elif args.diagnose:
    chosen = ["clip1", "stablejax", "muon_clip1", "stablejax_muon"] + list(DIAGNOSIS)
  elif "defences" in preset:
    chosen = list(preset["defences"])
  else:
    chosen = None  # the PLAN per model
  for m in models:
    if m not in MODELS:
      p.error(f"unknown model {m!r}: choose from {', '.join(MODELS)}")
  for d in chosen or []:
    if d not in DEFENCES and d not in variants:
      p.error(f"unknown defence {d!r}: choose from {', '.join(DEFENCES)} or define it with "
              "--variant")
  # Seeds innermost, then rates: the runs of one curve finish together, so an interrupted sweep
  # still has whole curves.
  cells = [(m, d, f, s) for m in models for d in (chosen or plan[m])
           for f in (factors or LONG_FACTORS[_family(d)]) for s in seeds]
  if args.long and not (args.models or args.defences or args.lr_factors or args.seeds):
    cells = long_cells()
  if args.hyperball:
    cells.sort(key=lambda c: _family(c[1]) == "muon")  # AdamW's first, else in order
  out_dir = Path(args.out) if args.out else (None if args.quick else RESULTS)

  machine = _common.machine_lines()
  for line in machine:
    print(line)
  if factors:
    grid = ", ".join(f"{f:g}" for f in factors)
  else:
    grid = "; ".join(f"{k} {', '.join(f'{f:g}' for f in v)}" for k, v in LONG_FACTORS.items())
  lengths = sorted({model_steps(m, steps) for m in models})
  setting = (_base_model_setting() + f", "
             f"{'/'.join(map(str, lengths))} steps (warmup 10% unless the model says otherwise), "
             f"data pydoc; base LR AdamW {ADAMW_LR:g}, Muon {MUON_LR:g} (its AdamW groups "
             f"{MUON_ADAM_LR:g}); LR factors {grid}; seeds {', '.join(map(str, seeds))}; "
             f"QK-clip tau {QK_TAU:g}; {len(cells)} runs, {args.jobs} in parallel")
  if variants:
    setting += "; variants: " + "; ".join(
        f"{k} = {b_} + {json.dumps(o)}" for k, (b_, o) in variants.items()
        if k in (chosen or []))
  print(setting, flush=True)
  command = shlex.join(["python", "bench/stress.py",
                        *(argv if argv is not None else sys.argv[1:])])

  workdir = tempfile.mkdtemp(prefix="stablejax_stress_")
  cache_dir = None if args.no_cache else os.path.join(workdir, "xla_cache")
  t0 = time.time()
  results: dict[tuple, dict] = {}
  runs_file = Path(args.results) if args.results else None
  if runs_file is not None and runs_file.exists():
    done = {_key(r): r for r in read_runs(runs_file)}
    results = {c: done[c] for c in cells if c in done}
    print(f"resuming: {len(results)} of {len(cells)} runs already in {runs_file}", flush=True)
  reuse = args.reuse.split(",") if args.reuse else list(preset.get("reuse", ()))
  if reuse:
    reused = reusable_runs([Path(x) for x in reuse],
                           [c for c in cells if c not in results], steps)
    results.update(reused)
    print(f"reusing: {len(reused)} of {len(cells)} runs from {', '.join(reuse)}", flush=True)
  todo = [c for c in cells if c not in results]
  ctx = multiprocessing.get_context("spawn")
  with futures.ProcessPoolExecutor(max_workers=args.jobs, mp_context=ctx,
                                   initializer=_common.use_compilation_cache,
                                   initargs=(cache_dir,)) as pool:
    jobs = {pool.submit(run_one, m, d, f, s, steps, variants, workdir): (m, d, f, s)
            for m, d, f, s in (todo if long_grid else _jobs(todo))}
    for job in futures.as_completed(jobs):
      r = job.result()
      results[jobs[job]] = r
      if runs_file is not None:
        append_run(runs_file, r)
      print(f"[{time.time() - t0:6.0f}s] {r['model']} {r['defence']} x{r['lr_factor']:g} "
            f"s{r['seed']}: {r['status']} val {_cell(r['val_loss'])} init {_cell(r['init_loss'])}"
            f" skips {_cell(r['skipped'])} rollbacks {_cell(r['rollbacks'])} "
            f"wall {_cell(r['wall_s'], '%.0f')}s cpu {r['cpu_s']:.0f}s "
            f"ms/step {_cell(r['ms_step'], '%.0f')} "
            f"load {os.getloadavg()[0]:.1f}" + (f"  {r['error']}" if r["error"] else ""),
            flush=True)
      # Finished runs so far, so an interrupted sweep can still be reported with --replot.
      partial = {"header": {"machine": machine, "setting": setting, "command": command,
                            "timing": f"{len(results)} of {len(cells)} runs (interrupted)"},
                 "results": [results[c] for c in cells if c in results]}
      (Path(workdir) / "results.partial.json").write_text(json.dumps(partial))
  ordered = [results[c] for c in cells]
  total = time.time() - t0
  if cache_dir:
    shutil.rmtree(cache_dir, ignore_errors=True)
  walls = [r["wall_s"] for r in ordered if r["wall_s"]]
  ran = len(todo)
  timing = (f"{ran} runs in {total:.0f}s wall ({args.jobs} in parallel; per run median "
            f"{statistics.median(walls):.0f}s incl. start-up and compilation, load average at the"
            f" end {os.getloadavg()[0]:.1f})") if walls else f"{ran} runs in {total:.0f}s"
  if len(cells) > ran:
    timing += f"; {len(cells) - ran} more taken from earlier files"
  header = {"machine": machine, "setting": setting, "timing": timing, "command": command}
  raw_path = Path(workdir) / "results.json"
  raw_path.write_text(json.dumps({"header": header, "results": ordered}))
  report(ordered, header, out_dir, name)
  print(f"raw results with loss curves: {raw_path}; run logs in {workdir}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
