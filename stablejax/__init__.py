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
]


# --- old import paths (deprecated; removed in the next release) ---
# Modules that moved keep their old names for one release: an import of an old name returns the
# very module of the new name (same object) with a DeprecationWarning, and `python -m OLD` runs the
# new program. A finder on sys.meta_path does it, so no files are left at the old paths.
import importlib as _importlib
import importlib.abc as _importlib_abc
import importlib.machinery as _importlib_machinery
import importlib.util as _importlib_util
import sys as _sys
import types as _types
import warnings as _warnings
from typing import NamedTuple as _NamedTuple
from typing import Optional as _Optional
from typing import Sequence as _Sequence


class _Moved(_NamedTuple):
  module: str               # what `import OLD` returns now
  program: _Optional[str]   # what `python -m OLD` runs now (None: it had no program)
  command: _Optional[str]   # the command to use instead of `python -m OLD`


_MOVED = {
    "stablejax.losses": _Moved("stablejax.modeling.losses", None, None),
    "stablejax.model_utils": _Moved("stablejax.modeling.utils", None, None),
    "stablejax.tokenizer": _Moved("stablejax.data.tokenizer", None, None),
    "stablejax.training.data": _Moved("stablejax.data.pipeline", None, None),
    "stablejax.prepare": _Moved("stablejax.data.prepare", "stablejax.cli.prepare",
                                "python -m stablejax prepare"),
    "stablejax.sample": _Moved("stablejax.training.sampling", "stablejax.cli.sample",
                               "python -m stablejax sample"),
    "stablejax.report": _Moved("stablejax.monitor.report", "stablejax.cli.report",
                               "python -m stablejax report"),
    "stablejax.launch": _Moved("stablejax.training.launch", "stablejax.cli.launch",
                               "python -m stablejax launch"),
    "stablejax.quantize_eval": _Moved("stablejax.training.quantized_eval",
                                      "stablejax.cli.quantize_eval",
                                      "python -m stablejax quantize-eval"),
}


class _MovedModuleLoader(_importlib_abc.Loader):
  """Loads an old module name as the module it moved to; runs the new program for ``-m``."""

  def __init__(self, old: str, moved: _Moved) -> None:
    self.old, self.moved = old, moved

  def create_module(self, spec: _importlib_machinery.ModuleSpec) -> None:
    return None  # a placeholder: exec_module puts the real module in its place

  def exec_module(self, module: _types.ModuleType) -> None:
    _warnings.warn(f"{self.old} is deprecated and will be removed in the next release: import "
                   f"{self.moved.module} instead", DeprecationWarning, stacklevel=2)
    # The import system returns what sys.modules holds after exec_module: the new module itself.
    _sys.modules[self.old] = _importlib.import_module(self.moved.module)

  def get_code(self, fullname: str) -> _Optional[_types.CodeType]:
    """The code `python -m OLD` runs (runpy asks the loader for it): the new program's."""
    target = self.moved.program or self.moved.module
    spec = _importlib_util.find_spec(target)
    if spec is None or not isinstance(spec.loader, _importlib_abc.InspectLoader):
      # Only a broken install lacks the new module or a loader that can give its code.
      raise ImportError(f"cannot run {target}, the new home of {self.old}: reinstall stablejax",
                        name=target)
    if self.moved.command:
      # Attributed to __main__, the program being run, so Python's default filters show it.
      _warnings.warn_explicit(f"python -m {self.old} is deprecated and will be removed in the "
                              f"next release: use {self.moved.command}", DeprecationWarning,
                              filename=spec.origin or target, lineno=0, module="__main__")
    return spec.loader.get_code(target)


class _MovedModuleFinder(_importlib_abc.MetaPathFinder):
  """Finds the old module names of ``_MOVED`` (and nothing else)."""

  stablejax_moved_modules = True

  def find_spec(self, fullname: str, path: _Optional[_Sequence[str]] = None,
                target: _Optional[_types.ModuleType] = None
                ) -> _Optional[_importlib_machinery.ModuleSpec]:
    moved = _MOVED.get(fullname)
    if moved is None:
      return None
    new_spec = _importlib_util.find_spec(moved.program or moved.module)
    # Without the new module (a broken install) exec_module's import names what is missing.
    origin = new_spec.origin if new_spec is not None else None
    return _importlib_util.spec_from_loader(fullname, _MovedModuleLoader(fullname, moved),
                                            origin=origin)


# First on the path, so a stale file left at an old path (an old install) cannot shadow the alias;
# a reload of stablejax replaces its earlier finder.
_sys.meta_path[:] = [f for f in _sys.meta_path if not getattr(f, "stablejax_moved_modules", False)]
_sys.meta_path.insert(0, _MovedModuleFinder())
# --- end old import paths ---
