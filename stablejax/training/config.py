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

from stablejax.data.config import DataConfig
from stablejax.data.prepared import prepared_vocab_size
from stablejax.modeling import family as family_lib
from stablejax.muon import newton_schulz as _ns
from stablejax.training import plugins as plugins_lib
from stablejax.transforms import defence


class ConfigError(ValueError):
  """A bad configuration file, key or value; the message names the problem and the fix."""


def model_section_class(name: str) -> type:
  """The ``model`` section's dataclass of the family ``name`` (``family`` first, then its
  fields).

  Raises:
    ConfigError: no family of that name is registered.
  """
  declaration = family_lib.get(name)
  if declaration is None:
    known = ", ".join(f.name for f in family_lib.registered())
    raise ConfigError(f"model.family={name!r} is not a registered model family: use one of "
                      f"{known}, or name the module that declares it with --plugin")
  return family_lib.section_class(declaration)


def _default_model() -> Any:
  return model_section_class(family_lib.DEFAULT_FAMILY)()


@dataclasses.dataclass
class TrainConfig:
  # With train.time_budget_minutes, the budget fixes the step count unless steps is given next to
  # it (same config file or dict, or --set): then steps caps it. null: no cap (needs a budget).
  steps: Optional[int] = 250
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
  ns_method: str = "standard"             # "standard" or "gram" (Gram Newton-Schulz)
  ns_preconditioning: str = "frobenius"   # "frobenius" or "aol" (Turbo-Muon)
  per_head: bool = False                  # attention projections orthogonalised per head
  normuon: bool = False                   # NorMuon's per-neuron normalisation after Muon
  normuon_b2: float = 0.95


@dataclasses.dataclass
class LossScaleConfig:
  """``stability.loss_scale``: dynamic loss scaling, fp16 only (``model.compute_dtype``)."""

  init: float = 2.0**10
  growth_interval: int = 200
  growth_factor: float = 1.5


@dataclasses.dataclass
class RecoveryConfig:
  """``stability.recovery``: rollback to the last good checkpoint (stablejax/training/recovery.py).

  A rollback multiplies the learning-rate scale in effect by ``emergency_lr_factor``, which then
  returns to 1.0 over ``lr_recovery_steps`` (null: never). Divergence: ``loss_window`` logged train
  losses in a row above ``loss_explosion_factor`` x the best median of ``loss_window`` losses.
  """

  enabled: bool = True
  emergency_lr_factor: float = 0.2
  lr_recovery_steps: Optional[int] = 100
  lr_recovery_schedule: str = "linear"    # "linear" or "geometric" (log-linear) return to 1.0
  max_rollbacks: int = 3
  loss_window: int = 5
  loss_explosion_factor: float = 3.0


def stability_config_class() -> type:
  """The ``stability`` section's dataclass: ``z_loss``, one section per registered defence
  (:mod:`stablejax.transforms.defence`, in chain order), ``loss_scale`` and ``recovery``.

  Built from the registry when asked for, so a defence registered at any time (in a test, in a
  user's module) has its section; the class is reused while the registry is unchanged.
  """
  declared = defence.registered()
  key = tuple((d.name, d.config) for d in declared)
  cls = _STABILITY_CLASSES.get(key)
  if cls is None:
    fields: list[Any] = [("z_loss", float, dataclasses.field(default=1e-4))]
    fields += [(d.name, d.config, dataclasses.field(default_factory=d.config)) for d in declared]
    fields += [("loss_scale", LossScaleConfig, dataclasses.field(default_factory=LossScaleConfig)),
               ("recovery", RecoveryConfig, dataclasses.field(default_factory=RecoveryConfig))]
    cls = dataclasses.make_dataclass("StabilityConfig", fields)
    cls.__module__ = __name__
    cls.__doc__ = ("The ``stability`` section: ``z_loss`` (PaLM's auxiliary loss weight; 0 turns "
                   "it off), a section per defence (" + ", ".join(d.name for d in declared)
                   + "), ``loss_scale`` and ``recovery``.")
    _STABILITY_CLASSES[key] = cls
  return cls


_STABILITY_CLASSES: dict[tuple, type] = {}


