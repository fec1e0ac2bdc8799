"""stablejax: training-stability transforms for optax and a self-healing LLM trainer."""

__version__ = "0.1.0"

# The public names are loaded on first use (PEP 562), so `import stablejax` and the `stablejax`
# command start without importing JAX: the command sets up its signal handling first, and
# `--help` answers at once. The first public name used imports all of them, as `import stablejax`
# did before, so what the package holds afterwards is the same.
import importlib as _importlib
from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any

if _TYPE_CHECKING:  # what static checkers and IDEs see: the names of _EXPORTS, imported eagerly
  # <!-- generated: public-names (python tools/generate.py, from _EXPORTS) -->
  from stablejax.modeling.losses import cross_entropy_with_z_loss as cross_entropy_with_z_loss
  from stablejax.transforms.adagc import AdaGCState as AdaGCState
  from stablejax.transforms.adagc import adagc as adagc
  from stablejax.transforms.hybrid import HybridClipState as HybridClipState
  from stablejax.transforms.hybrid import hybrid_clip as hybrid_clip
  from stablejax.transforms.loss_scaling import DynamicLossScale as DynamicLossScale
  from stablejax.transforms.metrics import register_state_metrics as register_state_metrics
  from stablejax.transforms.metrics import stability_metrics as stability_metrics
  from stablejax.transforms.finite_skip import SkipNonFiniteState as SkipNonFiniteState
  from stablejax.transforms.spike_skip import SkipSpikesState as SkipSpikesState
  from stablejax.transforms.finite_skip import skip_nonfinite as skip_nonfinite
  from stablejax.transforms.spike_skip import skip_spikes as skip_spikes
  from stablejax.transforms.qk_clip import QKClipState as QKClipState
  from stablejax.transforms.qk_clip import qk_clip as qk_clip
  from stablejax.transforms.zclip import ZClipState as ZClipState
  from stablejax.transforms.zclip import zclip as zclip
  from stablejax.transforms.update_clip import ClipUpdateRmsState as ClipUpdateRmsState
  from stablejax.transforms.update_clip import ZClipUpdateNormState as ZClipUpdateNormState
  from stablejax.transforms.update_clip import clip_update_rms as clip_update_rms
  from stablejax.transforms.update_clip import zclip_update_norm as zclip_update_norm
  from stablejax.transforms.compensated import CompensatedUpdatesState as CompensatedUpdatesState
  from stablejax.transforms.compensated import compensated_updates as compensated_updates
  from stablejax.transforms.hyperball import HyperballState as HyperballState
  from stablejax.transforms.hyperball import hyperball as hyperball
  from stablejax.muon.lr_check import check_learning_rates as check_learning_rates
  from stablejax.muon.muon import GroupUpdateRmsState as GroupUpdateRmsState
  from stablejax.muon.direction import OutlierSafeMuonState as OutlierSafeMuonState
  from stablejax.muon.muon import outlier_safe_muon as outlier_safe_muon
  from stablejax.muon.outliers import clamp_outlier_entries as clamp_outlier_entries
  from stablejax.muon.outliers import OutlierClampState as OutlierClampState
  from stablejax.muon.newton_schulz import newton_schulz as newton_schulz
  from stablejax.muon.describe import describe_routing as describe_routing
  from stablejax.muon.labels import label_params as label_params
  from stablejax.muon.routing import muon_dimension_numbers as muon_dimension_numbers
  from stablejax.layout.orientation import FusedDimensionNumbers as FusedDimensionNumbers
  from stablejax.modeling.utils import init_new_token_embeddings as init_new_token_embeddings
  from stablejax.modeling.utils import lambda_warmup as lambda_warmup
  from stablejax.modeling.utils import excess_kurtosis as excess_kurtosis
  from stablejax.modeling.utils import merge_emb_proj as merge_emb_proj
  from stablejax.modeling.utils import quantize_weights_rtn as quantize_weights_rtn
  from stablejax.modeling.attention import attention_logit_max as attention_logit_max
  from stablejax.modeling.attention import collect_attention_logits as collect_attention_logits
  from stablejax.modeling.attention import sow_attention_logits as sow_attention_logits
  from stablejax.modeling.probes import AttentionProbe as AttentionProbe
  from stablejax.modeling.probes import hf_attention_probe as hf_attention_probe
  from stablejax.modeling.probes import mha_with_max_logit as mha_with_max_logit
  from stablejax.monitor import AttentionLogitThresholds as AttentionLogitThresholds
  from stablejax.monitor import HealthThresholds as HealthThresholds
  from stablejax.monitor import StabilityMonitor as StabilityMonitor
  from stablejax.monitor import grad_health_level as grad_health_level
  from stablejax.monitor import movement_record as movement_record
  from stablejax.monitor import movement_warnings as movement_warnings
  from stablejax.monitor import param_dtypes as param_dtypes
  from stablejax.monitor import param_movement as param_movement
  from stablejax.monitor import per_layer_grad_norms as per_layer_grad_norms
  from stablejax.monitor import stability_score as stability_score
  from stablejax.monitor import tensorboard_scalars as tensorboard_scalars
  from stablejax.monitor import UpdateNormThresholds as UpdateNormThresholds
  from stablejax.training.loop.train_state import apply_gradients as apply_gradients
  # <!-- end generated: public-names -->

