"""find_attention_layers: where each attention layer's query and key heads lie, in every layout.

Each layout is checked two ways: against the expected layer (written here from what each Flax
module is), and by what the heads mean: multiplying query head h by s and the key head it attends
with by 1/s leaves every attention logit, so the model's output, unchanged, while scaling the
query alone changes it. A wrong axis, a wrong fused slice or a wrong query-to-key-head map breaks
the first; a slice that is not the query breaks the second.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flax_models import (DenseGeneralLM, EinsumLM, LayerAxisLM, LinenLM, LogicalLM, NNXLM,
                         linen_params)
from stablejax.layout.heads import AttentionLayer, HeadParam, find_attention_layers
from stablejax.modeling.gpt import GPT, ModelConfig

TOKENS = jax.random.randint(jax.random.key(3), (2, 8), 0, 64)


def _path(p) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in p)


def _scale_head(tree, params: tuple[HeadParam, ...], head: int, heads: int, head_dim: int,
                factor: float):
  """Multiplies head ``head`` of ``heads`` of each parameter (its own axis, or a split one)."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
  out = {_path(p): np.array(x) for p, x in flat}  # copies, edited in numpy
  for hp in params:
    x = out[hp.path]
    index = [slice(None)] * x.ndim
    if hp.select is not None:
      index[hp.select[0]] = hp.select[1]
    axis = hp.head_axis % x.ndim
    view = x[tuple(index)]  # a view: writing to it writes to x
    if hp.select is not None and hp.select[0] < axis:
      axis -= 1  # the selected axis is gone from the view
    sub_index = [slice(None)] * view.ndim
    if view.shape[axis] == heads:
      sub_index[axis] = head
    else:
      assert view.shape[axis] == heads * head_dim, (hp, view.shape)
      sub_index[axis] = slice(head * head_dim, (head + 1) * head_dim)
    view[tuple(sub_index)] *= factor
  return jax.tree.unflatten(treedef, [out[_path(p)] for p, _ in flat])


def _check_heads_mean_heads(apply, tree, layers: list[AttentionLayer], head_dim: int):
  apply = jax.jit(apply)
  base = apply(tree)
  for layer in layers:
    group = layer.num_heads // layer.num_kv_heads
    for h in (0, layer.num_heads - 1):
      both = tree
      for hq in range(layer.num_heads):  # every query head of h's key head, by 2
        if hq // group == h // group:
          both = _scale_head(both, layer.query, hq, layer.num_heads, head_dim, 2.0)
      both = _scale_head(both, layer.key, h // group, layer.num_kv_heads, head_dim, 0.5)
      np.testing.assert_allclose(apply(both), base, rtol=1e-4, atol=1e-4,
                                 err_msg=f"{layer.name} head {h}")
      query_only = _scale_head(tree, layer.query, h, layer.num_heads, head_dim, 2.0)
      assert np.max(np.abs(apply(query_only) - base)) > 1e-3, (layer.name, h)


@pytest.mark.parametrize("scan", [True, False])
def test_trainer_gpt_heads_from_num_heads_or_qk_norm(scan):
  cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, compute_dtype="float32",
                    init_std=0.3, qk_norm=False, scan_layers=scan)
  model = GPT(cfg)
  params = jax.jit(model.init)(jax.random.key(0), TOKENS)["params"]
  with pytest.raises(ValueError, match="pass num_heads"):
    find_attention_layers(params)
  layers = find_attention_layers(params, num_heads=4)
  prefix = ["blocks/attn"] if scan else ["block_0/attn", "block_1/attn"]
  assert [lay.name for lay in layers] == prefix
  for layer, name in zip(layers, prefix):
    assert layer == AttentionLayer(name, 4, 4, (HeadParam(f"{name}/q_proj/kernel", -1),),
                                   (HeadParam(f"{name}/k_proj/kernel", -1),), int(scan))
  _check_heads_mean_heads(lambda p: model.apply({"params": p}, TOKENS), params, layers, 8)
  with pytest.raises(ValueError, match="num_heads=3 does not divide"):
    find_attention_layers(params, num_heads=3)
  # With qk_norm the head size comes from q_norm/scale [L, hd].
  normed = GPT(ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, qk_norm=True,
                           scan_layers=scan))
  p = jax.eval_shape(lambda: normed.init(jax.random.key(0), TOKENS))["params"]
  heads = [(lay.num_heads, lay.num_kv_heads) for lay in find_attention_layers(p)]
  assert heads == [(2, 2)] * len(prefix)
  with pytest.raises(ValueError, match="disagrees"):
    find_attention_layers(p, num_heads=4)


