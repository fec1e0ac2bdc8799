"""Per-head Muon (``per_head=True``) in every storage the routing recognises, against numpy.

Each model's attention kernels are cut into per-head matrices by index expressions written here from
each model's source (query, key and value per head, grouped-query key and value per key head, the
output projection per head); the first Muon update of each such matrix must be a float64 numpy
Newton-Schulz of the gradient's same slice, times the Moonlight scale ``0.2 sqrt(max(rows, cols))``
and ``-lr``. Storages: stablejax's own GPT (scan-stacked ``[L, D, D]``, head size from ``num_heads``
or from the query/key norm), separate and fused grouped-query projections of a plain tree, GPT-2's
fused ``c_attn`` in Flax ``Dense`` storage and in Hugging Face's ``Conv1D`` ``[out, in]`` storage,
Hugging Face Llama (grouped-query), Equinox's ``MultiheadAttention`` (``[out, in]``, stacked),
nanodo's ``DenseGeneral`` ``[D, H, hd]`` / ``[H, hd, D]``, Gemma's einsum kernels (``q_einsum [H, D,
hd]`` with a fused ``kv_einsum [2, K, D, hd]``), and MaxText's layout scanned along axis 1 with
logical axis names.
"""

import math
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import stablejax
from flax_models import DenseGeneralLM, EinsumLM, LayerAxisLM
from helpers import load_example

LR = 0.01
A, B, C = 3.4445, -4.7750, 2.0315


def _ns64(m):
  """Five standard Newton-Schulz steps in float64 numpy (eps 1e-8, as Muon's)."""
  m = np.asarray(m, np.float64)
  tall = m.shape[0] > m.shape[1]
  x = m.T if tall else m
  x = x / (np.linalg.norm(x) + 1e-8)
  for _ in range(5):
    gram = x @ x.T
    x = A * x + (B * gram + C * gram @ gram) @ x
  return x.T if tall else x


def _key(k):
  return str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k))))


def _flat(tree):
  """``{path: array}``; an NNX state's trailing ``value`` is dropped."""
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    names = [_key(k) for k in path]
    out["/".join(names[:-1] if names[-1] == "value" else names)] = np.asarray(leaf, np.float64)
  return out


def _zeros(abstract):
  """Numpy zeros in place of each ``jax.ShapeDtypeStruct`` of a tree (boxes and modules kept):
  the routing reads shapes, names and metadata only, and Muon's first update without weight
  decay (outlier_safe_muon's default) does not read the weights."""
  return jax.tree.map(lambda s: np.zeros(s.shape, s.dtype)
                      if isinstance(s, jax.ShapeDtypeStruct) else s, abstract)


def _init(model):
  """A Linen model's variables as zeros of their shapes: traced (jax.eval_shape), not run (an
  init compiles a program per model)."""
  tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)
  return _zeros(jax.eval_shape(model.init, jax.random.key(0), tokens))


def _updates(params, per_head, **kw):
  # numpy gradients: jax.random.normal would compile a program for each new shape
  grads = jax.tree.map(lambda x: np.random.default_rng(x.size % 97).standard_normal(
      x.shape).astype(np.float32), params)
  tx = stablejax.outlier_safe_muon(LR, outlier_method=None, ns_backend="xla",
                                   per_head=per_head, **kw)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # nothing to warn about on a model it reads
    state = tx.init(params)
  return _flat(jax.jit(tx.update)(grads, state, params)[0]), _flat(grads)


def _check(params, slices, **kw):
  """``slices``: {path: [index expression of one head's matrix, ...]} for every attention
  kernel; each head's update against numpy (a whole-projection update is not that: its head
  slices are slices of one orthogonal matrix, not each orthogonal)."""
  got, grads = _updates(params, True, **kw)
  for path, heads in slices.items():
    assert path in got, (path, sorted(got))
    for idx in heads:
      g = grads[path][idx]
      assert g.ndim == 2, (path, idx, g.shape)
      want = -LR * 0.2 * math.sqrt(max(g.shape)) * _ns64(g)
      np.testing.assert_allclose(got[path][idx], want, atol=2e-4 * np.abs(want).max(),
                                 err_msg=f"{path} {idx}")


def _row_heads(n, hd, offset=0, lead=()):
  """Head slices of a kernel whose heads lie along its first matrix axis (after ``lead``)."""
  return [lead + (slice(offset + h * hd, offset + (h + 1) * hd), slice(None)) for h in range(n)]


