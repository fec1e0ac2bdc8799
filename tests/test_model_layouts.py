"""Routing in the layouts of public Flax models, written here after reading their code.

nanodo (Linen ``DenseGeneral`` attention under its own module name, ``nn.Partitioned`` boxes,
tied), Flax ``examples/lm1b`` (every parameter boxed with logical names, the untied head nested
under ``decoder/``), Flax ``examples/gemma`` (NNX einsum attention, fused ``qkv`` or ``q`` +
fused ``kv``), an NNX model with logical ``out_sharding`` names and meaningless module names, a
Linen model scanned along axis 1 (MaxText's layout), the NNX miniGPT tutorial's tree, and a tied
model whose MLP is as wide as the vocabulary. For each: every leaf's group and matrix against
rules written here from what each module is, no warning, and one update against
``optax.contrib.muon`` given the same dimension numbers (written here by hand).
"""

import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import stablejax
from flax_models import (DenseGeneralLM, EinsumLM, LayerAxisLM, LogicalLM, MiniGPTLike,
                         ShardedNamesLM)

MDN = optax.contrib.MuonDimensionNumbers
QKV, OUT, LAST2 = MDN(-3, (-2, -1)), MDN((-3, -2), -1), MDN(-2, -1)
EINSUM_IN = MDN(-2, (-3, -1))  # [.., H, D, hd]: D against (H, hd)
TOKENS = jnp.zeros((1, 8), jnp.int32)


def _key(k) -> str:
  return str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))


def _is_param(x) -> bool:
  return isinstance(x, (nnx.Variable, nn.meta.AxisMetadata))


def _flat(tree, is_leaf=_is_param) -> dict:
  return {"/".join(_key(k) for k in p): x
          for p, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]}


def _plain(tree):
  """Arrays only: Linen boxes and NNX Variables replaced by their values."""
  return jax.tree.map(lambda x: x.get_value() if isinstance(x, nnx.Variable) else x,
                      nn.unbox(tree), is_leaf=lambda x: isinstance(x, nnx.Variable))


def _normal_like(x):
  return jnp.asarray(np.random.default_rng(x.size).standard_normal(x.shape), jnp.float32)


def _filled(abstract):
  """``abstract`` (shapes) holding numpy normal values drawn apart from the gradients'."""
  return jax.tree.map(lambda x: jnp.asarray(
      np.random.default_rng([x.size, 1]).standard_normal(x.shape), x.dtype), abstract)


def _linen_init(model, *inputs):
  """``model.init``'s variables as it lays them out (boxes, names, shapes: jax.eval_shape runs
  its code), holding numpy normal values (drawn apart from the gradients') instead of its random
  init: nothing here reads the init's values, and a compiled init costs a second or two."""
  return _filled(jax.eval_shape(model.init, jax.random.key(0), *(inputs or (TOKENS,))))


def _nnx_params(make):
  """The ``nnx.Param`` state of the NNX model ``make()`` builds (Variables and their metadata:
  nnx.eval_shape runs its constructor), holding numpy normal values instead of its random init
  (each initialiser run eagerly compiles its own programs)."""
  return _filled(nnx.state(nnx.eval_shape(make), nnx.Param))


def _check(params, expected):
  """Leaf-by-leaf routing, no warning, and one update against optax.contrib.muon.

  ``expected(path, shape) -> (group, dims or None)``.
  """
  plain = _plain(params)
  shapes = {k: v.shape for k, v in _flat(plain).items()}
  want = {k: expected(k, s) for k, s in shapes.items()}
  labels = _flat(stablejax.label_params(params), is_leaf=None)
  dims = _flat(stablejax.muon_dimension_numbers(params),
               is_leaf=lambda x: x is None or isinstance(x, MDN))
  assert labels == _flat(stablejax.label_params(plain), is_leaf=None)  # boxed = unboxed
  for path, (group, matrix) in want.items():
    assert labels[path] == group, (path, shapes[path], labels[path])
    assert dims[path] == matrix, (path, shapes[path], dims[path])
  tx = stablejax.outlier_safe_muon(0.02, outlier_method=None, ns_backend="xla")
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # every layout recognised: nothing to warn about
    state = tx.init(params)  # with the metadata (boxes / Variables), as nnx.Optimizer does
  notes = [line for line in stablejax.describe_routing(params, tx).splitlines()
           if line.startswith(("note:", "unsure:", "warning:"))]
  assert not [n for n in notes if not n.startswith("note:")], notes

  grads = jax.tree.map(_normal_like, plain)
  dim_tree = jax.tree.unflatten(jax.tree.structure(plain),
                                [want[k][1] for k in _flat(plain, is_leaf=None)])
  ref = optax.contrib.muon(0.02, consistent_rms=0.2, eps=1e-8,
                           muon_weight_dimension_numbers=dim_tree)
  # init saw the metadata, update sees pure arrays (nnx.Optimizer; a Linen state unboxed).
  ours = jax.jit(tx.update)(grads, _plain(state), plain)[0]
  theirs = jax.jit(ref.update)(grads, ref.init(plain), plain)[0]
  ours, theirs = _flat(ours, is_leaf=None), _flat(theirs, is_leaf=None)
  compared = 0
  for path, (group, matrix) in want.items():
    if group == "muon":
      np.testing.assert_allclose(ours[path], theirs[path], rtol=2e-4, atol=1e-7, err_msg=path)
      compared += 1
  assert compared >= 4
  return notes, ours


