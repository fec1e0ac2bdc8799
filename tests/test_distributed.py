"""Joining a multi-process job (where each piece comes from) and agreeing across processes:
pure checks here, and one real two-process job on localhost (gloo) for the agreement calls."""

import os
import subprocess
import sys
import textwrap

import pytest

from stablejax.training.launch import distributed
from stablejax.training.config import ConfigError, MeshConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


@pytest.fixture
def env(monkeypatch):
  for name in ENV:
    monkeypatch.delenv(name, raising=False)
  return monkeypatch


def test_config_wins_over_the_environment_piece_by_piece(env):
  env.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1")
  env.setenv("JAX_NUM_PROCESSES", "4")
  env.setenv("JAX_PROCESS_ID", "3")
  cfg = MeshConfig(distributed=True)
  assert distributed.resolve(cfg) == ("10.0.0.1:1", 4, 3)
  assert distributed.resolve(MeshConfig(distributed=True, coordinator_address="h:2")) == (
      "h:2", 4, 3)
  assert distributed.resolve(MeshConfig(distributed=True, num_processes=8)) == (
      "10.0.0.1:1", 8, 3)
  assert distributed.resolve(MeshConfig(distributed=True, process_id=0)) == ("10.0.0.1:1", 4, 0)


def test_blank_variables_are_unset(env):
  for name in ENV:
    env.setenv(name, "  ")
  assert distributed.resolve(MeshConfig(distributed=True)) == (None, None, None)


@pytest.mark.parametrize("count,pid,ok", [(2, 1, True), (2, 2, False), (2, -1, False),
                                          (1, 0, True), (0, None, False), (-1, None, False)])
def test_process_count_and_id_ranges(env, count, pid, ok):
  cfg = MeshConfig(distributed=True, num_processes=count, process_id=pid)
  if ok:
    assert distributed.resolve(cfg)[1:] == (count, pid)
  else:
    with pytest.raises(ConfigError):
      distributed.resolve(cfg)


@pytest.mark.parametrize("count,error", [("1", False), ("2", True), ("3", True)])
def test_several_processes_announced_without_distributed_is_an_error(env, count, error):
  env.setenv("JAX_NUM_PROCESSES", count)
  if error:
    with pytest.raises(ConfigError, match=f"JAX_NUM_PROCESSES={count} is set but "
                                          "mesh.distributed=false"):
      distributed.initialize(MeshConfig())
  else:
    distributed.initialize(MeshConfig())


def test_single_process_agreement_returns_the_local_value():
  assert distributed.agree_max(2.5) == 2.5 and isinstance(distributed.agree_max(2.5), float)
  assert distributed.agree_max(7) == 7 and isinstance(distributed.agree_max(7), int)
  assert distributed.agree_any(True) is True and distributed.agree_any(False) is False


_JOB = textwrap.dedent("""
    import numpy as np
    from stablejax.training.launch import distributed
    from stablejax.training.config import MeshConfig
    distributed.initialize(MeshConfig(distributed=True, initialization_timeout=60,
                                      heartbeat_timeout=10, shutdown_timeout=30))
    import jax
    r = jax.process_index()
    print("agree", r, jax.process_count(), distributed.agree_any(r == 1),
          distributed.agree_any(False), distributed.agree_max(2.5 * r),
          distributed.agree_max(np.array([r, 5 - r])).tolist(), distributed.agree_max(r == 0),
          flush=True)
""")


def test_two_processes_agree_on_any_and_max(tmp_path):
  # What one process saw, every process gets: the any of the flags, the maximum of the values.
  script = tmp_path / "job.py"
  script.write_text(_JOB)
  env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "SLURM_", "OMPI_"))}
  proc = subprocess.run([sys.executable, "-m", "stablejax", "launch", "--nproc", "2",
                         "--devices-per-proc", "1", "--grace", "5", "--", str(script)],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = sorted(line for line in proc.stdout.splitlines() if " agree " in line)
  assert lines == ["[0] agree 0 2 True False 2.5 [1, 5] True",
                   "[1] agree 1 2 True False 2.5 [1, 5] True"], proc.stdout[-2000:]
