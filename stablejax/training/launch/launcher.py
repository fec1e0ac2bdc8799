"""Start a multi-process JAX job on this machine, the way `torchrun --standalone` does.

    python -m stablejax launch --nproc 2 --devices-per-proc 2 -- \\
        train.py --set mesh.distributed=true --out runs/mp

(the command line is :mod:`stablejax.cli.launch`; this module is the library it runs,
:func:`launch`) starts `--nproc` copies of the command, each with `JAX_COORDINATOR_ADDRESS`
(127.0.0.1 and a free port), `JAX_NUM_PROCESSES` and `JAX_PROCESS_ID` set. A command that starts
with a `.py` file runs with this Python (so does `-m module`); anything else runs as given.

Devices (`device_env`): each process gets its own. On a CPU host `--devices-per-proc N` sets
`XLA_FLAGS` to N simulated CPU devices per process. On a host with NVIDIA GPUs (or `--platform
gpu`), process r gets GPUs r*N .. r*N+N-1 through `JAX_LOCAL_DEVICE_IDS`, which
`jax.distributed.initialize` reads (the trainer's `mesh.local_device_ids` wins over it); without
`--devices-per-proc` the host's GPUs are divided evenly. On a TPU host, the `TPU_*` variables of
JAX's own multi-process test launcher (`TPU_VISIBLE_CHIPS`, `TPU_CHIPS_PER_PROCESS_BOUNDS`,
`TPU_PROCESS_BOUNDS`, `TPU_PROCESS_ADDRESSES`, `TPU_PROCESS_PORT`, `CLOUD_TPU_TASK_ID`) for 1, 4 or
8 chips in all.

Output lines are prefixed with the rank (`[0] ...`). When the launcher's own stdout or stderr goes
away (`... | head`), that stream's output is discarded from then on (one `launch:` line says so on
the other stream) and the job runs on: the pipes from the processes are always drained, so they
never block.

Signals: each process runs in its own process group (session), and SIGINT, SIGTERM and SIGHUP to
the launcher go to every process of every group, so a command wrapped in a shell has its ranks
signalled too (the trainer saves a checkpoint and exits 130 on any of the three). When a process
exits non-zero, or a process's command exits leaving others in its group, the rest get `--grace`
seconds to stop on their own (JAX notices a lost peer within `mesh.heartbeat_timeout`) and are
then killed; the launcher exits with the first non-zero code (128 + N for a process killed by
signal N), else 0.

If the launcher itself is killed (even SIGKILL), its processes die with it: each direct child gets
SIGKILL from the kernel when its parent dies (Linux `PR_SET_PDEATHSIG`), and a small watchdog
process, which holds the read end of a pipe from the launcher, kills every process group when
that pipe closes. Limits: a process that leaves its group (`setsid`, a daemon) is not followed,
and a watchdog killed together with the launcher (`kill -9` of both) cannot act.
"""

from __future__ import annotations

import ctypes
import glob
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Callable, Optional, Sequence

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
LOCAL_DEVICE_IDS = "JAX_LOCAL_DEVICE_IDS"  # read by jax.distributed.initialize
PLATFORMS = ("auto", "cpu", "gpu", "tpu")
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1


class LaunchError(ValueError):
  """A launch that cannot be set up; one line naming the problem and the fix."""


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


# ----------------------------------------------------------------------------- devices

# What JAX's jax._src.hardware_utils looks at, read here without importing JAX (which would
# take a second, and on a TPU host could claim the chips before the processes do).
_GOOGLE_PCI_VENDOR = "0x1ae0"
_TPU_PCI_DEVICES = ("0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f", "0x0076")
_NVIDIA_DEVICE_FILES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg")


def _read_text(path: str) -> str:
  try:
    with open(path) as f:
      return f.read().strip()
  except OSError:
    return ""


