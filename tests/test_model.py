"""Tests for the GPT model: options, precision policy, causality, BitNet, validation."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from stablejax.modeling import bitnet
from stablejax.modeling.gpt import GPT, ModelConfig, count_params, model_flops_per_token
from helpers import gpt_params

T = 16
# Tests run unscanned in float32 unless they are about scan or precision: it compiles much faster.
BASE = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, max_seq_len=T,
                   scan_layers=False, compute_dtype="float32", qk_norm=False)


def _tokens(seed=0, b=2, t=T, vocab=64):
  # numpy: a jax.random draw compiles a program per shape.
  return np.random.default_rng(seed).integers(0, vocab, (b, t)).astype(np.int32)


def _init(cfg, tokens):
  return jax.jit(GPT(cfg).init)(jax.random.key(0), tokens)["params"]


def _apply(cfg, params, tokens, **kw):
  return jax.jit(lambda p, t: GPT(cfg).apply({"params": p}, t, **kw))(params, tokens)


OPTIONS = {
    "defaults_scan_bf16": dict(scan_layers=True, compute_dtype="bfloat16", n_layers=2),
    "post_ln_ssnorm_qk_norm": dict(post_ln=True, norm="ssnorm", qk_norm=True),
    "tie_embed_scale": dict(tie_embeddings=True, embed_scale=True),
    "emb_proj": dict(emb_proj=True),
    "bitnet_remat": dict(bitnet=True, remat=True),
    "scan_remat_emb_proj_tie": dict(scan_layers=True, n_layers=2, remat=True, emb_proj=True,
                                    tie_embeddings=True),
    "fp16": dict(compute_dtype="float16"),
}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_forward_shapes_and_finite_loss(name):
  cfg = dataclasses.replace(BASE, **OPTIONS[name])
  cfg.validate()
  tokens = _tokens(t=T + 1)
  params = _init(cfg, tokens[:, :-1])

  @jax.jit
  def run(p):
    def loss_fn(p):
      logits, acts = GPT(cfg).apply({"params": p}, tokens[:, :-1], bitnet_lambda=0.5,
                                    return_activations=True)
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
      return loss, (logits, acts)
    return jax.value_and_grad(loss_fn, has_aux=True)(p)

  (loss, (logits, acts)), grads = run(params)
  assert logits.shape == (2, T, cfg.vocab_size) and logits.dtype == jnp.float32
  assert acts["residual"].shape == (cfg.n_layers + 1, 2, T, cfg.d_model)
  assert acts["residual"].dtype == jnp.float32
  assert np.isfinite(float(loss))
  # Untrained model: loss near log(vocab).
  assert abs(float(loss) - np.log(cfg.vocab_size)) < 0.5
  assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree_util.tree_leaves(grads))
  # Every parameter is float32 (the precision policy never stores low-precision params).
  assert all(p.dtype == jnp.float32 for p in jax.tree_util.tree_leaves(params))


def _shapes(cfg):
  return gpt_params(cfg, seq_len=T, abstract=True)


def _numpy_params(cfg, seed=0):
  """Parameters of ``cfg``'s layout drawn in numpy (norm gains 1, matrices of the init's std):
  for the tests whose property holds for any parameters (causality, scan vs unscanned), without
  compiling an init program."""
  rng = np.random.default_rng(seed)
  return jax.tree_util.tree_map_with_path(
      lambda path, leaf: np.ones(leaf.shape, np.float32) if "norm" in jax.tree_util.keystr(path)
      else rng.normal(0, cfg.init_std, leaf.shape).astype(np.float32), _shapes(cfg))


def test_param_layout_names_and_kernel_ranks():
  cfg = dataclasses.replace(BASE, emb_proj=True, qk_norm=True, scan_layers=True, n_layers=2)
  params = _shapes(cfg)
  assert params["tok_embed"]["embedding"].shape == (64, 32)
  assert params["lm_head"]["kernel"].shape == (32, 64)
  assert params["emb_proj_in"]["kernel"].shape == (32, 32)
  assert params["emb_proj_out"]["kernel"].shape == (32, 32)
  blocks = params["blocks"]
  assert blocks["attn"]["q_proj"]["kernel"].shape == (2, 32, 32)
  assert blocks["mlp"]["gate_proj"]["kernel"].shape == (2, 32, cfg.ff_dim)
  assert blocks["mlp"]["down_proj"]["kernel"].shape == (2, cfg.ff_dim, 32)
  assert blocks["attn_norm"]["scale"].shape == (2, 32)
  assert blocks["attn"]["q_norm"]["scale"].shape == (2, 8)
  # No 3D per-layer kernels: every non-embedding matrix is [L, in, out] under scan.
  for path, leaf in jax.tree_util.tree_leaves_with_path(blocks):
    assert leaf.ndim in (2, 3), path
  # EmbProj starts orthogonal.
  params = _init(dataclasses.replace(BASE, emb_proj=True), _tokens())
  p = np.asarray(params["emb_proj_in"]["kernel"])
  np.testing.assert_allclose(p.T @ p, np.eye(32), atol=1e-5)
  # Tied: no head.
  tied = _shapes(dataclasses.replace(BASE, tie_embeddings=True))
  assert "lm_head" not in tied
  # Unscanned: per-layer modules, 2D kernels.
  flat = _shapes(dataclasses.replace(BASE, n_layers=2))
  assert flat["block_1"]["attn"]["o_proj"]["kernel"].shape == (32, 32)


def test_ssnorm_has_one_scalar_gain_per_norm():
  params = _shapes(dataclasses.replace(BASE, norm="ssnorm", qk_norm=True, scan_layers=True,
                                      n_layers=2))
  assert params["final_norm"]["scale"].shape == ()
  assert params["blocks"]["attn_norm"]["scale"].shape == (2,)
  assert params["blocks"]["mlp_norm"]["scale"].shape == (2,)
  assert params["blocks"]["attn"]["k_norm"]["scale"].shape == (2,)


def test_scan_and_unscanned_models_agree():
  cfg_flat = dataclasses.replace(BASE, n_layers=2)
  cfg_scan = dataclasses.replace(cfg_flat, scan_layers=True)
  tokens = _tokens()
  p_scan = _numpy_params(cfg_scan)
  p_flat = {k: v for k, v in p_scan.items() if k != "blocks"}
  for i in range(cfg_flat.n_layers):
    p_flat[f"block_{i}"] = jax.tree_util.tree_map(lambda x, i=i: x[i], p_scan["blocks"])
  a = _apply(cfg_scan, p_scan, tokens)
  b = _apply(cfg_flat, p_flat, tokens)
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_an_unrolled_scan_keeps_the_stacked_parameters_and_the_numbers():
  # scan_unroll changes the compiled loop, not the model: the same [L, ...] parameters give the
  # same logits and gradients rolled (1 layer per iteration) and unrolled (the CPU's default).
  rolled = dataclasses.replace(BASE, n_layers=2, scan_layers=True, scan_unroll=1)
  unrolled = dataclasses.replace(rolled, scan_unroll=None)
  tokens = _tokens()
  params = _numpy_params(rolled)
  assert jax.tree.structure(_shapes(unrolled)) == jax.tree.structure(params)

  def loss_and_grads(cfg):
    def loss(p):
      return jnp.mean(GPT(cfg).apply({"params": p}, tokens) ** 2)
    return jax.jit(jax.value_and_grad(loss))(params)
  (l1, g1), (l2, g2) = loss_and_grads(rolled), loss_and_grads(unrolled)
  np.testing.assert_allclose(float(l1), float(l2), rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), g1, g2)


def test_scan_unroll_is_the_config_value_or_the_platform_choice():
  from stablejax.modeling.gpt import scan_unroll
  assert scan_unroll(dataclasses.replace(BASE, n_layers=6), "cpu") == 6
  assert scan_unroll(dataclasses.replace(BASE, n_layers=6), "gpu") == 1
  assert scan_unroll(dataclasses.replace(BASE, n_layers=6), "tpu") == 1
  assert scan_unroll(dataclasses.replace(BASE, n_layers=6, scan_unroll=3), "gpu") == 3


def test_matmul_over_flattened_rows_is_the_3d_product_and_its_gradient():
  from stablejax.modeling.layers import matmul_2d
  rng = np.random.default_rng(0)
  x, w, cot = (rng.normal(size=s).astype(np.float32) for s in ((2, 5, 8), (8, 3), (2, 5, 3)))
  y, pull = jax.vjp(matmul_2d, x, w)
  np.testing.assert_allclose(y, np.einsum("btk,kn->btn", x, w), rtol=1e-5, atol=1e-6)
  dx, dw = pull(cot)
  np.testing.assert_allclose(dx, np.einsum("btn,kn->btk", cot, w), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(dw, np.einsum("btk,btn->kn", x, cot), rtol=1e-5, atol=1e-6)


def test_cudnn_attention_that_refuses_the_call_falls_back_to_xla(monkeypatch):
  # Where cuDNN's fused attention is chosen but refuses the call (here: a CPU, which has no
  # cuDNN), the XLA implementation's result comes back, with one warning naming why.
  from stablejax.modeling import attention
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=(1, 4, 2, 8)).astype(jnp.bfloat16)) for _ in range(3))
  expected = jax.nn.dot_product_attention(q, k, v, is_causal=True)
  monkeypatch.setattr(attention, "device_platform", lambda: "cuda")
  monkeypatch.setattr(attention, "_warned_cudnn", [])
  with pytest.warns(UserWarning, match="cuDNN attention is not available"):
    out = attention.causal_attention(q, k, v)
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(expected, np.float32))


def test_bf16_compute_keeps_params_fp32_and_tracks_fp32_model():
  tokens = _tokens()
  cfg16 = dataclasses.replace(BASE, compute_dtype="bfloat16")
  cfg32 = BASE
  params = _init(cfg16, tokens)
  before = jax.tree_util.tree_map(np.asarray, params)
  def fwd(p):
    logits = GPT(cfg16).apply({"params": p}, tokens)
    return logits.sum(), logits
  (_, lo), grads = jax.jit(jax.value_and_grad(fwd, has_aux=True))(params)
  assert all(g.dtype == jnp.float32 for g in jax.tree_util.tree_leaves(grads))
  hi = _apply(cfg32, params, tokens)
  assert lo.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(lo), np.asarray(hi), atol=0.05)
  # The stored parameters were not modified by the low-precision call.
  for a, b in zip(jax.tree_util.tree_leaves(before), jax.tree_util.tree_leaves(params)):
    np.testing.assert_array_equal(a, np.asarray(b))
    assert b.dtype == jnp.float32


def test_param_dtype_bfloat16_stores_bf16_params():
  params = _shapes(dataclasses.replace(BASE, param_dtype="bfloat16"))
  assert all(p.dtype == jnp.bfloat16 for p in jax.tree_util.tree_leaves(params))


def test_causal_masking():
  cfg = dataclasses.replace(BASE, qk_norm=True, n_layers=2)
  tokens = _tokens()
  params = _numpy_params(cfg)
  changed = tokens.copy()
  changed[:, 10] = (tokens[:, 10] + 1) % cfg.vocab_size
  fwd = jax.jit(lambda t: GPT(cfg).apply({"params": params}, t))
  a = np.asarray(fwd(tokens))
  b = np.asarray(fwd(changed))
  np.testing.assert_allclose(a[:, :10], b[:, :10], atol=1e-6)
  assert np.abs(a[:, 10:] - b[:, 10:]).max() > 1e-4


def test_sequence_longer_than_max_seq_len_is_an_error():
  with pytest.raises(ValueError, match="max_seq_len"):
    _shapes_long = jax.eval_shape(GPT(BASE).init, jax.random.key(0), _tokens(t=T + 1))


def test_bitnet_quantizers_match_numpy():
  rng = np.random.default_rng(0)
  w = rng.normal(size=(8, 6)).astype(np.float32)
  s = np.abs(w).mean()
  np.testing.assert_allclose(np.asarray(bitnet.ternary_weight_quant(w)),
                             np.clip(np.round(w / s), -1, 1) * s, rtol=1e-6)
  x = rng.normal(size=(3, 5, 8)).astype(np.float32)
  amax = np.abs(x).max(-1, keepdims=True)
  ref = np.clip(np.round(x * 127 / amax), -128, 127) * amax / 127
  np.testing.assert_allclose(np.asarray(bitnet.int8_activation_quant(x)), ref, rtol=1e-5,
                             atol=1e-7)


def test_bitnet_lambda_mixes_and_ste_passes_gradients():
  rng = np.random.default_rng(1)
  x = rng.normal(size=(4, 8)).astype(np.float32)
  w = rng.normal(size=(8, 3)).astype(np.float32)
  # Each step jitted (one program each; op by op, each operation compiles one).
  x_quant = np.asarray(jax.jit(bitnet.int8_activation_quant)(x))
  full = x @ w
  quant = x_quant @ np.asarray(jax.jit(bitnet.ternary_weight_quant)(w))
  mixed = jax.jit(lambda x, w, f: bitnet.bitnet_matmul(x, w, f, jnp.float32))
  for quantized_fraction in (0.0, 0.3, 1.0):
    got = mixed(x, w, jnp.float32(quantized_fraction))
    f = quantized_fraction
    np.testing.assert_allclose(np.asarray(got), (1 - f) * full + f * quant, rtol=1e-5,
                               atol=1e-5)
  # Straight-through: at lam=1 the gradient wrt w is that of the plain matmul with q(x).
  g = jax.jit(jax.grad(lambda w_: bitnet.bitnet_matmul(x, w_, 1.0, jnp.float32).sum()))(w)
  np.testing.assert_allclose(np.asarray(g), x_quant.T @ np.ones((4, 3)), rtol=1e-5, atol=1e-5)


def test_bitnet_model_lambda_is_traced_and_changes_output():
  cfg = dataclasses.replace(BASE, bitnet=True)
  tokens = _tokens()
  params = _init(cfg, tokens)
  traces = []

  @jax.jit
  def fwd(p, quantized_fraction):
    traces.append(1)
    return GPT(cfg).apply({"params": p}, tokens, bitnet_lambda=quantized_fraction)

  out = [np.asarray(fwd(params, jnp.float32(f))) for f in (0.0, 0.5, 1.0)]
  assert len(traces) == 1
  plain = _apply(dataclasses.replace(cfg, bitnet=False), params, tokens)
  np.testing.assert_allclose(out[0], np.asarray(plain), atol=1e-5)
  assert np.abs(out[2] - out[0]).max() > 1e-3
  np.testing.assert_allclose(
      out[1], np.asarray(fwd(params, jnp.float32(0.5))), atol=0)


def test_validate_errors():
  bad = [
      (dict(n_heads=5), "n_heads=5 does not divide"),
      (dict(norm="layernorm"), "model.norm"),
      (dict(compute_dtype="float8"), "compute_dtype"),
      (dict(param_dtype="int8"), "param_dtype"),
      (dict(d_model=0), "d_model"),
      (dict(d_model=36, n_heads=4), "RoPE"),
      (dict(init_std=0.0), "init_std"),
      (dict(d_ff=-1), "d_ff"),
      (dict(scan_unroll=0), "scan_unroll"),
  ]
  for kw, msg in bad:
    with pytest.raises(ValueError, match=msg) as e:
      dataclasses.replace(BASE, **kw).validate()
    assert "\n" not in str(e.value)


def test_ff_dim_and_flops():
  assert ModelConfig(d_model=256).ff_dim == 704      # 8/3*256 = 682.7 -> nearest multiple of 64
  assert ModelConfig(d_model=32).ff_dim == 64
  assert ModelConfig(d_model=768).ff_dim == 2048
  assert ModelConfig(d_model=32, d_ff=100).ff_dim == 100
  cfg = BASE
  params = _shapes(cfg)
  n_matmul = count_params(params) - params["tok_embed"]["embedding"].size - sum(
      x.size for k, x in jax.tree_util.tree_leaves_with_path(params) if "norm" in str(k))
  assert model_flops_per_token(cfg, T) == 6 * n_matmul + 12 * cfg.n_layers * cfg.d_model * T
  assert count_params({"a": jnp.zeros((3, 4)), "b": [jnp.zeros(5)]}) == 17
