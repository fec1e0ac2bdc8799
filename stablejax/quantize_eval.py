"""Validation loss of a trained run before and after round-to-nearest weight quantisation.

    python -m stablejax.quantize_eval RUN_DIR [--bits 4] [--batches N] [--exclude lm_head ...]

Measures the outlier-safe claim (Outlier-Safe Pre-Training, arXiv 2506.19697) on our own models:
a model without activation/weight outliers loses little when its weights are rounded to 4 bits.

Reads ``RUN_DIR/config.json``, rebuilds the model and the fixed validation batches the way the
trainer does (``build_data``, ``GPT``, the trainer's own eval step), restores the parameters of the
newest usable checkpoint in ``RUN_DIR/checkpoints``, and evaluates the validation cross-entropy of
the parameters as trained and after ``stablejax.quantize_weights_rtn(params, bits)`` (per-channel,
symmetric, round-to-nearest; norm gains and vectors stay in full precision). An EmbProj model is
merged first (``stablejax.merge_emb_proj``, as it would be deployed), unless ``--no-merge``.
Prints both losses and the difference and writes ``RUN_DIR/quantize_eval.json``.

A checkpoint is usable when Orbax can read it and its contents match the fingerprint the trainer
saved with it (the trainer's own rule); a damaged newest step falls back to the previous one, with
a warning. The run directory is opened read-only (only ``quantize_eval.json`` is written).

Exit codes: 0 done; 2 missing run directory, missing or bad config, no usable checkpoint, bad
arguments.

Example::

    python train.py --out runs/small
    python -m stablejax.quantize_eval runs/small --bits 4 --exclude lm_head
    # checkpoint step 300, 8 validation batches, excluded lm_head
    # val loss full precision: ...
    # val loss 4-bit RTN:      ...
    # difference:              +0.0123 (+0.61%)

Data paths in config.json are read as they were given to the trainer (a relative path is relative
to the current directory), so run this from where the run was started.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import math
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

RESULT_FILE = "quantize_eval.json"


class QuantizeEvalError(Exception):
  """A run directory that cannot be evaluated; the message names the problem and the fix."""


@dataclasses.dataclass
class RestoredParams:
  """Parameters restored from one checkpoint of a run."""
  params: dict        # the GPT parameter tree (jax arrays, on the default device)
  step: int           # the checkpoint's step
  directory: Path     # the checkpoint directory they came from


def load_run_config(run_dir: str | Path):
  """Reads ``RUN_DIR/config.json`` as a trainer ``Config``.

  Raises:
    QuantizeEvalError: the directory or the config file is missing, or the config is invalid.
  """
  from stablejax.training.config import ConfigError, load_config

  run_dir = Path(run_dir)
  if not run_dir.is_dir():
    raise QuantizeEvalError(f"run directory {run_dir} does not exist: pass the --out directory of a "
                            f"training run")
  path = run_dir / "config.json"
  if not path.is_file():
    raise QuantizeEvalError(f"{path} does not exist: pass the --out directory of a run started "
                            f"with train.py (it writes config.json)")
  try:
    return load_config(path)
  except ConfigError as e:
    raise QuantizeEvalError(f"{path}: {e}") from None


def restore_params(run_dir: str | Path,
                   on_fallback: Callable[[int, str], None] = lambda step, why: None
                   ) -> RestoredParams:
  """Restores the parameters of the newest usable checkpoint of a run.

  The whole saved train state is read as host arrays (so a run saved on N devices restores on
  one), checked against the fingerprint stored in its metadata, and its ``params`` returned. No
  optimizer has to be rebuilt. Unreadable or damaged steps are reported through
  ``on_fallback(step, reason)`` and the previous step is tried.

  Args:
    run_dir: a training run's output directory (holding ``checkpoints/``).
    on_fallback: called for every checkpoint that was skipped.

  Returns:
    A ``RestoredParams``.

  Raises:
    QuantizeEvalError: no checkpoint directory, no checkpoint in it, or none usable.

  Example::

    restored = restore_params("runs/small")
    logits = GPT(cfg.model).apply({"params": restored.params}, tokens)
  """
  import jax
  import orbax.checkpoint as ocp

  from stablejax.training.checkpoint import fingerprint, fingerprint_matches

  directory = (Path(run_dir) / "checkpoints").absolute()
  steps = sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit()) \
      if directory.is_dir() else []
  if not steps:
    raise QuantizeEvalError(f"no checkpoint in {directory}: train the run first (checkpoints are "
                            f"written every checkpoint.every steps and at the end)")
  registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
  registry.add("state", ocp.args.PyTreeRestore, ocp.PyTreeCheckpointHandler)
  registry.add("meta", ocp.args.JsonRestore, ocp.JsonCheckpointHandler)
  # Orbax warns through absl that the directory is read-only and that the "data" item (the Grain
  # iterator, not needed here) is not restored; both are expected.
  absl_logger = logging.getLogger("absl")
  level = absl_logger.level
  absl_logger.setLevel(logging.ERROR)
  manager = ocp.CheckpointManager(
      directory, options=ocp.CheckpointManagerOptions(read_only=True), handler_registry=registry)
  try:
    steps = sorted(manager.all_steps())
    for step in reversed(steps):
      try:
        metadata = manager.item_metadata(step)["state"]
        metadata = getattr(metadata, "tree", metadata)
        # Host arrays: no sharding is needed, so a run saved on N devices restores on one.
        as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), metadata)
        restored = manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.PyTreeRestore(restore_args=as_numpy),
            meta=ocp.args.JsonRestore()))
        state, meta = restored["state"], dict(restored["meta"])
        if "params" not in state:
          raise ValueError("the saved state has no params")
        expected = meta.get("fingerprint", [math.nan, math.nan])
        actual = [float(v) for v in np.asarray(fingerprint(state))]
        if not fingerprint_matches(expected, actual):
          raise ValueError("contents do not match the fingerprint saved with it")
        params = jax.tree.map(jax.numpy.asarray, state["params"])
        return RestoredParams(params=params, step=int(meta.get("step", step)),
                              directory=directory / str(step))
      except Exception as e:  # noqa: BLE001 - any failure to read means "not usable"
        text = str(e).strip()
        reason = text.splitlines()[0] if text else type(e).__name__
        on_fallback(step, f"{type(e).__name__}: {reason[:200]}")
  finally:
    manager.close()
    absl_logger.setLevel(level)
  raise QuantizeEvalError(f"none of the {len(steps)} checkpoints in {directory} could be restored: "
                          f"train the run again (python train.py --fresh)")


def check_params(params, model_cfg, seq_len: int) -> None:
  """Raises QuantizeEvalError if ``params`` do not fit ``GPT(model_cfg)`` (shapes and names)."""
  import jax
  import jax.numpy as jnp

  from stablejax.training.model import GPT

  tokens = jax.ShapeDtypeStruct((1, seq_len), jnp.int32)
  expected = jax.eval_shape(lambda t: GPT(model_cfg).init(jax.random.PRNGKey(0), t), tokens)
  shapes = lambda tree: jax.tree_util.tree_map_with_path(  # noqa: E731
      lambda p, x: tuple(x.shape), tree)
  if shapes(expected["params"]) != shapes(params):
    raise QuantizeEvalError("the checkpoint's parameters do not match the model in config.json: "
                            "was config.json edited after training? restore the original config")


def make_evaluator(cfg, model_cfg=None, step: int = 0) -> Callable:
  """``params, batches -> mean validation cross-entropy``, with the trainer's eval step.

  Args:
    cfg: the run's trainer ``Config``.
    model_cfg: the model to evaluate (default ``cfg.model``; e.g. the config returned by
      ``merge_emb_proj``).
    step: training step, for the BitNet lambda of ``model.bitnet`` runs (the value the trainer's
      eval at that step used).

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

  def evaluate(params, batches) -> float:
    losses = [eval_step(params, jnp.asarray(b), jnp.int32(step)) for b in batches]
    return float(np.mean(jax.device_get(losses)))

  return evaluate


