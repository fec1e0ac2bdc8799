"""Device mesh and shardings: batch over (data, fsdp), parameters and optimizer state over fsdp.

The same code runs on one CPU, on `--xla_force_host_platform_device_count=N` simulated devices and
on several processes or hosts (after `stablejax.training.launch.distributed.initialize`).
`jax.devices()` lists devices process by process, so each process's devices hold a contiguous block
of the batch.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from stablejax.training.config import ConfigError, MeshConfig

BATCH_AXES = ("data", "fsdp")


def make_mesh(cfg: MeshConfig) -> Mesh:
  devices = jax.devices()
  n = len(devices)
  if n % cfg.fsdp:
    raise ConfigError(f"mesh.fsdp={cfg.fsdp} does not divide the {n} available devices: "
                      f"choose a divisor of {n}")
  data = n // cfg.fsdp if cfg.data == -1 else cfg.data
  if data * cfg.fsdp != n:
    raise ConfigError(f"mesh.data={cfg.data} x mesh.fsdp={cfg.fsdp} != {n} devices: "
                      "set mesh.data=-1 to use them all")
  return Mesh(np.asarray(devices).reshape(data, cfg.fsdp), BATCH_AXES)


def fsdp_spec(shape: tuple[int, ...], fsdp_size: int) -> P:
  """Shards the largest axis `fsdp_size` divides; small or indivisible arrays are replicated."""
  if fsdp_size == 1 or not shape:
    return P()
  order = sorted(range(len(shape)), key=lambda i: -shape[i])
  for axis in order:
    if shape[axis] % fsdp_size == 0 and shape[axis] >= fsdp_size:
      spec: list[Optional[str]] = [None] * len(shape)
      spec[axis] = "fsdp"
      return P(*spec)
  return P()


def state_shardings(mesh: Mesh, abstract_tree: Any) -> Any:
  """NamedShardings for a pytree of arrays or ShapeDtypeStructs (params, optimizer state)."""
  fsdp = mesh.shape["fsdp"]
  return jax.tree.map(lambda x: NamedSharding(mesh, fsdp_spec(tuple(x.shape), fsdp)), abstract_tree)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Leading (batch) axis split over every device."""
  return NamedSharding(mesh, P(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def check_batch(batch_size: int, grad_accum: int, mesh: Mesh) -> None:
  per_micro = batch_size // grad_accum
  if per_micro % mesh.size:
    raise ConfigError(
        f"train.batch_size/train.grad_accum={per_micro} is not divisible by the {mesh.size} "
        f"devices: use a multiple of {mesh.size}")
