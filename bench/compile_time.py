"""Compile time and step time of the README chain next to optax.contrib.muon, side by side.

Usage:
  python -m bench.compile_time                 # 12-layer GPT unrolled and scanned, 4-layer nanodo
  python -m bench.compile_time --quick         # 4 layers, d_model 64, 2 rounds (a smoke run)
  python -m bench.compile_time --breakdown     # also the chain's parts, to see what costs
  python -m bench.compile_time --layouts nanodo  # one of unrolled, scanned, nanodo
  python -m bench.compile_time --kernels       # also the compiled step's XLA:CPU kernel counts
  python -m bench.compile_time --profile       # also where the compile goes (XLA's own phases)

One jitted train step (loss, grads, optimizer update, apply) of a model with each optimizer. The
models: the trainer's GPT (`stablejax.modeling.gpt.GPT`, float32 compute, `--layers` layers,
d_model `--d-model`), "unrolled" (one parameter per layer) and "scanned" (`nn.scan`, stacked
`[L, ...]` parameters); and "nanodo", a model written as google-deepmind/nanodo's
`TransformerDo` is (`NanodoLM` below: token and position `nn.Embed`, `nn.DenseGeneral`
attention kernels `[D, H, hd]` and `[H, hd, D]`, a GELU MLP, bias-free LayerNorms, the head
tied to the embedding), 4 layers, d_model 128, 4 heads, whatever `--layers` says. The
optimizers:

  optax.contrib.muon  optax's Muon given the dimension numbers stablejax routes with
                      (`stablejax.muon_dimension_numbers(params)`), consistent_rms=0.2: the same
                      Newton-Schulz work on the same matrices, AdamW for the rest
  README chain        skip_nonfinite(skip_spikes(chain(zclip(), outlier_safe_muon(...))))

Compile time is trace + lower + compile of a fresh `jax.jit` (`.lower(...).compile()`), as wall
seconds and as CPU seconds of this process (all its threads; less disturbed by other processes
on a shared machine), the median over rounds run interleaved (A, B, A, B...), so load from
other processes hits both alike. Step time is the median over rounds of the mean of `--steps`
calls of each compiled step, also interleaved, after a warm-up. Ratios are chain / optax.

`--profile` adds, once per optimizer (first round), where the compile goes: CPU seconds of
tracing the step, the equations of its jaxpr (sub-jaxprs counted in; the model's are the same
for both optimizers, so the difference is the optimizer's), and wall seconds of XLA's own
compile phases from `jax.profiler` (the whole `PjRtCpuClient::Compile`, the HLO passes before
and after layout assignment, copy insertion, LLVM code generation of the loop kernels, which
runs on several threads, and thunk emission).
"""

from __future__ import annotations

import argparse
import collections
import re
import statistics
import tempfile
import time
from pathlib import Path

import flax.linen as nn
import jax
import jax.extend.core as jax_core
import jax.numpy as jnp
import optax

import stablejax
from bench import _common
from stablejax.modeling.gpt import GPT, ModelConfig

ROOT = Path(__file__).resolve().parent.parent


NANODO_LAYERS = 4
NANODO_D_MODEL = 128


