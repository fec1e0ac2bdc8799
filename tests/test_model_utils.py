"""Tests for stablejax.modeling.utils against numpy re-derivations and hand-computed values."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stablejax
from stablejax.modeling.utils import (excess_kurtosis, init_new_token_embeddings, lambda_warmup,
                                   merge_emb_proj, quantize_weights_rtn)
from stablejax.modeling.gpt import GPT, ModelConfig
from helpers import gpt_params

CFG = ModelConfig(vocab_size=48, d_model=32, n_layers=1, n_heads=4, max_seq_len=8,
                  scan_layers=False, compute_dtype="float32", qk_norm=False)


def _params(cfg, seed=0):
  """Parameters of the GPT's layout for ``cfg`` (jax.eval_shape of its init) drawn in numpy:
  norm gains 1, the rest normal of the init's std. What these tests check holds for any
  parameters; compiling an init program per config costs seconds."""
  rng = np.random.default_rng(seed)
  return jax.tree_util.tree_map_with_path(
      lambda path, leaf: jnp.ones(leaf.shape, leaf.dtype) if "norm" in jax.tree_util.keystr(path)
      else jnp.asarray(rng.normal(0, cfg.init_std, leaf.shape), leaf.dtype),
      gpt_params(cfg, abstract=True))


def test_public_names_exported():
  for name in ("init_new_token_embeddings", "lambda_warmup", "excess_kurtosis", "merge_emb_proj",
               "quantize_weights_rtn"):
    assert getattr(stablejax, name) is globals()[name]


# ----------------------------------------------------------------------------- new tokens


def test_new_token_init_equals_vocab_mean():
  params = _params(CFG)
  new_ids = [5, 47]
  out = init_new_token_embeddings(params, new_ids)
  emb = np.asarray(params["tok_embed"]["embedding"])
  head = np.asarray(params["lm_head"]["kernel"])
  others = [i for i in range(48) if i not in new_ids]
  for i in new_ids:
    np.testing.assert_allclose(np.asarray(out["tok_embed"]["embedding"][i]),
                               emb[others].mean(0), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(out["lm_head"]["kernel"][:, i]),
                               head[:, others].mean(1), rtol=1e-5, atol=1e-7)
  # Other rows untouched; input not modified.
  np.testing.assert_array_equal(np.asarray(out["tok_embed"]["embedding"])[others], emb[others])
  np.testing.assert_array_equal(np.asarray(params["tok_embed"]["embedding"]), emb)
  # Wrapped trees and tied models work too.
  wrapped = init_new_token_embeddings({"params": params}, [3])
  assert "params" in wrapped and "tok_embed" in wrapped["params"]
  tied = _params(dataclasses.replace(CFG, tie_embeddings=True))
  out_t = init_new_token_embeddings(tied, [0])
  assert "lm_head" not in out_t


def test_new_token_init_errors():
  params = _params(CFG)
  with pytest.raises(ValueError, match="grow the embedding"):
    init_new_token_embeddings(params, [48])
  with pytest.raises(ValueError, match="empty"):
    init_new_token_embeddings(params, [])
  with pytest.raises(ValueError, match="whole vocabulary"):
    init_new_token_embeddings(params, list(range(48)))


# ----------------------------------------------------------------------------- lambda warmup


def test_lambda_warmup_values():
  lin = lambda_warmup(10, "linear")
  cos = lambda_warmup(10, "cosine")
  for step, want in [(0, 0.0), (1, 0.1), (5, 0.5), (10, 1.0), (25, 1.0)]:
    assert float(lin(step)) == pytest.approx(want, abs=1e-6)
  for step in (0, 2, 5, 7, 10, 40):
    want = 0.5 * (1.0 - math.cos(math.pi * min(step / 10, 1.0)))
    assert float(cos(step)) == pytest.approx(want, abs=1e-6)
  assert float(lambda_warmup(0)(0)) == 1.0
  # Traceable: the step can be a traced int.
  assert float(jax.jit(lin)(jnp.int32(3))) == pytest.approx(0.3, abs=1e-6)
  with pytest.raises(ValueError, match="schedule"):
    lambda_warmup(10, "exp")
  with pytest.raises(ValueError, match="non-negative"):
    lambda_warmup(-1)


# ----------------------------------------------------------------------------- kurtosis


def _np_excess_kurtosis(h):
  vals = []
  for layer in h:
    x = np.asarray(layer, np.float64).ravel()
    c = x - x.mean()
    vals.append(max(0.0, (c ** 4).mean() / (c ** 2).mean() ** 2 - 3.0))
  return float(np.mean(vals))


def test_kurtosis_gaussian_near_zero_and_outlier_large():
  rng = np.random.default_rng(0)
  gauss = rng.normal(size=(3, 4, 16, 64)).astype(np.float32)
  k = float(excess_kurtosis(gauss))
  assert abs(k) < 0.2
  planted = gauss.copy()
  planted[1, 0, 3, 7] = 200.0          # one massive activation in layer 1
  kp = float(excess_kurtosis(planted))
  assert kp > 100.0
  np.testing.assert_allclose(kp, _np_excess_kurtosis(planted), rtol=1e-3)
  # List input, and a uniform distribution (negative excess kurtosis) clips to 0.
  assert float(excess_kurtosis([planted[0], planted[1], planted[2]])) == pytest.approx(kp, rel=1e-4)
  assert float(excess_kurtosis(rng.uniform(size=(2, 1000)))) == 0.0



@pytest.mark.parametrize("peak", [5e9, 1e19, 3e38])
def test_kurtosis_is_finite_for_huge_finite_activations(peak):
  # The raw fourth moment overflows float32 from |x| ~ 4e9 (the logged kurtosis read inf on the
  # runs whose attention logits diverged); the standardised moments never do. Reference: float64
  # numpy on the same values (at 3e38 numpy's own fourth power overflows, so divide first).
  rng = np.random.default_rng(1)
  acts = rng.normal(size=(2, 8, 64)).astype(np.float32)
  acts[1, 3, 5] = np.float32(peak)
  acts[0] *= np.float32(peak / 1e3)          # a whole layer of large values
  got = np.asarray(excess_kurtosis(acts))
  assert np.isfinite(got)
  scaled = acts.astype(np.float64) / np.abs(acts.astype(np.float64)).max(axis=(1, 2), keepdims=True)
  np.testing.assert_allclose(float(got), _np_excess_kurtosis(scaled), rtol=1e-3)
  n = acts[1].size
  assert float(got) <= (n - 3) / 2 + 1e-3 * n  # layer 1 at most n - 3, layer 0 Gaussian (~0)

# ----------------------------------------------------------------------------- EmbProj merge


@pytest.mark.parametrize("opts", [dict(), dict(tie_embeddings=True, embed_scale=True,
                                               norm="ssnorm")])
def test_emb_proj_merge_identity(opts):
  cfg = dataclasses.replace(CFG, emb_proj=True, **opts)
  params = _params(cfg, seed=1)
  # Make the projections non-trivial (not near the identity, as the orthogonal init is).
  rng = np.random.default_rng(1)
  params = dict(params)
  for name in ("emb_proj_in", "emb_proj_out"):
    params[name] = {"kernel": params[name]["kernel"] + 0.3 * jnp.asarray(
        rng.normal(size=(32, 32)), jnp.float32)}
  merged, cfg2 = merge_emb_proj(params, cfg)
  assert not cfg2.emb_proj and not cfg2.tie_embeddings
  assert "emb_proj_in" not in merged and "emb_proj_out" not in merged
  assert merged["lm_head"]["kernel"].shape == (32, 48)
  tokens = jnp.asarray(rng.integers(0, 48, size=(2, 8)), jnp.int32)
  with jax.default_matmul_precision("highest"):  # each forward pass jitted: one program each
    a = jax.jit(lambda p, t: GPT(cfg).apply({"params": p}, t))(params, tokens)
    b = jax.jit(lambda p, t: GPT(cfg2).apply({"params": p}, t))(merged, tokens)
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)
  with pytest.raises(ValueError, match="emb_proj=True"):
    merge_emb_proj(merged, cfg2)


# ----------------------------------------------------------------------------- RTN quantisation


def _np_rtn(w, bits, axis):
  qmax = 2 ** (bits - 1) - 1
  scale = np.abs(w).max(axis=axis, keepdims=True) / qmax
  scale = np.where(scale > 0, scale, 1.0)
  return np.clip(np.round(w / scale), -qmax, qmax) * scale


def test_quantize_rtn_matches_numpy():
  rng = np.random.default_rng(2)
  tree = {
      "tok_embed": {"embedding": rng.normal(size=(10, 6)).astype(np.float32)},
      "blocks": {"q_proj": {"kernel": rng.normal(size=(2, 6, 5)).astype(np.float32)},
                 "norm": {"scale": rng.normal(size=(2, 6)).astype(np.float32)}},
      "final_norm": {"scale": rng.normal(size=(6,)).astype(np.float32)},
      "lm_head": {"kernel": rng.normal(size=(6, 10)).astype(np.float32)},
      "gain": np.float32(1.7),
  }
  tree["lm_head"]["kernel"][:, 3] = 0.0      # an all-zero channel stays zero
  for bits in (4, 8):
    q = quantize_weights_rtn(tree, bits=bits)
    np.testing.assert_allclose(np.asarray(q["blocks"]["q_proj"]["kernel"]),
                               _np_rtn(tree["blocks"]["q_proj"]["kernel"], bits, -2), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(q["lm_head"]["kernel"]),
                               _np_rtn(tree["lm_head"]["kernel"], bits, -2), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(q["tok_embed"]["embedding"]),
                               _np_rtn(tree["tok_embed"]["embedding"], bits, -1), rtol=1e-6)
    # Norm gains stay exact, also the stacked [L, D] ones of scanned models; so do scalars.
    np.testing.assert_array_equal(np.asarray(q["final_norm"]["scale"]),
                                  tree["final_norm"]["scale"])
    np.testing.assert_array_equal(np.asarray(q["blocks"]["norm"]["scale"]),
                                  tree["blocks"]["norm"]["scale"])
    assert float(q["gain"]) == pytest.approx(1.7)
  q4 = np.asarray(quantize_weights_rtn(tree, bits=4)["lm_head"]["kernel"])
  assert len(np.unique(q4[:, 0])) <= 15
  ex = quantize_weights_rtn(tree, bits=4, exclude=("lm_head",))
  np.testing.assert_array_equal(np.asarray(ex["lm_head"]["kernel"]), tree["lm_head"]["kernel"])
  with pytest.raises(ValueError, match="bits"):
    quantize_weights_rtn(tree, bits=1)
