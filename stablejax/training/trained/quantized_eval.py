"""Validation loss of a trained run before and after round-to-nearest weight quantisation.

    python -m stablejax quantize-eval RUN_DIR [--bits 4] [--batches N] [--exclude lm_head ...]

(the command line is :mod:`stablejax.cli.quantize_eval`; this module is the library it runs,
:func:`quantize_eval`).

Measures the outlier-safe claim (Outlier-Safe Pre-Training, arXiv 2506.19697) on our own models:
a model without activation/weight outliers loses little when its weights are rounded to 4 bits.

Reads ``RUN_DIR/config.json``, rebuilds the model and the fixed validation batches the way the
trainer does (``build_data``, the config's model family, the trainer's own eval step), restores
the parameters of the newest usable checkpoint in ``RUN_DIR/checkpoints``, and evaluates the
validation cross-entropy of the parameters as trained and after
``stablejax.quantize_weights_rtn(params, bits)`` (per-channel, symmetric, round-to-nearest; norm
gains and vectors stay in full precision). The model is quantised as it would be deployed (its
family's ``for_deployment``: a GPT with EmbProj merged, ``stablejax.merge_emb_proj``), unless
``--no-merge``.
Prints both losses and the difference and writes ``RUN_DIR/quantize_eval.json``.

A checkpoint is usable when Orbax can read it and its contents match the fingerprint the trainer
saved with it (the trainer's own rule); a damaged newest step falls back to the previous one, with
a warning. The run directory is opened read-only (only ``quantize_eval.json`` is written).

Exit codes: 0 done; 2 missing run directory, missing or bad config, no usable checkpoint, bad
arguments.

Example::

    python -m stablejax train --out runs/small
    python -m stablejax quantize-eval runs/small --bits 4 --exclude lm_head
    # checkpoint step 300, 8 validation batches, excluded lm_head
    # val loss full precision: ...
    # val loss 4-bit RTN:      ...
    # difference:              +0.0123 (+0.61%)

Data paths in config.json are read as they were given to the trainer (a relative path is relative
to the current directory), so run this from where the run was started.
"""

from __future__ import annotations

import optax
import contextlib
import dataclasses
import functools
import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import numpy as np

from stablejax.training.trained.run import RunError, check_params, load_run_config, restore_params

if TYPE_CHECKING:
  from stablejax.training.config import Config

RESULT_FILE = "quantize_eval.json"


QuantizeEvalError = RunError  # one error type for an unusable run (stablejax.training.trained.run)


def make_evaluator(cfg: Config, model_cfg: Any = None, step: int = 0
                   ) -> Callable[[Any, Sequence[Any]], float]:
  """``params, batches -> mean validation cross-entropy``, with the trainer's eval step.

  Args:
    cfg: the run's trainer ``Config``.
    model_cfg: the ``model`` section to evaluate (default ``cfg.model``; e.g. the deployed
      model's, :meth:`stablejax.modeling.family.LanguageModel.for_deployment`).
    step: training step, for models whose forward pass follows a schedule (BitNet's lambda: the
      value the trainer's eval at that step used).

  Returns:
    A function of (params, list of ``[B, T+1]`` token arrays) returning a Python float: the mean
    over batches of the per-batch mean cross-entropy (z-loss excluded), as the trainer logs
    ``val_loss``.
  """
  import jax
  import jax.numpy as jnp

  from stablejax.training.config import to_dict

  model_cfg = model_cfg if model_cfg is not None else cfg.model
  run_cfg = dataclasses.replace(cfg, model=model_cfg)
  eval_step = _jitted_eval_step(json.dumps(to_dict(run_cfg), sort_keys=True))

  def evaluate(params: optax.Params, batches: Sequence[Any]) -> float:
    losses = [eval_step(params, jnp.asarray(b), jnp.int32(step)) for b in batches]
    return float(np.mean(jax.device_get(losses)))

  return evaluate


@functools.lru_cache(maxsize=8)
def _jitted_eval_step(config_json: str) -> Callable:
  """The trainer's eval step for a config (given as JSON, so it can key a cache), jitted once."""
  import jax

  from stablejax.training.config import config_from_dict, model_of
  from stablejax.training.loop.step import make_eval_step

  cfg = config_from_dict(json.loads(config_json))
  return jax.jit(make_eval_step(model_of(cfg), cfg))