@functools.lru_cache(maxsize=8)
def _jitted_eval_step(config_json: str) -> Callable:
  """The trainer's eval step for a config (given as JSON, so it can key a cache), jitted once."""
  import jax

  from stablejax.model_utils import lambda_warmup
  from stablejax.training.config import config_from_dict
  from stablejax.training.model import GPT
  from stablejax.training.step import make_eval_step

  cfg = config_from_dict(json.loads(config_json))
  lam = lambda_warmup(cfg.train.lambda_warmup_steps, cfg.train.lambda_schedule) \
      if cfg.model.bitnet else None
  return jax.jit(make_eval_step(GPT(cfg.model), cfg, lam))


@functools.lru_cache(maxsize=1)
def _jitted_quantize() -> Callable:
  """``quantize_weights_rtn`` as one compiled program per tree, bit width and exclusion list
  (run eagerly, every leaf shape compiles its own small programs, several times slower)."""
  import jax

  from stablejax.model_utils import quantize_weights_rtn

  return jax.jit(quantize_weights_rtn, static_argnames=("bits", "exclude"))


def quantize_eval(run_dir: str | Path, bits: int = 4, *, batches: Optional[int] = None,
                  exclude: Sequence[str] = (), merge: bool = True,
                  on_fallback: Callable[[int, str], None] = lambda step, why: None,
                  write: bool = True) -> dict:
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
    write: write ``RUN_DIR/quantize_eval.json``.

  Returns:
    ``{"run_dir", "checkpoint_step", "bits", "exclude", "batches", "merged_emb_proj",
    "val_loss_before", "val_loss_after", "delta", "relative_delta"}``.

  Raises:
    QuantizeEvalError: missing directory, config or usable checkpoint; bad arguments.

  Example::

    result = quantize_eval("runs/small", bits=4)
    print(result["val_loss_before"], result["val_loss_after"])
  """
  from stablejax.model_utils import merge_emb_proj
  from stablejax.training.data import DataError, build_data

  if not isinstance(bits, int) or isinstance(bits, bool) or not 2 <= bits <= 8:
    raise QuantizeEvalError(f"bits={bits!r} must be an integer in 2..8 (4 for the usual test)")
  if batches is not None and (not isinstance(batches, int) or batches < 1):
    raise QuantizeEvalError(f"batches={batches!r} must be a positive integer")
  run_dir = Path(run_dir)
  cfg = load_run_config(run_dir)
  restored = restore_params(run_dir, on_fallback)
  check_params(restored.params, cfg.model, cfg.train.seq_len)
  n_batches = batches if batches is not None else cfg.train.eval_batches
  try:
    data = build_data(cfg.data, seq_len=cfg.train.seq_len, batch_size=cfg.train.batch_size,
                      seed=cfg.train.seed)
  except DataError as e:
    raise QuantizeEvalError(f"the run's data cannot be loaded: {e}") from None
  val = [b["tokens"] for b in data.val_batches(n_batches)]

  evaluate = make_evaluator(cfg, step=restored.step)
  before = evaluate(restored.params, val)
  params = restored.params
  merged = bool(merge and cfg.model.emb_proj)
  if merged:
    params, merged_cfg = merge_emb_proj(params, cfg.model)
    evaluate = make_evaluator(cfg, merged_cfg, step=restored.step)
  after = evaluate(_jitted_quantize()(params, bits=bits, exclude=tuple(exclude)), val)

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
    (run_dir / RESULT_FILE).write_text(json.dumps(result, indent=2) + "\n")
  return result


class _ArgumentParser(argparse.ArgumentParser):
  def error(self, message):  # one line and exit code 2, like the trainer (main returns it)
    raise QuantizeEvalError(f"{message} (see python -m stablejax.quantize_eval --help)")


def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = _ArgumentParser(prog="python -m stablejax.quantize_eval",
                           description=__doc__.splitlines()[0])
  parser.add_argument("run_dir", help="a training run's output directory (train.py --out)")
  parser.add_argument("--bits", type=int, default=4, help="weight bits, 2..8 (default 4)")
  parser.add_argument("--batches", type=int, default=None,
                      help="validation batches (default: the run's train.eval_batches)")
  parser.add_argument("--exclude", nargs="+", default=[], metavar="SUBSTRING",
                      help="keep parameters whose path contains any of these in full precision")
  parser.add_argument("--no-merge", action="store_true",
                      help="quantise an EmbProj model without merging the projections first")
  try:
    args = parser.parse_args(argv)
  except QuantizeEvalError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2

  def fallback(step: int, reason: str) -> None:
    print(f"warning: checkpoint {step} is unusable ({reason}); trying the previous one",
          file=sys.stderr)

  try:
    r = quantize_eval(args.run_dir, args.bits, batches=args.batches, exclude=args.exclude,
                      merge=not args.no_merge, on_fallback=fallback)
  except QuantizeEvalError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  note = " (EmbProj merged)" if r["merged_emb_proj"] else ""
  note += f", excluded {', '.join(r['exclude'])}" if r["exclude"] else ""
  print(f"checkpoint step {r['checkpoint_step']}, {r['batches']} validation batches{note}")
  print(f"val loss full precision: {r['val_loss_before']:.4f}")
  print(f"val loss {r['bits']}-bit RTN:      {r['val_loss_after']:.4f}")
  print(f"difference:              {r['delta']:+.4f} ({100 * r['relative_delta']:+.2f}%)")
  print(f"wrote {Path(args.run_dir) / RESULT_FILE}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
