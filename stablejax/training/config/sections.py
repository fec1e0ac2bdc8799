"""The config's sections: one dataclass per section of a run's JSON config.

``model`` is the model family's section (:func:`model_section_class`: ``model.family`` picks
it), ``stability`` has a section per registered defence (:func:`stability_config_class`); the
others are fixed. :func:`to_dict` is the config as ``config.json`` holds it; :func:`model_of`
the :class:`stablejax.modeling.family.LanguageModel` of its model section.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Optional

from stablejax.data.config import DataConfig
from stablejax.training.config import optimizers
from stablejax.training.config.optimizers import MuonConfig, OptimizerConfig
from stablejax.modeling import family as family_lib
from stablejax.transforms import defence

if TYPE_CHECKING:  # the built-in defences' sections, for StabilitySections' static types
  # <!-- generated: stability-section-types (python tools/generate.py) -->
  from stablejax.transforms.clip import ClipConfig
  from stablejax.transforms.zclip import ZClipConfig
  from stablejax.transforms.adagc import AdaGCConfig
  from stablejax.transforms.update_clip import ClipUpdateRmsConfig
  from stablejax.transforms.update_clip import ZClipUpdateNormConfig
  from stablejax.transforms.hyperball import HyperballConfig
  from stablejax.transforms.qk_clip import QKClipConfig
  from stablejax.transforms.compensated import CompensatedUpdatesConfig
  from stablejax.transforms.spike_skip import SkipSpikesConfig
  from stablejax.transforms.finite_skip import SkipNonFiniteConfig
  # <!-- end generated: stability-section-types -->
  pass


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
  # A resume that changes this to N > 0 ramps the learning rate from 0 back to the schedule over N
  # steps (recorded with the run; the same command again does not ramp again). 0: no ramp.
  rewarmup_steps: int = 0
  # The persistent compilation cache's folder; "off"; null: $STABLEJAX_COMPILATION_CACHE or the
  # user's cache folder (stablejax/training/launch/compilation_cache.py).
  compilation_cache: Optional[str] = None


@dataclasses.dataclass
class LossScaleConfig:
  """``stability.loss_scale``: dynamic loss scaling, fp16 only (``model.compute_dtype``)."""

  init: float = 2.0**10
  growth_interval: int = 200
  growth_factor: float = 1.5


@dataclasses.dataclass
class RecoveryConfig:
  """``stability.recovery``: rollback to the last good checkpoint
  (stablejax/training/recovery/policy.py).

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
  # Before rolling back, replay the failing window from the rollback's checkpoint with the same
  # batches and rate: a failure that does not come back was transient (no backoff, no skipped data).
  replay: bool = True
  # max_transients transient failures on one device within transient_window steps: the run saves
  # and exits with code 16 (the hardware is suspect).
  max_transients: int = 3
  transient_window: int = 1000
  # A batch rejected this many times (a reproduced rollback's window, a skipped step) is skipped
  # from then on without training on it (0: never).
  reject_after: int = 2


@dataclasses.dataclass
class DeterminismConfig:
  """``stability.determinism``: every ``check_every`` steps the step's forward and backward run
  twice more, as two executions, and the largest difference of loss and gradient norm between
  them is recorded (a nondeterministic kernel, a flaky device). 0: off."""

  check_every: int = 0


@dataclasses.dataclass
class ReplicasConfig:
  """``stability.replicas``: with parameters replicated on several devices (data parallelism,
  several processes), every ``check_every`` steps and before every checkpoint each device's copy
  is fingerprinted and the copies compared; copies that differ stop the run (exit code 17) before
  anything is saved. 0: never."""

  check_every: int = 100


@dataclasses.dataclass
class WatchdogConfig:
  """``stability.watchdog``: a run in which no step finishes within the timeout writes every
  thread's stack to ``hang_stacks/`` and exits with code 18; a stop signal the run cannot act on
  within ``grace_seconds`` ends it the same way (exit code 130).

  The timeout is ``timeout_seconds``, or (null) ``factor`` x the measured time of a logging
  interval (``train.log_every`` steps), at least ``floor_seconds``; until the first interval is
  measured it is ``startup_seconds``. A compilation in progress never counts as a hang.
  """

  enabled: bool = True
  timeout_seconds: Optional[float] = None
  factor: float = 10.0
  floor_seconds: float = 180.0
  startup_seconds: float = 1800.0
  grace_seconds: float = 60.0


class StabilitySections:
  """What every ``stability`` section has: ``z_loss``, ``loss_scale`` and ``recovery``, and one
  section per registered defence (found by name, typed by the defence's ``config``).

  The section's dataclass is built from the registry (`stability_config_class`) with this class as
  its base, so a defence registered by a plugin has its section too.
  """
  z_loss: float
  loss_scale: LossScaleConfig
  recovery: RecoveryConfig
  determinism: DeterminismConfig
  replicas: ReplicasConfig
  watchdog: WatchdogConfig

  if TYPE_CHECKING:
    # The built-in defences' sections, typed for static checkers (written by tools/generate.py
    # from the registry); a plugin's section is found by __getattr__.
    # <!-- generated: stability-sections (python tools/generate.py) -->
    clip: ClipConfig
    zclip: ZClipConfig
    adagc: AdaGCConfig
    clip_update_rms: ClipUpdateRmsConfig
    zclip_update_norm: ZClipUpdateNormConfig
    hyperball: HyperballConfig
    qk_clip: QKClipConfig
    compensated_updates: CompensatedUpdatesConfig
    skip_spikes: SkipSpikesConfig
    skip_nonfinite: SkipNonFiniteConfig
    # <!-- end generated: stability-sections -->

    def __getattr__(self, name: str) -> Any:  # a plugin defence's section
      ...


