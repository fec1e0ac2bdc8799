"""Old module paths, kept for one release.

Modules that moved keep their old names for one release: an import of an old name returns the
very module of the new name (same object) with a DeprecationWarning, and ``python -m OLD`` runs
the new program. A finder on ``sys.meta_path`` does it, so no files are left at the old paths.
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
    "stablejax.quantize_eval": _Moved("stablejax.training.quantized_eval",
                                      "stablejax.cli.quantize_eval",
                                      "python -m stablejax quantize-eval"),
}


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
