"""Which leaves are scan-stacked (transforms.stacked) and the per-layer gradient norms of the
monitor, against numpy norms per layer slice."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stablejax import per_layer_grad_norms
from stablejax.transforms.stacked import STACKED_NAMES, is_stacked, stacked_component


def test_default_stacked_names():
  assert set(STACKED_NAMES) == {"layers", "blocks", "scan", "h"}
  for name in ("layers", "blocks", "scan", "h"):
    assert stacked_component(["model", name, "attn", "kernel"]) == 1


@pytest.mark.parametrize("parts,index", [
    (["Blocks", "attn", "kernel"], 0),     # case-insensitive
    (["model", "LAYERS", "mlp"], 1),
    (["h", "0", "attn", "kernel"], None),  # an unrolled list: the next component is an index
    (["layers", "3", "mlp", "kernel"], None),
    (["blocks_0", "attn", "kernel"], None),  # exact component match only
    (["mlp", "kernel"], None),
])
def test_stacked_component(parts, index):
  assert stacked_component(parts) == index
  assert stacked_component(parts, ()) is None


def test_a_scalar_or_unnamed_leaf_is_not_stacked():
  path = (jax.tree_util.DictKey("blocks"), jax.tree_util.DictKey("gain"))
  assert not is_stacked(path, jnp.float32(1.0))
  assert is_stacked(path, jnp.ones((2, 3)))
  assert not is_stacked(path, jnp.ones((2, 3)), stacked_names=())


def test_per_layer_norms_of_a_stacked_leaf_are_numpy_norms_per_slice():
  rng = np.random.default_rng(0)
  kernel = rng.standard_normal((3, 4, 5)).astype(np.float32)
  head = rng.standard_normal((5, 2)).astype(np.float32)
  grads = {"model": {"layers": {"attn": {"kernel": jnp.asarray(kernel)}}},
           "lm_head": {"kernel": jnp.asarray(head)}, "step": jnp.int32(7)}
  norms = jax.jit(per_layer_grad_norms)(grads)
  want = {f"model/layers/{i}/attn/kernel": np.linalg.norm(kernel[i]) for i in range(3)}
  want["lm_head/kernel"] = np.linalg.norm(head)
  assert set(norms) == set(want)  # the integer leaf has no norm
  for key, value in want.items():
    assert float(norms[key]) == pytest.approx(float(value), rel=1e-5), key


def test_stacked_names_empty_gives_one_norm_per_leaf():
  kernel = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
  norms = per_layer_grad_norms({"blocks": {"mlp": jnp.asarray(kernel)}}, stacked_names=())
  assert list(norms) == ["blocks/mlp"]
  assert float(norms["blocks/mlp"]) == pytest.approx(float(np.linalg.norm(kernel)), rel=1e-6)


def test_bf16_norms_are_float32():
  norms = per_layer_grad_norms({"blocks": {"w": jnp.full((2, 400), 0.5, jnp.bfloat16)}})
  assert float(norms["blocks/0/w"]) == pytest.approx(10.0, rel=1e-6)  # sqrt(400 * 0.25)


def test_update_norm_per_layer_groups_stacked_slices_and_unrolled_layers():
  from stablejax.monitor.layers import global_and_layer_norms
  rng = np.random.default_rng(0)
  stacked = rng.standard_normal((2, 3, 4)).astype(np.float32)
  unrolled = {f"block_{i}": {"attn": rng.standard_normal((4, 4)).astype(np.float32),
                             "norm": rng.standard_normal(4).astype(np.float32)} for i in (2, 3)}
  listed = rng.standard_normal((5,)).astype(np.float32)
  head = rng.standard_normal((4, 6)).astype(np.float32)
  tree = {"blocks": {"mlp": jnp.asarray(stacked)}, **jax.tree.map(jnp.asarray, unrolled),
          "h": {"4": {"w": jnp.asarray(listed)}}, "lm_head": jnp.asarray(head),
          "count": jnp.int32(3)}
  total, layers = jax.jit(global_and_layer_norms)(tree)
  want = {0: np.linalg.norm(stacked[0]), 1: np.linalg.norm(stacked[1]),
          **{i: np.sqrt(sum(np.sum(x ** 2) for x in unrolled[f"block_{i}"].values()))
             for i in (2, 3)}, 4: np.linalg.norm(listed)}
  assert sorted(layers) == sorted(want)  # the head is in no layer, the integer leaf nowhere
  for i, value in want.items():
    assert float(layers[i]) == pytest.approx(float(value), rel=1e-5)
  everything = [stacked, *[x for d in unrolled.values() for x in d.values()], listed, head]
  assert float(total) == pytest.approx(np.sqrt(sum(np.sum(x ** 2) for x in everything)), rel=1e-5)
