"""Multi-process training with real processes on CPU (jax.distributed, gloo collectives).

Two processes with two simulated devices each must train exactly like one process with four:
same mesh ({data: 2, fsdp: 2}), same global batches, same losses. The reference is one process
with four devices; the multi-process runs start through `stablejax launch` (and SIGHUP) and
through the JAX environment variables (with one process killed). Every process is started with
a timeout, and the launcher kills its processes when it dies, so a hang fails the test instead
of stalling the suite.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from helpers import (ROOT, SESSION_JAX_VARIABLES, TINY, TRAIN, read_metrics, run_inprocess,
                     run_subprocess, sets, slow, train_losses, xla_flags_with_devices)

HEARTBEAT = 10  # mesh.heartbeat_timeout of the multi-process runs: a lost peer is noticed within it
STAGE_TIMEOUT = 300  # each start of a job, here about 40 s (two compilations per process)
RUN = ["train.steps=30", "train.eval_every=10", "checkpoint.every=10", "train.log_every=2",
       "logging.histogram_every=0", "logging.activation_every=10", "logging.tensorboard=false",
       "mesh.data=2", "mesh.fsdp=2"]
DISTRIBUTED = ["mesh.distributed=true", f"mesh.heartbeat_timeout={HEARTBEAT}",
               "mesh.initialization_timeout=300", "mesh.shutdown_timeout=60"]
LAUNCH = [sys.executable, "-m", "stablejax", "launch", "--nproc", "2", "--devices-per-proc", "2",
          "--grace", "30", "--"]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _wait_for_step(out: Path, step: int, procs, timeout: float) -> int:
  """Polls metrics.jsonl until a train record reaches `step`; returns the step seen."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    try:
      steps = [r["step"] for r in read_metrics(out) if "loss" in r and "event" not in r]
    except (OSError, ValueError):  # not written yet, or a line half written
      steps = []
    if steps and max(steps) >= step:
      return max(steps)
    if any(p.poll() is not None for p in procs):
      raise AssertionError(f"a process ended before step {step}: {[p.returncode for p in procs]}")
    time.sleep(0.2)
  raise AssertionError(f"no step {step} within {timeout}s")


def _kill_all(procs) -> None:
  for p in procs:
    if p.poll() is None:
      p.kill()
      p.wait()


def _diagnostics(out: Path) -> dict:
  return {r["step"]: (r["act_rms"], r["logit_max"]) for r in read_metrics(out) if "act_rms" in r}


def _val_losses(out: Path) -> dict:
  return {r["step"]: r["val_loss"] for r in read_metrics(out) if "val_loss" in r}


def _assert_same_run(got: Path, want: Path) -> None:
  a, b = train_losses(got), train_losses(want)
  assert a.keys() == b.keys() and max(a) == 30, (sorted(a), sorted(b))
  np.testing.assert_allclose([a[s] for s in sorted(a)], [b[s] for s in sorted(b)], rtol=1e-4)
  va, vb = _val_losses(got), _val_losses(want)
  assert va.keys() == vb.keys() == {10, 20, 30}
  np.testing.assert_allclose([va[s] for s in sorted(va)], [vb[s] for s in sorted(vb)], rtol=1e-4)
  da, db = _diagnostics(got), _diagnostics(want)  # computed on a validation batch
  assert da.keys() == db.keys() and da
  np.testing.assert_allclose([da[s] for s in sorted(da)], [db[s] for s in sorted(db)], rtol=1e-4)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """One process with four simulated devices: what the two-process runs must reproduce."""
  out = tmp_path_factory.mktemp("one_process")
  result = run_subprocess(out, *RUN, fresh=True, devices=4, timeout=STAGE_TIMEOUT)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "mesh {'data': 2, 'fsdp': 2}" in result.stdout
  return out


@slow
def test_one_device_trains_like_the_four_device_reference(reference, tmp_path):
  """The same run on one device (in this process) and on a 2 x 2 mesh: same losses."""
  out = tmp_path / "one_device"
  assert run_inprocess(out, *RUN, "mesh.data=1", "mesh.fsdp=1") == 0
  one, four = train_losses(out), train_losses(reference)
  assert one.keys() == four.keys() and max(one) == 30
  np.testing.assert_allclose([one[s] for s in sorted(one)], [four[s] for s in sorted(four)],
                             rtol=2e-3)
  np.testing.assert_allclose([_val_losses(out)[s] for s in (10, 20, 30)],
                             [_val_losses(reference)[s] for s in (10, 20, 30)], rtol=2e-3)