def _norm_or_bias(names) -> bool:
  return names[-1] == "bias" or any("norm" in n.lower() for n in names)


@pytest.mark.parametrize("partition", [False, True])
def test_nanodo_dense_general_attention_tied(partition):
  params = _linen_init(DenseGeneralLM(partition=partition))

  def expected(path, shape):
    names = path.split("/")
    if names[1] in ("embed", "pos_embed"):
      return "embedding", None
    if _norm_or_bias(names) or len(shape) == 1:
      return "adam", None
    if names[-2] in ("query", "key", "value"):
      return "muon", QKV
    return "muon", OUT if names[-2] == "attn_out_proj" else LAST2
  notes, _ = _check(params, expected)
  assert len(notes) == 1 and "taken as tied to the embedding params/embed/embedding" in notes[0]


def test_tied_model_with_mlp_as_wide_as_the_vocabulary_is_reported_tied():
  params = _linen_init(DenseGeneralLM(vocab=96, ff=96))
  labels = _flat(stablejax.label_params(params), is_leaf=None)
  assert [k for k, v in labels.items() if v == "head"] == []
  table = stablejax.describe_routing(params)
  notes = [line for line in table.splitlines() if line.startswith(("note:", "unsure:"))]
  assert len(notes) == 1 and "tied" in notes[0] and "Dense" not in notes[0], notes


@pytest.mark.parametrize("boxed", [True, False])
def test_lm1b_logical_boxes_and_nested_head(boxed):
  model = LogicalLM(boxed=boxed)
  params = _linen_init(model)

  def expected(path, shape):
    names = path.split("/")
    if names[-2] == "Embed_0":
      return "embedding", None
    if _norm_or_bias(names):
      return "adam", None
    if names[-2] == "logitdense":
      return "head", None
    if names[-2] in ("query", "key", "value"):
      return "muon", QKV
    return "muon", OUT if names[-2] == "out" else LAST2
  notes, ours = _check(params, expected)
  assert notes == []  # boxed, the metadata names the head; unboxed, its name and shape
  if not boxed:
    return
  # Boxed init and boxed update give what _check found with pure arrays at update.
  tx = stablejax.outlier_safe_muon(0.02, outlier_method=None, ns_backend="xla")
  grads = jax.tree.map(_normal_like, params)
  boxed_update = jax.jit(tx.update)(grads, tx.init(params), params)[0]
  assert isinstance(boxed_update["params"]["decoder"]["logitdense"]["kernel"],
                    nn.LogicallyPartitioned)
  for path, u in _flat(_plain(boxed_update), is_leaf=None).items():
    np.testing.assert_allclose(u, ours[path], rtol=1e-6, atol=1e-9, err_msg=path)


@pytest.mark.parametrize("kv_heads,qk_norm", [(4, False), (2, True), (1, False)])
def test_gemma_einsum_attention_fused_and_grouped(kv_heads, qk_norm):
  variables = _nnx_params(lambda: EinsumLM(kv_heads=kv_heads, qk_norm=qk_norm, rngs=nnx.Rngs(0)))

  def expected(path, shape):
    names = path.split("/")
    if names[0] == "embedder":
      return "embedding", None
    if _norm_or_bias(names):
      return "adam", None
    if names[-2] in ("qkv_einsum", "q_einsum", "kv_einsum"):
      return "muon", EINSUM_IN
    return "muon", OUT if names[-2] == "attn_vec_einsum" else LAST2
  notes, update = _check(variables, expected)
  assert len(notes) == 1 and "tied to the embedding embedder/input_embedding" in notes[0]
  # The fused kernel is three (or two) matrices D x H*hd, each orthogonalised on its own:
  # re-derived in numpy from the gradient (first step: the Nesterov input is a multiple of it).
  fused = "qkv_einsum" if kv_heads == 4 else "kv_einsum"
  path = f"layers/0/attn/{fused}/w"
  grad = np.asarray(_normal_like(_flat(_plain(variables), is_leaf=None)[path]))  # [F, H, D, hd]
  u = np.asarray(update[path])
  for g_part, u_part in zip(grad, u):
    mat = np.moveaxis(g_part, 1, 0).reshape(g_part.shape[1], -1)   # [D, H*hd]
    want = -0.02 * 0.2 * np.sqrt(max(mat.shape)) * _numpy_newton_schulz(mat)
    got = np.moveaxis(u_part, 1, 0).reshape(mat.shape)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=1e-6, err_msg=fused)