def _default_stability() -> Any:
  return stability_config_class()()


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
  # the batch of the first listed step served again at every listed step (a stuck data loader)
  repeat_batch_steps: list[int] = dataclasses.field(default_factory=list)
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
  # Modules declaring defences or model families, imported before the rest is read
  # (stablejax.training.plugins); recorded, so every later command imports them again.
  plugins: list[str] = dataclasses.field(default_factory=list)
  # The family's section (model_section_class): model.family names it, the other keys are its.
  model: Any = dataclasses.field(default_factory=_default_model)
  data: DataConfig = dataclasses.field(default_factory=DataConfig)
  optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
  # A dataclass built from the registered defences (stability_config_class).
  stability: Any = dataclasses.field(default_factory=_default_stability)
  train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
  checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
  logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
  mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
  faults: FaultsConfig = dataclasses.field(default_factory=FaultsConfig)


# ----------------------------------------------------------------------------- loading


def _type_name(tp: Any) -> str:
  """How a value of annotation ``tp`` is written in JSON: "an integer or null", "a number"..."""
  if typing.get_origin(tp) in (Union, types.UnionType):
    return " or ".join(_type_name(arm) for arm in typing.get_args(tp))
  names = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
           type(None): "null"}
  if tp in names:
    return names[tp]
  if typing.get_origin(tp) is list:
    return "a JSON list"
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
  if cls is Config:
    built = {}
    if isinstance(raw.get("stability"), dict):
      built["stability"] = _build(stability_config_class(), raw["stability"], "stability")
    if isinstance(raw.get("model"), dict):
      section = model_section_class(_family_name(raw))
      built["model"] = _build(section, raw["model"], "model")
    raw = dict(raw, **built)
  hints = typing.get_type_hints(cls)
  names = [f.name for f in dataclasses.fields(cls)]
  for key, value in raw.items():
    where = f"{prefix}.{key}" if prefix else key
    old = _old_key_message(where, value)
    if old:
      raise ConfigError(old)
    if key not in hints:
      raise ConfigError(f"unknown config key '{where}': valid keys here are {', '.join(names)}")
  kwargs = {k: v if k in ("stability", "model") and dataclasses.is_dataclass(v) else
            _coerce(v, hints[k], f"{prefix}.{k}" if prefix else k) for k, v in raw.items()}
  return cls(**kwargs)


# ----------------------------------------------------------------------------- keys of 0.1

# The flat stability keys of stablejax 0.1 and the nested keys that replaced them. A config that
# uses one is an error naming its new key; a run directory written by 0.1 is translated
# (translate_v0_1), so it still resumes.
_RENAMED = {
    "zclip": ("zclip.enabled",), "zclip_alpha": ("zclip.alpha",),
    "z_thresh": ("zclip.z_thresh",), "zclip_warmup_steps": ("zclip.warmup_steps",),
    "adagc": ("adagc.enabled",), "adagc_beta": ("adagc.beta",),
    "adagc_lambda_rel": ("adagc.lambda_rel",), "adagc_lambda_abs": ("adagc.lambda_abs",),
    "adagc_warmup_steps": ("adagc.warmup_steps",), "adagc_per_layer": ("adagc.per_layer",),
    "skip_nonfinite": ("skip_nonfinite.enabled",), "skip_spikes": ("skip_spikes.enabled",),
    "spike_window": ("skip_spikes.window",), "spike_min_history": ("skip_spikes.min_history",),
    "spike_sigma": ("skip_spikes.sigma",), "spike_factor": ("skip_spikes.factor",),
    "spike_statistics": ("skip_spikes.statistics",),
    "max_consecutive_skips": ("skip_spikes.max_consecutive", "skip_nonfinite.max_consecutive"),
    "qk_clip_tau": ("qk_clip.enabled", "qk_clip.tau"),
    "max_grad_norm": ("zclip.max_grad_norm", "clip.max_norm"),
    "loss_scale_init": ("loss_scale.init",),
    "loss_scale_growth_interval": ("loss_scale.growth_interval",),
    "loss_scale_growth_factor": ("loss_scale.growth_factor",),
    "recovery": ("recovery.enabled",),
    "emergency_lr_factor": ("recovery.emergency_lr_factor",),
    "lr_recovery_steps": ("recovery.lr_recovery_steps",),
    "lr_recovery_schedule": ("recovery.lr_recovery_schedule",),
    "max_rollbacks": ("recovery.max_rollbacks",), "loss_window": ("recovery.loss_window",),
    "loss_explosion_factor": ("recovery.loss_explosion_factor",),
}
_RENAME_NOTES = {
    "qk_clip_tau": " (null: stability.qk_clip.enabled=false)",
    "max_grad_norm": " (ZClip's ceiling, or the plain clip's norm with "
                     "stability.clip.enabled=true when ZClip is off)",
}


