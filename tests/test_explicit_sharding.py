"""The README chain trains the Flax NNX miniGPT tutorial's model under an explicit mesh.

The tutorial runs under ``jax.set_mesh`` with ``AxisType.Explicit`` axes ``(batch, model)`` and
its kernels sharded ``P(None, 'model')``; there Newton-Schulz contracts sharded axes, which JAX
refuses under explicit sharding (``ShardingTypeError``). Four CPU devices are simulated in a
subprocess (the device count is fixed when jax is first imported). The reference is the same
model, init and data trained without a mesh on one device: the sharded run must agree with it.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

_SCRIPT = textwrap.dedent("""
    import json, os, sys, warnings
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=4")
    import jax, jax.numpy as jnp, numpy as np, optax
    from flax import nnx
    from jax.sharding import AxisType, PartitionSpec as P
    import stablejax
    sys.path.insert(0, sys.argv[1])
    from flax_models import MiniGPTLike

    assert len(jax.devices()) == 4, jax.devices()
    STEPS = 6

    def readme_chain():
        return stablejax.skip_nonfinite(stablejax.skip_spikes(optax.chain(
            stablejax.zclip(),
            stablejax.outlier_safe_muon(learning_rate=2e-3, adam_learning_rate=1.5e-3)),
        ), max_consecutive=16)

    tokens = np.random.default_rng(0).integers(0, 64, (4, 17)).astype(np.int32)

    def train(tokens, on_mesh):
        # Off the mesh the kernels' sharding annotations are metadata only (no eager sharding).
        with nnx.use_eager_sharding(on_mesh):
            model = MiniGPTLike(rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, readme_chain(), wrt=nnx.Param)
        specs_at_init = param_specs(model)

        @nnx.jit
        def step(model, optimizer, tokens):
            def loss_fn(model):
                logits = model(tokens[:, :-1])
                return optax.softmax_cross_entropy_with_integer_labels(
                    logits, tokens[:, 1:]).mean()
            loss, grads = nnx.value_and_grad(loss_fn)(model)
            optimizer.update(model, grads, loss=loss)
            return loss

        losses = [float(step(model, optimizer, tokens)) for _ in range(STEPS)]
        return model, optimizer, losses, specs_at_init

    def param_specs(model):
        return {"/".join(map(str, path)): str(jax.typeof(v[...]).sharding.spec)
                for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no Pallas/tiling warning, no routing warning
        ref_model, _, ref_losses, _ = train(jnp.asarray(tokens), False)
        mesh = jax.make_mesh((2, 2), ("batch", "model"),
                             axis_types=(AxisType.Explicit, AxisType.Explicit))
        with jax.set_mesh(mesh):
            sharded = jax.device_put(tokens, P("batch", None))
            model, optimizer, losses, specs_at_init = train(sharded, True)
            specs = param_specs(model)

    diffs = []
    for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(model, nnx.Param)),
                                 nnx.to_flat_state(nnx.state(ref_model, nnx.Param))):
        if path[-2:] == ("key", "bias"):
            continue  # its gradient is zero up to rounding (softmax ignores a shift of all
                      # scores); Adam scales that rounding noise to full-size steps
        a, b = np.asarray(a[...]), np.asarray(b[...])
        diffs.append((float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-12)),
                      "/".join(map(str, path))))
    metrics = {k: float(v) for k, v in stablejax.stability_metrics(optimizer.opt_state).items()
               if np.ndim(v) == 0}
    print(json.dumps({"losses": losses, "ref_losses": ref_losses, "specs": specs,
                      "specs_at_init": specs_at_init, "max_rel_diff": max(diffs)[0],
                      "worst": sorted(diffs)[-4:], "metrics": metrics}))
""")


def test_readme_chain_trains_minigpt_under_an_explicit_batch_model_mesh():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(TESTS)], capture_output=True,
                        text=True, timeout=600, env=env)
  assert proc.returncode == 0, proc.stderr[-4000:]
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  losses, ref_losses = out["losses"], out["ref_losses"]
  # It trains: the loss falls on a repeated batch, every step applied.
  assert losses[-1] < losses[0] - 0.05, losses
  skips = {k: v for k, v in out["metrics"].items() if k.endswith("total_skips")}
  assert len(skips) == 2 and not any(skips.values()), out["metrics"]
  # Weights keep the tutorial's sharding over 'model' through the updates.
  specs = out["specs"]
  assert specs == out["specs_at_init"], (specs, out["specs_at_init"])
  kernels = [k for k in specs if k.endswith("kernel")]
  assert len(kernels) >= 10 and all("'model'" in specs[k] for k in kernels), specs
  # The same training as on one device without a mesh (float32 sums in another order only).
  assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-4, (losses, ref_losses)
  assert out["max_rel_diff"] < 1e-3, out["worst"]


def test_fsdp_muon_update_gathers_each_sharded_matrix_once():
  # The trainer's FSDP mesh (automatic axes) on 4 simulated devices: Newton-Schulz on a matrix
  # sharded over fsdp, left to the partitioner (optax.contrib.muon), gathers inside every
  # product; gathered once before the iterations, one all-gather per sharded Muon tensor.
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-m", "bench.muon_collectives",   # bench/ is a package
                         "--layers", "1", "--d-model", "64", "--json"],
                        capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-4000:]
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  sharded, counts = out["sharded_muon_tensors"], out["counts"]
  assert sharded == out["muon_tensors"] > 0, out  # every Muon tensor of this model is sharded
  ours = counts["outlier_safe_muon"]
  assert ours["all-gather"] == sharded and ours["reduce-scatter"] == 0, counts
  assert ours["collective-permute"] == ours["all-to-all"] == 0, counts
  assert counts["optax.contrib.muon"]["all-gather"] > 5 * sharded, counts
