"""Compensated low-precision updates against independent references: a numpy re-derivation of
Kahan summation in bfloat16 (ml_dtypes' round-to-nearest-even), the exact float64 sum, and
stochastic rounding's expectation and rounding probabilities."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import stablejax
from helpers import read_metrics, run_inprocess, slow, stopping_run, tiny_config, train_losses

BF16 = ml_dtypes.bfloat16


def _bf16(x):
  return np.asarray(x, np.float32).astype(BF16)


def reference_kahan(p0: np.ndarray, updates: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Kahan summation with a bfloat16 parameter and buffer, float32 arithmetic (numpy)."""
  p, c = _bf16(p0), _bf16(np.zeros_like(p0))
  for u in updates:
    y = np.float32(u) - c.astype(np.float32)
    t = _bf16(p.astype(np.float32) + y)
    c = _bf16((t.astype(np.float32) - p.astype(np.float32)) - y)
    p = t
  return p, c


def _run(tx, params, updates):
  """optax loop: tx.update then optax.apply_updates, over the leading axis of ``updates``."""
  state = tx.init(params)

  def body(carry, u):
    p, s = carry
    out, s = tx.update({"w": u}, s, p)
    return (optax.apply_updates(p, out), s), out["w"]

  (params, state), applied = jax.jit(lambda c, u: jax.lax.scan(body, c, u))((params, state),
                                                                            updates)
  return params, state, applied


def test_kahan_matches_numpy_and_apply_updates_lands_on_it_exactly():
  rng = np.random.default_rng(0)
  p0 = rng.uniform(-2, 2, 64).astype(np.float32)
  updates = (rng.standard_normal((300, 64)) * 1e-3).astype(np.float32)  # mostly below p's spacing
  params, state, applied = _run(stablejax.compensated_updates(), {"w": jnp.asarray(_bf16(p0))},
                                jnp.asarray(updates))
  ref_p, ref_c = reference_kahan(p0, updates)
  np.testing.assert_array_equal(np.asarray(params["w"]).view(np.uint16), ref_p.view(np.uint16))
  np.testing.assert_array_equal(np.asarray(state.compensation["w"]).view(np.uint16),
                                ref_c.view(np.uint16))
  assert applied.dtype == jnp.float32 and params["w"].dtype == jnp.bfloat16
  # Nothing is lost: parameter minus buffer is the exact sum to within the buffer's own rounding
  # (8 bits of numbers below the parameter's last bit, 300 times), where plain bfloat16
  # addition lost most of it.
  exact = _bf16(p0).astype(np.float64) + updates.astype(np.float64).sum(0)
  kahan_err = np.abs(ref_p.astype(np.float64) - ref_c.astype(np.float64) - exact)
  plain = _bf16(p0)
  for u in updates:
    plain = _bf16(plain.astype(np.float32) + u)
  plain_err = np.abs(plain.astype(np.float64) - exact)
  assert kahan_err.max() < 2e-4 and np.median(plain_err) > 20 * kahan_err.max()


def test_stochastic_rounding_is_exact_in_expectation():
  x = np.float32(1.0) + np.float32(2.0 ** -7) * np.float32([0.1, 0.25, 0.5, 0.9])  # bf16 grid 2**-7
  keys = jax.random.split(jax.random.PRNGKey(1), 4000)
  draws = jax.vmap(lambda k: stablejax.transforms.compensated.stochastic_round_bf16(
      jnp.asarray(x), k))(keys).astype(jnp.float32)
  lo, hi = np.float32(1.0), np.float32(1.0 + 2.0 ** -7)
  assert set(np.unique(np.asarray(draws))) <= {lo, hi}
  up = np.mean(np.asarray(draws) == hi, axis=0)
  np.testing.assert_allclose(up, [0.1, 0.25, 0.5, 0.9], atol=0.03)  # P(up) = the fraction
  np.testing.assert_allclose(np.mean(np.asarray(draws), axis=0), x, atol=3e-4)
  # Negative numbers round in magnitude the same way; non-finite values pass through.
  neg = stablejax.transforms.compensated.stochastic_round_bf16(
      jnp.asarray(-x), jax.random.PRNGKey(2)).astype(jnp.float32)
  assert set(np.unique(np.asarray(neg))) <= {-lo, -hi}
  special = stablejax.transforms.compensated.stochastic_round_bf16(
      jnp.asarray([np.inf, -np.inf, np.nan], jnp.float32), jax.random.PRNGKey(3))
  assert np.isposinf(special[0]) and np.isneginf(special[1]) and np.isnan(special[2])


