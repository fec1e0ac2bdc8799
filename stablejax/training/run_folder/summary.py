"""What a run says of itself: the banner at its start, ``summary.json`` and the last lines at its
end (:class:`stablejax.training.loop.Trainer` prints and writes them, on process 0).

The banner names the model (parameters, family, dtypes), the devices and mesh, the data, the
optimizer with its peak learning rates and step count, the output folder, Muon's routing when
the chain holds an :func:`stablejax.outlier_safe_muon`, and a warning line for each learning
rate that looks set for another optimizer and each key that has no effect. The summary holds
the final losses, skipped steps, rollbacks, throughput and MFU, the stability score, the time
budget's figures and the peak memory.
"""

from __future__ import annotations

import optax
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

import jax

from stablejax.muon.describe import NoOutlierSafeMuonError, describe_routing
from stablejax.training.loop.batches import total_skips
from stablejax.training.loop.budget import peak_memory
from stablejax.training.loop.components import peak_flops_per_device
from stablejax.training.config import ineffective_keys
from stablejax.training.optim import learning_rate_warnings, learning_rates, run_steps

if TYPE_CHECKING:
  from stablejax.monitor.stability_monitor import StabilityMonitor
  from stablejax.training.loop.actions import Diagnostics, Evaluation, Logging
  from stablejax.training.loop.budget import Budget
  from stablejax.training.loop.components import Components
  from stablejax.training.recovery.policy import Recovery


def banner(components: Components, params: optax.Params, budget: Budget, out_dir: Path,
           step: int) -> list[str]:
  """The lines a run starts with (resuming at ``step`` when it is not 0)."""
  cfg, model = components.cfg, components.model
  lines = [
      f"stablejax {_version()}: {model.count_params(params) / 1e6:.2f}M "
      f"parameters ({model.describe()}), params {model.param_dtype}, compute "
      f"{model.compute_dtype}",
      f"devices: {jax.device_count()} x {jax.devices()[0].device_kind} "
      f"({jax.process_count()} process(es)); mesh {dict(components.mesh.shape)}",
      f"data: {json.dumps(components.data.stats, default=str)}",
      f"optimizer: {cfg.optimizer.name}, peak learning rates {learning_rates(cfg)}, "
      f"{components.total_steps} steps ({budget.describe_length(components.total_steps)}), warmup "
      f"{cfg.train.warmup_steps}",
      f"output: {out_dir}" + (f" (resuming at step {step})" if step else ""),
  ]
  sampler = components.sampler
  if sampler is not None and not sampler.gen.cached:
    lines.append(f"samples at evals: {sampler.gen.method} (model family {model.family!r} does "
                 "not offer decoding)")
  try:  # the configured chain or Trainer(tx=...): any chain holding an outlier_safe_muon
    with run_steps(components.total_steps):  # its schedules, as this run's steps see them
      lines.append(describe_routing(params, components.tx))
  except NoOutlierSafeMuonError:
    pass
  return lines + [f"warning: {w}" for w in learning_rate_warnings(cfg) + ineffective_keys(cfg)]


def summary(components: Components, *, step: int, exit_code: int, wall: float, logging: Logging,
            evaluation: Evaluation, diagnostics: Diagnostics, recovery: Recovery,
            monitor: StabilityMonitor, budget: Budget, abandoned_skips: int) -> dict:
  """``summary.json``: the run's outcome at ``step`` after ``wall`` seconds of this segment
  (``abandoned_skips``: the skipped steps of the segments that rollbacks undid)."""
  record = logging.last_record
  tokens_per_sec = logging.tokens_per_sec
  model = components.model
  flops = model.flops_per_token(components.cfg.train.seq_len) if model.supports("FLOPs") else None
  peak = peak_flops_per_device(components.cfg) * jax.device_count()
  return {
      "final_val_loss": evaluation.last_val_loss,
      "final_train_loss": record.get("loss"),
      "steps": step,
      "skipped_steps": total_skips(record) + abandoned_skips,
      "rollbacks": recovery.rollbacks,
      "tokens_per_sec": tokens_per_sec,
      "mfu": (flops * tokens_per_sec / peak
              if flops is not None and math.isfinite(tokens_per_sec) else None),
      "stability_score": monitor.score(),
      "excess_kurtosis": diagnostics.last_kurtosis,
      "wall_seconds": wall,
      "total_wall_seconds": budget.elapsed(),
      "exit_code": exit_code,
      "events": [e.describe() for e in recovery.events],
      **budget.summary(),
      **peak_memory(),
  }


def done(summary: dict, out_dir: Path, monitor: StabilityMonitor) -> list[str]:
  """The lines a run that trained to its end finishes with: its figures, then the monitor's
  advice."""
  return [f"done: {summary['steps']} steps in {summary['wall_seconds']:.0f}s, val_loss "
          f"{summary['final_val_loss']:.4f}, {summary['skipped_steps']} skipped steps, "
          f"{summary['rollbacks']} rollbacks, stability score "
          f"{summary['stability_score']:.2f}; logs in {out_dir}"
          ] + [f"advice: {line}" for line in monitor.advice()]


def _version() -> str:
  """The installed version (read from the package's metadata, not by importing its front file)."""
  from importlib import metadata
  try:
    return metadata.version("stablejax")
  except metadata.PackageNotFoundError:
    return "(not installed)"