def _col_heads(n, hd, offset=0, lead=()):
  return [lead + (slice(None), slice(offset + h * hd, offset + (h + 1) * hd)) for h in range(n)]


@pytest.mark.parametrize("qk_norm", [False, True])
def test_stablejax_gpt_scan_stacked(qk_norm):
  from stablejax.modeling.gpt import GPT, ModelConfig
  cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=16,
                    qk_norm=qk_norm)
  params = _init(GPT(cfg))["params"]
  slices = {}
  for layer in range(2):
    for name in ("q_proj", "k_proj", "v_proj"):
      slices.setdefault(f"blocks/attn/{name}/kernel", []).extend(_col_heads(4, 8, lead=(layer,)))
    slices.setdefault("blocks/attn/o_proj/kernel", []).extend(_row_heads(4, 8, lead=(layer,)))
  # with QK-norm the head size comes from the norm's gain; without, from num_heads
  _check(params, slices, **({} if qk_norm else {"num_heads": 4}))


def test_grouped_query_separate_and_fused_in_a_plain_tree():
  d, h, k, hd = 32, 4, 2, 8
  shapes = {"embed": (100, d), "ln": {"scale": (d,)},
            "gqa": {"q_proj": {"kernel": (d, h * hd)}, "k_proj": {"kernel": (d, k * hd)},
                    "v_proj": {"kernel": (d, k * hd)}, "o_proj": {"kernel": (h * hd, d)}},
            "fused": {"qkv_proj": {"kernel": (d, (h + 2 * k) * hd)},
                      "o_proj": {"kernel": (h * hd, d)}},
            "gpt2": {"c_attn": {"kernel": (d, 3 * d)}, "c_proj": {"kernel": (d, d)}}}
  params = jax.tree.map(np.zeros, shapes, is_leaf=lambda x: isinstance(x, tuple))
  slices = {"gqa/q_proj/kernel": _col_heads(h, hd), "gqa/k_proj/kernel": _col_heads(k, hd),
            "gqa/v_proj/kernel": _col_heads(k, hd), "gqa/o_proj/kernel": _row_heads(h, hd),
            # [D, (H + 2K) hd]: 4 query heads, then 2 key heads, then 2 value heads
            "fused/qkv_proj/kernel": _col_heads(h + 2 * k, hd),
            "fused/o_proj/kernel": _row_heads(h, hd),
            "gpt2/c_attn/kernel": _col_heads(3 * h, hd), "gpt2/c_proj/kernel": _row_heads(h, hd)}
  _check(params, slices, num_heads=h)


def test_equinox_multihead_attention_out_in_storage():
  equinox_lm = load_example("equinox_lm")
  model = eqx.filter_eval_shape(equinox_lm.GPT, 64, 32, 4, 2, 16, jax.random.key(0))
  params = eqx.filter(_zeros(model), eqx.is_array)
  slices = {}
  for layer in range(2):  # eqx.nn.Linear: weight [out, in]; stacked blocks [L, ...]
    for name in ("query_proj", "key_proj", "value_proj"):
      slices.setdefault(f"blocks/attn/{name}/weight", []).extend(_row_heads(4, 8, lead=(layer,)))
    slices.setdefault("blocks/attn/output_proj/weight", []).extend(
        _col_heads(4, 8, lead=(layer,)))
  _check(params, slices, num_heads=4)


def test_dense_general_heads_axis():
  params = _init(DenseGeneralLM())["params"]
  slices = {}
  for block in ("blocks_0", "blocks_1"):
    base = f"{block}/DenseGeneralAttention_0"
    for name in ("query", "key", "value"):  # [D, H, hd]
      slices[f"{base}/{name}/kernel"] = [(slice(None), h, slice(None)) for h in range(4)]
    slices[f"{base}/attn_out_proj/kernel"] = [(h,) for h in range(4)]  # [H, hd, D]
  _check(params, slices)  # heads are an axis: no head count needed


def test_gemma_einsum_grouped_query():
  model = nnx.eval_shape(lambda: EinsumLM(kv_heads=2, rngs=nnx.Rngs(0)))
  params = _zeros(nnx.state(model, nnx.Param))
  slices = {}
  for layer in range(2):
    base = f"layers/{layer}/attn"
    slices[f"{base}/q_einsum/w"] = [(h,) for h in range(4)]                # [H, D, hd]
    slices[f"{base}/kv_einsum/w"] = [(c, k) for c in range(2) for k in range(2)]  # [2, K, D, hd]
    slices[f"{base}/attn_vec_einsum/w"] = [(h,) for h in range(4)]         # [H, hd, D]
  _check(params, slices)


