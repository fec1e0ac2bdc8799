"""KV-cache generation against full recomputation, sampling rules, and the sample CLI."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stablejax.training.generate import Generator, greedy_reference, sample_logits
from stablejax.training.model import GPT, ModelConfig

BASE = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=2, max_seq_len=32,
            compute_dtype="float32", init_std=0.2)
VARIANTS = {
    "scan": {},
    "unscanned_qknorm_tied": dict(scan_layers=False, qk_norm=True, tie_embeddings=True),
    "ssnorm_embproj_remat": dict(norm="ssnorm", emb_proj=True, remat=True),
}


def init(cfg: ModelConfig, seed: int = 1):
  return GPT(cfg).init(jax.random.key(seed), jnp.zeros((1, 8), jnp.int32))["params"]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_kv_cache_equals_full_recomputation(variant):
  cfg = ModelConfig(**BASE, **VARIANTS[variant])
  params = init(cfg)
  prompt = [3, 5, 7, 11, 13]
  ref_tokens, ref_logits = greedy_reference(cfg, params, prompt, 20)
  got = Generator(cfg).generate(params, prompt, 20, temperature=0.0)[0].tolist()
  assert got == ref_tokens
  assert len(set(ref_tokens)) > 2  # a model that repeats one token would prove little
  # Logits of each cached step equal the full forward pass at that position.
  model = GPT(cfg)
  prefill = jax.jit(lambda p, t: model.apply({"params": p}, t, decode=True, mutable=["cache"]))
  step = jax.jit(lambda p, c, t: model.apply({"params": p, "cache": c}, t, decode=True,
                                             mutable=["cache"]))
  logits, variables = prefill(params, jnp.asarray([prompt]))
  np.testing.assert_allclose(logits[0, -1], ref_logits[0], rtol=1e-4, atol=1e-4)
  cache = variables["cache"]
  for i, token in enumerate(ref_tokens[:-1]):
    logits, variables = step(params, cache, jnp.asarray([[token]]))
    cache = variables["cache"]
    np.testing.assert_allclose(logits[0, -1], ref_logits[i + 1], rtol=1e-4, atol=1e-4)


def test_sampling_is_deterministic_for_a_seed():
  cfg = ModelConfig(**BASE)
  params = init(cfg)
  gen = Generator(cfg, top_k=10)
  a = gen.generate(params, [1, 2, 3], 24, temperature=0.8, seed=7, num_samples=3)
  b = Generator(cfg, top_k=10).generate(params, [1, 2, 3], 24, temperature=0.8, seed=7,
                                        num_samples=3)
  c = gen.generate(params, [1, 2, 3], 24, temperature=0.8, seed=8, num_samples=3)
  assert a.shape == (3, 24) and a.dtype == np.int32
  assert np.array_equal(a, b)
  assert not np.array_equal(a, c)
  assert not np.array_equal(a[0], a[1])  # samples of one call differ from each other


def test_top_k_1_is_greedy_and_padding_ids_are_never_drawn():
  cfg = ModelConfig(**BASE)
  params = init(cfg)
  greedy = Generator(cfg).generate(params, [4, 9], 16, temperature=0.0)
  top1 = Generator(cfg, top_k=1).generate(params, [4, 9], 16, temperature=1.5, seed=3)
  assert np.array_equal(greedy, top1)
  drawn = Generator(cfg, valid_vocab=10).generate(params, [4, 9], 64, temperature=5.0, seed=0,
                                                  num_samples=4)
  assert drawn.max() < 10 and len(np.unique(drawn)) > 3


def test_sample_logits_top_k_matches_numpy():
  logits = jax.random.normal(jax.random.key(0), (1, 50))
  allowed = set(np.argsort(-np.asarray(logits[0]))[:5].tolist())
  drawn = {int(sample_logits(logits, jax.random.key(i), 1.0, 5, 50)[0]) for i in range(200)}
  assert drawn <= allowed and len(drawn) >= 3


def test_generation_past_the_context_window():
  cfg = ModelConfig(**BASE)
  params = init(cfg)
  prompt = list(range(1, 41))  # longer than max_seq_len: its last 31 tokens are kept
  out = Generator(cfg).generate(params, prompt, 50, temperature=0.0)[0].tolist()
  assert len(out) == 50
  ref, _ = greedy_reference(cfg, params, prompt[-31:], 1)
  assert out[0] == ref[0]
  # After the first token the cache is full; the last 16 tokens are prefilled and greedy
  # decoding continues from that context.
  ref2, _ = greedy_reference(cfg, params, (prompt[-31:] + out[:1])[-16:], 5)
  assert out[1:6] == ref2


def test_sample_cli_errors(tmp_path, capsys):
  from stablejax.cli import sample as sample_cli
  from stablejax.training import runs
  assert sample_cli.main([str(tmp_path / "missing")]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "does not exist" in err[0]
  assert sample_cli.main([str(tmp_path), "--top-k", "-1"]) == 2
  (tmp_path / "config.json").write_text('{"data": {"train": "x.bin"}}')
  from stablejax.training.config import load_config
  with pytest.raises(runs.RunError, match="--tokenizer"):
    runs.run_tokenizer(load_config(tmp_path / "config.json"))
