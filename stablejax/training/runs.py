"""A training run's output directory, read back: its config, its newest usable checkpoint's
parameters and its tokenizer.

Shared by :mod:`stablejax.training.sampling` and :mod:`stablejax.training.quantized_eval` (and
their command lines, ``python -m stablejax sample`` and ``python -m stablejax quantize-eval``).
Everything here only reads the run directory. Data paths in ``config.json`` are read as they
were given to the trainer (a relative path is relative to the current directory).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path
from typing import Callable, Optional

import numpy as np


class RunError(Exception):
  """A run directory that cannot be used (sampled, evaluated); the message names the problem and
  the fix."""


@dataclasses.dataclass
class RestoredParams:
  """Parameters restored from one checkpoint of a run."""
  params: dict        # the GPT parameter tree (jax arrays, on the default device)
  step: int           # the checkpoint's step
  directory: Path     # the checkpoint directory they came from


def load_run_config(run_dir: str | Path):
  """Reads ``RUN_DIR/config.json`` as a trainer ``Config``.

  Raises:
    RunError: the directory or the config file is missing, or the config is invalid.
  """
  from stablejax.training.config import ConfigError, load_config

  run_dir = Path(run_dir)
  if not run_dir.is_dir():
    raise RunError(f"run directory {run_dir} does not exist: pass the --out directory of a "
                   f"training run")
  path = run_dir / "config.json"
  if not path.is_file():
    raise RunError(f"{path} does not exist: pass the --out directory of a run started "
                   f"with train.py (it writes config.json)")
  try:
    return load_config(path)
  except ConfigError as e:
    raise RunError(f"{path}: {e}") from None


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
    RunError: no checkpoint directory, no checkpoint in it, or none usable.

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
    raise RunError(f"no checkpoint in {directory}: train the run first (checkpoints are "
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
  raise RunError(f"none of the {len(steps)} checkpoints in {directory} could be restored: "
                 f"train the run again (python train.py --fresh)")


def check_params(params, model_cfg, seq_len: int) -> None:
  """Raises RunError if ``params`` do not fit ``GPT(model_cfg)`` (shapes and names)."""
  import jax
  import jax.numpy as jnp

  from stablejax.training.model import GPT

  tokens = jax.ShapeDtypeStruct((1, seq_len), jnp.int32)
  expected = jax.eval_shape(lambda t: GPT(model_cfg).init(jax.random.PRNGKey(0), t), tokens)
  shapes = lambda tree: jax.tree_util.tree_map_with_path(  # noqa: E731
      lambda p, x: tuple(x.shape), tree)
  if shapes(expected["params"]) != shapes(params):
    raise RunError("the checkpoint's parameters do not match the model in config.json: "
                   "was config.json edited after training? restore the original config")


def run_tokenizer(cfg, spec: Optional[str] = None):
  """The tokenizer of a run's data config (or ``spec``), with its ``start_ids``."""
  from stablejax.data import tokenizer as tokenizer_lib
  from stablejax.data.pipeline import DataError, data_tokenizer
  try:
    if spec:
      tok = tokenizer_lib.get_tokenizer(spec)
      tok.start_ids = [tok.eot_id]
      return tok
    tok = data_tokenizer(cfg.data)
  except (tokenizer_lib.TokenizerError, DataError) as e:
    raise RunError(str(e)) from None
  if tok is None:
    raise RunError("the run trained on plain .bin token files, whose tokenizer is unknown: "
                   "pass --tokenizer gpt2 (or the tokenizer.json that made them)")
  return tok