def test_layers_scanned_along_axis_one_with_logical_names():
  variables = _init(LayerAxisLM())  # boxed
  # nn.scan(variable_axes={'params': 1}): q/k/v [D, L, H, hd], o [H, L, hd, D]
  slices = {f"decoder/{n}/kernel": [(slice(None), layer, h, slice(None)) for layer in range(3)
                                    for h in range(4)] for n in "qkv"}
  slices["decoder/o/kernel"] = [(h, layer) for layer in range(3) for h in range(4)]
  _check(variables["params"], slices)


def test_hugging_face_gpt2_conv1d_and_llama_grouped_query():
  pytest.importorskip("transformers")
  from hf_models import build
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # transformers' deprecation notice of its Flax classes
    # their parameters' shapes only (the routing reads no weight): nothing initialised
    gpt2, llama = build("gpt2", _do_init=False), build("llama", _do_init=False)
  d, h, hd = 32, 4, 8
  slices = {}
  for layer in range(2):
    base = f"transformer/h/{layer}/attn"
    # Conv1D: kernel [out, in]; c_attn's rows are the query, key and value heads in turn
    slices[f"{base}/c_attn/kernel"] = _row_heads(3 * h, hd)
    slices[f"{base}/c_proj/kernel"] = _col_heads(h, hd)
  _check(_zeros(gpt2.params_shape_tree), slices, num_heads=h)
  slices = {}
  for layer in range(2):
    base = f"model/layers/{layer}/self_attn"
    slices[f"{base}/q_proj/kernel"] = _col_heads(h, hd)
    slices[f"{base}/k_proj/kernel"] = _col_heads(2, hd)  # 2 key heads
    slices[f"{base}/v_proj/kernel"] = _col_heads(2, hd)
    slices[f"{base}/o_proj/kernel"] = _row_heads(h, hd)
  del d
  _check(_zeros(llama.params_shape_tree), slices, num_heads=h)


def test_per_head_errors_and_describe():
  from stablejax.modeling.gpt import GPT, ModelConfig
  cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, max_seq_len=16,
                    qk_norm=False)
  params = _init(GPT(cfg))["params"]
  with pytest.raises(ValueError, match="num_heads="):
    stablejax.outlier_safe_muon(LR, per_head=True).init(params)
  with pytest.raises(ValueError, match="num_heads"):
    stablejax.outlier_safe_muon(LR, per_head=True, num_heads=0)
  with pytest.raises(ValueError, match="per_head"):
    stablejax.outlier_safe_muon(LR, per_head="yes")
  text = stablejax.describe_routing(params, stablejax.outlier_safe_muon(
      LR, per_head=True, num_heads=4))
  row = next(line for line in text.splitlines() if line.startswith("blocks/attn/o_proj"))
  assert "4 x 8x32" in row and "attention heads" in row
  dims = stablejax.muon_dimension_numbers(params, per_head=True, num_heads=4)
  assert dims["blocks"]["attn"]["q_proj"]["kernel"] == stablejax.FusedDimensionNumbers(-2, -1,
                                                                                       -1, 4)
  with pytest.warns(UserWarning, match="no attention projection is split"):
    stablejax.muon_dimension_numbers({"w": np.zeros((8, 8))}, per_head=True)


def test_given_dimension_numbers_win_over_per_head():
  import optax

  from stablejax.modeling.gpt import GPT, ModelConfig
  from stablejax.muon import routing
  cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, max_seq_len=16,
                    qk_norm=False)
  params = _init(GPT(cfg))["params"]
  whole = optax.contrib.MuonDimensionNumbers(-2, -1)

  def given(p):
    tree = jax.tree.map(lambda _: None, p)
    tree["blocks"]["attn"]["q_proj"]["kernel"] = whole
    return tree
  plan = routing.plan(params, weight_dimension_numbers=given, per_head=routing.PerHead(4))
  by_path = {leaf.path: (dims, source) for leaf, dims, source in
             zip(plan.leaves, plan.layouts, plan.sources)}
  assert by_path["blocks/attn/q_proj/kernel"] == (whole, "given")
  assert by_path["blocks/attn/k_proj/kernel"] == (
      stablejax.FusedDimensionNumbers(-2, -1, -1, 4), "per_head")
