"""Sampling speed: tokens/s of the KV-cache decoder against full recomputation, side by side.

    python -m bench.sample [--config default] [--new 100] [--rounds 5] [--quick]

Both generate greedily from a 16-token prompt with the same randomly initialised model (speed does
not depend on training) and must produce the same tokens. The KV-cache path is
``stablejax.training.trained.decoding.Generator`` (one jitted prefill + ``lax.scan`` of one-position
steps); the reference recomputes the whole context window for every new token inside one jitted
``lax.fori_loop`` (no host round trips either), as a decoder without a cache would. Timed
interleaved after compilation; medians printed.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench._common import interleaved, print_machine
from stablejax.training.config import load_config
from stablejax.training.trained.decoding import Generator
from stablejax.modeling.gpt import GPT, count_params


def recompute_fn(model, window: int, prompt_len: int, n_new: int):
  @jax.jit
  def run(params, buf):
    def body(i, buf):
      logits = model.apply({"params": params}, buf)
      nxt = jnp.argmax(logits[0, i - 1]).astype(jnp.int32)
      return buf.at[0, i].set(nxt)
    return jax.lax.fori_loop(prompt_len, prompt_len + n_new, body, buf)
  return run


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--config", default=str(Path(__file__).resolve().parent.parent / "configs"
                                         / "default.json"))
  p.add_argument("--new", type=int, default=100)
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--quick", action="store_true", help="32 tokens, 2 rounds")
  args = p.parse_args()
  if args.quick:
    args.new, args.rounds = 32, 2
  print_machine()
  cfg = load_config(args.config).model
  model = GPT(cfg)
  params = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
  prompt = list(range(1, 17))
  n = min(args.new, cfg.max_seq_len - len(prompt))
  print(f"model: {count_params(params) / 1e6:.2f}M parameters ({cfg.n_layers} layers, d_model "
        f"{cfg.d_model}, vocab {cfg.vocab_size}, window {cfg.max_seq_len}, {cfg.compute_dtype}); "
        f"prompt 16 tokens, {n} new tokens, greedy")

  gen = Generator(cfg)
  buf = np.zeros((1, cfg.max_seq_len), np.int32)
  buf[0, :len(prompt)] = prompt
  recompute = recompute_fn(model, cfg.max_seq_len, len(prompt), n)

  t0 = time.perf_counter()
  cached = gen.generate(params, prompt, n, temperature=0.0)[0]
  compile_cached = time.perf_counter() - t0
  t0 = time.perf_counter()
  full = np.asarray(recompute(params, jnp.asarray(buf)))[0, len(prompt):len(prompt) + n]
  compile_full = time.perf_counter() - t0
  assert np.array_equal(cached, full), "KV-cache and recomputed tokens differ"

  def time_cached():
    t = time.perf_counter()
    jax.block_until_ready(gen.generate(params, prompt, n, temperature=0.0))
    return time.perf_counter() - t

  def time_full():
    t = time.perf_counter()
    jax.block_until_ready(recompute(params, jnp.asarray(buf)))
    return time.perf_counter() - t

  times = interleaved({"kv_cache": time_cached, "recompute": time_full}, rounds=args.rounds,
                      warmup=1)
  med = {k: statistics.median(v) for k, v in times.items()}
  print(f"\n| decoder | tokens/s (median of {args.rounds}) | ms/token | compile s |")
  print("|---|---|---|---|")
  for name, comp in (("kv_cache", compile_cached), ("recompute", compile_full)):
    print(f"| {name} | {n / med[name]:,.0f} | {1000 * med[name] / n:.2f} | {comp:.1f} |")
  print(f"\nKV cache speed-up: {med['recompute'] / med['kv_cache']:.2f}x (same {n} tokens)")


if __name__ == "__main__":
  main()
