"""Plugins: a user's module declaring defences, model families or optimizers, used from the
command line.

``python -m stablejax train --plugin mydefs`` (repeatable) or a ``plugins`` list in the config
names modules to import before the config is read: each
:class:`stablejax.transforms.defence.Defence`, :class:`stablejax.transforms.defence.StepArgument`,
:class:`stablejax.modeling.family.ModelFamily` and
:class:`stablejax.training.config.optimizers.Optimizer` at a plugin's top level is registered, so
its ``stability.<name>`` section, its ``model.family`` or its ``optimizer.name`` exists when the
config is checked. The run records its plugins in ``config.json``; a resume, ``sample``,
``report`` and ``quantize-eval`` import them again from there. A plugin is a module name
importable from the current directory or ``PYTHONPATH`` (``mydefs``, ``mypackage.defences``) or a
path to a ``.py`` file (recorded as an absolute path). After torchtune's dotted-path components:
the user's code needs no edit of the library.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
from pathlib import Path
from typing import Iterable

from stablejax.data.paths import PathError, checked_path
from stablejax.modeling import family
from stablejax.training.config import optimizers
from stablejax.transforms import defence
from stablejax.transforms._registry import DeclarationError


class PluginError(ValueError):
  """A plugin that cannot be imported; the message names it, where it was listed, and the fix."""


class DeclarationRefused(PluginError):
  """A plugin whose declarations a registry refuses (a name another module declares, a section
  without ``enabled`` or a default, ...): the plugin, where it was listed, and the registry's
  line."""


_LOADED: dict[str, types.ModuleType] = {}


def normalise(name: str) -> str:
  """The form a plugin is recorded in: a ``.py`` path made absolute, a module name as given."""
  name = name.strip()
  if name.endswith(".py"):
    return str(Path(os.path.expanduser(name)).resolve())
  return name


def load(names: Iterable[str], where: str = "--plugin") -> list[types.ModuleType]:
  """Imports the plugins ``names`` (each once per process) and registers their declarations.

  Args:
    names: module names or ``.py`` paths.
    where: where the names came from, for the error (``--plugin``, ``runs/x/config.json``).

  Returns:
    The plugin modules, in order.

  Raises:
    PluginError: a plugin is not a string, is missing, or fails to import (one line naming it
      and the error); `DeclarationRefused` when it imports but a registry refuses what it
      declares.
  """
  modules = []
  for name in names:
    if not isinstance(name, str) or not name.strip():
      raise PluginError(f"plugins: {name!r} (from {where}) is not a module name or .py path")
    if name.strip().endswith(".py"):
      try:
        checked_path(name.strip())
      except PathError as e:
        raise PluginError(f"plugin {name.strip()!r} (from {where}): {e}") from None
    key = normalise(name)
    module = _LOADED.get(key)
    if module is None:
      module = _import(key, where)
      _LOADED[key] = module
    try:
      defence.register_module(module, key)
      family.register_module(module, key)
      optimizers.register_module(module, key)
    except DeclarationError as e:
      raise DeclarationRefused(f"plugin {key!r} (from {where}): {e}") from None
    modules.append(module)
  return modules


def _import(name: str, where: str) -> types.ModuleType:
  try:
    if name.endswith(".py"):
      path = Path(name)
      if not path.is_file():
        raise FileNotFoundError(f"no file {path}")
      spec = importlib.util.spec_from_file_location(f"stablejax_plugin_{path.stem}", path)
      assert spec is not None and spec.loader is not None
      module = importlib.util.module_from_spec(spec)
      sys.modules[spec.name] = module
      spec.loader.exec_module(module)
      return module
    cwd = os.getcwd()
    if cwd not in sys.path:  # the console script does not put it there; python -m does
      sys.path.append(cwd)
    return importlib.import_module(name)
  except SystemExit as e:  # it would end the program there, silently, with the plugin's code
    raise PluginError(
        f"plugin {name!r} (from {where}) called sys.exit({e.code!r}) while it was imported: "
        "remove the call from its top level (or put it under if __name__ == \"__main__\":)"
    ) from None
  except Exception as e:  # noqa: BLE001 - any failure of the user's module is its one line
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    raise PluginError(
        f"plugin {name!r} (from {where}) cannot be imported ({type(e).__name__}: {text}): make "
        "it importable from the current directory or PYTHONPATH, or pass the path of its .py "
        "file") from None