def _old_key_message(dotted: str, value: Any = None) -> Optional[str]:
  """The error for a key of stablejax 0.1 (``stability.z_thresh``, ``stability.zclip=false``)."""
  parts = dotted.split(".")
  if len(parts) != 2 or parts[0] != "stability" or parts[1] not in _RENAMED:
    return None
  old = parts[1]
  if old in ("zclip", "adagc", "skip_nonfinite", "skip_spikes", "recovery") \
      and isinstance(value, dict):
    return None  # the new section of the same name
  new = " and ".join(f"stability.{k}" for k in _RENAMED[old])
  return (f"stability.{old} is a key of stablejax 0.1: use {new}{_RENAME_NOTES.get(old, '')}; "
          "docs/trainer.md lists the stability sections")


def is_v0_1(raw: Any) -> bool:
  """Whether a config dict uses the flat stability keys of stablejax 0.1."""
  stability = raw.get("stability") if isinstance(raw, dict) else None
  return isinstance(stability, dict) and any(
      _old_key_message(f"stability.{k}", v) for k, v in stability.items())


def translate_v0_1(raw: dict) -> dict:
  """A config dict of stablejax 0.1 (flat stability keys) in the nested form of this version.

  ``max_grad_norm`` was the global-norm ceiling in every mode: ZClip's own ceiling when ZClip ran,
  else ``optax.clip_by_global_norm``; ``qk_clip_tau`` null meant QK-clip off.
  """
  if not is_v0_1(raw):
    return raw
  old = dict(raw["stability"])
  new: dict[str, Any] = {}

  def put(dotted: str, value: Any) -> None:
    section, _, key = dotted.partition(".")
    new.setdefault(section, {})[key] = value

  zclip_on = old.get("zclip", True)
  for key, value in old.items():
    if key == "z_loss" or isinstance(value, dict):
      new[key] = value
    elif key == "qk_clip_tau":
      put("qk_clip.enabled", value is not None)
      if value is not None:
        put("qk_clip.tau", value)
    elif key == "max_grad_norm":
      if zclip_on:
        put("zclip.max_grad_norm", value)
      elif value is not None:
        put("clip.enabled", True)
        put("clip.max_norm", value)
    elif key in _RENAMED:
      for dotted in _RENAMED[key]:
        put(dotted, value)
    else:
      new[key] = value  # unknown: left for the usual error
  if "max_grad_norm" not in old and not zclip_on:
    put("clip.enabled", True)  # 0.1's default ceiling of 1.0 applied without ZClip too
  return dict(raw, stability=new)


def config_from_dict(raw: dict, layers: Optional[list[set[str]]] = None) -> Config:
  """Builds and validates a `Config` from a (possibly partial) nested dict.

  The plugins it names (``raw["plugins"]``) are imported first, so their defences and model
  families exist when the rest is read.

  Args:
    raw: the config values, e.g. ``{"train": {"steps": 100}}``.
    layers: the dotted keys each source gave, in the order they were applied (a config file,
      then ``--set`` overrides); None: ``raw`` is one source. They tell a ``train.steps`` given
      next to (or after) ``train.time_budget_minutes`` from one that only came with the file.
  """
  if not isinstance(raw, dict):
    raise ConfigError("the config must be a JSON object with sections like 'model' and 'train'")
  load_plugins(raw.get("plugins", []), "the config's plugins")
  _sections_are_objects(raw)
  _vocab_from_prepared_data(raw)
  _budget_fixes_steps(raw, [flat_keys(raw)] if layers is None else layers)
  cfg = _build(Config, raw)
  validate(cfg)
  return cfg