class NanodoAttention(nn.Module):
  """nanodo's ``CausalAttn``: ``query/key/value`` ``nn.DenseGeneral`` kernels ``[D, H, hd]``,
  ``attn_out_proj`` ``[H, hd, D]``, no biases."""
  d_model: int
  heads: int

  @nn.compact
  def __call__(self, x):
    hd = self.d_model // self.heads
    init = nn.initializers.xavier_uniform()
    q, k, v = (nn.DenseGeneral((self.heads, hd), use_bias=False, kernel_init=init, name=n)(x)
               for n in ("query", "key", "value"))
    logits = jnp.einsum("bqhd,bkhd->bhqk", q / hd**0.5, k)
    mask = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
    probs = jax.nn.softmax(jnp.where(mask, logits, -1e9), axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
    return nn.DenseGeneral(self.d_model, axis=(-2, -1), use_bias=False, kernel_init=init,
                           name="attn_out_proj")(out)


class NanodoBlock(nn.Module):
  d_model: int
  heads: int

  @nn.compact
  def __call__(self, x):
    x = x + NanodoAttention(self.d_model, self.heads)(nn.LayerNorm(use_bias=False)(x))
    init = nn.initializers.xavier_uniform()
    h = nn.Dense(4 * self.d_model, use_bias=False, kernel_init=init)(
        nn.LayerNorm(use_bias=False)(x))
    return x + nn.Dense(self.d_model, use_bias=False, kernel_init=init)(nn.gelu(h))


class NanodoLM(nn.Module):
  """nanodo's ``TransformerDo`` layout: token and position embeddings, blocks, a bias-free final
  LayerNorm and the output head tied to the token embedding."""
  vocab: int = 256
  d_model: int = NANODO_D_MODEL
  heads: int = 4
  layers: int = NANODO_LAYERS
  max_len: int = 64

  @nn.compact
  def __call__(self, tokens):
    init = nn.initializers.normal(0.02)
    embed = nn.Embed(self.vocab, self.d_model, embedding_init=init)
    x = embed(tokens) + nn.Embed(self.max_len, self.d_model, embedding_init=init)(
        jnp.arange(tokens.shape[1])[None])
    for _ in range(self.layers):
      x = NanodoBlock(self.d_model, self.heads)(x)
    return embed.attend(nn.LayerNorm(use_bias=False)(x))


def build_model(layout: str, layers: int, d_model: int, seq_len: int):
  """The model of one layout (see the module docstring) and a one-line description of it."""
  if layout == "nanodo":
    model = NanodoLM(max_len=seq_len)
    return model, (f"nanodo-style LM: {model.layers} layers, d_model {model.d_model}, "
                   f"{model.heads} heads, tied head")
  if layout not in ("unrolled", "scanned"):
    raise SystemExit(f"error: unknown layout {layout!r}; use unrolled, scanned or nanodo")
  scanned = layout == "scanned"
  # scan_unroll=1: the scanned layout's rolled loop (one layer's code), as on GPU and TPU; a CPU
  # run of the trainer unrolls it by default (model.scan_unroll).
  cfg = ModelConfig(vocab_size=256, d_model=d_model, n_layers=layers, n_heads=4,
                    max_seq_len=seq_len, compute_dtype="float32", scan_layers=scanned,
                    scan_unroll=1 if scanned else None)
  return GPT(cfg), f"GPT {layout}: {layers} layers, d_model {d_model}, 4 heads"


def readme_chain(**muon_kw) -> optax.GradientTransformationExtraArgs:
  return stablejax.skip_nonfinite(stablejax.skip_spikes(optax.chain(
      stablejax.zclip(),
      stablejax.outlier_safe_muon(learning_rate=2e-3, adam_learning_rate=1.5e-3, **muon_kw))))


def variants(params, breakdown: bool) -> dict:
  dims = stablejax.muon_dimension_numbers(params)
  out = {
      "optax.contrib.muon": (optax.contrib.muon(2e-3, consistent_rms=0.2, eps=1e-8,
                                                muon_weight_dimension_numbers=dims), False),
      "README chain": (readme_chain(), True),
  }
  if breakdown:
    out["outlier_safe_muon alone"] = (
        stablejax.outlier_safe_muon(2e-3, adam_learning_rate=1.5e-3), False)
    out["... without outlier clamp"] = (
        stablejax.outlier_safe_muon(2e-3, adam_learning_rate=1.5e-3, outlier_method=None), False)
    out["... with ns_backend='xla'"] = (
        stablejax.outlier_safe_muon(2e-3, adam_learning_rate=1.5e-3, ns_backend="xla"), False)
    out["README chain without the skip wrappers"] = (optax.chain(
        stablejax.zclip(), stablejax.outlier_safe_muon(2e-3, adam_learning_rate=1.5e-3)), False)
  return out


def make_step(model, tx, takes_loss: bool):
  def step(params, opt_state, tokens):
    def loss_fn(p):
      logits = model.apply({"params": p}, tokens[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    loss, grads = jax.value_and_grad(loss_fn)(params)
    extra = {"loss": loss} if takes_loss else {}
    updates, opt_state = tx.update(grads, opt_state, params, **extra)
    return optax.apply_updates(params, updates), opt_state, loss
  return step


def compile_seconds(model, tx, takes_loss, args) -> tuple[float, float, object]:
  """Wall and CPU seconds (this process, all threads) of trace + lower + compile."""
  wall, cpu = time.perf_counter(), time.process_time()
  compiled = jax.jit(make_step(model, tx, takes_loss), donate_argnums=(0, 1)).lower(*args).compile()
  return time.perf_counter() - wall, time.process_time() - cpu, compiled


def _renamer():
  names: dict = {}
  return lambda v: names.setdefault(v.group(0), f"%{len(names)}")


def kernel_counts(compiled) -> tuple[int, int]:
  """(fusions, distinct loop kernels) of a compiled XLA:CPU executable.

  XLA:CPU compiles each loop fusion into a kernel of its own with LLVM, once per distinct fused
  computation (an unrolled model's identical layers share theirs); reductions and products go to
  its YNNPACK fusions instead, which cost next to nothing to compile. The number of distinct
  loop kernels is what most of a step's compile time follows.
  """
  text = compiled.as_text()
  bodies = {}
  for m in re.finditer(r"\n%?([\w.\-]+) \(([^\n]*)\) -> ([^\n]*) \{\n(.*?)\n\}", text, re.S):
    body = re.sub(r", metadata=\{[^}]*\}", "", m.group(4))
    body = re.sub(r"%[\w.\-]+", _renamer(), body)  # the same computation under other names
    bodies[m.group(1)] = re.sub(r"[\w.]+: ", "", m.group(3) + m.group(2)) + body
  fusions, kernels = 0, set()
  for m in re.finditer(r"= \S+ fusion\(.*?\), kind=\w+, calls=%?([\w.\-]+)([^\n]*)", text):
    fusions += 1
    if "ynn" not in m.group(2):
      kernels.add(bodies.get(m.group(1), m.group(1)))
  return fusions, len(kernels)


# XLA:CPU's compile phases as jax.profiler names them (some with the module's name after them,
# "HLO passes ... (jit_step)"; where both names occur, one event holds the other: the larger).
XLA_PHASES = ("PjRtCpuClient::Compile", "HLO passes through layout assignment",
              "HLO passes after layout assignment", "copy-insertion", "Codegen",
              "ThunkEmitter::EmitEntryComputation")


def count_equations(jaxpr) -> int:
  """Equations of a jaxpr, those of its sub-jaxprs (jit, cond branches, custom rules) counted
  in place of the call that holds them."""
  total = 0
  for eqn in jaxpr.eqns:
    subs = list(jax_core.jaxprs_in_params(eqn.params))
    total += sum(count_equations(sub) for sub in subs) if subs else 1
  return total


def compile_profile(model, tx, takes_loss, args) -> dict[str, float]:
  """Trace CPU seconds, jaxpr equations and XLA's compile phases (wall seconds) of one step."""
  jitted = jax.jit(make_step(model, tx, takes_loss), donate_argnums=(0, 1))
  cpu = time.process_time()
  traced = jitted.trace(*args)
  out = {"trace CPU s": time.process_time() - cpu,
         "equations": float(count_equations(traced.jaxpr.jaxpr))}
  lowered = traced.lower()
  with tempfile.TemporaryDirectory() as folder:
    with jax.profiler.trace(folder):
      lowered.compile()
    dumps = sorted(Path(folder).rglob("*.xplane.pb"))
    if not dumps:
      raise SystemExit("error: jax.profiler wrote no trace; --profile needs the profiler")
    seconds: collections.Counter = collections.Counter()
    for plane in jax.profiler.ProfileData.from_file(str(dumps[-1])).planes:
      for line in plane.lines:
        for event in line.events:
          seconds[event.name] += event.duration_ns / 1e9
  return {**out, **phase_seconds(seconds)}


def phase_seconds(seconds: dict[str, float]) -> dict[str, float]:
  """Seconds of each of ``XLA_PHASES`` from the profiler's seconds per event name."""
  return {phase: max((v for k, v in seconds.items()
                      if re.fullmatch(re.escape(phase) + r"( \(jit_\w+\))?", k)), default=0.0)
          for phase in XLA_PHASES}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--layers", type=int, default=12)
  p.add_argument("--d-model", type=int, default=128)
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--seq-len", type=int, default=64)
  p.add_argument("--layouts", default="unrolled,scanned,nanodo")
  p.add_argument("--breakdown", action="store_true")
  p.add_argument("--kernels", action="store_true",
                 help="also the compiled step's fusions and distinct LLVM loop kernels")
  p.add_argument("--profile", action="store_true",
                 help="also trace time, jaxpr equations and XLA's compile phases")
  p.add_argument("--quick", action="store_true")
  a = p.parse_args(argv)
  if a.quick:
    a.layers, a.d_model, a.rounds, a.steps = 4, 64, 2, 3
  _common.print_machine()
  print(f"vocab 256, batch {a.batch} x {a.seq_len} tokens, float32; {a.rounds} interleaved "
        f"rounds, {a.steps} steps each")
  rows, profile_rows = [], []
  for layout in a.layouts.split(","):
    model, description = build_model(layout, a.layers, a.d_model, a.seq_len)
    print(description)
    tokens = jax.random.randint(jax.random.key(1), (a.batch, a.seq_len + 1), 0, 256)
    params = jax.jit(model.init)(jax.random.key(0), tokens[:, :-1])["params"]
    txs = variants(params, a.breakdown)
    compile_s: dict = {name: [] for name in txs}
    compile_cpu: dict = {name: [] for name in txs}
    step_s: dict = {name: [] for name in txs}
    kernels: dict = {}
    for _ in range(a.rounds):
      for name, (tx, takes_loss) in txs.items():
        state = tx.init(params)
        seconds, cpu, compiled = compile_seconds(model, tx, takes_loss, (params, state, tokens))
        compile_s[name].append(seconds)
        compile_cpu[name].append(cpu)
        if a.kernels and name not in kernels:
          kernels[name] = kernel_counts(compiled)
        if a.profile and len(compile_s[name]) == 1:
          phases = compile_profile(model, tx, takes_loss, (params, state, tokens))
          profile_rows.append((layout, name) + tuple(
              f"{v:.0f}" if k == "equations" else f"{v:.2f}" for k, v in phases.items()))
        p_, s_ = jax.tree.map(jnp.copy, (params, state))
        p_, s_, loss = compiled(p_, s_, tokens)  # warm-up
        loss.block_until_ready()
        start = time.perf_counter()
        for _ in range(a.steps):
          p_, s_, loss = compiled(p_, s_, tokens)
        loss.block_until_ready()
        step_s[name].append((time.perf_counter() - start) / a.steps)
    base = "optax.contrib.muon"
    med = statistics.median
    c0, u0, t0 = med(compile_s[base]), med(compile_cpu[base]), med(step_s[base])
    for name in txs:
      c, u, t = med(compile_s[name]), med(compile_cpu[name]), med(step_s[name])
      rows.append((layout, name, f"{c:.2f}", f"{c / c0:.2f}x", f"{u:.2f}", f"{u / u0:.2f}x",
                   f"{t * 1e3:.1f}", f"{t / t0:.3f}x") + (kernels[name] if a.kernels else ()))
  print()
  print(_common.table(rows, ("model", "optimizer", "compile s", "ratio", "compile CPU s",
                             "ratio", "step ms", "step ratio")
                      + (("fusions", "loop kernels") if a.kernels else ())))
  if profile_rows:
    print("\nwhere the compile goes (one compile each; XLA phases in wall seconds):")
    print(_common.table(profile_rows, ("model", "optimizer", "trace CPU s", "equations",
                                       "XLA compile", "passes to layout", "passes after layout",
                                       "copy insertion", "codegen", "thunk emission")))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
