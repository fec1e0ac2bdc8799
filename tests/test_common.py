"""The helpers every transform shares: float32 norms, the finiteness check, saturating counters
and argument checks, through the public transforms and against hand-computed values."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import stablejax
from stablejax.transforms import _common
from stablejax.transforms.loss_scaling import all_finite


def test_float16_gradient_norm_is_computed_in_float32():
  # 300^2 = 90,000 overflows float16 (max 65,504); the norm sqrt(3) * 300 does not.
  grads = {"w": jnp.full(3, 300.0, jnp.float16)}
  tx = stablejax.zclip(max_grad_norm=None)
  updates, state = tx.update(grads, tx.init(grads))
  assert float(state.grad_norm) == pytest.approx(np.sqrt(3.0) * 300.0, rel=1e-6)
  assert updates["w"].dtype == jnp.float16 and updates["w"].tolist() == [300.0] * 3
  assert float(_common.global_norm_f32(grads)) == pytest.approx(np.sqrt(3.0) * 300.0, rel=1e-6)


@pytest.mark.parametrize("bad", [jnp.inf, -jnp.inf, jnp.nan])
def test_any_non_finite_entry_is_not_finite(bad):
  assert not bool(all_finite({"a": jnp.ones(2), "b": jnp.array([1.0, bad])}))
  assert bool(all_finite({"a": jnp.ones(2), "b": jnp.array([1.0, 2.0])}))


def test_an_empty_tree_is_finite():
  assert bool(all_finite({})) and bool(all_finite([]))
  tx = stablejax.skip_nonfinite(optax.sgd(0.1))
  _, state = tx.update({}, tx.init({}), {})
  assert not bool(state.skipped)


def test_counters_saturate_at_the_int32_maximum():
  top = np.iinfo(np.int32).max
  tx = stablejax.skip_nonfinite(optax.sgd(0.1))
  params = {"w": jnp.ones(2)}
  state = tx.init(params)._replace(total_skips=jnp.int32(top), consecutive_skips=jnp.int32(top))
  _, state = tx.update({"w": jnp.array([jnp.nan, 1.0])}, state, params)
  assert int(state.total_skips) == top and int(state.consecutive_skips) == top


def test_a_traced_hyperparameter_is_not_checked_and_a_concrete_one_is():
  with pytest.raises(ValueError, match="alpha=1.5 is invalid"):
    _common.check("alpha", 1.5, lambda v: 0 < v < 1, "use a factor in (0, 1)")
  _common.check("alpha", jnp.float32(1.5), lambda v: 0 < v < 1, "not checked: an array")
  _common.check("alpha", None, lambda v: 0 < v < 1, "not checked: None")


def test_leaf_norm_is_computed_in_float32_for_bf16():
  # 3000 entries of 1.01 in bfloat16 (1.0078125 each): the norm in float32 is sqrt(3000) x that;
  # squares summed in bfloat16 would round the sum to 8 bits of mantissa
  x = jnp.full((3000,), 1.01, jnp.bfloat16)
  norm = _common.leaf_norm_f32(x)
  assert norm.dtype == jnp.float32
  np.testing.assert_allclose(float(norm), np.sqrt(3000) * 1.0078125, rtol=1e-6)
