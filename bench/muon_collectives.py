"""Collectives in the compiled Muon update under the trainer's FSDP mesh, next to optax's Muon.

Usage:
  python -m bench.muon_collectives                # 4 simulated CPU devices, mesh (data 1, fsdp 4)
  python -m bench.muon_collectives --devices 8 --layers 4 --d-model 256

The trainer shards every parameter and optimizer-state leaf over the ``fsdp`` axis along its
largest divisible axis (`stablejax.training.launch.mesh.fsdp_spec`) and traces its step under its
mesh. This compiles the optimizer update alone (gradients, state and params sharded that way, the
same shardings out) for the trainer's GPT and counts the collective operations in the
optimized HLO (`compiled.as_text()`), per kind, for:

  outlier_safe_muon   stablejax's Muon (Newton-Schulz on each gathered matrix)
  README chain        skip_nonfinite(skip_spikes(chain(zclip(), outlier_safe_muon(...))))
  optax.contrib.muon  optax's Muon with the same dimension numbers, left to the partitioner

Newton-Schulz needs whole matrices: the count to expect is one all-gather per sharded Muon
matrix (the momentum, before the iterations) and nothing inside the iterations; the update is
sliced back to the parameter's shard locally. Scalars (norms, counters) are all-reduced.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from pathlib import Path



def _parse(argv: list[str] | None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
  p.add_argument("--devices", type=int, default=4)
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--d-model", type=int, default=128)
  p.add_argument("--scan", action="store_true", help="scan-stacked layers ([L, in, out] kernels)")
  p.add_argument("--json", action="store_true", help="also print the counts as one JSON line")
  return p.parse_args(argv)


ARGS = _parse(sys.argv[1:] if __name__ == "__main__" else [])
# The device count is fixed when jax is first imported.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           f" --xla_force_host_platform_device_count={ARGS.devices}").strip()

import jax  # noqa: E402
import optax  # noqa: E402

import stablejax  # noqa: E402
from bench import _common  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from stablejax.muon import matrices, routing  # noqa: E402
from stablejax.training.launch import mesh as mesh_lib  # noqa: E402
from stablejax.training.config import MeshConfig  # noqa: E402
from stablejax.modeling.gpt import GPT, ModelConfig  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all")
# An HLO instruction of that kind (async pairs counted once, at their -start).
_OP = re.compile(r"=\s*\S+\s+(" + "|".join(KINDS) + r")(-start)?\(")


def count_collectives(hlo_text: str) -> dict[str, int]:
  counts = dict.fromkeys(KINDS, 0)
  for match in _OP.finditer(hlo_text):
    counts[match.group(1)] += 1
  return counts


def compiled_update(tx: optax.GradientTransformation, params: dict, mesh: jax.sharding.Mesh,
                    takes_loss: bool) -> str:
  """Optimized HLO of ``tx.update`` with FSDP-sharded gradients, state and params."""
  state = tx.init(params)
  p_sharding = mesh_lib.state_shardings(mesh, params)
  s_sharding = mesh_lib.state_shardings(mesh, jax.eval_shape(lambda: state))
  scalar = mesh_lib.replicated(mesh)

  def update(grads: dict, opt_state: object, p: dict, loss: jax.Array) -> tuple:
    extra = {"loss": loss} if takes_loss else {}
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # as the trainer traces its step
      return tx.update(grads, opt_state, p, **extra)

  fn = jax.jit(update, in_shardings=(p_sharding, s_sharding, p_sharding, scalar),
               out_shardings=(p_sharding, s_sharding))
  loss = jax.ShapeDtypeStruct((), jax.numpy.float32)
  return fn.lower(params, state, params, loss).compile().as_text()


def main() -> int:
  a = ARGS
  _common.print_machine()
  mesh = mesh_lib.make_mesh(MeshConfig(fsdp=a.devices))
  cfg = ModelConfig(vocab_size=256, d_model=a.d_model, n_layers=a.layers, n_heads=4,
                    max_seq_len=64, compute_dtype="float32", scan_layers=a.scan)
  tokens = jax.numpy.zeros((1, 64), jax.numpy.int32)
  params = jax.jit(GPT(cfg).init)(jax.random.key(0), tokens)["params"]

  routed = routing.plan(params)
  muon = [(leaf.shape, dims) for leaf, label, dims in
          zip(routed.leaves, routed.labels, routed.layouts) if label == "muon"]
  sharded = [shape for shape, _ in muon if mesh_lib.fsdp_spec(shape, a.devices) != P()]
  n_matrices = sum(math.prod(matrices.matrix_shape(dims, shape)[0]) for shape, dims in muon)
  dims = stablejax.muon_dimension_numbers(params)
  print(f"mesh (data 1, fsdp {a.devices}); GPT {a.layers} layers"
        f"{' (scanned)' if a.scan else ''}, d_model {a.d_model}: {len(muon)} Muon tensors "
        f"({n_matrices} matrices), {len(sharded)} of them sharded over fsdp\n")

  txs = {
      "outlier_safe_muon": (stablejax.outlier_safe_muon(2e-3, adam_learning_rate=1.5e-3), False),
      "README chain": (stablejax.skip_nonfinite(stablejax.skip_spikes(optax.chain(
          stablejax.zclip(),
          stablejax.outlier_safe_muon(2e-3, adam_learning_rate=1.5e-3)))), True),
      "optax.contrib.muon": (optax.contrib.muon(2e-3, consistent_rms=0.2, eps=1e-8,
                                                muon_weight_dimension_numbers=dims), False),
  }
  rows, found = [], {}
  for name, (tx, takes_loss) in txs.items():
    counts = count_collectives(compiled_update(tx, params, mesh, takes_loss))
    found[name] = counts
    per = counts["all-gather"] / max(1, len(sharded))
    rows.append((name, *(counts[k] for k in KINDS), f"{per:.2f}"))
  print(_common.table(rows, ("optimizer update", *KINDS, "all-gathers per sharded Muon tensor")))
  if a.json:
    print(json.dumps({"muon_tensors": len(muon), "sharded_muon_tensors": len(sharded),
                      "counts": found}))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
