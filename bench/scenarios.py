"""Stability scenarios x defences: which setups survive which failures, on the same seeds and data.

Usage:
  python -m bench.scenarios                 # full matrix, 150 steps per run, 2 runs in parallel
  python -m bench.scenarios --quick         # 60 steps per run (a smoke run of the whole matrix)
  python -m bench.scenarios --jobs 1 --scenarios clean,nan_grads --defences none,stablejax
  python -m bench.scenarios --seeds 0,1,2   # every cell with 3 seeds: mean +/- sd per cell

Every run is a real trainer run (`stablejax.training.loop.Trainer`: the jitted train step, the data
pipeline, evaluation, checkpoints, monitoring and recovery) of a small GPT on the embedded corpus
(`pydoc`), same seed and data order in every cell. Each defence is a trainer config
(`stability.*` and `optimizer.name`), except `optax.apply_if_finite`, which is no trainer option
and is swapped in as the run's optimizer before compilation (the same step and loop run it).

Defences (all AdamW unless named; only `stablejax` and `stablejax+muon` roll back):
  none             plain AdamW, nothing else
  clip1            optax.clip_by_global_norm(1.0) + AdamW
  apply_if_finite  optax.apply_if_finite(AdamW, max_consecutive_errors=16)
  zclip            stablejax.zclip + AdamW
  adagc            stablejax.adagc + AdamW
  skip_spikes      stablejax.skip_spikes(AdamW)
  skip_nonfinite   stablejax.skip_nonfinite(AdamW)
  qk_clip          AdamW + stablejax.qk_clip (tau 30)
  stablejax        the trainer's stack: skip_nonfinite(skip_spikes(zclip + AdamW)) + rollback
                   (+ the Kahan-compensated update with bf16 parameters)
  stablejax+muon   the same around outlier-safe Muon (the trainer's default optimizer)

Scenarios: clean; lr10x (every learning rate x10); garbage (a batch of one repeated byte every
`--garbage-every` steps); nan_grads (gradients multiplied by NaN at 6 random steps); fp16_aggressive
(fp16 compute, loss scale 2**16 growing x2 every 100 steps) and fp16_conservative (2**10, x1.5
every 200); bf16_params (parameters stored in bfloat16, LR / 10) with its fp32 reference
fp32_small_lr; postln_deep and preln_deep (6 layers, Post-LN vs Pre-LN); stale_second_moment
(Adam b2 0.999, gradients x0.01 for the first third of the run: the update spikes when they come
back) with its reference adam_b2_0.999 (the same without the drop).

The stack variants run where they have something to do: stablejax+update_zclip and
stablejax+update_rms (the update clips, off by default) on clean, lr10x and the b2 0.999 rows;
stablejax_uncompensated and stablejax+stochastic_rounding (bf16 parameters without the default
Kahan compensation, or with stochastic rounding instead) on bf16_params.

Columns: status (ok: finished with a finite val loss; nan: finished with NaN/Inf; gave_up: the
trainer stopped after its rollback budget, exit 3; crashed: an exception), final val loss (the last
evaluation), spikes (loss-spike events on normal batches: a logged loss that is non-finite or more
than 25% above the median of the previous 20 logged losses; consecutive spiking steps count once;
the injected garbage batches' own losses are not counted), skipped steps (every skip the optimizer
made, also on trajectories later rolled back), rollbacks, warnings (the trainer's monitor:
gradient health, stability score, and the parameter-movement check that flags bf16 underflow),
wall seconds of the whole run (with compilation, on a shared machine) and the median milliseconds
per train step.

With several `--seeds` (model init and data order; the injected faults stay at the same steps),
`scenarios_summary.md` gives each cell's final validation loss as mean +/- sd over the seeds that
finished with a finite loss (`nan` when none did, `k/n ok` when only some did) and checks every
stablejax cell against the best other defence of its row: within one standard error
(sd / sqrt(seeds)) of it, or better.

`--replot DIR/results.json` rebuilds the table, CSV and PNG from the raw results a run saved.
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
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

from bench import _common
from stablejax.transforms import defence as defences

ROOT = Path(__file__).resolve().parent.parent

RESULTS = ROOT / "bench" / "results"
LR = 3e-3          # AdamW (and the Muon run's AdamW groups)
MUON_LR = 0.01     # Muon matrices

BASE = {
    "model": {"vocab_size": 256, "d_model": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 64,
              "compute_dtype": "float32", "qk_norm": False},
    "data": {"train": "pydoc"},
    "optimizer": {"name": "adamw", "learning_rate": LR},
    "stability": {"zclip": {"warmup_steps": 25}, "adagc": {"warmup_steps": 50},
                  "skip_spikes": {"window": 64, "min_history": 32}},
    "train": {"batch_size": 8, "seq_len": 64, "seed": 0, "eval_batches": 4, "log_every": 1,
              "peak_flops_per_device": 1e11},
    "checkpoint": {"keep": 2},
    "logging": {"tensorboard": False, "progress": False, "histogram_every": 0},
}

# Baselines, then each declared defence alone around AdamW (stablejax.transforms.defence), then
# the stacks. "clip1" is the plain clip at 1.0, the baseline of every comparison.
DEFENCES = {
    "none": {"stability": _common.stability_off()},
    "clip1": {"stability": _common.defences_on("clip")},
    "apply_if_finite": {"stability": _common.stability_off()},  # + tx swap, see below
    **{d.name: {"stability": _common.defences_on(d.name)} for d in defences.registered()
       if d.name != "clip"},
    "stablejax": {},
    "stablejax+muon": {"optimizer": {"name": "muon", "learning_rate": MUON_LR,
                                     "adam_learning_rate": LR, "embedding_learning_rate": LR,
                                     "head_learning_rate": LR}},
    # The stack with the update clips (off by default), and bf16 parameters without the
    # compensation (on by default) or with stochastic rounding instead of Kahan summation.
    "stablejax+update_zclip": {"stability": {"zclip_update_norm": {"enabled": True}}},
    "stablejax+update_rms": {"stability": {"clip_update_rms": {"enabled": True}}},
    "stablejax_uncompensated": {"stability": {"compensated_updates": {"enabled": False}}},
    "stablejax+stochastic_rounding": {"stability": {"compensated_updates": {
        "method": "stochastic_rounding"}}},
}

DEEP = {"model": {"n_layers": 6}}
SCENARIOS = {
    "clean": {},
    "lr10x": {"lr_factor": 10.0},
    "garbage": {"garbage": True},
    "nan_grads": {"nan": True},
    "fp16_aggressive": {"model": {"compute_dtype": "float16"},
                        "stability": {"loss_scale": {"init": 65536.0, "growth_factor": 2.0,
                                                     "growth_interval": 100}}},
    "fp16_conservative": {"model": {"compute_dtype": "float16"}},
    "bf16_params": {"model": {"param_dtype": "bfloat16"}, "lr_factor": 0.1},
    "fp32_small_lr": {"lr_factor": 0.1},
    "postln_deep": {"model": {"n_layers": 6, "post_ln": True}},
    "preln_deep": DEEP,
    # Adam's second moment left stale: gradients 100x smaller for the first third of the run,
    # then back to their scale; with b2 = 0.999 (optax's and PyTorch's default) the second
    # moment, an average over the run so far, is then far too small and the update norm jumps
    # 2x while the gradient norm looks ordinary (Wortsman et al., arXiv 2304.13013, section
    # 3.4). adam_b2_0.999 is the same run without the drop.
    "stale_second_moment": {"optimizer": {"b2": 0.999}, "grad_scale": (0.0, 1 / 3, 0.01)},
    "adam_b2_0.999": {"optimizer": {"b2": 0.999}},
}
# The fp32 reference of bf16_params only needs to show what the same LR does without underflow.
SCENARIO_DEFENCES = {"fp32_small_lr": ("none", "stablejax")}
# The new stack variants only where they have something to do.
_UPDATE_CLIPS = ("stablejax+update_zclip", "stablejax+update_rms")
_PRECISION = ("stablejax_uncompensated", "stablejax+stochastic_rounding")
for _name in SCENARIOS:
  if _name not in SCENARIO_DEFENCES:
    SCENARIO_DEFENCES[_name] = tuple(
        d for d in DEFENCES
        if (d not in _UPDATE_CLIPS or _name in ("clean", "lr10x", "stale_second_moment",
                                                 "adam_b2_0.999"))
        and (d not in _PRECISION or _name == "bf16_params"))


def scenario_config(scenario: str, defence: str, steps: int, garbage_every: int,
                    seed: int = 0) -> dict:
  spec = dict(SCENARIOS[scenario])
  lr_factor = spec.pop("lr_factor", 1.0)
  garbage, nan = spec.pop("garbage", False), spec.pop("nan", False)
  grad_scale = spec.pop("grad_scale", None)
  raw = _common.deep_merge(BASE, DEFENCES[defence])
  raw = _common.deep_merge(raw, spec)
  raw["train"]["seed"] = seed
  warmup = max(2, steps // 10)
  raw["train"].update(steps=steps, warmup_steps=warmup, eval_every=max(1, steps // 2))
  raw["checkpoint"]["every"] = max(1, steps // 4)
  # The parameter-movement check (it flags the bf16 underflow) only where it has something to say:
  # it compiles two more functions per run.
  raw["logging"]["activation_every"] = max(1, steps // 4) if lr_factor < 1 else 0
  for key in ("learning_rate", "adam_learning_rate", "embedding_learning_rate",
              "head_learning_rate"):
    if key in raw["optimizer"]:
      raw["optimizer"][key] *= lr_factor
  faults = {}
  if garbage:
    faults["garbage_batch_steps"] = list(range(2 * warmup, steps, garbage_every))
  if nan:
    import random
    faults["nan_grad_steps"] = sorted(random.Random(0).sample(range(warmup, steps), 6))
  if grad_scale is not None:  # (first, last) as fractions of the run, and the factor
    first, last, factor = grad_scale
    faults["grad_scale_steps"] = list(range(int(first * steps), int(last * steps)))
    faults["grad_scale_factor"] = factor
  raw["faults"] = faults
  return raw


def optax_apply_if_finite(cfg, main_tx):
  import optax
  return optax.with_extra_args_support(optax.apply_if_finite(
      optax.chain(main_tx, optax.inject_hyperparams(optax.scale)(step_size=1.0)),
      max_consecutive_errors=16))


TX_SWAPS = {"apply_if_finite": optax_apply_if_finite}


# ----------------------------------------------------------------------------- one run


def _optax_skips(opt_state) -> int:
  import jax
  import optax
  found = [int(s.total_notfinite) for s in jax.tree.leaves(
      opt_state, is_leaf=lambda x: isinstance(x, optax.ApplyIfFiniteState))
      if isinstance(s, optax.ApplyIfFiniteState)]
  return sum(found)


def count_spikes(losses: list[tuple[int, float]], fault_steps: set[int], window: int = 20,
                 rel: float = 1.25) -> int:
  """Spike events in a logged loss sequence (file order, so rolled-back steps are included)."""
  history: list[float] = []
  events, inside = 0, False
  for step, loss in losses:
    if step in fault_steps:
      continue
    spiking = not math.isfinite(loss) or (
        len(history) >= window and loss > rel * statistics.median(history[-window:]))
    if spiking and not inside:
      events += 1
    inside = spiking
    if math.isfinite(loss) and not spiking:
      history.append(loss)
  return events


def run_status(code: int, val_loss) -> str:
  """ok (finished with a finite val loss), nan, gave_up (exit 3: rollback budget spent), exit_N."""
  if code == 3:
    return "gave_up"
  if code == 0:
    return "ok" if val_loss is not None and math.isfinite(val_loss) else "nan"
  return f"exit_{code}"


def run_one(scenario: str, defence: str, steps: int, garbage_every: int, workdir: str,
            seed: int = 0) -> dict:
  """Runs one cell (one seed) in this process; returns its row and loss curve."""
  from stablejax.training.config import config_from_dict
  from stablejax.training.loop.trainer import Trainer

  raw = scenario_config(scenario, defence, steps, garbage_every, seed)
  name = f"{scenario}__{defence}__s{seed}"
  out = Path(workdir) / name
  result = {"scenario": scenario, "defence": defence, "seed": seed, "status": "crashed",
            "val_loss": None,
            "spikes": None, "skipped": None, "rollbacks": None, "wall_s": None, "ms_step": None,
            "curve": [], "error": ""}
  t0 = time.time()
  log = io.StringIO()
  try:
    cfg = config_from_dict(raw)
    swap = TX_SWAPS.get(defence)

    with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
      run = Trainer(cfg, out, fresh=True, optimizer=swap)
      code = run.train()
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
               if line.strip()]
    train = [r for r in records if "loss" in r and "step" in r]
    # The batch drawn for step index s is logged as step s + 1 (steps are counted after they run).
    faults = {s + 1 for s in raw["faults"].get("garbage_batch_steps", [])}
    losses = [(r["step"], float(r["loss"])) for r in train]
    skipped = sum(1 for r in train if any(k.endswith("/skipped") and v for k, v in r.items()))
    skipped += _optax_skips(run.state.opt_state)
    val = summary.get("final_val_loss")
    status = run_status(code, val)
    step_times = [cfg.train.batch_size * cfg.train.seq_len / r["tokens_per_sec"]
                  for r in train[1:] if r.get("tokens_per_sec")]
    result.update(status=status, val_loss=val, spikes=count_spikes(losses, faults),
                  skipped=skipped, rollbacks=summary["rollbacks"],
                  wall_s=summary["wall_seconds"],
                  ms_step=1e3 * statistics.median(step_times) if step_times else None,
                  curve=losses, warnings=sum(1 for r in records if r.get("event") == "warning"),
                  warning_lines=[r["cause"] for r in records if r.get("event") == "warning"],
                  # the update norm before the learning rate (the monitor's indicator)
                  update_curve=[(r["step"], r["update_norm"] / r["lr"]) for r in train
                                if r.get("update_norm") is not None and r.get("lr")])
  except Exception as e:  # a crashed cell is a result, not the end of the matrix
    result["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
    result["wall_s"] = time.time() - t0
    log.write(traceback.format_exc())
  finally:
    (Path(workdir) / f"{name}.log").write_text(log.getvalue())
    shutil.rmtree(out, ignore_errors=True)
  return result


def _worker_init(cache_dir: str | None) -> None:
  if cache_dir:
    import jax
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


# ----------------------------------------------------------------------------- output


HEADERS = ["scenario", "defence", "seed", "status", "val_loss", "spikes", "skipped", "rollbacks",
           "warnings", "wall_s", "ms_step"]


def _row(r: dict) -> list:
  def num(x, fmt):
    return "-" if x is None else (fmt % x if isinstance(x, float) else str(x))
  return [r["scenario"], r["defence"], r.get("seed", 0), r["status"], num(r["val_loss"], "%.4f"),
          num(r["spikes"], "%d"), num(r["skipped"], "%d"), num(r["rollbacks"], "%d"),
          num(r.get("warnings"), "%d"), num(r["wall_s"], "%.1f"), num(r["ms_step"], "%.1f")]


def write_csv(results: list[dict], path: Path, machine: list[str]) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  with open(path, "w", newline="") as f:
    for line in machine:
      f.write(f"# {line}\n")
    w = csv.writer(f)
    w.writerow(HEADERS + ["error"])
    for r in results:
      w.writerow(_row(r) + [r["error"]])


def plot(results: list[dict], path: Path, title: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np

  scenarios = list(dict.fromkeys(r["scenario"] for r in results))
  defences = list(dict.fromkeys(r["defence"] for r in results))
  colors = {d: plt.cm.tab10(i % 10) for i, d in enumerate(defences)}
  cols = 3
  rows = math.ceil(len(scenarios) / cols)
  fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.2 * rows), squeeze=False)
  for ax, scenario in zip(axes.flat, scenarios):
    for r in results:
      if r["scenario"] != scenario or not r["curve"]:
        continue
      y = np.array([loss for _, loss in r["curve"]], float)
      x = np.arange(len(y))  # logged order: a rollback shows as extra steps, not a jump back
      k = 5
      smooth = np.convolve(np.where(np.isfinite(y), y, np.nan), np.ones(k) / k, mode="valid")
      ax.plot(x[k - 1:], smooth, lw=1, color=colors[r["defence"]],
              label=f"{r['defence']} ({r['status']})")
      bad = ~np.isfinite(y)
      if bad.any():
        first = int(np.argmax(bad))
        ax.axvline(first, color=colors[r["defence"]], ls=":", lw=0.8)
    ax.set_title(scenario, fontsize=9)
    ax.set_ylim(1.5, 6.5)
    ax.set_xlabel("logged train step (incl. replays after rollback)", fontsize=7)
    ax.set_ylabel("train loss (5-step mean)", fontsize=7)
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=6)
  for ax in list(axes.flat)[len(scenarios):]:
    ax.axis("off")
  fig.suptitle(title, fontsize=9)
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=55)
  plt.close(fig)


def report(ordered: list[dict], out_dir, machine: list[str], setting: str, timing: str,
           workdir: str, name: str = "scenarios") -> None:
  print()
  print(_common.table([_row(r) for r in ordered], HEADERS))
  print(f"\n{timing}")
  fails = [r for r in ordered if r["error"]]
  for r in fails:
    print(f"crashed: {r['scenario']} / {r['defence']} / seed {r.get('seed', 0)}: {r['error']} "
          f"(log: {workdir}/{r['scenario']}__{r['defence']}__s{r.get('seed', 0)}.log)")
  summary = summary_markdown(ordered)
  print()
  print(summary)
  if out_dir is not None:
    write_csv(ordered, out_dir / f"{name}.csv", machine + [setting])
    first_seed = min(r.get("seed", 0) for r in ordered)
    plot([r for r in ordered if r.get("seed", 0) == first_seed], out_dir / f"{name}.png",
         "; ".join(machine) + "\n" + setting + f"; curves of seed {first_seed}")
    (out_dir / f"{name}_summary.md").write_text(
        "\n".join(f"<!-- {line} -->" for line in machine + [setting, timing]) + "\n\n"
        + summary + "\n")
    (out_dir / f"{name}_runs.json").write_text(json.dumps(
        {"header": {"machine": machine, "setting": setting, "timing": timing},
         "results": ordered}))
    print(f"wrote {out_dir / (name + '.csv')}, {name}_summary.md, {name}_runs.json and "
          f"{name}.png")


STABLEJAX_DEFENCES = tuple(d for d in DEFENCES if d.startswith("stablejax"))


def cell_stats(rows: list[dict]) -> dict:
  """Mean, sd and standard error of the finite final val losses of one cell's seeds."""
  finite = [r["val_loss"] for r in rows
            if r["status"] == "ok" and r["val_loss"] is not None and math.isfinite(r["val_loss"])]
  n = len(finite)
  mean = statistics.fmean(finite) if finite else float("nan")
  sd = statistics.stdev(finite) if n > 1 else 0.0
  return {"n": len(rows), "ok": n, "mean": mean, "sd": sd,
          "se": sd / math.sqrt(n) if n else float("nan"),
          "skipped": sum(r["skipped"] or 0 for r in rows),
          "rollbacks": sum(r["rollbacks"] or 0 for r in rows),
          "warnings": sum(r.get("warnings") or 0 for r in rows)}


