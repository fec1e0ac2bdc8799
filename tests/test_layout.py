"""The package layout: no import circle, a root of folders, the `stablejax` command, and the old
module paths that still work for one release (with a DeprecationWarning)."""

from __future__ import annotations

import ast
import json
import importlib
import subprocess
import sys
import warnings
from importlib.metadata import entry_points
from pathlib import Path

import pytest

import stablejax
import stablejax.cli
from helpers import run_python

PACKAGE = Path(stablejax.__file__).resolve().parent
ROOT = PACKAGE.parent

# The layout decision: old path -> (what an import of it returns, what `python -m` of it runs).
MOVED = {
    "stablejax.losses": ("stablejax.modeling.losses", None),
    "stablejax.model_utils": ("stablejax.modeling.utils", None),
    "stablejax.tokenizer": ("stablejax.data.tokenizer", None),
    "stablejax.training.data": ("stablejax.data.pipeline", None),
    "stablejax.prepare": ("stablejax.data.prepare", "prepare"),
    "stablejax.sample": ("stablejax.training.sampling", "sample"),
    "stablejax.report": ("stablejax.monitor.report", "report"),
    "stablejax.launch": ("stablejax.training.launch", "launch"),
    "stablejax.quantize_eval": ("stablejax.training.quantized_eval", "quantize-eval"),
    "stablejax.training.model": ("stablejax.modeling.gpt", None),
    "stablejax.training.bitnet": ("stablejax.modeling.bitnet", None),
    "stablejax.muon.layout": ("stablejax.layout.analysis", None),
    "stablejax.muon.heads": ("stablejax.layout.heads", None),
    "stablejax.training.runs": ("stablejax.training.trained_run", None),
    "stablejax.training.generate": ("stablejax.training.decoding", None),
}
COMMANDS = ("train", "prepare", "sample", "report", "launch", "quantize-eval")
# Names that moved out of a module that stays: old module -> {name: the module it lives in now,
# or "module:new name" for one renamed too}.
MOVED_NAMES = {
    "stablejax.data.pipeline": {
        **dict.fromkeys(("PREPARED_META", "PREPARED_FORMAT", "PREPARED_MARKER", "read_prepared",
                         "prepared_vocab_size", "scan_tokens", "prepared_file"),
                        "stablejax.data.prepared"),
        **dict.fromkeys(("TEXT_SUFFIXES", "TEXT_DOC_BYTES", "BIN_DOC_TOKENS", "data_tokenizer"),
                        "stablejax.data.sources"),
        **dict.fromkeys(("IDENTITY_FORMAT", "HASH_LIMIT", "data_identity", "identity_difference"),
                        "stablejax.data.identity"),
        "garbage_batch": "stablejax.training.batches",
    },
    "stablejax.data.prepare": {
        "TEXT_FIELD": "stablejax.data.config",
        **dict.fromkeys(("JSON_SUFFIXES", "PARQUET_SUFFIXES", "TEXT_SUFFIXES", "input_files"),
                        "stablejax.data.inputs"),
        **dict.fromkeys(("BATCH_BYTES", "BATCH_DOCS", "is_val"), "stablejax.data.encode"),
        "PARTIAL": "stablejax.data.out_dir",
    },
    "stablejax.transforms.skipping": {
        **dict.fromkeys(("SkipNonFiniteState", "skip_nonfinite", "SkipNonFiniteConfig",
                         "SKIP_NONFINITE"), "stablejax.transforms.finite_skip"),
        **dict.fromkeys(("SkipSpikesState", "skip_spikes", "window_stats", "log_sigma_threshold",
                         "SkipSpikesConfig", "SKIP_SPIKES"), "stablejax.transforms.spike_skip"),
    },
    "stablejax.layout.analysis": {
        **dict.fromkeys(("AxisName", "axis_names_of", "OUT_IN"), "stablejax.layout.leaves"),
        **dict.fromkeys(("HEADS", "HEAD_DIM", "MLP", "STACK", "EXPERT", "FUSED", "FUSED_FEATURES",
                         "fused_parts_of_name", "PROJECTION_NAMES", "projection_name",
                         "component_name"), "stablejax.layout.names"),
        **dict.fromkeys(("MuonDimensionNumbers", "orientations"), "stablejax.layout.orientation"),
        "Projection": "stablejax.layout.attention",
    },
    "stablejax.training.loop": {"Run": "stablejax.training.loop:Trainer"},
    "stablejax.training.components": {"build": "stablejax.training.components:build_components"},
    "stablejax.muon.muon": {
        **dict.fromkeys(("OUTLIER_METHODS", "IQR_EXACT_MAX", "clamp_outliers"),
                        "stablejax.muon.outliers"),
        **dict.fromkeys(("DEFAULT_NS_STEPS", "OutlierSafeMuonState", "ns_health", "shape_scale",
                         "scale_by_outlier_safe_muon"), "stablejax.muon.direction"),
        **dict.fromkeys(("TensorGuardState", "skip_nonfinite_tensors"),
                        "stablejax.transforms.nonfinite_tensors"),
    },
    "stablejax.muon.routing": {
        **dict.fromkeys(("GROUPS", "pure", "default_labels", "label_params"),
                        "stablejax.muon.labels"),
        **dict.fromkeys(("MuonDimensionNumbers", "DIMENSION_TYPES", "LAST_TWO_AXES",
                         "ATTENTION_QKV", "check_dims", "matrix_shape", "to_matrices",
                         "split_fused", "part_shapes"), "stablejax.muon.matrices"),
        **dict.fromkeys(("Note", "warn_notes"), "stablejax.muon.notes"),
    },
}


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
FLOORS = {"_compat": -1, "layout": 0, "transforms": 1, "data": 1, "muon": 2, "modeling": 2,
          "monitor": 3, "training": 4, "cli": 5, "__main__": 6, "": 6}


