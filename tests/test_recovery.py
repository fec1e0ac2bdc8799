"""Fault injection end to end: NaN gradients, garbage batches, a far too high learning rate,
SIGKILL during training, during a checkpoint save and right after a rollback, a damaged
checkpoint, a transient read error, and what a rollback restores, skips and backs off."""

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
  assert skipped or rec["zclip/was_clipped"], rec


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
  records = read_metrics(out)
  events = [i for i, r in enumerate(records) if r.get("event") == "rollback"]
  for i in events:
    # the LR scale in effect when the failure was logged, backed off by emergency_lr_factor
    before = [r for r in records[:i] if "lr_scale" in r][-1]
    assert records[i]["lr_scale"] == pytest.approx(0.2 * before["lr_scale"], rel=1e-6)
    assert records[i]["skipped_batches"][1] > records[i]["skipped_batches"][0]
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
  assert "checkpoint 30 is damaged" in second.stderr
  assert "resuming at step 20" in second.stdout
  assert train_losses(out) == train_losses(clean_run)
  assert (out / "damaged_checkpoints" / "30" / "state").is_dir()  # set aside, not deleted


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
  before = sorted(p.name for p in (out / "checkpoints").iterdir())
  second = run_subprocess(out)
  assert second.returncode == 2, second.stderr[-2000:]
  assert "are damaged" in second.stderr and "--fresh" in second.stderr
  assert "Traceback" not in second.stderr
  assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before


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


# ----------------------------------------------------------------------------- rollback end to end
# Batches 13, 14 and 15 of the data stream give NaN gradients; three skips in a row ask for a
# rollback, seen when step 16 is logged (at step 17: metrics are read one step late), by when
# batches 0..16 were read. The rollback restores checkpoint 10, skips batches 10..16 and never
# meets the NaN batches, nor the garbage batch 16, again.
NAN_BATCHES = ("faults.nan_grad_batch_indices=[13, 14, 15]", "faults.garbage_batch_indices=[16]",
               "stability.max_consecutive_skips=3")


def tiny_config(*overrides):
  from stablejax.training.config import load_config
  from trainer_utils import ROOT, TINY
  return load_config(ROOT / "configs" / "default.json", [*TINY, *overrides])


@pytest.fixture(scope="module")
def rollback_run(tmp_path_factory):
  """One uninterrupted run with the NaN batches, recording what the trainer fed and restored."""
  import jax
  import orbax.checkpoint as ocp

  from stablejax.training.loop import Run
  from stablejax.training.optim import get_lr_scale

  class RecordingRun(Run):
    def __init__(self, *args, **kwargs):
      self.fed, self.at_rollback = [], []
      super().__init__(*args, **kwargs)

    def _device_tokens(self, tokens):
      self.fed.append(np.array(tokens))
      return super()._device_tokens(tokens)

    def _rollback(self, step, cause):
      restored_step = super()._rollback(step, cause)
      saved = ocp.StandardCheckpointer().restore(
          self.out_dir / "checkpoints" / str(restored_step) / "state")
      self.at_rollback.append({
          "restored_step": restored_step,
          "params": jax.device_get(self.state.params), "saved_params": saved["params"],
          "lr_scale": float(get_lr_scale(self.state.opt_state)),
          "backoff": jax.device_get(self.state.lr_backoff),
          "batches_consumed": self.batches_consumed})
      return restored_step

  out = tmp_path_factory.mktemp("rollback")
  cfg = tiny_config(*NAN_BATCHES)
  run = RecordingRun(cfg, out, fresh=True)
  assert run.train() == 0
  return out, run, cfg


def data_stream(cfg, n):
  """The first `n` training batches, read from a fresh pipeline (no trainer involved)."""
  from stablejax.training.data import build_data
  t = cfg.train
  it = build_data(cfg.data, seq_len=t.seq_len, batch_size=t.batch_size, seed=t.seed,
                  process_index=0, process_count=1).train_iter()
  return [np.asarray(next(it)["tokens"]) for _ in range(n)]


@slow
def test_rollback_restores_the_checkpoint_skips_the_named_batches_and_backs_off(rollback_run):
  import jax
  from stablejax.training.optim import get_lr_scale, lr_schedule

  out, run, cfg = rollback_run
  (event,) = [r for r in read_metrics(out) if r.get("event") == "rollback"]
  assert event["step"] == 17 and event["restored_step"] == 10
  assert event["skipped_batches"] == [10, 17] and event["lr_scale"] == pytest.approx(0.2)
  (seen,) = run.at_rollback
  # exactly the saved parameters of step 10 (read back with Orbax, no template)
  jax.tree.map(np.testing.assert_array_equal, seen["params"], seen["saved_params"])
  assert seen["lr_scale"] == pytest.approx(0.2)  # in the optimizer state at once
  assert float(seen["backoff"].scale) == pytest.approx(0.2) and int(seen["backoff"].start) == 10
  # fed: batches 0..16 (16 replaced by garbage), then after the rollback 17.. (10..16 skipped)
  from stablejax.training.data import garbage_batch
  stream = data_stream(cfg, 17 + 30)
  garbage = garbage_batch("repeat", 8, 32, 256, seed=16)["tokens"]
  want = stream[:16] + [garbage] + stream[17:47]
  assert len(run.fed) == len(want) == 17 + 30
  for got, expected in zip(run.fed, want):
    np.testing.assert_array_equal(got, expected)
  assert not any(np.array_equal(got, garbage) for got in run.fed[17:])
  assert summary(out)["skipped_steps"] == 3 and summary(out)["rollbacks"] == 1
  # The LR scale returns to 1.0 linearly over lr_recovery_steps; the logged lr includes it.
  n = cfg.stability.lr_recovery_steps
  schedule = lr_schedule(cfg, cfg.optimizer.learning_rate)
  records = read_metrics(out)
  after = [r for r in records[records.index(event):] if "lr_scale" in r and "event" not in r]
  assert [r["step"] for r in after] == list(range(12, 41, 2))
  for r in after:  # record k: the update of step k - 1
    scale = 0.2 + 0.8 * min(1.0, (r["step"] - 1 - 10) / n)
    assert r["lr_scale"] == pytest.approx(scale, rel=1e-6)
    assert r["lr"] == pytest.approx(float(schedule(r["step"] - 1)) * scale, rel=1e-5)
  assert float(get_lr_scale(run.state.opt_state)) == pytest.approx(0.2 + 0.8 * 29 / n, rel=1e-6)