@functools.lru_cache(maxsize=1)
def _jitted_quantize() -> Callable:
  """``quantize_weights_rtn`` as one compiled program per tree, bit width and exclusion list
  (run eagerly, every leaf shape compiles its own small programs, several times slower)."""
  import jax

  from stablejax.modeling.utils import quantize_weights_rtn

  return jax.jit(quantize_weights_rtn, static_argnames=("bits", "exclude"))


def quantize_eval(run_dir: str | Path, bits: int = 4, *, batches: Optional[int] = None,
                  exclude: Sequence[str] = (), merge: bool = True,
                  on_fallback: Callable[[int, str], None] = lambda step, why: None,
                  write: bool = True, check_stop: Callable[[], None] = lambda: None) -> dict:
  """Validation loss of a run's newest usable checkpoint before and after RTN quantisation.

  Args:
    run_dir: a training run's output directory.
    bits: weight bit width, 2..8.
    batches: number of fixed validation batches (default ``train.eval_batches`` of the run, so
      ``val_loss_before`` equals the trainer's val loss at that step).
    exclude: parameter-path substrings kept in full precision (e.g. ``("lm_head",)``).
    merge: for an EmbProj model, merge the projections into the embedding and head before
      quantising (how it would be deployed).
    on_fallback: called as ``on_fallback(step, reason)`` for each unusable checkpoint skipped.
    write: write ``RUN_DIR/quantize_eval.json`` (atomically).
    check_stop: called between the steps (restoring, loading data, each evaluation, each
      compilation done); whatever it raises stops the evaluation before anything is written.

  Returns:
    ``{"run_dir", "checkpoint_step", "bits", "exclude", "batches", "merged_emb_proj",
    "val_loss_before", "val_loss_after", "delta", "relative_delta"}``.

  Raises:
    QuantizeEvalError: missing directory, config or usable checkpoint; bad arguments; a run
      directory it cannot write the result to.

  Example::

    result = quantize_eval("runs/small", bits=4)
    print(result["val_loss_before"], result["val_loss_after"])
  """
  from stablejax.data.config import DataError
  from stablejax.data.pipeline import build_data
  from stablejax.training.config import model_of

  check_stop()
  if not isinstance(bits, int) or isinstance(bits, bool) or not 2 <= bits <= 8:
    raise QuantizeEvalError(f"bits={bits!r} must be an integer in 2..8 (4 for the usual test)")
  if batches is not None and (not isinstance(batches, int) or batches < 1):
    raise QuantizeEvalError(f"batches={batches!r} must be a positive integer")
  run_dir = Path(run_dir)
  cfg = load_run_config(run_dir)
  check_stop()
  restored = restore_params(run_dir, on_fallback)
  check_params(restored.params, cfg)
  check_stop()
  n_batches = batches if batches is not None else cfg.train.eval_batches
  try:
    data = build_data(cfg.data, seq_len=cfg.train.seq_len, batch_size=cfg.train.batch_size,
                      seed=cfg.train.seed)
  except DataError as e:
    raise QuantizeEvalError(f"the run's data cannot be loaded: {e}") from None
  val = [b["tokens"] for b in data.val_batches(n_batches)]
  check_stop()

  evaluate = make_evaluator(cfg, step=restored.step)
  before = evaluate(restored.params, val)
  check_stop()
  params = restored.params
  merged = False
  if merge:
    model = model_of(cfg)
    params, deployed = model.for_deployment(params)
    merged = deployed is not model
    if merged:
      evaluate = make_evaluator(cfg, deployed.config, step=restored.step)
  quantized = _jitted_quantize()(params, bits=bits, exclude=tuple(exclude))
  check_stop()
  after = evaluate(quantized, val)
  check_stop()

  result = {
      "run_dir": str(run_dir),
      "checkpoint_step": restored.step,
      "bits": bits,
      "exclude": list(exclude),
      "batches": n_batches,
      "merged_emb_proj": merged,
      "val_loss_before": before,
      "val_loss_after": after,
      "delta": after - before,
      "relative_delta": (after - before) / before if before else math.nan,
  }
  if write:
    partial = run_dir / f"{RESULT_FILE}.{os.getpid()}.partial"
    try:  # whole or not at all: written aside, then renamed into place
      partial.write_text(json.dumps(result, indent=2) + "\n")
      os.replace(partial, run_dir / RESULT_FILE)
    except OSError as e:
      with contextlib.suppress(OSError):
        partial.unlink(missing_ok=True)
      raise QuantizeEvalError(f"cannot write {run_dir / RESULT_FILE} ({e.strerror or e}): free "
                              f"some space or make the run directory writable") from None
  return result
