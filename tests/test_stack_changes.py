"""A run survives what its operator changes between two starts: defences switched on and off, a
setting of one changed, the optimizer switched on request. The optimizer state is keyed by name,
so each start says in one line what changed and goes on (training/restore_plan.py)."""

import json

import jax
import jax.numpy as jnp
import pytest

from helpers import read_metrics, run_inprocess, slow, train_losses, train_state_class


def _records_after(out, step):
  return [r for r in read_metrics(out) if "loss" in r and "event" not in r and r["step"] > step]


def _within_noise(losses: dict, before: int, after: int) -> None:
  """The first logged loss after a resume is within the run's own step-to-step noise of the last
  one before it."""
  steps = sorted(s for s in losses if s <= before)
  jumps = [abs(losses[b] - losses[a]) for a, b in zip(steps, steps[1:])]
  assert abs(losses[after] - losses[before]) <= 3 * max(jumps[-4:]), (losses, before, after)


@slow
def test_defences_switched_on_and_off_between_starts(tmp_path, capsys):
  out = tmp_path / "run"
  common = ("train.eval_every=50", "checkpoint.every=10")
  assert run_inprocess(out, "train.steps=10", *common) == 0
  capsys.readouterr()
  # Second start: QK-clip on (the tiny model has no QK-norm).
  assert run_inprocess(out, "train.steps=20", "stability.qk_clip.enabled=true", *common,
                       fresh=False) == 0
  printed = capsys.readouterr().out
  assert "resumed with qk_clip on: new state" in printed
  assert "stability.qk_clip.enabled false -> true" in printed
  # Third start: ZClip off, the update RMS clip on, a spike-skip setting changed.
  assert run_inprocess(out, "train.steps=30", "stability.qk_clip.enabled=true",
                       "stability.zclip.enabled=false", "stability.clip_update_rms.enabled=true",
                       "stability.skip_spikes.window=8", *common, fresh=False) == 0
  printed = capsys.readouterr().out
  line = next(x for x in printed.splitlines() if x.startswith("resumed with"))
  assert line == ("resumed with clip_update_rms on: new state; zclip off: its state dropped; "
                  "skip_spikes: its state's layout changed (its settings), started afresh")
  losses = train_losses(out)
  assert max(losses) == 30
  _within_noise(losses, 10, 12)
  _within_noise(losses, 20, 22)
  second = [r for r in _records_after(out, 10) if r["step"] <= 20]
  assert all("qk_clip/max_logit" in r and "zclip/z" in r for r in second)
  third = _records_after(out, 20)
  assert all("update_rms_clip/max_rms" in r and "zclip/z" not in r for r in third)
  events = [r for r in read_metrics(out) if r.get("event") == "resumed"]
  assert [r["step"] for r in events] == [10, 10, 20, 20]
  config = json.loads((out / "config.json").read_text())
  assert config["stability"]["zclip"]["enabled"] is False

  # Another optimizer: refused in one line naming the flag, nothing changed...
  before = (out / "config.json").read_text()
  # (AdamW's stack as test_a_reset_is_applied_only_to_another_optimizers_checkpoint has it: the
  # same programs)
  adamw = ("optimizer.name=adamw", "optimizer.learning_rate=0.001",
           "stability.skip_nonfinite.max_consecutive=3")
  assert run_inprocess(out, "train.steps=36", *adamw, *common, fresh=False) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "--reset-optimizer" in err[0] and "muon" in err[0], err
  assert (out / "config.json").read_text() == before
  # ... and with --reset-optimizer the parameters, step and data position are kept, and the
  # new optimizer continues the learning-rate schedule.
  from stablejax.cli.train import main
  from helpers import sets
  argv = sets("train.steps=36", *adamw, *common) + ["--out", str(out), "--reset-optimizer"]
  assert main(argv) == 0
  printed = capsys.readouterr().out
  assert "optimizer muon -> adamw: its state started afresh (--reset-optimizer)" in printed
  last = _records_after(out, 30)
  assert [r["step"] for r in last] == [32, 34, 36]
  from helpers import optax_lr, tiny_config
  cfg = tiny_config("train.steps=36", *adamw)
  assert last[0]["lr"] == pytest.approx(optax_lr(cfg, 31), rel=1e-5)


