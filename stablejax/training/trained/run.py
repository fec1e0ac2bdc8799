"""A training run's output directory, read back: its config, its newest usable checkpoint's
parameters and its tokenizer.

Shared by :mod:`stablejax.training.trained.sampling` and
:mod:`stablejax.training.trained.quantized_eval` (and their command lines, ``python -m stablejax
sample`` and ``python -m stablejax quantize-eval``). Everything here only reads the run directory,
except `write_tokenizer_record`, which the trainer calls at the start of a run.

A run carries what decoding needs: ``RUN_DIR/tokenizer/record.json`` names the tokenizer the
run was trained with (kind, tiktoken name or the SHA-256 of a Hugging Face ``tokenizer.json``,
vocabulary size, end-of-text id, the ids of an empty prompt), and for a Hugging Face tokenizer
``RUN_DIR/tokenizer/tokenizer.json`` is a copy of the file itself. Both are written atomically
(the copy first, the record last). Runs without a record (trained before it existed) fall back
to their ``config.json`` data paths, read as they were given to the trainer (a relative path is
relative to the current directory); a path that does not resolve is an error, never a silent
switch to another tokenizer.
"""

from __future__ import annotations

import optax
import dataclasses
import hashlib
import json
import logging
import math
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
  from stablejax.data.config import DataConfig
  from stablejax.data.tokenizer import Tokenizer
  from stablejax.training.config import Config

import numpy as np


class RunError(Exception):
  """A run directory that cannot be used (sampled, evaluated); the message names the problem and
  the fix."""


@dataclasses.dataclass
class RestoredParams:
  """Parameters restored from one checkpoint of a run."""
  params: dict        # the model's parameter tree (jax arrays, on the default device)
  step: int           # the checkpoint's step
  directory: Path     # the checkpoint directory they came from


def load_run_config(run_dir: str | Path) -> Config:
  """Reads ``RUN_DIR/config.json`` as a trainer ``Config``.

  Raises:
    RunError: the directory or the config file is missing, or the config is invalid.
  """
  from stablejax.training.config import ConfigError, load_run_file

  run_dir = Path(run_dir)
  if not run_dir.is_dir():
    raise RunError(f"run directory {run_dir} does not exist: pass the --out directory of a "
                   f"training run")
  path = run_dir / "config.json"
  if not path.is_file():
    raise RunError(f"{path} does not exist: pass the --out directory of a run started "
                   f"with python -m stablejax train (it writes config.json)")
  try:
    return load_run_file(path)
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
    logits = model_of(cfg).logits(restored.params, tokens, restored.step)
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
                 f"train the run again (python -m stablejax train --fresh)")


def check_params(params: optax.Params, cfg: Config) -> None:
  """Raises RunError if ``params`` do not fit the model of ``cfg`` (names and shapes)."""
  import jax
  import jax.numpy as jnp

  from stablejax.training.config import ConfigError, model_of
  from stablejax.training.recovery.restore_plan import describe_difference, leaf_layout

  try:
    model = model_of(cfg)
  except ConfigError as e:
    raise RunError(str(e)) from None
  tokens = jax.ShapeDtypeStruct((1, cfg.train.seq_len), jnp.int32)
  expected = jax.eval_shape(lambda t: model.init(jax.random.PRNGKey(0), t), tokens)
  shapes = {path: shape for path, (shape, _) in leaf_layout(expected).items()}
  if shapes != {path: shape for path, (shape, _) in leaf_layout(params).items()}:
    raise RunError("the checkpoint's parameters do not fit the model in config.json ("
                   f"{describe_difference(params, expected, 'params')}): was config.json edited "
                   "after training? restore the original config")


TOKENIZER_DIR = "tokenizer"     # in the run directory: what decoding needs
TOKENIZER_RECORD = "record.json"
TOKENIZER_COPY = "tokenizer.json"  # a Hugging Face tokenizer's own file


def tokenizer_record(data_cfg: "DataConfig") -> tuple[dict, Optional[Path]]:
  """What decoding a run on `data_cfg` needs: the tokenizer's identity (as the prepared
  directory's ``meta.json`` names it, or ``bytes`` for text; ``kind`` None for plain ``.bin``
  files) and, for a Hugging Face tokenizer, the file to carry.

  Raises:
    RunError: the data's tokenizer cannot be read (e.g. a prepared directory's meta.json).
  """
  from stablejax.data import tokenizer as tokenizer_lib
  from stablejax.data.config import DataError
  from stablejax.data.prepared import read_prepared
  from stablejax.data.sources import data_tokenizer
  try:
    tok = data_tokenizer(data_cfg)
  except tokenizer_lib.TokenizerError:  # e.g. tiktoken's files not cached: its name suffices
    entries = data_cfg.train if isinstance(data_cfg.train, list) else [data_cfg.train]
    meta = read_prepared(entries[0]) or {}
    info = dict(meta.get("tokenizer", {}))
    if info.get("kind") != "tiktoken":
      raise
    return {"kind": "tiktoken", "name": info.get("name", "gpt2"),
            "vocab_size": meta["vocab_size"], "eot_id": meta["eot_id"],
            "start_ids": [meta["eot_id"]]}, None
  except DataError as e:
    raise RunError(str(e)) from None
  if tok is None:
    return {"kind": None, "reason": "plain .bin token files: their tokenizer is unknown"}, None
  record = {**tok.describe(), "vocab_size": int(tok.vocab_size), "eot_id": int(tok.eot_id),
            "start_ids": [int(i) for i in tok.start_ids]}
  if isinstance(tok, tokenizer_lib.HFTokenizer):
    record["file"] = TOKENIZER_COPY
    return record, Path(tok.path)
  return record, None


