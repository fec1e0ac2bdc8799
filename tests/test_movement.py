"""Parameter movement against hand-computed norms and the resolution of each dtype (bfloat16
eps 2^-7, float16 2^-10, float32 2^-23), and the "not moving" warning's wording of its cause."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stablejax import movement_record, movement_warnings, param_dtypes, param_movement
from stablejax.monitor.movement import default_group


def _move(old, new, labels=None):
  return jax.device_get(param_movement(old, new, labels))


def test_relative_change_is_against_the_previous_parameters():
  old = {"mlp": {"kernel": jnp.ones((4, 4))}}
  new = {"mlp": {"kernel": jnp.full((4, 4), 2.0)}}
  m = _move(old, new)["mlp"]
  assert float(m["rel_change"]) == pytest.approx(1.0)   # ||2 - 1|| / ||1||
  assert float(m["param_rms"]) == pytest.approx(2.0)
  assert float(m["frozen_fraction"]) == 0.0


def test_frozen_fraction_counts_the_entries_that_did_not_move():
  old = {"mlp": {"kernel": jnp.zeros(4)}}
  new = {"mlp": {"kernel": jnp.array([0.0, 1.0, 1.0, 1.0])}}
  assert float(_move(old, new)["mlp"]["frozen_fraction"]) == pytest.approx(0.25)


@pytest.mark.parametrize("dtype,eps", [(jnp.bfloat16, 2.0 ** -7), (jnp.float16, 2.0 ** -10),
                                       (jnp.float32, 2.0 ** -23)])
def test_resolution_ratio_is_in_units_of_the_groups_own_dtype(dtype, eps):
  # Every entry moves by one ulp of 1.0 in this dtype: rms(d) / (eps * rms(p)) = 1.
  old = {"mlp": {"kernel": jnp.ones((8,), dtype)}}
  new = {"mlp": {"kernel": jnp.full((8,), 1.0 + eps, dtype)}}
  m = _move(old, new)["mlp"]
  assert float(m["resolution_ratio"]) == pytest.approx(1.0, rel=1e-5)
  assert float(m["resolution_ratio_bf16"]) == pytest.approx(eps / 2.0 ** -7, rel=1e-5)


def test_a_mixed_group_uses_its_lowest_precision():
  old = {"mlp": {"a": jnp.ones(4, jnp.bfloat16), "b": jnp.ones(4, jnp.float32)}}
  assert param_dtypes(old) == {"mlp": "bfloat16"}
  new = {"mlp": {"a": jnp.full(4, 1.0 + 2.0 ** -7, jnp.bfloat16), "b": jnp.ones(4)}}
  # rms(d) = sqrt(4 * 2^-14 / 8) = 2^-7 / sqrt(2); against bf16's eps 2^-7 (rms(p) = 1).
  assert float(_move(old, new)["mlp"]["resolution_ratio"]) == pytest.approx(
      1 / math.sqrt(2), rel=1e-5)


def test_default_groups_in_the_documented_order():
  assert default_group("blocks/attn/q_proj/kernel") == "attention"
  assert default_group("blocks/ln_1/scale") == "norm"
  assert default_group("blocks/attn_norm/scale") == "norm"     # norm is checked before attention
  assert default_group("tok_embed/embedding") == "embedding"
  assert default_group("lm_head/kernel") == "head"
  assert default_group("blocks/mlp/fc1/kernel") == "mlp"
  assert default_group("blocks/router/kernel") == "other"


@pytest.mark.parametrize("dtype,cause", [
    ("bfloat16", "updates underflow the low-precision parameters"),
    ("float16", "updates underflow the low-precision parameters"),
    ("float32", "learning rate too low"),
])
def test_stuck_group_names_its_cause(dtype, cause):
  (line,) = movement_warnings({"mlp": {"rel_change": 0.01, "resolution_ratio": 0.5}},
                              dtypes={"mlp": dtype}, step=7)
  assert line.startswith("step 7: parameters are not moving: mlp (rel change 0.01, updates 0.5x")
  assert line.endswith(cause) or cause in line


def test_thresholds_of_the_warning():
  ok = {"mlp": {"rel_change": 2e-6, "resolution_ratio": 1.0}}
  assert movement_warnings(ok, dtypes={"mlp": "float32"}) == []
  assert len(movement_warnings({"mlp": {"rel_change": 5e-7, "resolution_ratio": 3.0}})) == 1
  assert len(movement_warnings({"mlp": {"rel_change": 1e-2, "resolution_ratio": 0.99}})) == 1


def test_norm_scales_at_one_are_called_out():
  (line,) = movement_warnings({"norm": {"rel_change": 0.0, "resolution_ratio": 0.0,
                                        "param_rms": 1.0}})
  assert "norm scales stuck at 1.000" in line
  (line,) = movement_warnings({"norm": {"rel_change": 0.0, "resolution_ratio": 0.0,
                                        "param_rms": 0.5}})
  assert "stuck at" not in line


def test_non_finite_movement_gets_its_own_line():
  for bad in ({"rel_change": math.inf, "resolution_ratio": 1.0},
              {"rel_change": math.nan, "resolution_ratio": 1.0},
              {"rel_change": 0.1, "resolution_ratio": math.nan}):
    assert movement_warnings({"mlp": bad}) == [
        "non-finite parameters or movement in groups: mlp"]


def test_movement_record_keys():
  record = movement_record({"mlp": {"rel_change": np.float32(0.5), "resolution_ratio": 80.0,
                                    "resolution_ratio_bf16": 0.25, "param_rms": 1.0}})
  assert record == {"param_move/mlp": 0.5, "param_move/mlp/resolution_ratio": 80.0,
                    "param_move/mlp/resolution_ratio_bf16": 0.25}