def _start_env_process(rank: int, port: int, out: Path, log: Path) -> subprocess.Popen:
  """One process of a 2-process job, joined through JAX's environment variables."""
  env = dict(os.environ, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2",
             JAX_PROCESS_ID=str(rank), XLA_FLAGS=xla_flags_with_devices(2))
  cmd = [sys.executable, str(TRAIN), *sets(*RUN, *DISTRIBUTED), "--out", str(out)]
  return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def _checkpoint_steps(out: Path) -> list[int]:
  return sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())


def _wait_or_fail(proc: subprocess.Popen, logs: list[Path], what: str) -> tuple[str, str]:
  """Waits up to STAGE_TIMEOUT for `proc`; returns its (stdout, stderr) logs, or fails the test
  with them (read before tmp_path goes)."""
  try:
    proc.wait(timeout=STAGE_TIMEOUT)
  except subprocess.TimeoutExpired:
    pytest.fail(f"{what} within {STAGE_TIMEOUT} s:\n"
                + "\n".join(log.read_text()[-4000:] for log in logs))
  return logs[0].read_text(), logs[1].read_text()


def _own_lines(text: str, rank: int) -> list[str]:
  """Lines a process printed through the launcher, without gloo's own connection messages.

  Gloo prints one message per device from that device's thread, so two of them can interleave
  into one line followed by an empty one: empty lines are dropped with the messages.
  """
  return [line for line in text.splitlines() if line.startswith(f"[{rank}] ")
          and "peer ranks" not in line and line[len(f"[{rank}] "):].strip()]


@slow
@pytest.mark.timeout(5 * STAGE_TIMEOUT)  # the reference and three stages, each within its own
def test_sighup_kill_and_relaunch_resume_like_one_process(reference, tmp_path):
  """Launcher + SIGHUP (a closed terminal; the launcher passes it on like SIGTERM and SIGINT),
  then env-var launch + one process killed, then a relaunch to the end."""
  out = tmp_path / "run"
  launch = LAUNCH + [str(TRAIN), *sets(*RUN, *DISTRIBUTED), "--out", str(out)]

  # 1. stablejax launch; SIGHUP to the launcher reaches both processes: one save, exit 130.
  logs = [tmp_path / "launch1.out", tmp_path / "launch1.err"]
  first = subprocess.Popen(launch + ["--fresh"], cwd=ROOT, stdout=open(logs[0], "w"),
                           stderr=open(logs[1], "w"))
  try:
    _wait_for_step(out, 4, [first], timeout=STAGE_TIMEOUT)
    first.send_signal(signal.SIGHUP)
    stdout, stderr = _wait_or_fail(first, logs, "the launcher did not exit after SIGHUP")
  finally:
    _kill_all([first])
  assert first.returncode == 130, stderr[-3000:]
  assert "2 process(es)" in stdout and "mesh {'data': 2, 'fsdp': 2}" in stdout
  saved = [line for line in stdout.splitlines() if "SIGHUP at step" in line]
  assert len(saved) == 1 and saved[0].startswith("[0] "), stdout[-3000:]
  assert saved[0].endswith("checkpoint saved; run the same command to resume"), saved[0]
  assert _own_lines(stdout, 1) == [] and _own_lines(stderr, 1) == []  # process 1 prints nothing
  stopped = int(saved[0].split("SIGHUP at step ")[1].split(":")[0])
  assert 4 <= stopped < 20
  assert _checkpoint_steps(out) == [s for s in (0, 10) if s < stopped] + [stopped]

  # 2. The same job through JAX's environment variables; it resumes, then process 1 is killed.
  port = _free_port()
  logs = [tmp_path / f"env{r}.log" for r in range(2)]
  procs = [_start_env_process(r, port, out, logs[r]) for r in range(2)]
  try:
    kill_after = max(12, stopped + 2)  # past the checkpoint of step 10
    _wait_for_step(out, kill_after, procs, timeout=STAGE_TIMEOUT)
    procs[1].kill()
    killed_at = time.monotonic()
    survivor = procs[0].wait(timeout=HEARTBEAT + 60)
    waited = time.monotonic() - killed_at
  finally:
    _kill_all(procs)
  log = logs[0].read_text()
  assert f"resuming at step {stopped}" in log, log[-3000:]
  assert survivor != 0, log[-3000:]
  assert waited < HEARTBEAT + 30, waited
  last_checkpoint = _checkpoint_steps(out)[-1]  # complete ones only (Orbax renames when done)
  assert last_checkpoint >= 10

  # 3. The same launcher command again: resumes from the last complete checkpoint, finishes.
  logs = [tmp_path / "launch3.out", tmp_path / "launch3.err"]
  second = subprocess.Popen(launch, cwd=ROOT, stdout=open(logs[0], "w"), stderr=open(logs[1], "w"))
  try:
    stdout, stderr = _wait_or_fail(second, logs, "the relaunch did not finish")
  finally:
    _kill_all([second])
  assert second.returncode == 0, stderr[-3000:]
  assert f"resuming at step {last_checkpoint}" in stdout, stdout[-3000:]
  _assert_same_run(out, reference)
  summary = json.loads((out / "summary.json").read_text())
  assert summary["steps"] == 30 and summary["exit_code"] == 0 and summary["rollbacks"] == 0


