"""Sampling from a trained model: with a KV cache (one jitted prefill + ``lax.scan`` of decode
steps) where the family offers decoding, else by re-running the model on the growing context.

``Generator(model).generate(params, prompt_ids, n_new, ...)`` returns the new token ids, for any
model family (``model`` may also be a ``model`` config section). A family that offers decoding
(:meth:`stablejax.modeling.family.LanguageModel.decode_start` and ``decode_next``) processes the
prompt once (prefill); each new token then costs one forward pass of one position against the
cached keys and values. A family with nothing but its forward pass (a user's model declared
through ``--plugin``) re-runs the model on the whole context for each token, as nanoGPT's
``generate`` does: the context right-padded to the window, one compilation for every step, the
logits read at its last real position (a causal model: the padding cannot change them).
Sampling: logits / temperature, restricted to the ``top_k`` largest (0: all), ids at or above
``valid_vocab`` (padding rows of the embedding) never drawn; ``temperature=0`` is greedy. The same
seed gives the same tokens, and within the window both ways give the same tokens for a model
that has both (to the rounding of their logits).

The context window is ``W = model.max_seq_len`` tokens, all of them used: while prompt and
generated tokens fit in ``W`` (each new token drawn from at most ``W`` tokens of context), the
cached decoder gives what full recomputation over the whole sequence gives. Past the window the
prompt keeps its last ``W`` tokens; then the cached decoder re-prefills: once the next token
would need ``W + 1`` tokens of context, the last ``W // 2`` tokens are prefilled into a fresh
cache and decoding continues from there, so every token past the window is drawn from between
``W // 2`` and ``W`` tokens of context (a re-prefill every ``W - W // 2 + 1`` tokens, not one per
token). Re-running the model, each token past the window is drawn from the last ``W`` tokens
(nanoGPT's crop).

Example::

    gen = Generator(cfg.model)   # or a LanguageModel
    ids = gen.generate(params, tok.encode("def "), 100, temperature=0.8, top_k=50, seed=0)
    print(tok.decode(ids))
"""

from __future__ import annotations

import optax
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from stablejax.modeling import family as family_lib
from stablejax.modeling.family import LanguageModel

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


def as_model(model: Any) -> LanguageModel:
  """``model`` itself, or the :class:`LanguageModel` of a ``model`` config section."""
  return model if isinstance(model, LanguageModel) else family_lib.build(model)


# How a Generator decodes, as the trainer's banner and ``python -m stablejax sample`` say it.
KV_CACHE = "KV cache"
RECOMPUTE = "no KV cache: the model re-runs on the growing context for each token"


