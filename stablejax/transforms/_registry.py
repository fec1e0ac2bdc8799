"""What the registries of declarations share (the trainer's defences and step arguments, its model
families): one declaration per name, each from one module, and the built-in declarations of a
package found on disk and registered the first time a registry is asked, not as a side effect of
an import.

Here, on the lowest floor both registries may import from (transforms/ below modeling/)."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import types
from typing import Any, Callable, Generic, Iterator, Optional, TypeVar

Declaration = TypeVar("Declaration")


# How many times a registry of this process changed (a declaration added or removed): what a memo
# of things built from the declarations compares, so that a plugin loaded since is never missed.
_generation = 0


def generation() -> int:
  """The number of changes to any registry in this process so far (see :func:`changed`)."""
  return _generation


def changed() -> None:
  """Records that a registry changed: what was built from the declarations before may differ."""
  global _generation
  _generation += 1


class DeclarationError(ValueError):
  """A declaration a registry refuses: a name declared twice, or a declaration that is not
  usable as written; one line naming it (and both modules) and the fix."""


def package_modules(package: str, skip: tuple[str, ...] = ()) -> list[types.ModuleType]:
  """Imports every module of ``package`` found on disk (every folder of its ``__path__``), by
  name; names starting with ``_`` and those in ``skip`` are left out."""
  folders = [str(f) for f in importlib.import_module(package).__path__]
  names = sorted({info.name for info in pkgutil.iter_modules(folders)})
  return [importlib.import_module(f"{package}.{name}") for name in names
          if not name.startswith("_") and name not in skip]


class Builtins:
  """Registers the declarations of every module of one package (:func:`package_modules`), once,
  when :meth:`load` is first called: a module added to the package declares its defence or
  family by being there, with no list to edit.

  Args:
    package: the package's name (``"stablejax.transforms"``).
    register_module: registers the declarations of one module.
    skip: module names to leave out (the registry's own module); names starting with ``_`` are
      always left out.
  """

  def __init__(self, package: str, register_module: Callable[[types.ModuleType], Any],
               skip: tuple[str, ...] = ()):
    self.package, self.register_module, self.skip = package, register_module, skip
    self.loaded = False

  def load(self) -> None:
    if self.loaded:
      return
    self.loaded = True
    for module in package_modules(self.package, self.skip):
      self.register_module(module)


class Registry(Generic[Declaration]):
  """Declarations by name. A name is declared once: the same declaration registered again (a
  module imported under two names that both hold it, a plugin loaded twice) is the same one, but
  another declaration under a registered name is refused, naming both modules, whichever module
  came first. Nothing is replaced silently: a plugin named like a built-in would otherwise change
  what a run that never named the plugin's keys trains with.

  Args:
    kind: what is declared, for the messages (``"defence"``, ``"model family"``).
    name_is: what the name is besides, for the fix (``"a config section, stability.<name>"``).
    load_builtins: registers the built-in declarations, called before anything is added or
      asked (so a user's declaration is always the second of its name); None: the caller
      loads them.

  Example:
    >>> from stablejax.transforms._registry import DeclarationError, Registry
    >>> colours = Registry("colour", "a key of the palette", load_builtins=lambda: None)
    >>> red = object()
    >>> colours.add("red", red, "palette.basic")
    >>> colours.add("red", red, "palette.basic")  # the same declaration again: no change
    >>> try:
    ...   colours.add("red", object(), "my_colours")
    ... except DeclarationError as e:
    ...   print(e)
    colour 'red' is declared twice, by palette.basic and by my_colours: give the second another
    name (the name is a key of the palette)
  """

  def __init__(self, kind: str, name_is: str, load_builtins: Optional[Callable[[], None]]):
    self.kind, self.name_is = kind, name_is
    self.load_builtins = load_builtins or (lambda: None)
    self._entries: dict[str, tuple[Declaration, str]] = {}

  def add(self, name: str, declaration: Declaration, origin: str) -> None:
    """Registers ``declaration`` under ``name``, declared by ``origin`` (a module's name or a
    plugin's path).

    Raises:
      DeclarationError: another declaration holds ``name``.
    """
    self.load_builtins()
    held = self._entries.get(name)
    if held is not None and held[0] is not declaration:
      raise DeclarationError(
          f"{self.kind} {name!r} is declared twice, by {held[1]} and by {origin}: give the "
          f"second another name (the name is {self.name_is})")
    if held is None:
      self._entries[name] = (declaration, origin)
      changed()

  def remove(self, name: str) -> None:
    """Forgets ``name`` (a no-op for an unknown one)."""
    self.load_builtins()
    if self._entries.pop(name, None) is not None:
      changed()

  def get(self, name: str) -> Optional[Declaration]:
    self.load_builtins()
    held = self._entries.get(name)
    return held[0] if held is not None else None

  def values(self) -> list[Declaration]:
    self.load_builtins()
    return [declaration for declaration, _ in self._entries.values()]

  def by_name(self) -> tuple[Declaration, ...]:
    """Every declaration, sorted by its registered name."""
    self.load_builtins()
    return tuple(self._entries[name][0] for name in sorted(self._entries))

  def names(self) -> Iterator[str]:
    self.load_builtins()
    return iter(sorted(self._entries))

  def __contains__(self, name: object) -> bool:  # without loading the built-ins: what is in now
    return name in self._entries


def section_fields(config: Any, owner: str) -> set[str]:
  """The field names of a declaration's config section, once it is usable as a section: a
  dataclass whose every field has a default (the trainer builds the section with no arguments,
  then sets what the config gives).

  Args:
    config: the section's class.
    owner: the declaration, for the message (``"defence 'mine'"``).

  Raises:
    DeclarationError: not a dataclass, or a field without a default.
  """
  if not (isinstance(config, type) and dataclasses.is_dataclass(config)):
    raise DeclarationError(f"the config of {owner} is {config!r}, not a dataclass: declare it "
                           "with @dataclasses.dataclass")
  fields = dataclasses.fields(config)
  bare = [f.name for f in fields if f.default is dataclasses.MISSING
          and f.default_factory is dataclasses.MISSING]
  if bare:
    raise DeclarationError(f"the config of {owner} has no default for {', '.join(bare)}: give "
                           "every field a default (the recommended setting), as the config "
                           "file may leave any key out")
  return {f.name for f in fields}