def _numpy_newton_schulz(x, steps=5, a=3.4445, b=-4.7750, c=2.0315, eps=1e-8):
  """Muon's quintic Newton-Schulz iteration (Jordan et al.), in float64."""
  x = x.astype(np.float64)
  wide = x.shape[0] <= x.shape[1]
  x = x if wide else x.T
  x = x / (np.linalg.norm(x) + eps)
  for _ in range(steps):
    gram = x @ x.T
    x = a * x + (b * gram + c * gram @ gram) @ x
  return x if wide else x.T


def test_nnx_logical_sharding_names_decide():
  with nnx.use_eager_sharding(False):
    variables = _nnx_params(lambda: ShardedNamesLM(rngs=nnx.Rngs(0)))

  def expected(path, shape):
    names = path.split("/")
    if names[0] == "tokens":
      return "embedding", None
    if names[0] == "unembed_w":
      return "head", None
    if names[-2] == "gain":
      return "adam", None
    if names[-2] in ("wa", "wb", "wc"):
      return "muon", QKV
    return "muon", OUT if names[-2] == "wd" else LAST2
  assert _check(variables, expected)[0] == []
  table = stablejax.describe_routing(variables)
  row = next(line for line in table.splitlines() if line.startswith("layers/0/wd/kernel "))
  assert re.split(r"\s{2,}", row)[3:5] == ["32x32", "metadata"]


@pytest.mark.parametrize("boxed", [True, False])
def test_layers_stacked_on_axis_one(boxed):
  params = _linen_init(LayerAxisLM())
  if not boxed:
    params = nn.unbox(params)

  def expected(path, shape):
    names = path.split("/")
    if names[-2] == "Embed_0":
      return "embedding", None
    if names[-2] == "logits_dense":
      return "head", None
    if "Norm" in names[-2]:
      return "adam", None
    return "muon", {"q": MDN(-4, (-2, -1)), "k": MDN(-4, (-2, -1)), "v": MDN(-4, (-2, -1)),
                    "o": MDN((-4, -2), -1), "wi": MDN(-3, -1), "wo": MDN(-3, -1)}[names[-2]]
  _check(params, expected)


def test_minigpt_tutorial_tree_with_mesh_axis_annotations():
  with nnx.use_eager_sharding(False):
    variables = _nnx_params(lambda: MiniGPTLike(rngs=nnx.Rngs(0)))

  def expected(path, shape):
    names = path.split("/")
    if names[0] == "embedding_layer":
      return "embedding", None
    if _norm_or_bias(names):
      return "adam", None
    if names[0] == "output_layer":
      return "head", None
    if names[-2] in ("query", "key", "value"):
      return "muon", QKV
    return "muon", OUT if names[-2] == "out" else LAST2
  notes, _ = _check(variables, expected)
  assert notes == []  # output_layer: named like a head and shaped like one


def test_one_summary_warning_for_unrecognised_kernels_grouped_by_layout():
  layer = {"conv": {"kernel": jnp.zeros((3, 3, 4, 8))}, "mix": {"kernel": jnp.zeros((2, 5, 6, 7))}}
  params = {"embed": jnp.zeros((40, 16)), **{f"layer_{i}": layer for i in range(4)}}
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    stablejax.outlier_safe_muon(0.02).init(params)
  assert len(caught) == 1, [str(w.message) for w in caught]
  text = str(caught[0].message)
  assert "8 kernels of 3+ axes match no layout rule" in text
  assert "4 x (3, 3, 4, 8) as 9 x 4x8 (layer_0/conv/kernel, layer_1/conv/kernel and 2 more)" in text
  assert "4 x (2, 5, 6, 7) as 10 x 6x7" in text


def test_attention_with_as_many_heads_as_head_dims_is_not_a_stack():
  # [D, H, hd] kernels and [H, hd] biases share axis 1 when H == hd: one attention layer,
  # orthogonalised as whole matrices, not a stack along axis 1 cut into per-head slices.
  mha = nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=16)
  attn = _linen_init(mha, jnp.ones((1, 3, 16)))["params"]
  dims = stablejax.muon_dimension_numbers({"embed": jnp.zeros((50, 16)), "attn": attn})["attn"]
  assert [dims[p]["kernel"] for p in ("query", "key", "value", "out")] == [QKV, QKV, QKV, OUT]
