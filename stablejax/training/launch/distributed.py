"""Multi-process runs: joining the job, and agreeing on host-local decisions.

Joining (`initialize`). With `mesh.distributed=true` the trainer calls `jax.distributed.initialize`
before anything touches a JAX backend (even `jax.devices()`). Each piece comes from, in order:
the config (`mesh.coordinator_address`, `mesh.num_processes`, `mesh.process_id`,
`mesh.local_device_ids`), the environment (`JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`,
`JAX_PROCESS_ID`; JAX 0.10 reads only the first of these itself), then JAX's own cluster detection
(SLURM, Open MPI, Kubernetes, Cloud TPU), which fills whatever is still unset. A piece nobody
supplies is a `ConfigError` naming the key and the variable to set. On CPU, cross-process
collectives use gloo (`jax_cpu_collectives_implementation`).

Failure. JAX's coordination service watches every process: when one dies, the others stop within
`mesh.heartbeat_timeout` seconds (often at once, when a collective loses its peer). A process
that finishes waits at most `mesh.shutdown_timeout` for the others; one that fails alone leaves at
once (`leave`).

Agreement. Every process must take the same Python branch, or the next collective deadlocks.
Values fetched from replicated arrays (metrics, losses) are identical everywhere; anything
host-local (a signal flag, wall-clock time) is not, and goes through `agree_any` / `agree_max`:
a tiny jitted all-reduce over every device, so all processes get the same answer. Each call is
a collective: every process must make the same calls in the same order (at the same steps), and
the call waits for the device work queued before it, so make it where the host already waits
(the trainer uses log and eval steps). With one process they return the local value at once.

Example::

    initialize(cfg.mesh)                      # first, before jax.devices()
    if agree_any(stop_requested):             # True on every process if any process saw it
      save_and_exit()
    budget_left = agree_max(seconds_used) < limit
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any, Callable, Optional, overload

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from jax.experimental import multihost_utils

from stablejax.training.config import ConfigError, MeshConfig

ENV_ADDRESS, ENV_COUNT, ENV_ID = "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"


def _env_int(name: str) -> Optional[int]:
  text = os.environ.get(name)
  if text is None or text.strip() == "":
    return None
  try:
    return int(text)
  except ValueError:
    raise ConfigError(f"{name}={text!r} is not an integer: set it to a whole number") from None


def resolve(cfg: MeshConfig) -> tuple[Optional[str], Optional[int], Optional[int]]:
  """(coordinator address, process count, process id) from the config, else the environment.

  None means "not given here"; JAX's cluster detection may still fill it in.
  """
  address = cfg.coordinator_address or os.environ.get(ENV_ADDRESS, "").strip() or None
  count = cfg.num_processes if cfg.num_processes is not None else _env_int(ENV_COUNT)
  pid = cfg.process_id if cfg.process_id is not None else _env_int(ENV_ID)
  if count is not None and count < 1:
    raise ConfigError(f"the process count is {count}: set mesh.num_processes (or {ENV_COUNT}) to "
                      "1 or more")
  if count is not None and pid is not None and not 0 <= pid < count:
    raise ConfigError(f"the process id {pid} is outside [0, {count}): set mesh.process_id (or "
                      f"{ENV_ID}) to 0 .. {count - 1} on each process")
  return address, count, pid


# What to set when JAX says a piece is missing (its ValueError messages in jax/_src/distributed.py).
_MISSING = (
    ("coordinator_address", "the coordinator address is unknown",
     f"set mesh.coordinator_address or {ENV_ADDRESS} to HOST:PORT of process 0"),
    ("number of processes", "the process count is unknown",
     f"set mesh.num_processes or {ENV_COUNT}"),
    ("process id", "this process's id is unknown", f"set mesh.process_id or {ENV_ID} (0 .. N-1)"),
)


def initialize(cfg: MeshConfig) -> None:
  """Joins the multi-process job when `cfg.distributed`; a no-op otherwise or when already joined.

  Raises:
    ConfigError: a piece of the job description is missing or malformed, or the environment
      announces several processes while `mesh.distributed` is false.
    RuntimeError: a JAX backend was initialised before this call (a programming error).
  """
  if not cfg.distributed:
    count = _env_int(ENV_COUNT)
    if count is not None and count > 1:
      raise ConfigError(f"{ENV_COUNT}={count} is set but mesh.distributed=false, so each process "
                        "would train alone: add --set mesh.distributed=true")
    return
  if jax.distributed.is_initialized():
    return
  address, count, pid = resolve(cfg)
  # Cross-process collectives on CPU need an implementation: gloo, JAX 0.10's default (kept
  # explicit for versions where it was off; a user's "mpi" choice is left alone).
  # jax.config's options are attributes it adds at run time, unknown to the checker.
  if jax.config.jax_cpu_collectives_implementation is None:  # type: ignore[attr-defined]
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  try:
    jax.distributed.initialize(
        coordinator_address=address, num_processes=count, process_id=pid,
        local_device_ids=cfg.local_device_ids,
        initialization_timeout=cfg.initialization_timeout,
        heartbeat_timeout_seconds=cfg.heartbeat_timeout,
        shutdown_timeout_seconds=cfg.shutdown_timeout)
  except ValueError as e:
    text = str(e).lower()
    for needle, problem, fix in _MISSING:
      if needle in text:
        raise ConfigError(f"mesh.distributed=true but {problem} and no SLURM, Open MPI, Kubernetes "
                          f"or Cloud TPU cluster was detected: {fix}") from None
    raise ConfigError(f"mesh.distributed=true: {e}") from None


def is_main() -> bool:
  """True on the process that prints and writes the run's files (process 0)."""
  return jax.process_index() == 0