def test_stochastic_rounding_moves_parameters_by_small_updates_on_average():
  p0 = np.ones(2000, np.float32)
  updates = np.full((200, 2000), 1e-4, np.float32)  # each alone far below half of 2**-7
  params, state, _ = _run(stablejax.compensated_updates("stochastic_rounding", seed=3),
                          {"w": jnp.asarray(_bf16(p0))}, jnp.asarray(updates))
  mean = float(jnp.mean(params["w"].astype(jnp.float32)))
  assert abs(mean - 1.02) < 2e-3  # the exact sum; plain bfloat16 stays at 1.0
  assert float(state.lost_fraction) == 1.0  # every plain update would have rounded away


def test_float32_leaves_pass_through_and_float16_needs_kahan():
  params = {"w": jnp.ones(3, jnp.float32), "b": jnp.ones(2, jnp.bfloat16)}
  tx = stablejax.compensated_updates()
  updates = {"w": jnp.full(3, 1e-9), "b": jnp.full(2, 1e-3)}
  out, state = tx.update(updates, tx.init(params), params)
  assert out["w"] is updates["w"] and state.compensation["w"].shape == ()
  assert state.compensation["b"].dtype == jnp.bfloat16 and state.compensation["b"].shape == (2,)
  with pytest.raises(ValueError, match="kahan"):
    stablejax.compensated_updates("stochastic_rounding").init({"w": jnp.ones(2, jnp.float16)})
  with pytest.raises(ValueError, match="params"):
    tx.update(updates, tx.init(params))


def test_a_skipped_step_keeps_the_buffer():
  params = {"w": jnp.ones(4, jnp.bfloat16)}
  tx = stablejax.skip_nonfinite(optax.chain(optax.sgd(1.0), stablejax.compensated_updates()))
  state = tx.init(params)
  _, state = tx.update({"w": jnp.full(4, -1e-3)}, state, params)
  buffer = state.inner_state[1].compensation["w"]
  assert float(jnp.abs(buffer.astype(jnp.float32)).max()) > 0
  updates, after = tx.update({"w": jnp.array([jnp.nan, 1.0, 1.0, 1.0])}, state, params)
  assert bool(after.skipped) and float(jnp.abs(updates["w"]).max()) == 0.0
  np.testing.assert_array_equal(after.inner_state[1].compensation["w"], buffer)


def test_the_trainer_compensates_bf16_parameters_only():
  from stablejax.training.config import load_config
  from stablejax.training.optim import build_optimizer
  base = ["optimizer.name=adamw", "train.steps=10", "train.warmup_steps=1"]
  fp32 = build_optimizer(load_config(None, base)).init({"w": jnp.ones(4)})
  bf16_cfg = load_config(None, base + ["model.param_dtype=\"bfloat16\""])
  bf16 = build_optimizer(bf16_cfg).init({"w": jnp.ones(4, jnp.bfloat16)})
  def found(state):
    kind = stablejax.CompensatedUpdatesState
    return [x for x in jax.tree.leaves(state, is_leaf=lambda n: isinstance(n, kind))
            if isinstance(x, kind)]
  assert not found(fp32)  # float32 parameters: left out of the chain (the state is unchanged)
  assert len(found(bf16)) == 1
  assert "compensated/lost_fraction" in stablejax.stability_metrics(bf16)


@slow
def test_a_bf16_run_resumed_from_its_checkpoint_equals_the_uninterrupted_run(tmp_path, capsys):
  # The Kahan buffer is optimizer state: saved with the checkpoint and restored with it, so the
  # resumed run continues bit for bit (without it, the buffer would restart at 0).
  bf16 = ("model.param_dtype=\"bfloat16\"", "optimizer.learning_rate=0.001",
          "optimizer.adam_learning_rate=0.001", "optimizer.embedding_learning_rate=0.001",
          "optimizer.head_learning_rate=0.001", "train.steps=30")
  # The interrupted run stops as a SIGTERM stops it (a checkpoint at step 25, exit 130), in this
  # process: it reuses the uninterrupted run's programs instead of compiling them in a process of
  # its own.
  whole, resumed = tmp_path / "whole", tmp_path / "resumed"
  assert run_inprocess(whole, *bf16) == 0
  first = stopping_run(tiny_config(*bf16), resumed, fresh=True, stop_at=25)
  assert first.train() == 130
  capsys.readouterr()
  assert run_inprocess(resumed, *bf16, fresh=False) == 0
  assert "resuming at step 25" in capsys.readouterr().out
  records = [r for r in read_metrics(whole) if "compensated/lost_fraction" in r]
  assert records and max(r["compensated/lost_fraction"] for r in records) > 0.1
  assert train_losses(resumed) == train_losses(whole)
