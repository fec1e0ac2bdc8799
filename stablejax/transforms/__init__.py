"""Gradient-side stability transforms (optax ``GradientTransformation``s).

Imported in chain order, so their metrics are registered (and listed by the monitor) in it.
"""

from stablejax.transforms import clip  # noqa: F401 (declares the trainer's stability.clip)
from stablejax.transforms.zclip import ZClipState
from stablejax.transforms.zclip import zclip
from stablejax.transforms.adagc import AdaGCState
from stablejax.transforms.adagc import adagc
from stablejax.transforms.update_clip import ClipUpdateRmsState
from stablejax.transforms.update_clip import ZClipUpdateNormState
from stablejax.transforms.update_clip import clip_update_rms
from stablejax.transforms.update_clip import zclip_update_norm
from stablejax.transforms.hybrid import HybridClipState
from stablejax.transforms.hybrid import hybrid_clip
from stablejax.transforms.loss_scaling import DynamicLossScale
from stablejax.transforms.loss_scaling import all_finite
from stablejax.transforms.metrics import register_state_metrics
from stablejax.transforms.metrics import stability_metrics
from stablejax.transforms.qk_clip import QKClipState
from stablejax.transforms.qk_clip import qk_clip
from stablejax.transforms.skipping import SkipNonFiniteState
from stablejax.transforms.skipping import SkipSpikesState
from stablejax.transforms.skipping import skip_nonfinite
from stablejax.transforms.skipping import skip_spikes
from stablejax.transforms.compensated import CompensatedUpdatesState
from stablejax.transforms.compensated import compensated_updates

__all__ = [
    "AdaGCState",
    "ClipUpdateRmsState",
    "CompensatedUpdatesState",
    "DynamicLossScale",
    "HybridClipState",
    "QKClipState",
    "SkipNonFiniteState",
    "SkipSpikesState",
    "ZClipState",
    "ZClipUpdateNormState",
    "adagc",
    "all_finite",
    "clip_update_rms",
    "compensated_updates",
    "hybrid_clip",
    "qk_clip",
    "register_state_metrics",
    "skip_nonfinite",
    "skip_spikes",
    "stability_metrics",
    "zclip",
    "zclip_update_norm",
]