# ----------------------------------------------------------------------------- collectives

# The bodies of a compiled module's conditionals and loops, and what they call, read from its
# text: how many collectives run inside control flow.
_CONTROL_FLOW = textwrap.dedent("""
    import json, re, sys
    import jax, jax.numpy as jnp, numpy as np
    sys.path.insert(0, sys.argv[1])
    from helpers import tiny_config
    from stablejax.data.pipeline import build_data
    from stablejax.training.launch import mesh as mesh_lib
    from stablejax.training.loop import step as step_lib
    from stablejax.training.loop.components import build_components

    COLLECTIVE = re.compile(r" (all-reduce|all-gather|collective-permute|reduce-scatter|"
                            r"all-to-all)(-start)?\\(")
    CALLED = re.compile(r"(?:branch_computations=\\{|calls=|to_apply=|body=|condition=)"
                        r"([^}\\s]+(?:, %[\\w.\\-]+)*)")
    NAME = re.compile(r"%[\\w.\\-]+")

    def in_control_flow(hlo):
        bodies = {}
        for block in re.split(r"\\n(?=(?:ENTRY )?%[\\w.\\-]+ \\()", hlo):
            name = re.match(r"(?:ENTRY )?(%[\\w.\\-]+) ", block)
            if name:
                bodies[name.group(1)] = block
        def count(name, seen):
            body = bodies.get(name, "")
            called = {c for group in CALLED.findall(body) for c in NAME.findall(group)}
            return len(COLLECTIVE.findall(body)) + sum(count(c, seen | {c}) for c in called - seen)
        text = "\\n".join(bodies.values())
        conditionals = re.findall(r"conditional\\(.*?branch_computations=\\{([^}]*)\\}", text)
        branches = [b for group in conditionals for b in NAME.findall(group)]
        loops = re.findall(r" while\\(.*?body=(%[\\w.\\-]+)", text)
        return {"conditionals": len(branches) // 2, "loops": len(loops),
                "collectives": sum(count(b, {b}) for b in branches + loops)}

    def step_hlo(*overrides):
        cfg = tiny_config("mesh.data=2", "mesh.fsdp=2", *overrides)
        data = build_data(cfg.data, seq_len=cfg.train.seq_len, batch_size=cfg.train.batch_size,
                          seed=0)
        c = build_components(cfg, data)
        accum = cfg.train.grad_accum
        batch = {"tokens": jax.ShapeDtypeStruct(
                     (accum, cfg.train.batch_size // accum, cfg.train.seq_len + 1), jnp.int32,
                     sharding=c.tokens_sharding),
                 "grad_scale": jax.ShapeDtypeStruct((), jnp.float32,
                                                    sharding=mesh_lib.replicated(c.mesh)),
                 "run_steps": jax.ShapeDtypeStruct((), jnp.int32,
                                                   sharding=mesh_lib.replicated(c.mesh)),
                 "read_metrics": jax.ShapeDtypeStruct((), jnp.bool_,
                                                      sharding=mesh_lib.replicated(c.mesh))}
        return c.train_step.lower(c.abstract_state, batch).compile().as_text()

    # The reading itself: a conditional with a psum in each branch, a loop with one in its body
    # (shard_maps over the 4 devices).
    mesh = jax.make_mesh((4,), ("d",))
    x = jax.device_put(jnp.ones(4), jax.NamedSharding(mesh, jax.P("d")))
    def probe(fn):
        f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=jax.P("d"), out_specs=jax.P("d")))
        return in_control_flow(f.lower(x).compile().as_text())
    out = {"ordered": step_lib.control_flow_collectives_ordered(),
           "probe_cond": probe(lambda v: jax.lax.cond(v[0] > 0, lambda u: jax.lax.psum(u, "d"),
                                                      lambda u: jax.lax.psum(-u, "d"), v)),
           "probe_loop": probe(lambda v: jax.lax.fori_loop(
               0, v[0].astype(jnp.int32), lambda i, u: u + jax.lax.psum(u, "d"), v)),
           "step": in_control_flow(step_hlo()),
           "accumulating_step": in_control_flow(step_hlo("train.grad_accum=2"))}
    print(json.dumps(out))
""")


