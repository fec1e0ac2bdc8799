"""Run report: plots and a text summary of a run's ``metrics.jsonl``.

Usage (the command line is :mod:`stablejax.cli.report`, over :func:`make_report`)::

  python -m stablejax report RUN_DIR [--out PATH] [--window STEPS]

Reads ``RUN_DIR/metrics.jsonl`` (train, eval and event records; see the
metrics contract in ``docs/monitoring.md``), writes ``RUN_DIR/report.png``
and prints a summary of the events: rollbacks, skipped steps, warnings, health
levels, the stability score and the final losses. It reads whatever is there,
so it works on a run that is still being written and on one that crashed: a
truncated or malformed line is skipped and reported, unknown keys are ignored
and every optional key may be missing.

Panels: loss and val loss (with skipped steps and rollbacks marked); raw vs
clipped gradient norm with the ZClip band (EMA mean +- std) and threshold;
learning rate; stability score (the logged ``stability_score`` or, for runs
that did not log it, the score replayed with :class:`StabilityMonitor`) with
the target; window rates (spike, clip, skip); per-group update RMS
(``muon/update_rms/*``); the maximum attention logit per layer
(``attn_logit_max/layer_*``, log scale, with QK-clip's pre-clip maximum and its
threshold crossings when it ran) and the output-logit statistics (max logit,
mean and max log Z).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from stablejax.monitor import StabilityMonitor, _as_float, health_code, specs
from stablejax.transforms.metrics import MetricsSpec

METRICS_FILE = "metrics.jsonl"
REPORT_FILE = "report.png"
REPORT_SOFTWARE = "stablejax report"  # the PNG's Software text: how the report knows its own


class ReportError(Exception):
  """A run directory that cannot be reported on (missing or empty metrics)."""


def read_metrics(path: Path) -> tuple[list[dict], int]:
  """Reads a metrics.jsonl file leniently.

  Args:
    path: the file.

  Returns:
    ``(records, bad_lines)``: the JSON objects that parsed and carry an integer
    ``step``, in file order, and how many non-empty lines were skipped
    (truncated, malformed or without a step).
  """
  records, bad = [], 0
  with open(path, "r", encoding="utf-8", errors="replace") as f:
    for line in f:
      line = line.strip()
      if not line:
        continue
      try:
        rec = json.loads(line)
      except ValueError:
        bad += 1
        continue
      if not isinstance(rec, dict) or not isinstance(rec.get("step"), (int, float)) \
          or isinstance(rec.get("step"), bool):
        bad += 1
        continue
      rec["step"] = int(rec["step"])
      records.append(rec)
  return records, bad


_num = _as_float  # number or None, "NaN"/"Infinity" strings included


def _series(records: Sequence[dict], key: str) -> tuple[list[float], list[float]]:
  """Steps and values of ``key``; a NaN point breaks the line where the step goes back
  (rollback)."""
  xs: list[float] = []
  ys: list[float] = []
  for r in records:
    v = _num(r.get(key))
    if v is not None:
      if xs and r["step"] < xs[-1]:
        xs.append(float("nan"))
        ys.append(float("nan"))
      xs.append(r["step"])
      ys.append(v)
  return xs, ys


def _break_rewinds(steps: Sequence[int],
                   values: Sequence[float]) -> tuple[list[float], list[float]]:
  xs: list[float] = []
  ys: list[float] = []
  for x, y in zip(steps, values):
    if xs and x < xs[-1]:
      xs.append(float("nan"))
      ys.append(float("nan"))
    xs.append(x)
    ys.append(y)
  return xs, ys


# Events that end a run for a fault of the hardware or of the run itself, not of its training.
STOP_EVENTS = ("watchdog", "replicas_differ", "transient_exit")


def _is_train(r: dict) -> bool:
  return "event" not in r and "val_loss" not in r


def analyse(records: Sequence[dict], window: int = 100) -> dict[str, Any]:
  """Replays the train records through a :class:`StabilityMonitor` and gathers events.

  Args:
    records: parsed metrics.jsonl records.
    window: monitor window in steps.

  Returns:
    A dict with ``train`` / ``eval`` / ``events`` record lists, per-train-record
    ``score`` and ``rates`` series (replayed), ``monitor_warnings``
    (``[(step, line)]``), ``skip_steps`` (steps flagged skipped in train
    records or by ``skip`` events), ``rollbacks`` (``[(step, cause)]``),
    ``replays`` (``[(step, verdict, device, cause)]``: the trainer's replays of a failing
    window), ``rewarmups`` (``[(step, steps)]``), ``stops`` (``[(step, event, cause)]``: the
    watchdog, replicas that differ, too many transient faults) and the monitor ``summary``.
  """
  train = [r for r in records if _is_train(r)]
  evals = [r for r in records if "val_loss" in r and "event" not in r]
  events = [r for r in records if "event" in r]
  mon = StabilityMonitor(window=window)
  scores, rates, warnings = [], [], []
  rollbacks = []
  for r in records:  # file order: a rollback event counts for the train records after it
    if r.get("event") == "rollback":
      rollbacks.append((r["step"], str(r.get("cause", ""))))
      mon.record_rollback(r["step"], str(r.get("cause", "")))
    elif _is_train(r):
      for line in mon.update(r["step"], r):
        warnings.append((r["step"], line))
      scores.append(mon.score())
      rates.append(mon.rates())
  skip_steps = set()
  for r in train:
    if any(bool(r.get(k)) for k in r if k.endswith("/skipped")):
      skip_steps.add(r["step"])
  for r in events:
    if r.get("event") == "skip":
      skip_steps.add(r["step"])
  def of(kind: str) -> list[dict]:
    return [r for r in events if r.get("event") == kind]
  return {
      "train": train,
      "eval": evals,
      "events": events,
      "replays": [(r["step"], str(r.get("verdict")), str(r.get("device") or ""),
                   str(r.get("cause", ""))) for r in of("replay")],
      "rewarmups": [(r["step"], r.get("steps")) for r in of("rewarmup")],
      "stops": [(r["step"], r["event"], str(r.get("cause", ""))) for r in events
                if r.get("event") in STOP_EVENTS],
      "score": scores,
      "rates": rates,
      "monitor_warnings": warnings,
      "skip_steps": sorted(skip_steps),
      "rollbacks": rollbacks,
      "summary": mon.summary(),
  }


def plot_report(analysis: dict[str, Any], out_path: Path, title: str = "") -> Path:
  """Draws the report figure (Agg backend, no pyplot state) and saves it as PNG.

  Args:
    analysis: the result of :func:`analyse`.
    out_path: where to write the PNG.
    title: figure title.

  Returns:
    ``out_path``.
  """
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  fig = Figure(figsize=(14, 16), dpi=90)
  FigureCanvasAgg(fig)
  axes = fig.subplots(4, 2).ravel()
  fig.suptitle(title or "stablejax run report")
  for i, (ax, (draw, panel_title, ylabel, log)) in enumerate(zip(axes, PANELS)):
    draw(ax, analysis)
    _mark_events(ax, analysis, label=i == 0)  # the legend of the first panel names them
    _finish(ax, panel_title, ylabel, log)
  fig.tight_layout(rect=(0, 0, 1, 0.97))
  out_path = Path(out_path)
  fig.savefig(out_path, format="png", metadata={"Software": REPORT_SOFTWARE})
  return out_path


def _mark_events(ax: Any, analysis: dict[str, Any], label: bool) -> None:
  """Rollbacks (dashed red), transient faults a replay cleared (dotted green), re-warmups
  (dash-dot purple), stops (black) and skipped steps (orange) as vertical lines."""
  for i, (s, _) in enumerate(analysis["rollbacks"]):
    ax.axvline(s, color="tab:red", lw=1.2, ls="--", alpha=0.8,
               label="rollback" if label and i == 0 else None)
  transients = [s for s, verdict, _, _ in analysis.get("replays", []) if verdict == "transient"]
  for i, s in enumerate(transients):
    ax.axvline(s, color="tab:green", lw=1.2, ls=":", alpha=0.9,
               label="transient fault (replayed)" if label and i == 0 else None)
  for i, (s, _) in enumerate(analysis.get("rewarmups", [])):
    ax.axvline(s, color="tab:purple", lw=1.2, ls="-.", alpha=0.8,
               label="re-warmup" if label and i == 0 else None)
  for i, (s, _, _) in enumerate(analysis.get("stops", [])):
    ax.axvline(s, color="black", lw=1.2, alpha=0.8,
               label="stopped (watchdog, replicas, transients)" if label and i == 0 else None)
  for i, s in enumerate(analysis["skip_steps"]):
    ax.axvline(s, color="tab:orange", lw=0.8, alpha=0.35,
               label="skipped step" if label and i == 0 else None)


def _finish(ax: Any, title: str, ylabel: Optional[str] = None, log: bool = False) -> None:
  ax.set_title(title, fontsize=10)
  ax.set_xlabel("step", fontsize=8)
  if ylabel:
    ax.set_ylabel(ylabel, fontsize=8)
  ax.grid(alpha=0.3)
  ax.tick_params(labelsize=8)
  if log and any(np.any(np.asarray(line.get_ydata(), dtype=float) > 0)
                  for line in ax.get_lines()):
    ax.set_yscale("log")
  handles, labels = ax.get_legend_handles_labels()
  if handles:
    ax.legend(fontsize=7, loc="best")
  if not ax.has_data():
    ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")


def _loss_panel(ax: Any, analysis: dict[str, Any]) -> None:
  train = analysis["train"]
  xs, ys = _series(train, "loss")
  if xs:
    ax.plot(xs, ys, lw=1, label="train loss")
    bad = [(r["step"], v) for r in train for v in [_num(r.get("loss"))]
           if v is not None and not math.isfinite(v)]
    if bad:
      finite = [y for y in ys if math.isfinite(y)]
      ypos = max(finite) if finite else 0.0
      ax.plot([x for x, _ in bad], [ypos] * len(bad), "rx", label="non-finite loss")
  xs, ys = _series(analysis["eval"], "val_loss")
  if xs:
    ax.plot(xs, ys, "o-", ms=3, lw=1.2, label="val loss")


def _grad_norm_panel(ax: Any, analysis: dict[str, Any]) -> None:
  """Raw vs clipped gradient norm, and each clipping defence's band and threshold."""
  train = analysis["train"]
  raw_keys = [key for key in specs.grad_norm_keys()[1:] if any(key in r for r in train)]
  xs, ys = _series(train, raw_keys[0] if raw_keys else "grad_norm")
  if xs:
    ax.plot(xs, [y if math.isfinite(y) else float("nan") for y in ys], lw=1, label="raw grad norm")
  for spec in specs.metric_specs():
    if spec.band is not None:
      _plot_band(ax, train, spec, spec.band)
  _plot_series(ax, train, "grad_norm")