def load_plugins(names: Any, where: str) -> None:
  """Imports the plugins ``names`` (:mod:`stablejax.training.plugins`).

  Raises:
    ConfigError: ``names`` is not a list of strings, or a plugin cannot be imported.
  """
  if not isinstance(names, list):
    raise ConfigError(f"plugins={json.dumps(names)} has the wrong type: expected a JSON list of "
                      "module names or .py paths")
  try:
    plugins_lib.load(names, where)
  except plugins_lib.PluginError as e:
    raise ConfigError(str(e)) from None


def _family_name(raw: dict) -> str:
  model = raw.get("model")
  name = model.get("family", family_lib.DEFAULT_FAMILY) if isinstance(model, dict) else \
      family_lib.DEFAULT_FAMILY
  if not isinstance(name, str):
    raise ConfigError(f"model.family={json.dumps(name)} has the wrong type: expected a string")
  return name


def _sections_are_objects(raw: dict) -> None:
  """Every section of ``raw`` but ``plugins`` must be a JSON object."""
  for f in dataclasses.fields(Config):
    value = raw.get(f.name)
    if f.name != "plugins" and value is not None and not isinstance(value, dict):
      raise ConfigError(f"{f.name} must be a JSON object of its keys, not {json.dumps(value)}")


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


def _maybe_json(text: str) -> Any:
  try:
    return json.loads(text)
  except json.JSONDecodeError:
    return text


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
  """Applies `section.key=value` overrides (value parsed as JSON, else taken as a string).

  The keys are checked against the sections of the config they make: ``model.*`` against the
  family ``model.family`` names (set in the file or by an override), ``stability.*`` against the
  registered defences (import a plugin's first: :func:`load_plugins`).
  """
  parsed = []
  for item in overrides:
    if "=" not in item:
      raise ConfigError(f"--set {item!r} is not of the form section.key=value (e.g. "
                        "train.steps=100)")
    dotted, text = item.split("=", 1)
    dotted = dotted.strip()
    old = _old_key_message(dotted, _maybe_json(text))
    if old:
      raise ConfigError(old)
    parsed.append((dotted, _maybe_json(text)))
  for dotted, value in parsed:
    if dotted == "model.family":
      raw.setdefault("model", {})
      if not isinstance(raw["model"], dict):
        raise ConfigError("model must be a JSON object of its keys, not "
                          f"{json.dumps(raw['model'])}")
      raw["model"] = _switch_family(raw["model"], value)
  defaults = to_dict(Config(model=model_section_class(_family_name(raw))()))
  for dotted, value in parsed:
    parts = dotted.split(".")
    node_default: Any = defaults
    for part in parts:
      if not isinstance(node_default, dict) or part not in node_default:
        raise ConfigError(f"--set {dotted}: no such config key; see "
                          "stablejax/configs/default.json for the keys"
                          + (" (model.* keys depend on model.family)"
                             if parts[0] == "model" else ""))
      node_default = node_default[part]
    node = raw
    for i, part in enumerate(parts[:-1]):
      child = node.setdefault(part, {})
      if not isinstance(child, dict):
        where = ".".join(parts[:i + 1])
        raise ConfigError(f"--set {dotted}: {where} is {json.dumps(child)} in the config, not a "
                          f"JSON object of its keys: make {where} an object (or leave it out)")
      node = child
    node[parts[-1]] = value
  return raw


def _switch_family(model: dict, family: Any) -> dict:
  """A ``model`` section of a config file under ``--set model.family=...``: the keys the new
  family has too are kept; the others are dropped when they only restate the old family's
  defaults (the packaged default config) and refused otherwise."""
  old = _family_name({"model": model})
  if not isinstance(family, str) or family == old:
    return dict(model, family=family)
  new_fields = {f.name for f in dataclasses.fields(model_section_class(family))}
  old_defaults = dataclasses.asdict(model_section_class(old)())
  kept = {"family": family}
  for key, value in model.items():
    if key in new_fields and key != "family":
      kept[key] = value
    elif key != "family" and old_defaults.get(key, object()) != value:
      raise ConfigError(f"model.{key}={json.dumps(value)} of the config file is not a key of "
                        f"model.family={family!r}: remove it, or set the family in the file")
  return kept


