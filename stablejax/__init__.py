"""stablejax: training-stability transforms for optax and a self-healing LLM trainer."""

__version__ = "0.1.0"

# --- transforms (gradient-side stability) ---
# --- end transforms ---

# --- muon ---
# --- end muon ---

# --- model utilities ---
# --- end model utilities ---

# --- monitoring ---
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

__all__ = [
    "__version__",
    # --- all transforms ---
    # --- end all transforms ---
    # --- all muon ---
    # --- end all muon ---
    # --- all model utilities ---
    # --- end all model utilities ---
    # --- all monitoring ---
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
]
