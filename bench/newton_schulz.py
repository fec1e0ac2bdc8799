"""Newton-Schulz on CPU: each method against the standard iteration and optax's, and accuracy.

Usage:
  python -m bench.newton_schulz              # timing, 7 interleaved rounds
  python -m bench.newton_schulz --quick      # 3 rounds
  python -m bench.newton_schulz --dtype bfloat16
  python -m bench.newton_schulz --accuracy   # + Gram's error and AOL's orthogonality (trains a
                                             #   small model for its gradients: a few minutes)

Timing: at GPT-2 shapes (768x768, 768x3072, 12x768x768), every variant compiled once (compile
seconds measured apart), then `--rounds` rounds in which each variant runs once in turn
(interleaved, so load from other jobs hits all of them alike); the median over rounds, and its
ratio to the standard iteration's median (`stablejax.newton_schulz(backend="xla")`, 5 standard
steps). Variants: `method="gram"` as dispatched (the standard iteration where Gram would take more
FLOPs), Gram forced (`stablejax.muon.gram.iterations` on every shape, to show why the dispatcher
does not pick it on square ones), AOL with 4 steps, AOL + Gram with 4 steps, and optax.contrib's
own Newton-Schulz (`orthogonalize_via_newton_schulz`, 5 steps Frobenius and 4 steps AOL). The
FLOPs column is the count of `stablejax.muon.gram.flops` against the standard 5 steps.

Accuracy (`--accuracy`), float32 and bfloat16, on three kinds of input per shape: Gaussian,
a spectrum decaying as 1 / k (random singular vectors), and real gradients of a 3-layer GPT
(d_model 768, SwiGLU width 3072, 12 heads; the stablejax model trained 30 AdamW steps on the
embedded corpus, then the gradient of one more batch: q/k/v/o kernels for 768x768 and the stack
12x768x768, the up projections for 768x3072):

* Gram vs standard: relative Frobenius distance `||G - S|| / ||S||` of the same coefficients
  and steps, in the same dtype, and each one's distance to the float32 standard result.
* Orthogonality: the polar error `||O - U V^T||_F / ||U V^T||_F` against the exact polar factor
  (float64 SVD; Turbo-Muon's measure), and the same restricted to the input's top directions
  (`polar_error`), for the standard 5 steps, AOL with 4 and 5, the `dion` preset with 5, and
  Turbo-Muon's setup (AOL with the last four `dion` triples), and `polar_express` with 5, in
  float32.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax.contrib._muon import orthogonalize_via_newton_schulz

import stablejax
from stablejax.muon import gram as gram_ns
from stablejax.muon.newton_schulz import STANDARD_COEFFS, resolve_iteration

SHAPES = ((768, 768), (768, 3072), (12, 768, 768))
STEPS = 5
AOL_STEPS = 4
BATCHED_DIMS = optax.contrib.MuonDimensionNumbers(reduction_axis=1, output_axis=2)


def _compile(fn, x):
  t0 = time.perf_counter()
  compiled = jax.jit(fn).lower(x).compile()
  return compiled, time.perf_counter() - t0


def _forced_gram(x, steps: int = STEPS):
  """The Gram iteration on every shape (what `method="gram"` does only where it pays)."""
  it, _ = resolve_iteration("standard", steps, "gram", dtype=x.dtype)
  if x.shape[-2] > x.shape[-1]:
    x = jnp.swapaxes(x, -1, -2)
  xn = x / (jnp.linalg.norm(x.astype(jnp.float32), axis=(-2, -1), keepdims=True) + 1e-7)
  return gram_ns.iterations(xn.astype(x.dtype), it.per_step, it.restarts)


def _optax(x, preconditioning: str = "frobenius", steps: int = STEPS):
  coeffs = jnp.asarray(STANDARD_COEFFS, x.dtype)
  dims = None if x.ndim == 2 else BATCHED_DIMS
  return orthogonalize_via_newton_schulz(x, coeffs, steps, preconditioning=preconditioning,
                                         eps=1e-8, dimension_numbers=dims)


def variants(dtype) -> dict:
  """name -> (function, FLOPs-relative-to-standard function of (n, m))."""
  ns = functools.partial(stablejax.newton_schulz, backend="xla")
  restarts = gram_ns.default_restarts(STEPS, dtype)
  aol_restarts = gram_ns.default_restarts(AOL_STEPS, dtype)

  def std_flops(n, m, steps=STEPS):
    return gram_ns.flops(n, m, steps, method="standard")

  def dispatched(n, m, steps, rs):
    return gram_ns.flops(n, m, steps, rs) if gram_ns.uses_gram(n, m, steps, rs) else std_flops(
        n, m, steps)
  return {
      "standard, 5 steps": (lambda v: ns(v, steps=STEPS), lambda n, m: 1.0),
      "gram, 5 steps": (lambda v: ns(v, steps=STEPS, method="gram"),
                        lambda n, m: dispatched(n, m, STEPS, restarts) / std_flops(n, m)),
      "gram forced, 5 steps": (_forced_gram, lambda n, m: gram_ns.flops(n, m, STEPS, restarts)
                               / std_flops(n, m)),
      "aol, 4 steps": (lambda v: ns(v, steps=AOL_STEPS, preconditioning="aol"),
                       lambda n, m: std_flops(n, m, AOL_STEPS) / std_flops(n, m)),
      "aol + gram, 4 steps": (
          lambda v: ns(v, steps=AOL_STEPS, preconditioning="aol", method="gram"),
          lambda n, m: dispatched(n, m, AOL_STEPS, aol_restarts) / std_flops(n, m)),
      "optax, 5 steps": (_optax, lambda n, m: 1.0),
      "optax aol, 4 steps": (lambda v: _optax(v, "aol", AOL_STEPS),
                             lambda n, m: std_flops(n, m, AOL_STEPS) / std_flops(n, m)),
  }


def timing(dtype, rounds: int) -> None:
  print(f"dtype {jnp.dtype(dtype).name}; median of {rounds} interleaved rounds after compile; "
        "ratios against the standard iteration's median")
  key = jax.random.key(0)
  a = jax.random.normal(key, (768, 768), jnp.float32).astype(dtype)
  b = jax.random.normal(key, (768, 3072), jnp.float32).astype(dtype)
  mm, mm_compile = _compile(lambda x: jnp.dot(x, b, preferred_element_type=jnp.float32), a)
  jax.block_until_ready(mm(a))
  t_mm = statistics.median(_timed(lambda: mm(a)) for _ in range(rounds))
  print(f"plain matmul [768,768]x[768,3072]: {t_mm * 1e3:.1f} ms, "
        f"{2 * 768 * 768 * 3072 / t_mm / 1e9:.1f} GFLOP/s")
  for shape in SHAPES:
    x = jax.random.normal(jax.random.key(1), shape, jnp.float32).astype(dtype)
    n, m = min(shape[-2:]), max(shape[-2:])
    compiled, compile_s, flop_ratio = {}, {}, {}
    for name, (fn, flops) in variants(dtype).items():
      compiled[name], compile_s[name] = _compile(fn, x)
      flop_ratio[name] = flops(n, m)
      jax.block_until_ready(compiled[name](x))  # warm-up
    times: dict[str, list[float]] = {name: [] for name in compiled}
    for _ in range(rounds):
      for name, fn in compiled.items():
        times[name].append(_timed(lambda f=fn, v=x: f(v)))
    med = {name: statistics.median(ts) for name, ts in times.items()}
    base = med["standard, 5 steps"]
    print(f"\n{'x'.join(map(str, shape))}")
    header = (f"  {'variant':<22} {'ms':>8} {'vs standard':>12} {'FLOPs vs standard':>18} "
              f"{'compile s':>10}")
    print(header)
    print("  " + "-" * (len(header) - 2))
    for name in compiled:
      print(f"  {name:<22} {med[name] * 1e3:>8.1f} {med[name] / base:>12.3f} "
            f"{flop_ratio[name]:>18.3f} {compile_s[name]:>10.2f}")


def _timed(call) -> float:
  t0 = time.perf_counter()
  jax.block_until_ready(call())
  return time.perf_counter() - t0


# ----------------------------------------------------------------------------- accuracy


def decaying(shape, seed: int = 0) -> np.ndarray:
  """Random singular vectors, singular values 1 / k (a decaying spectrum)."""
  rng = np.random.default_rng(seed)
  *batch, r, c = shape
  k = min(r, c)
  out = []
  for _ in range(math.prod(batch)):
    u = np.linalg.qr(rng.standard_normal((r, k)))[0]
    v = np.linalg.qr(rng.standard_normal((c, k)))[0]
    out.append((u / np.arange(1, k + 1)) @ v.T)
  return np.stack(out).reshape(shape)


def real_gradients(train_steps: int = 30) -> dict:
  """Gradients of a 3-layer d_model-768 GPT after `train_steps` AdamW steps on the embedded
  corpus: shape -> float32 array."""
  from stablejax.data.pipeline import build_data
  from stablejax.modeling.gpt import GPT
  from stablejax.training.config import load_config
  cfg = load_config(None, ["model.d_model=768", "model.n_layers=3", "model.n_heads=12",
                           "model.d_ff=3072", "model.vocab_size=256", "model.max_seq_len=64",
                           "model.compute_dtype=float32", "model.remat=false",
                           "train.seq_len=64"])
  model = GPT(cfg.model)
  data = build_data(cfg.data, seq_len=64, batch_size=8, seed=0)
  batches = data.train_iter()
  params = model.init(jax.random.key(0), jnp.zeros((1, 64), jnp.int32))["params"]
  tx = optax.adamw(3e-3, b1=0.9, b2=0.95)
  opt_state = tx.init(params)

  def loss_fn(p, tokens):
    logits = model.apply({"params": p}, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), tokens[:, 1:]).mean()

  @jax.jit
  def step(p, s, tokens):
    loss, g = jax.value_and_grad(loss_fn)(p, tokens)
    updates, s = tx.update(g, s, p)
    return optax.apply_updates(p, updates), s, loss

  loss = None
  for _ in range(train_steps):
    params, opt_state, loss = step(params, opt_state, jnp.asarray(next(batches)["tokens"]))
  grads = jax.jit(jax.grad(loss_fn))(params, jnp.asarray(next(batches)["tokens"]))
  print(f"real gradients: 3-layer GPT, d_model 768, after {train_steps} AdamW steps "
        f"(loss {float(loss):.3f})")
  flat = {"/".join(str(getattr(k, "key", k)) for k in p): v
          for p, v in jax.tree_util.tree_flatten_with_path(grads)[0]}
  attn = [flat[k] for k in sorted(flat) if "attn" in k and k.endswith("kernel")]
  attn = np.concatenate([np.asarray(a).reshape(-1, 768, 768) for a in attn])  # [12, 768, 768]
  up = np.asarray(next(v for k, v in flat.items() if "up_proj" in k))[0]  # layer 0: [768, 3072]
  return {(768, 768): attn[0], (768, 3072): up, (12, 768, 768): attn}


def _rel(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


TOP = 0.01  # "top" directions: singular values of at least 1% of the largest


def polar_error(x, o) -> tuple[float, float]:
  """(||O - U V^T|| / ||U V^T||, the same on the top directions), per slice pooled.

  The second is the RMS of ``u_i^T O v_i - 1`` over the singular directions of ``x`` whose
  singular value is at least TOP times the largest: Newton-Schulz keeps the singular vectors,
  so this is how close to 1 it brings the directions that carry the input (a real gradient's
  smallest singular values are 1e-4 and less of its largest, and 5 steps leave them near 0,
  which dominates the first number).
  """
  x = np.asarray(x, np.float64).reshape((-1,) + x.shape[-2:])
  o = np.asarray(o, np.float64).reshape(x.shape)
  num = den = top_sq = top_n = 0.0
  for xs, os_ in zip(x, o):
    u, s, vt = np.linalg.svd(xs, full_matrices=False)
    polar = u @ vt
    num += np.sum((os_ - polar) ** 2)
    den += np.sum(polar**2)
    keep = s >= TOP * s[0]
    gains = np.einsum("ij,ik,kj->j", u[:, keep], os_, vt[keep].T)
    top_sq += np.sum((gains - 1) ** 2)
    top_n += keep.sum()
  return math.sqrt(num / den), math.sqrt(top_sq / top_n)


def accuracy() -> None:
  inputs = {"gaussian": {s: np.random.default_rng(1).standard_normal(s) for s in SHAPES},
            "decaying": {s: decaying(s) for s in SHAPES}, "gradient": real_gradients()}
  ns = jax.jit(stablejax.newton_schulz, static_argnames=(
      "steps", "coeffs", "backend", "method", "preconditioning"))
  print("\nGram vs standard (5 standard steps, XLA): relative Frobenius distance, and each one's "
        "distance to the float32 standard result")
  header = (f"  {'shape':<11} {'input':<9} {'dtype':<9} {'||G-S||/||S||':>14} "
            f"{'S vs f32':>9} {'G vs f32':>9}")
  print(header)
  print("  " + "-" * (len(header) - 2))
  for shape in SHAPES:
    for kind, mats in inputs.items():
      x32 = jnp.asarray(mats[shape], jnp.float32)
      ref32 = ns(x32, backend="xla")
      for dtype in (jnp.float32, jnp.bfloat16):
        x = x32.astype(dtype)
        s, g = ns(x, backend="xla"), ns(x, backend="xla", method="gram")
        print(f"  {'x'.join(map(str, shape)):<11} {kind:<9} {jnp.dtype(dtype).name:<9} "
              f"{_rel(g, s):>14.2e} {_rel(s, ref32):>9.2e} {_rel(g, ref32):>9.2e}")
  print(f"\nOrthogonality (float32, XLA): polar error ||O - UV^T|| / ||UV^T||, and (after the "
        f"slash) the same over the directions with singular values >= {TOP:g} x the largest")
  cases = (("standard, 5", dict(steps=5)),
           ("aol, 4", dict(steps=4, preconditioning="aol")),
           ("aol, 5", dict(steps=5, preconditioning="aol")),
           ("dion, 5", dict(steps=5, coeffs="dion")),
           ("turbo: dion + aol, 4", dict(steps=4, coeffs="dion", preconditioning="aol")),
           ("polar_express, 5", dict(steps=5, coeffs="polar_express")))
  header = f"  {'shape':<11} {'input':<9} " + " ".join(f"{name:>21}" for name, _ in cases)
  print(header)
  print("  " + "-" * (len(header) - 2))
  for shape in SHAPES:
    for kind, mats in inputs.items():
      x = jnp.asarray(mats[shape], jnp.float32)
      cells = []
      for _, kw in cases:
        err, top = polar_error(x, ns(x, backend="xla", **kw))
        cells.append(f"{err:.3f} / {top:.3f}")
      print(f"  {'x'.join(map(str, shape)):<11} {kind:<9} " + " ".join(f"{c:>21}" for c in cells))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="3 rounds instead of 7")
  parser.add_argument("--rounds", type=int, default=None)
  parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  parser.add_argument("--accuracy", action="store_true",
                      help="also Gram's error and AOL's orthogonality (trains a small model)")
  parser.add_argument("--no-timing", action="store_true", help="only the accuracy tables")
  args = parser.parse_args()
  rounds = args.rounds or (3 if args.quick else 7)
  dev = jax.devices()[0]
  print(f"jax {jax.__version__}, optax {optax.__version__}, backend {jax.default_backend()}, "
        f"device {dev.device_kind}, {os.cpu_count()} CPU cores visible, "
        f"{platform.processor() or platform.machine()}, load average "
        f"{os.getloadavg()[0]:.1f} at the start")
  if not args.no_timing:
    timing(jnp.dtype(args.dtype), rounds)
  if args.accuracy:
    accuracy()
  print(f"\nload average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
  main()