def test_no_collective_inside_control_flow_of_the_cpu_train_step():
  """On XLA:CPU a collective inside a conditional or a loop can run out of order with the step's
  others; across processes that deadlocked a 2 x 2 job (step.control_flow_collectives_ordered).
  The train step compiled for the tests' 2 x 2 mesh, with and without gradient accumulation,
  keeps its conditionals (the skip wrappers') and loops free of collectives."""
  env = dict(os.environ, XLA_FLAGS=xla_flags_with_devices(4), JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", _CONTROL_FLOW, str(Path(__file__).parent)],
                        capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-4000:]
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  # The reading sees collectives in control flow where there are some.
  assert out["probe_cond"] == {"conditionals": 1, "loops": 0, "collectives": 2}, out
  assert out["probe_loop"]["loops"] == 1 and out["probe_loop"]["collectives"] == 1, out
  assert out["ordered"] is False
  for step in (out["step"], out["accumulating_step"]):
    assert step["conditionals"] >= 2 and step["collectives"] == 0, out


# ----------------------------------------------------------------------------- joining


def test_join_pieces_come_from_config_then_environment(monkeypatch):
  from stablejax.training.launch import distributed
  from stablejax.training.config import ConfigError, MeshConfig
  for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    monkeypatch.delenv(name, raising=False)
  assert distributed.resolve(MeshConfig(distributed=True)) == (None, None, None)
  monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.1.2.3:1234")
  monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
  monkeypatch.setenv("JAX_PROCESS_ID", "3")
  assert distributed.resolve(MeshConfig(distributed=True)) == ("10.1.2.3:1234", 4, 3)
  explicit = MeshConfig(distributed=True, coordinator_address="host0:99", num_processes=2,
                        process_id=0)
  assert distributed.resolve(explicit) == ("host0:99", 2, 0)
  monkeypatch.setenv("JAX_PROCESS_ID", "three")
  with pytest.raises(ConfigError, match="JAX_PROCESS_ID='three' is not an integer"):
    distributed.resolve(MeshConfig(distributed=True))
  with pytest.raises(ConfigError, match=r"process id 5 is outside \[0, 2\)"):
    distributed.resolve(MeshConfig(distributed=True, num_processes=2, process_id=5))


def test_join_keys_without_distributed_are_an_error():
  from stablejax.training.config import ConfigError, config_from_dict
  with pytest.raises(ConfigError, match="mesh.process_id is set but mesh.distributed=false"):
    config_from_dict({"mesh": {"process_id": 1}})
  with pytest.raises(ConfigError, match="mesh.heartbeat_timeout=0 must be > 0"):
    config_from_dict({"mesh": {"distributed": True, "heartbeat_timeout": 0}})


def _clean_env(**extra) -> dict:
  env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "SLURM_", "OMPI_"))}
  env.update(extra)
  return env


