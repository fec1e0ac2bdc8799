"""The ``llama`` model family: logits equal Hugging Face's ``FlaxLlamaForCausalLM`` for the same
weights, its cached decoding equals full recomputation, and ``model.family=llama`` trains (with
grouped-query attention and QK-clip), samples and resumes through the trainer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import (hf_init_and_logits, llama_params_from_hf, optax_lr, read_metrics,
                     run_inprocess, slow, tiny_config)

V, D, H, K, L, F = 64, 32, 4, 2, 2, 48


def _hf_and_ours(scan_layers: bool, tie: bool = False):
  transformers = pytest.importorskip("transformers")
  from stablejax.modeling.llama import Llama, LlamaConfig
  hf_cfg = transformers.LlamaConfig(
      vocab_size=V, hidden_size=D, intermediate_size=F, num_hidden_layers=L,
      num_attention_heads=H, num_key_value_heads=K, max_position_embeddings=32,
      rms_norm_eps=1e-5, tie_word_embeddings=False)
  hf_params, hf_logits = hf_init_and_logits(
      transformers.FlaxLlamaForCausalLM(hf_cfg, _do_init=False))
  params = llama_params_from_hf(hf_params, L, scan_layers)
  cfg = LlamaConfig(vocab_size=V, d_model=D, n_layers=L, n_heads=H, n_kv_heads=K, d_ff=F,
                    max_seq_len=32, qk_norm=False, norm_eps=1e-5, scan_layers=scan_layers)
  return hf_params, hf_logits, Llama(cfg), params


@pytest.mark.parametrize("scan_layers", [True, False])
def test_logits_equal_hugging_face_llama_for_the_same_weights(scan_layers):
  hf_params, hf_logits, ours, params = _hf_and_ours(scan_layers)
  tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, V)
  # Each forward pass jitted, as a training step would run it.
  theirs = np.asarray(hf_logits(hf_params, tokens))
  got = np.asarray(jax.jit(ours.apply)({"params": params}, tokens))
  np.testing.assert_allclose(got, theirs, rtol=0, atol=2e-6 * np.abs(theirs).max() + 1e-6)


def test_cached_decoding_equals_full_recomputation():
  from stablejax.modeling import family
  from stablejax.training.trained.decoding import Generator, greedy_reference
  section = family.section_class(family.get("llama"))(
      vocab_size=V, d_model=D, n_layers=L, n_heads=H, n_kv_heads=1, max_seq_len=16)
  model = family.build(section)
  params = jax.jit(model.init)(jax.random.key(3), jnp.zeros((1, 8), jnp.int32))
  params = jax.tree.map(lambda p: p * 8.0 if p.ndim > 1 else p, params)  # peaked, not uniform
  want, _ = greedy_reference(model, params, [3, 1, 4], 12)
  got = Generator(model).generate(params, [3, 1, 4], 12, temperature=0.0)[0].tolist()
  assert got == want


def test_grouped_query_attention_needs_a_divisor():
  from stablejax.training.config import ConfigError, load_config
  with pytest.raises(ConfigError, match=r"model.n_kv_heads=3 must divide model.n_heads=4 .* "
                                        r"use one of \[1, 2, 4\]"):
    load_config(None, ["model.family=llama", "model.n_heads=4", "model.n_kv_heads=3"])


@slow
def test_the_llama_family_trains_samples_and_resumes(tmp_path):
  from stablejax.training.trained.sampling import sample
  out = tmp_path / "llama"
  llama = ("model.family=llama", "model.n_kv_heads=1", "stability.qk_clip.enabled=true",
           "stability.qk_clip.tau=5", "train.eval_every=50", "checkpoint.every=4")
  assert run_inprocess(out, "train.steps=8", *llama) == 0
  records = [r for r in read_metrics(out) if "loss" in r and "event" not in r]
  assert records[-1]["loss"] < records[0]["loss"]
  # QK-clip on grouped-query attention: per query head, the shared key heads left alone.
  assert all(r["qk_clip/max_logit"] > 0 for r in records) and "attn_logit_max" in records[0]
  result = sample(out, "def ", max_new_tokens=6, temperature=0.0)
  assert result["step"] == 8 and len(result["tokens"][0]) == 6
  assert run_inprocess(out, "train.steps=12", *llama, fresh=False) == 0
  assert max(r["step"] for r in read_metrics(out) if "loss" in r) == 12
  # The resumed steps decay over the run's new length (no skipped step: update k is step k + 1),
  # with the programs the first start compiled.
  longer = tiny_config("train.steps=12", *llama)
  resumed = [r for r in read_metrics(out) if "lr" in r and "event" not in r and r["step"] > 8]
  assert resumed and all(r["skip_nonfinite/skipped"] is False for r in resumed)
  for r in resumed:
    assert r["lr"] == pytest.approx(optax_lr(longer, r["step"] - 1), rel=1e-5)
