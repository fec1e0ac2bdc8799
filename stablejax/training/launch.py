"""Start a multi-process JAX job on this machine, the way `torchrun --standalone` does.

    python -m stablejax launch --nproc 2 --devices-per-proc 2 -- \\
        train.py --set mesh.distributed=true --out runs/mp

(the command line is :mod:`stablejax.cli.launch`; this module is the library it runs,
:func:`launch`) starts `--nproc` copies of the command, each with `JAX_COORDINATOR_ADDRESS`
(127.0.0.1 and a free port), `JAX_NUM_PROCESSES` and `JAX_PROCESS_ID` set, and (with
`--devices-per-proc N`) `XLA_FLAGS` asking for N simulated CPU devices per process. A command that
starts with a `.py` file runs with this Python (so does `-m module`); anything else runs as given.
Output lines are prefixed with the rank (`[0] ...`). SIGINT/SIGTERM/SIGHUP are forwarded to every
process (the trainer then saves a checkpoint and exits 130). When a process exits non-zero the
others get `--grace` seconds to stop on their own (JAX notices a lost peer within
`mesh.heartbeat_timeout`) and are then killed; the launcher exits with the first non-zero code
(128 + N for a process killed by signal N), else 0. If the launcher itself dies, its processes
are killed with it (Linux).
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Optional, Sequence

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
_PR_SET_PDEATHSIG = 1


def free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def child_command(command: list[str]) -> list[str]:
  if command[0].endswith(".py") or command[0] == "-m":
    return [sys.executable, *command]
  return list(command)


def with_device_count(xla_flags: str, n: int) -> str:
  """XLA_FLAGS with the simulated CPU device count set to `n` (an existing count is replaced)."""
  kept = [f for f in xla_flags.split() if not f.startswith(DEVICE_COUNT_FLAG)]
  return " ".join(kept + [f"{DEVICE_COUNT_FLAG}={n}"])


def child_env(rank: int, nproc: int, port: int, devices: Optional[int]) -> dict:
  env = dict(os.environ)
  env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(nproc),
             JAX_PROCESS_ID=str(rank), PYTHONUNBUFFERED="1")
  if devices is not None:
    env["XLA_FLAGS"] = with_device_count(env.get("XLA_FLAGS", ""), devices)
  return env


try:  # loaded here, not in the forked child, where taking the loader's lock could deadlock
  _LIBC = ctypes.CDLL("libc.so.6", use_errno=True)
except OSError:
  _LIBC = None


def _die_with_parent() -> None:
  """In the child before exec: get SIGKILL when the launcher dies (Linux; elsewhere a no-op)."""
  if _LIBC is not None:
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


_LOCK = threading.Lock()
_SEGMENT = re.compile(rb"([^\r\n]*)(\r\n|\r|\n)")


def _pump(rank: int, source: IO[bytes], sink: IO[str]) -> None:
  """Copies `source` to `sink`, each line prefixed with the rank ("\\r" updates stay in place)."""
  prefix = f"[{rank}] "
  pending = b""
  while True:
    chunk = os.read(source.fileno(), 65536)
    if not chunk:
      break
    pending += chunk
    end = 0
    out = []
    for m in _SEGMENT.finditer(pending):
      end_of_line = "\r" if m.group(2) == b"\r" else "\n"
      out.append(prefix + m.group(1).decode(errors="replace") + end_of_line)
      end = m.end()
    pending = pending[end:]
    if out:
      with _LOCK:
        sink.write("".join(out))
        sink.flush()
  if pending:
    with _LOCK:
      sink.write(prefix + pending.decode(errors="replace") + "\n")
      sink.flush()


def exit_code(returncode: int) -> int:
  return 128 - returncode if returncode < 0 else returncode


def launch(command: Sequence[str], nproc: int, *, devices_per_proc: Optional[int] = None,
           port: Optional[int] = None, grace: float = 30.0) -> int:
  """Runs ``nproc`` copies of ``command`` as one JAX job and supervises them.

  Args:
    command: the command and its arguments (a leading ``.py`` file or ``-m`` runs with this
      Python).
    nproc: processes to start.
    devices_per_proc: simulated CPU devices per process (sets ``XLA_FLAGS``); None leaves it.
    port: coordinator port (default: a free one).
    grace: after a process fails, how many seconds the others may take to stop.

  Returns:
    The exit code: the first non-zero one of the processes (128 + N for signal N), else 0; 2 when
    a process cannot be started.
  """
  port = port or free_port()
  command = child_command(list(command))
  procs: list[subprocess.Popen] = []
  pumps: list[threading.Thread] = []

  def forward(signum, frame):
    for p in procs:
      if p.poll() is None:
        try:
          os.kill(p.pid, signum)
        except ProcessLookupError:
          pass

  for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(sig, forward)

  for rank in range(nproc):
    try:
      p = subprocess.Popen(command, env=child_env(rank, nproc, port, devices_per_proc),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                           start_new_session=True, preexec_fn=_die_with_parent)
    except OSError as e:
      print(f"error: cannot start {command[0]!r}: {e.strerror}", file=sys.stderr)
      forward(signal.SIGKILL, None)
      return 2
    procs.append(p)
  for rank, p in enumerate(procs):  # threads only once every process is forked
    for source, sink in ((p.stdout, sys.stdout), (p.stderr, sys.stderr)):
      t = threading.Thread(target=_pump, args=(rank, source, sink), daemon=True)
      t.start()
      pumps.append(t)

  first_failure: Optional[tuple[int, int]] = None  # (rank, exit code)
  deadline = None
  while [p.poll() for p in procs].count(None):
    for rank, p in enumerate(procs):
      if first_failure is None and p.returncode not in (None, 0):
        first_failure = (rank, exit_code(p.returncode))
        deadline = time.monotonic() + grace
    if deadline is not None and time.monotonic() > deadline:
      alive = [rank for rank, p in enumerate(procs) if p.poll() is None]
      with _LOCK:
        print(f"launch: process {first_failure[0]} exited with {first_failure[1]}; killing "
              f"{', '.join(map(str, alive))} after {grace:g}s", file=sys.stderr, flush=True)
      forward(signal.SIGKILL, None)
      break
    time.sleep(0.05)
  for p in procs:
    p.wait()
  for t in pumps:
    t.join(timeout=5)
  if first_failure is None:
    failures = [(rank, exit_code(p.returncode)) for rank, p in enumerate(procs) if p.returncode]
    first_failure = failures[0] if failures else None
  return first_failure[1] if first_failure else 0