@pytest.mark.parametrize("args,env,needle", [
    (["mesh.distributed=true"], {},
     "mesh.distributed=true but the coordinator address is unknown and no SLURM, Open MPI, "
     "Kubernetes or Cloud TPU cluster was detected: set mesh.coordinator_address or "
     "JAX_COORDINATOR_ADDRESS"),
    (["mesh.distributed=true"], {"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1"},
     "the process count is unknown"),
    (["mesh.distributed=true", "mesh.num_processes=2"], {"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1"},
     "set mesh.process_id or JAX_PROCESS_ID"),
])
def test_missing_join_piece_exits_2_with_one_line(tmp_path, args, env, needle):
  # A process each: these are refused by jax.distributed.initialize itself, which a process may
  # call only before its first computation.
  cmd = [sys.executable, str(TRAIN), *sets(*args), "--out", str(tmp_path / "run")]
  session_jax = {name: os.environ[name] for name in SESSION_JAX_VARIABLES if name in os.environ}
  result = subprocess.run(cmd, cwd=ROOT, env=_clean_env(**session_jax, **env),
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == 2, result.stderr[-2000:]
  lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
  assert len(lines) == 1 and needle in lines[0], result.stderr[-2000:]
  assert "Traceback" not in result.stderr


def test_several_processes_announced_without_distributed_exit_2_with_one_line(
    tmp_path, monkeypatch, capsys):
  # In this process: refused before anything would join a job.
  from stablejax.cli.train import main
  for name in list(os.environ):
    if name.startswith(("JAX_", "SLURM_", "OMPI_")) and name not in SESSION_JAX_VARIABLES:
      monkeypatch.delenv(name)
  monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
  assert main(["--out", str(tmp_path / "run")]) == 2
  err = capsys.readouterr().err
  lines = [line for line in err.splitlines() if line.startswith("error:")]
  assert lines == ["error: JAX_NUM_PROCESSES=2 is set but mesh.distributed=false, so each process "
                   "would train alone: add --set mesh.distributed=true"], err[-2000:]
  import jax
  assert not jax.distributed.is_initialized()


# ----------------------------------------------------------------------------- the launcher

CHILD = r"""
import os, signal, sys, time
rank = int(os.environ["JAX_PROCESS_ID"])
print(rank, os.environ["JAX_NUM_PROCESSES"], os.environ["JAX_COORDINATOR_ADDRESS"],
      os.environ["XLA_FLAGS"], flush=True)
mode = sys.argv[1]
if mode == "fail":
  if rank == 1:
    sys.exit(3)
  time.sleep(60)
elif mode == "signal":
  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda s, f: (print("got", s, flush=True), sys.exit(130)))
  print("ready", os.getpid(), flush=True)
  time.sleep(60)
elif mode == "flood":  # far more than a pipe holds, then a clean exit
  for i in range(20000):
    print(f"line {i} " + "x" * 80, flush=i % 100 == 0)
  sys.exit(0)
elif mode == "devices":
  print("devices", *(f"{k}={os.environ.get(k)}" for k in sys.argv[2:]), flush=True)
print("progress 1\rprogress 2\rdone", flush=True)
print("to stderr", file=sys.stderr, flush=True)
"""


def _launch(tmp_path, *args, mode="ok", timeout=60, shell=False, child_args=()):
  script = tmp_path / "child.py"
  script.write_text(CHILD)
  child = [str(script), mode, *child_args]
  if shell:  # a shell that stays the parent of the Python process (a second command follows)
    child = ["sh", "-c", f"{sys.executable} {script} {mode}; echo shell done"]
  cmd = [sys.executable, "-m", "stablejax", "launch", *args, "--", *child]
  env = dict(os.environ, XLA_FLAGS="--xla_cpu_foo=1 --xla_force_host_platform_device_count=7")
  env.pop("JAX_PLATFORMS", None)
  return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _communicate(proc, timeout: float) -> tuple[str, str]:
  """stdout and stderr as text, with "\r" kept (text mode would turn it into "\n")."""
  stdout, stderr = proc.communicate(timeout=timeout)
  return stdout.decode(), stderr.decode()


def test_launcher_sets_the_environment_and_prefixes_output(tmp_path):
  proc = _launch(tmp_path, "--nproc", "3", "--devices-per-proc", "2")
  stdout, stderr = _communicate(proc, timeout=60)
  assert proc.returncode == 0, stderr
  lines = stdout.splitlines()
  env_lines = sorted(line for line in lines if "127.0.0.1:" in line)
  assert len(env_lines) == 3
  ports = {line.split("127.0.0.1:")[1].split()[0] for line in env_lines}
  assert len(ports) == 1  # one coordinator for all
  for rank, line in enumerate(env_lines):
    assert line.startswith(f"[{rank}] {rank} 3 127.0.0.1:")
    # an existing device count is replaced, other XLA flags are kept
    assert line.endswith("--xla_cpu_foo=1 --xla_force_host_platform_device_count=2")
  assert "[1] done" in stdout.replace("\r", "\n").splitlines()
  assert "[2] to stderr" in stderr.splitlines()
  assert "[0] progress 1\r[0] progress 2\r[0] done" in stdout  # in-place updates stay in place


def test_launcher_exits_with_the_first_failure_and_stops_the_others(tmp_path):
  start = time.monotonic()
  proc = _launch(tmp_path, "--nproc", "2", "--grace", "1", mode="fail")
  stdout, stderr = _communicate(proc, timeout=60)
  assert proc.returncode == 3
  assert time.monotonic() - start < 30  # rank 0 would sleep for 60 s
  assert "launch: process 1 exited with 3; killing 0 after 1s" in stderr


def test_launcher_forwards_sigterm(tmp_path):
  proc = _launch(tmp_path, "--nproc", "2", mode="signal")
  _wait_ready(proc)
  proc.send_signal(signal.SIGTERM)
  stdout, _ = _communicate(proc, timeout=30)
  assert proc.returncode == 130
  assert "[0] got 15" in stdout and "[1] got 15" in stdout


def _wait_ready(proc) -> list[int]:
  """The pids of the launched processes, once both have installed their signal handler."""
  pids = []
  while len(pids) < 2:
    line = proc.stdout.readline().decode()
    assert line, proc.stderr.read()
    if " ready " in line:
      pids.append(int(line.split()[-1]))
  return pids


def test_launcher_death_takes_its_processes_along(tmp_path):
  proc = _launch(tmp_path, "--nproc", "2", mode="signal")
  pids = _wait_ready(proc)
  proc.kill()  # SIGKILL: no chance to forward anything
  proc.wait(timeout=30)
  _assert_all_end(pids)


def _assert_all_end(pids) -> None:
  """Every process of ``pids`` ends within 20 s (those that do not are killed, then reported)."""
  deadline = time.monotonic() + 20
  while time.monotonic() < deadline and any(map(_running, pids)):
    time.sleep(0.1)
  alive = [pid for pid in pids if _running(pid)]
  for pid in alive:
    os.kill(pid, signal.SIGKILL)
  assert not alive


def _running(pid: int) -> bool:
  """Whether `pid` is a live process (a zombie nobody reaped yet counts as gone)."""
  try:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
  except (OSError, IndexError):
    return False


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_launcher_signals_reach_ranks_wrapped_in_a_shell(tmp_path, sig):
  proc = _launch(tmp_path, "--nproc", "2", "--grace", "20", mode="signal", shell=True)
  try:
    pids = _wait_ready(proc)
    proc.send_signal(sig)
    stdout, stderr = _communicate(proc, timeout=60)
  finally:
    _kill_all([proc])
  assert f"[0] got {int(sig)}" in stdout and f"[1] got {int(sig)}" in stdout, (stdout, stderr)
  # the shell's own code: 130 from its rank, or 128 + N when the signal killed the shell first
  assert proc.returncode in (130, 128 + int(sig)), stderr
  assert not any(map(_running, pids))


def test_launcher_death_takes_ranks_wrapped_in_a_shell_along(tmp_path):
  proc = _launch(tmp_path, "--nproc", "2", mode="signal", shell=True)
  pids = _wait_ready(proc)  # the Python processes, children of the shells
  proc.kill()  # SIGKILL: no chance to forward anything
  proc.wait(timeout=30)
  _assert_all_end(pids)


def test_launcher_keeps_draining_when_its_stdout_goes_away(tmp_path):
  """`launch ... | head -1`: the reader exits, the processes keep writing 1.7 MB each; the job
  must end on its own with its exit code, not block on full pipes."""
  proc = _launch(tmp_path, "--nproc", "2", mode="flood")
  try:
    first = proc.stdout.readline()
    assert first.startswith(b"["), first
    proc.stdout.close()  # what head does after its line
    try:
      proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
      raise AssertionError("the launcher hung after its stdout closed") from None
    stderr = proc.stderr.read().decode()
  finally:
    _kill_all([proc])
  assert proc.returncode == 0, stderr
  notes = [line for line in stderr.splitlines() if line.startswith("launch: stdout was closed")]
  assert len(notes) == 1, stderr
  assert "Traceback" not in stderr and "BrokenPipe" not in stderr, stderr


DEVICE_VARS = ["XLA_FLAGS", "JAX_LOCAL_DEVICE_IDS", "TPU_VISIBLE_CHIPS",
               "TPU_CHIPS_PER_PROCESS_BOUNDS", "TPU_PROCESS_BOUNDS", "CLOUD_TPU_TASK_ID",
               "TPU_PROCESS_PORT", "TPU_PROCESS_ADDRESSES"]


def _device_lines(stdout: str) -> dict[int, dict[str, str]]:
  """{rank: {variable: value}} from the children's "devices" lines."""
  found = {}
  for line in stdout.splitlines():
    if " devices " in line:
      rank = int(line[1:line.index("]")])
      found[rank] = dict(item.split("=", 1) for item in _split_vars(line.split(" devices ", 1)[1]))
  return found


def _split_vars(text: str) -> list[str]:
  """KEY=VALUE items of a devices line (values may hold spaces: XLA_FLAGS)."""
  items, current = [], None
  for word in text.split(" "):
    if "=" in word and word.split("=", 1)[0] in DEVICE_VARS:
      current = word
      items.append(current)
    else:
      items[-1] += " " + word
  return items


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_launcher_gives_each_rank_its_own_accelerators(tmp_path, platform):
  """--platform gpu/tpu on this CPU host: the variables each rank gets (what JAX reads)."""
  proc = _launch(tmp_path, "--nproc", "2", "--devices-per-proc", "2", "--platform", platform,
                 mode="devices", child_args=DEVICE_VARS)
  stdout, stderr = _communicate(proc, timeout=60)
  assert proc.returncode == 0, stderr
  got = _device_lines(stdout)
  assert sorted(got) == [0, 1]
  for rank in (0, 1):
    env = got[rank]
    # CPU devices stay as the user set them; accelerators are split.
    assert env["XLA_FLAGS"] == "--xla_cpu_foo=1 --xla_force_host_platform_device_count=7"
    want_ids = "0,1" if rank == 0 else "2,3"
    if platform == "gpu":
      assert env["JAX_LOCAL_DEVICE_IDS"] == want_ids and env["TPU_VISIBLE_CHIPS"] == "None"
    else:
      assert env["JAX_LOCAL_DEVICE_IDS"] == "None"
      assert env["TPU_VISIBLE_CHIPS"] == want_ids and env["CLOUD_TPU_TASK_ID"] == str(rank)
      # JAX's own layout for 2 processes x 2 chips on a 4-chip host
      assert env["TPU_PROCESS_BOUNDS"] == "2,1,1"
      assert env["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "1,2,1"
      addresses = env["TPU_PROCESS_ADDRESSES"].split(",")
      assert len(set(addresses)) == 2 and addresses[rank] == f"localhost:{env['TPU_PROCESS_PORT']}"
  assert got[0]["TPU_PROCESS_ADDRESSES"] == got[1]["TPU_PROCESS_ADDRESSES"]


def test_device_plan_detection_and_limits(monkeypatch):
  from stablejax.training.launch import launcher as launch_lib
  detect = launch_lib.detect_platform
  monkeypatch.setattr(launch_lib, "detect_platform", lambda: ("gpu", 8))
  assert launch_lib.plan_devices(4, None) == ("gpu", 2)  # divided evenly
  assert launch_lib.plan_devices(2, 3) == ("gpu", 3)
  with pytest.raises(launch_lib.LaunchError, match="need 10, but this host has 8"):
    launch_lib.plan_devices(2, 5)
  with pytest.raises(launch_lib.LaunchError, match="8 GPU\\(s\\) for 16 processes"):
    launch_lib.plan_devices(16, None)
  monkeypatch.setattr(launch_lib, "detect_platform", lambda: ("cpu", 0))
  assert launch_lib.plan_devices(2, 4) == ("cpu", 4)
  assert launch_lib.plan_devices(2, None) == ("cpu", None)
  with pytest.raises(launch_lib.LaunchError, match="not a layout JAX sets up"):
    launch_lib.plan_devices(3, 1, "tpu", available=4)
  # Detection reads CUDA_VISIBLE_DEVICES only where NVIDIA's device files exist, and
  # JAX_PLATFORMS=cpu looks for nothing.
  monkeypatch.setattr(launch_lib, "_tpu_chips", lambda: 0)
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
  monkeypatch.delenv("JAX_PLATFORMS", raising=False)
  monkeypatch.setattr(launch_lib.os.path, "exists", lambda p: p == "/dev/nvidiactl")
  assert detect() == ("gpu", 3)
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  assert detect() == ("cpu", 0)
  monkeypatch.delenv("JAX_PLATFORMS")
  monkeypatch.setattr(launch_lib.os.path, "exists", lambda p: False)
  assert detect() == ("cpu", 0)


def test_launcher_bad_arguments_exit_2(tmp_path):
  for args in (["--nproc", "0", "--", "x.py"], ["--nproc", "2"]):
    result = subprocess.run([sys.executable, "-m", "stablejax", "launch", *args], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and len(result.stderr.splitlines()) == 1


# ----------------------------------------------------------------------------- data slices

SLICE = ["mesh.data=2", "mesh.fsdp=2", "train.batch_size=8", "train.eval_batches=2"]


def _slice_child(out: str) -> None:
  """In each process of a 2 x 2 launch: this process's rows and the global arrays built from
  them."""
  import jax
  from jax.experimental import multihost_utils

  from stablejax.training.config import load_config
  from stablejax.training.loop.trainer import Trainer

  cfg = load_config(ROOT / "stablejax" / "configs" / "default.json",
                    [*TINY, *SLICE, "mesh.distributed=true", "mesh.initialization_timeout=300"])
  run = Trainer(cfg, Path(out) / "run")
  it = run.components.data.train_iter()
  local_train = [np.asarray(next(it)["tokens"], np.int32) for _ in range(2)]
  local_val = [np.asarray(b["tokens"], np.int32) for b in run.components.data.val_batches(2)]
  global_train = [multihost_utils.process_allgather(run.components.device_tokens(t), tiled=True)
                  for t in local_train]
  global_val = [multihost_utils.process_allgather(v, tiled=True)
                for v in run.components.val_batches()]
  from stablejax.training.launch import distributed
  rank = jax.process_index()
  agreed = [distributed.agree_max(rank + 0.5), distributed.agree_any(rank == 1),
            distributed.agree_any(False), *distributed.agree_max(np.array([rank, -rank, 7]))]
  np.savez(Path(out) / f"rows{rank}.npz", train=np.stack(local_train),
           val=np.stack(local_val), global_train=np.stack(global_train),
           global_val=np.stack(global_val), devices=[d.id for d in jax.local_devices()],
           agreed=np.array(agreed, np.float64))


def _slurm_env(rank: int, port: int) -> dict:
  """What `srun --ntasks 2` gives each task (JAX's SlurmCluster reads these), on this host."""
  return _clean_env(SLURM_JOB_ID="4242", SLURM_STEP_NODELIST="127.0.0.1", SLURM_NTASKS="2",
                    SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), JAX_COORDINATOR_PORT=str(port),
                    XLA_FLAGS=xla_flags_with_devices(2))


@slow
@pytest.mark.parametrize("route", ["launcher", "slurm"])
def test_processes_read_disjoint_rows_that_form_the_single_process_batch(tmp_path, route):
  """Each process's rows, and the global arrays the trainer builds from them (train and eval).

  "slurm": no JAX_* variables at all; JAX's cluster detection finds the job in SLURM's.
  """
  child = [str(Path(__file__).resolve()), str(tmp_path)]
  if route == "launcher":
    procs = [subprocess.Popen(LAUNCH + child, cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT)]
  else:
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, *child], cwd=ROOT, env=_slurm_env(r, port),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(2)]
  try:
    outputs = [p.communicate(timeout=180)[0].decode(errors="replace") for p in procs]
  finally:
    _kill_all(procs)
  assert [p.returncode for p in procs] == [0] * len(procs), "\n".join(outputs)[-3000:]
  parts = [np.load(tmp_path / f"rows{p}.npz") for p in range(2)]
  assert len({*parts[0]["devices"], *parts[1]["devices"]}) == 4  # two devices each, none shared
  for p in range(2):  # agree_max / agree_any: the same answer on both processes
    np.testing.assert_array_equal(parts[p]["agreed"], [1.5, 1, 0, 1, 0, 7])

  from stablejax.training.config import load_config
  from stablejax.data.pipeline import build_data
  cfg = load_config(ROOT / "stablejax" / "configs" / "default.json", [*TINY, *SLICE])
  t = cfg.train
  single = build_data(cfg.data, seq_len=t.seq_len, batch_size=t.batch_size, seed=t.seed)
  it = single.train_iter()
  want_train = np.stack([np.asarray(next(it)["tokens"], np.int32) for _ in range(2)])
  want_val = np.stack([b["tokens"] for b in single.val_batches(2)])

  for key, want in (("train", want_train), ("val", want_val)):
    a, b = parts[0][key], parts[1][key]
    assert a.shape == b.shape == (2, t.batch_size // 2, t.seq_len + 1)
    for batch in range(2):
      rows_a = {r.tobytes() for r in a[batch]}
      rows_b = {r.tobytes() for r in b[batch]}
      assert not rows_a & rows_b, f"{key} batch {batch}: a row read by both processes"
    np.testing.assert_array_equal(np.concatenate([a, b], axis=1), want)
  # The trainer's global arrays, gathered on each process, are the single-process batches.
  for p in range(2):
    np.testing.assert_array_equal(parts[p]["global_train"][:, 0], want_train)  # grad_accum = 1
    np.testing.assert_array_equal(parts[p]["global_val"], want_val)


if __name__ == "__main__":
  _slice_child(sys.argv[1])


# ----------------------------------------------------------------------------- replicas


@slow
def test_two_processes_stop_before_saving_when_one_replica_is_corrupted(tmp_path):
  """Process 1's copy of the parameters changed before step 12 (silent data corruption): the
  replica check at step 16 names it, both processes exit 17, and no checkpoint after step 10 is
  written."""
  out = tmp_path / "run"
  cmd = [sys.executable, "-m", "stablejax", "launch", "--nproc", "2", "--devices-per-proc", "1",
         "--grace", "30", "--", str(TRAIN),
         *sets("train.steps=40", "checkpoint.every=10", "logging.tensorboard=false",
               "faults.corrupt_replica_step=12", "faults.corrupt_replica_device=1",
               "stability.replicas.check_every=4", *DISTRIBUTED), "--out", str(out)]
  proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)
  try:
    stdout, stderr = proc.communicate(timeout=STAGE_TIMEOUT)
  finally:
    _kill_all([proc])
  assert proc.returncode == 17, stderr[-3000:]
  (line,) = [line for line in _own_lines(stderr, 0) if "copies of the parameters" in line]
  assert "step 16:" in line and line.endswith("(exit code 17)"), line
  assert "process 0 (device cpu:" in line and "process 1 (device cpu:" in line  # two copies
  assert "killing" not in stderr  # both ended by themselves, with code 17 (the launcher's)
  assert _checkpoint_steps(out) == [0, 10]
  (event,) = [r for r in read_metrics(out) if r.get("event") == "replicas_differ"]
  assert event["step"] == 16
