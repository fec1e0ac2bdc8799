"""Which matrix Muon orthogonalises for a Flax attention layer, measured on one update.

Usage:
  python -m bench.attention_layout            # Linen MultiHeadDotProductAttention, D 64, 4 heads
  python -m bench.attention_layout --d-model 128 --heads 8 --seeds 5

Flax keeps the query/key/value kernels as ``[D, H, hd]`` and the output kernel as ``[H, hd, D]``.
One Muon update is computed from the same full-rank random gradients three ways:

* ``last two axes``: each kernel as D (or H) separate small matrices, what the default was before
  Flax attention layouts were recognised (reproduced here with
  ``weight_dimension_numbers=MuonDimensionNumbers(-2, -1)``);
* ``stablejax default``: ``outlier_safe_muon`` with no dimension numbers;
* ``optax.contrib.muon``: with the dimension numbers of the whole ``[D, H*hd]`` / ``[H*hd, D]``
  matrix written by hand.

Printed per kernel: the singular-value spread (max / min) of the update reshaped to the attention
matrix. An orthogonalised matrix has a spread of about 1 (the standard NS coefficients leave its
singular values in [0.68, 1.13], so at most ~1.7); a large spread means the matrix that matters
was not orthogonalised. Also printed: the largest difference between stablejax's default and
optax's update.
"""

from __future__ import annotations

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from bench import _common

import stablejax

MDN = optax.contrib.MuonDimensionNumbers
KERNELS = ("query", "key", "value", "out")


def spread(update, name: str, d_model: int) -> float:
  m = np.asarray(update[name]["kernel"], np.float64)
  m = m.reshape(-1, d_model) if name == "out" else m.reshape(d_model, -1)
  s = np.linalg.svd(m, compute_uv=False)
  return float(s.max() / s.min())


def one_update(tx, params, grads):
  return tx.update(grads, tx.init(params), params)[0]


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--d-model", type=int, default=64)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--seeds", type=int, default=3)
  p.add_argument("--quick", action="store_true", help="one seed")
  args = p.parse_args(argv)
  seeds = 1 if args.quick else args.seeds

  _common.print_machine()
  d = args.d_model
  mha = nn.MultiHeadDotProductAttention(num_heads=args.heads)
  params = mha.init(jax.random.key(0), jnp.zeros((1, 4, d)))["params"]
  print(f"Linen MultiHeadDotProductAttention: D {d}, {args.heads} heads of {d // args.heads}; "
        f"kernels {[tuple(params[k]['kernel'].shape) for k in KERNELS]}")
  labels = {k: {"kernel": "muon", "bias": "adam"} for k in KERNELS}
  common = dict(outlier_method=None, ns_backend="xla", param_labels=labels)
  variants = {
      "last two axes": stablejax.outlier_safe_muon(
          0.02, weight_dimension_numbers=MDN(-2, -1), **common),
      "stablejax default": stablejax.outlier_safe_muon(0.02, **common),
  }
  dims = {k: {"kernel": MDN((0, 1), 2) if k == "out" else MDN(0, (1, 2)), "bias": None}
          for k in KERNELS}
  reference = optax.contrib.muon(0.02, consistent_rms=0.2, eps=1e-8,
                                 muon_weight_dimension_numbers=dims)
  rows = {name: {k: [] for k in KERNELS} for name in list(variants) + ["optax.contrib.muon"]}
  max_diff, rms = 0.0, 0.0
  for seed in range(seeds):
    grads = {k: {n: jax.random.normal(jax.random.key(100 * seed + i * 2 + j), x.shape)
                 for j, (n, x) in enumerate(sorted(v.items()))}
             for i, (k, v) in enumerate(sorted(params.items()))}
    updates = {name: one_update(tx, params, grads) for name, tx in variants.items()}
    updates["optax.contrib.muon"] = one_update(reference, params, grads)
    for name, u in updates.items():
      for k in KERNELS:
        rows[name][k].append(spread(u, k, d))
    for k in KERNELS:
      diff = np.abs(np.asarray(updates["stablejax default"][k]["kernel"])
                    - np.asarray(updates["optax.contrib.muon"][k]["kernel"])).max()
      max_diff = max(max_diff, float(diff))
      rms = float(np.sqrt(np.mean(np.asarray(updates["optax.contrib.muon"][k]["kernel"]) ** 2)))

  print(f"\nsingular-value spread (max/min) of one update as the attention matrix, median of "
        f"{seeds} seed(s):")
  print(f"{'':<20}" + "".join(f"{k:>10}" for k in KERNELS))
  for name, per_kernel in rows.items():
    print(f"{name:<20}" + "".join(f"{np.median(per_kernel[k]):>10.2f}" for k in KERNELS))
  print(f"\nlargest |stablejax default - optax.contrib.muon| entry: {max_diff:.2e} "
        f"(update RMS {rms:.2e})")


if __name__ == "__main__":
  main()
