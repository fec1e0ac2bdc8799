"""Fault injection end to end: NaN gradients, garbage batches, a far too high learning rate,
SIGKILL during training and during a checkpoint save, and a damaged checkpoint."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from trainer_utils import read_metrics, run_inprocess, run_subprocess, slow, summary, train_losses


def checkpoint_params_finite(out: Path) -> bool:
  """Reads every checkpoint on disk with Orbax (no template) and checks each array is finite."""
  import orbax.checkpoint as ocp
  steps = [p for p in (out / "checkpoints").iterdir() if p.name.isdigit()]
  assert steps
  for step_dir in steps:
    tree = ocp.StandardCheckpointer().restore(step_dir / "state")
    for leaf in __import__("jax").tree.leaves(tree):
      arr = np.asarray(leaf)
      if np.issubdtype(arr.dtype, np.floating) and not np.all(np.isfinite(arr)):
        return False
  return True


@slow
def test_nan_gradients_and_a_gradient_spike_are_skipped(clean_run, tmp_path):
  out = tmp_path / "nan"
  assert run_inprocess(out, "faults.nan_grad_steps=[12, 27]", "faults.grad_scale_steps=[33]",
                       "faults.grad_scale_factor=1e6") == 0
  s = summary(out)
  assert s["skipped_steps"] == 3 and s["rollbacks"] == 0
  assert abs(s["final_val_loss"] - summary(clean_run)["final_val_loss"]) < 0.15
  records = [r for r in read_metrics(out) if "skip_nonfinite/total_skips" in r]
  assert records[-1]["skip_nonfinite/total_skips"] == 2
  assert records[-1]["skip_spikes/total_skips"] == 1
  assert all(r["params_finite"] for r in records)
  assert checkpoint_params_finite(out)


@slow
def test_garbage_batch_is_contained(clean_run, tmp_path):
  out = tmp_path / "garbage"
  assert run_inprocess(out, "faults.garbage_batch_steps=[25]", "faults.garbage_kind=\"random\"") == 0
  s = summary(out)
  assert abs(s["final_val_loss"] - summary(clean_run)["final_val_loss"]) < 0.15
  # contained: the garbage step was either skipped or had its gradient clipped
  (rec,) = [r for r in read_metrics(out) if r.get("step") == 26 and "zclip/grad_norm" in r]
  skipped = rec["skip_spikes/skipped"] or rec["skip_nonfinite/skipped"]
  assert skipped or rec["zclip/was_clipped"] or rec["adagc/clipped_fraction"] > 0, rec


@slow
def test_learning_rate_far_too_high_rolls_back(tmp_path):
  out = tmp_path / "hot"
  hot = ["optimizer.name=\"adamw\"", "optimizer.learning_rate=1.0", "stability.zclip=false",
         "stability.adagc=false", "stability.max_grad_norm=null", "stability.skip_spikes=false",
         "stability.max_rollbacks=2", "stability.loss_window=2", "stability.loss_explosion_factor=1.5"]
  code = run_inprocess(out, *hot)
  s = summary(out)
  assert code in (0, 3)
  assert s["rollbacks"] >= 1
  events = [r for r in read_metrics(out) if r.get("event") == "rollback"]
  assert [e["lr_scale"] for e in events] == pytest.approx([0.2 ** (i + 1) for i in range(len(events))])
  assert all(e["skipped_batches"][1] > e["skipped_batches"][0] for e in events)
  if code == 0:
    assert math.isfinite(s["final_val_loss"])
  else:
    assert s["exit_code"] == 3 and len(s["events"]) == s["rollbacks"]
  assert checkpoint_params_finite(out)


@slow
def test_kill_during_checkpoint_save_then_resume(clean_run, tmp_path):
  out = tmp_path / "killsave"
  first = run_subprocess(out, "faults.kill_during_save_step=30", "checkpoint.async_save=true",
                         fresh=True)
  assert first.returncode == -9, first.stderr[-2000:]
  second = run_subprocess(out, "checkpoint.async_save=true")
  assert second.returncode == 0, second.stderr[-2000:]
  assert train_losses(out) == train_losses(clean_run)


@slow
def test_corrupt_latest_checkpoint_falls_back(clean_run, tmp_path):
  out = tmp_path / "corrupt"
  first = run_subprocess(out, "faults.kill_at_step=35", fresh=True)
  assert first.returncode == -9
  latest = max((p for p in (out / "checkpoints").iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
  assert latest.name == "30"
  for f in (latest / "state").rglob("*"):
    if f.is_file() and f.stat().st_size > 64 and "json" not in f.name:
      data = bytearray(f.read_bytes())
      for i in range(16, len(data), 97):
        data[i] ^= 0xFF
      f.write_bytes(bytes(data))
  second = run_subprocess(out)
  assert second.returncode == 0, second.stderr[-3000:]
  assert "checkpoint 30 is unusable" in second.stderr
  assert "resuming at step 20" in second.stdout
  assert train_losses(out) == train_losses(clean_run)


@slow
def test_no_usable_checkpoint_exits_2(tmp_path):
  out = tmp_path / "allbad"
  first = run_subprocess(out, "faults.kill_at_step=15", fresh=True)
  assert first.returncode == -9
  for step_dir in (out / "checkpoints").iterdir():
    if step_dir.name.isdigit():
      for f in (step_dir / "state").rglob("*"):
        if f.is_file():
          f.write_bytes(b"\0" * 8)
  second = run_subprocess(out)
  assert second.returncode == 2, second.stderr[-2000:]
  assert "could be restored" in second.stderr and "--fresh" in second.stderr
  assert "Traceback" not in second.stderr


@slow
def test_sigterm_saves_and_exits(tmp_path):
  import signal
  import subprocess
  import sys
  import time

  from trainer_utils import ROOT, TRAIN, sets
  out = tmp_path / "term"
  proc = subprocess.Popen([sys.executable, str(TRAIN), *sets("train.steps=400", "checkpoint.every=1000"),
                           "--out", str(out)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)
  deadline = time.time() + 240
  while time.time() < deadline:
    if (out / "metrics.jsonl").exists() and len(read_metrics(out)) >= 3:
      break
    time.sleep(0.5)
  proc.send_signal(signal.SIGTERM)
  stdout, stderr = proc.communicate(timeout=240)
  assert proc.returncode == 130, stderr[-2000:]
  assert "SIGTERM" in stdout and "checkpoint saved" in stdout
  steps = [int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit()]
  assert max(steps) > 0