@pytest.mark.parametrize("scan", [False, True])
def test_flax_multi_head_attention_linen_and_nnx(scan):
  model = LinenLM(scan=scan)
  params = linen_params(model)
  layers = find_attention_layers(params)
  name = ("ScanLinenBlock_0" if scan else "LinenBlock_0") + "/MultiHeadDotProductAttention_0"
  assert layers[0] == AttentionLayer(
      name, 4, 4, (HeadParam(f"{name}/query/kernel", -2), HeadParam(f"{name}/query/bias", -2)),
      (HeadParam(f"{name}/key/kernel", -2), HeadParam(f"{name}/key/bias", -2)), int(scan))
  assert len(layers) == (1 if scan else 2)
  _check_heads_mean_heads(lambda p: model.apply({"params": p}, TOKENS), params, layers, 8)

  nnx_model = NNXLM(scan=scan, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(nnx_model)
  variables = nnx.state(nnx_model, nnx.Param)
  layers = find_attention_layers(variables)  # Variables, as nnx.Optimizer passes them
  assert layers == find_attention_layers(nnx.as_pure(variables))
  names = ["blocks/attn"] if scan else ["blocks/0/attn", "blocks/1/attn"]
  assert [lay.name for lay in layers] == names
  assert layers[0].query[1] == HeadParam(f"{layers[0].name}/query/bias", -2)

  pure = nnx.as_pure(state)

  def apply(s):
    return nnx.merge(graphdef, s)(TOKENS)
  _check_heads_mean_heads(apply, pure, layers, 8)


@pytest.mark.parametrize("partition", [False, True])
def test_dense_general_attention_under_any_module_name(partition):
  model = DenseGeneralLM(partition=partition)
  variables = jax.jit(model.init)(jax.random.key(0), TOKENS)
  layers = find_attention_layers(variables)
  name = "params/blocks_0/DenseGeneralAttention_0"
  assert layers[0] == AttentionLayer(name, 4, 4, (HeadParam(f"{name}/query/kernel", -2),),
                                     (HeadParam(f"{name}/key/kernel", -2),))
  assert len(layers) == 2
  plain = nn.unbox(variables)
  _check_heads_mean_heads(lambda v: model.apply(v, TOKENS), plain, layers, 8)


def test_logically_partitioned_boxes_as_lm1b_writes_them():
  model = LogicalLM()
  boxed = jax.jit(model.init)(jax.random.key(0), TOKENS)
  assert isinstance(boxed["params"]["decoder"]["logitdense"]["kernel"], nn.LogicallyPartitioned)
  layers = find_attention_layers(boxed)
  assert layers == find_attention_layers(nn.unbox(boxed))
  assert [lay.name for lay in layers] == [
      f"params/decoder/encoderdecoderblock_{i}/SelfAttention_0" for i in range(2)]
  _check_heads_mean_heads(lambda v: model.apply(v, TOKENS), nn.unbox(boxed), layers, 8)


@pytest.mark.parametrize("boxed", [True, False])
def test_layers_stacked_on_a_later_axis_are_refused_not_misread(boxed):
  # nn.scan(..., variable_axes={'params': 1}) (MaxText's param_scan_axis=1): q kernels are
  # [D, L, H, hd]. An AttentionLayer describes leading stacked axes only, so reading axis 0 as
  # the layer axis would give QK-clip the wrong heads: a clear error instead.
  params = jax.jit(LayerAxisLM().init)(jax.random.key(0), TOKENS)
  with pytest.raises(ValueError, match="not the leading one"):
    find_attention_layers(params if boxed else nn.unbox(params))


@pytest.mark.parametrize("kv_heads,head_dim", [(4, 8), (2, 8), (1, 8), (2, 16)])
def test_gemma_einsum_fused_and_grouped_query(kv_heads, head_dim):
  model = EinsumLM(kv_heads=kv_heads, head_dim=head_dim, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  layers = find_attention_layers(nnx.state(model, nnx.Param))
  assert [lay.name for lay in layers] == ["layers/0/attn", "layers/1/attn"]
  if kv_heads == 4:
    w = "layers/0/attn/qkv_einsum/w"
    assert layers[0] == AttentionLayer("layers/0/attn", 4, 4, (HeadParam(w, -3, (0, 0)),),
                                       (HeadParam(w, -3, (0, 1)),))
  else:
    assert layers[0] == AttentionLayer(
        "layers/0/attn", 4, kv_heads, (HeadParam("layers/0/attn/q_einsum/w", -3),),
        (HeadParam("layers/0/attn/kv_einsum/w", -3, (0, 0)),))

  def apply(s):
    return nnx.merge(graphdef, s)(TOKENS)
  _check_heads_mean_heads(apply, nnx.as_pure(state), layers, head_dim)


def test_einsum_query_beside_a_fused_key_value_is_the_query_whatever_its_name():
  # Gemma's grouped-query einsum kernels under names that say nothing: the one [H, D, hd] kernel
  # beside a fused [2, K, D, hd] key/value kernel is the query.
  d, h, kv, hd = 16, 4, 2, 8
  params = {"embed": jnp.zeros((40, d)),
            "attn": {"a": {"w": jnp.zeros((h, d, hd))}, "b": {"w": jnp.zeros((2, kv, d, hd))},
                     "c": {"w": jnp.zeros((h, hd, d))}}}
  assert find_attention_layers(params) == [AttentionLayer(
      "attn", h, kv, (HeadParam("attn/a/w", -3),), (HeadParam("attn/b/w", -3, (0, 0)),))]


def test_grouped_query_the_unnamed_projection_with_every_head_is_the_query():
  d, h, kv, hd = 16, 4, 2, 8
  params = {"embed": jnp.zeros((40, d)),
            "attn": {"x": {"kernel": jnp.zeros((d, h, hd))},
                     "k": {"kernel": jnp.zeros((d, kv, hd))},
                     "v": {"kernel": jnp.zeros((d, kv, hd))},
                     "o": {"kernel": jnp.zeros((h, hd, d))}}}
  assert find_attention_layers(params) == [AttentionLayer(
      "attn", h, kv, (HeadParam("attn/x/kernel", -2),), (HeadParam("attn/k/kernel", -2),))]


def test_kernels_stored_out_in_have_their_heads_on_the_output_axis():
  # Every 2-D kernel [out, in], as Hugging Face's Conv1D and Equinox store them: the query's
  # heads lie along axis -2, its fan-in (the model width) along -1.
  d, h, kv, hd = 16, 4, 2, 8
  shapes = {"q_proj": (h * hd, d), "k_proj": (kv * hd, d), "v_proj": (kv * hd, d),
            "o_proj": (d, h * hd)}
  params = {"embed": jnp.zeros((40, d)),
            "attn": {name: {"kernel": jnp.zeros(shape)} for name, shape in shapes.items()}}
  assert find_attention_layers(params, num_heads=h) == [AttentionLayer(
      "attn", h, kv, (HeadParam("attn/q_proj/kernel", -2),),
      (HeadParam("attn/k_proj/kernel", -2),))]


def test_overrides_name_the_query_and_key_and_warn_when_unmatched():
  d, h, hd = 16, 2, 8
  proj = {n: {"kernel": jnp.zeros((d, h, hd))} for n in ("a", "b", "c")}
  params = {"embed": jnp.zeros((40, d)),
            "attn": {**proj, "o": {"kernel": jnp.zeros((h, hd, d))}}}
  with pytest.raises(LookupError, match="overrides="):
    find_attention_layers(params)
  roles = {"attn/a": "query", "attn/b": "key", "attn/c": "value"}
  layer, = find_attention_layers(params, overrides=roles)
  assert layer.query == (HeadParam("attn/a/kernel", -2),)
  assert layer.key == (HeadParam("attn/b/kernel", -2),)
  with pytest.warns(UserWarning, match=r"\['gqa/\*'\] match no kernel"):
    assert find_attention_layers(params, overrides={**roles, "gqa/*": "key"}) == [layer]
  with pytest.raises(ValueError, match="match no kernel"):
    find_attention_layers(params, overrides={**roles, "gqa/*": "key"}, strict=True)
  with pytest.raises(ValueError, match="use one of"):
    find_attention_layers(params, overrides={"attn/a": "q"})
