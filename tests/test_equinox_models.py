"""stablejax on an Equinox GPT (examples/equinox_lm.py): real ``eqx.nn`` modules, blocks stacked
with ``eqx.filter_vmap`` and scanned over layers, ``[out, in]`` Linear weights.

Routing leaf by leaf against rules written from what each Equinox module is, the ``[out, in]``
width scale against ``optax.contrib.muon`` given the transposed dimension numbers, QK-clip on
``eqx.nn.MultiheadAttention`` bringing a head to ``tau`` on the next forward pass, the logits of
``mha_with_max_logit`` against a numpy re-derivation, and the README chain training.
"""

import math
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import stablejax

from helpers import load_example

equinox_lm = load_example("equinox_lm")

MDN = optax.contrib.MuonDimensionNumbers
D, H, L, T = 32, 4, 2, 16


@pytest.fixture(scope="module")
def model():
  return equinox_lm.GPT(64, D, H, L, T, jax.random.key(0))


def _flat(tree, is_leaf=None):
  return {"/".join(str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k))))
                   for k in path): leaf
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]}


def test_every_leaf_routed_with_out_in_weights(model):
  params = eqx.filter(model, eqx.is_array)
  labels = _flat(stablejax.label_params(params))
  dims = _flat(stablejax.muon_dimension_numbers(params),
               is_leaf=lambda x: x is None or isinstance(x, MDN))
  assert len(labels) == 17   # stacked blocks: attention 4, norms 4, MLP 4; embeddings, norm, head 5
  for path, label in labels.items():
    names = path.split("/")
    if names[-1] == "bias" or "norm" in names[-2]:
      want = "adam"
    elif names[0] in ("embed", "pos_embed"):
      want = "embedding"
    elif names[0] == "head":
      want = "head"
    else:
      want = "muon"   # attention projections and the MLP: eqx.nn.Linear, y = W x
    assert label == want, path
    if want == "muon":
      assert dims[path] == MDN(-1, -2), path
  with warnings.catch_warnings():
    warnings.simplefilter("error")   # nothing to warn about on a model it handles
    optax.chain(stablejax.outlier_safe_muon(2e-3), stablejax.qk_clip(30.0, num_heads=H)).init(
        params)


def test_out_in_width_scale_equals_optax_with_transposed_dims(model):
  params = eqx.filter(model, eqx.is_array)
  # numpy draws: a jax.random.normal per leaf shape would compile a program for each
  grads = jax.tree.map(lambda x: jnp.asarray(
      np.random.default_rng(x.size).standard_normal(x.shape), x.dtype), params)
  ours = stablejax.outlier_safe_muon(0.02, consistent_rms=None, adam_learning_rate=1e-3,
                                     outlier_method=None, ns_backend="xla")
  got = jax.jit(ours.update)(grads, ours.init(params), params)[0]
  up = {"w": grads.blocks.up.weight}                                # [L, 4D, D]: [out, in]
  ref = optax.contrib.muon(0.02, consistent_rms=None, eps=1e-8,
                           muon_weight_dimension_numbers=MDN(-1, -2))
  want = ref.update(up, ref.init(up), up)[0]["w"]
  np.testing.assert_allclose(got.blocks.up.weight, want, rtol=2e-4, atol=1e-7)


@eqx.filter_jit
def _with_and_without_max_logit(attn, x, causal):
  """``(mha_with_max_logit(attn, ...), attn(...))`` in one program (eagerly, each operation of
  the two calls compiles on its own)."""
  return stablejax.mha_with_max_logit(attn, x, x, x, causal), attn(x, x, x, causal)


def test_mha_with_max_logit_against_numpy(model):
  block = jax.tree.map(lambda x: np.asarray(x)[0] if eqx.is_array(x) else x, model.blocks)
  x = np.random.default_rng(1).standard_normal((T, D)).astype(np.float32)
  causal = np.tril(np.ones((T, T), bool))
  (out, max_logit), plain_out = _with_and_without_max_logit(block.attn, x, causal)
  np.testing.assert_allclose(out, plain_out, rtol=1e-6)
  q = (np.asarray(x) @ np.asarray(block.attn.query_proj.weight).T).reshape(T, H, -1)
  k = (np.asarray(x) @ np.asarray(block.attn.key_proj.weight).T).reshape(T, H, -1)
  logits = np.einsum("thd,shd->hts", q, k) / math.sqrt(D // H)
  want = np.where(np.asarray(causal), logits, -np.inf).max(axis=(1, 2))
  np.testing.assert_allclose(max_logit, want, rtol=1e-5)


def test_qk_clip_on_stacked_multihead_attention_brings_a_layer_to_tau(model):
  params, static = eqx.partition(model, eqx.is_array)
  layers = stablejax.layout.heads.find_attention_layers(params, num_heads=H)
  assert [(a.name, a.num_heads, a.stack_ndim, a.query[0].head_axis) for a in layers] == [
      ("blocks/attn", H, 1, -2)]
  tokens = jax.random.randint(jax.random.key(2), (3, T), 0, 64)

  @jax.jit  # one program for the three forward passes (eagerly, one per operation)
  def max_logits(params):
    return jax.vmap(eqx.combine(params, static))(tokens)[1].max(axis=0)   # [L, H]

  before = max_logits(params)
  tau = 0.5 * float(before.min())
  clip = optax.chain(optax.sgd(0.0), stablejax.qk_clip(tau, num_heads=H))
  zeros = jax.tree.map(jnp.zeros_like, params)
  # Layer 0 only (clipping it changes layer 1's input): its heads at tau exactly.
  only_first = before.at[1].set(0.0)
  updates, _ = clip.update(zeros, clip.init(params), params,
                           max_logits={"blocks/attn": only_first})
  after = max_logits(eqx.apply_updates(params, updates))
  np.testing.assert_allclose(after[0], np.minimum(before[0], tau), rtol=1e-4)
  # The last layer only: layer 0 untouched, layer 1 at tau.
  updates, _ = clip.update(zeros, clip.init(params), params,
                           max_logits={"blocks/attn": before.at[0].set(0.0)})
  after = max_logits(eqx.apply_updates(params, updates))
  np.testing.assert_allclose(after[0], before[0], rtol=1e-6)
  np.testing.assert_allclose(after[1], np.minimum(before[1], tau), rtol=1e-4)
  with pytest.raises(ValueError, match="qk_clip: .*pass num_heads="):
    stablejax.qk_clip(tau).init(params)


@pytest.mark.slow
def test_readme_chain_with_qk_clip_trains_30_steps():
  losses = equinox_lm.train(steps=30, d_model=D, heads=H, layers=L, seq_len=T, batch_size=8,
                            tau=5.0, verbose=False)
  assert np.all(np.isfinite(losses)) and np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.5, losses
