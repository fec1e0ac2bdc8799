"""Mesh and shardings: fsdp shards the largest divisible axis; the batch is split over every
device; mesh sizes and batch divisibility are checked. Several devices: a subprocess with
XLA_FLAGS set before JAX starts (this process's JAX has its own device count)."""

import subprocess
import sys
import textwrap

import pytest
from jax.sharding import PartitionSpec as P

from stablejax.training.launch.mesh import fsdp_spec


@pytest.mark.parametrize("shape,fsdp,spec", [
    ((8, 6), 2, P("fsdp", None)),
    ((6, 8), 2, P(None, "fsdp")),        # the largest axis, not the first divisible one
    ((3, 4, 6), 2, P(None, None, "fsdp")),
    ((4, 3), 4, P("fsdp", None)),        # an axis exactly the fsdp size is sharded
    ((6, 8), 4, P(None, "fsdp")),
    ((12, 8), 4, P("fsdp", None)),
    ((3, 5), 2, P()),                    # indivisible: replicated
    ((2, 2), 4, P()),                    # too small: replicated
    ((), 4, P()),
    ((8, 6), 1, P()),
])
def test_fsdp_spec(shape, fsdp, spec):
  assert fsdp_spec(shape, fsdp) == spec


_SCRIPT = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=4")
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import PartitionSpec as P
    from stablejax.training.config import ConfigError, MeshConfig
    from stablejax.training.launch import mesh as mesh_lib

    assert len(jax.devices()) == 4
    for cfg, sizes in ((MeshConfig(), (4, 1)), (MeshConfig(fsdp=2), (2, 2)),
                       (MeshConfig(fsdp=4), (1, 4)), (MeshConfig(data=2, fsdp=2), (2, 2)),
                       (MeshConfig(data=1, fsdp=4), (1, 4))):
        m = mesh_lib.make_mesh(cfg)
        assert (m.shape["data"], m.shape["fsdp"]) == sizes, (cfg, dict(m.shape))
    for cfg in (MeshConfig(data=3), MeshConfig(data=2), MeshConfig(data=4, fsdp=2),
                MeshConfig(fsdp=3)):
        try:
            mesh_lib.make_mesh(cfg)
        except ConfigError:
            pass
        else:
            raise AssertionError(f"{cfg} was accepted on 4 devices")

    m = mesh_lib.make_mesh(MeshConfig(fsdp=2))
    batch = jax.device_put(np.arange(8 * 3).reshape(8, 3), mesh_lib.batch_sharding(m))
    rows = sorted(tuple(s.data[:, 0].tolist()) for s in batch.addressable_shards)
    assert rows == [(0, 3), (6, 9), (12, 15), (18, 21)], rows  # 2 rows per device, all 4 used
    shardings = mesh_lib.state_shardings(
        m, {"w": jax.ShapeDtypeStruct((6, 8), jnp.float32),
            "b": jax.ShapeDtypeStruct((3,), jnp.float32)})
    assert shardings["w"].spec == P(None, "fsdp") and shardings["b"].spec == P()
    mesh_lib.check_batch(8, 2, m)   # micro-batches of 4 rows: one per device
    for batch_size, accum in ((8, 4), (6, 1), (2, 1)):
        try:
            mesh_lib.check_batch(batch_size, accum, m)
        except ConfigError:
            pass
        else:
            raise AssertionError(f"batch {batch_size} / accum {accum} accepted on 4 devices")
    print("MESH_OK")
""")


def test_mesh_on_four_devices():
  proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "MESH_OK" in proc.stdout
