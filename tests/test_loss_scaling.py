"""DynamicLossScale: growth / backoff / floor against a hand-computed sequence."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stablejax
from stablejax.transforms.loss_scaling import all_finite


def test_conservative_defaults():
  ls = stablejax.DynamicLossScale()
  assert float(ls.loss_scale) == 1024.0 and int(ls.counter) == 0
  assert ls.growth_interval == 200 and ls.growth_factor == 1.5
  assert ls.backoff_factor == 0.5 and ls.min_scale == 1.0
  assert ls.loss_scale.dtype == jnp.float32 and ls.counter.dtype == jnp.int32


def test_create_matches_constructor():
  a = stablejax.DynamicLossScale.create(initial_scale=64.0, growth_interval=7,
                                        growth_factor=2.0)
  b = stablejax.DynamicLossScale(loss_scale=64.0, growth_interval=7,
                                 growth_factor=2.0)
  assert jax.tree.structure(a) == jax.tree.structure(b)
  assert float(a.loss_scale) == 64.0 and int(a.counter) == 0


def test_growth_backoff_floor_sequence_under_jit():
  ls = stablejax.DynamicLossScale(loss_scale=8.0, growth_interval=3)
  adjust = jax.jit(lambda ls, ok: ls.adjust(ok))
  # (finite?, expected scale after, expected counter after), by hand:
  # 3 finite steps grow 8 -> 12; 2 more finite then an overflow: 12 -> 6;
  # overflows 6 -> 3 -> 1.5 -> 1 (floor) -> 1; 3 finite steps grow 1 -> 1.5.
  sequence = [
      (True, 8.0, 1), (True, 8.0, 2), (True, 12.0, 0),
      (True, 12.0, 1), (True, 12.0, 2), (False, 6.0, 0),
      (False, 3.0, 0), (False, 1.5, 0), (False, 1.0, 0), (False, 1.0, 0),
      (True, 1.0, 1), (True, 1.0, 2), (True, 1.5, 0), (True, 1.5, 1),
  ]
  for ok, scale, counter in sequence:
    ls = adjust(ls, jnp.array(ok))
    assert float(ls.loss_scale) == scale and int(ls.counter) == counter
  assert ls.growth_interval == 3  # static policy survives jit


def test_default_policy_grows_after_200_finite_steps():
  ls = stablejax.DynamicLossScale()

  def body(ls, _):
    return ls.adjust(jnp.array(True)), ls.loss_scale

  # scales[t] is the scale used at step t (before its adjust).
  ls, scales = jax.lax.scan(body, ls, None, length=401)
  scales = np.asarray(scales)
  assert (scales[:200] == 1024.0).all() and (scales[200:400] == 1536.0).all()
  assert scales[400] == 2304.0 and float(ls.loss_scale) == 2304.0


def test_scale_unscale_roundtrip_keeps_dtypes_fp16():
  ls = stablejax.DynamicLossScale(loss_scale=1536.0)
  params = {"w": jnp.array([1e-3, -2e-3, 5e-4], jnp.float16),
            "b": jnp.array([0.25], jnp.float32)}

  def loss_fn(p):
    return (jnp.sum(p["w"].astype(jnp.float32)**2) + jnp.sum(p["b"])).astype(
        jnp.float16)

  @jax.jit
  def grads_of(p, ls):
    return ls.unscale(jax.grad(lambda q: ls.scale(loss_fn(q)))(p))

  grads = grads_of(params, ls)
  assert grads["w"].dtype == jnp.float16 and grads["b"].dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(grads["w"], np.float32),
                             2 * np.asarray(params["w"], np.float32), rtol=2e-3)
  np.testing.assert_allclose(grads["b"], [1.0], rtol=1e-3)
  assert ls.scale(jnp.float16(2.0)).dtype == jnp.float16


def test_overflow_is_detected_and_backs_off():
  ls = stablejax.DynamicLossScale(loss_scale=2.0**15)
  x = jnp.array([4.0], jnp.float16)
  grads = jax.grad(lambda v: ls.scale(jnp.sum(v * v)))(x)  # 2**18 > fp16 max
  finite = all_finite(ls.unscale(grads))
  assert not bool(finite)
  ls = ls.adjust(finite)
  assert float(ls.loss_scale) == 2.0**14


def test_is_a_pytree_of_two_arrays():
  ls = stablejax.DynamicLossScale()
  leaves = jax.tree.leaves(ls)
  assert len(leaves) == 2
  mapped = jax.tree.map(lambda x: x + 1, ls)
  assert float(mapped.loss_scale) == 1025.0 and mapped.growth_factor == 1.5


@pytest.mark.parametrize("kwargs,match", [
    (dict(growth_interval=0), "growth_interval"),
    (dict(growth_factor=1.0), "growth_factor"),
    (dict(backoff_factor=1.0), "backoff_factor"),
    (dict(min_scale=0.0), "min_scale"),
    (dict(loss_scale=0.5), "loss_scale"),
])
def test_bad_arguments_raise(kwargs, match):
  with pytest.raises(ValueError, match=match):
    stablejax.DynamicLossScale(**kwargs)


def test_create_defaults_are_the_documented_policy():
  # 2**10 initial, x1.5 after 200 finite steps in a row, x0.5 on overflow, floor 1.
  ls = stablejax.DynamicLossScale.create()
  assert float(ls.loss_scale) == 1024.0 and ls.growth_interval == 200
  assert ls.growth_factor == 1.5 and ls.backoff_factor == 0.5 and ls.min_scale == 1.0


def test_unscale_divides_by_the_current_scale():
  ls = stablejax.DynamicLossScale(loss_scale=4096.0)
  assert ls.unscale(jnp.full(2, 8192.0, jnp.float16)).tolist() == [2.0, 2.0]
  backed_off = ls
  for _ in range(5):  # 4096 -> 2048 -> 1024 -> 512 -> 256 -> 128
    backed_off = backed_off.adjust(jnp.array(False))
  assert float(backed_off.loss_scale) == 128.0
  assert backed_off.unscale(jnp.full(2, 384.0, jnp.float16)).tolist() == [3.0, 3.0]


def test_a_custom_policy_is_kept_by_every_adjust_and_through_jit():
  ls = stablejax.DynamicLossScale(loss_scale=1024.0, growth_interval=2, growth_factor=4.0,
                                  backoff_factor=0.25, min_scale=2.0)
  adjust = jax.jit(lambda ls, ok: ls.adjust(ok))
  # By hand: 1024 x 0.25 = 256, x 0.25 = 64; two finite steps grow x4 = 256; then 64, 16, 4,
  # and the floor 2.
  expected = [(False, 256.0), (False, 64.0), (True, 64.0), (True, 256.0), (False, 64.0),
              (False, 16.0), (False, 4.0), (False, 2.0), (False, 2.0)]
  for ok, scale in expected:
    ls = adjust(ls, jnp.array(ok))
    assert float(ls.loss_scale) == scale
  assert (ls.growth_interval, ls.growth_factor, ls.backoff_factor, ls.min_scale) == (
      2, 4.0, 0.25, 2.0)
