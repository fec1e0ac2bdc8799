"""stablejax: training-stability transforms for optax and a self-healing LLM trainer."""

__version__ = "0.1.0"

# --- transforms (gradient-side stability) ---
# --- end transforms ---

# --- muon ---
# --- end muon ---

# --- model utilities ---
# --- end model utilities ---

# --- monitoring ---
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
    # --- end all monitoring ---
]
