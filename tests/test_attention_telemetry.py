"""Attention-logit telemetry: the per-head max pre-softmax logit, from the trainer's GPT, from
Flax Linen and NNX attention layers (through sow_attention_logits), against numpy."""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import stablejax
from stablejax.layout.heads import AttentionLayer, HeadParam, find_attention_layers
from stablejax.modeling.gpt import GPT, ModelConfig, layer_max_logits
from stablejax.modeling.layers import rope


def _np_max_logit(q, k, causal=True, mask=None):
  """q [B, T, H, d], k [B, S, K, d] -> [H]: brute force in float64."""
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  b, t, h, d = q.shape
  kh = k.shape[2]
  out = np.full(h, -np.inf)
  for head in range(h):
    kk = k[:, :, head // (h // kh)]
    logits = np.einsum("btd,bsd->bts", q[:, :, head], kk) / np.sqrt(d)
    keep = np.ones(logits.shape, bool)
    if causal:
      keep &= np.tril(np.ones((t, k.shape[1]), bool))[None]
    if mask is not None:
      keep &= np.broadcast_to(mask[:, head] if mask.shape[1] > 1 else mask[:, 0], logits.shape)
    out[head] = logits[keep].max()
  return out


def test_attention_logit_max_matches_numpy_causal_masked_and_grouped():
  rng = np.random.default_rng(0)
  q = rng.normal(size=(2, 5, 4, 8)).astype(np.float32) * 3
  k = rng.normal(size=(2, 5, 2, 8)).astype(np.float32) * 3      # 2 key heads for 4 query heads
  np.testing.assert_allclose(stablejax.attention_logit_max(q, k, is_causal=True),
                             _np_max_logit(q, k), rtol=1e-5)
  mask = rng.uniform(size=(2, 1, 5, 5)) > 0.3
  np.testing.assert_allclose(stablejax.attention_logit_max(q, k, mask=mask),
                             _np_max_logit(q, k, causal=False, mask=mask), rtol=1e-5)
  # No gradient flows through the telemetry.
  g = jax.grad(lambda x: stablejax.attention_logit_max(x, k).sum())(jnp.asarray(q))
  assert float(jnp.abs(g).max()) == 0.0
  with pytest.raises(ValueError, match="multiple of key heads"):
    stablejax.attention_logit_max(q, k[:, :, :1].repeat(3, axis=2))


@pytest.mark.parametrize("scan", [True, False])
def test_gpt_sows_the_max_of_the_logits_its_softmax_uses(scan):
  cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=16,
                    compute_dtype="float32", scan_layers=scan, init_std=0.3, qk_norm=False)
  model = GPT(cfg)
  tokens = np.random.default_rng(1).integers(0, 64, (2, 12)).astype(np.int32)
  # init and each forward pass jitted: one program each (op by op, one per operation).
  params = jax.jit(model.init)(jax.random.key(0), tokens)["params"]
  plain = jax.jit(lambda p, t: model.apply({"params": p}, t))(params, tokens)
  logits, state = jax.jit(lambda p, t: model.apply({"params": p}, t, attention_logits=True,
                                                   mutable=["intermediates"]))(params, tokens)
  np.testing.assert_allclose(np.asarray(logits), np.asarray(plain), rtol=1e-5, atol=1e-5)
  collected = stablejax.collect_attention_logits(state)
  # The sown values are keyed by the names find_attention_layers gives the layers (what
  # qk_clip matches them by), and the layers are the GPT's q_proj / k_proj, heads head-major.
  found = find_attention_layers(params, num_heads=cfg.n_heads)
  names = ["blocks/attn"] if scan else [f"block_{i}/attn" for i in range(cfg.n_layers)]
  assert found == [AttentionLayer(n, 4, 4, query=(HeadParam(f"{n}/q_proj/kernel", -1),),
                                  key=(HeadParam(f"{n}/k_proj/kernel", -1),),
                                  stack_ndim=int(scan)) for n in names]
  assert sorted(collected) == names
  got = np.asarray(layer_max_logits(cfg, collected))                       # [L, H]
  # Reference: the q_proj / k_proj outputs captured by Flax, RoPE, numpy max.
  _, captured = jax.jit(lambda p, t: model.apply({"params": p}, t, capture_intermediates=True,
                                                 mutable=["intermediates"]))(params, tokens)
  inter = captured["intermediates"]
  for i in range(cfg.n_layers):
    attn = inter["blocks"]["attn"] if scan else inter[f"block_{i}"]["attn"]
    q, k = attn["q_proj"]["__call__"][0], attn["k_proj"]["__call__"][0]
    if scan:
      q, k = q[i], k[i]
    q = rope(q.reshape(2, 12, 4, 8), cfg.rope_theta)
    k = rope(k.reshape(2, 12, 4, 8), cfg.rope_theta)
    np.testing.assert_allclose(got[i], _np_max_logit(q, k), rtol=1e-5)


