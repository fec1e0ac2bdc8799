"""The package layout: no import circle, a root of folders, the `stablejax` command, and the old
module paths that still work for one release (with a DeprecationWarning)."""

from __future__ import annotations

import ast
import json
import importlib
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

import stablejax
import stablejax.cli
from helpers import run_python

PACKAGE = Path(stablejax.__file__).resolve().parent
ROOT = PACKAGE.parent

COMMANDS = ("train", "prepare", "sample", "report", "launch", "quantize-eval")
# ----------------------------------------------------------------------------- import graph


def _package_modules() -> dict[str, Path]:
  modules = {}
  for path in PACKAGE.rglob("*.py"):
    parts = path.relative_to(ROOT).with_suffix("").parts
    modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  return modules


def _imported(source: str, name: str, is_package: bool, modules) -> set[str]:
  """The package modules that ``source`` (module ``name``) imports anywhere: at the top, inside
  functions, under ``if``/``try``, and through ``importlib.import_module("literal")``.

  ``from a import b`` counts as importing ``a.b`` when that is a module, else ``a``. The parent
  packages Python imports on the way to a module are not counted: every module has them.
  """
  found = set()
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Import):
      found.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        base = name.split(".") if is_package else name.split(".")[:-1]
        base = base[:len(base) - node.level + 1]
        module = ".".join(base + ([node.module] if node.module else []))
      else:
        module = node.module
      for alias in node.names:
        found.add(f"{module}.{alias.name}" if f"{module}.{alias.name}" in modules else module)
    elif (isinstance(node, ast.Call) and ast.unparse(node.func) == "importlib.import_module"
          and node.args and isinstance(node.args[0], ast.Constant)):
      found.add(node.args[0].value)
  return {m for m in found if m in modules and m != name}