def _tpu_chips() -> int:
  return sum(_read_text(vendor) == _GOOGLE_PCI_VENDOR
             and _read_text(os.path.join(os.path.dirname(vendor), "device")) in _TPU_PCI_DEVICES
             for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"))


def _nvidia_gpus() -> int:
  if not any(os.path.exists(f) for f in _NVIDIA_DEVICE_FILES):
    return 0
  visible = os.environ.get("CUDA_VISIBLE_DEVICES")
  if visible is not None:
    return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
  return len(glob.glob("/proc/driver/nvidia/gpus/*")) or len(glob.glob("/dev/nvidia[0-9]*"))


def detect_platform() -> tuple[str, int]:
  """("tpu", chips), ("gpu", NVIDIA GPUs visible) or ("cpu", 0) for this host, without JAX.

  `JAX_PLATFORMS` (its first entry) decides when set: `cpu` never looks for accelerators.
  """
  wanted = os.environ.get("JAX_PLATFORMS", "").split(",")[0].strip().lower()
  if wanted == "cpu":
    return "cpu", 0
  if wanted in ("", "tpu"):
    chips = _tpu_chips()
    if chips:
      return "tpu", chips
  if wanted in ("", "cuda", "gpu"):
    gpus = _nvidia_gpus()
    if gpus:
      return "gpu", gpus
  return "cpu", 0


# (processes x chips per process) -> (TPU_PROCESS_BOUNDS, TPU_CHIPS_PER_PROCESS_BOUNDS): the
# layouts JAX's own launcher (jax._src.test_multiprocess) sets up on one host.
_TPU_BOUNDS = {
    (1, 1): ("1,1,1", "1,1,1"),
    (4, 1): ("2,2,1", "1,1,1"), (2, 2): ("2,1,1", "1,2,1"), (1, 4): ("1,1,1", "2,2,1"),
    (8, 1): ("4,2,1", "1,1,1"), (2, 4): ("1,2,1", "2,2,1"), (1, 8): ("1,1,1", "2,4,1"),
}


def plan_devices(nproc: int, devices_per_proc: Optional[int], platform: str = "auto",
                 available: Optional[int] = None) -> tuple[str, Optional[int]]:
  """(platform, devices per process) for a launch; `available` is the host's count (detected
  when None and `platform` is auto).

  Raises:
    LaunchError: more devices asked for than the host has, or a TPU layout JAX does not set up.
  """
  if platform == "auto":
    platform, found = detect_platform()
    available = found if available is None else available
  if platform == "cpu":
    return "cpu", devices_per_proc
  name = "GPU" if platform == "gpu" else "TPU chip"
  if devices_per_proc is None:
    if not available:
      raise LaunchError(f"--platform {platform} needs --devices-per-proc (the number of {name}s "
                        f"could not be found on this host)")
    devices_per_proc = available // nproc
    if devices_per_proc < 1:
      raise LaunchError(f"this host has {available} {name}(s) for {nproc} processes: use "
                        f"--nproc {available} or fewer")
  if available and nproc * devices_per_proc > available:
    raise LaunchError(f"{nproc} processes x {devices_per_proc} {name}(s) need "
                      f"{nproc * devices_per_proc}, but this host has {available}: lower --nproc "
                      f"or --devices-per-proc")
  if platform == "tpu" and (nproc, devices_per_proc) not in _TPU_BOUNDS:
    layouts = ", ".join(f"{p}x{c}" for p, c in _TPU_BOUNDS)
    raise LaunchError(f"{nproc} processes x {devices_per_proc} TPU chip(s) is not a layout JAX "
                      f"sets up on one host (processes x chips: {layouts})")
  return platform, devices_per_proc


def device_env(rank: int, nproc: int, platform: str, devices_per_proc: Optional[int],
               base: dict, tpu_ports: Sequence[int] = ()) -> dict:
  """The variables that give process `rank` its own devices (see the module docstring)."""
  if devices_per_proc is None:
    return {}
  ids = list(range(rank * devices_per_proc, (rank + 1) * devices_per_proc))
  if platform == "cpu":
    return {"XLA_FLAGS": with_device_count(base.get("XLA_FLAGS", ""), devices_per_proc)}
  if platform == "gpu":
    return {LOCAL_DEVICE_IDS: ",".join(map(str, ids))}
  hosts, chips = _TPU_BOUNDS[(nproc, devices_per_proc)]
  return {"TPU_VISIBLE_CHIPS": ",".join(map(str, ids)), "TPU_CHIPS_PER_PROCESS_BOUNDS": chips,
          "TPU_PROCESS_BOUNDS": hosts, "CLOUD_TPU_TASK_ID": str(rank),
          "TPU_PROCESS_ADDRESSES": ",".join(f"localhost:{p}" for p in tpu_ports),
          "TPU_PROCESS_PORT": str(tpu_ports[rank]), "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


def child_env(rank: int, nproc: int, port: int, devices: Optional[int], platform: str = "cpu",
              tpu_ports: Sequence[int] = ()) -> dict:
  env = dict(os.environ)
  env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(nproc),
             JAX_PROCESS_ID=str(rank), PYTHONUNBUFFERED="1")
  env.update(device_env(rank, nproc, platform, devices, env, tpu_ports))
  return env


# ----------------------------------------------------------------------------- processes

_LIBC: Optional[ctypes.CDLL]
try:  # loaded here, not in the forked child, where taking the loader's lock could deadlock
  _LIBC = ctypes.CDLL("libc.so.6", use_errno=True)
except OSError:
  _LIBC = None


def _die_with_parent() -> None:
  """In the child before exec: get SIGKILL when the launcher dies (Linux; elsewhere a no-op)."""
  if _LIBC is not None:
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


# The watchdog: reads process-group ids, one a line; "done" ends it quietly; end of input (the
# launcher died, however) kills every group it was given. Runs with -S: only builtins.
_WATCHDOG = """
import os, signal, sys
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
  signal.signal(s, signal.SIG_IGN)
groups = []
for line in sys.stdin:
  if line.strip() == "done":
    sys.exit(0)
  groups.append(int(line))
for g in groups:
  try:
    os.killpg(g, signal.SIGKILL)
  except OSError:
    pass
"""


class _Watchdog:
  """Kills the launched process groups if the launcher dies without saying it is done."""

  def __init__(self) -> None:
    try:  # its own session: a terminal's Ctrl-C or hang-up does not reach it
      self.proc: Optional[subprocess.Popen] = subprocess.Popen(
          [sys.executable, "-S", "-c", _WATCHDOG], stdin=subprocess.PIPE,
          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    except OSError:
      self.proc = None

  def _send(self, line: str) -> None:
    if self.proc is not None and self.proc.stdin is not None:
      try:
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()
      except (OSError, ValueError):  # the watchdog is gone: nothing more it can do
        self.proc = None

  def guard(self, pgid: int) -> None:
    self._send(str(pgid))

  def done(self) -> None:
    self._send("done")
    if self.proc is not None and self.proc.stdin is not None:
      try:
        self.proc.stdin.close()
        self.proc.wait(timeout=5)
      except (OSError, subprocess.TimeoutExpired):
        self.proc.kill()


def _signal_groups(procs: Sequence[subprocess.Popen], signum: int) -> None:
  """`signum` to every process of every launched group (each was started as a session leader,
  so its group id is its pid; the group outlives the leader while members remain)."""
  for p in procs:
    try:
      os.killpg(p.pid, signum)
    except (ProcessLookupError, PermissionError):
      pass


def _group_alive(pgid: int) -> bool:
  try:
    os.killpg(pgid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


# ----------------------------------------------------------------------------- output

_LOCK = threading.Lock()
_SEGMENT = re.compile(rb"([^\r\n]*)(\r\n|\r|\n)")
_DISCARDED: set[int] = set()  # id() of sinks whose reader went away


def _write(sink: IO[str], text: str) -> None:
  """Writes and flushes `text` (caller holds _LOCK); a sink that fails is discarded from then on."""
  if id(sink) in _DISCARDED:
    return
  try:
    sink.write(text)
    sink.flush()
    return
  except (OSError, ValueError):  # EPIPE once a `| head` exits, or a closed file
    pass
  _DISCARDED.add(id(sink))
  try:  # later writes, and the interpreter's final flush, go nowhere instead of failing again
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sink.fileno())
    os.close(devnull)
  except (OSError, ValueError, AttributeError):
    pass
  name = "stdout" if sink is sys.stdout else "stderr" if sink is sys.stderr else "an output"
  other = sys.stderr if sink is sys.stdout else sys.stdout
  if id(other) not in _DISCARDED:
    try:
      other.write(f"launch: {name} was closed (its reader exited); the processes' {name} is "
                  f"discarded from now on and the job continues\n")
      other.flush()
    except (OSError, ValueError):
      pass


def _say(text: str) -> None:
  """A line of the launcher's own on stderr."""
  with _LOCK:
    _write(sys.stderr, text + "\n")


def _pump(rank: int, source: IO[bytes], sink: IO[str]) -> None:
  """Copies `source` to `sink`, each line prefixed with the rank ("\\r" updates stay in place).

  Reads to the end whatever happens to `sink`, so a process never blocks on a full pipe.
  """
  prefix = f"[{rank}] "
  pending = b""
  while True:
    try:
      chunk = os.read(source.fileno(), 65536)
    except OSError:
      break
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
        _write(sink, "".join(out))
  if pending:
    with _LOCK:
      _write(sink, prefix + pending.decode(errors="replace") + "\n")


def exit_code(returncode: int) -> int:
  return 128 - returncode if returncode < 0 else returncode


def launch(command: Sequence[str], nproc: int, *, devices_per_proc: Optional[int] = None,
           port: Optional[int] = None, grace: float = 30.0, platform: str = "auto",
           stop_requested: Callable[[], Optional[int]] = lambda: None) -> int:
  """Runs ``nproc`` copies of ``command`` as one JAX job and supervises them.

  Args:
    command: the command and its arguments (a leading ``.py`` file or ``-m`` runs with this
      Python).
    nproc: processes to start.
    devices_per_proc: devices per process: simulated CPU devices (``XLA_FLAGS``), or each
      process's own GPUs or TPU chips on such a host; None leaves CPU runs as they are and divides
      a host's GPUs or TPU chips evenly.
    port: coordinator port (default: a free one).
    grace: after a process fails, how many seconds the others may take to stop.
    platform: ``auto`` (detect TPU chips, then NVIDIA GPUs, else CPU), ``cpu``, ``gpu`` or
      ``tpu``: which devices ``devices_per_proc`` divides.
    stop_requested: a stop signal that came before this call took over the signals (the
      command line's), or None.

  Returns:
    The exit code: the first non-zero one of the processes (128 + N for signal N), else 0; 2 when
    the launch cannot be set up or a process cannot be started; 130 when SIGINT, SIGTERM or
    SIGHUP came before any process was started (a signal while they are being started goes to
    those started, and no more are started).
  """
  try:
    platform, devices_per_proc = plan_devices(nproc, devices_per_proc, platform)
  except LaunchError as e:
    _say(f"error: {e}")
    return 2
  if platform != "cpu":
    _say(f"launch: {nproc} process(es) x {devices_per_proc} {platform.upper()} device(s) each")
  port = port or free_port()
  tpu_ports = [free_port() for _ in range(nproc)] if platform == "tpu" else []
  command = child_command(list(command))
  procs: list[subprocess.Popen] = []
  pumps: list[threading.Thread] = []
  watchdog = _Watchdog()

  received: list[int] = []  # stop signals, in order
  signalled: set[int] = set()  # pids whose group got the first one

  def forward(signum: int, frame: object) -> None:
    received.append(signum)
    _signal_groups(procs, signum)
    signalled.update(p.pid for p in procs)

  for sig in FORWARDED:
    signal.signal(sig, forward)
  early = stop_requested()
  if early is not None:
    received.append(early)

  for rank in range(nproc):
    if received:  # stopped while starting: the started ones have it, no more are started
      break
    try:
      p = subprocess.Popen(command, env=child_env(rank, nproc, port, devices_per_proc, platform,
                                                  tpu_ports),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                           start_new_session=True, preexec_fn=_die_with_parent)
    except OSError as e:
      _say(f"error: cannot start {command[0]!r}: {e.strerror}")
      _signal_groups(procs, signal.SIGKILL)
      watchdog.done()
      return 2
    procs.append(p)
    watchdog.guard(p.pid)
    if received and p.pid not in signalled:  # it came while this one was being started
      _signal_groups([p], received[0])
      signalled.add(p.pid)
  if not procs:
    name = signal.Signals(received[0]).name if received else "a signal"
    _say(f"launch: interrupted by {name} before any process was started")
    watchdog.done()
    return 130
  for rank, p in enumerate(procs):  # threads only once every process is forked
    for source, sink in ((p.stdout, sys.stdout), (p.stderr, sys.stderr)):
      t = threading.Thread(target=_pump, args=(rank, source, sink), daemon=True)
      t.start()
      pumps.append(t)

  first_failure: Optional[tuple[int, int]] = None  # (rank, exit code)
  deadline = None
  while True:
    for rank, p in enumerate(procs):
      if first_failure is None and p.poll() not in (None, 0):
        first_failure = (rank, exit_code(p.returncode))
        deadline = time.monotonic() + grace
    running = [rank for rank, p in enumerate(procs) if p.poll() is None]
    left = [rank for rank, p in enumerate(procs) if p.returncode is not None
            and _group_alive(p.pid)]  # a command's own children, e.g. ranks under a shell
    if not running and not left:
      break
    if deadline is None and not running:
      deadline = time.monotonic() + grace
    if deadline is not None and time.monotonic() > deadline:
      alive = ", ".join(map(str, sorted({*running, *left})))
      if first_failure is not None:
        _say(f"launch: process {first_failure[0]} exited with {first_failure[1]}; killing {alive} "
             f"after {grace:g}s")
      else:
        _say(f"launch: the commands exited but left processes running in group(s) of {alive}; "
             f"killing them after {grace:g}s")
      _signal_groups(procs, signal.SIGKILL)
      break
    time.sleep(0.05)
  for p in procs:
    p.wait()
  for t in pumps:
    t.join(timeout=5)
  watchdog.done()
  if first_failure is None:
    failures = [(rank, exit_code(p.returncode)) for rank, p in enumerate(procs) if p.returncode]
    first_failure = failures[0] if failures else None
  return first_failure[1] if first_failure else 0