def _check_sections(raw: Any, path: Path) -> dict:
  """A config file's content: a JSON object whose sections are objects (one line otherwise)."""
  if not isinstance(raw, dict):
    raise ConfigError(f"config file {path} is {type(raw).__name__} JSON, not an object with "
                      "sections like 'model' and 'train'")
  for section, value in raw.items():
    if section in _SECTIONS and section != "plugins" and not isinstance(value, dict):
      raise ConfigError(f"config file {path}: section {section!r} is {json.dumps(value)}, not a "
                        f"JSON object of its keys: make it an object (or leave it out)")
  return raw


_SECTIONS = tuple(f.name for f in dataclasses.fields(Config))


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


def load_config(path: str | Path | None, overrides: Sequence[str] = (),
                plugins: Sequence[str] = ()) -> Config:
  """The config of a JSON file or packaged config (None: the defaults) with ``section.key=value``
  overrides and plugins.

  ``path`` is a JSON file, or the name of a config that ships with the package (``"default"``,
  ``"gpt2_small"``, ...; `packaged_configs`). ``plugins`` (the trainer's ``--plugin``) join the
  file's ``plugins`` and a ``--set plugins=[...]``; all are imported before the keys are checked,
  and the config lists them all.

  A time budget in the file or the overrides owns the step count unless ``train.steps`` is given
  in the same place or later (`config_from_dict`).

  Raises:
    ConfigError: a missing or invalid file, an unknown key or a bad value, a plugin that cannot
      be imported (one line naming it).

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
    (model.* keys depend on model.family)
  """
  raw: dict = {}
  if path is not None:
    path = config_path(path)
    try:
      raw = _check_sections(json.loads(path.read_text()), path)
    except json.JSONDecodeError as e:
      raise ConfigError(f"config file {path} is not valid JSON (line {e.lineno}: {e.msg})") \
          from None
    except UnicodeDecodeError as e:
      raise ConfigError(f"config file {path} is not UTF-8 text ({e.reason} at byte {e.start}): "
                        "pass a JSON file") from None
    except OSError as e:
      raise ConfigError(f"cannot read config file {path}: {e.strerror or e}") from None
  return _with_overrides(raw, overrides, plugins, str(path) if path else "the config")


def _with_overrides(raw: dict, overrides: Sequence[str], plugins: Sequence[str],
                    where: str) -> Config:
  """``raw`` with the plugins imported, then the overrides applied, then checked."""
  overrides = list(overrides)
  named = [_maybe_json(item.split("=", 1)[1]) for item in overrides
           if item.split("=", 1)[0].strip() == "plugins" and "=" in item]
  listed = raw.get("plugins", [])
  load_plugins(listed, where)
  for value in named:
    load_plugins(value, "--set plugins")
  load_plugins(list(plugins), "--plugin")
  layers = [flat_keys(raw), _override_keys(overrides)]
  raw = apply_overrides(raw, overrides)
  every = [plugins_lib.normalise(name) for group in [listed, *named, list(plugins)]
           for name in group]
  raw["plugins"] = list(dict.fromkeys(every))
  return config_from_dict(raw, layers)


def _override_keys(overrides: Sequence[str]) -> set[str]:
  """The dotted keys (and their sections) ``section.key=value`` overrides give."""
  keys = set()
  for item in overrides:
    parts = item.split("=", 1)[0].strip().split(".")
    keys |= {".".join(parts[:i + 1]) for i in range(len(parts))}
  return keys


def load_run_file(path: str | Path, overrides: Sequence[str] = (),
                  plugins: Sequence[str] = ()) -> Config:
  """The config a run wrote (``RUN_DIR/config.json``), in this version's form, with
  ``section.key=value`` overrides: its plugins are imported again first, and a run directory of
  stablejax 0.1 (flat stability keys) is translated (`translate_v0_1`), so it still resumes.

  Raises:
    ConfigError: a missing or invalid file (one line naming it), a plugin that cannot be
      imported, or a bad override.
  """
  path = Path(path)
  try:
    raw = json.loads(path.read_text())
  except OSError as e:
    raise ConfigError(f"cannot read {path}: {e.strerror or e}") from None
  except json.JSONDecodeError as e:
    raise ConfigError(f"{path} is not valid JSON (line {e.lineno}: {e.msg})") from None
  except UnicodeDecodeError as e:
    raise ConfigError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
  raw = translate_v0_1(_check_sections(raw, path))
  return _with_overrides(raw, overrides, plugins, str(path))


