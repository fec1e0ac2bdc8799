"""The trainer's step as the loop calls it (the Trainer's jitted step, batch layout, checkpoints),
without the loop: gradient accumulation and the fp16 loss-scaling path."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import stablejax

from helpers import tiny_config

SMALL = ("train.batch_size=8", "train.steps=12", "checkpoint.async_save=false",
         "logging.tensorboard=false")


def make_run(tmp_path, name, *overrides):
  from stablejax.training.loop.trainer import Trainer
  return Trainer(tiny_config(*SMALL, *overrides), tmp_path / name, fresh=True)


def stream(run, n):
  it = run.components.data.train_iter()
  return [np.asarray(next(it)["tokens"], np.int32) for _ in range(n)]


def steps(run, batches, grad_scales=None, moves=None):
  """Runs the Trainer's jitted train step over host batches; returns the final state and metrics
  (and appends each step's parameter change to ``moves``)."""
  state = run.components.init_state(jax.random.PRNGKey(run.cfg.train.seed))
  history = []
  for i, tokens in enumerate(batches):
    scale = 1.0 if grad_scales is None else grad_scales[i]
    before = jax.device_get(state.params) if moves is not None else None  # the step donates it
    batch = run.components.step_batch(tokens, scale, step=i)
    state, metrics = run.components.train_step(state, batch)
    history.append(jax.device_get(metrics))
    if moves is not None:
      moves.append(jax.tree.map(lambda a, b: np.asarray(a, np.float64) - b,
                                jax.device_get(state.params), before))
  return state, history


def test_four_micro_batches_equal_one_batch_of_four_times_the_size(tmp_path):
  # train.grad_accum=4 splits each batch of 8 rows into 4 micro-batches of 2 inside the step;
  # the mean of their mean losses and gradients is the full batch's (equal sizes), so the runs
  # agree up to float32 summation order: losses to 1e-5 relative, parameters to 1e-5 absolute.
  one = make_run(tmp_path, "accum1")
  four = make_run(tmp_path, "accum4", "train.grad_accum=4")
  batches = stream(one, 4)
  # [accum, micro-batch, T + 1]
  assert four.components.device_tokens(batches[0]).shape == (4, 2, 33)
  moves = []
  state1, hist1 = steps(one, batches, moves=moves)
  state4, hist4 = steps(four, batches)
  for a, b in zip(hist1, hist4):
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
  assert hist1[-1]["loss"] < hist1[0]["loss"]  # it trained
  moved = jax.tree.map(lambda a, b: np.abs(np.asarray(a) - np.asarray(b)).max(),
                       state4.params, one.components.init_state(jax.random.PRNGKey(0)).params)
  assert max(jax.tree.leaves(moved)) > 1e-3  # parameters moved far more than the tolerance
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-5),
               state4.params, state1.params)
  # The update norm is computed on the steps the loop reads (1, 2, 4 with train.log_every=2) and
  # is the norm of the parameters' change there; step 3's is not computed (NaN).
  for step, (record, move) in enumerate(zip(hist1, moves), start=1):
    if step == 3:
      assert np.isnan(record["update_norm"]) and np.isnan(record["update_norm/layer_0"])
    else:
      applied = np.sqrt(sum(np.sum(np.square(m)) for m in jax.tree.leaves(move)))
      assert record["update_norm"] == pytest.approx(applied, rel=1e-4)


def test_the_step_computes_the_update_norms_on_every_step_the_loop_reads():
  # train.step.metrics_read against the loop's own rules (actions.Logging.due and
  # actions.Checkpointing.due, a deferred save included): every step the loop reads is covered.
  from types import SimpleNamespace

  from stablejax.training.loop import actions
  from stablejax.training.loop.step import metrics_read
  cfg = tiny_config("train.log_every=3", "checkpoint.every=7", "train.steps=40")
  components = SimpleNamespace(cfg=cfg, total_steps=40)
  read = [metrics_read(cfg, s) for s in range(1, 41)]
  for deferred in (False, True):
    logging = SimpleNamespace(components=components)
    checkpointing = SimpleNamespace(components=components, deferred=deferred)
    loop = [actions.Logging.due(logging, s) or actions.Checkpointing.due(checkpointing, s)
            for s in range(1, 41)]
    assert not any(want and not got for want, got in zip(loop, read))
  assert not read[1] and read[2] and read[6] and read[39]  # 2 none; 3 a log; 7 a save; 40 last


FP16 = ("model.compute_dtype=\"float16\"", "stability.loss_scale.init=1048576",
        "stability.loss_scale.growth_interval=3", "stability.loss_scale.growth_factor=2.0")


