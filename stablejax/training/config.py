"""Run configuration: one dataclass per section, loaded from JSON, overridable from the command
line.

Unknown keys and values of the wrong type are errors (`ConfigError`, one line naming the key and
the fix), never silently ignored: a typo in a learning-rate key must not train with the default.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from stablejax.data.pipeline import DataConfig, prepared_vocab_size
from stablejax.modeling.gpt import ModelConfig


class ConfigError(ValueError):
  """A bad configuration file, key or value; the message names the problem and the fix."""


@dataclasses.dataclass
class TrainConfig:
  # With train.time_budget_minutes, the budget fixes the step count unless steps is given next to
  # it (same config file or dict, or --set): then steps caps it. null: no cap (needs a budget).
  steps: Optional[int] = 300
  batch_size: int = 16            # global batch (sequences per optimizer step, all devices)
  seq_len: int = 128
  seed: int = 0
  eval_every: int = 100
  eval_batches: int = 8
  log_every: int = 10
  grad_accum: int = 1             # micro-batches per step; the stability transforms see their mean
  warmup_steps: int = 30
  min_lr_ratio: float = 0.1       # cosine decays to learning_rate * min_lr_ratio
  # for MFU; None: known accelerators, measured on CPU
  peak_flops_per_device: Optional[float] = None
  # model.bitnet: quantisation strength ramps 0 -> 1 over these steps
  lambda_warmup_steps: int = 1000
  lambda_schedule: str = "linear"  # "linear" or "cosine"
  time_budget_minutes: Optional[float] = None  # fix the step count to end within this (budget.py)
  target_val_loss: Optional[float] = None      # summary.json: time_to_target_s, step_to_target


@dataclasses.dataclass
class OptimizerConfig:
  """The defaults are a stable Muon setup: Muon at 0.01 (Moonlight scale), AdamW groups at 3e-3.

  With name="adamw", learning_rate is the AdamW rate of every parameter (set it to about 3e-4 to
  3e-3: the learning-rate check warns above that) and weight_decay decays the matrices.
  """
  name: str = "muon"              # "muon" (outlier-safe Muon + AdamW groups) or "adamw"
  learning_rate: float = 0.01     # Muon matrices (muon) or every parameter (adamw)
  # norms, biases, scalars (muon only; null: learning_rate)
  adam_learning_rate: Optional[float] = 3e-3
  # token embedding (muon only; null: adam_learning_rate)
  embedding_learning_rate: Optional[float] = None
  # output head (muon only; null: adam_learning_rate)
  head_learning_rate: Optional[float] = None
  # Muon matrices (muon) or every matrix (adamw); never norms, biases
  weight_decay: float = 0.0
  adam_weight_decay: float = 0.0  # AdamW groups' matrices (muon only); never norms, biases
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  momentum: float = 0.95
  ns_steps: int = 5
  ns_coeffs: str = "standard"
  ns_backend: str = "auto"
  consistent_rms: Optional[float] = 0.2
  outlier_threshold: float = 5.0
  outlier_method: Optional[str] = "zscore"


@dataclasses.dataclass
class StabilityConfig:
  zclip: bool = True
  zclip_alpha: float = 0.97
  z_thresh: float = 2.5
  zclip_warmup_steps: int = 25
  max_grad_norm: Optional[float] = 1.0  # global-norm ceiling in every mode (ZClip's, else a clip)
  # Off by default: on clean runs AdaGC (lambda_rel 1.05) acts as a learning-rate cut and cost
  # final loss in every bench/stress.py cell, with no gain at high learning rates (README).
  adagc: bool = False
  adagc_beta: float = 0.98
  adagc_lambda_rel: float = 1.05
  adagc_lambda_abs: float = 1.0
  adagc_warmup_steps: int = 100
  adagc_per_layer: bool = True       # one AdaGC threshold per layer of scan-stacked [L, ...] leaves
  skip_nonfinite: bool = True
  skip_spikes: bool = True
  spike_window: int = 128
  spike_min_history: Optional[int] = None  # null: the rule's default (64, or 63 for olmo_core)
  spike_sigma: Optional[float] = 6.0       # skip above mean + sigma * std; null disables the rule
  spike_factor: Optional[float] = None     # skip above factor * mean; null disables the rule
  spike_statistics: str = "winsorized"     # or "olmo_core": OLMo-core's exact rule
  max_consecutive_skips: int = 16
  z_loss: float = 1e-4
  # QK-clip (Kimi K2, arXiv 2507.20534): after each update, rescale W_q and W_k of every head
  # whose max pre-softmax logit in the step's forward pass exceeded this (null: off).
  qk_clip_tau: Optional[float] = None
  loss_scale_init: float = 2.0**10   # fp16 only (model.compute_dtype == "float16")
  loss_scale_growth_interval: int = 200
  loss_scale_growth_factor: float = 1.5
  # Recovery (stablejax/training/recovery.py).
  recovery: bool = True
  emergency_lr_factor: float = 0.2    # a rollback multiplies the LR scale in effect by this
  # then it returns to 1.0 over this many steps (null: never)
  lr_recovery_steps: Optional[int] = 100
  lr_recovery_schedule: str = "linear"    # "linear" or "geometric" (log-linear) return to 1.0
  max_rollbacks: int = 3
  loss_window: int = 5               # divergence: this many logged train losses in a row ...
  loss_explosion_factor: float = 3.0  # ... above factor x the best median of loss_window losses


@dataclasses.dataclass
class CheckpointConfig:
  every: int = 100
  keep: int = 3
  async_save: bool = True


@dataclasses.dataclass
class LoggingConfig:
  tensorboard: bool = True
  progress: bool = True
  histogram_every: int = 100        # per-layer gradient-norm histograms (0 disables)
  activation_every: int = 100       # residual-stream RMS/max, logit max, kurtosis (0 disables)
  # At every log step: per-layer max attention logit and output-logit statistics, measured on
  # the first attention_sequences sequences of the step's batch with the updated parameters.
  attention_logits: bool = True
  attention_per_head: bool = False  # also one max logit per head and layer
  attention_sequences: int = 4
  grad_norm_high: float = 5.0
  grad_norm_critical: float = 10.0
  sample_every: Optional[int] = None  # steps between printed samples; None: at each eval; 0: off
  sample_prompt: str = ""             # "" starts a new document
  sample_tokens: int = 64


@dataclasses.dataclass
class MeshConfig:
  data: int = -1                   # -1: every device not used by fsdp
  fsdp: int = 1                    # parameters and optimizer state sharded over this axis
  # Multi-process (multi-host) runs: see stablejax/training/distributed.py and README "Multi-host".
  # join a job with jax.distributed.initialize() before anything else
  distributed: bool = False
  coordinator_address: Optional[str] = None  # HOST:PORT of process 0; else $JAX_COORDINATOR_ADDRESS
  # else $JAX_NUM_PROCESSES, else the cluster's (SLURM...)
  num_processes: Optional[int] = None
  process_id: Optional[int] = None           # else $JAX_PROCESS_ID, else the cluster's
  local_device_ids: Optional[list[int]] = None  # devices this process uses (None: all it sees)
  initialization_timeout: int = 300  # seconds to wait for every process to join
  heartbeat_timeout: int = 100       # seconds without a heartbeat before a process counts as dead
  shutdown_timeout: int = 300        # seconds an exiting process waits for the others at the end


@dataclasses.dataclass
class FaultsConfig:
  """Deliberate faults, for testing that a setup survives them.

  Step numbers are 0-based indices of the step about to run: a fault at step s hits the update
  that metrics.jsonl logs as step s + 1 (records carry the number of completed steps). A step
  fault strikes again when a rollback replays the step; a batch fault (`*_batch_indices`, 0-based
  positions in the training data stream) belongs to the data, so a rollback that skips the batch
  never meets it again.
  """
  nan_grad_steps: list[int] = dataclasses.field(default_factory=list)
  nan_grad_batch_indices: list[int] = dataclasses.field(default_factory=list)
  garbage_batch_steps: list[int] = dataclasses.field(default_factory=list)
  garbage_batch_indices: list[int] = dataclasses.field(default_factory=list)
  garbage_kind: str = "repeat"     # "repeat" (one token repeated) or "random" (random bytes)
  grad_scale_steps: list[int] = dataclasses.field(default_factory=list)
  grad_scale_factor: float = 1e4
  kill_at_step: Optional[int] = None        # SIGKILL just before this step runs
  # SIGKILL while the checkpoint of this step is written
  kill_during_save_step: Optional[int] = None
  kill_after_rollback: Optional[int] = None  # SIGKILL once the n-th rollback (1-based) is recorded,
                                             # before the abandoned branch's checkpoints are deleted


@dataclasses.dataclass
class Config:
  """A training run's whole configuration: one dataclass per section of the JSON file.

  Build it with `load_config` (a JSON file plus ``section.key=value`` overrides, checked and with
  one-line errors) rather than by hand; `Run` trains it.

  Example:
    >>> from stablejax.training.config import Config, load_config
    >>> cfg = load_config(None, ["model.n_layers=2", "optimizer.name=adamw"])
    >>> isinstance(cfg, Config), cfg.model.n_layers, cfg.optimizer.name
    (True, 2, 'adamw')
    >>> cfg.train.steps == Config().train.steps  # untouched keys keep their defaults
    True
  """
  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  data: DataConfig = dataclasses.field(default_factory=DataConfig)
  optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
  stability: StabilityConfig = dataclasses.field(default_factory=StabilityConfig)
  train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
  checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
  logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
  mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
  faults: FaultsConfig = dataclasses.field(default_factory=FaultsConfig)


# ----------------------------------------------------------------------------- loading


def _type_name(tp: Any) -> str:
  return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
  """Checks `value` against the annotation `tp`; returns it (ints widen to floats)."""
  origin = typing.get_origin(tp)
  if origin in (Union, types.UnionType):
    for arm in typing.get_args(tp):
      try:
        return _coerce(value, arm, key)
      except ConfigError:
        continue
    raise ConfigError(f"{key}={json.dumps(value)} has the wrong type: expected {_type_name(tp)}")
  if tp is type(None):
    if value is None:
      return None
    raise ConfigError(f"{key} must be null")
  if origin is list:
    (item_tp,) = typing.get_args(tp)
    if not isinstance(value, list):
      raise ConfigError(f"{key}={json.dumps(value)} has the wrong type: expected a JSON list")
    return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
  if tp is float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise ConfigError(f"{key}={json.dumps(value)} has the wrong type: expected a number")
    return float(value)
  if tp is int:
    if isinstance(value, bool) or not isinstance(value, int):
      raise ConfigError(f"{key}={json.dumps(value)} has the wrong type: expected an integer")
    return value
  if tp is bool:
    if not isinstance(value, bool):
      raise ConfigError(f"{key}={json.dumps(value)} has the wrong type: expected true or false")
    return value
  if tp is str:
    if not isinstance(value, str):
      raise ConfigError(f"{key}={json.dumps(value)} has the wrong type: expected a string")
    return value
  if isinstance(tp, type) and dataclasses.is_dataclass(tp):
    if not isinstance(value, dict):
      raise ConfigError(f"{key} must be a JSON object of {tp.__name__} fields")
    return _build(tp, value, key)
  raise ConfigError(f"{key}: unsupported annotation {tp}")


def _build(cls: type, raw: dict, prefix: str = "") -> Any:
  hints = typing.get_type_hints(cls)
  names = [f.name for f in dataclasses.fields(cls)]
  for key in raw:
    if key not in hints:
      where = f"{prefix}.{key}" if prefix else key
      raise ConfigError(f"unknown config key '{where}': valid keys here are {', '.join(names)}")
  kwargs = {k: _coerce(v, hints[k], f"{prefix}.{k}" if prefix else k) for k, v in raw.items()}
  return cls(**kwargs)


def config_from_dict(raw: dict, layers: Optional[list[set[str]]] = None) -> Config:
  """Builds and validates a `Config` from a (possibly partial) nested dict.

  Args:
    raw: the config values, e.g. ``{"train": {"steps": 100}}``.
    layers: the dotted keys each source gave, in the order they were applied (a config file,
      then ``--set`` overrides); None: ``raw`` is one source. They tell a ``train.steps`` given
      next to (or after) ``train.time_budget_minutes`` from one that only came with the file.
  """
  if not isinstance(raw, dict):
    raise ConfigError("the config must be a JSON object with sections like 'model' and 'train'")
  _vocab_from_prepared_data(raw)
  _budget_fixes_steps(raw, [flat_keys(raw)] if layers is None else layers)
  cfg = _build(Config, raw)
  validate(cfg)
  return cfg


def flat_keys(raw: Any, prefix: str = "") -> set[str]:
  """The dotted keys of a nested dict: ``{"train": {"steps": 1}}`` -> ``{"train",
  "train.steps"}``."""
  keys: set[str] = set()
  if isinstance(raw, dict):
    for key, value in raw.items():
      dotted = f"{prefix}.{key}" if prefix else str(key)
      keys |= {dotted} | flat_keys(value, dotted)
  return keys


def _budget_fixes_steps(raw: dict, layers: list[set[str]]) -> None:
  """With a time budget, the budget owns the step count (train.steps=null) unless train.steps
  was given in the same source as the budget or a later one; that one is then a cap.

  So ``--set train.time_budget_minutes=2`` on a config file with ``"steps": 250`` trains as
  long as two minutes allow, and a file (or ``--set``) giving both caps the budget at its steps.
  """
  train = raw.get("train")
  if not isinstance(train, dict) or train.get("time_budget_minutes") is None:
    return
  given = [i for i, keys in enumerate(layers) if "train.time_budget_minutes" in keys]
  if given and any("train.steps" in keys for keys in layers[given[-1]:]):
    return
  raw["train"] = dict(train, steps=None)


def _vocab_from_prepared_data(raw: dict) -> None:
  """Without model.vocab_size, a prepared data directory's vocabulary (padded to a multiple of
  64) sets it; a given one is checked against the data when the run starts."""
  model, data = raw.get("model", {}), raw.get("data", {})
  if not isinstance(model, dict) or not isinstance(data, dict) or "vocab_size" in model:
    return
  vocab = prepared_vocab_size(data.get("train"))
  if vocab is not None:
    raw["model"] = dict(model, vocab_size=-(-vocab // 64) * 64)


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
  """Applies `section.key=value` overrides (value parsed as JSON, else taken as a string)."""
  defaults = dataclasses.asdict(Config())
  for item in overrides:
    if "=" not in item:
      raise ConfigError(f"--set {item!r} is not of the form section.key=value (e.g. "
                        "train.steps=100)")
    dotted, text = item.split("=", 1)
    parts = dotted.strip().split(".")
    node_default = defaults
    for part in parts:
      if not isinstance(node_default, dict) or part not in node_default:
        raise ConfigError(f"--set {dotted}: no such config key; see "
                          "stablejax/configs/default.json for the keys")
      node_default = node_default[part]
    try:
      value = json.loads(text)
    except json.JSONDecodeError:
      value = text  # bare strings need no quotes: --set data.train=/path/to/text
    node = raw
    for part in parts[:-1]:
      node = node.setdefault(part, {})
    node[parts[-1]] = value
  return raw


def packaged_configs() -> dict[str, Path]:
  """The configs that ship with the package (``stablejax/configs/*.json``), by name."""
  folder = Path(__file__).resolve().parent.parent / "configs"
  return {p.stem: p for p in sorted(folder.glob("*.json"))}


def config_path(name_or_path: str | Path) -> Path:
  """The JSON file of ``--config``: an existing file, else a packaged config's name.

  Raises:
    ConfigError: neither a file nor a packaged config (the message lists the names).
  """
  path = Path(name_or_path)
  if path.is_file():
    return path
  packaged = packaged_configs()
  name = path.stem if path.suffix == ".json" and path.parent == Path("configs") else str(path)
  if name in packaged:
    return packaged[name]
  raise ConfigError(f"config {str(name_or_path)!r} is neither a file nor a packaged config: pass "
                    f"a JSON file or one of {', '.join(packaged)}")


def config_name(name_or_path: str | Path) -> str:
  """The name a run directory takes by default (``runs/<name>``): the file name without .json."""
  return Path(name_or_path).stem


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> Config:
  """The config of a JSON file or packaged config (None: the defaults) with ``section.key=value``
  overrides.

  ``path`` is a JSON file, or the name of a config that ships with the package (``"default"``,
  ``"gpt2_small"``, ...; `packaged_configs`).

  A time budget in the file or the overrides owns the step count unless ``train.steps`` is given
  in the same place or later (`config_from_dict`).

  Raises:
    ConfigError: a missing or invalid file, an unknown key or a bad value (one line naming it).

  Example:
    >>> import json, pathlib, tempfile
    >>> from stablejax.training.config import ConfigError, load_config
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "tiny.json"
    >>> _ = path.write_text(json.dumps({"model": {"d_model": 64, "n_layers": 2}}))
    >>> cfg = load_config(path, ["model.n_layers=3"])  # overrides win over the file
    >>> cfg.model.d_model, cfg.model.n_layers
    (64, 3)
    >>> try:
    ...   load_config(path, ["model.n_layer=3"])
    ... except ConfigError as e:
    ...   print(e)
    --set model.n_layer: no such config key; see stablejax/configs/default.json for the keys
  """
  raw: dict = {}
  if path is not None:
    path = config_path(path)
    try:
      raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
      raise ConfigError(f"config file {path} is not valid JSON (line {e.lineno}: {e.msg})") \
          from None
  layers = [flat_keys(raw), flat_keys(apply_overrides({}, list(overrides)))]
  return config_from_dict(apply_overrides(raw, list(overrides)), layers)


def to_dict(cfg: Config) -> dict:
  return dataclasses.asdict(cfg)


def _positive(name: str, value: float, allow_zero: bool = False) -> None:
  ok = value >= 0 if allow_zero else value > 0
  if not ok or (isinstance(value, float) and not math.isfinite(value)):
    bound = ">= 0" if allow_zero else "> 0"
    raise ConfigError(f"{name}={value} must be {bound}")


def validate(cfg: Config) -> None:
  """Cross-field checks; each failure names the key and what to set instead."""
  t, o, s = cfg.train, cfg.optimizer, cfg.stability
  for name in ("batch_size", "seq_len", "eval_every", "log_every", "grad_accum"):
    _positive(f"train.{name}", getattr(t, name))
  _positive("train.warmup_steps", t.warmup_steps, allow_zero=True)
  if t.steps is None:
    if t.time_budget_minutes is None:
      raise ConfigError("train.steps=null needs train.time_budget_minutes (the budget then fixes"
                        " the step count): set train.steps or a budget")
  else:
    _positive("train.steps", t.steps)
    if t.warmup_steps >= t.steps:
      raise ConfigError(f"train.warmup_steps={t.warmup_steps} must be below train.steps={t.steps}")
  if t.batch_size % t.grad_accum:
    raise ConfigError(f"train.batch_size={t.batch_size} is not divisible by "
                      f"train.grad_accum={t.grad_accum}")
  if t.seq_len > cfg.model.max_seq_len:
    raise ConfigError(f"train.seq_len={t.seq_len} exceeds "
                      f"model.max_seq_len={cfg.model.max_seq_len}: raise model.max_seq_len")
  if not 0 <= t.min_lr_ratio <= 1:
    raise ConfigError(f"train.min_lr_ratio={t.min_lr_ratio} must lie in [0, 1]")
  if t.time_budget_minutes is not None:
    _positive("train.time_budget_minutes", t.time_budget_minutes)
  if cfg.logging.sample_every is not None:
    _positive("logging.sample_every", cfg.logging.sample_every, allow_zero=True)
  _positive("logging.sample_tokens", cfg.logging.sample_tokens)
  if o.name not in ("muon", "adamw"):
    raise ConfigError(f"optimizer.name={o.name!r} is not known: use \"muon\" or \"adamw\"")
  for name in ("learning_rate", "adam_learning_rate", "embedding_learning_rate",
               "head_learning_rate"):
    value = getattr(o, name)
    if value is not None:
      _positive(f"optimizer.{name}", value)
  _positive("optimizer.weight_decay", o.weight_decay, allow_zero=True)
  _positive("optimizer.adam_weight_decay", o.adam_weight_decay, allow_zero=True)
  if o.name == "muon" and o.adam_learning_rate is None and o.consistent_rms is None:
    raise ConfigError("optimizer.adam_learning_rate=null needs optimizer.consistent_rms: Muon's "
                      "width scaling runs at ~0.02, far too high for AdamW; set "
                      "adam_learning_rate (e.g. 3e-3)")
  if s.skip_spikes:
    if s.spike_sigma is None and s.spike_factor is None:
      raise ConfigError("stability.spike_sigma and stability.spike_factor are both null: set one "
                        "(e.g. spike_sigma=6.0 or spike_factor=10.0) or "
                        "stability.skip_spikes=false")
    for name in ("spike_sigma", "spike_factor"):
      if getattr(s, name) is not None:
        _positive(f"stability.{name}", getattr(s, name))
    if s.spike_statistics not in ("winsorized", "olmo_core"):
      raise ConfigError(f"stability.spike_statistics={s.spike_statistics!r} is not known: use "
                        "\"winsorized\" or \"olmo_core\"")
    _positive("stability.spike_window", s.spike_window)
    if s.spike_min_history is not None and not 1 <= s.spike_min_history <= s.spike_window:
      raise ConfigError(f"stability.spike_min_history={s.spike_min_history} must lie in "
                        f"[1, stability.spike_window={s.spike_window}]")
    if s.spike_statistics == "olmo_core" and s.spike_min_history is None and s.spike_window < 19:
      raise ConfigError(f"stability.spike_window={s.spike_window} is below 19: OLMo-core's rule "
                        "(spike_statistics=\"olmo_core\") never skips there; use a window >= 19")
  if not 0 < s.emergency_lr_factor <= 1:
    raise ConfigError(f"stability.emergency_lr_factor={s.emergency_lr_factor} must lie in (0, 1]")
  if s.lr_recovery_steps is not None:
    _positive("stability.lr_recovery_steps", s.lr_recovery_steps)
  if s.lr_recovery_schedule not in ("linear", "geometric"):
    raise ConfigError(f"stability.lr_recovery_schedule={s.lr_recovery_schedule!r} is not known:"
                      " use \"linear\" or \"geometric\"")
  _positive("stability.max_rollbacks", s.max_rollbacks, allow_zero=True)
  _positive("stability.loss_window", s.loss_window)
  if not s.loss_explosion_factor > 1:
    raise ConfigError(f"stability.loss_explosion_factor={s.loss_explosion_factor} must be > 1"
                      " (a multiple of the best loss)")
  _positive("stability.max_consecutive_skips", s.max_consecutive_skips)
  if s.qk_clip_tau is not None:
    _positive("stability.qk_clip_tau", s.qk_clip_tau)
    if cfg.model.qk_norm:
      raise ConfigError("stability.qk_clip_tau with model.qk_norm=true: QK-norm removes the scale"
                        " of W_q and W_k from the logits, so QK-clip would shrink them every step "
                        "without lowering a logit; set stability.qk_clip_tau=null (QK-norm already"
                        " bounds the logits) or model.qk_norm=false")
  _positive("logging.attention_sequences", cfg.logging.attention_sequences)
  _positive("checkpoint.every", cfg.checkpoint.every)
  _positive("checkpoint.keep", cfg.checkpoint.keep)
  for name in ("nan_grad_steps", "nan_grad_batch_indices", "garbage_batch_steps",
               "garbage_batch_indices", "grad_scale_steps"):
    if any(i < 0 for i in getattr(cfg.faults, name)):
      raise ConfigError(f"faults.{name}={getattr(cfg.faults, name)} has a negative entry: use "
                        "0-based indices")
  if cfg.faults.garbage_kind not in ("repeat", "random"):
    raise ConfigError(f"faults.garbage_kind={cfg.faults.garbage_kind!r} is not known: use "
                      "\"repeat\" or \"random\"")
  if cfg.mesh.fsdp < 1 or cfg.mesh.data == 0 or cfg.mesh.data < -1:
    raise ConfigError(f"mesh.data={cfg.mesh.data}, mesh.fsdp={cfg.mesh.fsdp}: use fsdp >= 1 and "
                      "data >= 1 or -1")
  for name in ("initialization_timeout", "heartbeat_timeout", "shutdown_timeout"):
    _positive(f"mesh.{name}", getattr(cfg.mesh, name))
  if not cfg.mesh.distributed:
    for name in ("coordinator_address", "num_processes", "process_id", "local_device_ids"):
      if getattr(cfg.mesh, name) is not None:
        raise ConfigError(f"mesh.{name} is set but mesh.distributed=false: set "
                          f"mesh.distributed=true to join a multi-process job, or drop "
                          f"mesh.{name}")
  try:
    cfg.model.validate()
  except ValueError as e:
    raise ConfigError(str(e)) from None


# ----------------------------------------------------------------------------- ineffective keys

# (keys, is_ineffective(cfg), "with ..." reason). A key listed here and set away from its default
# while its condition holds gets one warning line at start; add a row for every new mode switch.
_INEFFECTIVE_RULES = (
    (("optimizer.adam_learning_rate", "optimizer.embedding_learning_rate",
      "optimizer.head_learning_rate", "optimizer.adam_weight_decay", "optimizer.momentum",
      "optimizer.ns_steps", "optimizer.ns_coeffs", "optimizer.ns_backend",
      "optimizer.consistent_rms", "optimizer.outlier_threshold", "optimizer.outlier_method"),
     lambda c: c.optimizer.name == "adamw",
     'optimizer.name="adamw" (AdamW uses optimizer.learning_rate and optimizer.weight_decay)'),
    (("optimizer.outlier_threshold",),
     lambda c: c.optimizer.name == "muon" and c.optimizer.outlier_method is None,
     "optimizer.outlier_method=null"),
    (("stability.zclip_alpha", "stability.z_thresh", "stability.zclip_warmup_steps"),
     lambda c: not c.stability.zclip, "stability.zclip=false"),
    (("stability.adagc_beta", "stability.adagc_lambda_rel", "stability.adagc_lambda_abs",
      "stability.adagc_warmup_steps", "stability.adagc_per_layer"),
     lambda c: not c.stability.adagc, "stability.adagc=false"),
    (("stability.adagc_per_layer",),
     lambda c: c.stability.adagc and not c.model.scan_layers,
     "model.scan_layers=false (no stacked layers)"),
    (("stability.spike_window", "stability.spike_min_history", "stability.spike_sigma",
      "stability.spike_factor", "stability.spike_statistics"),
     lambda c: not c.stability.skip_spikes, "stability.skip_spikes=false"),
    (("stability.max_consecutive_skips",),
     lambda c: not (c.stability.skip_spikes or c.stability.skip_nonfinite),
     "stability.skip_spikes=false and stability.skip_nonfinite=false"),
    (("stability.loss_scale_init", "stability.loss_scale_growth_interval",
      "stability.loss_scale_growth_factor"),
     lambda c: c.model.compute_dtype != "float16",
     'model.compute_dtype other than "float16" (loss scaling is for fp16 only)'),
    (("stability.emergency_lr_factor", "stability.max_rollbacks", "stability.loss_window",
      "stability.loss_explosion_factor", "stability.lr_recovery_steps",
      "stability.lr_recovery_schedule"),
     lambda c: not c.stability.recovery, "stability.recovery=false"),
    (("logging.attention_per_head", "logging.attention_sequences"),
     lambda c: not c.logging.attention_logits, "logging.attention_logits=false"),
    (("train.lambda_warmup_steps", "train.lambda_schedule"),
     lambda c: not c.model.bitnet, "model.bitnet=false"),
    (("faults.garbage_kind",),
     lambda c: not (c.faults.garbage_batch_steps or c.faults.garbage_batch_indices),
     "faults.garbage_batch_steps and faults.garbage_batch_indices empty"),
    (("faults.grad_scale_factor",), lambda c: not c.faults.grad_scale_steps,
     "faults.grad_scale_steps empty"),
)


def ineffective_keys(cfg: Config) -> list[str]:
  """One line per config key set away from its default that has no effect in the chosen mode.

  Example: `optimizer.adam_weight_decay=0.1 has no effect with optimizer.name="adamw" (...)`.
  The trainer prints each as a warning at start, so no setting is silently ignored.
  """
  lines, seen = [], set()
  for keys, ineffective, reason in _INEFFECTIVE_RULES:
    if not ineffective(cfg):
      continue
    for dotted in keys:
      section_name, key = dotted.split(".")
      section = getattr(cfg, section_name)
      if dotted in seen or not hasattr(section, key):
        continue  # named once; or a key this version of the config does not have
      value = getattr(section, key)
      if value != getattr(type(section)(), key):
        seen.add(dotted)
        lines.append(f"{dotted}={json.dumps(value)} has no effect with {reason}")
  return lines