def recorded_plugins(path: str | Path) -> list[str]:
  """The plugins a run's ``config.json`` lists ([] when it lists none or cannot be read: the
  reader that needs the file says what is wrong with it)."""
  try:
    raw = json.loads(Path(path).read_text())
  except (OSError, ValueError):
    return []
  names = raw.get("plugins", []) if isinstance(raw, dict) else []
  return [n for n in names if isinstance(n, str)] if isinstance(names, list) else []


def to_dict(cfg: Config) -> dict:
  """The config as JSON (``config.json``): every section, ``model.family`` first in its own."""
  out = dataclasses.asdict(cfg)
  out["model"] = family_lib.section_dict(cfg.model)
  return out


def changed_keys(before: Config, after: Config) -> list[str]:
  """``key old -> new`` for every config key whose value differs between two starts of a run
  (a section that exists on one side only, such as a plugin defence's, counts as its keys).

  Example:
    >>> from stablejax.training.config import changed_keys, load_config
    >>> changed_keys(load_config(None), load_config(None, ["optimizer.learning_rate=0.005",
    ...                                                    "stability.qk_clip.enabled=true",
    ...                                                    "model.qk_norm=false"]))
    ['model.qk_norm true -> false', 'optimizer.learning_rate 0.01 -> 0.005',
     'stability.qk_clip.enabled false -> true']
  """
  def leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
      out: dict[str, Any] = {}
      for key, value in tree.items():
        out.update(leaves(value, f"{prefix}.{key}" if prefix else key))
      return out
    return {prefix: tree}
  old, new = leaves(to_dict(before)), leaves(to_dict(after))
  lines = []
  for key in sorted(set(old) | set(new)):
    a, b = old.get(key, "(none)"), new.get(key, "(none)")
    if a != b:
      lines.append(f"{key} {json.dumps(a)} -> {json.dumps(b)}")
  return lines


def model_of(cfg: Config) -> family_lib.LanguageModel:
  """The :class:`stablejax.modeling.family.LanguageModel` of a config's ``model`` section.

  Raises:
    ConfigError: the family is not registered.
  """
  try:
    return family_lib.build(cfg.model, cfg)
  except ValueError as e:
    raise ConfigError(str(e)) from None


def _positive(name: str, value: float, allow_zero: bool = False) -> None:
  ok = value >= 0 if allow_zero else value > 0
  if not ok or (isinstance(value, float) and not math.isfinite(value)):
    bound = ">= 0" if allow_zero else "> 0"
    raise ConfigError(f"{name}={value} must be {bound}")


def validate(cfg: Config) -> None:
  """Cross-field checks; each failure names the key and what to set instead."""
  _validate_train(cfg)
  _validate_optimizer(cfg.optimizer)
  _validate_stability(cfg)
  _validate_logging_checkpoint_faults(cfg)
  _validate_mesh(cfg.mesh)
  check = getattr(cfg.model, "validate", None)
  try:
    if check is not None:
      check()
  except ValueError as e:
    raise ConfigError(str(e)) from None


def _validate_train(cfg: Config) -> None:
  t = cfg.train
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


def _validate_optimizer(o: OptimizerConfig) -> None:
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
  for name, known in (("ns_method", _ns.METHODS), ("ns_preconditioning", _ns.PRECONDITIONINGS)):
    if getattr(o, name) not in known:
      raise ConfigError(f"optimizer.{name}={getattr(o, name)!r} is not known: use one of "
                        + ", ".join(f'"{k}"' for k in known))
  if not 0 <= o.normuon_b2 < 1:
    raise ConfigError(f"optimizer.normuon_b2={o.normuon_b2} must lie in [0, 1)")


