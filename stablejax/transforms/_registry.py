"""The built-in declarations of a package (the trainer's defences, its model families), found
on disk and registered the first time a registry is asked, not as a side effect of an import.

Here, on the lowest floor both registries may import from (transforms/ below modeling/)."""

from __future__ import annotations

import importlib
import pkgutil
import types
from pathlib import Path
from typing import Any, Callable


class Builtins:
  """Registers the declarations of every module of one package, once, when :meth:`load` is
  first called.

  Args:
    package: the package's name (``"stablejax.transforms"``).
    folder: its folder on disk.
    register_module: registers the declarations of one module.
    skip: module names to leave out (the registry's own module); names starting with ``_`` are
      always left out.
  """

  def __init__(self, package: str, folder: Path | str,
               register_module: Callable[[types.ModuleType], Any], skip: tuple[str, ...] = ()):
    self.package, self.folder = package, Path(folder)
    self.register_module, self.skip = register_module, skip
    self.loaded = False

  def load(self) -> None:
    if self.loaded:
      return
    self.loaded = True
    for info in sorted(pkgutil.iter_modules([str(self.folder)]), key=lambda m: m.name):
      if not info.name.startswith("_") and info.name not in self.skip:
        self.register_module(importlib.import_module(f"{self.package}.{info.name}"))
