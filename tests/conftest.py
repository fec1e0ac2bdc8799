"""Fixtures shared by the tests, and the session's persistent compilation cache.

Most end-to-end tests train the same tiny model, in this process or in subprocesses; compiling it
takes most of their CPU time. JAX's persistent compilation cache (the documented
``JAX_COMPILATION_CACHE_DIR``, set here before anything imports jax, so every xdist worker and
every subprocess a test starts inherits it) compiles each program once per session; the others
load it. A cache directory given in the environment is used as it is (and kept); otherwise the
session makes one and removes it.

The tests' programs are tiny and run a few steps, so XLA:CPU's LLVM optimisation of the compiled
code costs more CPU time than it saves: ``--xla_backend_optimization_level=0`` (appended to any
XLA_FLAGS given, and inherited by subprocesses; tests/helpers.py keeps it when it sets a device
count) cuts an end-to-end test's CPU time by about a third. The HLO the tests check (sharding,
collectives, fusions of the optimizer) is the same; only the machine code is less optimised.
"""

import os
import shutil
import tempfile

_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_CACHE:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="stablejax-tests-xla-")
# Cache every program, however fast it compiled or small it is: the tests' programs are tiny.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = " ".join(
      [os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0"]).strip()

import pytest  # noqa: E402

from helpers import DIAGNOSTICS, run_inprocess  # noqa: E402


def pytest_configure(config):
  # The controller (not an xdist worker) made the cache: it removes it when the session ends.
  if _OWN_CACHE and not hasattr(config, "workerinput"):
    cache = os.environ["JAX_COMPILATION_CACHE_DIR"]
    config.add_cleanup(lambda: shutil.rmtree(cache, ignore_errors=True))


@pytest.fixture(scope="session")
def clean_run(tmp_path_factory, worker_id):
  """One uninterrupted tiny run without faults: the reference the fault and resume tests compare
  to (they only read it). Trained once per session: under xdist the workers share the session's
  folder, and the first to come trains it while the other waits on the lock (xdist's recipe for
  a session fixture run once)."""
  from filelock import FileLock
  shared = tmp_path_factory.getbasetemp()
  if worker_id != "master":
    shared = shared.parent  # the session's folder, above each worker's own
  out, done = shared / "clean_run", shared / "clean_run.done"
  with FileLock(str(shared / "clean_run.lock")):
    if not done.exists():
      # MFU from the measured rate; the diagnostics on (on a fixed validation batch: the losses
      # are those of a run without them)
      assert run_inprocess(out, "train.peak_flops_per_device=null", *DIAGNOSTICS) == 0
      done.touch()
  return out


# Plugin modules the tests name with --plugin: imported by the trainer when a test asks, never at
# collection (a declaration registered as a side effect would show up in every later test).
collect_ignore = ["plugins"]