# The public names, each once: where it comes from, grouped as docs/api groups them. The lazy
# loader, __all__, the type checkers' imports above and tests/test_layout.py all read this.
_EXPORTS = {
    # --- transforms (gradient-side stability) ---
    "cross_entropy_with_z_loss": "stablejax.modeling.losses",
    "AdaGCState": "stablejax.transforms.adagc",
    "adagc": "stablejax.transforms.adagc",
    "HybridClipState": "stablejax.transforms.hybrid",
    "hybrid_clip": "stablejax.transforms.hybrid",
    "DynamicLossScale": "stablejax.transforms.loss_scaling",
    "register_state_metrics": "stablejax.transforms.metrics",
    "stability_metrics": "stablejax.transforms.metrics",
    "SkipNonFiniteState": "stablejax.transforms.finite_skip",
    "SkipSpikesState": "stablejax.transforms.spike_skip",
    "skip_nonfinite": "stablejax.transforms.finite_skip",
    "skip_spikes": "stablejax.transforms.spike_skip",
    "QKClipState": "stablejax.transforms.qk_clip",
    "qk_clip": "stablejax.transforms.qk_clip",
    "ZClipState": "stablejax.transforms.zclip",
    "zclip": "stablejax.transforms.zclip",
    "ClipUpdateRmsState": "stablejax.transforms.update_clip",
    "ZClipUpdateNormState": "stablejax.transforms.update_clip",
    "clip_update_rms": "stablejax.transforms.update_clip",
    "zclip_update_norm": "stablejax.transforms.update_clip",
    "CompensatedUpdatesState": "stablejax.transforms.compensated",
    "compensated_updates": "stablejax.transforms.compensated",
    "HyperballState": "stablejax.transforms.hyperball",
    "hyperball": "stablejax.transforms.hyperball",
    # --- end transforms ---
    # --- muon ---
    "check_learning_rates": "stablejax.muon.lr_check",
    "GroupUpdateRmsState": "stablejax.muon.muon",
    "OutlierSafeMuonState": "stablejax.muon.direction",
    "outlier_safe_muon": "stablejax.muon.muon",
    "clamp_outlier_entries": "stablejax.muon.outliers",
    "OutlierClampState": "stablejax.muon.outliers",
    "newton_schulz": "stablejax.muon.newton_schulz",
    "describe_routing": "stablejax.muon.describe",
    "label_params": "stablejax.muon.labels",
    "muon_dimension_numbers": "stablejax.muon.routing",
    "FusedDimensionNumbers": "stablejax.layout.orientation",
    # --- end muon ---
    # --- model utilities ---
    "init_new_token_embeddings": "stablejax.modeling.utils",
    "lambda_warmup": "stablejax.modeling.utils",
    "excess_kurtosis": "stablejax.modeling.utils",
    "merge_emb_proj": "stablejax.modeling.utils",
    "quantize_weights_rtn": "stablejax.modeling.utils",
    "attention_logit_max": "stablejax.modeling.attention",
    "collect_attention_logits": "stablejax.modeling.attention",
    "sow_attention_logits": "stablejax.modeling.attention",
    "AttentionProbe": "stablejax.modeling.probes",
    "hf_attention_probe": "stablejax.modeling.probes",
    "mha_with_max_logit": "stablejax.modeling.probes",
    # --- end model utilities ---
    # --- monitoring ---
    "AttentionLogitThresholds": "stablejax.monitor",
    "HealthThresholds": "stablejax.monitor",
    "StabilityMonitor": "stablejax.monitor",
    "grad_health_level": "stablejax.monitor",
    "movement_record": "stablejax.monitor",
    "movement_warnings": "stablejax.monitor",
    "param_dtypes": "stablejax.monitor",
    "param_movement": "stablejax.monitor",
    "per_layer_grad_norms": "stablejax.monitor",
    "stability_score": "stablejax.monitor",
    "tensorboard_scalars": "stablejax.monitor",
    "UpdateNormThresholds": "stablejax.monitor",
    # --- end monitoring ---
    # --- training loops ---
    "apply_gradients": "stablejax.training.loop.train_state",
    # --- end training loops ---
}
# Subpackages that loading the public names binds on the package (`stablejax.muon` ...).
_SUBPACKAGES = ("data", "layout", "modeling", "monitor", "muon", "training", "transforms")
# Names of this loader, which dir() leaves out so that it lists what the package offers.
_LOADER_NAMES = {"_importlib", "_TYPE_CHECKING", "_Any", "_EXPORTS", "_SUBPACKAGES",
                 "_LOADER_NAMES", "_load_public_names", "__getattr__", "__dir__"}

__all__ = ["__version__", *_EXPORTS]


def _load_public_names() -> None:
  for name, module in _EXPORTS.items():
    globals()[name] = getattr(_importlib.import_module(module), name)


def __getattr__(name: str) -> _Any:
  """A public name (or a subpackage the public names bring) on first use: loads them all."""
  if name in _EXPORTS or name in _SUBPACKAGES:
    _load_public_names()
    return globals()[name]  # a subpackage is bound on the package by its import
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
  return sorted((set(globals()) - _LOADER_NAMES) | set(_EXPORTS) | set(_SUBPACKAGES))

