"""The suite's ``--cpu-report`` (the repository's ``conftest.py``): a function jitted inside
another is traced inside the outer trace, so its seconds are counted once, in the outer span."""

import threading

import pytest

TRACE = "/jax/core/compile/jaxpr_trace_duration"
LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"


@pytest.fixture
def report(request, monkeypatch):
  """The root conftest module, its counters and spans replaced by empty ones for the test."""
  (module,) = [p for p in request.config.pluginmanager.get_plugins() if hasattr(p, "_count_phase")]
  monkeypatch.setattr(module, "_COMPILED", [0, 0.0, 0.0, 0.0])
  monkeypatch.setattr(module, "_SPANS", {})
  return module


def test_nested_traces_count_once_and_other_threads_apart(report):
  report._count_phase(TRACE, 1.0, 1.2, fun_name="inner")
  report._count_phase(TRACE, 1.3, 1.5, fun_name="inner")
  # A trace in another thread during the outer one is not inside it.
  other = threading.Thread(target=report._count_phase, args=(TRACE, 1.55, 1.8))
  other.start()
  other.join()
  report._count_phase(TRACE, 0.9, 2.0, fun_name="outer")  # holds both inner ones
  report._count_phase(LOWER, 2.1, 2.4, fun_name="outer")
  report._count_phase("/jax/some/other/event", 0.0, 9.0)
  assert report._COMPILED[2] == pytest.approx(1.1 + 0.25)
  assert report._COMPILED[3] == pytest.approx(0.3)
  assert report._COMPILED[:2] == [0, 0.0]  # programs and backend seconds: their own listener
