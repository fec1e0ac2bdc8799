"""Newton-Schulz timing: stablejax's XLA path vs optax's NS, and achieved GFLOP/s vs a plain matmul.

Usage:
  python -m bench.newton_schulz            # 7 timed repeats per case
  python -m bench.newton_schulz --quick    # 3 repeats
  python -m bench.newton_schulz --dtype bfloat16 --steps 5

For each shape it reports the compile time (lower + compile, measured separately) and the median
wall time of the compiled function over the repeats, for ``stablejax.newton_schulz(backend="xla")``
and for ``optax.contrib``'s ``orthogonalize_via_newton_schulz`` (stacked input through
``MuonDimensionNumbers``). GFLOP/s counts ``steps * batch * (4 n^2 m + 2 n^3)`` flops for an
``n x m`` matrix with ``n <= m`` (the three products of each iteration; symmetry not discounted),
and is compared with a plain ``[768, 768] x [768, 3072]`` matmul timed the same way on the same
machine, so the ratio says how close NS gets to the machine's matmul throughput.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import optax
from optax.contrib._muon import orthogonalize_via_newton_schulz

import stablejax

SHAPES = ((768, 768), (768, 3072), (12, 768, 768))
STANDARD = (3.4445, -4.7750, 2.0315)


def _time(fn, args, repeats):
  t0 = time.perf_counter()
  compiled = jax.jit(fn).lower(*args).compile()
  compile_s = time.perf_counter() - t0
  jax.block_until_ready(compiled(*args))  # warm-up run
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - t0)
  return compile_s, statistics.median(times)


def _ns_flops(shape, steps):
  *batch, r, c = shape
  n, m = min(r, c), max(r, c)
  b = 1
  for d in batch:
    b *= d
  return steps * b * (4 * n * n * m + 2 * n**3)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="3 repeats instead of 7")
  parser.add_argument("--repeats", type=int, default=None)
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  args = parser.parse_args()
  repeats = args.repeats or (3 if args.quick else 7)
  dtype = jnp.dtype(args.dtype)
  steps = args.steps

  dev = jax.devices()[0]
  print(f"jax {jax.__version__}, optax {optax.__version__}, backend {jax.default_backend()}, "
        f"device {dev.device_kind}, {os.cpu_count()} CPU cores visible, "
        f"{platform.processor() or platform.machine()}")
  print(f"dtype {dtype.name}, {steps} NS steps, median of {repeats} runs after compile")

  key = jax.random.key(0)
  a = jax.random.normal(key, (768, 768), jnp.float32).astype(dtype)
  b = jax.random.normal(key, (768, 3072), jnp.float32).astype(dtype)
  mm_compile, mm_time = _time(
      lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32).astype(dtype), (a, b), repeats)
  mm_gflops = 2 * 768 * 768 * 3072 / mm_time / 1e9
  print(f"plain matmul [768,768]x[768,3072]: {mm_time * 1e3:.1f} ms, {mm_gflops:.1f} GFLOP/s "
        f"(compile {mm_compile:.2f} s)")
  print()

  header = (f"{'shape':<14} {'stablejax ms':>12} {'optax ms':>9} {'optax/ours':>10} "
            f"{'compile ours s':>14} {'compile optax s':>15} {'GFLOP/s':>8} {'vs matmul':>9}")
  print(header)
  print("-" * len(header))
  coeffs = jnp.asarray(STANDARD, dtype)
  # A [batch, m, n] shape: one matrix per leading index.
  batched_dims = optax.contrib.MuonDimensionNumbers(reduction_axis=1, output_axis=2)
  for shape in SHAPES:
    x = jax.random.normal(jax.random.key(1), shape, jnp.float32).astype(dtype)

    def ours(v):
      return stablejax.newton_schulz(v, steps=steps, backend="xla", eps=1e-8)

    if len(shape) == 2:
      def theirs(v):
        return orthogonalize_via_newton_schulz(v, coeffs, steps, eps=1e-8)
    else:
      def theirs(v):
        return orthogonalize_via_newton_schulz(v, coeffs, steps, eps=1e-8,
                                               dimension_numbers=batched_dims)

    c_ours, t_ours = _time(ours, (x,), repeats)
    c_theirs, t_theirs = _time(theirs, (x,), repeats)
    gflops = _ns_flops(shape, steps) / t_ours / 1e9
    name = "x".join(str(d) for d in shape)
    print(f"{name:<14} {t_ours * 1e3:>12.1f} {t_theirs * 1e3:>9.1f} {t_theirs / t_ours:>10.2f} "
          f"{c_ours:>14.2f} {c_theirs:>15.2f} {gflops:>8.1f} {gflops / mm_gflops:>9.2f}")


if __name__ == "__main__":
  main()