def _import_graph() -> dict[str, set[str]]:
  modules = _package_modules()
  graph = {name: _imported(path.read_text(), name, path.name == "__init__.py", modules)
           for name, path in modules.items()}
  # The `stablejax` command imports its subcommands by name from a table.
  graph["stablejax.cli"] |= {command.module for command in stablejax.cli.COMMANDS.values()}
  return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Strongly connected components with more than one module (Tarjan), each sorted."""
  index, low, stack, on_stack, found = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in graph.get(v, ()):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        found.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return found


def test_the_import_checker_sees_function_local_imports_and_circles():
  modules = {"p": None, "p.a": None, "p.b": None, "p.c": None}
  source = "import os\ndef f():\n  from p import b\n  from .c import x\n"
  assert _imported(source, "p.a", False, modules) == {"p.b", "p.c"}
  assert _imported("from . import a", "p", True, modules) == {"p.a"}
  assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
  assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle():
  graph = _import_graph()
  assert len(graph) > 40 and "stablejax.muon.describe" in graph
  assert {"stablejax.muon.muon", "stablejax.muon.routing"} <= graph["stablejax.muon.describe"]
  assert "stablejax.muon.muon" not in graph["stablejax.muon.routing"]
  assert _cycles(graph) == []


# The floors of the package: a module imports from its own folder or from a lower floor, never
# from a higher one (docs/development.md, Layout). "" is the package's front file.
FLOORS = {"layout": 0, "transforms": 1, "data": 1, "muon": 2, "modeling": 2,
          "monitor": 3, "training": 4, "cli": 5, "__main__": 6, "": 6}


def _folder(module: str) -> str:
  parts = module.split(".")
  return parts[1] if len(parts) > 1 else ""


def _upward_imports(graph: dict[str, set[str]]) -> list[str]:
  return sorted(f"{a} -> {b}" for a, imported in graph.items() for b in imported
                if _folder(a) != _folder(b) and FLOORS[_folder(a)] <= FLOORS[_folder(b)])


def test_the_floor_check_sees_an_import_that_goes_up():
  graph = {"stablejax.transforms.zclip": {"stablejax.muon.muon", "stablejax.layout.heads"},
           "stablejax.training.loop.trainer": {"stablejax"}}
  assert _upward_imports(graph) == ["stablejax.training.loop.trainer -> stablejax",
                                    "stablejax.transforms.zclip -> stablejax.muon.muon"]


def test_no_module_imports_from_a_higher_floor():
  graph = _import_graph()
  assert {_folder(m) for m in graph} <= set(FLOORS), "a new folder needs its floor in FLOORS"
  assert _upward_imports(graph) == []


def test_package_root_holds_only_the_api_modules_and_folders():
  files = {p.name for p in PACKAGE.iterdir() if p.is_file()}
  assert files == {"__init__.py", "__main__.py", "py.typed"}
  folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
  assert folders == {"cli", "configs", "data", "layout", "modeling", "monitor", "muon", "training",
                     "transforms"}
  assert all((PACKAGE / f / "__init__.py").is_file() for f in folders - {"configs"})
  assert sorted(p.name for p in (PACKAGE / "configs").iterdir()) == [
      "default.json", "gpt2_small.json", "openwebtext_stable.json", "openwebtext_stable_cpu.json"]


# ----------------------------------------------------------------------------- rooms


def test_no_level_of_the_trainer_holds_more_than_twelve_modules():
  """The trainer by idea, each folder a room a newcomer can name (its config, the loop, the
  recovery, the run folder, launching, a finished run), not thirty modules on one level."""
  training = PACKAGE / "training"
  for folder in [training, *[p for p in training.rglob("*") if p.is_dir()]]:
    modules = [m for m in folder.glob("*.py") if m.name != "__init__.py"]
    assert len(modules) <= 12, (folder, len(modules))
  rooms = {p.name for p in (PACKAGE / "training").iterdir()
           if p.is_dir() and p.name != "__pycache__"}
  assert rooms == {"config", "launch", "loop", "recovery", "run_folder", "trained"}


def test_old_paths_are_gone():
  for old in ("stablejax._compat", "stablejax.losses", "stablejax.training.runs",
              "stablejax.training.rollback", "stablejax.training.run_dir"):
    with pytest.raises(ModuleNotFoundError):
      importlib.import_module(old)


# ----------------------------------------------------------------------------- the command


def test_python_m_stablejax_runs_a_subcommand():
  proc = run_python("-m", "stablejax", "prepare", "--help")
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.startswith("usage: python -m stablejax prepare")
  assert "--tokenizer" in proc.stdout and "deprecated" not in proc.stderr


def test_python_m_stablejax_help_lists_every_command():
  proc = run_python("-m", "stablejax", "--help")
  assert proc.returncode == 0, proc.stderr
  listed = [line.split()[0] for line in proc.stdout.split("commands:\n")[1].splitlines()
            if line.startswith("  ")]
  assert listed == list(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_subcommand_answers_help(command, capsys):
  with pytest.raises(SystemExit) as exit_info:
    stablejax.cli.main([command, "--help"])
  assert exit_info.value.code == 0
  assert capsys.readouterr().out.startswith(f"usage: python -m stablejax {command}")


def test_unknown_or_missing_command_is_one_error_line_and_exit_2(capsys):
  for argv in (["frobnicate"], []):
    assert stablejax.cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "prepare" in err, err


def test_console_script_is_the_command():
  (script,) = entry_points(group="console_scripts", name="stablejax")
  assert script.value == "stablejax.cli:main" and script.load() is stablejax.cli.main


def test_a_program_without_the_train_extra_is_one_line_naming_it(tmp_path):
  # orbax unavailable, as after `pip install stablejax` without the extra.
  code = ("import sys; sys.modules['orbax'] = None\n"
          "from stablejax.cli import main\n"
          f"sys.exit(main(['train', '--out', {str(tmp_path / 'run')!r}]))")
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
  assert result.returncode == 2, result.stderr[-2000:]
  assert result.stderr.strip() == ("error: python -m stablejax train needs orbax, which comes with "
                                   "the train extra: pip install 'stablejax[train]'")


# ----------------------------------------------------------------------------- the package root

HEAVY = ("jax", "jaxlib", "numpy", "optax", "flax", "grain", "orbax")


def _python(code: str) -> str:
  proc = run_python("-c", code)
  assert proc.returncode == 0, proc.stderr
  return proc.stdout


def test_importing_stablejax_and_its_command_loads_no_heavy_library():
  code = ("import json, sys, stablejax, stablejax.cli; stablejax.cli.main(['--help']); "
          f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r}))))")
  assert json.loads(_python(code).splitlines()[-1]) == []


def test_the_lazy_package_offers_the_same_names_as_the_eager_one():
  code = ("import importlib, json, stablejax; before = dir(stablejax); "
          "muon = stablejax.muon.__name__; "  # a subpackage, without importing it by name
          "same = {n: getattr(stablejax, n) is getattr(importlib.import_module(m), n) "
          "for n, m in stablejax._EXPORTS.items()}; "
          "import sys; extras = sorted({m.split('.')[0] for m in sys.modules} & "
          "{'grain', 'orbax', 'tqdm', 'tensorboardX', 'tokenizers', 'matplotlib'}); "
          "print(json.dumps([before, dir(stablejax), muon, same, stablejax.__all__, "
          "stablejax.__version__, extras]))")
  before, after, muon, same, names, version, extras = json.loads(_python(code))
  # Every public name loads without the train extra (a library user installs none of it).
  assert extras == []
  assert before == after  # dir() is the same before and after the names are loaded
  # Every public name, from the package's one list, resolves to its module's object.
  assert names == ["__version__", *stablejax._EXPORTS] and len(names) == len(set(names))
  assert len(same) == len(stablejax._EXPORTS) > 50
  assert set(names) <= set(before)
  assert {"layout", "modeling", "monitor", "muon", "transforms"} <= set(before)
  assert not {"_importlib", "_EXPORTS", "_load_public_names", "__getattr__"} & set(before)
  assert muon == "stablejax.muon" and all(same.values()), same
  assert version == stablejax.__version__
  with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
    stablejax.no_such_name  # noqa: B018