def test_a_restore_plan_matches_entries_by_name():
  """The plan from a checkpoint's metadata alone: an entry in both is read, one switched on
  starts fresh, one switched off is dropped, one with other shapes starts fresh; another
  optimizer needs reset_optimizer."""
  from stablejax.training.recovery.restore_plan import StateMismatch, plan

  State = train_state_class()

  def shape(*s):
    return jax.ShapeDtypeStruct(s, jnp.float32)

  saved = {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": {"w": shape(4)},
           "opt_state": {"optimizer": {"muon": {"mu": shape(4)}}, "zclip": {"ema": shape()},
                         "skip_spikes": {"history": shape(64)}, "lr_scale": {"s": shape()}}}
  current = State(step=jax.ShapeDtypeStruct((), jnp.int32), params={"w": shape(4)},
                  opt_state={"optimizer": {"muon": {"mu": shape(4)}}, "qk_clip": {"m": shape()},
                             "skip_spikes": {"history": shape(32)}, "lr_scale": {"s": shape()}})
  p = plan(saved, current)
  assert (p.fresh, p.dropped, p.changed) == (["qk_clip"], ["zclip"], ["skip_spikes"])
  assert sorted(p.target["opt_state"]) == ["lr_scale", "optimizer"]
  assert p.describe() == ("resumed with qk_clip on: new state; zclip off: its state dropped; "
                          "skip_spikes: its state's layout changed (its settings), started afresh")
  other = current.replace(opt_state={**current.opt_state, "optimizer": {"adamw": {"m": shape(4)}}})
  with pytest.raises(StateMismatch, match="muon's and this run's optimizer is adamw: pass "
                                          "--reset-optimizer"):
    plan(saved, other)
  reset = plan(saved, other, reset_optimizer=True)
  assert reset.optimizer_reset == "muon -> adamw" and "optimizer" not in reset.target["opt_state"]
  with pytest.raises(StateMismatch, match=r"params/w is \(4,\) float32 in the checkpoint and "
                                          r"\(5,\) float32 in this run"):
    plan(saved, current.replace(params={"w": shape(5)}))


def _adamw_with_lr_scale(params):
  """This run's optimizer in the trainer's layout, AdamW on a warmup schedule and the LR scale:
  ``(fresh, abstract)``, ``fresh(params)`` its state and ``abstract`` the train state's shapes."""
  import optax
  adamw = optax.adamw(optax.linear_schedule(0.0, 1e-3, 100))
  scale = optax.inject_hyperparams(optax.scale)(step_size=1.0)

  def fresh(p):
    return {"optimizer": {"adamw": adamw.init(p)}, "lr_scale": scale.init(p)}

  State = train_state_class()
  return fresh, jax.eval_shape(lambda: State(step=jnp.int32(0), params=params,
                                             opt_state=fresh(params)))