def barrier(name: str) -> None:
  """Waits until every process reaches the barrier with the same `name` (no-op on one process)."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


@functools.cache
def _reducer() -> tuple[jax.sharding.NamedSharding, Callable[[jax.Array], jax.Array]]:
  """One entry per device in, their maximum out, replicated on every device."""
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("all",))
  spec = jax.sharding.PartitionSpec("all")
  sharding = jax.sharding.NamedSharding(mesh, spec)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  reduce = jax.jit(lambda x: jnp.max(x, axis=0), out_shardings=replicated)
  return sharding, reduce


def _all_reduce_max(value: np.ndarray) -> np.ndarray:
  value = np.asarray(value)
  sharding, reduce = _reducer()
  local = np.broadcast_to(value, (jax.local_device_count(), *value.shape))
  stacked = jax.make_array_from_process_local_data(sharding, np.ascontiguousarray(local))
  return np.asarray(reduce(stacked))


@overload
def agree_max(value: bool) -> bool: ...
@overload
def agree_max(value: int) -> int: ...
@overload
def agree_max(value: float) -> float: ...
@overload
def agree_max(value: npt.ArrayLike) -> Any: ...  # a Python scalar for 0-d input, else an array


def agree_max(value: npt.ArrayLike) -> Any:
  """The maximum of `value` over all processes, returned on every process.

  Args:
    value: a host number or numpy array (the same shape on every process). Computed in int32 for
      integers and bools and float32 otherwise (JAX's default precision): pass durations, counts
      and flags, not epoch timestamps.

  Returns:
    The global maximum, as a Python scalar for scalar input, else a numpy array.

  Example:
    In a single-process run the value is its own maximum; in a job, every process gets the
    slowest process's number:

    >>> from stablejax.training.launch.distributed import agree_max
    >>> agree_max(2.5)
    2.5
    >>> agree_max(np.array([1, 7]))
    array([1, 7])
  """
  array = np.asarray(value)
  if jax.process_count() == 1:
    return array.item() if array.ndim == 0 else array
  dtype = np.int32 if array.dtype.kind in "biu" else np.float32
  out = _all_reduce_max(array.astype(dtype))
  if array.dtype == np.bool_:
    out = out.astype(bool)
  return out.item() if out.ndim == 0 else out


def agree_any(flag: bool) -> bool:
  """True on every process if `flag` is true on any process (e.g. a stop signal seen by one).

  Example:
    Every process takes the same branch, so no collective waits for a process that left:

    >>> from stablejax.training.launch.distributed import agree_any
    >>> stop_signal_seen_here = False
    >>> agree_any(stop_signal_seen_here)
    False
  """
  return bool(agree_max(bool(flag)))


def leave(code: int) -> int:
  """Exit code `code` for this process; in a multi-process job, exits at once with it.

  A process that fails alone (bad input it alone sees, a lost peer) must not sit in JAX's
  shutdown barrier for `mesh.shutdown_timeout` seconds waiting for peers that will never arrive:
  it flushes its output and exits, and the others notice within `mesh.heartbeat_timeout`.
  """
  if jax.distributed.is_initialized() and jax.process_count() > 1:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
  return code


def lost_peer_message(error: BaseException) -> str:
  """One line for a collective that failed in a multi-process job (usually a peer that died)."""
  first = (str(error).strip().splitlines() or [type(error).__name__])[0]
  return (f"process {jax.process_index()}: a cross-process operation failed ({first[:300]}); "
          "another process probably stopped, see its output; run the same command to resume from "
          "the last checkpoint")
