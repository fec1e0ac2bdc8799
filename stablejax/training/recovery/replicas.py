"""Replica fingerprints: do the devices that hold copies of a parameter still hold the same bits?

Under data parallelism every device keeps its own copy of the replicated parameters (and of each
FSDP shard). The all-reduced update keeps the copies equal, until a device flips a bit or a copy
is written wrongly: from then on that replica trains a different model and nothing in the
metrics says so (they come from the all-reduced values). Megatron-LM checks this with
``--check-weight-hash-across-dp-replicas-interval``; here every ``stability.replicas.check_every``
steps and before each checkpoint is saved, each device fingerprints the blocks it holds (in a
``shard_map``, so each device reads its own memory), the fingerprints are gathered to every
process, and the copies of each block are compared. Copies that differ stop the run before a
corrupt state is saved (exit code 17), naming the devices and processes that disagree.

The fingerprint of a block is two wrapping uint32 sums of its bits (the plain sum and a
position-weighted one): exact, so any changed bit shows, and independent of reduction order.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

_SUMS = 2
EXIT_REPLICAS_DIFFER = 17


class ReplicasDiffer(Exception):
  """Copies of the parameters that should be equal are not; the run stops before saving
  (exit code 17). The message names the parameters, devices and processes; ``step`` is the
  step count at the check."""

  def __init__(self, message: str, step: int):
    super().__init__(message)
    self.step = step


def _block_fingerprint(x: jax.Array) -> jax.Array:
  """uint32 ``[2]``: the wrapping sums of a block's bits, plain and weighted by position."""
  x = jnp.ravel(x)
  if x.dtype.itemsize == 4:
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  elif x.dtype.itemsize == 2:
    bits = jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
  elif x.dtype.itemsize == 1:
    bits = jax.lax.bitcast_convert_type(x, jnp.uint8).astype(jnp.uint32)
  else:  # 8-byte values: both halves
    bits = jnp.ravel(jax.lax.bitcast_convert_type(x, jnp.uint32))
  weights = jnp.arange(bits.shape[0], dtype=jnp.uint32) * jnp.uint32(2654435761) + jnp.uint32(1)
  return jnp.stack([jnp.sum(bits, dtype=jnp.uint32), jnp.sum(bits * weights, dtype=jnp.uint32)])


class ReplicaCheck:
  """Fingerprints every device's copy of ``params`` and compares the copies.

  Args:
    mesh: the run's mesh.
    shardings: the parameters' ``NamedSharding`` tree (on ``mesh``).

  ``active`` is False when no parameter has a copy on more than one device (one device, or
  everything sharded): there is nothing to compare then.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np
    >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    >>> from stablejax.training.recovery.replicas import ReplicaCheck
    >>> mesh = Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("data", "fsdp"))
    >>> params = {"w": jnp.ones((4, 4))}
    >>> check = ReplicaCheck(mesh, {"w": NamedSharding(mesh, P())})
    >>> check.active, check(params)   # one device: no copies to compare
    (False, [])
  """

  def __init__(self, mesh: jax.sharding.Mesh, shardings: Any):
    self.mesh = mesh
    leaves, self.treedef = jax.tree_util.tree_flatten_with_path(shardings)
    self.names = ["/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
                  for path, _ in leaves]
    self.specs = [s.spec for _, s in leaves]
    axes = tuple(mesh.axis_names)
    # Devices holding the same block of leaf i: those whose coordinates agree on the axes the
    # leaf is sharded over.
    self.groups: list[list[list[int]]] = []
    coords = list(np.ndindex(*mesh.devices.shape))
    for spec in self.specs:
      used = {a for entry in spec if entry is not None
              for a in (entry if isinstance(entry, tuple) else (entry,))}
      by_block: dict[tuple, list[int]] = collections.defaultdict(list)
      for flat, c in enumerate(coords):
        by_block[tuple(c[i] for i, a in enumerate(axes) if a in used)].append(flat)
      self.groups.append([g for g in by_block.values() if len(g) > 1])
    self.active = any(self.groups)
    self._program: Optional[Callable[[Any], jax.Array]] = None

  def verify(self, step: int, params: Any) -> None:
    """Raises :class:`ReplicasDiffer` when copies differ (at ``step``: the steps completed)."""
    lines = self(params)
    if lines:
      raise ReplicasDiffer(f"step {step}: the copies of the parameters differ between devices: "
                           + "; ".join(lines) + ": a device or its memory corrupted its copy "
                           "(silent data corruption); nothing was saved since the last check",
                           step)

  def _fingerprints(self) -> Callable[[Any], jax.Array]:
    if self._program is None:
      mesh, axes = self.mesh, tuple(self.mesh.axis_names)
      specs = jax.tree_util.tree_unflatten(self.treedef, self.specs)

      def local(params: Any) -> jax.Array:
        blocks = jax.tree.leaves(params)
        prints = jnp.stack([_block_fingerprint(b) for b in blocks])  # [leaves, 2]
        return prints.reshape((1,) * len(axes) + prints.shape)

      per_device = jax.shard_map(local, mesh=mesh, in_specs=(specs,), out_specs=P(*axes),
                                 check_vma=False)
      # Every process gets every device's fingerprints (an all-gather of a few numbers).
      self._program = jax.jit(per_device, out_shardings=NamedSharding(mesh, P()))
    return self._program

  def __call__(self, params: Any) -> list[str]:
    """The copies that differ, one line per parameter (empty: all agree). A collective: every
    process calls it at the same step."""
    if not self.active:
      return []
    values = np.asarray(self._fingerprints()(params))
    values = values.reshape(-1, len(self.names), _SUMS)
    devices = list(self.mesh.devices.flat)
    lines = []
    for i, groups in enumerate(self.groups):
      for group in groups:
        prints = collections.Counter(tuple(values[d, i]) for d in group)
        if len(prints) == 1:
          continue
        common, count = prints.most_common(1)[0]
        odd = ([d for d in group if tuple(values[d, i]) != common] if count > len(group) / 2
               else group)
        names = ", ".join(f"process {devices[d].process_index} (device {devices[d].platform}:"
                          f"{devices[d].id})" for d in odd)
        lines.append(f"{self.names[i]}: {'the copy of ' if len(odd) < len(group) else 'copies on '}"
                     f"{names} {'differs' if len(odd) == 1 else 'differ'} from "
                     f"{'the others' if len(odd) < len(group) else 'each other'}")
        break
    return lines


def corrupt_copy(params: Any, device_index: int, nan: bool = False) -> Any:
  """``params`` with one device's copy of the first floating-point parameter changed (its first
  entry scaled by 1.001, or ``nan``: every entry NaN): a replica that silently diverged, or a
  device that computes garbage, for fault injection. Only the process holding that device
  changes anything; nothing crosses devices."""
  leaves, treedef = jax.tree_util.tree_flatten(params)
  target = next(i for i, leaf in enumerate(leaves) if jnp.issubdtype(leaf.dtype, jnp.floating))
  leaf = leaves[target]
  device = jax.devices()[device_index]
  shards = []
  for shard in leaf.addressable_shards:
    data = shard.data
    if shard.device == device:
      flat = jnp.ravel(data)
      flat = jnp.full_like(flat, jnp.nan) if nan else flat.at[0].set(flat[0] * 1.001 + 1e-3)
      data = jax.device_put(flat.reshape(data.shape), device)
    shards.append(data)
  leaves[target] = jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, shards)
  return jax.tree_util.tree_unflatten(treedef, leaves)
