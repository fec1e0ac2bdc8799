"""stablejax: training-stability transforms for optax and a self-healing LLM trainer."""

__version__ = "0.1.0"

# --- transforms (gradient-side stability) ---
from stablejax.modeling.losses import cross_entropy_with_z_loss
from stablejax.transforms.adagc import AdaGCState
from stablejax.transforms.adagc import adagc
from stablejax.transforms.hybrid import HybridClipState
from stablejax.transforms.hybrid import hybrid_clip
from stablejax.transforms.loss_scaling import DynamicLossScale
from stablejax.transforms.metrics import register_state_metrics
from stablejax.transforms.metrics import stability_metrics
from stablejax.transforms.skipping import SkipNonFiniteState
from stablejax.transforms.skipping import SkipSpikesState
from stablejax.transforms.skipping import skip_nonfinite
from stablejax.transforms.skipping import skip_spikes
from stablejax.transforms.qk_clip import QKClipState
from stablejax.transforms.qk_clip import qk_clip
from stablejax.transforms.zclip import ZClipState
from stablejax.transforms.zclip import zclip
# --- end transforms ---

# --- muon ---
from stablejax.muon.lr_check import check_learning_rates
from stablejax.muon.muon import GroupUpdateRmsState
from stablejax.muon.muon import OutlierSafeMuonState
from stablejax.muon.muon import outlier_safe_muon
from stablejax.muon.newton_schulz import newton_schulz
from stablejax.muon.describe import describe_routing
from stablejax.muon.routing import label_params
from stablejax.muon.routing import muon_dimension_numbers
from stablejax.layout.analysis import FusedDimensionNumbers
# --- end muon ---

# --- model utilities ---
from stablejax.modeling.utils import init_new_token_embeddings
from stablejax.modeling.utils import lambda_warmup
from stablejax.modeling.utils import excess_kurtosis
from stablejax.modeling.utils import merge_emb_proj
from stablejax.modeling.utils import quantize_weights_rtn
from stablejax.modeling.attention import attention_logit_max
from stablejax.modeling.attention import collect_attention_logits
from stablejax.modeling.attention import sow_attention_logits
from stablejax.modeling.probes import AttentionProbe
from stablejax.modeling.probes import hf_attention_probe
from stablejax.modeling.probes import mha_with_max_logit
# --- end model utilities ---

# --- monitoring ---
from stablejax.monitor import AttentionLogitThresholds
from stablejax.monitor import HealthThresholds
from stablejax.monitor import StabilityMonitor
from stablejax.monitor import grad_health_level
from stablejax.monitor import movement_record
from stablejax.monitor import movement_warnings
from stablejax.monitor import param_dtypes
from stablejax.monitor import param_movement
from stablejax.monitor import per_layer_grad_norms
from stablejax.monitor import stability_score
from stablejax.monitor import tensorboard_scalars
# --- end monitoring ---

# --- training loops ---
from stablejax.training.train_state import apply_gradients
# --- end training loops ---

__all__ = [
    "__version__",
    # --- all transforms ---
    "AdaGCState",
    "DynamicLossScale",
    "HybridClipState",
    "QKClipState",
    "SkipNonFiniteState",
    "SkipSpikesState",
    "ZClipState",
    "adagc",
    "cross_entropy_with_z_loss",
    "hybrid_clip",
    "qk_clip",
    "register_state_metrics",
    "skip_nonfinite",
    "skip_spikes",
    "stability_metrics",
    "zclip",
    # --- end all transforms ---
    # --- all muon ---
    "GroupUpdateRmsState",
    "OutlierSafeMuonState",
    "check_learning_rates",
    "describe_routing",
    "label_params",
    "muon_dimension_numbers",
    "FusedDimensionNumbers",
    "newton_schulz",
    "outlier_safe_muon",
    # --- end all muon ---
    # --- all model utilities ---
    "init_new_token_embeddings",
    "lambda_warmup",
    "excess_kurtosis",
    "merge_emb_proj",
    "quantize_weights_rtn",
    "attention_logit_max",
    "collect_attention_logits",
    "sow_attention_logits",
    "AttentionProbe",
    "hf_attention_probe",
    "mha_with_max_logit",
    # --- end all model utilities ---
    # --- all monitoring ---
    "AttentionLogitThresholds",
    "HealthThresholds",
    "StabilityMonitor",
    "grad_health_level",
    "movement_record",
    "movement_warnings",
    "param_dtypes",
    "param_movement",
    "per_layer_grad_norms",
    "stability_score",
    "tensorboard_scalars",
    # --- end all monitoring ---
    # --- all training loops ---
    "apply_gradients",
    # --- end all training loops ---
]

# Old module paths keep working for one release (stablejax/_compat.py).
from stablejax import _compat  # noqa: E402,F401
