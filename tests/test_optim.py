"""The optimizer the trainer builds from its config: weight decay, clipping, rates, the logged
lr."""

from __future__ import annotations

import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import stablejax
from stablejax.training import optim
from stablejax.muon.lr_check import ADAM_MAX_LR
from stablejax.muon.describe import routing_infos
from stablejax.training import config as config_lib
from stablejax.training.config import Config, ConfigError, config_from_dict, load_config
from stablejax.training.loop.step import TrainState, make_train_step
from helpers import gpt_params, read_metrics, run_inprocess, slow

TINY_MODEL = {"vocab_size": 32, "d_model": 16, "n_layers": 2, "n_heads": 2, "max_seq_len": 8,
              "compute_dtype": "float32"}


def _cfg(**sections) -> Config:
  raw = {"model": dict(TINY_MODEL), "train": {"seq_len": 8, "steps": 50, "warmup_steps": 5}}
  for name, values in sections.items():
    raw.setdefault(name, {}).update(values)
  return config_from_dict(raw)


def _paths(tree) -> dict[str, jax.Array]:
  return {"/".join(str(getattr(k, "key", k)) for k in path): leaf
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


# ---------------------------------------------------------------- 12.2: AdamW weight decay


def test_adamw_mode_decays_matrices_with_optimizer_weight_decay_and_never_norms_or_biases():
  cfg = _cfg(optimizer={"name": "adamw", "learning_rate": 1e-3, "weight_decay": 0.1},
             train={"warmup_steps": 0})
  params = gpt_params(cfg.model, seq_len=cfg.train.seq_len)
  tx = optim.main_optimizer(cfg)
  zeros = jax.tree.map(jnp.zeros_like, params)
  # Jitted: eagerly, each of the update's operations compiles on its own.
  updates, _ = jax.jit(tx.update)(zeros, tx.init(params), params)
  # Zero gradients: Adam's direction is 0, so the update is the decoupled decay -lr * wd * p alone.
  lr = 1e-3
  decayed = set()
  for path, u in _paths(updates).items():
    p = _paths(params)[path]
    if path.endswith("/scale") or path.endswith("/bias"):
      np.testing.assert_array_equal(u, 0.0, err_msg=path)   # norm gains (stacked too), biases
    else:
      np.testing.assert_allclose(u, -lr * 0.1 * p, rtol=1e-6, err_msg=path)
      decayed.add(path)
  assert "blocks/attn/q_proj/kernel" in decayed and "tok_embed/embedding" in decayed
  assert any(path.startswith("blocks/attn_norm") for path in _paths(params))


def test_muon_mode_decays_embedding_and_head_with_adam_weight_decay_and_never_norms() -> None:
  # optimizer.adam_weight_decay: the AdamW decay of the embedding and head groups in Muon mode;
  # norm gains and biases are never decayed.
  cfg = _cfg(optimizer={"name": "muon", "learning_rate": 1e-2, "adam_learning_rate": 1e-3,
                        "weight_decay": 0.0, "adam_weight_decay": 0.1},
             train={"warmup_steps": 0})
  params = gpt_params(cfg.model, seq_len=cfg.train.seq_len)
  tx = optim.main_optimizer(cfg)
  zeros = jax.tree.map(jnp.zeros_like, params)
  # Jitted: eagerly, each of the update's operations compiles on its own (a minute on a CPU).
  updates, _ = jax.jit(tx.update)(zeros, tx.init(params), params)
  got, want = _paths(updates), _paths(params)
  # Zero gradients: the update of an AdamW group is its decoupled decay -lr * wd * p alone.
  np.testing.assert_allclose(got["tok_embed/embedding"], -1e-3 * 0.1 * want["tok_embed/embedding"],
                             rtol=1e-6)
  for path, u in got.items():
    if path.endswith("/scale") or path.endswith("/bias"):
      np.testing.assert_array_equal(u, 0.0, err_msg=path)


def test_adam_weight_decay_is_reported_as_ineffective_in_adamw_mode():
  cfg = _cfg(optimizer={"name": "adamw", "learning_rate": 1e-3, "adam_weight_decay": 0.1})
  lines = config_lib.ineffective_keys(cfg)
  assert len(lines) == 1 and lines[0].startswith("optimizer.adam_weight_decay=0.1 has no effect")
  assert "optimizer.weight_decay" in lines[0]   # and names the key to use instead


# ---------------------------------------------------------------- 12.2: ineffective keys


@pytest.mark.parametrize("overrides,keys", [
    ({}, []),
    ({"optimizer": {"name": "adamw", "learning_rate": 1e-3, "momentum": 0.9, "ns_steps": 3,
                    "head_learning_rate": 1e-3}},
     ["optimizer.head_learning_rate", "optimizer.momentum", "optimizer.ns_steps"]),
    ({"optimizer": {"outlier_method": None, "outlier_threshold": 3.0}},
     ["optimizer.outlier_threshold"]),
    ({"stability": {"zclip": {"enabled": False, "z_thresh": 3.0},
                    "adagc": {"enabled": False, "beta": 0.9},
                    "skip_spikes": {"enabled": False, "window": 32, "factor": 10.0},
                    "loss_scale": {"init": 256.0}}},
     ["stability.loss_scale.init", "stability.zclip.z_thresh", "stability.adagc.beta",
      "stability.skip_spikes.window", "stability.skip_spikes.factor"]),
    ({"stability": {"skip_spikes": {"enabled": False, "max_consecutive": 4},
                    "skip_nonfinite": {"enabled": False, "max_consecutive": 4}}},
     ["stability.skip_spikes.max_consecutive", "stability.skip_nonfinite.max_consecutive"]),
    ({"stability": {"adagc": {"enabled": True, "per_layer": False}},
      "model": {"scan_layers": False}},
     ["stability.adagc.per_layer"]),
    ({"train": {"lambda_warmup_steps": 10}, "faults": {"grad_scale_factor": 100.0}},
     ["faults.grad_scale_factor", "train.lambda_warmup_steps"]),  # the model family's rules last
    ({"stability": {"zclip": {"enabled": False}, "adagc": {"enabled": True},
                    "clip": {"enabled": True, "max_norm": 0.5}}}, []),
])
def test_ineffective_keys_are_named(overrides, keys):
  cfg = _cfg(**overrides)
  lines = config_lib.ineffective_keys(cfg)
  assert [line.split("=")[0] for line in lines] == keys
  assert all(" has no effect with " in line for line in lines)


@pytest.mark.parametrize("name", ["default", "gpt2_small", "openwebtext_stable",
                                  "openwebtext_stable_cpu"])
def test_shipped_configs_set_no_ineffective_key(name):
  assert config_lib.ineffective_keys(load_config(name)) == []


# ---------------------------------------------------------------- the plain clip with AdaGC


def test_the_plain_clip_runs_before_adagc_without_zclip():
  cfg = _cfg(stability={"zclip": {"enabled": False}, "clip": {"enabled": True, "max_norm": 0.5},
                        "adagc": {"enabled": True, "lambda_abs": 100.0}},
             optimizer={"name": "adamw", "learning_rate": 1e-3})
  tx = optim.build_optimizer(cfg)
  grads = {"w": jnp.full((4, 4), 2.5)}   # global norm 10
  # Jitted: eagerly, each of the chain's operations compiles on its own.
  _, state = jax.jit(tx.update)(grads, tx.init(grads), grads, loss=jnp.float32(1.0))
  metrics = stablejax.stability_metrics(state)
  # AdaGC (its warmup clip at 100 does nothing here) sees the norm the plain clip left: 0.5.
  assert float(metrics["adagc/grad_norm"]) == pytest.approx(0.5, rel=1e-6)
  assert float(metrics["adagc/clipped_grad_norm"]) == pytest.approx(0.5, rel=1e-6)


# ---------------------------------------------------------------- 12.7: default learning rates


def test_default_config_resolves_sane_rates_for_every_group():
  rates = optim.learning_rates(Config())
  assert set(rates) == {"muon", "adam", "embedding", "head"}
  assert all(isinstance(r, float) for r in rates.values()), rates
  for group in ("adam", "embedding", "head"):
    assert rates[group] <= ADAM_MAX_LR, rates
  assert optim.learning_rate_warnings(Config()) == []


def test_unset_adamw_rates_resolve_to_what_the_optimizer_uses_and_are_checked():
  cfg = _cfg(optimizer={"learning_rate": 0.02, "adam_learning_rate": None})
  rates = optim.learning_rates(cfg)
  assert rates == {"muon": 0.02, "adam": 0.02, "embedding": 0.02, "head": 0.02}
  (info, _), = routing_infos(optim.main_optimizer(cfg))  # what describe_routing reads
  assert {g: float(lr(10 ** 6)) / (cfg.train.min_lr_ratio) for g, lr in info.learning_rates.items()
          } == pytest.approx(rates)   # the schedules end at peak * min_lr_ratio
  warnings = optim.learning_rate_warnings(cfg)
  assert len(warnings) == 1 and "AdamW learning rate 0.02" in warnings[0]


def test_unset_adamw_rate_with_width_scaled_muon_is_a_config_error():
  with pytest.raises(ConfigError, match="optimizer.adam_learning_rate"):
    _cfg(optimizer={"adam_learning_rate": None, "consistent_rms": None})


# ---------------------------------------------------------------- spike rules in the config


def test_spike_factor_rule_alone_from_the_config():
  cfg = _cfg(stability={"zclip": {"enabled": False}, "skip_nonfinite": {"enabled": False},
                        "skip_spikes": {"sigma": None, "factor": 10.0, "window": 16,
                                        "min_history": 4}},
             optimizer={"name": "adamw", "learning_rate": 1e-3})
  tx = optim.build_optimizer(cfg)
  params = {"w": jnp.zeros(4)}
  update = jax.jit(tx.update)

  def skipped_after(history, last):
    state = tx.init(params)
    for norm in history + [last]:
      _, state = update({"w": jnp.full(4, norm / 2)}, state, params, loss=jnp.float32(1.0))
    return bool(state["skip_spikes"].skipped)

  history = [1.0, 1.1, 0.9, 1.0, 1.05]
  assert not skipped_after(history, 5.0)   # far beyond 6 sigma, but only 5x the mean
  assert skipped_after(history, 11.0)


def test_both_spike_rules_off_is_a_config_error():
  with pytest.raises(ConfigError, match="stability.skip_spikes.sigma"):
    _cfg(stability={"skip_spikes": {"sigma": None, "factor": None}})
  _cfg(stability={"skip_spikes": {"sigma": None, "factor": None, "enabled": False}})


def test_olmo_core_spike_statistics_from_the_config():
  cfg = _cfg(stability={"skip_spikes": {"statistics": "olmo_core", "window": 128,
                                        "min_history": None}})
  state = optim.build_optimizer(cfg).init({"w": jnp.zeros(2)})
  assert state["skip_spikes"].loss_history.shape == (128,)
  with pytest.raises(ConfigError, match="stability.skip_spikes.statistics"):
    _cfg(stability={"skip_spikes": {"statistics": "olmo"}})


def test_spike_statistics_from_the_config_reach_skip_spikes() -> None:
  # skip_spikes' docstring: with min_history unset, skipping starts after window // 2 values
  # (winsorized) or max(20, window // 2) - 1 values (olmo_core). At window 20 a spike after 12
  # ordinary steps is skipped by the first rule and not yet by the second.
  def skipped_after_12_steps(statistics: str) -> bool:
    cfg = _cfg(stability={"zclip": {"enabled": False}, "skip_nonfinite": {"enabled": False},
                          "skip_spikes": {"window": 20, "min_history": None,
                                          "statistics": statistics}},
               optimizer={"name": "adamw", "learning_rate": 1e-3})
    tx = optim.build_optimizer(cfg)
    params = {"w": jnp.zeros(4)}
    update = jax.jit(tx.update)
    state: Any = tx.init(params)
    for i in range(12):
      _, state = update({"w": jnp.full(4, 0.5 + 0.01 * (i % 3))}, state, params,
                        loss=jnp.float32(2.0 + 0.01 * (i % 2)))
    assert not bool(state["skip_spikes"].skipped)
    _, state = update({"w": jnp.full(4, 500.0)}, state, params, loss=jnp.float32(50.0))
    return bool(state["skip_spikes"].skipped)

  assert skipped_after_12_steps("winsorized")
  assert not skipped_after_12_steps("olmo_core")


def test_max_consecutive_reaches_both_skip_wrappers() -> None:
  # stability.<skip wrapper>.max_consecutive: that many skipped steps in a row raise
  # needs_rollback.
  cfg = _cfg(stability={"zclip": {"enabled": False}, "skip_nonfinite": {"max_consecutive": 2},
                        "skip_spikes": {"max_consecutive": 2, "window": 8, "min_history": 4,
                                        "sigma": None, "factor": 10.0}},
             optimizer={"name": "adamw", "learning_rate": 1e-3})
  tx = optim.build_optimizer(cfg)
  params = {"w": jnp.zeros(4)}
  update = jax.jit(tx.update)

  def run(bad: float) -> list[tuple[bool, bool]]:
    state = tx.init(params)
    for _ in range(4):
      _, state = update({"w": jnp.full(4, 0.5)}, state, params, loss=jnp.float32(2.0))
    flags = []
    for _ in range(2):
      _, state = update({"w": jnp.full(4, bad)}, state, params, loss=jnp.float32(2.0))
      flags.append((bool(state["skip_nonfinite"].needs_rollback),
                    bool(state["skip_spikes"].needs_rollback)))
    return flags

  # skip_nonfinite (outer) sees the NaN steps; skip_spikes (inner) the 100x norm.
  assert [f[0] for f in run(jnp.nan)] == [False, True]
  assert [f[1] for f in run(100.0)] == [False, True]


# ---------------------------------------------------------------- the run's length


@pytest.mark.parametrize("warmup, steps", [(4, 40), (0, 10), (5, 6), (100, 2703)])
def test_the_schedule_decays_over_the_length_the_step_is_given(warmup, steps):
  # In a train step (run_steps: its batch's run_steps) the schedule is optax's warmup + cosine
  # over that length, whatever train.steps the program was built with; outside, over train.steps.
  peak = 0.01
  cfg = _cfg(train={"warmup_steps": warmup, "steps": warmup + 3})
  schedule = optim.lr_schedule(cfg, peak)
  end = peak * cfg.train.min_lr_ratio
  counts = jnp.arange(steps + 4)

  def in_step(count, length):
    with optim.run_steps(length):
      return schedule(count)
  got = jax.jit(jax.vmap(in_step, in_axes=(0, None)))(counts, jnp.int32(steps))
  want = jax.vmap(optax.warmup_cosine_decay_schedule(0.0, peak, warmup, steps, end))(counts)
  np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-12)
  assert float(got[-1]) == pytest.approx(end, rel=1e-6)  # the floor from the last step on
  configured = optax.warmup_cosine_decay_schedule(0.0, peak, warmup, warmup + 3, end)
  np.testing.assert_array_equal(jax.vmap(schedule)(counts), jax.vmap(configured)(counts))