def _lr_panel(ax: Any, analysis: dict[str, Any]) -> None:
  train = analysis["train"]
  xs, ys = _series(train, "lr")
  if xs:
    ax.plot(xs, ys, lw=1.2, label="lr")
  for key in sorted({k for r in train for k in r if k.startswith("lr/")}):
    ax.plot(*_series(train, key), lw=1, label=key)


def _score_panel(ax: Any, analysis: dict[str, Any]) -> None:
  """The logged stability score (or the replayed one), the target, and health levels >= high."""
  train = analysis["train"]
  xs, ys = _series(train, "stability_score")
  if xs:
    ax.plot(xs, ys, lw=1.2, label="stability score (logged)")
  elif train:
    ax.plot(*_break_rewinds([r["step"] for r in train], analysis["score"]), lw=1.2,
            label="stability score (replayed)")
  if train:
    ax.axhline(0.8, color="tab:red", lw=0.8, ls="--", label="target 0.8")
    health = [(r["step"], health_code(r["health"])) for r in train
              if isinstance(r.get("health"), str)]
    high = [(s, 1.0 - 0.03 * code) for s, code in health if math.isfinite(code) and code >= 1]
    if high:
      ax.plot(*zip(*high), "v", color="tab:purple", ms=4,
              label="grad health high/critical/exploded")
  ax.set_ylim(-0.05, 1.05)