def _folder(module: str) -> str:
  parts = module.split(".")
  return parts[1] if len(parts) > 1 else ""


def _upward_imports(graph: dict[str, set[str]]) -> list[str]:
  return sorted(f"{a} -> {b}" for a, imported in graph.items() for b in imported
                if _folder(a) != _folder(b) and FLOORS[_folder(a)] <= FLOORS[_folder(b)])


def test_the_floor_check_sees_an_import_that_goes_up():
  graph = {"stablejax.transforms.zclip": {"stablejax.muon.muon", "stablejax.layout.heads"},
           "stablejax.training.loop": {"stablejax"}}
  assert _upward_imports(graph) == ["stablejax.training.loop -> stablejax",
                                    "stablejax.transforms.zclip -> stablejax.muon.muon"]


def test_no_module_imports_from_a_higher_floor():
  graph = _import_graph()
  assert {_folder(m) for m in graph} <= set(FLOORS), "a new folder needs its floor in FLOORS"
  assert _upward_imports(graph) == []


def test_package_root_holds_only_the_api_modules_and_folders():
  files = {p.name for p in PACKAGE.iterdir() if p.is_file()}
  assert files == {"__init__.py", "__main__.py", "_compat.py", "py.typed"}
  folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
  assert folders == {"cli", "configs", "data", "layout", "modeling", "monitor", "muon", "training",
                     "transforms"}
  assert all((PACKAGE / f / "__init__.py").is_file() for f in folders - {"configs"})
  assert sorted(p.name for p in (PACKAGE / "configs").iterdir()) == [
      "default.json", "gpt2_small.json", "openwebtext_stable.json", "openwebtext_stable_cpu.json"]


# ----------------------------------------------------------------------------- old paths


def _forget(name: str) -> None:
  """Makes the next import of ``name`` go through the import system again."""
  sys.modules.pop(name, None)
  parent, _, child = name.rpartition(".")
  parent_module = importlib.import_module(parent)
  if hasattr(parent_module, child):
    delattr(parent_module, child)


def test_every_moved_module_has_an_old_path():
  assert set(stablejax._compat._MOVED) == set(MOVED)


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_import_path_is_the_new_module_with_a_warning(old):
  new = MOVED[old][0]
  _forget(old)
  with pytest.warns(DeprecationWarning, match=rf"{old} is deprecated.*import {new}"):
    module = importlib.import_module(old)
  assert module is importlib.import_module(new)
  assert module.__name__ == new and module.__spec__.name == new  # the new module is untouched
  parent, _, child = old.rpartition(".")
  assert getattr(sys.modules[parent], child) is module
  assert sys.modules[old] is module


