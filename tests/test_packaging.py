"""The package as users get it: ``python -m build`` makes an sdist and a wheel, the wheel installs
into a fresh virtual environment and works from there, the version has one source, and the
changelog has an entry for it."""

from __future__ import annotations

import ast
import datetime
import json
import os
import re
import shutil
import site
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest

try:
  import tomllib
except ModuleNotFoundError:  # Python 3.10: build, in the test extra, brings tomli
  import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "stablejax"
# Repository folders that are not part of the package and must not be installed with it.
NOT_SHIPPED = {"tests", "bench", "runs", "docs", "tools", "examples", ".venv"}


def _source_version() -> str:
  """``__version__`` as written in stablejax/__init__.py (read without importing it)."""
  tree = ast.parse((PACKAGE / "__init__.py").read_text())
  for node in tree.body:
    if (isinstance(node, ast.Assign) and len(node.targets) == 1
        and getattr(node.targets[0], "id", None) == "__version__"):
      return ast.literal_eval(node.value)
  raise AssertionError("stablejax/__init__.py assigns no __version__")


def _package_files(root: Path) -> set[str]:
  """The files a build of the tree at ``root`` must ship: every module of the package, the
  py.typed marker and the packaged configs (``python -m stablejax train --config NAME``)."""
  files = {p for p in (root / "stablejax").rglob("*.py") if "__pycache__" not in p.parts}
  files |= set((root / "stablejax" / "configs").glob("*.json"))
  files.add(root / "stablejax" / "py.typed")
  return {p.relative_to(root).as_posix() for p in files}


# ------------------------------------------------------------------------------------ version


def test_version_has_one_source():
  pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
  project = pyproject["project"]
  assert "version" not in project, "the version is written in stablejax/__init__.py only"
  assert "version" in project["dynamic"]
  assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "stablejax.__version__"}
  version = _source_version()
  assert re.fullmatch(r"\d+\.\d+\.\d+", version), version


def test_changelog_follows_keep_a_changelog_and_lists_the_current_version():
  text = (ROOT / "CHANGELOG.md").read_text()
  sections = re.findall(r"^## (.*)$", text, flags=re.M)
  assert sections and sections[0] == "[Unreleased]", sections
  released = []
  for heading in sections[1:]:
    match = re.fullmatch(r"\[(\d+\.\d+\.\d+)\] - (\d{4}-\d{2}-\d{2})", heading)
    assert match, f"release heading {heading!r} is not '[X.Y.Z] - YYYY-MM-DD'"
    datetime.date.fromisoformat(match.group(2))
    released.append(tuple(map(int, match.group(1).split("."))))
  assert released == sorted(released, reverse=True), "releases are listed newest first"
  assert len(set(released)) == len(released), "a release is listed twice"
  version = tuple(map(int, _source_version().split(".")))
  assert version in released, f"CHANGELOG.md has no section for version {_source_version()}"
  # Every change sits under one of Keep a Changelog's kinds of change.
  kinds = {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}
  for kind in re.findall(r"^### (.*)$", text, flags=re.M):
    assert kind in kinds, f"'### {kind}' is not one of {sorted(kinds)}"
  for body in re.split(r"^## .*$", text, flags=re.M)[1:]:
    assert re.search(r"^### ", body, flags=re.M), "a release section without a kind of change"


# ------------------------------------------------------------------------ build and install


def _check_output(command, *, timeout, **kwargs) -> subprocess.CompletedProcess:
  result = subprocess.run([str(c) for c in command], capture_output=True, text=True,
                          timeout=timeout, **kwargs)
  assert result.returncode == 0, (
      f"{' '.join(map(str, command))} exited {result.returncode}\n"
      f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}")
  return result


def _check_wheel(wheel: Path, version: str, expected: set[str]):
  with zipfile.ZipFile(wheel) as zf:
    names = set(zf.namelist())
    dist_info = f"stablejax-{version}.dist-info"
    metadata = zf.read(f"{dist_info}/METADATA").decode()
    entry_points = zf.read(f"{dist_info}/entry_points.txt").decode()
  for name in names:
    top, *rest = name.split("/")
    assert top in ("stablejax", dist_info), f"the wheel installs {name} outside the package"
    assert not NOT_SHIPPED & set(rest), f"the wheel holds {name}"
  package = {n for n in names if n.startswith("stablejax/")}
  assert package == expected, (f"missing from the wheel: {sorted(expected - package)}; "
                               f"not in the source: {sorted(package - expected)}")
  assert "stablejax/py.typed" in names and "stablejax/configs/default.json" in names
  assert re.search(rf"^Version: {re.escape(version)}$", metadata, flags=re.M)
  # The library needs jax, flax, optax and numpy; everything the programs need is the train
  # extra (no Orbax, Grain, matplotlib or tokenizer for a user who wants zclip()).
  requires = re.findall(r"^Requires-Dist: (.*)$", metadata, flags=re.M)
  unconditional = sorted(re.split(r"[<>=!~ \[;]", r)[0] for r in requires if "extra ==" not in r)
  assert unconditional == ["flax", "jax", "numpy", "optax"], requires
  train = {re.split(r"[<>=!~ \[;]", r)[0] for r in requires if 'extra == "train"' in r}
  assert {"orbax-checkpoint", "grain", "tensorboardX", "matplotlib", "tokenizers",
          "tiktoken"} <= train, requires
  # What the package index shows: Project-URLs and classifiers.
  assert re.search(r"^Project-URL: Source, https://", metadata, flags=re.M)
  assert re.search(r"^Classifier: Topic :: Scientific/Engineering", metadata, flags=re.M)
  assert re.search(r"^stablejax = stablejax\.cli:main$", entry_points, flags=re.M)


