"""The flat stability keys of stablejax 0.1 and the nested keys that replaced them.

A config that uses one is an error naming its new key (:func:`old_key_message`); a run directory
written by 0.1 is translated (:func:`translate_v0_1`), so it still resumes.
"""

from __future__ import annotations

from typing import Any, Optional


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
