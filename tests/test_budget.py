"""train.time_budget_minutes, train.target_val_loss and the peak memory in summary.json."""

from __future__ import annotations

import math
import resource
import time
import types

import pytest

from stablejax.training import budget as budget_lib
from stablejax.training.budget import Budget, Timings, plan_total_steps

from trainer_utils import read_metrics, run_inprocess, slow, summary


def test_plan_total_steps_arithmetic():
  t = Timings(step_seconds=0.5, eval_seconds=4.0, save_seconds=2.0, compile_seconds=20.0)
  # 0.95 * 600 - 30 elapsed - 20 recompile - 4 final eval - 2 final save = 514 s;
  # per step 0.5 + 4/100 + 2/200 = 0.55 s -> 934 steps.
  assert plan_total_steps(600, 30, t, eval_every=100, checkpoint_every=200,
                          max_steps=10**9) == math.floor(514 / 0.55)
  assert plan_total_steps(600, 30, t, eval_every=100, checkpoint_every=200, max_steps=500) == 500
  assert plan_total_steps(60, 55, t, eval_every=100, checkpoint_every=200, max_steps=10**9) < 0
  t.diagnostics_seconds = 1.5  # every 50 steps: + 0.03 s per step
  assert plan_total_steps(600, 30, t, eval_every=100, checkpoint_every=200, max_steps=10**9,
                          diagnostics_every=50) == math.floor(514 / 0.58)
  # A sample of 2 s every 25 steps: + 0.08 s per step, and the final sample's 2 s. No cap.
  t.sample_seconds = 2.0
  assert plan_total_steps(600, 30, t, eval_every=100, checkpoint_every=200, max_steps=None,
                          diagnostics_every=50, sample_every=25) == math.floor(512 / 0.66)


def test_out_of_time_guards_the_budget():
  b = Budget(train_cfg(budget=1.0), t_start=time.time() - 50)
  assert not b.out_of_time()  # no measurement: nothing to compare against
  b.timings = Timings(step_seconds=1.0, eval_seconds=2.0, save_seconds=3.0, compile_seconds=0.0)
  assert not b.out_of_time()  # 50 + 1 + 2 + 3 <= 60
  b.t_start -= 5
  assert b.out_of_time()      # 55 + 6 > 60


def train_cfg(**kw):
  return types.SimpleNamespace(time_budget_minutes=kw.get("budget"),
                               target_val_loss=kw.get("target"))


def test_target_is_recorded_once_and_survives_a_resume():
  b = Budget(train_cfg(target=2.0), t_start=time.time() - 10)
  assert not b.check_target(100, 2.5)
  assert not b.check_target(150, 2.0)  # "below": equal does not count
  assert b.check_target(200, 1.9)
  assert not b.check_target(300, 1.5)  # the first time is kept
  assert b.step_to_target == 200 and 10 <= b.time_to_target < 60
  meta = b.state_dict()
  resumed = Budget(train_cfg(target=2.0), t_start=time.time())
  resumed.load_state_dict(meta)
  assert resumed.summary()["step_to_target"] == 200
  assert resumed.summary()["time_to_target_s"] == b.time_to_target
  assert resumed.elapsed() >= meta["elapsed_seconds"]  # wall time adds up over resumes
  never = Budget(train_cfg(target=1.0), t_start=time.time())
  never.check_target(10, 3.0)
  assert never.summary()["time_to_target_s"] is None and never.summary()["step_to_target"] is None


def test_stored_step_count_is_kept_without_measuring(monkeypatch):
  b = Budget(train_cfg(budget=90.0), t_start=time.time())
  b.load_state_dict({"budget_steps": 1234, "elapsed_seconds": 60.0})
  monkeypatch.setattr(budget_lib, "measure", lambda run: pytest.fail("re-measured on resume"))
  assert b.plan(run=None) == 1234
  assert Budget(train_cfg(), t_start=0).plan(run=None) is None


def test_peak_memory_on_cpu_is_the_process_rss_labelled_as_such():
  m = budget_lib.peak_memory()
  rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  assert "ru_maxrss" in m["peak_memory_source"] and "no device memory" in m["peak_memory_source"]
  assert 0.5 * rss <= m["peak_memory_bytes"] <= 1.5 * rss
  assert 0 < m["peak_memory_fraction"] < 1


# AdamW without the clipping and skipping layers: the budget logic is the same and compiles in a
# fraction of the time, which the budget would otherwise spend on this shared machine.
BUDGET_RUN = ("optimizer.name=adamw", "stability.zclip=false", "stability.adagc=false",
              "stability.skip_spikes=false", "train.steps=100000", "train.warmup_steps=5", "train.eval_every=50",
              "checkpoint.every=50", "train.log_every=1", "logging.histogram_every=0",
              "logging.activation_every=0", "logging.sample_every=0", "train.batch_size=4",
              "train.seq_len=16")


@slow
def test_budgeted_run_ends_in_budget_with_lr_at_floor_and_resume_keeps_the_count(tmp_path):
  out = tmp_path / "budget"
  minutes = 2.0
  assert run_inprocess(out, f"train.time_budget_minutes={minutes}", "train.target_val_loss=5.0",
                       *BUDGET_RUN) == 0
  s = summary(out)
  assert s["planned_steps"] == s["steps"] > 5
  assert s["total_wall_seconds"] <= 1.1 * minutes * 60, s["budget_timings"]
  train = [r for r in read_metrics(out) if "lr" in r and "event" not in r]
  peak, floor = 0.01, 0.01 * 0.1  # TINY's learning rate and the default min_lr_ratio
  assert max(r["lr"] for r in train) == pytest.approx(peak, rel=1e-3)
  assert train[-1]["step"] == s["steps"]
  # The last update used the schedule at step N-1 of N: within 1e-3 of the floor.
  assert train[-1]["lr"] == pytest.approx(floor, rel=1e-3)
  assert s["step_to_target"] is not None and s["step_to_target"] % 50 == 0
  assert 0 < s["time_to_target_s"] <= s["total_wall_seconds"]
  assert s["peak_memory_bytes"] > 0 and "peak_memory_source" in s
  # Run again with ten times the budget: the checkpoints hold the step count, nothing re-plans.
  assert run_inprocess(out, "train.time_budget_minutes=15", "train.target_val_loss=5.0",
                       *BUDGET_RUN, fresh=False) == 0
  assert summary(out)["planned_steps"] == s["planned_steps"] == summary(out)["steps"]
