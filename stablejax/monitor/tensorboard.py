"""TensorBoard tag names for metrics.jsonl records and monitor rates."""

from __future__ import annotations

from typing import Any, Mapping, Optional

from stablejax.monitor import specs
from stablejax.monitor._numbers import _as_float
from stablejax.monitor.health import health_code


_TOP_LEVEL_TAGS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_sec": "train/tokens_per_sec",
    "val_loss": "eval/loss",
    "stability_score": "stability/score",
    "act_rms": "activations/rms",
    "act_max": "activations/max",
    "logit_max": "activations/logit_max",
    "excess_kurtosis": "activations/excess_kurtosis",
    "lambda": "train/quant_lambda",
    "attn_logit_max": "attention/max_logit",
    "output_logit_max": "output_logits/max",
    "output_log_z_mean": "output_logits/log_z_mean",
    "output_log_z_max": "output_logits/log_z_max",
}
_LOSS_SCALE_PREFIX = "loss_scale/"  # the fp16 loss scale's keys, logged by the train step
_DETERMINISM_PREFIX = "determinism/"  # the trainer's determinism check (stability.determinism)


def tensorboard_scalars(record: Mapping[str, Any],
                        rates: Optional[Mapping[str, Any]] = None) -> dict[str, float]:
  """Maps one ``metrics.jsonl`` record (and optional monitor rates) to TensorBoard tags.

  Tags: ``train/loss``, ``train/lr``, ``train/grad_norm``,
  ``train/tokens_per_sec``, ``train/quant_lambda``, ``eval/loss``;
  ``stability/<metric key>`` for every ``stability_metrics`` key of a registered state
  (:func:`stablejax.register_state_metrics`; e.g. ``stability/zclip/grad_norm``,
  ``stability/muon/update_rms/adam``);
  ``stability/score``; ``health/level`` (-1 low, 0 healthy, 1 high,
  2 critical, 3 exploded); ``movement/<group>`` and
  ``movement/<group>/<ratio>`` for ``param_move/...``;
  ``activations/{rms,max,logit_max,excess_kurtosis}``;
  ``attention/max_logit`` and ``attention/max_logit/layer_<i>[/head_<h>]`` for the
  attention-logit telemetry; ``output_logits/{max,log_z_mean,log_z_max}``;
  ``stability/qk_clip/...`` for QK-clip's metrics;
  ``stability/rate/<name>`` for each monitor rate; ``stability/determinism/...`` for the
  trainer's determinism check; ``events/<event>`` = 1 for event records (a replay's also
  ``events/replay/<verdict>``); ``other/<key>`` for any other numeric key. Booleans
  become 0/1, strings (other than ``health``) and ``step`` are dropped, as
  are non-numeric values. Non-finite values are kept (the caller decides).

  Args:
    record: one train, eval or event record.
    rates: optional :meth:`StabilityMonitor.rates` to add as
      ``stability/rate/<name>``.

  Returns:
    ``{tag: float}``.

  Example:
    >>> from stablejax import tensorboard_scalars
    >>> tensorboard_scalars({"step": 10, "loss": 2.5, "lr": 1e-3, "zclip/grad_norm": 0.7,
    ...                      "health": "healthy"})
    {'train/loss': 2.5, 'train/lr': 0.001, 'stability/zclip/grad_norm': 0.7, 'health/level': 0.0}
  """
  out: dict[str, float] = {}
  stability_prefixes = specs.prefixes() + (_LOSS_SCALE_PREFIX, _DETERMINISM_PREFIX)
  if "event" in record:
    out[f"events/{record['event']}"] = 1.0
    if isinstance(record.get("verdict"), str):
      out[f"events/{record['event']}/{record['verdict']}"] = 1.0
  for key, value in record.items():
    if key in ("step", "event", "cause"):
      continue
    if key == "health":
      out["health/level"] = health_code(value if isinstance(value, str) else None)
      continue
    v = _as_float(value)
    if v is None:
      continue
    if key in _TOP_LEVEL_TAGS:
      out[_TOP_LEVEL_TAGS[key]] = v
    elif key.startswith(stability_prefixes):
      out[f"stability/{key}"] = v
    elif key.startswith("param_move/"):
      out["movement/" + key[len("param_move/"):]] = v
    elif key.startswith("attn_logit_max/"):
      out["attention/max_logit/" + key[len("attn_logit_max/"):]] = v
    else:
      out[f"other/{key}"] = v
  for name, value in (rates or {}).items():
    v = _as_float(value)
    if v is not None:
      out[f"stability/rate/{name}"] = v
  return out
