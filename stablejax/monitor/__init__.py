"""Stability monitoring: health levels, rates, one stability score, movement checks.

Everything here reads what the training step already computes:
:func:`stablejax.stability_metrics` of the optimizer state plus the loss and the
global gradient norm, fetched to the host every log interval (one
``metrics.jsonl`` train record). Two parts:

* Host side, pure Python: :class:`StabilityMonitor` turns a stream of records
  into sliding-window rates (ZClip spike and clip rate, AdaGC clipped-tensor
  rate, Muon outlier / Newton-Schulz instability / emergency fallback rates,
  skipped-step rate, rollbacks), a gradient health level
  (:func:`grad_health_level`), one score in ``[0, 1]``
  (:func:`stability_score`) and warning lines with troubleshooting advice.
* Device side, jittable: :func:`param_movement` (relative change of each
  parameter group and the size of its updates against the parameter dtype's
  resolution, which exposes learning rates that are too low and updates that
  underflow bf16 parameters) and :func:`per_layer_grad_norms` (for TensorBoard
  histograms). :func:`movement_warnings` reads the former on the host.

The score formula, the health levels and the troubleshooting table are
documented in ``docs/monitoring.md``; the numbers below are the same.

Example::

  monitor = stablejax.StabilityMonitor(window=100)
  for line in monitor.update(step, record):    # record: one train record
    print(line)
  record["health"] = monitor.level
  record["stability_score"] = monitor.score()

Modules: :mod:`~stablejax.monitor.health` (levels), :mod:`~stablejax.monitor.score` (score and
troubleshooting table), :mod:`~stablejax.monitor.stability_monitor` (the host-side monitor),
:mod:`~stablejax.monitor.movement` (parameter movement), :mod:`~stablejax.monitor.layers`
(per-layer gradient norms) and :mod:`~stablejax.monitor.tensorboard` (tag names). Every name is
importable from ``stablejax.monitor`` directly.
"""

from stablejax.monitor._numbers import _as_float  # noqa: F401 (stablejax.monitor.report uses it)
from stablejax.monitor.health import HEALTH_LEVELS
from stablejax.monitor.health import AttentionLogitThresholds
from stablejax.monitor.health import HealthThresholds
from stablejax.monitor.health import grad_health_level
from stablejax.monitor.health import health_code
from stablejax.monitor.layers import STACKED_NAMES
from stablejax.monitor.layers import per_layer_grad_norms
from stablejax.monitor.movement import default_group
from stablejax.monitor.movement import movement_record
from stablejax.monitor.movement import movement_warnings
from stablejax.monitor.movement import param_dtypes
from stablejax.monitor.movement import param_movement
from stablejax.monitor.movement import path_str
from stablejax.monitor.score import PLATEAU_ADVICE
from stablejax.monitor.score import SCORE_BUDGETS
from stablejax.monitor.score import SCORE_PENALTY_AT_BUDGET
from stablejax.monitor.score import TROUBLESHOOTING
from stablejax.monitor.score import stability_score
from stablejax.monitor.score import troubleshooting_advice
from stablejax.monitor.stability_monitor import StabilityMonitor
from stablejax.monitor.tensorboard import tensorboard_scalars
from stablejax.monitor.update_norm import UpdateNormThresholds


__all__ = [
    "AttentionLogitThresholds",
    "HEALTH_LEVELS",
    "HealthThresholds",
    "PLATEAU_ADVICE",
    "SCORE_BUDGETS",
    "SCORE_PENALTY_AT_BUDGET",
    "STACKED_NAMES",
    "StabilityMonitor",
    "TROUBLESHOOTING",
    "default_group",
    "grad_health_level",
    "health_code",
    "movement_record",
    "movement_warnings",
    "param_dtypes",
    "param_movement",
    "path_str",
    "per_layer_grad_norms",
    "stability_score",
    "tensorboard_scalars",
    "troubleshooting_advice",
    "UpdateNormThresholds",
]
