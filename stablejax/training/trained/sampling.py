"""Sample text from a trained run.

    python -m stablejax sample RUN_DIR --prompt "..." [--max-new-tokens 200] [--temperature 0.8]
                               [--top-k 50] [--seed 0] [--num-samples 1] [--tokenizer T]

(the command line is :mod:`stablejax.cli.sample`; this module is the library it runs,
:func:`sample`).

After nanoGPT's ``sample.py``. Reads ``RUN_DIR/config.json``, restores the parameters of the newest
usable checkpoint (the trainer's fingerprint rule; a damaged newest step falls back to the
previous one with a warning), encodes the prompt with the run's tokenizer (the one the trainer
recorded in ``RUN_DIR/tokenizer/``, with a copy of a Hugging Face ``tokenizer.json``; a missing
or changed copy is an error naming ``--tokenizer``; plain ``.bin`` data needs ``--tokenizer``),
generates with the jitted KV-cache decoder of ``stablejax.training.trained.decoding`` (a family
without decoding: re-running the model on the growing context, nanoGPT's way) and prints the
prompt and its continuation. An empty prompt starts a new document (the end-of-text token; a blank
line for byte-level text). The same seed gives the same text. ``--temperature 0`` is greedy.

A run trained before runs recorded their tokenizer falls back to the data paths in config.json,
read as they were given to the trainer: run it from where the run was started (or pass
``--tokenizer``); a path that does not resolve is an error, never a switch to another tokenizer.

Exit codes: 0 done; 2 missing run directory, config or usable checkpoint, unknown tokenizer, bad
arguments.

Example::

    python -m stablejax sample runs/pydoc_bpe --prompt "The with statement" --max-new-tokens 100
"""

from __future__ import annotations

import collections
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np

from stablejax.training.trained.run import (RunError, check_params, load_run_config, restore_params,
                                     run_tokenizer)

if TYPE_CHECKING:
  from stablejax.training.trained.decoding import Generator

SampleError = RunError  # one error type for an unusable run (stablejax.training.trained.run)

# The generators of the last runs sampled in this process, by what their jitted programs depend
# on: another sample() of a run with the same config (a notebook sampling a run again, other
# seeds, prompts of one length) calls programs already traced and compiled.
_GENERATORS: collections.OrderedDict[tuple, Generator] = collections.OrderedDict()
_GENERATORS_KEPT = 4


def _generator(cfg: Any, top_k: int, valid_vocab: int) -> Generator:
  """The :class:`~stablejax.training.trained.decoding.Generator` of a run's config (its model is
  built by the family from the whole config), reused while the config, ``top_k``,
  ``valid_vocab`` and the registered model families are unchanged."""
  from stablejax.training.config import model_of
  from stablejax.training.trained import decoding
  from stablejax.transforms import _registry

  key = (repr(cfg), top_k, valid_vocab, _registry.generation())
  if key not in _GENERATORS:
    _GENERATORS[key] = decoding.Generator(model_of(cfg), top_k=top_k, valid_vocab=valid_vocab)
    while len(_GENERATORS) > _GENERATORS_KEPT:
      _GENERATORS.popitem(last=False)
  return _GENERATORS[key]


def sample(run_dir: str | Path, prompt: str = "", *, max_new_tokens: int = 200,
           temperature: float = 0.8, top_k: int = 50, seed: int = 0, num_samples: int = 1,
           tokenizer: Optional[str] = None,
           on_fallback: Callable[[int, str], Any] = lambda step, why: None,
           check_stop: Callable[[], None] = lambda: None) -> dict:
  """Samples ``num_samples`` continuations of ``prompt`` from a run's newest usable checkpoint.

  ``check_stop`` is called between the steps (config, checkpoint, tokenizer, compilation);
  whatever it raises stops sampling there. A step under way, such as an XLA compilation, always
  runs to its end: nothing is thrown into it. The first generation compiles the decoder and
  gives the samples; a second one, already compiled, measures the speed. A stop that comes once
  the samples exist does not throw them away: the speed is not measured, and the result says
  ``"stopped": True``.

  Returns:
    ``{"step", "prompt_ids", "samples": [text], "tokens": [[ids]], "seconds", "compile_seconds",
    "stopped", "decoding"}`` where each text is the prompt followed by its continuation
    (``seconds`` None when the speed was not measured; ``compile_seconds``: the first generation,
    compilation included, which a second call for the same model, prompt length and sample count
    in this process does not repeat; ``decoding``: how the tokens were made,
    :data:`~stablejax.training.trained.decoding.KV_CACHE` or, for a family without decoding,
    :data:`~stablejax.training.trained.decoding.RECOMPUTE`).

  Raises:
    SampleError: missing run, config, checkpoint or tokenizer; bad arguments.
  """
  import jax

  check_stop()
  if max_new_tokens < 0 or num_samples < 1 or top_k < 0 or not temperature >= 0:
    raise SampleError("need --max-new-tokens >= 0, --num-samples >= 1, --top-k >= 0 (0: all) and "
                      "--temperature >= 0 (0: greedy)")
  cfg = load_run_config(run_dir)
  check_stop()
  restored = restore_params(run_dir, on_fallback)
  check_params(restored.params, cfg)
  check_stop()
  tok = run_tokenizer(cfg, tokenizer, run_dir)
  if tok.vocab_size > cfg.model.vocab_size:
    raise SampleError(f"the tokenizer has {tok.vocab_size} tokens but the model only "
                      f"{cfg.model.vocab_size}: pass the --tokenizer the run was trained with")
  prompt_ids = tok.encode(prompt) if prompt else list(tok.start_ids)
  if not prompt_ids:
    prompt_ids = list(tok.start_ids)
  gen = _generator(cfg, top_k, tok.vocab_size)
  kwargs: dict[str, Any] = dict(temperature=temperature, seed=seed, step=restored.step,
                                num_samples=num_samples)
  check_stop()
  t0 = time.perf_counter()
  tokens = gen.generate(restored.params, prompt_ids, max_new_tokens, **kwargs)  # and compile
  jax.block_until_ready(tokens)
  t1 = t2 = time.perf_counter()
  stopped = False
  try:
    check_stop()
  except BaseException:  # noqa: BLE001 - a stop now keeps the samples, unmeasured
    stopped = True
  if not stopped:  # the same samples again (the same seed), compiled: the speed
    jax.block_until_ready(gen.generate(restored.params, prompt_ids, max_new_tokens, **kwargs))
    t2 = time.perf_counter()
  texts = [tok.decode(list(prompt_ids) + row.tolist()) if prompt else tok.decode(row.tolist())
           for row in np.asarray(tokens)]
  if prompt:
    texts = [prompt + t[len(tok.decode(prompt_ids)):] for t in texts]
  return {"step": restored.step, "prompt_ids": list(prompt_ids), "samples": texts,
          "tokens": np.asarray(tokens).tolist(), "seconds": None if stopped else t2 - t1,
          "compile_seconds": t1 - t0, "stopped": stopped, "decoding": gen.method}