def test_a_program_config_has_no_length_to_fall_back_on():
  # The programs are built without train.steps (it is host-only): a schedule called in one
  # without the step's length fails rather than decaying over a default count.
  from stablejax.training.loop.components import program_config
  schedule = optim.lr_schedule(program_config(_cfg()), 0.01)
  with pytest.raises(ValueError, match="train.steps is unset"):
    schedule(jnp.int32(3))
  with optim.run_steps(50):
    assert float(schedule(jnp.int32(50))) == pytest.approx(0.01 * _cfg().train.min_lr_ratio)


# ---------------------------------------------------------------- 12.6: the logged lr


def _schedule_counts(opt_state) -> set[int]:
  nodes = jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByScheduleState))
  return {int(n.count) for n in nodes if isinstance(n, optax.ScaleByScheduleState)}


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_logged_lr_is_the_scheduled_rate_applied_after_skipped_steps(name):
  cfg = _cfg(optimizer={"name": name, "learning_rate": 1e-3 if name == "adamw" else 1e-2},
             train={"batch_size": 2, "warmup_steps": 4, "steps": 20})
  model = config_lib.model_of(cfg)
  tx = optim.build_optimizer(cfg)
  schedule = optim.lr_schedule(cfg, cfg.optimizer.learning_rate)
  params = gpt_params(cfg.model, seq_len=cfg.train.seq_len)
  state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))
  step = jax.jit(make_train_step(model, tx, cfg, schedule))
  tokens = jax.random.randint(jax.random.PRNGKey(1), (1, 2, cfg.train.seq_len + 1), 0, 32)
  # The reference rate, computed by the same float32 operations under jit. Two programs may still
  # round the last bit differently (XLA:CPU's emitters fuse them differently): equal to 2 units in
  # the last place, while the rates of neighbouring counts differ by more than 1% here.
  run_steps = jnp.int32(cfg.train.steps)

  def scheduled(count, scale):
    with optim.run_steps(run_steps):  # as in the step: decaying over the batch's run_steps
      return schedule(count) * scale
  rate = jax.jit(scheduled)
  nan_steps, backoff_step = {2, 3, 7}, 9
  applied = 0
  for s in range(12):
    if s == backoff_step:   # the recovery's learning-rate backoff
      state = state.replace(opt_state=optim.set_lr_scale(state.opt_state, 0.2))
    scale = 0.2 if s >= backoff_step else 1.0
    grad_scale = jnp.float32(jnp.nan if s in nan_steps else 1.0)
    state, metrics = step(state, {"tokens": tokens, "grad_scale": grad_scale,
                                  "run_steps": run_steps, "read_metrics": np.bool_(True)})
    # The rate this step applied (or, when skipped, would have): the schedule at the number of
    # updates applied before it, times the backoff.
    expected = np.float32(rate(applied, jnp.float32(scale)))
    assert abs(np.float32(metrics["lr"]) - expected) <= 2 * np.spacing(expected), (
        s, float(metrics["lr"]), float(expected))
    applied += s not in nan_steps
    assert _schedule_counts(state.opt_state) == {applied}   # what the optimizer's schedules saw
  assert applied == 9 and int(state.step) == 12