def test_linen_mha_wrapper_sows_per_head_max_and_leaves_the_output_alone():
  mha = nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=16,
                                        attention_fn=stablejax.sow_attention_logits(
                                            nn.dot_product_attention))
  plain = nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=16)
  x = jax.random.normal(jax.random.key(0), (2, 6, 16)) * 3
  mask = nn.make_causal_mask(jnp.ones((2, 6)))
  variables = mha.init(jax.random.key(1), x)
  y, state = mha.apply(variables, x, mask=mask, sow_weights=True, mutable=["intermediates"])
  np.testing.assert_allclose(y, plain.apply(variables, x, mask=mask), rtol=1e-6)
  assert "attention_weights" not in str(jax.tree_util.tree_structure(state))
  got = stablejax.collect_attention_logits(state)[""]
  p = variables["params"]
  q = jnp.einsum("btd,dhk->bthk", x, p["query"]["kernel"]) + p["query"]["bias"]
  k = jnp.einsum("btd,dhk->bthk", x, p["key"]["kernel"]) + p["key"]["bias"]
  np.testing.assert_allclose(got, _np_max_logit(q, k), rtol=1e-5)
  # Without sow_weights nothing is sown.
  _, none = mha.apply(variables, x, mask=mask, mutable=["intermediates"])
  assert stablejax.collect_attention_logits(none) == {}


def test_nnx_mha_wrapper_in_a_model_keys_by_module_path():
  class Model(nnx.Module):
    def __init__(self, rngs):
      self.blocks = nnx.List([nnx.MultiHeadAttention(
          num_heads=2, in_features=8, qkv_features=8, decode=False, rngs=rngs,
          attention_fn=stablejax.sow_attention_logits(nnx.dot_product_attention))
          for _ in range(2)])

    def __call__(self, x):
      for block in self.blocks:
        x = block(x, sow_weights=True, is_causal=True)
      return x

  model = Model(nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(2), (1, 5, 8)) * 3
  with warnings.catch_warnings():
    warnings.simplefilter("error")   # no DeprecationWarning of Module.sow outside nnx.capture
    _, intermediates = nnx.capture(lambda model, x: model(x), nnx.Intermediate)(model, x)
  got = stablejax.collect_attention_logits(intermediates)
  assert sorted(got) == ["blocks/0", "blocks/1"]
  block = model.blocks[0]
  q = block.query(x)
  k = block.key(x)
  np.testing.assert_allclose(got["blocks/0"], _np_max_logit(q, k), rtol=1e-5)
  # Outside nnx.capture the layer sows nothing and says how to collect the values, once.
  stablejax.modeling.attention._warned_outside_capture.clear()
  with pytest.warns(UserWarning, match="outside nnx.capture sows nothing"):
    model(x)
  assert stablejax.collect_attention_logits(nnx.state(model, nnx.Intermediate)) == {}