def _rates_panel(ax: Any, analysis: dict[str, Any]) -> None:
  """Each registered rate of the replayed monitor; the skip rates as their sum."""
  steps = [r["step"] for r in analysis["train"]]
  styles = ("-", "--", "-.", ":")
  rate_lines = [(rate.name, rate.label or rate.name) for _, rate in specs.rates() if not rate.skip]
  rate_lines.append((specs.SKIP_RATE, "skipped-step rate"))
  for i, (key, label) in enumerate(rate_lines):
    ys = [rt.get(key, float("nan")) for rt in analysis["rates"]]
    if any(math.isfinite(y) for y in ys):
      ax.plot(*_break_rewinds(steps, ys), lw=1, ls=styles[i % len(styles)], label=label)


def _update_rms_panel(ax: Any, analysis: dict[str, Any]) -> None:
  _plot_series(ax, analysis["train"], "update_rms")


def _attention_panel(ax: Any, analysis: dict[str, Any]) -> None:
  """The max attention logit per layer (Wortsman et al.'s first proxy of instability)."""
  train = analysis["train"]

  def layer_index(key: str) -> int:
    tail = key.rsplit("_", 1)[1]
    return int(tail) if tail.isdigit() else 0
  layer_keys = sorted({k for r in train for k in r
                       if k.startswith("attn_logit_max/layer_") and k.count("/") == 1},
                      key=layer_index)
  for key in layer_keys:
    ax.plot(*_series(train, key), lw=0.9, label=key[len("attn_logit_max/"):])
  if not layer_keys:
    xs, ys = _series(train, "attn_logit_max")
    if xs:
      ax.plot(xs, ys, lw=1.2, label="max over layers")
  _plot_series(ax, train, "attention")


