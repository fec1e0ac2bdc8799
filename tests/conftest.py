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
count) cuts an end-to-end test's CPU time by about a third. XLA:CPU's older emitters for fused
computations (``--xla_cpu_use_fusion_emitters=false``, the same way) compile them faster again:
a tiny run that compiles everything took 13.6 CPU-seconds instead of 18.0. Generating each
program's machine code as one LLVM module (``--xla_cpu_parallel_codegen_split_count=1``; XLA
splits it to compile the parts on several threads, which costs more CPU for the tests' small
programs than it saves) cut the CPU time of the unit-test modules by 12%. The HLO the tests
check (sharding, collectives, fusions of the optimizer) is the same; only the machine code
differs (a tiny run's loss after 40 steps moves in the seventh digit).

Each MLIR operation JAX lowers carries a location; by default the whole Python traceback that
made it (up to 100 frames). The session's processes keep only the frame of the code that made it
(the documented ``JAX_INCLUDE_FULL_TRACEBACKS_IN_LOCATIONS=false``, inherited by subprocesses):
lowering builds, and XLA carries, one frame per operation instead of a call stack. The programs
are the same (JAX's cache key drops locations) and no test reads them.
"""

import os
import shutil
import sys
import tempfile

from helpers import SESSION_JAX_VARIABLES  # helpers imports no JAX at import

_CACHE_DIR, _MIN_COMPILE_TIME, _MIN_ENTRY_SIZE, _FULL_TRACEBACKS = SESSION_JAX_VARIABLES
_OWN_CACHE = _CACHE_DIR not in os.environ
if _OWN_CACHE:
  os.environ[_CACHE_DIR] = tempfile.mkdtemp(prefix="stablejax-tests-xla-")
# Cache every program, however fast it compiled or small it is: the tests' programs are tiny.
os.environ.setdefault(_MIN_COMPILE_TIME, "0")
os.environ.setdefault(_MIN_ENTRY_SIZE, "0")
os.environ.setdefault(_FULL_TRACEBACKS, "false")
# Python's bytecode, where the environment turns writing it off (PYTHONDONTWRITEBYTECODE): every
# process would compile every module it imports from source again (jax, flax, optax, Orbax, Grain
# and stablejax: ~3.5 CPU-seconds a process). The session's processes (the pytest processes from
# here on, and every process a test starts) write and read one compiled copy in a folder of the
# session's instead (PYTHONPYCACHEPREFIX; the controller makes the folder and removes it). Each
# module is compiled once, when the session first imports it; so the README's test command
# installs the packages without compiling their bytecode, most of which no test imports.
_PYCACHE = "STABLEJAX_TESTS_PYCACHE"
_OWN_PYCACHE = bool(os.environ.get("PYTHONDONTWRITEBYTECODE")) and not (
    "PYTHONPYCACHEPREFIX" in os.environ or _PYCACHE in os.environ)
if _OWN_PYCACHE:
  os.environ[_PYCACHE] = tempfile.mkdtemp(prefix="stablejax-tests-pyc-")
if os.environ.get(_PYCACHE):
  os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
  os.environ["PYTHONPYCACHEPREFIX"] = os.environ[_PYCACHE]
  sys.dont_write_bytecode = False  # this process's own imports from here on
  sys.pycache_prefix = os.environ[_PYCACHE]
for _flag in ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false",
              "--xla_cpu_parallel_codegen_split_count=1"):
  if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), _flag]).strip()

# Python's cyclic garbage collector, in the pytest processes: the thresholds the programs use
# (stablejax.cli._process; the programs the tests start set them themselves). Tracing and
# lowering allocate millions of short-lived objects; a collection every 50,000 instead of 700 cut
# the collector's own time from 4.9 to 0.8 CPU-seconds of about 105 over two test modules
# (gc.callbacks, measured around each collection).
from stablejax.cli._process import collect_garbage_less_often  # noqa: E402 - imports no JAX

collect_garbage_less_often()

import pytest  # noqa: E402

from helpers import DIAGNOSTICS, run_inprocess  # noqa: E402


def pytest_configure(config):
  _hold_the_bytecode_lock(config)
  # The controller (not an xdist worker) made the cache: it removes it when the session ends.
  if _OWN_CACHE and not hasattr(config, "workerinput"):
    cache = os.environ[_CACHE_DIR]
    config.add_cleanup(lambda: shutil.rmtree(cache, ignore_errors=True))
  if _OWN_PYCACHE and not hasattr(config, "workerinput"):
    pycache = os.environ[_PYCACHE]
    config.add_cleanup(lambda: shutil.rmtree(pycache, ignore_errors=True))


_BYTECODE_LOCK = pytest.StashKey()  # the worker's lock, until it has collected


def _hold_the_bytecode_lock(config) -> None:
  """An xdist worker imports the stack and collects the tests holding a lock in the session's
  bytecode folder. The workers start together: without it, each would compile the same modules'
  bytecode (and rewrite the same test modules' asserts) into the empty folder at the same time,
  about 8 CPU-seconds each; with it, the second reads the first's copies. It is released once
  this worker has collected (``pytest_collection_finish``), or when the session ends."""
  if not (hasattr(config, "workerinput") and os.environ.get(_PYCACHE)):
    return
  from filelock import FileLock
  lock = FileLock(os.path.join(os.environ[_PYCACHE], "collection.lock"))
  lock.acquire()
  config.stash[_BYTECODE_LOCK] = lock
  config.add_cleanup(lambda: lock.release(force=True))


def pytest_collection_finish(session):
  lock = session.config.stash.get(_BYTECODE_LOCK, None)
  if lock is not None:
    lock.release(force=True)


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
