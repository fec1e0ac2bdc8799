"""Old module paths and names, kept for one release.

Modules that moved keep their old names for one release: an import of an old name returns the
very module of the new name (same object) with a DeprecationWarning, and ``python -m OLD`` runs
the new program. A finder on ``sys.meta_path`` does it, so no files are left at the old paths.

Names that moved out of a module that stays (``_MOVED_NAMES``) are found by that module's
``__getattr__``, which calls `moved_name`: ``from OLD import NAME`` returns the very object of
its new module, with a DeprecationWarning.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings
from typing import NamedTuple, Optional, Sequence


class _Moved(NamedTuple):
  module: str               # what `import OLD` returns now
  program: Optional[str]   # what `python -m OLD` runs now (None: it had no program)
  command: Optional[str]   # the command to use instead of `python -m OLD`


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
    "stablejax.training.model": _Moved("stablejax.modeling.gpt", None, None),
    "stablejax.training.bitnet": _Moved("stablejax.modeling.bitnet", None, None),
    "stablejax.muon.layout": _Moved("stablejax.layout.analysis", None, None),
    "stablejax.muon.heads": _Moved("stablejax.layout.heads", None, None),
    "stablejax.training.runs": _Moved("stablejax.training.trained_run", None, None),
    "stablejax.training.generate": _Moved("stablejax.training.decoding", None, None),
    "stablejax.quantize_eval": _Moved("stablejax.training.quantized_eval",
                                      "stablejax.cli.quantize_eval",
                                      "python -m stablejax quantize-eval"),
}


_DATA = "stablejax.data."
_TRANSFORMS = "stablejax.transforms."
_LAYOUT = "stablejax.layout."
_MUON = "stablejax.muon."
# Module that stays -> {name that moved out of it: the module it lives in now, or
# "module:new_name" for a name that was renamed too}.
_MOVED_NAMES: dict[str, dict[str, str]] = {
    _DATA + "pipeline": {
        **dict.fromkeys(("PREPARED_META", "PREPARED_FORMAT", "PREPARED_MARKER", "read_prepared",
                         "prepared_vocab_size", "scan_tokens", "prepared_file"),
                        _DATA + "prepared"),
        **dict.fromkeys(("TEXT_SUFFIXES", "TEXT_DOC_BYTES", "BIN_DOC_TOKENS", "data_tokenizer"),
                        _DATA + "sources"),
        **dict.fromkeys(("IDENTITY_FORMAT", "HASH_LIMIT", "data_identity",
                         "identity_difference"), _DATA + "identity"),
        "garbage_batch": "stablejax.training.batches",
    },
    _MUON + "muon": {
        **dict.fromkeys(("OUTLIER_METHODS", "IQR_EXACT_MAX", "clamp_outliers"), _MUON + "outliers"),
        **dict.fromkeys(("DEFAULT_NS_STEPS", "OutlierSafeMuonState", "ns_health", "shape_scale",
                         "scale_by_outlier_safe_muon"), _MUON + "direction"),
        **dict.fromkeys(("TensorGuardState", "skip_nonfinite_tensors"),
                        "stablejax.transforms.nonfinite_tensors"),
    },
    _MUON + "routing": {
        **dict.fromkeys(("GROUPS", "pure", "default_labels", "label_params"), _MUON + "labels"),
        **dict.fromkeys(("MuonDimensionNumbers", "DIMENSION_TYPES", "LAST_TWO_AXES",
                         "ATTENTION_QKV", "check_dims", "matrix_shape", "to_matrices",
                         "split_fused", "part_shapes"), _MUON + "matrices"),
        **dict.fromkeys(("Note", "warn_notes"), _MUON + "notes"),
    },
    _DATA + "prepare": {
        "TEXT_FIELD": _DATA + "config",
        **dict.fromkeys(("JSON_SUFFIXES", "PARQUET_SUFFIXES", "TEXT_SUFFIXES", "input_files"),
                        _DATA + "inputs"),
        **dict.fromkeys(("BATCH_BYTES", "BATCH_DOCS", "is_val"), _DATA + "encode"),
        "PARTIAL": _DATA + "out_dir",
    },
    _TRANSFORMS + "skipping": {
        **dict.fromkeys(("SkipNonFiniteState", "skip_nonfinite", "SkipNonFiniteConfig",
                         "SKIP_NONFINITE"), _TRANSFORMS + "finite_skip"),
        **dict.fromkeys(("SkipSpikesState", "skip_spikes", "window_stats", "log_sigma_threshold",
                         "SkipSpikesConfig", "SKIP_SPIKES"), _TRANSFORMS + "spike_skip"),
    },
    _LAYOUT + "analysis": {
        **dict.fromkeys(("AxisName", "axis_names_of", "OUT_IN"), _LAYOUT + "leaves"),
        **dict.fromkeys(("HEADS", "HEAD_DIM", "MLP", "STACK", "EXPERT", "FUSED", "FUSED_FEATURES",
                         "fused_parts_of_name", "PROJECTION_NAMES", "projection_name",
                         "component_name"), _LAYOUT + "names"),
        **dict.fromkeys(("MuonDimensionNumbers", "orientations"), _LAYOUT + "orientation"),
        "Projection": _LAYOUT + "attention",
    },
    "stablejax.training.loop": {"Run": "stablejax.training.loop:Trainer"},
    "stablejax.training.components": {"build": "stablejax.training.components:build_components"},
}


def moved_name(module: str, name: str) -> object:
  """``module.name`` where it lives now, with a DeprecationWarning at the importer's line.

  A module that names moved out of calls it from its ``__getattr__``.

  Raises:
    AttributeError: ``module`` has no ``name`` and never had (as for any missing attribute).
  """
  new = _MOVED_NAMES.get(module, {}).get(name)
  if new is None:
    raise AttributeError(f"module {module!r} has no attribute {name!r}")
  # stacklevel 3: past this function and the module's __getattr__, at the import or the access.
  new_module, _, new_name = new.partition(":")
  new_name = new_name or name
  instead = (f"use {new_module}.{new_name}" if new_name != name else
             f"import it from {new_module}")
  warnings.warn(f"{module}.{name} is deprecated and will be removed in the next release: "
                f"{instead} instead", DeprecationWarning, stacklevel=3)
  return getattr(importlib.import_module(new_module), new_name)


class _MovedModuleLoader(importlib.abc.Loader):
  """Loads an old module name as the module it moved to; runs the new program for ``-m``."""

  def __init__(self, old: str, moved: _Moved) -> None:
    self.old, self.moved = old, moved

  def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
    return None  # a placeholder: exec_module puts the real module in its place

  def exec_module(self, module: types.ModuleType) -> None:
    warnings.warn(f"{self.old} is deprecated and will be removed in the next release: import "
                   f"{self.moved.module} instead", DeprecationWarning, stacklevel=2)
    # The import system returns what sys.modules holds after exec_module: the new module itself.
    sys.modules[self.old] = importlib.import_module(self.moved.module)

  def get_code(self, fullname: str) -> Optional[types.CodeType]:
    """The code `python -m OLD` runs (runpy asks the loader for it): the new program's."""
    target = self.moved.program or self.moved.module
    spec = importlib.util.find_spec(target)
    if spec is None or not isinstance(spec.loader, importlib.abc.InspectLoader):
      # Only a broken install lacks the new module or a loader that can give its code.
      raise ImportError(f"cannot run {target}, the new home of {self.old}: reinstall stablejax",
                        name=target)
    if self.moved.command:
      # Attributed to __main__, the program being run, so Python's default filters show it.
      warnings.warn_explicit(f"python -m {self.old} is deprecated and will be removed in the "
                              f"next release: use {self.moved.command}", DeprecationWarning,
                              filename=spec.origin or target, lineno=0, module="__main__")
    return spec.loader.get_code(target)


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
  """Finds the old module names of ``_MOVED`` (and nothing else)."""

  stablejax_moved_modules = True

  def find_spec(self, fullname: str, path: Optional[Sequence[str]] = None,
                target: Optional[types.ModuleType] = None
                ) -> Optional[importlib.machinery.ModuleSpec]:
    moved = _MOVED.get(fullname)
    if moved is None:
      return None
    new_spec = importlib.util.find_spec(moved.program or moved.module)
    # Without the new module (a broken install) exec_module's import names what is missing.
    origin = new_spec.origin if new_spec is not None else None
    return importlib.util.spec_from_loader(fullname, _MovedModuleLoader(fullname, moved),
                                            origin=origin)


# First on the path, so a stale file left at an old path (an old install) cannot shadow the alias;
# a reload of stablejax replaces its earlier finder.
sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "stablejax_moved_modules", False)]
sys.meta_path.insert(0, _MovedModuleFinder())