def _output_logits_panel(ax: Any, analysis: dict[str, Any]) -> None:
  for key, label in (("output_logit_max", "max logit"), ("output_log_z_mean", "mean log Z"),
                     ("output_log_z_max", "max log Z")):
    xs, ys = _series(analysis["train"], key)
    if xs:
      ax.plot(xs, ys, lw=1, label=label)


# The panels, row by row: (draw, title, y label, log scale).
PANELS = (
    (_loss_panel, "loss", "loss", False),
    (_grad_norm_panel, "gradient norm", "global L2 norm", True),
    (_lr_panel, "learning rate", None, False),
    (_score_panel, "stability score", None, False),
    (_rates_panel, "window rates (replayed monitor)", None, False),
    (_update_rms_panel, "update RMS per group", None, True),
    (_attention_panel, "max attention logit q.k/sqrt(d) per layer", None, True),
    (_output_logits_panel, "output logits", None, False),
)


def _plot_series(ax: Any, train: Sequence[dict], panel: str) -> None:
  """The registered specs' lines of one panel (:class:`stablejax.transforms.metrics.Series`)."""
  for spec in specs.metric_specs():
    for line in spec.series:
      if line.panel != panel:
        continue
      keys = ([spec.key(line.key)] if line.key != "*" else
              sorted({k for r in train for k in r if k.startswith(spec.prefix + "/")}))
      for key in keys:
        xs, ys = _series(train, key)
        if xs:
          label = key[len(spec.prefix) + 1:] if line.label == "*" else line.label
          ax.plot(xs, ys, lw=1, ls=line.style, color="k" if line.style == ":" else None,
                  label=label)


def _plot_band(ax: Any, train: Sequence[dict], spec: MetricsSpec,
               band: tuple[str, str, str]) -> None:
  """A shaded mean +- std band (e.g. ZClip's EMA statistics of the gradient norm)."""
  mean_key, std_key, label = band
  bx, lo, hi = [], [], []
  for r in train:
    m, s = _num(r.get(spec.key(mean_key))), _num(r.get(spec.key(std_key)))
    if m is not None and s is not None and math.isfinite(m) and math.isfinite(s) and m > 0:
      bx.append(r["step"])
      lo.append(max(m - s, 0.1 * m))  # on a log axis a band down to ~0 would swamp the plot
      hi.append(m + s)
  if bx:
    bxs, los = _break_rewinds(bx, lo)
    _, his = _break_rewinds(bx, hi)
    ax.fill_between(bxs, los, his, color="tab:green", alpha=0.2, label=label)