class Generator:
  """Jitted generation for one model (compiled once per prompt/segment shape): with a KV cache
  where the family offers decoding, else by re-running the model on the growing context
  (:attr:`method` says which)."""

  def __init__(self, model: Any, top_k: int = 0, valid_vocab: Optional[int] = None):
    self.model = as_model(model)
    self.top_k = int(top_k)
    self.valid_vocab = int(valid_vocab or self.model.vocab_size)
    self.cached = self.model.supports("decoding")
    self.method = KV_CACHE if self.cached else RECOMPUTE
    self._segment = (_segment_fn if self.cached else _recompute_fn)(
        self.model, self.top_k, self.valid_vocab)

  def generate(self, params: optax.Params, prompt_ids: Sequence[int], n_new: int, *,
               temperature: float = 0.8, seed: int = 0, step: int = 0,
               num_samples: int = 1) -> np.ndarray:
    """``n_new`` tokens after ``prompt_ids`` (a non-empty list), ``[num_samples, n_new]`` int32.

    ``step`` is the training step of ``params`` (a BitNet model's quantisation strength follows
    it). Past the context window the module's policies apply: the last ``W`` prompt tokens,
    then (KV cache) a fresh cache from the last ``W // 2`` tokens whenever the window is full, or
    (re-running the model) the last ``W`` tokens for each token.
    """
    window = self.model.max_seq_len
    if not prompt_ids:
      raise ValueError("the prompt has no tokens: give at least one (e.g. the end-of-text id)")
    if n_new < 1:
      return np.zeros((num_samples, 0), np.int32)
    context = np.asarray(list(prompt_ids)[-window:], np.int32)
    context = np.broadcast_to(context, (num_samples, context.size))
    rng = jax.random.key(seed)
    if not self.cached:
      rng, sub = jax.random.split(rng)  # the first segment's key of the cached decoder
      padded = np.zeros((num_samples, window), np.int32)
      padded[:, :context.shape[1]] = context
      return np.asarray(self._segment(params, jnp.asarray(padded), jnp.int32(context.shape[1]),
                                      sub, jnp.float32(temperature), jnp.int32(step),
                                      n_new=n_new))
    out = []
    remaining = n_new
    while remaining:
      # Prefill P tokens, then W - P decode steps fill the cache: W - P + 1 tokens, the last one
      # drawn from all W cached positions.
      n = min(remaining, window - context.shape[1] + 1)
      rng, sub = jax.random.split(rng)
      new = np.asarray(self._segment(params, jnp.asarray(context), sub, jnp.float32(temperature),
                                     jnp.int32(step), n_new=n))
      out.append(new)
      remaining -= n
      context = np.concatenate([context, new], axis=1)[:, -(window // 2):]
    return np.concatenate(out, axis=1)


def _segment_fn(model: LanguageModel, top_k: int, valid_vocab: int) -> Callable[..., Any]:
  """The jitted segment for one model."""

  def segment(params: optax.Params, prompt: jax.Array, rng: jax.Array, temperature: jax.Array,
              step: jax.Array, n_new: int) -> jax.Array:
    """Prefill ``prompt`` [B, P] into a fresh cache, then draw ``n_new`` tokens."""
    logits, cache = model.decode_start(params, prompt, step)
    rngs = jax.random.split(rng, n_new)
    first = sample_logits(logits[:, -1], rngs[0], temperature, top_k, valid_vocab)

    def one(carry: tuple[Any, jax.Array], rng_i: jax.Array
            ) -> tuple[tuple[Any, jax.Array], jax.Array]:
      cache, token = carry
      logits, cache = model.decode_next(params, cache, token[:, None], step)
      nxt = sample_logits(logits[:, -1], rng_i, temperature, top_k, valid_vocab)
      return (cache, nxt), token

    (_, last), tokens = jax.lax.scan(one, (cache, first), rngs[1:])
    return jnp.concatenate([tokens, last[None]], axis=0).T  # [B, n_new]

  return jax.jit(segment, static_argnames=("n_new",))


def _recompute_fn(model: LanguageModel, top_k: int, valid_vocab: int) -> Callable[..., Any]:
  """The jitted generation of a model without decoding: each token from a forward pass over the
  whole context (``[B, W]``, right-padded; ``length`` real tokens), the next token written after
  the last (past the window: the context shifted left by one first)."""

  def generate(params: optax.Params, context: jax.Array, length: jax.Array, rng: jax.Array,
               temperature: jax.Array, step: jax.Array, n_new: int) -> jax.Array:
    window = context.shape[1]

    def one(carry: tuple[jax.Array, jax.Array], rng_i: jax.Array
            ) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
      context, length = carry
      logits = model.logits(params, context, step)                  # [B, W, V]
      last = jax.lax.dynamic_index_in_dim(logits, length - 1, axis=1, keepdims=False)
      token = sample_logits(last, rng_i, temperature, top_k, valid_vocab)
      full = length == window
      context = jnp.where(full, jnp.roll(context, -1, axis=1), context)
      context = jax.lax.dynamic_update_slice_in_dim(context, token[:, None],
                                                    jnp.minimum(length, window - 1), axis=1)
      return (context, jnp.minimum(length + 1, window)), token

    _, tokens = jax.lax.scan(one, (context, length), jax.random.split(rng, n_new))
    return tokens.T  # [B, n_new]

  return jax.jit(generate, static_argnames=("n_new",))


def greedy_reference(model: Any, params: optax.Params, prompt_ids: Sequence[int], n_new: int,
                     valid_vocab: Optional[int] = None) -> tuple[list[int], list[np.ndarray]]:
  """Greedy decoding by full recomputation (no cache), for tests: (tokens, last-position logits).

  Each step runs the whole sequence, right-padded to ``max_seq_len`` (causal attention: the
  padding cannot change earlier positions) so that one compilation serves every step.
  """
  lm = as_model(model)
  apply = jax.jit(lambda p, t: lm.logits(p, t, jnp.int32(0)))
  ids, all_logits = list(prompt_ids), []
  vocab = valid_vocab or lm.vocab_size
  if len(ids) + n_new - 1 > lm.max_seq_len:
    raise ValueError("the reference decodes within one context window")
  for _ in range(n_new):
    padded = np.zeros((1, lm.max_seq_len), np.int32)
    padded[0, :len(ids)] = ids
    logits = np.asarray(apply(params, jnp.asarray(padded)))[0, len(ids) - 1]
    all_logits.append(logits)
    ids.append(int(np.argmax(logits[:vocab])))
  return ids[len(prompt_ids):], all_logits


class EvalSampler:
  """The trainer's sample at each eval: a fixed prompt, seed and length, decoded to text."""

  def __init__(self, model: LanguageModel, tok: Tokenizer, prompt: str, n_tokens: int, seed: int,
               temperature: float = 0.8, top_k: int = 50):
    self.tok = tok
    self.prompt = prompt
    self.prompt_ids = (tok.encode(prompt) if prompt else []) or list(tok.start_ids)
    self.n_tokens, self.seed, self.temperature = n_tokens, seed, temperature
    self.gen = Generator(model, top_k=top_k, valid_vocab=tok.vocab_size)

  def __call__(self, params: optax.Params, step: int) -> str:
    ids = self.gen.generate(params, self.prompt_ids, self.n_tokens, temperature=self.temperature,
                            seed=self.seed, step=step)[0]
    return self.prompt + self.tok.decode(ids.tolist())