@slow
def test_kill_right_after_rollback_resumes_with_its_skip_lr_and_count(rollback_run, tmp_path, capsys,
                                                                      monkeypatch):
  import orbax.checkpoint as ocp

  reference, _, _ = rollback_run
  out = tmp_path / "killed"
  first = run_subprocess(out, *NAN_BATCHES, "faults.kill_at_step=17", fresh=True)
  assert first.returncode == -9, first.stderr[-2000:]
  assert "rollback 1/3 at step 17" in first.stderr
  decision = json.loads((out / "recovery.json").read_text())
  assert [e["restored_step"] for e in decision["recovery"]["events"]] == [10]
  steps = sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())
  assert steps == [0, 10]  # killed before the next checkpoint: only recovery.json knows

  # A transient read error on resume: exit 2, one line, nothing on disk changed.
  listing = sorted(str(p.relative_to(out)) for p in out.rglob("*") if "tensorboard" not in str(p))
  original = ocp.CheckpointManager.restore

  def timeout_once(self, *args, **kwargs):
    monkeypatch.setattr(ocp.CheckpointManager, "restore", original)
    raise TimeoutError("storage did not answer")
  monkeypatch.setattr(ocp.CheckpointManager, "restore", timeout_once)
  capsys.readouterr()
  assert run_inprocess(out, *NAN_BATCHES, fresh=False) == 2
  errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and "TimeoutError: storage did not answer" in errors[0], errors
  assert listing == sorted(str(p.relative_to(out)) for p in out.rglob("*")
                           if "tensorboard" not in str(p))

  second = run_subprocess(out, *NAN_BATCHES)
  assert second.returncode == 0, second.stderr[-3000:]
  assert "re-applying rollback 1" in second.stdout
  s = summary(out)
  assert s["rollbacks"] == 1 and s["skipped_steps"] == 3
  # Same losses and LR scales as the run that was never killed: same skip, same backoff.
  assert train_losses(out) == train_losses(reference)
  scales = lambda d: {r["step"]: r["lr_scale"] for r in read_metrics(d)  # noqa: E731
                      if "lr_scale" in r and "event" not in r}
  assert scales(out) == scales(reference)


@slow
def test_second_rollback_goes_further_back_and_survives_a_kill_before_cleanup(tmp_path):
  # Step-keyed NaN faults strike again after every rollback: rollback 1 returns to step 10,
  # rollback 2 (to the same checkpoint) goes back to step 0; the kill lands after rollback 2 is
  # recorded and before checkpoint 10, now on the abandoned branch, is deleted.
  faults = ("faults.nan_grad_steps=[13, 14, 15]", "stability.max_consecutive_skips=3",
            "stability.max_rollbacks=2")
  out = tmp_path / "further"
  first = run_subprocess(out, *faults, "faults.kill_after_rollback=2", fresh=True)
  assert first.returncode == -9, first.stderr[-2000:]
  events = [r for r in read_metrics(out) if r.get("event") == "rollback"]
  assert [e["restored_step"] for e in events] == [10, 0]
  # rollback 2 skips everything read since step 0's checkpoint: 0..16, then 17..23 (replay)
  assert [e["skipped_batches"] for e in events] == [[10, 17], [0, 24]]
  assert events[1]["lr_scale"] == pytest.approx(0.2 * (0.2 + 0.8 * 5 / 100), rel=1e-6)
  assert sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == [0, 10]

  second = run_subprocess(out, *faults)
  # The resumed run starts from step 0 (not the abandoned 10) with rollback 2's LR scale, and
  # its budget is spent: the third failure stops it.
  assert second.returncode == 3, second.stderr[-3000:]
  assert "re-applying rollback 2" in second.stdout
  assert "recovery budget used: 2 of 2 rollbacks" in second.stdout
  records = read_metrics(out)
  resumed = records[records.index(events[1]) + 1:]
  first_train = next(r for r in resumed if "lr_scale" in r and "event" not in r)
  assert first_train["step"] == 2
  assert first_train["lr_scale"] == pytest.approx(
      events[1]["lr_scale"] + (1 - events[1]["lr_scale"]) * 1 / 100, rel=1e-6)