def _check_sdist(sdist: Path, version: str, expected: set[str]):
  prefix = f"stablejax-{version}/"
  with tarfile.open(sdist) as tf:
    names = {m.name for m in tf.getmembers() if m.isfile()}
  assert all(n.startswith(prefix) for n in names), sorted(names)[:5]
  names = {n[len(prefix):] for n in names}
  needed = {"pyproject.toml", "README.md", "CHANGELOG.md", "PKG-INFO"}
  needed |= {p.name for p in ROOT.glob("LICEN[CS]E*")}
  assert needed <= names, f"the sdist lacks {sorted(needed - names)}"
  package = {n for n in names if n.startswith("stablejax/")}
  assert package == expected, (f"missing from the sdist: {sorted(expected - package)}; "
                               f"not in the source: {sorted(package - expected)}")
  for name in names:
    parts = name.split("/")
    assert parts[0] in {"stablejax", "stablejax.egg-info"} or len(parts) == 1, (
        f"the sdist holds {name}")
    assert not NOT_SHIPPED & set(parts) and "__pycache__" not in parts, f"the sdist holds {name}"


# Runs in the fresh environment: where stablejax and its metadata come from, and one ZClip
# run: warmup over norms 1 and 3 (mean 2, population std 1, no ceiling), then a norm-10 step.
_INSTALLED_CHECK = textwrap.dedent("""
    import json
    from importlib import metadata

    import jax.numpy as jnp
    import stablejax

    dist = metadata.distribution("stablejax")
    tx = stablejax.zclip(z_thresh=2.5, warmup_steps=2, max_grad_norm=None)
    params = {"a": jnp.zeros(2), "b": jnp.zeros((1, 1))}
    state = tx.init(params)
    for grads in ({"a": jnp.array([0.6, 0.8]), "b": jnp.zeros((1, 1))},
                  {"a": jnp.zeros(2), "b": jnp.full((1, 1), 3.0)},
                  {"a": jnp.array([6.0, 0.0]), "b": jnp.full((1, 1), 8.0)}):
      updates, state = tx.update(grads, state, params)
    import sys
    extras = ("orbax", "grain", "tensorboardX", "matplotlib", "tokenizers", "tiktoken", "tqdm")
    print(json.dumps({
        "imported_extras": sorted({m.split(".")[0] for m in sys.modules} & set(extras)),
        "file": stablejax.__file__,
        "version": stablejax.__version__,
        "dist_version": dist.version,
        "dist_location": str(dist.locate_file("")),
        "updates": {"a": updates["a"].tolist(), "b": updates["b"].tolist()},
        "threshold": float(state.threshold),
        "was_clipped": bool(state.was_clipped),
    }))
""")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_built_wheel_installs_into_a_fresh_environment_and_works(tmp_path):
  version = _source_version()
  dist = tmp_path / "dist"
  # Built from a copy of the files git would commit, as in a fresh clone: a build in the
  # working tree would write stablejax.egg-info there, and setuptools puts every file listed
  # in an old one into the next sdist and wheel (a removed module would still ship).
  source = tmp_path / "source"
  listed = _check_output(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                timeout=60, cwd=ROOT).stdout.split("\0")
  for name in filter(None, listed):
    if (ROOT / name).is_file():  # not a tracked file deleted in the working tree
      (source / name).parent.mkdir(parents=True, exist_ok=True)
      shutil.copy2(ROOT / name, source / name)
  # Isolated build (the default): the build backend comes from pyproject's [build-system], as
  # for a user's build; the wheel is built from the sdist, which proves the sdist sufficient.
  # uv (the test extra's) installs the backend into each build environment: 6 CPU-seconds
  # against 11 with pip.
  _check_output([sys.executable, "-m", "build", "--installer", "uv", "--outdir", dist, source],
                timeout=240)
  wheel = dist / f"stablejax-{version}-py3-none-any.whl"
  sdist = dist / f"stablejax-{version}.tar.gz"
  assert sorted(dist.iterdir()) == sorted([wheel, sdist])
  _check_wheel(wheel, version, _package_files(source))
  _check_sdist(sdist, version, _package_files(source))

  # A fresh environment (no system site-packages) with the wheel installed by uv. The wheel
  # goes in with --no-deps, and a .pth file appends this environment's site-packages for the
  # dependencies (jax, flax, optax, ...: the versions the tests run with; downloading and
  # installing them anew takes minutes). Lines of a .pth come after the environment's own
  # site-packages, and the .pth files of the appended folders are not run, so this
  # environment's editable stablejax cannot be imported there: only the wheel's can, and the
  # check below asserts it.
  venv = tmp_path / "venv"
  _check_output([sys.executable, "-m", "venv", "--without-pip", venv], timeout=60)
  python = venv / "bin" / "python"
  _check_output([sys.executable, "-m", "uv", "pip", "install", "--quiet", "--python", python,
                 "--no-deps", "--no-index", wheel], timeout=120)
  purelib = Path(_check_output(
      [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
      timeout=60).stdout.strip())
  assert purelib.is_relative_to(venv)
  (purelib / "_stablejax_test_dependencies.pth").write_text(
      "\n".join(site.getsitepackages()) + "\n")

  # No PYTHON* variable of the tests' (PYTHONPATH would reach this repository), except the
  # session's bytecode folder (tests/conftest.py): the dependencies' modules compiled once.
  env = {k: v for k, v in os.environ.items()
         if not k.startswith("PYTHON") or k == "PYTHONPYCACHEPREFIX"}
  env["JAX_PLATFORMS"] = "cpu"
  work = tmp_path / "work"  # not the repository: its stablejax/ must not be on the path
  work.mkdir()

  def run(*command):
    return _check_output(command, timeout=120, cwd=work, env=env)

  found = json.loads(run(python, "-c", _INSTALLED_CHECK).stdout.strip().splitlines()[-1])
  assert Path(found["file"]).resolve().is_relative_to(venv.resolve()), found["file"]
  assert Path(found["dist_location"]).resolve().is_relative_to(venv.resolve())
  assert found["version"] == found["dist_version"] == version
  assert found["imported_extras"] == []  # zclip() pulls in none of the train extra
  # By hand: after warmup mean 2 and std 1; the norm-10 step has z = 8 and gets the clip value
  # mean + z_thresh * std / (z / z_thresh) = 2 + 2.5 / 3.2 = 2.78125, so the gradient is scaled
  # by 2.78125 / (10 + 1e-6).
  scale = 2.78125 / (10 + 1e-6)
  assert found["was_clipped"] is True
  assert found["threshold"] == pytest.approx(2.78125, rel=1e-5)
  assert found["updates"]["a"] == pytest.approx([6.0 * scale, 0.0], rel=1e-5)
  assert found["updates"]["b"][0] == pytest.approx([8.0 * scale], rel=1e-5)

  # The programs: python -m stablejax and the console script.
  new = run(python, "-m", "stablejax", "prepare", "--help")
  assert new.stdout.startswith("usage: python -m stablejax prepare")
  assert "deprecated" not in new.stderr
  script = venv / "bin" / "stablejax"
  assert script.read_text().splitlines()[0] == f"#!{python}"
  listing = run(script, "--help").stdout
  for command in ("prepare", "sample", "report", "launch", "quantize-eval"):
    assert re.search(rf"^  {command} ", listing, flags=re.M), listing
  assert run(script, "prepare", "--help").stdout == new.stdout
  # The trainer from the installed wheel, on its packaged default config (a few tiny steps; the
  # train extra's packages come from the appended site-packages).
  tiny = ["model.d_model=16", "model.n_layers=1", "model.n_heads=2", "model.max_seq_len=16",
          "train.seq_len=16", "train.batch_size=4", "train.steps=2", "train.warmup_steps=1",
          "train.eval_every=2", "train.eval_batches=1", "checkpoint.every=2",
          "logging.progress=false", "logging.sample_every=0", "logging.histogram_every=0",
          "logging.activation_every=0", "train.peak_flops_per_device=1e12"]
  argv = [a for item in tiny for a in ("--set", item)]
  trained = run(script, "train", "--config", "default", *argv, "--out", work / "run")
  assert "done: 2 steps" in trained.stdout
  assert json.loads((work / "run" / "config.json").read_text())["model"]["qk_norm"] is True


def test_readme_links_are_absolute_and_point_at_files_of_this_repository():
  # The package index shows README.md as the long description: a relative link would be broken
  # there. Every link goes to the project's repository, at a file that exists here.
  pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
  home = pyproject["project"]["urls"]["Source"]
  text = (ROOT / "README.md").read_text()
  links = re.findall(r"\]\(([^)\s]+)\)", text)
  assert len(links) > 10
  for link in links:
    assert re.match(r"^https?://", link), f"relative link in README.md: {link}"
    for prefix in (f"{home}/blob/main/", home.replace("github.com", "raw.githubusercontent.com")
                   + "/main/"):
      if link.startswith(prefix):
        path = link[len(prefix):].split("#")[0]
        assert (ROOT / path).exists(), f"README.md links to {path}, which does not exist"
