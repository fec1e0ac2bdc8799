"""Sampling from a trained GPT with a KV cache: one jitted prefill + ``lax.scan`` of decode steps.

``Generator(model_cfg).generate(params, prompt_ids, n_new, ...)`` returns the new token ids. The
prompt is processed once (prefill); each new token then costs one forward pass of one position
against the cached keys and values (``GPT(..., decode=True)``). Sampling: logits / temperature,
restricted to the ``top_k`` largest (0: all), ids at or above ``valid_vocab`` (padding rows of the
embedding) never drawn; ``temperature=0`` is greedy. The same seed gives the same tokens.

The context window is ``W = model.max_seq_len`` tokens, all of them used: while prompt and
generated tokens fit in ``W`` (each new token drawn from at most ``W`` tokens of context), the
cached decoder gives what full recomputation over the whole sequence gives. Past the window
(the re-prefill policy): the prompt keeps its last ``W`` tokens; once the next token would need
``W + 1`` tokens of context, the last ``W // 2`` tokens are prefilled into a fresh cache and
decoding continues from there, so every token past the window is drawn from between ``W // 2``
and ``W`` tokens of context (a re-prefill every ``W - W // 2 + 1`` tokens, not one per token).

Example::

    gen = Generator(cfg.model)
    ids = gen.generate(params, tok.encode("def "), 100, temperature=0.8, top_k=50, seed=0)
    print(tok.decode(ids))
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from stablejax.modeling.gpt import GPT, ModelConfig

if TYPE_CHECKING:
  from stablejax.data.tokenizer import Tokenizer


def sample_logits(logits: jax.Array, rng: jax.Array, temperature: float | jax.Array, top_k: int,
                  valid_vocab: int) -> jax.Array:
  """Next token ids ``[B]`` from float32 logits ``[B, V]``."""
  vocab = logits.shape[-1]
  if valid_vocab < vocab:
    logits = jnp.where(jnp.arange(vocab) < valid_vocab, logits, -jnp.inf)
  if 0 < top_k < vocab:
    kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  greedy = jnp.argmax(logits, axis=-1)
  drawn = jax.random.categorical(rng, logits / jnp.maximum(temperature, 1e-6), axis=-1)
  return jnp.where(temperature > 0, drawn, greedy).astype(jnp.int32)


class Generator:
  """Jitted KV-cache generation for one model config (compiled once per prompt/segment shape)."""

  def __init__(self, model_cfg: ModelConfig, top_k: int = 0, valid_vocab: Optional[int] = None):
    self.cfg = model_cfg
    self.top_k = int(top_k)
    self.valid_vocab = int(valid_vocab or model_cfg.vocab_size)
    self._segment = _segment_fn(json.dumps(dataclasses.asdict(model_cfg), sort_keys=True),
                                self.top_k, self.valid_vocab)

  def generate(self, params: Any, prompt_ids: Sequence[int], n_new: int, *,
               temperature: float = 0.8, seed: int = 0, bitnet_lambda: float = 1.0,
               num_samples: int = 1) -> np.ndarray:
    """``n_new`` tokens after ``prompt_ids`` (a non-empty list), ``[num_samples, n_new]`` int32.

    Past the context window the module's re-prefill policy applies: the last ``W`` prompt
    tokens, then a fresh cache from the last ``W // 2`` tokens whenever the window is full.
    """
    window = self.cfg.max_seq_len
    if not prompt_ids:
      raise ValueError("the prompt has no tokens: give at least one (e.g. the end-of-text id)")
    if n_new < 1:
      return np.zeros((num_samples, 0), np.int32)
    context = np.asarray(list(prompt_ids)[-window:], np.int32)
    context = np.broadcast_to(context, (num_samples, context.size))
    rng = jax.random.key(seed)
    out = []
    remaining = n_new
    while remaining:
      # Prefill P tokens, then W - P decode steps fill the cache: W - P + 1 tokens, the last one
      # drawn from all W cached positions.
      n = min(remaining, window - context.shape[1] + 1)
      rng, sub = jax.random.split(rng)
      new = np.asarray(self._segment(params, jnp.asarray(context), sub, jnp.float32(temperature),
                                     jnp.float32(bitnet_lambda), n_new=n))
      out.append(new)
      remaining -= n
      context = np.concatenate([context, new], axis=1)[:, -(window // 2):]
    return np.concatenate(out, axis=1)


@functools.lru_cache(maxsize=8)
def _segment_fn(model_cfg_json: str, top_k: int, valid_vocab: int) -> Callable[..., Any]:
  """The jitted segment for one model config (cached, so repeated samplers compile once)."""
  cfg = ModelConfig(**json.loads(model_cfg_json))
  model = GPT(cfg)

  def segment(params: Any, prompt: jax.Array, rng: jax.Array, temperature: jax.Array,
              lam: jax.Array, n_new: int) -> jax.Array:
    """Prefill ``prompt`` [B, P] into a fresh cache, then draw ``n_new`` tokens."""
    kwargs: dict[str, Any] = {"bitnet_lambda": lam} if cfg.bitnet else {}
    logits, variables = model.apply({"params": params}, prompt, decode=True, mutable=["cache"],
                                    **kwargs)
    rngs = jax.random.split(rng, n_new)
    first = sample_logits(logits[:, -1], rngs[0], temperature, top_k, valid_vocab)

    def step(carry: tuple[Any, jax.Array], rng_i: jax.Array
             ) -> tuple[tuple[Any, jax.Array], jax.Array]:
      cache, token = carry
      logits, variables = model.apply({"params": params, "cache": cache}, token[:, None],
                                      decode=True, mutable=["cache"], **kwargs)
      nxt = sample_logits(logits[:, -1], rng_i, temperature, top_k, valid_vocab)
      return (variables["cache"], nxt), token

    (_, last), tokens = jax.lax.scan(step, (variables["cache"], first), rngs[1:])
    return jnp.concatenate([tokens, last[None]], axis=0).T  # [B, n_new]

  return jax.jit(segment, static_argnames=("n_new",))


@functools.lru_cache(maxsize=8)
def _forward_fn(model_cfg_json: str) -> Callable[..., Any]:
  """The jitted full forward pass of one model config (cached: one compilation per shape)."""
  model = GPT(ModelConfig(**json.loads(model_cfg_json)))
  return jax.jit(model.apply)


def greedy_reference(model_cfg: ModelConfig, params: Any, prompt_ids: Sequence[int], n_new: int,
                     valid_vocab: Optional[int] = None) -> tuple[list[int], list[np.ndarray]]:
  """Greedy decoding by full recomputation (no cache), for tests: (tokens, last-position logits).

  Each step runs the whole sequence, right-padded to ``max_seq_len`` (causal attention: the
  padding cannot change earlier positions) so that one compilation serves every step.
  """
  apply = _forward_fn(json.dumps(dataclasses.asdict(model_cfg), sort_keys=True))
  ids, all_logits = list(prompt_ids), []
  vocab = valid_vocab or model_cfg.vocab_size
  if len(ids) + n_new - 1 > model_cfg.max_seq_len:
    raise ValueError("the reference decodes within one context window")
  for _ in range(n_new):
    padded = np.zeros((1, model_cfg.max_seq_len), np.int32)
    padded[0, :len(ids)] = ids
    logits = np.asarray(apply({"params": params}, jnp.asarray(padded)))[0, len(ids) - 1]
    all_logits.append(logits)
    ids.append(int(np.argmax(logits[:vocab])))
  return ids[len(prompt_ids):], all_logits


class EvalSampler:
  """The trainer's sample at each eval: a fixed prompt, seed and length, decoded to text."""

  def __init__(self, model_cfg: ModelConfig, tok: Tokenizer, prompt: str, n_tokens: int, seed: int,
               bitnet_lambda: Optional[Callable[[int], Any]] = None, temperature: float = 0.8,
               top_k: int = 50):
    self.tok = tok
    self.prompt = prompt
    self.prompt_ids = (tok.encode(prompt) if prompt else []) or list(tok.start_ids)
    self.n_tokens, self.seed, self.temperature = n_tokens, seed, temperature
    self.bitnet_lambda = bitnet_lambda
    self.gen = Generator(model_cfg, top_k=top_k, valid_vocab=tok.vocab_size)

  def __call__(self, params: Any, step: int) -> str:
    lam = float(self.bitnet_lambda(step)) if self.bitnet_lambda is not None else 1.0
    ids = self.gen.generate(params, self.prompt_ids, self.n_tokens, temperature=self.temperature,
                            seed=self.seed, bitnet_lambda=lam)[0]
    return self.prompt + self.tok.decode(ids.tolist())
