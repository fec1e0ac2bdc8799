"""train.time_budget_minutes, train.target_val_loss and the peak memory in summary.json."""

from __future__ import annotations

import dataclasses
import json
import math
import resource
import time
import types
import typing
from pathlib import Path

import pytest

from stablejax.training.loop import budget as budget_lib
from stablejax.training.loop.budget import Budget, Timings, plan_total_steps

from helpers import ROOT, read_metrics, slow, summary


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
  return types.SimpleNamespace(time_budget_minutes=kw.get("budget"), steps=kw.get("steps"),
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


TIMINGS = Timings(step_seconds=1.0, eval_seconds=2.0, save_seconds=3.0, compile_seconds=10.0)


def test_stored_step_count_is_kept_without_measuring(monkeypatch):
  b = Budget(train_cfg(budget=90.0), t_start=time.time())
  b.load_state_dict({"budget_steps": 1234, "elapsed_seconds": 60.0, "step": 100,
                     "budget_timings": dataclasses.asdict(TIMINGS)})
  monkeypatch.setattr(budget_lib, "measure", lambda *a: pytest.fail("re-measured on resume"))
  assert b.plan(None, None, Path('.')) == 1234 and b.timings == TIMINGS
  assert Budget(train_cfg(), t_start=0).plan(None, None, Path('.')) is None
  # A checkpoint of a version that stored no timings: the count is kept, the timings re-measured
  # (without them the resumed run could not stop early).
  legacy = Budget(train_cfg(budget=90.0), t_start=time.time())
  legacy.load_state_dict({"budget_steps": 1234, "elapsed_seconds": 60.0, "step": 100})
  monkeypatch.setattr(budget_lib, "measure", lambda *a: TIMINGS)
  assert legacy.plan(None, None, Path('.')) == 1234 and legacy.timings == TIMINGS


def test_a_resumed_budget_keeps_its_timings_and_wall_clock(tmp_path):
  # Segment 1 planned with measured timings, saved a checkpoint 40 s in, ticked its clock at 50 s
  # and was killed. Segment 2 resumes: 50 s are spent, and with 1 + 2 + 3 s of margin a 1-minute
  # budget has room for at most 4 more seconds before the run must stop.
  clock = tmp_path / budget_lib.CLOCK_FILE
  first = Budget(train_cfg(budget=1.0), t_start=time.time() - 40, clock_file=clock)
  first.steps, first.timings, first.fixed_by = 500, TIMINGS, "time_budget"
  meta = {**first.state_dict(), "step": 200}
  first.t_start -= 10
  first.tick(force=True)
  assert 49.5 < json.loads(clock.read_text())["elapsed_seconds"] < 51
  second = Budget(train_cfg(budget=1.0), t_start=time.time(), clock_file=clock)
  second.load_state_dict(meta)
  assert second.steps == 500 and second.timings == TIMINGS and second.segments == 2
  assert 49.5 < second.elapsed() < 52  # the clock's time, not only the checkpoint's 40 s
  assert not second.out_of_time()      # 50 + 6 <= 60
  assert second.out_of_time(recent_step_seconds=5.0)  # steps now take 5 s: 50 + 10 + ... > 60
  second.t_start -= 5
  assert second.out_of_time()          # 55 + 6 > 60
  s = second.summary()
  assert s["segments"] == 2 and s["steps_fixed_by"] == "time_budget"
  assert s["within_time_budget"] is True and s["budget_timings"]["step_seconds"] == 1.0
  # A clock without a checkpoint belongs to another run: a fresh run does not read it.
  fresh = Budget(train_cfg(budget=1.0), t_start=time.time(), clock_file=clock)
  fresh.load_state_dict({})
  assert fresh.elapsed() < 1 and fresh.segments == 1


def test_budget_owns_the_step_count_unless_steps_is_given_next_to_it(tmp_path):
  from stablejax.training.config import ConfigError, config_from_dict, load_config
  default = ROOT / "stablejax" / "configs" / "default.json"  # "steps": 250
  assert load_config(default).train.steps == 250
  assert load_config(default, ["train.time_budget_minutes=2"]).train.steps is None
  assert load_config(default, ["train.steps=400", "train.time_budget_minutes=2"]).train.steps == 400
  assert load_config(default, ["train.time_budget_minutes=2",
                              "train.steps=null"]).train.steps is None
  both = tmp_path / "both.json"
  both.write_text(json.dumps({"train": {"steps": 900, "time_budget_minutes": 5}}))
  assert load_config(both).train.steps == 900  # given together: a cap
  assert load_config(both, ["train.time_budget_minutes=3"]).train.steps is None
  assert config_from_dict({"train": {"time_budget_minutes": 2}}).train.steps is None
  assert config_from_dict({"train": {"time_budget_minutes": 2, "steps": 50}}).train.steps == 50
  with pytest.raises(ConfigError, match="train.steps=null needs train.time_budget_minutes"):
    load_config(default, ["train.steps=null"])


def _measured_run(monkeypatch):
  """A bare run for ``Budget.plan`` (eval every 100 steps, a checkpoint every 200, a warmup of
  10, no diagnostics), its measurement replaced by TIMINGS."""
  monkeypatch.setattr(budget_lib, "measure", lambda *a: TIMINGS)
  cfg = types.SimpleNamespace(
      train=types.SimpleNamespace(eval_every=100, warmup_steps=10),
      checkpoint=types.SimpleNamespace(every=200),
      logging=types.SimpleNamespace(activation_every=0, histogram_every=0, sample_every=0))
  return types.SimpleNamespace(cfg=cfg, sampler=None)


def test_plan_without_a_cap_and_with_one_says_what_fixed_the_length(monkeypatch):
  run = _measured_run(monkeypatch)
  # 0.95 * 600 - 10 compile - 2 eval - 3 save = 555 s; 1 + 2/100 + 3/200 = 1.035 s a step.
  fits = math.floor((0.95 * 600 - 10 - 2 - 3) / 1.035)
  owned = Budget(train_cfg(budget=10.0), t_start=time.time())
  assert owned.plan(run, None, Path('.')) == fits and owned.fixed_by == "time_budget"
  assert "fixed by train.time_budget_minutes=10" in owned.describe_length(fits)
  capped = Budget(train_cfg(budget=10.0, steps=250), t_start=time.time())
  assert capped.plan(run, None, Path('.')) == 250 and capped.fixed_by == "train.steps"
  assert capped.summary()["steps_fixed_by"] == "train.steps"
  loose = Budget(train_cfg(budget=10.0, steps=10**6), t_start=time.time())
  assert loose.plan(run, None, Path('.')) == fits and loose.fixed_by == "time_budget"


class _State(typing.NamedTuple):
  params: dict


class _FakeClock:
  """time.perf_counter for budget.measure: advanced by the fake run's work, nothing else."""

  def __init__(self) -> None:
    self.now = 0.0

  def perf_counter(self) -> float:
    return self.now


def test_measure_plans_with_the_slowest_timed_step_and_counts_compilation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
  # The module docstring: the compiled step, an eval and a save are timed; TIMED_STEPS steps are
  # timed after the compiling one and "the slowest counts"; compiling (the first step, the first
  # eval beyond a timed one) is paid again once the schedule is fixed.
  import numpy as np
  from stablejax.training import checkpoint as checkpoint_lib
  clock = _FakeClock()
  monkeypatch.setattr(budget_lib, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
  step_seconds = iter([10.0, 0.5, 0.9, 0.4, 0.5, 0.6])  # compiling step, then 5 timed ones
  eval_seconds = iter([5.0, 2.0])                       # compiling eval, then the timed one

  def train_step(state: _State, batch: dict) -> tuple[_State, dict]:
    clock.now += next(step_seconds)
    return state, {"loss": 1.0}

  def eval_step(params: dict, tokens: object, step: object) -> float:
    clock.now += next(eval_seconds)
    return 1.0

  class FakeCheckpoints:
    def __init__(self, *args: object, **kwargs: object) -> None:
      pass

    def save(self, *args: object) -> None:
      clock.now += 3.0

    def wait(self) -> None:
      pass

    def close(self) -> None:
      pass

  monkeypatch.setattr(checkpoint_lib, "Checkpoints", FakeCheckpoints)
  cfg = types.SimpleNamespace(checkpoint=types.SimpleNamespace(async_save=False),
                              logging=types.SimpleNamespace(activation_every=0, histogram_every=0))
  components = types.SimpleNamespace(
      cfg=cfg, sampler=None,
      data=types.SimpleNamespace(train_iter=lambda: iter(lambda: {"tokens": np.zeros((1, 2, 3))},
                                                          None)),
      step_batch=lambda tokens, step: {"tokens": tokens}, train_step=train_step,
      eval_step=eval_step,
      val_batches=lambda: [np.zeros((2, 3))])
  t = budget_lib.measure(components, _State(params={"w": np.zeros(2, np.float32)}), tmp_path)
  assert budget_lib.TIMED_STEPS == 5
  assert t.step_seconds == pytest.approx(0.9)  # the slowest of 0.5, 0.9, 0.4, 0.5, 0.6
  assert t.eval_seconds == pytest.approx(2.0) and t.save_seconds == pytest.approx(3.0)
  # The first step, and the first eval's 5 - 2 s beyond a timed one.
  assert t.compile_seconds == pytest.approx(10.0 + 3.0)
  assert not (tmp_path / budget_lib.PROBE_DIR).exists()


def test_a_budget_with_room_for_only_the_warmup_is_an_error(
    monkeypatch: pytest.MonkeyPatch) -> None:
  # "not more than train.warmup_steps": a count equal to the warmup leaves no decay at all.
  run = _measured_run(monkeypatch)
  # 0.95 * 60 * b - 15 s of compile, final eval and save = 1.035 s x 10 steps, and half a
  # second for the time the test itself spends (it counts as elapsed).
  minutes = (15 + 10 * 1.035 + 0.5) / (0.95 * 60)
  assert plan_total_steps(minutes * 60, 0.0, TIMINGS, eval_every=100, checkpoint_every=200,
                          max_steps=None) == 10
  with pytest.raises(budget_lib.BudgetError, match="not more than train.warmup_steps=10"):
    Budget(train_cfg(budget=minutes), t_start=time.time()).plan(run, None, Path('.'))
  run.cfg.train.warmup_steps = 9
  assert Budget(train_cfg(budget=minutes), t_start=time.time()).plan(run, None, Path('.')) == 10


def test_diagnostics_are_planned_at_the_more_frequent_interval() -> None:
  cfg = types.SimpleNamespace(logging=types.SimpleNamespace(activation_every=50,
                                                            histogram_every=200))
  assert budget_lib._diagnostics_every(cfg) == 50
  cfg.logging.activation_every = 0
  assert budget_lib._diagnostics_every(cfg) == 200


def test_peak_memory_on_cpu_is_the_process_rss_labelled_as_such():
  m = budget_lib.peak_memory()
  rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  assert "ru_maxrss" in m["peak_memory_source"] and "no device memory" in m["peak_memory_source"]
  assert 0.5 * rss <= m["peak_memory_bytes"] <= 1.5 * rss
  assert 0 < m["peak_memory_fraction"] < 1


# AdamW without the clipping and skipping layers: the budget logic is the same and compiles in a
# fraction of the time, which the budget would otherwise spend on this shared machine. No
# train.steps: the budget owns the count (stablejax/configs/default.json's "steps": 250 is no cap).
BUDGET_RUN = ("optimizer.name=adamw", "stability.zclip.enabled=false",
              "stability.adagc.enabled=false",
              "stability.skip_spikes.enabled=false", "train.warmup_steps=5", "train.eval_every=50",
              "checkpoint.every=50", "train.log_every=1", "logging.histogram_every=0",
              "logging.activation_every=0", "logging.sample_every=0", "train.batch_size=4",
              "train.seq_len=16")


def budget_argv(out, *overrides, fresh=True):
  """train.py's arguments for a tiny run without TINY's train.steps."""
  from helpers import TINY
  args = []
  for item in (*[x for x in TINY if not x.startswith("train.steps=")], *BUDGET_RUN, *overrides):
    args += ["--set", item]
  return args + ["--out", str(out)] + (["--fresh"] if fresh else [])


def run_budget(out, *overrides, fresh=True):
  from stablejax.cli.train import main
  return main(budget_argv(out, *overrides, fresh=fresh))


def batches_that_wait(monkeypatch, seconds: float) -> None:
  """Every training batch arrives ``seconds`` late, as from a slow data source: the runs of this
  process (and the budget's measurement of a step, which reads batches too) spend their minute
  mostly waiting, not computing. The tiny model's step alone takes a few milliseconds here; at
  that speed a budgeted minute would be a minute of CPU time, and a short stall of the machine a
  large share of each step."""
  from stablejax.data.pipeline import Data
  fresh_iterator = Data.train_iter

  def waiting(batch):
    time.sleep(seconds)
    return batch

  def train_iter(data):
    dataset = data.train_dataset
    data.train_dataset = dataset.map(waiting)
    try:
      return fresh_iterator(data)
    finally:
      data.train_dataset = dataset
  monkeypatch.setattr(Data, "train_iter", train_iter)


@slow
def test_budgeted_run_ends_in_budget_with_lr_at_floor_and_resume_keeps_the_count(
    tmp_path, capsys, monkeypatch):
  out = tmp_path / "budget"
  # One minute of batches that each take 0.08 s to arrive: the budget plans about 500 steps here
  # (a checkpoint every 50 steps costs about as much again), past 250 (the budget, not the
  # default config, fixes the length) also on a machine three times slower. The step is measured
  # with its batch's wait; in the run the wait overlaps the previous step's computation, so a
  # stall of the machine eats into that margin first.
  batches_that_wait(monkeypatch, 0.08)
  minutes = 1.0
  capsys.readouterr()
  assert run_budget(out, f"train.time_budget_minutes={minutes}", "train.target_val_loss=5.0") == 0
  printed = capsys.readouterr().out
  s = summary(out)
  # The budget fixed the length, not stablejax/configs/default.json's 250 steps, and says so.
  assert s["planned_steps"] == s["steps"] > 250 and s["steps_fixed_by"] == "time_budget"
  assert f"{s['steps']} steps (fixed by train.time_budget_minutes={minutes:g})" in printed
  assert s["total_wall_seconds"] <= 1.1 * minutes * 60, s["budget_timings"]
  assert s["within_time_budget"] is (s["total_wall_seconds"] <= minutes * 60)
  train = [r for r in read_metrics(out) if "lr" in r and "event" not in r]
  peak, floor = 0.01, 0.01 * 0.1  # TINY's learning rate and the default min_lr_ratio
  assert max(r["lr"] for r in train) == pytest.approx(peak, rel=1e-3)
  assert train[-1]["step"] == s["steps"]
  # The last update used the schedule at step N-1 of N: within 1e-3 of the floor.
  assert train[-1]["lr"] == pytest.approx(floor, rel=1e-3)
  assert s["step_to_target"] is not None and s["step_to_target"] % 50 == 0
  assert 0 < s["time_to_target_s"] <= s["total_wall_seconds"]
  assert s["peak_memory_bytes"] > 0 and "peak_memory_source" in s
  # Run again with thirty times the budget: the checkpoints hold the step count, nothing re-plans.
  assert run_budget(out, "train.time_budget_minutes=15", "train.target_val_loss=5.0",
                    fresh=False) == 0
  assert summary(out)["planned_steps"] == s["planned_steps"] == summary(out)["steps"]
  assert summary(out)["segments"] == 2


@slow
def test_budget_holds_across_an_interrupted_and_slower_resumed_run(tmp_path):
  # Stopped (as by SIGTERM) at step 8, then resumed on a "slower machine": every step takes 250
  # ms more than measured (waiting, so the slower segment costs little CPU). The two segments
  # together must end within the budget: the resumed run keeps the plan's timings and the wall
  # time already spent, and stops early.
  import signal

  from stablejax.training.config import load_config
  from stablejax.training.loop.trainer import Trainer

  minutes = 2.0  # the check below allows 2% over: 2.4 s of a busy machine's noise
  argv = budget_argv(tmp_path, f"train.time_budget_minutes={minutes}")
  cfg = load_config(ROOT / "stablejax" / "configs" / "default.json", argv[1:-2:2])
  assert cfg.train.steps is None
  out = tmp_path / "interrupted"
  started = time.monotonic()

  def stop_at_8(run):
    next_batch = run.batches.next

    def stopping(step):
      if step + 1 == 8:
        run.signals.received = signal.SIGTERM  # what the handler does
      return next_batch(step)
    run.batches.next = stopping
    return run

  def slower(run):
    next_batch = run.batches.next

    def slow(step):
      if time.monotonic() - started > 2 * minutes * 60:
        raise AssertionError("the resumed run went on past twice its budget")
      time.sleep(0.25)
      return next_batch(step)
    run.batches.next = slow
    return run

  t0 = time.monotonic()
  assert stop_at_8(Trainer(cfg, out, fresh=True)).train() == 130
  first = time.monotonic() - t0
  planned = summary(out)["planned_steps"]
  t0 = time.monotonic()
  assert slower(Trainer(cfg, out)).train() == 0
  second = time.monotonic() - t0
  s = summary(out)
  assert s["planned_steps"] == planned and s["segments"] == 2
  assert 8 < s["stopped_early_at"] < planned and s["steps"] == s["stopped_early_at"]
  assert abs(s["total_wall_seconds"] - (first + second)) < 2.0, (s["total_wall_seconds"], first,
                                                                 second)
  # Within the budget, to the accuracy of the measured eval and save times on a busy machine.
  assert first + second <= 1.02 * minutes * 60, (first, second, s["budget_timings"])
  assert s["within_time_budget"] is (s["total_wall_seconds"] <= minutes * 60)


@slow
def test_only_process_0_clears_and_removes_the_shared_probe_directory(tmp_path, monkeypatch):
  # In a multi-process run every process writes its shards of the probe save into one folder.
  # A process other than 0 must neither clear it first (process 0 may already be writing) nor
  # remove it after: here the file "from process 0" must survive a measurement on process 1.
  from stablejax.training.launch import distributed
  from stablejax.training.loop.trainer import Trainer

  from helpers import tiny_config
  cfg = tiny_config(*BUDGET_RUN, "train.time_budget_minutes=5", "train.steps=null")
  run = Trainer(cfg, tmp_path / "run", fresh=True)
  state, _ = run.restorer.restore_or_init()
  probe = tmp_path / "run" / budget_lib.PROBE_DIR
  probe.mkdir()
  (probe / "written_by_process_0").write_text("shard")
  barriers = []
  monkeypatch.setattr(distributed, "is_main", lambda: False)
  monkeypatch.setattr(distributed, "barrier", barriers.append)
  timings = budget_lib.measure(run.components, state, tmp_path / "run")
  assert timings.save_seconds > 0
  assert (probe / "written_by_process_0").read_text() == "shard"
  # Both sides of the save are barriers: clear, then write, then remove.
  assert barriers == ["budget_probe_clear", "budget_probe"]
  monkeypatch.setattr(distributed, "is_main", lambda: True)
  budget_lib.measure(run.components, state, tmp_path / "run")
  assert not probe.exists()  # process 0 removes it, leftovers included
  run.close()


def test_a_start_killed_before_its_first_checkpoint_counts_when_the_clock_is_the_runs(tmp_path):
  # No checkpoint yet (meta {}), but the run's own clock file says 70 s in 1 segment: the next
  # start counts them (a SIGKILL during start-up still spent budget). A clock the run directory
  # does not record as the trainer's is ignored (it belongs to another run).
  from stablejax.training.checkpoint import write_json_atomic
  clock = tmp_path / budget_lib.CLOCK_FILE
  write_json_atomic(clock, {"elapsed_seconds": 70.0, "segments": 1})
  owned = Budget(train_cfg(budget=10.0), t_start=time.time(), clock_file=clock)
  owned.load_state_dict({}, owns_clock=True)
  assert owned.prior_seconds == 70.0 and owned.segments == 2
  assert owned.elapsed() >= 70.0
  foreign = Budget(train_cfg(budget=10.0), t_start=time.time(), clock_file=clock)
  foreign.load_state_dict({}, owns_clock=False)
  assert foreign.prior_seconds == 0.0 and foreign.segments == 1


def test_a_segment_killed_during_start_up_counts_to_its_last_heartbeat(tmp_path):
  """The start-up after the first clock write (the budget's probe, compilations: 14.7 s or 51 s
  in the reviewed runs) writes no log step; a heartbeat keeps the clock so that a SIGKILL there
  loses at most one interval. Here the main thread is busy for 0.8 s after the first write, and
  the clock file (what a SIGKILL leaves) follows it."""
  clock = tmp_path / budget_lib.CLOCK_FILE
  segment = Budget(train_cfg(budget=3.0), t_start=time.time() - 14.7, clock_file=clock)
  segment.tick(force=True)
  first = json.loads(clock.read_text())["elapsed_seconds"]
  segment.start_heartbeat(interval=0.1)
  try:
    time.sleep(0.8)  # the start-up: no log step ticks the clock
    last = json.loads(clock.read_text())["elapsed_seconds"]
  finally:
    segment.stop_heartbeat()
  assert 14.7 <= first < 16 and last >= first + 0.5
  resumed = Budget(train_cfg(budget=3.0), t_start=time.time(), clock_file=clock)
  resumed.load_state_dict({}, owns_clock=True)  # killed before its first checkpoint
  assert resumed.prior_seconds >= first + 0.5 and resumed.segments == 2
  # Without a budget there is no heartbeat (the clock is written at log steps).
  plain = Budget(train_cfg(budget=None), t_start=time.time(), clock_file=tmp_path / "other.json")
  plain.start_heartbeat(interval=0.01)
  time.sleep(0.1)
  plain.stop_heartbeat()
  assert not (tmp_path / "other.json").exists()
