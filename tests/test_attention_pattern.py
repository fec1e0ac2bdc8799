"""The attention pattern as a parameter of the shared attention (modeling/attention.py,
modeling/layers.py), checked against numpy, and the Mistral-style family built on it,
tests/plugins/mistral.py: its cached decoding equals its full forward pass, a token beyond the
window has no influence, a window as long as the sequence is Llama, and its logits equal Hugging
Face's ``FlaxMistralForCausalLM`` for the same weights."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import hf_init_and_logits, llama_params_from_hf, once_per_config

PLUGINS = Path(__file__).parent / "plugins"
V, D, H, K, L, T = 64, 32, 4, 2, 2, 12
# Inputs from numpy: a jax.random draw compiles a program per shape.
RNG = np.random.default_rng(0)


def _numpy_attention(q, k, v, keep):
  """Grouped-query attention over the kept keys, in float64: (out, per-head max logit)."""
  group = q.shape[2] // k.shape[2]
  k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
  logits = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(q.shape[-1])
  masked = np.where(keep, logits, -np.inf)
  probs = np.exp(masked - masked.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  return np.einsum("bhts,bshd->bthd", probs, v), masked.max(axis=(0, 2, 3))


@pytest.mark.parametrize("window,masked", [(None, False), (3, False), (None, True), (3, True)])
def test_each_attention_path_keeps_the_keys_the_pattern_keeps(window, masked):
  from stablejax.modeling.attention import (AttentionPattern, causal_attention,
                                           causal_attention_with_max_logit)
  rng = np.random.default_rng(0)
  q, k, v = (rng.normal(size=(2, 7, heads, 8)).astype(np.float32) for heads in (4, 2, 2))
  mask = (lambda qp, kp: (qp + kp) % 3 != 1) if masked else None  # any function of positions
  pattern = AttentionPattern(window=window, mask=mask)
  i, j = np.arange(7)[:, None], np.arange(7)[None, :]
  keep = (j <= i) & ((j > i - window) if window else True) & (((i + j) % 3 != 1) | (not masked))
  want, want_max = _numpy_attention(*(np.asarray(x, np.float64) for x in (q, k, v)), keep)
  # Each path jitted as the model calls it (one program per path, not one per operation).
  np.testing.assert_allclose(jax.jit(lambda *a: causal_attention(*a, pattern))(q, k, v), want,
                             atol=2e-5)
  got, got_max = jax.jit(lambda *a: causal_attention_with_max_logit(*a, pattern))(q, k, v)
  np.testing.assert_allclose(got, want, atol=2e-5)
  np.testing.assert_allclose(got_max, want_max, atol=2e-5)


@pytest.fixture(scope="module")
def mistral():
  from stablejax.modeling import family
  from stablejax.training import plugins
  (module,) = plugins.load([str(PLUGINS / "mistral.py")])
  yield module
  family.unregister("mistral")


def _model(name: str, **keys):
  from stablejax.modeling import family
  section = family.section_class(family.get(name))(
      vocab_size=V, d_model=D, n_layers=L, n_heads=H, n_kv_heads=K, max_seq_len=16, **keys)
  section.validate()
  return family.build(section)


@pytest.fixture(scope="module")
def params():
  """Llama's parameters (Mistral's are the same names and shapes, the same init), scaled up for
  peaked attention: initialised once for the module."""
  model = _model("llama")

  @jax.jit
  def init(key, tokens):
    return jax.tree.map(lambda p: p * 8.0 if p.ndim > 1 else p, model.init(key, tokens))
  return init(jax.random.key(3), jnp.zeros((1, T), jnp.int32))


@once_per_config
def _logits(name: str, **keys):
  """The jitted forward pass of ``_model(name, **keys)`` (one program per model and shape)."""
  return jax.jit(_model(name, **keys).logits)


def _tokens(b: int) -> np.ndarray:
  return RNG.integers(0, V, (b, T)).astype(np.int32)


def _dilated():
  """Llama whose queries attend to the keys an even number of positions back: a mask function
  (the query's own position always kept)."""
  from stablejax.modeling.attention import AttentionPattern
  from stablejax.modeling.llama import LlamaModel
  section = _model("llama").config
  return LlamaModel(section, pattern=AttentionPattern(mask=lambda q, k: (q - k) % 2 == 0))


@pytest.mark.parametrize("pattern", ["window", "mask"])
def test_cached_decoding_equals_the_full_forward_pass(mistral, params, pattern):
  model = _model("mistral", sliding_window=3) if pattern == "window" else _dilated()
  tokens = _tokens(2)
  # Each call jitted, as the trainer and the sampler run them: one program each, not one per
  # operation (the decoding steps share theirs).
  full = np.asarray(jax.jit(model.logits)(params, tokens, 0))
  first, cache = jax.jit(model.decode_start)(params, tokens[:, :4], 0)
  steps = [np.asarray(first)]
  decode_next = jax.jit(model.decode_next)
  for i in range(4, T):  # past the window: the cache's old keys must be left out
    logits, cache = decode_next(params, cache, tokens[:, i:i + 1], 0)
    steps.append(np.asarray(logits))
  np.testing.assert_allclose(np.concatenate(steps, axis=1), full, rtol=0,
                             atol=1e-5 * np.abs(full).max())
  # The max-logit path masks alike: its logits are the forward pass's.
  with_attention, _ = jax.jit(model.logits_and_attention)(params, tokens, 0)
  np.testing.assert_allclose(with_attention, full, rtol=0, atol=1e-5 * np.abs(full).max())
  # The pattern changes the logits (else the checks above would hold for any pattern).
  plain = np.asarray(_logits("llama")(params, tokens, 0))
  assert np.abs(plain - full).max() > 1e-3


def test_a_token_beyond_the_window_has_no_influence(mistral, params):
  model = _model("mistral", sliding_window=3)
  tokens = _tokens(1)
  changed = tokens.copy()
  changed[0, 0] = (tokens[0, 0] + 1) % V
  logits = _logits("mistral", sliding_window=3)
  before, after = (np.asarray(logits(params, t, 0))[0] for t in (tokens, changed))
  # Each layer reaches 3 positions back, two layers 6: position 6 sees token 0, position 7 not.
  reach = L * 3
  assert np.abs(after[reach] - before[reach]).max() > 1e-3
  np.testing.assert_allclose(after[reach + 1:], before[reach + 1:], rtol=0, atol=1e-6)
  # Without the window (Llama, the same parameters) every later position sees token 0.
  llama = _logits("llama")
  full_before, full_after = (np.asarray(llama(params, t, 0))[0] for t in (tokens, changed))
  assert np.abs(full_after[-1] - full_before[-1]).max() > 1e-3
  assert "sliding window 3" in model.describe()


def test_a_window_as_long_as_the_sequence_is_llama(mistral, params):
  model, llama = _logits("mistral", sliding_window=T - 1), _logits("llama")
  tokens = _tokens(2)
  np.testing.assert_array_equal(model(params, tokens, 0), llama(params, tokens, 0))
  shorter = _logits("mistral", sliding_window=T - 2)
  assert not np.array_equal(shorter(params, tokens, 0), llama(params, tokens, 0))


def test_logits_equal_hugging_face_mistral_for_the_same_weights(mistral):
  transformers = pytest.importorskip("transformers")
  hf = transformers.FlaxMistralForCausalLM(transformers.MistralConfig(
      vocab_size=V, hidden_size=D, intermediate_size=48, num_hidden_layers=L,
      num_attention_heads=H, num_key_value_heads=K, max_position_embeddings=16,
      rms_norm_eps=1e-5, sliding_window=3, tie_word_embeddings=False), _do_init=False)
  hf_params, hf_logits = hf_init_and_logits(hf)
  params = llama_params_from_hf(hf_params, L)
  tokens = _tokens(2)
  theirs = np.asarray(hf_logits(hf_params, tokens))
  keys = dict(d_ff=48, qk_norm=False, norm_eps=1e-5)
  got = np.asarray(_logits("mistral", sliding_window=3, **keys)(params, tokens, 0))
  np.testing.assert_allclose(got, theirs, rtol=0, atol=2e-6 * np.abs(theirs).max() + 1e-6)
  wider = _logits("mistral", sliding_window=5, **keys)
  assert np.abs(np.asarray(wider(params, tokens, 0)) - theirs).max() > 1e-4