def _fmt(v: Optional[float]) -> str:
  return "n/a" if v is None else f"{v:.4g}"


def format_summary(analysis: dict[str, Any], bad_lines: int = 0, max_lines: int = 20) -> str:
  """The text summary of events and final numbers.

  Args:
    analysis: the result of :func:`analyse`.
    bad_lines: number of skipped lines to mention.
    max_lines: maximum listed items per section.

  Returns:
    Multi-line text.
  """
  train, evals, events = analysis["train"], analysis["eval"], analysis["events"]
  summ = analysis["summary"]
  out = []
  steps = [r["step"] for r in train]
  out.append(f"train records: {len(train)} (steps {min(steps)}..{max(steps)})" if steps
             else "train records: 0")
  out.append(f"eval records: {len(evals)}; event records: {len(events)}")
  if bad_lines:
    out.append(f"skipped {bad_lines} unreadable line(s) (truncated or malformed; a run still "
               "being written or one that crashed mid-line)")
  losses = [(r["step"], _num(r.get("loss"))) for r in train if _num(r.get("loss")) is not None]
  if losses:
    out.append(f"final train loss: {_fmt(losses[-1][1])} at step {losses[-1][0]}")
  vals = [(r["step"], v) for r in evals if (v := _num(r.get("val_loss"))) is not None]
  if vals:
    finite = [v for v in vals if math.isfinite(v[1])]
    best = min(finite, key=lambda v: v[1]) if finite else None
    out.append(f"final val loss: {_fmt(vals[-1][1])} at step {vals[-1][0]}"
               + (f"; best {_fmt(best[1])} at step {best[0]}" if best else ""))
  nonfinite = [r["step"] for r in train
               if (v := _num(r.get("loss"))) is not None and not math.isfinite(v)]
  if nonfinite:
    out.append(f"non-finite loss at {len(nonfinite)} logged step(s): {_list(nonfinite, max_lines)}")
  total_skips = 0
  if train:
    for spec, rate in specs.rates():
      v = _num(train[-1].get(spec.key(rate.counter))) if rate.skip and rate.counter else None
      if v is not None and math.isfinite(v):
        total_skips += int(v)
  out.append(f"skipped steps: {total_skips} by the last logged counters; flagged at logged steps "
             f"or skip events: {_list(analysis['skip_steps'], max_lines)}")
  rbs = analysis["rollbacks"]
  out.append(f"rollbacks: {len(rbs)}")
  for s, cause in rbs[:max_lines]:
    out.append(f"  step {s}: {cause}")
  out += _diagnosis_lines(analysis, max_lines)
  for kind in ("fallback_checkpoint",):
    n = [r for r in events if r.get("event") == kind]
    if n:
      out.append(f"{kind} events: {len(n)} at steps {_list([r['step'] for r in n], max_lines)}")
  logged_warnings = [r for r in events if r.get("event") == "warning"]
  out.append(f"logged warnings: {len(logged_warnings)}")
  for r in logged_warnings[:max_lines]:
    cause = str(r.get("cause", ""))  # monitor warnings already start with "step N:"
    out.append(f"  {cause}" if cause.startswith("step ") else f"  step {r['step']}: {cause}")
  if len(logged_warnings) > max_lines:
    out.append(f"  ... {len(logged_warnings) - max_lines} more")
  if not logged_warnings and analysis["monitor_warnings"]:
    out.append(f"monitor warnings (replayed): {len(analysis['monitor_warnings'])}")
    for _, line in analysis["monitor_warnings"][:max_lines]:
      out.append(f"  {line}")
  levels = summ.get("level_counts") or {}
  if levels:
    out.append("gradient health at logged steps: "
               + ", ".join(f"{k} {levels[k]}" for k in
                           ("low", "healthy", "high", "critical", "exploded") if k in levels)
               + f"; max grad norm {_fmt(summ.get('max_grad_norm'))}")
  logged_scores = [_num(r.get("stability_score")) for r in train
                   if _num(r.get("stability_score")) is not None]
  score = logged_scores[-1] if logged_scores else summ["score"]
  out.append(f"stability score (last window): {score:.3f} (target {summ['score_target']:.2f})")
  rates = summ.get("rates") or {}
  shown = {k: v for k, v in rates.items() if k != "rollbacks"}
  if shown:
    out.append("rates (last window): " + ", ".join(f"{k} {v:.3g}" for k, v in shown.items()))
  for line in summ.get("advice") or []:
    out.append(f"advice: {line}")
  return "\n".join(out)