@slow
def test_trainer_banner_and_logged_lr(tmp_path, capsys):
  # train's main() in this process: what it prints is the program's (tests/test_trainer.py runs
  # train.py as a process).
  out = tmp_path / "run"
  capsys.readouterr()
  code = run_inprocess(
      out, "optimizer.name=\"adamw\"", "optimizer.learning_rate=0.001",
      "optimizer.adam_learning_rate=0.003", "optimizer.embedding_learning_rate=null",
      "optimizer.head_learning_rate=null", "optimizer.weight_decay=0.1",
      "optimizer.adam_weight_decay=0.1", "train.steps=12", "train.log_every=1",
      "faults.nan_grad_steps=[3, 4]", "checkpoint.every=100", "logging.histogram_every=0",
      "logging.activation_every=0", "train.eval_every=100", fresh=True)
  result = capsys.readouterr()
  assert code == 0, result.err[-2000:]
  warnings = [line for line in result.err.splitlines() if line.startswith("warning: ")]
  assert warnings[:1] == ["warning: optimizer.adam_weight_decay=0.1 has no effect with "
                      "optimizer.name=\"adamw\" (AdamW uses optimizer.learning_rate and "
                      "optimizer.weight_decay)"], result.err
  assert not any("learning rate" in line for line in warnings)   # 1e-3 is a sane AdamW rate
  assert "peak learning rates {'adamw': 0.001}" in result.out
  cfg = config_from_dict(json.loads((out / "config.json").read_text()))
  schedule = optim.lr_schedule(cfg, 0.001)
  run_steps = jnp.int32(cfg.train.steps)

  def scheduled(count, scale):
    with optim.run_steps(run_steps):  # as in the step: decaying over the batch's run_steps
      return schedule(count) * scale
  rate = jax.jit(scheduled)
  train = {r["step"]: r for r in read_metrics(out) if "loss" in r and "event" not in r}
  applied = 0
  for s in range(1, 13):   # record s: the s-th step, index s - 1 in faults.nan_grad_steps
    # Two programs may round the last bit differently (tests/conftest.py's XLA flags): 2 ulp;
    # neighbouring counts' rates differ by far more, so a wrong count still fails.
    expected = np.float32(rate(applied, jnp.float32(1.0)))
    assert abs(np.float32(train[s]["lr"]) - expected) <= 2 * np.spacing(expected), s
    applied += (s - 1) not in (3, 4)
