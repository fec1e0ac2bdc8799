"""Run configuration: one dataclass per section, loaded from JSON, overridable from the command
line, checked.

The sections (:mod:`.sections`), loading a file with overrides and plugins (:mod:`.loading`), the
keys of stablejax 0.1 (:mod:`.legacy`) and the checks (:mod:`.checks`: validation, keys without
effect, what changed between two starts). Unknown keys and values of the wrong type are errors
(`ConfigError`, one line naming the key and the fix), never silently ignored: a typo in a
learning-rate key must not train with the default.

Example:
  >>> from stablejax.training.config import Config, load_config
  >>> cfg = load_config(None, ["model.n_layers=2", "optimizer.name=adamw"])
  >>> isinstance(cfg, Config), cfg.model.n_layers, cfg.optimizer.name
  (True, 2, 'adamw')
"""

from stablejax.training.config.sections import (CheckpointConfig, Config, ConfigError,
                                                DeterminismConfig, FaultsConfig, LoggingConfig,
                                                LossScaleConfig, MeshConfig,
                                                RecoveryConfig, ReplicasConfig, StabilitySections,
                                                TrainConfig, WatchdogConfig, model_of,
                                                model_section_class,
                                                stability_config_class, to_dict)
from stablejax.training.config.optimizers import (AdamWConfig, MuonConfig, Optimizer,
                                                  OptimizerConfig, OptimizerContext)
from stablejax.training.config.legacy import is_v0_1, translate_v0_1
from stablejax.training.config.checks import changed_keys, ineffective_keys, validate
from stablejax.training.config.loading import (apply_overrides, config_from_dict, config_name,
                                               config_path, flat_keys, load_config, load_plugins,
                                               load_run_file, packaged_configs, recorded_plugins)

__all__ = [
    "AdamWConfig", "CheckpointConfig", "Config", "ConfigError", "DeterminismConfig", "FaultsConfig",
    "LoggingConfig", "LossScaleConfig", "MeshConfig", "MuonConfig", "Optimizer",
    "OptimizerConfig", "OptimizerContext", "RecoveryConfig",
    "ReplicasConfig", "StabilitySections", "TrainConfig", "WatchdogConfig",
    "apply_overrides", "changed_keys", "config_from_dict", "config_name", "config_path",
    "flat_keys", "ineffective_keys", "is_v0_1", "load_config", "load_plugins", "load_run_file",
    "model_of", "model_section_class", "packaged_configs", "recorded_plugins",
    "stability_config_class", "to_dict", "translate_v0_1", "validate",
]