def summary_markdown(results: list[dict]) -> str:
  """Mean +/- sd per cell and, per stablejax cell, the check against the best other defence."""
  scenarios = list(dict.fromkeys(r["scenario"] for r in results))
  defences = list(dict.fromkeys(r["defence"] for r in results))
  cells = {}
  for r in results:
    cells.setdefault((r["scenario"], r["defence"]), []).append(r)
  stats = {k: cell_stats(v) for k, v in cells.items()}
  seeds = max(s["n"] for s in stats.values())
  lines = [f"Final validation loss, mean +/- sd over {seeds} seed(s) (skipped steps / rollbacks / "
           "monitor warnings, summed over the seeds, for the stablejax stacks):", "",
           "| scenario | " + " | ".join(defences) + " | stablejax vs best other |",
           "|---" * (len(defences) + 2) + "|"]
  for sc in scenarios:
    row, verdicts = [sc], []
    others = [stats[(sc, d)] for d in defences
              if d not in STABLEJAX_DEFENCES and (sc, d) in stats and stats[(sc, d)]["ok"]]
    best = min(others, key=lambda s: s["mean"]) if others else None
    for d in defences:
      st = stats.get((sc, d))
      if st is None:
        row.append("")
        continue
      if not st["ok"]:
        text = "nan"
      else:
        text = f"{st['mean']:.3f} +/- {st['sd']:.3f}"
        if st["ok"] < st["n"]:
          text += f" ({st['ok']}/{st['n']} ok)"
      if d in STABLEJAX_DEFENCES:
        text += f" ({st['skipped']}/{st['rollbacks']}/{st['warnings']})"
        if best is not None and st["ok"] == st["n"]:
          gap = st["mean"] - best["mean"]
          ok = gap <= best["se"] or gap <= 0
          verdicts.append(f"{d} {gap:+.3f} ({'within' if ok else 'outside'} 1 SE "
                          f"{best['se']:.3f})")
        elif st["ok"] < st["n"]:
          verdicts.append(f"{d}: {st['n'] - st['ok']} seed(s) failed")
      row.append(text)
    row.append("; ".join(verdicts))
    lines.append("| " + " | ".join(row) + " |")
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--quick", action="store_true", help="60 steps per run instead of 150")
  p.add_argument("--steps", type=int, default=None)
  p.add_argument("--jobs", type=int, default=2, help="runs in parallel (separate processes)")
  p.add_argument("--scenarios", default=",".join(SCENARIOS))
  p.add_argument("--defences", default=",".join(DEFENCES))
  p.add_argument("--garbage-every", type=int, default=None)
  p.add_argument("--seeds", default="0", help="comma list of seeds (model init and data order)")
  p.add_argument("--no-cache", action="store_true",
                 help="no shared persistent compilation cache between the runs")
  p.add_argument("--replot", default=None, metavar="RESULTS_JSON",
                 help="only rebuild the table, CSV and PNG from a saved results.json")
  p.add_argument("--out", default=None, help="CSV/PNG directory (default bench/results, "
                 "or a temporary directory with --quick)")
  p.add_argument("--name", default="scenarios", help="output file prefix (default scenarios: "
                 "NAME.csv, NAME_summary.md, NAME.png)")
  args = p.parse_args(argv)
  steps = args.steps or (60 if args.quick else 150)
  garbage_every = args.garbage_every or max(5, steps // 10)
  scenarios = [s for s in args.scenarios.split(",") if s]
  defences = [d for d in args.defences.split(",") if d]
  for name in scenarios:
    if name not in SCENARIOS:
      p.error(f"unknown scenario {name!r}: choose from {', '.join(SCENARIOS)}")
  for name in defences:
    if name not in DEFENCES:
      p.error(f"unknown defence {name!r}: choose from {', '.join(DEFENCES)}")
  seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
  cells = [(s, d, seed) for s in scenarios for d in defences
           if d in SCENARIO_DEFENCES.get(s, defences) for seed in seeds]
  out_dir = Path(args.out) if args.out else (None if args.quick else RESULTS)
  if args.replot:
    saved = json.loads(Path(args.replot).read_text())
    header = saved["header"]
    for line in header["machine"] + [header["setting"]]:
      print(line)
    report(saved["results"], Path(args.out) if args.out else RESULTS, header["machine"],
           header["setting"], header["timing"], str(Path(args.replot).parent), args.name)
    return 0

  machine = _common.machine_lines()
  for line in machine:
    print(line)
  m = BASE["model"]
  setting = (f"GPT d_model {m['d_model']}, {m['n_layers']} layers (deep: 6), seq "
             f"{BASE['train']['seq_len']}, batch {BASE['train']['batch_size']}, {steps} steps, "
             f"AdamW LR {LR:g} (Muon {MUON_LR:g}), data pydoc, seeds {args.seeds}; "
             f"{len(cells)} runs, {args.jobs} in parallel")
  print(setting)
  sys.stdout.flush()

  workdir = tempfile.mkdtemp(prefix="stablejax_scenarios_")
  cache_dir = None if args.no_cache else os.path.join(workdir, "xla_cache")
  t0 = time.time()
  results: dict[tuple[str, str, int], dict] = {}
  ctx = multiprocessing.get_context("spawn")
  with futures.ProcessPoolExecutor(max_workers=args.jobs, mp_context=ctx,
                                   initializer=_worker_init, initargs=(cache_dir,)) as pool:
    jobs = {pool.submit(run_one, s, d, steps, garbage_every, workdir, seed): (s, d, seed)
            for s, d, seed in cells}
    for job in futures.as_completed(jobs):
      r = job.result()
      results[jobs[job]] = r
      extra = f"  {r['error']}" if r["error"] else ""
      print(f"[{time.time() - t0:6.0f}s] " + " ".join(map(str, _row(r))) + extra, flush=True)
  ordered = [results[c] for c in cells]
  total = time.time() - t0
  if cache_dir:
    shutil.rmtree(cache_dir, ignore_errors=True)
  raw_path = Path(workdir) / "results.json"
  timing = f"{len(cells)} runs in {total:.0f}s wall ({args.jobs} in parallel)."
  raw_path.write_text(json.dumps({"header": {"machine": machine, "setting": setting,
                                             "timing": timing}, "results": ordered}))

  report(ordered, out_dir, machine, setting, timing, workdir, args.name)
  print(f"raw results with loss curves: {raw_path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
