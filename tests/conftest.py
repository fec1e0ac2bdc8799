"""Fixtures shared by the end-to-end trainer tests."""

import pytest

from trainer_utils import run_inprocess


@pytest.fixture(scope="session")
def clean_run(tmp_path_factory):
  """One uninterrupted tiny run without faults: the reference the fault and resume tests compare
  to."""
  out = tmp_path_factory.mktemp("clean")
  assert run_inprocess(out, "train.peak_flops_per_device=null") == 0  # MFU from the measured rate
  return out
