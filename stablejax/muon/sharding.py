"""Sharded parameters in Muon: gather each matrix once before Newton-Schulz, put it back after.

Newton-Schulz multiplies whole matrices five times over. Left to the SPMD partitioner, a matrix
sharded along one of its matrix axes (FSDP shards the largest axis; tensor parallelism the heads)
is contracted over that sharded axis in every iteration: one or more collectives per matrix
product, fifteen products per matrix. Under explicit sharding (``jax.sharding.AxisType.Explicit``
with ``jax.set_mesh``) JAX refuses such a contraction outright (``ShardingTypeError``).

So the Muon branch gathers each momentum matrix once (every device then holds the whole matrix
and runs Newton-Schulz on it locally, as replicated computation) and gives the update back the
sharding the parameter has, which is a local slice: one all-gather per parameter, no collective
inside the iterations.

* Explicit axes: ``jax.sharding.reshard`` to replicated and back to the input's own sharding.
* Auto axes under a mesh context (``jax.set_mesh`` / ``jax.sharding.use_mesh``):
  ``jax.lax.with_sharding_constraint`` to replicated; the partitioner slices the result to the
  output sharding of the step.
* No mesh context: nothing is known about the sharding inside ``jit``; the partitioner decides.
  The trainer traces its step under its mesh, so it is always in the case above.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
from jax.sharding import PartitionSpec

AxisType = jax.sharding.AxisType


def _identity(x: Any) -> Any:
  return x


def _explicit_spec(x: Any) -> Any:
  """The input's sharding spec if any of its axes is sharded over an explicit mesh axis."""
  sharding = getattr(jax.typeof(x), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if sharding is None or mesh is None or getattr(mesh, "empty", True):
    return None
  explicit = {name for name, kind in zip(mesh.axis_names, mesh.axis_types)
              if kind == AxisType.Explicit}
  used: set = set()
  for entry in sharding.spec:
    if entry is None:
      continue
    used.update(entry if isinstance(entry, tuple) else (entry,))
  return sharding.spec if used & explicit else None


def gather(x: jax.Array) -> tuple[jax.Array, Callable[[jax.Array], jax.Array]]:
  """``x`` replicated on every device, and the function that gives a result ``x``'s sharding."""
  spec = _explicit_spec(x)
  if spec is not None:
    replicated = jax.sharding.reshard(x, PartitionSpec())
    return replicated, lambda y: jax.sharding.reshard(y, spec)
  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty and any(kind == AxisType.Auto for kind in mesh.axis_types):
    return jax.lax.with_sharding_constraint(x, PartitionSpec()), _identity
  return x, _identity


def replicated(x: jax.Array) -> jax.Array:
  """Keeps ``x`` whole on every device under an auto mesh context (the partitioner would
  otherwise be free to split a stack of matrices and gather it again in every iteration)."""
  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty and all(kind == AxisType.Auto for kind in mesh.axis_types):
    return jax.lax.with_sharding_constraint(x, PartitionSpec())
  return x