def _validate_stability(cfg: Config) -> None:
  s = cfg.stability
  _positive("stability.z_loss", s.z_loss, allow_zero=True)
  try:
    defence.validate(s, defence.DefenceContext(stability=s, model=model_of(cfg)))
  except ValueError as e:
    raise ConfigError(str(e)) from None
  r = s.recovery
  if not 0 < r.emergency_lr_factor <= 1:
    raise ConfigError(f"stability.recovery.emergency_lr_factor={r.emergency_lr_factor} must lie "
                      "in (0, 1]")
  if r.lr_recovery_steps is not None:
    _positive("stability.recovery.lr_recovery_steps", r.lr_recovery_steps)
  if r.lr_recovery_schedule not in ("linear", "geometric"):
    raise ConfigError(f"stability.recovery.lr_recovery_schedule={r.lr_recovery_schedule!r} is not"
                      " known: use \"linear\" or \"geometric\"")
  _positive("stability.recovery.max_rollbacks", r.max_rollbacks, allow_zero=True)
  _positive("stability.recovery.loss_window", r.loss_window)
  if not r.loss_explosion_factor > 1:
    raise ConfigError(f"stability.recovery.loss_explosion_factor={r.loss_explosion_factor} must be"
                      " > 1 (a multiple of the best loss)")
  _positive("stability.loss_scale.init", s.loss_scale.init)
  _positive("stability.loss_scale.growth_interval", s.loss_scale.growth_interval)
  if not s.loss_scale.growth_factor > 1:
    raise ConfigError(f"stability.loss_scale.growth_factor={s.loss_scale.growth_factor} must be"
                      " > 1")


def _validate_logging_checkpoint_faults(cfg: Config) -> None:
  if cfg.logging.sample_every is not None:
    _positive("logging.sample_every", cfg.logging.sample_every, allow_zero=True)
  _positive("logging.sample_tokens", cfg.logging.sample_tokens)
  _positive("logging.attention_sequences", cfg.logging.attention_sequences)
  _positive("checkpoint.every", cfg.checkpoint.every)
  _positive("checkpoint.keep", cfg.checkpoint.keep)
  for name in ("nan_grad_steps", "nan_grad_batch_indices", "garbage_batch_steps",
               "garbage_batch_indices", "grad_scale_steps", "repeat_batch_steps"):
    if any(i < 0 for i in getattr(cfg.faults, name)):
      raise ConfigError(f"faults.{name}={getattr(cfg.faults, name)} has a negative entry: use "
                        "0-based indices")
  if cfg.faults.garbage_kind not in ("repeat", "random"):
    raise ConfigError(f"faults.garbage_kind={cfg.faults.garbage_kind!r} is not known: use "
                      "\"repeat\" or \"random\"")


def _validate_mesh(mesh: MeshConfig) -> None:
  if mesh.fsdp < 1 or mesh.data == 0 or mesh.data < -1:
    raise ConfigError(f"mesh.data={mesh.data}, mesh.fsdp={mesh.fsdp}: use fsdp >= 1 and "
                      "data >= 1 or -1")
  for name in ("initialization_timeout", "heartbeat_timeout", "shutdown_timeout"):
    _positive(f"mesh.{name}", getattr(mesh, name))
  if not mesh.distributed:
    for name in ("coordinator_address", "num_processes", "process_id", "local_device_ids"):
      if getattr(mesh, name) is not None:
        raise ConfigError(f"mesh.{name} is set but mesh.distributed=false: set "
                          f"mesh.distributed=true to join a multi-process job, or drop "
                          f"mesh.{name}")


# ----------------------------------------------------------------------------- ineffective keys

