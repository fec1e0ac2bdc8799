"""The doctests' temporary folders: the package's docstring examples make their folders with
``tempfile.mkdtemp()``, as a user would; run as doctests, each example's folders go into one
folder of its own, removed after the example, so the suite leaves nothing behind in the system's
temporary folder. (A short path in the system's temporary folder, not ``tmp_path``: examples print
paths, shortened past 40 characters. The tests' own fixtures are in ``tests/conftest.py``.)

The ``--cpu-report`` option is here too, so that it counts the doctests with the tests (a hook of
``tests/conftest.py`` runs for the items under ``tests/`` only)."""

import shutil
import tempfile
import threading

import pytest
from _pytest.doctest import DoctestItem


@pytest.fixture(autouse=True)
def _doctest_temporary_folders_removed(request, monkeypatch):
  if not isinstance(request.node, DoctestItem):
    yield
    return
  folder = tempfile.mkdtemp(prefix="sjdoc")
  monkeypatch.setattr(tempfile, "tempdir", folder)
  try:
    yield
  finally:
    shutil.rmtree(folder, ignore_errors=True)


# ----------------------------------------------------------------------------- CPU report
# --durations gives wall time, which a test that sleeps or waits on another worker inflates; the
# suite's budget is CPU time. --cpu-report N prints the N tests that cost the most: user + system
# seconds of the test's process and of the processes it started and waited for, setup (the
# module fixtures it was first to need) and teardown included; the package's doctests as well.


def pytest_addoption(parser):
  parser.addoption("--cpu-report", type=int, default=0, metavar="N",
                   help="print the N tests that cost the most CPU time (0: none)")


def pytest_configure(config):
  if config.getoption("--cpu-report"):
    # The processes that run tests count the programs XLA compiles and time JAX's compilation
    # phases (jax.monitoring's documented listeners; the xdist controller runs no test, so it
    # never imports JAX for this).
    if hasattr(config, "workerinput") or config.getoption("numprocesses", None) in (None, 0):
      import jax.monitoring
      jax.monitoring.register_event_duration_secs_listener(_count_compile)
      jax.monitoring.register_event_time_span_listener(_count_phase)


def _cpu_seconds() -> float:
  import resource
  own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(
      resource.RUSAGE_CHILDREN)
  return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


# This process's XLA compilations since it started: programs, their backend seconds (compiling,
# or loading from the compilation cache), then the seconds JAX spent tracing functions to jaxprs
# and lowering jaxprs to MLIR for them. The count is the one figure of a test's cost that does not
# move with the host's load: a change that compiles fewer programs shows as fewer, where CPU
# seconds differ by more than it between runs.
_COMPILED = [0, 0.0, 0.0, 0.0]
_PHASES = {"/jax/core/compile/jaxpr_trace_duration": 2,
           "/jax/core/compile/jaxpr_to_mlir_module_duration": 3}
_SPANS: dict = {}  # per thread: the phases' spans counted so far, latest last


def _count_compile(event: str, seconds: float, **kwargs) -> None:
  if event == "/jax/core/compile/backend_compile_duration":
    _COMPILED[0] += 1
    _COMPILED[1] += seconds


def _count_phase(event: str, start: float, end: float, **kwargs) -> None:
  """Tracing and lowering seconds, each second once: a function jitted inside another is traced
  inside the outer trace, and reports its span first; the outer span, which holds it, replaces
  it."""
  if event not in _PHASES:
    return
  spans = _SPANS.setdefault(threading.get_ident(), [])
  while spans and start <= spans[-1][0] and spans[-1][1] <= end:
    inner_start, inner_end, phase = spans.pop()
    _COMPILED[phase] -= inner_end - inner_start
  spans.append((start, end, _PHASES[event]))
  _COMPILED[_PHASES[event]] += end - start


def _record_cpu(item, phase):
  start, programs, compile_seconds, trace_seconds, lower_seconds = _cpu_seconds(), *_COMPILED
  yield
  item.user_properties += [(f"cpu_seconds_{phase}", _cpu_seconds() - start),
                           (f"compiled_programs_{phase}", _COMPILED[0] - programs),
                           (f"compile_seconds_{phase}", _COMPILED[1] - compile_seconds),
                           (f"trace_seconds_{phase}", _COMPILED[2] - trace_seconds),
                           (f"lower_seconds_{phase}", _COMPILED[3] - lower_seconds)]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
  yield from _record_cpu(item, "setup")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
  yield from _record_cpu(item, "call")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item):
  yield from _record_cpu(item, "teardown")


_CPU_BY_TEST: dict[str, float] = {}
_COMPILED_BY_TEST: dict[str, tuple[int, float, float, float]] = {}


def pytest_runtest_logreport(report):
  # Reports reach the controller from the workers with the item's properties so far.
  def total(kind):
    return sum(v for k, v in report.user_properties if k.startswith(kind))
  if any(k.startswith("cpu_seconds_") for k, _ in report.user_properties):
    _CPU_BY_TEST[report.nodeid] = total("cpu_seconds_")
    _COMPILED_BY_TEST[report.nodeid] = (total("compiled_programs_"), total("compile_seconds_"),
                                        total("trace_seconds_"), total("lower_seconds_"))


def pytest_terminal_summary(terminalreporter, config):
  n = config.getoption("--cpu-report")
  if not n or not _CPU_BY_TEST:
    return
  total = sum(_CPU_BY_TEST.values())
  terminalreporter.write_sep("=", f"{n} most CPU-costly tests (of {total:.0f} CPU-s in tests)")
  for nodeid, seconds in sorted(_CPU_BY_TEST.items(), key=lambda kv: -kv[1])[:n]:
    terminalreporter.write_line(f"{seconds:8.1f}s  {nodeid}")
  by_module: dict[str, list] = {}
  for nodeid, seconds in _CPU_BY_TEST.items():
    module = by_module.setdefault(nodeid.split("::")[0], [0.0, 0, 0.0, 0.0, 0.0])
    module[0] += seconds
    for i, value in enumerate(_COMPILED_BY_TEST.get(nodeid, (0, 0.0, 0.0, 0.0)), start=1):
      module[i] += value
  programs, backend, trace, lower = (sum(m[i] for m in by_module.values()) for i in range(1, 5))
  terminalreporter.write_sep(
      "-", f"by module: CPU-s; the programs XLA compiled in the test processes, with their "
           f"backend, tracing and lowering seconds (of {programs}: {backend:.0f}, {trace:.0f} and "
           f"{lower:.0f} s)")
  for module, (seconds, programs, backend, trace, lower) in sorted(
      by_module.items(), key=lambda kv: -kv[1][0])[:n]:
    terminalreporter.write_line(f"{seconds:8.1f}s  {programs:5d} {backend:6.1f}s {trace:6.1f}s "
                                f"{lower:6.1f}s  {module}")