def _diagnosis_lines(analysis: dict[str, Any], max_lines: int) -> list[str]:
  """The replays (transient or reproduced), rejected batches, re-warmups, the determinism check
  and the stops of the watchdog, the replica check and the transient faults."""
  out = []
  replays, events = analysis.get("replays", []), analysis["events"]
  if replays:
    transient = sum(verdict == "transient" for _, verdict, _, _ in replays)
    out.append(f"replays: {len(replays)} ({transient} transient: not reproduced, went on; "
               f"{len(replays) - transient} reproduced: rolled back)")
    for step, verdict, device, cause in replays[:max_lines]:
      out.append(f"  step {step}: {verdict}" + (f" ({device})" if device else "") + f": {cause}")
  blocked = sorted({p for r in events if r.get("event") == "batch_blocked"
                    for p in r.get("positions", [])})
  dropped = [r["step"] for r in events if r.get("event") == "rejected_batch_dropped"]
  if blocked or dropped:
    out.append(f"rejected batches never trained on again: positions {_list(blocked, max_lines)};"
               f" dropped from the stream at steps {_list(dropped, max_lines)}")
  for step, steps in analysis.get("rewarmups", []):
    out.append(f"re-warmup: the learning rate ramped from 0 over {steps} steps from step {step}")
  last = next((r for r in reversed(analysis["train"]) if "determinism/checks" in r), None)
  if last is not None:
    out.append(f"determinism checks: {int(last['determinism/checks'])}, largest difference of "
               f"two executions: loss {_fmt(_num(last.get('determinism/max_loss_diff')))}, "
               f"gradient norm {_fmt(_num(last.get('determinism/max_grad_norm_diff')))}")
  for step, kind, cause in analysis.get("stops", []):
    out.append(f"stopped at step {step} ({kind}): {cause}")
  return out


def _list(items: Sequence[Any], limit: int) -> str:
  if not items:
    return "none"
  text = ", ".join(str(i) for i in items[:limit])
  return text + (f", ... ({len(items)} total)" if len(items) > limit else "")


def make_report(run_dir: Path, out_path: Optional[Path] = None,
                window: int = 100) -> tuple[Path, str]:
  """Reads ``run_dir/metrics.jsonl``, writes the PNG and returns ``(png_path, summary_text)``.

  Args:
    run_dir: the run directory.
    out_path: PNG path (default ``run_dir/report.png``).
    window: monitor window in steps for the replayed rates and score.

  Raises:
    ReportError: the directory or metrics file is missing or has no records.
  """
  run_dir = Path(run_dir)
  if not run_dir.is_dir():
    raise ReportError(f"run directory {run_dir} does not exist; pass the directory a run wrote "
                      f"{METRICS_FILE} into")
  path = run_dir / METRICS_FILE
  if not path.is_file():
    raise ReportError(f"{path} not found; pass a run directory containing {METRICS_FILE}")
  records, bad = read_metrics(path)
  if not records:
    raise ReportError(f"{path} has no readable records yet; wait for the first log step")
  analysis = analyse(records, window=window)
  out = plot_report(analysis, out_path or run_dir / REPORT_FILE,
                    title=f"stablejax run: {run_dir.name}")
  text = format_summary(analysis, bad_lines=bad)
  return out, text