# (keys, is_ineffective(cfg), "with ..." reason). A key listed here and set away from its default
# while its condition holds gets one warning line at start; add a row for every new mode switch.
_INEFFECTIVE_RULES = (
    (("optimizer.adam_learning_rate", "optimizer.embedding_learning_rate",
      "optimizer.head_learning_rate", "optimizer.adam_weight_decay", "optimizer.momentum",
      "optimizer.ns_steps", "optimizer.ns_coeffs", "optimizer.ns_backend",
      "optimizer.consistent_rms", "optimizer.outlier_threshold", "optimizer.outlier_method",
      "optimizer.ns_method", "optimizer.ns_preconditioning", "optimizer.per_head",
      "optimizer.normuon", "optimizer.normuon_b2"),
     lambda c: c.optimizer.name == "adamw",
     'optimizer.name="adamw" (AdamW uses optimizer.learning_rate and optimizer.weight_decay)'),
    (("optimizer.outlier_threshold",),
     lambda c: c.optimizer.name == "muon" and c.optimizer.outlier_method is None,
     "optimizer.outlier_method=null"),
    (("optimizer.normuon_b2",),
     lambda c: c.optimizer.name == "muon" and not c.optimizer.normuon,
     "optimizer.normuon=false"),
    (("stability.loss_scale.init", "stability.loss_scale.growth_interval",
      "stability.loss_scale.growth_factor"),
     lambda c: model_of(c).compute_dtype != "float16",
     'model.compute_dtype other than "float16" (loss scaling is for fp16 only)'),
    (("stability.recovery.emergency_lr_factor", "stability.recovery.max_rollbacks",
      "stability.recovery.loss_window", "stability.recovery.loss_explosion_factor",
      "stability.recovery.lr_recovery_steps", "stability.recovery.lr_recovery_schedule"),
     lambda c: not c.stability.recovery.enabled, "stability.recovery.enabled=false"),
    (("logging.attention_per_head", "logging.attention_sequences"),
     lambda c: not c.logging.attention_logits, "logging.attention_logits=false"),
    (("faults.garbage_kind",),
     lambda c: not (c.faults.garbage_batch_steps or c.faults.garbage_batch_indices),
     "faults.garbage_batch_steps and faults.garbage_batch_indices empty"),
    (("faults.grad_scale_factor",), lambda c: not c.faults.grad_scale_steps,
     "faults.grad_scale_steps empty"),
)


def _get(cfg: Any, dotted: str) -> tuple[bool, Any, Any]:
  """(found, value, default) of a dotted key: the default is the same key of a fresh section."""
  *path, key = dotted.split(".")
  node = cfg
  for part in path:
    node = getattr(node, part, None)
  if node is None or not hasattr(node, key):
    return False, None, None
  return True, getattr(node, key), getattr(type(node)(), key)


def _declared_rules(cfg: Config) -> list[tuple[tuple[str, ...], bool, str]]:
  """Every key of a disabled defence's section has no effect; then the defences' own rules
  (``Defence.ineffective``) and the model's (``LanguageModel.ineffective_keys``)."""
  model = model_of(cfg)
  ctx = defence.DefenceContext(stability=cfg.stability, model=model)
  rules = []
  for d in defence.registered():
    section = d.section(cfg.stability)
    keys = tuple(f"stability.{d.name}.{f.name}" for f in dataclasses.fields(d.config)
                 if f.name != "enabled")
    rules.append((keys, not section.enabled, f"stability.{d.name}.enabled=false"))
    if section.enabled and d.ineffective is not None:
      rules += [((key,), True, reason) for key, reason in d.ineffective(section, ctx)]
  rules += [((key,), True, reason) for key, reason in model.ineffective_keys(cfg)]
  return rules


def ineffective_keys(cfg: Config) -> list[str]:
  """One line per config key set away from its default that has no effect in the chosen mode.

  Example: `optimizer.adam_weight_decay=0.1 has no effect with optimizer.name="adamw" (...)`.
  The trainer prints each as a warning at start, so no setting is silently ignored. Every key of
  a disabled defence counts (``stability.adagc.beta`` with ``stability.adagc.enabled=false``).
  """
  rules = [(keys, ineffective(cfg), reason) for keys, ineffective, reason in _INEFFECTIVE_RULES]
  lines, seen = [], set()
  for keys, ineffective, reason in rules + _declared_rules(cfg):
    if not ineffective:
      continue
    for dotted in keys:
      found, value, default = _get(cfg, dotted)
      if dotted in seen or not found:
        continue  # named once; or a key this version of the config does not have
      if value != default:
        seen.add(dotted)
        lines.append(f"{dotted}={json.dumps(value)} has no effect with {reason}")
  return lines