def test_a_reset_optimizer_continues_the_learning_rate_schedule():
  # finish() after --reset-optimizer: the new optimizer's step counters (the schedule's, Adam's)
  # start at the updates applied so far (the kept lr_scale's count), not at 0.
  from stablejax.training.recovery.restore_plan import plan

  params = {"w": jnp.ones(3)}
  fresh, abstract = _adamw_with_lr_scale(params)
  saved = {"step": abstract.step, "params": abstract.params,
           "opt_state": {"optimizer": {"muon": {"mu": jax.ShapeDtypeStruct((3,), jnp.float32)}},
                         "lr_scale": abstract.opt_state["lr_scale"]}}
  p = plan(saved, abstract, reset_optimizer=True)
  applied = fresh(params)["lr_scale"]._replace(count=jnp.int32(7))
  restored = {"step": jnp.int32(9), "params": params, "opt_state": {"lr_scale": applied}}
  state = p.finish(restored, fresh, lambda: None)
  counts = [int(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(
      state.opt_state["optimizer"]) if getattr(path[-1], "name", None) == "count"]
  assert counts == [7, 7]  # Adam's and the schedule's
  assert int(state.opt_state["lr_scale"].count) == 7 and int(state.step) == 9


@slow
def test_a_reset_is_applied_only_to_another_optimizers_checkpoint(clean_run, tmp_path, capsys):
  # The clean run (Muon, checkpoints 20, 30, 40), its newest checkpoint damaged. Switched to AdamW
  # with --reset-optimizer: the damage is proven although the stack changed (the fall-back to 30);
  # NaN batches right after it trigger a replay and a rollback to checkpoint 30, Muon's, which the
  # reset allows too; the same command again restores AdamW's checkpoint as it is.
  import shutil

  from stablejax.cli.train import main
  from helpers import sets
  out = tmp_path / "switch"
  shutil.copytree(clean_run, out)
  for f in (out / "checkpoints" / "40" / "state").rglob("*"):
    if f.is_file() and f.parent.name == "d":
      f.write_bytes(b"\0" * f.stat().st_size)
  argv = sets("train.steps=50", "optimizer.name=adamw", "optimizer.learning_rate=0.001",
              "faults.nan_grad_batch_indices=[33, 34, 35]",
              "stability.skip_nonfinite.max_consecutive=3") + ["--out", str(out),
                                                              "--reset-optimizer"]
  capsys.readouterr()
  assert main(argv) == 0
  captured = capsys.readouterr()
  assert "warning: checkpoint 40 is damaged" in captured.err
  assert captured.out.count("optimizer muon -> adamw: its state started afresh") == 1
  (rollback,) = [r for r in read_metrics(out) if r.get("event") == "rollback"]
  assert rollback["restored_step"] == 30 and rollback["reproduced"] is True
  assert main(argv) == 0  # at its end: restores checkpoint 50 (AdamW's) and resets nothing
  assert "started afresh" not in capsys.readouterr().out


def test_a_reset_needs_another_optimizer_and_is_the_runs_once_made():
  from stablejax.training.recovery.restore_plan import StateMismatch, plan

  State = train_state_class()

  def shape(*s):
    return jax.ShapeDtypeStruct(s, jnp.float32)

  def saved(name):
    return {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": {"w": shape(4)},
            "opt_state": {"optimizer": {name: {"m": shape(4)}}, "lr_scale": {"s": shape()}}}
  adamw = State(step=jax.ShapeDtypeStruct((), jnp.int32), params={"w": shape(4)},
                opt_state={"optimizer": {"adamw": {"m": shape(4)}}, "lr_scale": {"s": shape()}})
  # the same optimizer: restored as it is, whatever the flag
  same = plan(saved("adamw"), adamw, reset_optimizer=True)
  assert same.optimizer_reset is None and "optimizer" in same.target["opt_state"]
  # another optimizer: the flag, or a switch an earlier start made (recorded), allows the reset
  with pytest.raises(StateMismatch, match="pass --reset-optimizer"):
    plan(saved("muon"), adamw)
  assert plan(saved("muon"), adamw, switched=True).optimizer_reset == "muon -> adamw"
  # a recorded switch allows a change of optimizer, not another layout of the same one
  other = adamw.replace(opt_state={**adamw.opt_state, "optimizer": {"adamw": {"m": shape(5)}}})
  with pytest.raises(StateMismatch, match="another layout"):
    plan(saved("adamw"), other, switched=True)


def test_a_chain_of_the_runs_own_is_named_and_reset_on_request():
  # A run trained through Trainer(cfg, out, tx=...) holds an optimizer state that is not keyed
  # by defence: the command line names that (not only an earlier stablejax's layout), and
  # --reset-optimizer starts the configured chain afresh, its counts at the steps taken.
  import optax
  from stablejax.training.recovery.restore_plan import StateMismatch, plan

  params = {"w": jnp.ones(3)}
  own = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
  stored = jax.eval_shape(lambda: {"step": jnp.int32(0), "params": params,
                                   "opt_state": own.init(params)})
  fresh, abstract = _adamw_with_lr_scale(params)
  with pytest.raises(StateMismatch, match=r"Trainer\(cfg, out, tx=\.\.\.\).*--reset-optimizer"):
    plan(stored, abstract)
  p = plan(stored, abstract, reset_optimizer=True)
  assert p.describe() == ("resumed with optimizer of the run's own chain -> this run's: its state "
                          "started afresh (--reset-optimizer), continuing the learning-rate "
                          "schedule")
  assert sorted(p.target) == ["params", "step"]  # nothing of the optimizer is read
  state = p.finish({"step": jnp.int32(12), "params": params}, fresh, lambda: None)
  counts = [int(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(state.opt_state)
            if getattr(path[-1], "name", None) == "count"]
  assert counts == [12, 12, 12]  # Adam's, the schedule's and the LR scale's


def test_a_checkpoint_with_a_loss_scale_resumes_without_one(tmp_path):
  # fp16 switched off at a resume: the checkpoint's loss scale is not read (Orbax raised a
  # TypeError when the state it was asked to fill had None there).
  import flax.struct
  import grain
  from stablejax.training.checkpoint import Checkpoints
  from stablejax.training.recovery.restore_plan import plan

  class State(flax.struct.PyTreeNode):
    step: jax.Array
    params: dict
    opt_state: dict
    loss_scale: object = None

  class Match:
    def plan(self, stored):
      return plan(stored, abstract)

    def finish(self, p, restored):
      return p.finish(restored, lambda params: {}, lambda: None)

  opt_state = {"optimizer": {"adamw": {"m": jnp.ones(3)}}}
  with_scale = State(step=jnp.int32(7), params={"w": jnp.arange(3.0)}, opt_state=opt_state,
                     loss_scale={"scale": jnp.float32(1024.0)})
  abstract = jax.eval_shape(lambda: State(step=jnp.int32(0), params={"w": jnp.zeros(3)},
                                          opt_state=opt_state))
  data = iter(grain.MapDataset.range(10).batch(2).to_iter_dataset())
  checkpoints = Checkpoints(tmp_path / "ckpt", keep=2, async_save=False)
  checkpoints.save(7, with_scale, data, {})
  state, meta = checkpoints.restore(abstract, data, match=Match())
  checkpoints.close()
  assert int(state.step) == 7 and state.loss_scale is None and meta["step"] == 7
  assert state.params["w"].tolist() == [0.0, 1.0, 2.0]
