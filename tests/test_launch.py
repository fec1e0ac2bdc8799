"""The launcher's plan for each rank (environment, devices, command) and its exit code, against
the values its documentation and JAX's own multi-process launcher give."""

import os
import signal
import subprocess
import sys

import pytest

from helpers import folder_locked_by
from stablejax.training.launch import launcher as launch_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_exit_code_of_a_signalled_process_is_128_plus_n():
  assert launch_lib.exit_code(-signal.SIGKILL) == 137
  assert launch_lib.exit_code(-signal.SIGTERM) == 143
  assert launch_lib.exit_code(3) == 3 and launch_lib.exit_code(0) == 0


def test_launch_reports_a_rank_killed_by_a_signal_as_128_plus_n(tmp_path):
  script = tmp_path / "die.py"
  script.write_text("import os, signal, sys\n"
                    "if os.environ['JAX_PROCESS_ID'] == '1':\n"
                    "  os.kill(os.getpid(), signal.SIGKILL)\n")
  proc = subprocess.run([sys.executable, "-m", "stablejax", "launch", "--nproc", "2", "--grace",
                         "5", "--", str(script)], cwd=ROOT, capture_output=True, text=True,
                        timeout=120)
  assert proc.returncode == 128 + signal.SIGKILL, proc.stderr


def test_with_device_count_replaces_an_existing_count():
  flags = launch_lib.with_device_count(
      "--xla_cpu_foo=1 --xla_force_host_platform_device_count=7", 2)
  assert flags == "--xla_cpu_foo=1 --xla_force_host_platform_device_count=2"
  assert launch_lib.with_device_count("", 3) == "--xla_force_host_platform_device_count=3"


def test_child_environment_per_rank():
  env = launch_lib.child_env(2, 3, 4321, 2, "cpu")
  assert env["JAX_COORDINATOR_ADDRESS"] == "127.0.0.1:4321"
  assert (env["JAX_NUM_PROCESSES"], env["JAX_PROCESS_ID"]) == ("3", "2")
  assert env["XLA_FLAGS"].endswith("--xla_force_host_platform_device_count=2")


@pytest.mark.parametrize("rank,ids", [(0, "0,1,2"), (1, "3,4,5"), (2, "6,7,8")])
def test_each_rank_gets_its_own_gpus(rank, ids):
  assert launch_lib.device_env(rank, 3, "gpu", 3, {}) == {"JAX_LOCAL_DEVICE_IDS": ids}


# JAX's own launcher (jax/_src/test_multiprocess.py): (processes, chips per process) ->
# (TPU_PROCESS_BOUNDS, TPU_CHIPS_PER_PROCESS_BOUNDS).
JAX_TPU_LAYOUTS = {(1, 1): ("1,1,1", "1,1,1"), (4, 1): ("2,2,1", "1,1,1"),
                   (2, 2): ("2,1,1", "1,2,1"), (1, 4): ("1,1,1", "2,2,1"),
                   (8, 1): ("4,2,1", "1,1,1"), (2, 4): ("1,2,1", "2,2,1"),
                   (1, 8): ("1,1,1", "2,4,1")}


@pytest.mark.parametrize("nproc,chips", sorted(JAX_TPU_LAYOUTS))
def test_tpu_layouts_are_jax_s(nproc, chips):
  ports = [9000 + r for r in range(nproc)]
  env = launch_lib.device_env(nproc - 1, nproc, "tpu", chips, {}, ports)
  assert (env["TPU_PROCESS_BOUNDS"], env["TPU_CHIPS_PER_PROCESS_BOUNDS"]) == \
      JAX_TPU_LAYOUTS[(nproc, chips)]
  first = (nproc - 1) * chips
  assert env["TPU_VISIBLE_CHIPS"] == ",".join(str(i) for i in range(first, first + chips))
  assert env["CLOUD_TPU_TASK_ID"] == str(nproc - 1)


def test_device_plan_limits():
  assert launch_lib.plan_devices(4, None, "gpu", available=8) == ("gpu", 2)
  assert launch_lib.plan_devices(3, None, "gpu", available=8) == ("gpu", 2)
  assert launch_lib.plan_devices(2, 4, "gpu", available=8) == ("gpu", 4)  # all 8, exactly
  with pytest.raises(launch_lib.LaunchError, match="need 9, but this host has 8"):
    launch_lib.plan_devices(3, 3, "gpu", available=8)


def test_python_files_and_modules_run_with_this_python():
  assert launch_lib.child_command(["train.py", "--x"]) == [sys.executable, "train.py", "--x"]
  assert launch_lib.child_command(["-m", "pkg"]) == [sys.executable, "-m", "pkg"]
  assert launch_lib.child_command(["sh", "-c", "true"]) == ["sh", "-c", "true"]


def test_jax_platforms_cpu_looks_for_no_accelerator(monkeypatch):
  monkeypatch.setattr(launch_lib, "_tpu_chips", lambda: 4)
  monkeypatch.setattr(launch_lib, "_nvidia_gpus", lambda: 2)
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  assert launch_lib.detect_platform() == ("cpu", 0)
  monkeypatch.setenv("JAX_PLATFORMS", "")
  assert launch_lib.detect_platform() == ("tpu", 4)
  monkeypatch.setenv("JAX_PLATFORMS", "cuda")
  assert launch_lib.detect_platform() == ("gpu", 2)




def test_a_second_launch_on_a_live_run_directory_is_one_line_and_exit_2(tmp_path):
  """Process 0 refuses the folder; every process learns it and they leave together: one error
  line, no XLA check failure from a process left waiting for its coordinator."""
  out = tmp_path / "run"
  out.mkdir()
  with folder_locked_by(out, "train"):
    proc = subprocess.run([sys.executable, "-m", "stablejax", "launch", "--nproc", "2", "--grace",
                           "20", "--", "train.py", "--set", "mesh.distributed=true", "--out",
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
  output = proc.stdout + proc.stderr
  assert proc.returncode == 2, output[-3000:]
  errors = [line for line in output.splitlines() if "error" in line.lower()]
  assert len(errors) == 1 and errors[0].startswith("[0] error: ") and "is in use by train" in \
      errors[0], output[-3000:]
  assert "Check failure" not in output and "Traceback" not in output and "launch:" not in output
  assert sorted(p.name for p in out.iterdir()) == [".lock"]