def test_old_from_imports_work_and_the_warning_points_at_the_importer():
  for old in ("stablejax.prepare", "stablejax.quantize_eval", "stablejax.sample"):
    _forget(old)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from stablejax.prepare import Options, PrepareError, prepare  # noqa: F401
    from stablejax.quantize_eval import (QuantizeEvalError, load_run_config,  # noqa: F401
                                         quantize_eval)
    from stablejax.sample import SampleError, run_tokenizer, sample  # noqa: F401
  deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
  assert len(deprecations) == 3
  assert all(Path(w.filename).resolve() == Path(__file__).resolve() for w in deprecations)
  from stablejax.data.prepare import prepare as new_prepare
  from stablejax.training.trained_run import RunError
  assert prepare is new_prepare
  assert QuantizeEvalError is RunError and SampleError is RunError


def test_every_moved_name_has_an_old_path():
  assert stablejax._compat._MOVED_NAMES == MOVED_NAMES


def test_old_names_are_the_new_objects_with_a_warning():
  for old, names in MOVED_NAMES.items():
    module = importlib.import_module(old)
    for name, new in names.items():
      assert name not in vars(module), f"{old}.{name} is still defined there"
      new_module, _, new_name = new.partition(":")
      said = rf"use {new_module}\.{new_name} " if new_name else rf"from {new_module} "
      with pytest.warns(DeprecationWarning, match=rf"{old}\.{name} is deprecated.*{said}"):
        value = getattr(module, name)
      assert value is getattr(importlib.import_module(new_module), new_name or name)


def test_an_old_names_warning_points_at_the_importer_and_other_names_stay_missing():
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from stablejax.data.pipeline import garbage_batch  # noqa: F401
    from stablejax.data.prepare import is_val  # noqa: F401
  deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
  assert len(deprecations) == 2
  assert all(Path(w.filename).resolve() == Path(__file__).resolve() for w in deprecations)
  with pytest.raises(ImportError, match="no_such_name"):
    from stablejax.data.pipeline import no_such_name  # noqa: F401
  with pytest.raises(AttributeError, match="has no attribute '_max_run'"):
    stablejax.data.pipeline._max_run  # noqa: B018 (private names get no old path)


@pytest.mark.parametrize("old", [o for o in sorted(MOVED) if MOVED[o][1]])
def test_old_program_path_runs_the_new_program_with_a_warning(old):
  command = MOVED[old][1]
  proc = run_python("-m", old, "--help")
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.startswith(f"usage: python -m stablejax {command}")
  assert "DeprecationWarning" in proc.stderr
  assert f"python -m {old} is deprecated" in proc.stderr
  assert f"use python -m stablejax {command}" in proc.stderr


def test_old_program_path_keeps_exit_codes(tmp_path):
  proc = run_python("-m", "stablejax.prepare", str(tmp_path / "missing.txt"), "--out",
              str(tmp_path / "out"), "--tokenizer", "bytes")
  assert proc.returncode == 2
  errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and "missing.txt" in errors[0] and "does not exist" in errors[0]
  assert not (tmp_path / "out").exists()


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
          "print(json.dumps([before, dir(stablejax), muon, same, stablejax.__all__, "
          "stablejax.__version__]))")
  before, after, muon, same, names, version = json.loads(_python(code))
  assert before == after  # dir() is the same before and after the names are loaded
  # Every public name, from the package's one list, resolves to its module's object.
  assert names == ["__version__", *stablejax._EXPORTS] and len(names) == len(set(names))
  assert len(same) == len(stablejax._EXPORTS) > 50
  assert set(names) <= set(before)
  assert {"_compat", "layout", "modeling", "monitor", "muon", "transforms"} <= set(before)
  assert not {"_importlib", "_EXPORTS", "_load_public_names", "__getattr__"} & set(before)
  assert muon == "stablejax.muon" and all(same.values()), same
  assert version == stablejax.__version__
  with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
    stablejax.no_such_name  # noqa: B018