def test_fp16_loss_scale_backs_off_on_overflow_grows_and_is_checkpointed(tmp_path):
  # A loss scale of 2^20 overflows fp16 gradients: the scale halves on each overflow (the step
  # skipped: parameters unchanged) until the gradients are finite, then doubles after every 3
  # finite steps. An injected NaN gradient (step 9) is an overflow like any other.
  run = make_run(tmp_path, "fp16", *FP16)
  batches = stream(run, 12)
  grad_scales = [1.0] * 9 + [float("nan")] + [1.0] * 2
  state = run.components.init_state(jax.random.PRNGKey(run.cfg.train.seed))
  scale, counter, scales, overflowed = 2.0**20, 0, [], []
  for i, (tokens, g) in enumerate(zip(batches, grad_scales)):
    before = jax.device_get(state.params)
    batch = run.components.step_batch(tokens, g, step=i)
    state, metrics = run.components.train_step(state, batch)
    m = jax.device_get(metrics)
    overflow = bool(m["skip_nonfinite/skipped"])
    overflowed.append(overflow)
    if overflow:  # nothing was applied
      jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.params), before)
    # the documented rule, by hand
    if overflow:
      scale, counter = max(scale * 0.5, 1.0), 0
    else:
      counter += 1
      if counter == 3:
        scale, counter = scale * 2.0, 0
    scales.append(float(m["loss_scale"]))
    assert float(m["loss_scale"]) == scale and int(state.loss_scale.counter) == counter
  assert overflowed[0] and overflowed[9] and not all(overflowed)
  assert any(b > a for a, b in zip(scales, scales[1:])), scales  # it grew at least once
  assert np.all(np.isfinite(jax.tree.leaves(jax.device_get(state.params))[0]))

  # In the checkpoint, and restored with the rest of the state.
  run.checkpoints.save(12, state, run.components.data.train_iter(), {"batches_consumed": 12})
  run.checkpoints.wait()
  restored, meta = run.checkpoints.restore(run.components.abstract_state,
                                           run.components.data.train_iter())
  assert meta["step"] == 12
  assert float(restored.loss_scale.loss_scale) == scale
  assert int(restored.loss_scale.counter) == counter
  run.close()


def test_qk_clip_in_the_train_step_rescales_exactly_the_heads_over_tau(tmp_path):
  # Two runs from the same initial parameters on the same batch, without and with QK-clip: the
  # clip is the chain's last link, so the second run's parameters are the first's with every
  # head whose max logit (re-derived here from the initial parameters) exceeded tau scaled by
  # sqrt(tau / max) in its q_proj and k_proj columns, and nothing else changed.
  from stablejax.modeling.gpt import layer_max_logits
  plain = make_run(tmp_path, "plain", "model.qk_norm=false")  # QK-clip needs a model without it
  batch = stream(plain, 1)[0]
  params0 = plain.components.init_state(jax.random.PRNGKey(plain.cfg.train.seed)).params
  # Jitted: eagerly, each of the model's operations compiles on its own.
  _, sown = jax.jit(lambda p, x: plain.components.model.module.apply(
      {"params": p}, x, attention_logits=True, mutable=["intermediates"]))(params0, batch[:, :-1])
  s = np.asarray(layer_max_logits(plain.cfg.model, stablejax.collect_attention_logits(sown)),
                 np.float64)                                            # [L, H]
  tau = float(np.median(s))
  assert (s > tau).any() and (s < tau).any()
  clipped = make_run(tmp_path, "clip", "model.qk_norm=false", "stability.qk_clip.enabled=true",
                     f"stability.qk_clip.tau={tau!r}")
  state_a, hist_a = steps(plain, [batch])
  state_b, hist_b = steps(clipped, [batch])
  assert hist_b[0]["qk_clip/heads_clipped"] == int((s > tau).sum())
  assert hist_b[0]["qk_clip/max_logit"] == pytest.approx(s.max(), rel=1e-5)
  assert hist_b[0]["loss"] == pytest.approx(hist_a[0]["loss"], rel=1e-6)
  hd = plain.cfg.model.head_dim
  factor = np.repeat(np.sqrt(np.where(s > tau, tau / s, 1.0)), hd, axis=-1)   # [L, H * hd]
  a, b = state_a.params, state_b.params
  for proj in ("q_proj", "k_proj"):
    want = np.asarray(a["blocks"]["attn"][proj]["kernel"]) * factor[:, None, :]
    np.testing.assert_allclose(np.asarray(b["blocks"]["attn"][proj]["kernel"]), want,
                               rtol=1e-5, atol=1e-7)
  rest = lambda p: {k: v for k, v in p.items() if k != "blocks"}  # noqa: E731
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7),
               rest(a), rest(b))
  np.testing.assert_allclose(b["blocks"]["attn"]["v_proj"]["kernel"],
                             a["blocks"]["attn"]["v_proj"]["kernel"], rtol=1e-6, atol=1e-7)


def test_qk_clip_config_errors():
  from stablejax.training.config import ConfigError
  with pytest.raises(ConfigError, match="qk_norm"):
    tiny_config("stability.qk_clip.enabled=true", "model.qk_norm=true")
  with pytest.raises(ConfigError, match="stability.qk_clip.tau"):
    tiny_config("stability.qk_clip.enabled=true", "stability.qk_clip.tau=0",
                "model.qk_norm=false")
