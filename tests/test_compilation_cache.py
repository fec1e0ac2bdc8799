"""The persistent compilation cache of the programs (training/compilation_cache.py): where it
lives, a second start that loads instead of compiling, and a damaged or unusable folder that
costs one line, never the run."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from helpers import ROOT

ZSTD_FRAME_MAGIC = b"\x28\xb5\x2f\xfd"  # RFC 8878, 3.1.1

# One process: the cache on in FOLDER, one program compiled (its result printed), the summary.
PROGRAM = textwrap.dedent("""
    import sys, warnings
    import jax, jax.numpy as jnp
    from stablejax.training.launch import compilation_cache
    folder = compilation_cache.enable(sys.argv[1], say=lambda line: print(line, file=sys.stderr))
    f = jax.jit(lambda x: jnp.tanh(x @ x.T).sum() * 3.0)
    x = jax.device_put(__import__("numpy").arange(64.0).reshape(8, 8) / 64)  # no other program
    print(float(f(x)))
    print(compilation_cache.summary())
""")


def _run(folder) -> subprocess.CompletedProcess:
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("JAX_COMPILATION_CACHE", "STABLEJAX_COMPILATION_CACHE"))}
  env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"  # the tiny program is kept too
  return subprocess.run([sys.executable, "-c", PROGRAM, str(folder)], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=120)


def test_the_folder_comes_from_the_flag_the_setting_the_environment_or_the_platform(
    monkeypatch, tmp_path):
  from stablejax.training.launch import compilation_cache as cc
  monkeypatch.delenv(cc.ENV, raising=False)
  monkeypatch.delenv(cc.JAX_ENV, raising=False)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert cc.choose() == (tmp_path / "xdg" / "stablejax" / "xla", "the user's cache folder")
  monkeypatch.setenv(cc.JAX_ENV, "/elsewhere")
  assert cc.choose() == (None, "$JAX_COMPILATION_CACHE_DIR")  # JAX's own: left to JAX
  monkeypatch.setenv(cc.ENV, str(tmp_path / "env"))
  assert cc.choose() == (tmp_path / "env", "$STABLEJAX_COMPILATION_CACHE")
  assert cc.choose(str(tmp_path / "cfg")) == (tmp_path / "cfg", "train.compilation_cache")
  assert cc.choose("OFF") == (None, "train.compilation_cache")
  assert cc.choose(str(tmp_path / "cfg"), disabled=True) == (None, "--no-compilation-cache")
  monkeypatch.setenv(cc.ENV, "off")
  assert cc.choose() == (None, "$STABLEJAX_COMPILATION_CACHE")


def test_a_second_process_loads_what_the_first_compiled_and_damage_costs_one_line(tmp_path):
  folder = tmp_path / "cache"
  first, second = _run(folder), _run(folder)
  assert first.returncode == second.returncode == 0, first.stderr[-2000:] + second.stderr[-2000:]
  result = first.stdout.splitlines()[0]
  assert first.stdout.splitlines()[1].endswith(f"({folder}), 1 compiled")
  assert second.stdout.splitlines() == [result, f"1 program loaded from the compilation cache "
                                                f"({folder}), 0 compiled"]
  entries = [p for p in folder.iterdir() if p.name.endswith("-cache")]
  assert entries and not [p for p in folder.iterdir() if p.name.endswith(".tmp")]
  # zstd frames (the train extra installs zstandard), not zlib streams: faster to write and read
  assert all(entry.read_bytes()[:4] == ZSTD_FRAME_MAGIC for entry in entries)
  for entry in entries:  # damaged: every entry's bytes cut short
    entry.write_bytes(entry.read_bytes()[:40])
  third = _run(folder)
  assert third.returncode == 0 and third.stdout.splitlines()[0] == result
  (line,) = [line for line in third.stderr.splitlines() if line.strip()]
  assert line.startswith("warning: a compilation cache entry could not be read (")
  assert line.endswith("); compiling instead")


def test_a_folder_that_cannot_be_created_turns_the_cache_off_with_one_line(tmp_path):
  blocker = tmp_path / "a_file"
  blocker.write_text("not a folder")
  run = _run(blocker / "cache")
  assert run.returncode == 0 and run.stdout.splitlines()[1] == "None"  # off: no summary
  (line,) = [line for line in run.stderr.splitlines() if line.strip()]
  assert line.startswith(f"warning: compilation cache off: {blocker / 'cache'} "
                         "(train.compilation_cache) cannot be used (")


def test_a_job_of_several_cpu_processes_turns_the_users_default_cache_off_with_one_line(
    monkeypatch):
  # Only process 0 writes, and on CPU the other processes' keys differ from its (measured in a
  # 2 x 2 job: every program of process 1 missed a cache process 0 had filled), so process 0
  # alone would load. A folder the user named is kept; one process, or a GPU job, keeps it too.
  import jax
  from stablejax.training.launch import compilation_cache as cc
  updates, said = [], []
  monkeypatch.setattr(jax.config, "update", lambda name, value: updates.append((name, value)))
  monkeypatch.setattr(cc, "_use", object())
  for chosen_by, count, platform in (("train.compilation_cache", 2, "cpu"),
                                     ("$STABLEJAX_COMPILATION_CACHE", 4, "cpu"),
                                     ("the user's cache folder", 1, "cpu"),
                                     ("the user's cache folder", 2, "gpu")):
    monkeypatch.setattr(cc, "_chosen_by", chosen_by)
    assert not cc.turn_off_for_multiprocess_cpu(count, platform, say=said.append)
  assert updates == said == [] and cc._use is not None
  monkeypatch.setattr(cc, "_chosen_by", "the user's cache folder")
  assert cc.turn_off_for_multiprocess_cpu(2, "cpu", say=said.append)
  assert updates == [("jax_enable_compilation_cache", False)] and cc._use is None
  assert cc.summary() is None  # the banner claims no loads
  (line,) = said
  assert line.startswith("compilation cache off: in a job of 2 CPU processes only process 0")
  assert line.endswith(f"set train.compilation_cache or ${cc.ENV} to keep one")
  # Off already (no folder enabled): nothing to do, nothing said.
  monkeypatch.setattr(cc, "_use", None)
  assert not cc.turn_off_for_multiprocess_cpu(2, "cpu", say=said.append) and len(said) == 1