def _identity(record: dict) -> tuple:
  """What makes two tokenizers the same: kind, tiktoken name, file hash, vocabulary, end-of-text."""
  return (record.get("kind"), record.get("name"), record.get("sha256"),
          record.get("vocab_size"), record.get("eot_id"))


def _describe(record: dict) -> str:
  kind = record.get("kind")
  if kind == "hf":
    return f"the Hugging Face tokenizer.json with sha256 {str(record.get('sha256'))[:12]}..."
  if kind == "tiktoken":
    return f"tiktoken's {record.get('name')}"
  return "byte-level (bytes)" if kind == "bytes" else "an unknown tokenizer (plain .bin data)"


def read_tokenizer_record(run_dir: str | Path) -> Optional[dict]:
  """``RUN_DIR/tokenizer/record.json``, or None for a run trained before runs recorded it."""
  path = Path(run_dir) / TOKENIZER_DIR / TOKENIZER_RECORD
  if not path.is_file():
    return None
  try:
    record = json.loads(path.read_text())
  except (OSError, ValueError) as e:
    raise RunError(f"{path} cannot be read ({e}): pass --tokenizer with the tokenizer the run "
                   "was trained with") from None
  if not isinstance(record, dict) or "kind" not in record:
    raise RunError(f"{path} is not a tokenizer record: pass --tokenizer with the tokenizer the "
                   "run was trained with")
  return record


def write_tokenizer_record(run_dir: str | Path, data_cfg: "DataConfig") -> None:
  """Records the tokenizer of `data_cfg` in the run directory (the trainer, at the start of a
  run): the Hugging Face file is copied first, the record written last, both atomically (a
  temporary file renamed over the old one), so an interrupted write leaves the old record or
  the new one with its file."""
  from stablejax.training.checkpoint import write_json_atomic
  record, source = tokenizer_record(data_cfg)
  directory = Path(run_dir) / TOKENIZER_DIR
  directory.mkdir(parents=True, exist_ok=True)
  if source is not None:
    target = directory / TOKENIZER_COPY
    tmp = directory / f".{TOKENIZER_COPY}.tmp"
    shutil.copyfile(source, tmp)
    with open(tmp, "rb") as f:
      os.fsync(f.fileno())
    os.replace(tmp, target)
  write_json_atomic(directory / TOKENIZER_RECORD, record)


def recorded_tokenizer(checkpoint_meta: dict, run_record: Optional[dict],
                       run_dir: str | Path) -> tuple[Optional[dict], str]:
  """The tokenizer a run trained with, and where it is recorded: the metadata of the checkpoint
  being resumed (every checkpoint carries it), else ``run.json``, else ``tokenizer/record.json``
  (a run of an earlier release). (None, ...) when none of them names one."""
  run_dir = Path(run_dir)
  if isinstance(checkpoint_meta.get("tokenizer"), dict):
    step = checkpoint_meta.get("step", "?")
    return checkpoint_meta["tokenizer"], f"checkpoint {step} in {run_dir / 'checkpoints'}"
  if run_record is not None:
    return run_record, str(run_dir / "run.json")
  return read_tokenizer_record(run_dir), str(run_dir / TOKENIZER_DIR / TOKENIZER_RECORD)


def resume_tokenizer_problem(checkpoint_meta: dict, run_record: Optional[dict],
                             run_dir: str | Path, current: dict) -> Optional[str]:
  """Why a run may not resume from ``checkpoint_meta`` on data whose tokenizer is ``current``
  (`tokenizer_record`), in one line; None when it may. A run would train on other token ids;
  ``--data-changed`` changes the data, never the tokenizer. A run whose tokenizer is recorded
  nowhere (its record files deleted) cannot be checked, so it does not resume.

  Raises:
    RunError: ``tokenizer/record.json`` is the only record and it cannot be read.
  """
  recorded, where = recorded_tokenizer(checkpoint_meta, run_record, run_dir)
  if recorded is None:
    return (f"the tokenizer this run was trained with is recorded nowhere (not in its checkpoint, "
            f"{Path(run_dir) / 'run.json'} or {where}), so the data's cannot be checked against "
            f"it: restore {where}, or pass --fresh to start a new run")
  if _identity(current) == _identity(recorded):
    return None
  return (f"the data's tokenizer ({_describe(current)}) is not the one this run was trained "
          f"with ({_describe(recorded)}, recorded in {where}): point data.train at the run's data, "
          "or pass --fresh to start a new run (--data-changed allows other data, never another "
          "tokenizer)")