def stability_config_class() -> type[StabilitySections]:
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
               ("recovery", RecoveryConfig, dataclasses.field(default_factory=RecoveryConfig)),
               ("determinism", DeterminismConfig,
                dataclasses.field(default_factory=DeterminismConfig)),
               ("replicas", ReplicasConfig, dataclasses.field(default_factory=ReplicasConfig)),
               ("watchdog", WatchdogConfig, dataclasses.field(default_factory=WatchdogConfig))]
    cls = dataclasses.make_dataclass("StabilityConfig", fields, bases=(StabilitySections,))
    cls.__module__ = __name__
    cls.__doc__ = ("The ``stability`` section: ``z_loss`` (PaLM's auxiliary loss weight; 0 turns "
                   "it off), a section per defence (" + ", ".join(d.name for d in declared)
                   + "), ``loss_scale``, ``recovery`` and the run's checks (``determinism``, "
                   "``replicas``, ``watchdog``).")
    _STABILITY_CLASSES[key] = cls
  return cls


_STABILITY_CLASSES: dict[tuple, type[StabilitySections]] = {}


def _default_stability() -> StabilitySections:
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
  # Multi-process (multi-host) runs: see stablejax/training/launch/distributed.py and README
  # "Multi-host". join a job with jax.distributed.initialize() before anything else
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
  # What a flaky device gives: a NaN gradient, or one scaled by grad_scale_factor, on the *first*
  # execution of these steps only (a replay or a rollback runs them clean). With transient_device
  # (a global device index), the NaN comes from that device instead: its copy of the parameters
  # turns NaN, so its rows' loss does (the others' copies and the data are fine).
  transient_nan_steps: list[int] = dataclasses.field(default_factory=list)
  transient_grad_scale_steps: list[int] = dataclasses.field(default_factory=list)
  transient_device: Optional[int] = None
  # Every execution of these steps (and of the determinism check's runs of them) scales the
  # gradient by 1 + nondeterminism x a fresh standard normal draw.
  nondeterministic_steps: list[int] = dataclasses.field(default_factory=list)
  nondeterminism: float = 1e-3
  # Before this step, one device's copy of the parameters is changed (the first float entry of the
  # first parameter, by one part in a thousand) on corrupt_replica_device (a global device index;
  # null: the last device).
  corrupt_replica_step: Optional[int] = None
  corrupt_replica_device: Optional[int] = None
  # Block forever: on the host just before this step, or inside the data pipeline when it reads
  # this batch position (0-based).
  hang_at_step: Optional[int] = None
  hang_at_batch: Optional[int] = None


@dataclasses.dataclass
class Config:
  """A training run's whole configuration: one dataclass per section of the JSON file.

  Build it with `load_config` (a JSON file plus ``section.key=value`` overrides, checked and with
  one-line errors) rather than by hand; `Trainer` trains it.

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
  # The declared optimizer's section (optimizers.section_class): optimizer.name picks it.
  optimizer: OptimizerConfig = dataclasses.field(default_factory=MuonConfig)
  # A dataclass built from the registered defences (stability_config_class).
  stability: StabilitySections = dataclasses.field(default_factory=_default_stability)
  train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
  checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
  logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
  mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
  faults: FaultsConfig = dataclasses.field(default_factory=FaultsConfig)

  def __post_init__(self) -> None:
    # A section whose class is not its name's (OptimizerConfig(name="adamw"), or a name changed
    # by dataclasses.replace) becomes the declared optimizer's, keeping the shared keys: the
    # builder is always the one optimizer.name declares.
    declared = optimizers.get(self.optimizer.name)
    if declared is not None and type(self.optimizer) is not declared.config:
      shared = {f.name: getattr(self.optimizer, f.name)
                for f in dataclasses.fields(declared.config) if hasattr(self.optimizer, f.name)}
      self.optimizer = declared.config(**shared)


def to_dict(cfg: Config) -> dict:
  """The config as JSON (``config.json``): every section, ``model.family`` first in its own."""
  out = dataclasses.asdict(cfg)
  out["model"] = family_lib.section_dict(cfg.model)
  return out


def model_of(cfg: Config) -> family_lib.LanguageModel:
  """The :class:`stablejax.modeling.family.LanguageModel` of a config's ``model`` section.

  Raises:
    ConfigError: the family is not registered.
  """
  try:
    return family_lib.build(cfg.model, cfg)
  except ValueError as e:
    raise ConfigError(str(e)) from None
