"""Diagnose before healing: a failing window replayed (transient or reproduced), rejected
batches, the determinism check, replica fingerprints, the progress watchdog, model surgery on
resume and the re-warmup (training/replay.py, healing.py, rejected.py, replicas.py, watchdog.py,
restore_plan.py)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from helpers import (ROOT, TRAIN, read_metrics, run_inprocess, sets, slow, summary,
                     train_state_class, xla_flags_with_devices)

# A burst of three bad steps (NaN gradients, or spikes) is as long as either skip wrapper's
# max_consecutive: a rollback trigger. (The stack of test_recovery's rollback runs: the same
# programs.)
BURST = ("stability.skip_nonfinite.max_consecutive=3", "stability.skip_spikes.max_consecutive=3")


# ----------------------------------------------------------------------------- units


def test_rejected_batches_block_a_position_skipped_twice_not_a_rollback_window(tmp_path):
  from stablejax.training.recovery.rejected import REJECTED_FILE, RejectedBatches
  from stablejax.training.run_folder.folder import RunDirectory
  run_dir = RunDirectory.open(tmp_path / "run")
  order = {"train.seed": 0}
  rejected = RejectedBatches(run_dir, threshold=2, order=order)
  assert rejected.reject([(5, 5), (6, 6), (7, 7)], "rollback at step 8", counts=False) == []
  assert rejected.reject([(6, 6)], "skip_spikes skipped step 7") == []
  assert rejected.reject([(5, 5), (6, 6), (7, 7)], "rollback at step 8", counts=False) == []
  assert rejected.blocked == set()  # two windows are no proof against a batch
  assert rejected.reject([(6, 6)], "skip_spikes skipped step 7 (replay)") == [6]
  # written at once, atomically; a new start reads it and says so in one line
  saved = json.loads((tmp_path / "run" / REJECTED_FILE).read_text())
  assert [e["counts"] for e in saved["batches"]["6"]] == [False, True, False, True]
  again = RejectedBatches(run_dir, threshold=2, order=order)
  line = again.load()
  assert again.blocked == {6} and "skipping 1 batch rejected 2 times or more (positions 6" in line
  # a replay that cleared the window withdraws its rejections
  assert again.withdraw(lambda position, event: position != 6) == 4
  assert again.blocked == set() and sorted(again.entries) == [5, 7]
  # another data order: the positions name other batches, so the record is not applied
  other = RejectedBatches(run_dir, threshold=2, order={"train.seed": 1})
  assert "another data order" in other.load() and other.blocked == set()
  run_dir.close()


def test_batches_drop_blocked_positions_and_transient_faults_strike_once():
  from stablejax.training.loop.batches import Batches
  from stablejax.training.config import FaultsConfig

  def stream(start):
    return iter({"tokens": np.full((2, 5), i, np.int32)} for i in range(start, 100))
  faults = FaultsConfig(transient_nan_steps=[1], nan_grad_batch_indices=[4])
  batches = Batches(stream(0), faults, 256, lambda tokens, grad_scale, step: {
      "tokens": tokens, "grad_scale": np.float32(grad_scale)})
  batches.blocked = {2}
  got = [batches.next(step) for step in range(4)]
  # position 2 is read and dropped: step 2 trains on position 3
  assert [int(b["tokens"][0, 0]) for b in got] == [0, 1, 3, 4]
  assert batches.dropped == [(2, 2)] and batches.positions == {0: 0, 1: 1, 2: 3, 3: 4}
  # step 1's first execution: the transient NaN; step 3: the batch fault of position 4
  assert [bool(np.isnan(b["grad_scale"])) for b in got] == [False, True, False, True]
  # the same steps again (a replay from step 1): the transient fault is gone, the batch's stays
  batches.consumed, batches.stream = 1, stream(1)
  again = [batches.next(step) for step in range(1, 4)]
  assert [int(b["tokens"][0, 0]) for b in again] == [1, 3, 4]
  assert [bool(np.isnan(b["grad_scale"])) for b in again] == [False, False, True]


def test_a_rewarmup_ramps_linearly_from_zero_whatever_the_recovery_schedule():
  import jax.numpy as jnp
  from stablejax.training.recovery.policy import LRBackoff, backoff_lr_scale
  ramp = LRBackoff(scale=jnp.float32(0.0), start=jnp.int32(20), steps=jnp.int32(10))
  steps = np.array([20, 21, 25, 29, 30, 31, 100])
  for schedule in ("linear", "geometric"):
    got = [float(backoff_lr_scale(ramp, jnp.int32(s), 100, schedule)) for s in steps]
    np.testing.assert_allclose(got, np.clip((steps - 20) / 10, 0, 1), atol=1e-7)


def test_a_resume_may_add_parameters_and_not_remove_or_reshape_them():
  import jax
  import jax.numpy as jnp
  from stablejax.training.recovery.restore_plan import StateMismatch, plan

  State = train_state_class()

  def shape(*s):
    return jax.ShapeDtypeStruct(s, jnp.float32)

  def state(params, moments):
    return State(step=jax.ShapeDtypeStruct((), jnp.int32), params=params,
                 opt_state={"optimizer": {"adamw": {"mu": moments}}})

  saved_params = {"q": {"kernel": shape(4, 4)}}
  saved = {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": saved_params,
           "opt_state": {"optimizer": {"adamw": {"mu": saved_params}}}}
  grown = {"q": {"kernel": shape(4, 4)}, "q_norm": {"scale": shape(4)}}
  p = plan(saved, state(grown, grown))
  assert p.new_params == ["q_norm/scale"] and p.saved_keys == ("optimizer",)
  assert ("params", "q_norm", "scale") not in p.read
  assert ("opt_state", "optimizer", "adamw", "mu", "q", "kernel") in p.read
  assert p.describe().startswith("resumed with 1 new parameter tensors initialised "
                                 "(q_norm/scale), every other tensor restored")
  # the new tensor and its moments from the initial state, every other leaf as read
  restored = {"step": jnp.int32(5), "params": {"q": {"kernel": jnp.full((4, 4), 7.0)}},
              "opt_state": {"optimizer": {"adamw": {"mu": {"q": {"kernel": jnp.ones((4, 4))}}}}}}
  init = State(step=jnp.int32(0), params={"q": {"kernel": jnp.zeros((4, 4))},
                                          "q_norm": {"scale": jnp.ones(4)}}, opt_state={})
  def fresh(params):
    return {"optimizer": {"adamw": {"mu": jax.tree.map(jnp.zeros_like, params)}}}
  full = p.finish(restored, fresh, lambda: init)
  assert float(full.params["q"]["kernel"][0, 0]) == 7.0 and int(full.step) == 5
  np.testing.assert_array_equal(full.params["q_norm"]["scale"], np.ones(4))
  assert float(full.opt_state["optimizer"]["adamw"]["mu"]["q"]["kernel"][0, 0]) == 1.0
  np.testing.assert_array_equal(full.opt_state["optimizer"]["adamw"]["mu"]["q_norm"]["scale"],
                                np.zeros(4))
  # removing or reshaping a tensor is refused, with what the caller says changed
  with pytest.raises(StateMismatch, match=r"q/kernel \(4, 4\) is in the checkpoint only "
                                          r"\(model.x changed\)"):
    plan(saved, state({"other": {"kernel": shape(4, 4)}}, {}), explain=lambda: "model.x changed")
  with pytest.raises(StateMismatch, match=r"q/kernel is \(4, 4\) float32 in the checkpoint and "
                                          r"\(4, 8\) float32"):
    plan(saved, state({"q": {"kernel": shape(4, 8)}}, {}))


def _watchdog(tmp_path, fired, **settings):
  from stablejax.training.config import WatchdogConfig
  from stablejax.training.recovery.watchdog import Watchdog
  events = []
  dog = Watchdog(WatchdogConfig(**settings), log_every=10, run_root=tmp_path,
                 record=events.append, signal_received=lambda: bool(fired.get("signal")),
                 on_fire=lambda code: fired.setdefault("code", code), poll=0.02)
  return dog, events


def test_the_watchdog_waits_for_a_compilation_and_fires_on_a_stuck_main_thread(tmp_path,
                                                                               monkeypatch):
  import jax
  import jax.numpy as jnp
  from jax._src import compiler
  slow = compiler.backend_compile_and_load

  def slow_compile(*args, **kwargs):  # XLA busy for a second, under JAX's compiler frames
    time.sleep(1.0)
    return slow(*args, **kwargs)
  monkeypatch.setattr(compiler, "backend_compile_and_load", slow_compile)
  x = jnp.ones(3)  # the backend starts here, not while the watchdog runs (alone, it would)
  fired: dict = {}
  dog, events = _watchdog(tmp_path, fired, timeout_seconds=0.2, startup_seconds=0.2)
  salt = float(time.time_ns() % 999_983)  # a program no cache holds
  # Traced and lowered before the watch: Python work outside the compiler's frames, which on a
  # loaded machine can itself outlast the 0.2 s timeout.
  lowered = jax.jit(lambda x: jnp.tanh(x) * salt).lower(x)
  dog.start()
  t0 = time.monotonic()
  lowered.compile()
  assert time.monotonic() - t0 >= 1.0 and not fired  # 5 timeouts long, never a hang
  dog.beat(7)
  time.sleep(1.0)  # stuck: no beat
  dog.stop()
  assert fired == {"code": 18}
  (event,) = events
  assert event["event"] == "watchdog" and event["step"] == 7
  stacks = (tmp_path / "hang_stacks" / "process_0.txt").read_text()
  # every thread, the stuck main thread among them, at the line where it waits
  assert "test_the_watchdog_waits_for_a_compilation" in stacks and 'Thread 0x' in stacks


def test_a_stop_signal_the_run_cannot_act_on_ends_it_after_the_grace_period(tmp_path):
  fired: dict = {}
  dog, events = _watchdog(tmp_path, fired, grace_seconds=0.3)
  dog.start()
  fired["signal"] = True
  t0 = time.monotonic()
  while "code" not in fired and time.monotonic() - t0 < 5:
    dog.beat()  # progress does not help: the signal is not acted on
    time.sleep(0.01)
  dog.stop()
  assert fired["code"] == 130 and 0.3 <= time.monotonic() - t0 < 2
  assert "grace_seconds" in events[0]["cause"]


def test_the_default_timeout_ends_a_hang_of_the_default_model_within_five_minutes():
  from stablejax.training.config import WatchdogConfig, load_config
  from stablejax.training.recovery.watchdog import Watchdog
  cfg = load_config(None, [])
  dog = Watchdog(cfg.stability.watchdog, cfg.train.log_every, None, lambda e: None, lambda: False)
  assert dog.timeout() == cfg.stability.watchdog.startup_seconds  # before the first interval
  dog.measured(0.4)  # the default model's step on this machine is about that
  assert dog.timeout() == 180.0 and dog._poll() == 5.0  # at most 185 s from the last beat
  dog.measured(2.5)  # a slower interval since (a loaded machine): 10 x 10 steps x 2.5 s
  assert dog.timeout() == 250.0
  assert Watchdog(WatchdogConfig(timeout_seconds=30), 10, None, lambda e: None,
                  lambda: False).timeout() == 1800.0  # a fixed timeout starts after the start


# ----------------------------------------------------------------------------- trainer runs


def _events(out, kind):
  return [r for r in read_metrics(out) if r.get("event") == kind]


@slow
def test_transient_faults_at_several_steps_end_where_the_clean_run_does(clean_run, tmp_path):
  # NaN gradients on the first execution of a burst of steps, and a gradient scaled by 1e8 on
  # the first execution of a second: each burst triggers a rollback, each replay trains through
  # it. The run is the clean run's to the bit: no backoff, no skipped data.
  # Each burst is as long as the skip wrapper's max_consecutive, so that its trigger comes after
  # it (steps that run for the first time after a replay would fail again).
  out = tmp_path / "transient"
  assert run_inprocess(out, *BURST, "faults.transient_nan_steps=[6, 7, 8]",
                       "faults.transient_grad_scale_steps=[21, 22, 23]",
                       "faults.grad_scale_factor=1e8",
                       "stability.recovery.max_transients=4",
                       "stability.determinism.check_every=5") == 0
  replays = _events(out, "replay")
  assert [r["verdict"] for r in replays] == ["transient"] * 2
  assert [r["restored_step"] for r in replays] == [0, 20]
  # the first run's record at the trigger came after three skipped steps; the replay's did not
  first = replays[0]
  assert first["first"]["step"] == first["again"]["step"] == 10
  assert first["first"]["loss"] != first["again"]["loss"]
  assert all(r["device"] == f"process 0 ({socket.gethostname()}), device cpu:0" for r in replays)
  s, clean = summary(out), summary(clean_run)
  assert s["final_val_loss"] == clean["final_val_loss"] and s["rollbacks"] == 0
  last = [r for r in read_metrics(out) if "loss" in r and "event" not in r][-1]
  want = [r for r in read_metrics(clean_run) if "loss" in r and "event" not in r][-1]
  assert last["loss"] == want["loss"] and last["step"] == want["step"] == 40
  # the determinism check: two executions of the same step agree on this CPU
  assert last["determinism/checks"] == 8 and last["determinism/max_loss_diff"] == 0.0
  assert last["determinism/max_grad_norm_diff"] == 0.0
  # the first run's skipped steps were the device's fault: no batch stays rejected
  assert json.loads((out / "rejected_batches.json").read_text())["batches"] == {}


@slow
def test_deterministic_faults_are_reproduced_rolled_back_and_their_batches_never_read_again(
    tmp_path):
  # NaN gradients from the batches at positions 12..14: the replay meets them too, so the
  # rollback goes ahead (backoff, skip) and the three are rejected twice (first run, replay).
  # A nondeterministic step shows in the determinism check.
  out = tmp_path / "det"
  assert run_inprocess(out, *BURST, "faults.nan_grad_batch_indices=[12, 13, 14]",
                       "stability.determinism.check_every=5", "faults.nondeterministic_steps=[5]",
                       "faults.nondeterminism=1e-3") == 0
  (replay,) = _events(out, "replay")
  (rollback,) = _events(out, "rollback")
  assert replay["verdict"] == "reproduced" and replay["again_cause"] == rollback["cause"]
  assert rollback["reproduced"] is True and rollback["restored_step"] == 10
  assert rollback["skipped_batches"][0] == 10 and rollback["lr_scale"] == pytest.approx(0.2)
  assert [p for event in _events(out, "batch_blocked") for p in event["positions"]] == [12, 13, 14]
  saved = json.loads((out / "rejected_batches.json").read_text())["batches"]
  for position in ("12", "13", "14"):
    causes = [e["cause"] for e in saved[position] if e["counts"]]
    assert len(causes) == 2 and causes[1].endswith("(replay)")
  (nondeterminism,) = _events(out, "nondeterminism")
  assert nondeterminism["step"] == 6 and nondeterminism["loss"] == 0.0
  assert 1e-6 < nondeterminism["grad_norm"] < 1e-1
  last = [r for r in read_metrics(out) if "determinism/checks" in r][-1]
  assert last["determinism/max_grad_norm_diff"] == nondeterminism["grad_norm"]
  from stablejax.monitor.report import make_report
  _, text = make_report(out)
  assert "replays: 1 (0 transient: not reproduced, went on; 1 reproduced: rolled back)" in text
  assert "rejected batches never trained on again: positions 12, 13, 14" in text


@slow
def test_a_resume_that_adds_qk_norm_keeps_every_tensor_and_rewarms_once(clean_run, tmp_path,
                                                                         capsys):
  import shutil

  import jax
  import orbax.checkpoint as ocp
  from stablejax.cli.train import main
  out = tmp_path / "surgery"
  shutil.copytree(clean_run, out)  # a run of the tiny model without QK-norm, at step 40
  resume = sets("train.steps=50", "model.qk_norm=true", "checkpoint.every=41") + ["--out", str(out)]
  assert main(resume + ["--rewarmup-steps", "8"]) == 0
  printed = capsys.readouterr().out
  assert ("resumed with 2 new parameter tensors initialised (blocks/attn/k_norm/scale, "
          "blocks/attn/q_norm/scale), every other tensor restored") in printed
  changed = next(line for line in printed.splitlines() if line.startswith("changed since"))
  assert "model.qk_norm false -> true" in changed and "train.rewarmup_steps 0 -> 8" in changed
  # the first step after the switch runs at a learning rate of 0: checkpoint 41 holds every
  # tensor of checkpoint 40 bit for bit, and the new ones at their initial value
  def tensors(step):
    state = ocp.StandardCheckpointer().restore(out / "checkpoints" / str(step) / "state")
    return {jax.tree_util.keystr(path): leaf
            for path, leaf in jax.tree_util.tree_leaves_with_path(state["params"])}
  at_switch, after = tensors(40), tensors(41)
  assert sorted(set(after) - set(at_switch)) == ["['blocks']['attn']['k_norm']['scale']",
                                                 "['blocks']['attn']['q_norm']['scale']"]
  for name, value in at_switch.items():
    np.testing.assert_array_equal(after[name], value, err_msg=name)
  np.testing.assert_array_equal(after["['blocks']['attn']['q_norm']['scale']"], 1.0)
  records = {r["step"]: r for r in read_metrics(out) if "lr_scale" in r and "event" not in r}
  ramp = [step for step in records if 40 < step <= 50]
  assert ramp == [41, 42, 44, 46, 48, 50]  # logged at step 1 after the start, then every 2
  for step in ramp:
    assert records[step]["lr_scale"] == pytest.approx(min(1.0, (step - 41) / 8), abs=1e-6)
  (rewarmup,) = _events(out, "rewarmup")
  assert rewarmup["step"] == 40 and rewarmup["steps"] == 8
  # the same command again: the run is at its end, and says nothing of a ramp
  assert main(resume + ["--rewarmup-steps", "8"]) == 0
  assert "re-warming" not in capsys.readouterr().out and len(_events(out, "rewarmup")) == 1
  from stablejax.monitor.report import make_report
  assert "re-warmup: the learning rate ramped from 0 over 8 steps from step 40" in \
      make_report(out)[1]


# ----------------------------------------------------------------------------- processes


def _train(out, *overrides, devices=None):
  env = dict(os.environ)
  if devices is not None:
    env["XLA_FLAGS"] = xla_flags_with_devices(devices)
  return subprocess.Popen([sys.executable, str(TRAIN), *sets(*overrides), "--out", str(out),
                           "--fresh"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)


@slow
def test_hangs_end_with_every_threads_stack_on_the_host_in_the_pipeline_and_after_sigterm(
    tmp_path):
  # Inside the data pipeline, with a timeout of 3 s: exit 18 and Grain's frames in the stacks.
  pipeline = _train(tmp_path / "pipeline", "faults.hang_at_batch=9",
                    "stability.watchdog.timeout_seconds=3")
  # On the host, with the default timeout: SIGTERM ends it within the 2 s grace period.
  host = _train(tmp_path / "host", "faults.hang_at_step=9", "stability.watchdog.grace_seconds=2")
  try:
    out, err = pipeline.communicate(timeout=300)
    assert pipeline.returncode == 18, err[-2000:]
    stacks = (tmp_path / "pipeline" / "hang_stacks" / "process_0.txt").read_text()
    assert "hang_in_pipeline" in stacks or "in read" in stacks
    assert "grain" in stacks and "training/loop/" in stacks
    assert "no progress for" in err and "(exit code 18)" in err
    (event,) = _events(tmp_path / "pipeline", "watchdog")
    assert event["exit_code"] == 18 and event["step"] == 9
    deadline = time.monotonic() + 300
    while not any(r.get("step") == 8 for r in _records(tmp_path / "host")):
      assert host.poll() is None and time.monotonic() < deadline, host.stderr.read()[-2000:]
      time.sleep(0.5)
    time.sleep(2)  # stuck in step 9 by now
    t0 = time.monotonic()
    host.send_signal(signal.SIGTERM)
    _, err = host.communicate(timeout=60)
    assert host.returncode == 130 and time.monotonic() - t0 < 2 + 5, err[-2000:]
    assert "hang_if_due" in (tmp_path / "host" / "hang_stacks" / "process_0.txt").read_text()
    assert "grace_seconds" in err
  finally:
    for proc in (pipeline, host):
      if proc.poll() is None:
        proc.kill()


def _records(out):
  try:
    return read_metrics(out)
  except (FileNotFoundError, json.JSONDecodeError):
    return []


@slow
def test_a_flaky_device_is_named_and_a_corrupted_copy_stops_the_run_before_a_save(tmp_path):
  # Two devices, one process. Device 1's copy turns NaN on the first execution of steps 12..14:
  # the replay (at step 17, from checkpoint 10) clears it and names that device. A copy changed
  # before step 31 is caught by the check at step 34 (every 17 steps and before every save):
  # nothing after step 30 is saved.
  out = tmp_path / "replicas"
  proc = _train(out, *BURST, "faults.transient_nan_steps=[12, 13, 14]", "faults.transient_device=1",
                "faults.corrupt_replica_step=31", "stability.replicas.check_every=17",
                devices=2)
  _, err = proc.communicate(timeout=300)
  assert proc.returncode == 17, err[-3000:]
  (replay,) = _events(out, "replay")
  assert replay["verdict"] == "transient" and replay["device"].endswith("device cpu:1")
  (event,) = _events(out, "replicas_differ")
  assert event["step"] == 34 and "blocks/" in event["cause"] and "device cpu:1" in event["cause"]
  assert "(exit code 17)" in err
  assert sorted(int(p.name) for p in (out / "checkpoints").iterdir()) == [10, 20, 30]