def _from_record(run_dir: Path, record: dict) -> Any:
  """The tokenizer a record names, loaded from the run directory's own copy."""
  from stablejax.data import tokenizer as tokenizer_lib
  path = run_dir / TOKENIZER_DIR / TOKENIZER_RECORD
  kind = record.get("kind")
  if kind is None:
    raise RunError("the run trained on plain .bin token files, whose tokenizer is unknown: "
                   "pass --tokenizer gpt2 (or the tokenizer.json that made them)")
  if kind == "hf":
    copy = run_dir / TOKENIZER_DIR / TOKENIZER_COPY
    if not copy.is_file():
      raise RunError(f"{copy} is missing ({path} names {_describe(record)}): restore it, or pass "
                     "--tokenizer with the tokenizer.json the run was trained with")
    digest = hashlib.sha256(copy.read_bytes()).hexdigest()
    if digest != record.get("sha256"):
      raise RunError(f"{copy} differs from the tokenizer the run was trained with (sha256 "
                     f"{digest[:12]}..., {path} records {str(record.get('sha256'))[:12]}...): "
                     "restore it, or pass --tokenizer with the tokenizer.json the run was trained "
                     "with")
    spec: Any = copy
  elif kind == "tiktoken":
    spec = record.get("name", "gpt2")
  elif kind == "bytes":
    spec = "bytes"
  else:
    raise RunError(f"{path} names an unknown tokenizer kind {kind!r}: pass --tokenizer")
  try:
    tok: Any = (tokenizer_lib.HFTokenizer(spec, record.get("eot_token")) if kind == "hf"
                else tokenizer_lib.get_tokenizer(spec))
  except tokenizer_lib.TokenizerError as e:
    raise RunError(str(e)) from None
  tok.start_ids = list(record.get("start_ids") or [tok.eot_id])
  return tok


def run_tokenizer(cfg: Config, spec: Optional[str] = None,
                  run_dir: Optional[str | Path] = None) -> Tokenizer:
  """The tokenizer to decode a run with, with its ``start_ids`` (the prompt of an empty sample).

  In order: ``spec`` (``--tokenizer``), which must be the one the run recorded if it recorded
  one; the run's own record (``RUN_DIR/tokenizer/``); for a run without a record, its data
  config, whose paths must resolve from the current directory.

  Raises:
    RunError: the recorded tokenizer is missing or differs from its record, ``spec`` differs
      from it, an old run's data path does not resolve, or plain ``.bin`` data without ``spec``.
  """
  from stablejax.data import tokenizer as tokenizer_lib
  from stablejax.data.config import EMBEDDED, DataError
  from stablejax.data.sources import data_tokenizer
  record = read_tokenizer_record(run_dir) if run_dir is not None else None
  if spec:
    try:
      named = tokenizer_lib.get_tokenizer(spec)
    except tokenizer_lib.TokenizerError as e:
      raise RunError(str(e)) from None
    named.start_ids = [named.eot_id]
    if record is not None and record.get("kind") is not None:
      given = {**named.describe(), "vocab_size": named.vocab_size, "eot_id": named.eot_id}
      if _identity(given) != _identity(record):
        raise RunError(f"--tokenizer {spec} ({_describe(given)}) is not the tokenizer the run was "
                       f"trained with ({_describe(record)}, recorded in "
                       f"{Path(run_dir or '.') / TOKENIZER_DIR / TOKENIZER_RECORD}): pass that "
                       "one, or leave out --tokenizer")
      named.start_ids = list(record.get("start_ids") or named.start_ids)
    return named
  if record is not None:
    return _from_record(Path(run_dir or "."), record)
  entries = cfg.data.train if isinstance(cfg.data.train, list) else [cfg.data.train]
  missing = [e for e in entries if e != EMBEDDED and not Path(os.path.expanduser(e)).exists()]
  if missing:
    where = f"{run_dir}/config.json" if run_dir is not None else "the run's config"
    raise RunError(f"{where} names data.train {missing[0]!r}, which does not exist from "
                   f"{Path.cwd()}, and the run has no tokenizer record (it was trained before "
                   "runs recorded one): run this from the directory the run was started in, or "
                   "pass --tokenizer (bytes, gpt2 or the tokenizer.json the run was trained with)")
  try:
    tok = data_tokenizer(cfg.data)
  except (tokenizer_lib.TokenizerError, DataError) as e:
    raise RunError(str(e)) from None
  if tok is None:
    raise RunError("the run trained on plain .bin token files, whose tokenizer is unknown: "
                   "pass --tokenizer gpt2 (or the tokenizer.json that made them)")
  return tok
