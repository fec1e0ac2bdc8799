"""Tokens/s of the trainer's compiled step against a minimal JAX GPT loop of the same size.

Usage:
  python -m bench.peer_step                  # two sizes, 11 and 7 interleaved rounds
  python -m bench.peer_step --quick          # the default size only, 3 rounds (a smoke run)
  python -m bench.peer_step --sizes default  # one of the sizes below
  python -m bench.peer_step --flat-peer      # also the peer with its Dense layers over [B*T, D]
  python -m bench.peer_step --profile 12     # also where each runner's time goes (jax.profiler)
  python -m bench.peer_step --set model.scan_unroll=1   # the trainer with a config override

The peer is a minimal GPT training loop of nanoGPT's classic shape, written in Flax Linen as a
user writes one (`PeerGPT`): token and learned position embeddings; Pre-LN blocks of a bias-free
LayerNorm, causal self-attention (one fused QKV `nn.Dense`, `jax.nn.dot_product_attention`, an
output `nn.Dense`) and a bias-free LayerNorm, GELU MLP; a final LayerNorm and the head tied to the
token embedding (`embed.attend`); optax's integer-label softmax cross-entropy;
`optax.chain(clip_by_global_norm(1.0), adamw(warmup_cosine_decay_schedule))`; one `jax.jit` with
the parameters and optimizer state donated. It has the trainer's d_model, layers, heads,
vocabulary, sequence length, batch and compute dtype, and the MLP width (a multiple of 64 near
4 x d_model) whose parameter count is nearest the trainer's.

The trainer: `bench._common.trainer_step(cfg, stack)`, the step `python -m stablejax train` runs
(its model `stablejax.modeling.gpt.GPT` with RoPE, RMSNorm, QK-norm and SwiGLU, the z-loss, the
gradient-accumulation loop, the fault hooks and the step's metrics), with

  clip_adamw  `clip_by_global_norm(1.0)` + AdamW with the trainer's schedule
  default     the packaged default config's chain: skip_nonfinite(skip_spikes(chain(zclip,
              outlier_safe_muon, lr_scale))) with the compensated update (what a user gets
              without flags); its Newton-Schulz iterations are work AdamW does not do

The sizes (both with the default config's vocabulary of 256 bytes):

  default  the packaged default config: d_model 192, 4 layers, 4 heads, batch 16 x 128
  wide     d_model 256, 6 layers, 4 heads, batch 16 x 256

The runners are called in turn (peer, clip_adamw, default, peer, ...), each call `--steps`
steps back to back with one wait at the end; after a warm-up round, the ratios are the median
(and quartiles) of the per-round ratios of seconds per step, peer / trainer: tokens/s of the
trainer over the peer's. Targets: clip_adamw >= 1.0, default >= 0.95.
"""

from __future__ import annotations

import argparse
import collections
import functools
import gzip
import json
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from bench import _common

SIZES = {
    "default": [],
    "wide": ["model.d_model=256", "model.n_layers=6", "model.n_heads=4", "model.max_seq_len=256",
             "train.seq_len=256"],
}
ROUNDS = {"default": 11, "wide": 7}
TARGETS = {"clip_adamw": 1.0, "default": 0.95}
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


# ----------------------------------------------------------------------------- the peer


class PeerBlock(nn.Module):
  """A Pre-LN nanoGPT block: LayerNorm -> causal attention, LayerNorm -> GELU MLP."""
  n_heads: int
  mlp_width: int
  n_layers: int
  dtype: Any
  flat: bool = False  # Dense over [B*T, D] rows (what the trainer's model does)

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    b, t, d = x.shape
    init = nn.initializers.normal(0.02)
    proj_init = nn.initializers.normal(0.02 / (2 * self.n_layers) ** 0.5)  # nanoGPT's c_proj
    dense = functools.partial(nn.Dense, use_bias=False, dtype=self.dtype)

    def apply(layer: nn.Module, h: jax.Array) -> jax.Array:
      if not self.flat:
        return layer(h)
      return layer(h.reshape(b * t, h.shape[-1])).reshape(b, t, -1)

    h = nn.LayerNorm(use_bias=False, dtype=self.dtype)(x)
    qkv = apply(dense(3 * d, kernel_init=init), h).reshape(b, t, 3, self.n_heads, d // self.n_heads)
    impl = _attention_implementation(self.dtype)
    a = jax.nn.dot_product_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], is_causal=True,
                                     implementation=impl)
    x = x + apply(dense(d, kernel_init=proj_init), a.reshape(b, t, d))
    h = nn.LayerNorm(use_bias=False, dtype=self.dtype)(x)
    h = nn.gelu(apply(dense(self.mlp_width, kernel_init=init), h))
    return x + apply(dense(d, kernel_init=proj_init), h)


class PeerGPT(nn.Module):
  """nanoGPT in Flax: learned positions, LayerNorm, GELU MLP, head tied to the embedding."""
  vocab_size: int
  d_model: int
  n_layers: int
  n_heads: int
  mlp_width: int
  block_size: int
  dtype: Any = jnp.float32
  remat: bool = False
  flat: bool = False

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    init = nn.initializers.normal(0.02)
    wte = nn.Embed(self.vocab_size, self.d_model, embedding_init=init, dtype=self.dtype)
    wpe = nn.Embed(self.block_size, self.d_model, embedding_init=init, dtype=self.dtype)
    x = wte(tokens) + wpe(jnp.arange(tokens.shape[1]))[None]
    block = nn.remat(PeerBlock) if self.remat else PeerBlock
    for _ in range(self.n_layers):
      x = block(self.n_heads, self.mlp_width, self.n_layers, self.dtype, self.flat)(x)
    x = nn.LayerNorm(use_bias=False, dtype=self.dtype)(x)
    return wte.attend(x).astype(jnp.float32)


def _attention_implementation(dtype: Any) -> Any:
  """cuDNN's fused attention where it applies (a CUDA GPU, half precision), as a user who knows
  it would ask for; XLA's otherwise (the default of ``jax.nn.dot_product_attention``)."""
  dev = jax.devices()[0]
  cuda = dev.platform == "gpu" and "rocm" not in str(getattr(dev.client, "platform_version", ""))
  return "cudnn" if cuda and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16),
                                                 jnp.dtype(jnp.float16)) else None


def peer_model(cfg, mlp_width: int, flat: bool = False) -> PeerGPT:
  m = cfg.model
  return PeerGPT(vocab_size=m.vocab_size, d_model=m.d_model, n_layers=m.n_layers,
                 n_heads=m.n_heads, mlp_width=mlp_width, block_size=m.max_seq_len,
                 dtype=_DTYPES[m.compute_dtype], remat=m.remat, flat=flat)


def peer_param_count(cfg, mlp_width: int) -> int:
  m = cfg.model
  per_layer = 4 * m.d_model * m.d_model + 2 * m.d_model * mlp_width + 2 * m.d_model
  return (m.vocab_size + m.max_seq_len) * m.d_model + m.n_layers * per_layer + m.d_model


def peer_flops_per_token(cfg, mlp_width: int) -> float:
  """Training FLOPs per token of the peer, as `stablejax.modeling.gpt.model_flops_per_token`
  counts the trainer's: 6 N (the matmul parameters: blocks and the tied head) + 12 L D T."""
  m = cfg.model
  n = m.n_layers * (4 * m.d_model * m.d_model + 2 * m.d_model * mlp_width)
  n += m.d_model * m.vocab_size
  return float(6 * n + 12 * m.n_layers * m.d_model * cfg.train.seq_len)


def peer_mlp_width(cfg, trainer_params: int) -> int:
  """The MLP width, a multiple of 64 between 2 and 6 x d_model, whose parameter count is nearest
  the trainer's (4 x d_model, nanoGPT's, where the counts tie)."""
  d = cfg.model.d_model
  widths = range(64 * max(1, (2 * d) // 64), 6 * d + 1, 64)
  return min(widths, key=lambda w: (abs(peer_param_count(cfg, w) - trainer_params),
                                    abs(w - 4 * d)))


class PeerStep:
  """The peer's jitted, donated train step, compiled, with its own state; ``run`` as
  `bench._common.CompiledStep.run`."""

  def __init__(self, cfg, tokens: jax.Array, mlp_width: int, flat: bool = False, seed: int = 0):
    o, t = cfg.optimizer, cfg.train
    self.model = peer_model(cfg, mlp_width, flat)
    self.tokens = tokens
    params = jax.jit(self.model.init)(jax.random.PRNGKey(seed), tokens[:, :-1])["params"]
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, 3e-4, t.warmup_steps, t.steps, 3e-4 * t.min_lr_ratio)
    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=0.1))
    model = self.model

    def step(params: Any, opt_state: Any, tokens: jax.Array) -> tuple[Any, Any, jax.Array]:
      def loss_fn(p: Any) -> jax.Array:
        logits = model.apply({"params": p}, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
      loss, grads = jax.value_and_grad(loss_fn)(params)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss

    self.state = (params, tx.init(params))
    t0 = time.perf_counter()
    self.compiled = jax.jit(step, donate_argnums=(0, 1)).lower(*self.state, tokens).compile()
    self.compile_seconds = time.perf_counter() - t0
    self.loss = jnp.float32(jnp.nan)

  @property
  def params(self) -> Any:
    return self.state[0]

  def planned_bytes(self) -> int | None:
    return _common.planned_bytes(self.compiled)

  def run(self, n: int) -> float:
    t0 = time.perf_counter()
    params, opt_state = self.state
    loss = self.loss
    for _ in range(n):
      params, opt_state, loss = self.compiled(params, opt_state, self.tokens)
    jax.block_until_ready((params, opt_state, loss))
    self.state, self.loss = (params, opt_state), loss
    return (time.perf_counter() - t0) / n


def peer_for(cfg, trainer_params: int, batch: dict, flat: bool = False) -> PeerStep:
  """The peer sized to a trainer of ``trainer_params`` parameters, on the first micro-batch of
  ``batch`` (the trainer's layout ``[grad_accum, B, T + 1]``) joined into one batch."""
  tokens = batch["tokens"].reshape(-1, batch["tokens"].shape[-1])
  return PeerStep(cfg, tokens, peer_mlp_width(cfg, trainer_params), flat)


# ----------------------------------------------------------------------------- the profile


def _op_names(compiled: Any) -> dict[str, str]:
  """XLA instruction name -> the JAX op name it came from (the compiled HLO's metadata)."""
  names = {}
  for line in compiled.as_text().splitlines():
    m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = .*?op_name=\"([^\"]*)\"", line)
    if m:
      names.setdefault(m.group(1), m.group(2))
  return names


def _where(op_name: str, depth: int) -> str:
  """``jit(train_step)/.../transpose(jvp(GPT))/block_2/mlp/jit(silu)/mul`` -> ``backward
  block/mlp``: forward or backward pass, the layer index dropped, ``depth`` parts of the path."""
  name = re.sub(r"^jit\([^)]*\)/", "", op_name)
  name = re.sub(r"(while/body/)?closed_call/", "", name)
  name = re.sub(r"([A-Za-z]*[Bb]lock|layers?)_\d+", r"\1", name)
  if name.startswith("transpose(jvp("):
    return f"backward {'/'.join(name.split('/')[1:depth + 1])}"
  if name.startswith("jvp("):
    return f"forward {'/'.join(name.split('/')[1:depth + 1])}"
  # The optimizer's transforms and the step's metrics carry no module path: their products
  # (Newton-Schulz) apart from the rest.
  return "optimizer and metrics: " + ("products" if "dot_general" in name else "other")


def profile(runner: Any, steps: int, out_dir: Path, depth: int = 3) -> list[tuple[str, float]]:
  """Milliseconds per step of ``runner``'s XLA operations (`jax.profiler` trace of ``steps``
  steps in ``out_dir``), summed by where they come from (:func:`_where`), largest first."""
  runner.run(1)
  with jax.profiler.trace(str(out_dir)):
    runner.run(steps)
  trace = sorted(out_dir.rglob("*.trace.json.gz"), key=lambda p: p.stat().st_mtime)[-1]
  events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
  names = _op_names(runner.compiled)
  totals: dict[str, float] = collections.Counter()
  for e in events:
    if e.get("ph") == "X" and e.get("name") in names:
      totals[_where(names[e["name"]], depth)] += e["dur"] / 1e3 / steps
  return sorted(totals.items(), key=lambda kv: -kv[1])


# ----------------------------------------------------------------------------- the comparison


def describe(cfg, n_params: int, peer: PeerStep) -> list[str]:
  m, t = cfg.model, cfg.train
  peer_n = _count(peer.params)
  return [
      f"trainer: {n_params / 1e6:.2f}M parameters (d_model {m.d_model}, {m.n_layers} layers, "
      f"{m.n_heads} heads, SwiGLU {m.ff_dim}, RoPE, RMSNorm, QK-norm {m.qk_norm}, "
      f"{'tied' if m.tie_embeddings else 'untied'} head, z-loss {cfg.stability.z_loss:g}, "
      f"{m.compute_dtype}, scan_layers {m.scan_layers})",
      f"peer: {peer_n / 1e6:.2f}M parameters ({peer_n / n_params:.3f}x; GELU MLP "
      f"{peer.model.mlp_width}, learned positions, LayerNorm, tied head"
      f"{', Dense over [B*T, D]' if peer.model.flat else ''})",
      f"batch {t.batch_size} x {t.seq_len} tokens, vocabulary {m.vocab_size}",
  ]


def _count(params: Any) -> int:
  return int(sum(np.prod(np.shape(p)) for p in jax.tree.leaves(params)))


def compare(size: str, rounds: int, steps: int, flat_peer: bool, top: int = 0,
            overrides: Sequence[str] = ()) -> list[dict]:
  """Builds the runners of one size, times them interleaved, prints the table; returns rows."""
  cfg = _common.trainer_config("default", [*SIZES[size], *overrides])
  batch = _common.random_batch(cfg)
  trainer = {"clip_adamw": _common.trainer_step(cfg, "clip_adamw", batch),
             "default": _common.trainer_step(cfg, "full", batch)}
  n_params = _count(trainer["default"].state.params)
  runners: dict[str, Any] = {"peer": peer_for(cfg, n_params, batch)}
  if flat_peer:
    runners["peer, flat Dense"] = peer_for(cfg, n_params, batch, flat=True)
  runners.update(trainer)
  print(f"\n{size}:")
  for line in describe(cfg, n_params, runners["peer"]):
    print("  " + line)
  print("  compile s: " + ", ".join(f"{k} {r.compile_seconds:.1f}" for k, r in runners.items()))
  times = _common.interleaved({k: (lambda r=r: r.run(steps)) for k, r in runners.items()},
                              rounds, warmup=1)
  tokens = cfg.train.batch_size * cfg.train.seq_len
  rows = []
  for name, ts in times.items():
    ratio, q1, q3 = _common.paired_ratio(times["peer"], ts)
    loss = runners[name].loss if name.startswith("peer") else \
        runners[name].last_metrics["loss"]
    rows.append({"size": size, "runner": name, "ms_per_step": _common.median(ts) * 1e3,
                 "tokens_per_s": tokens / _common.median(ts), "vs_peer": ratio,
                 "vs_peer_iqr": (q1, q3), "loss": float(jax.device_get(loss))})
  print(_common.table(
      [(r["runner"], f"{r['ms_per_step']:.1f}", f"{r['tokens_per_s']:,.0f}",
        f"{r['vs_peer']:.3f}x", f"{r['vs_peer_iqr'][0]:.3f}-{r['vs_peer_iqr'][1]:.3f}",
        f"{r['loss']:.3f}") for r in rows],
      ("runner", "ms/step", "tokens/s", "tokens/s vs peer", "IQR", "last loss")))
  if top:
    for name, runner in runners.items():
      with tempfile.TemporaryDirectory() as tmp:
        where = profile(runner, steps, Path(tmp))
      total = sum(ms for _, ms in where)
      print(f"\n  profile of {name}: {total:.0f} ms of XLA operations per step (jax.profiler), "
            f"the {top} largest by origin")
      print(_common.table([(origin, f"{ms:.1f}", f"{100 * ms / total:.1f}%")
                           for origin, ms in where[:top]], ("origin", "ms/step", "share")))
  return rows


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--sizes", default=",".join(SIZES), help="comma-separated: default, wide")
  p.add_argument("--rounds", type=int, default=None, help="interleaved rounds per size")
  p.add_argument("--steps", type=int, default=3, help="steps per runner per round")
  p.add_argument("--quick", action="store_true", help="the default size, 3 rounds of 2 steps")
  p.add_argument("--flat-peer", action="store_true",
                 help="also the peer with its Dense layers applied to [B*T, D] rows")
  p.add_argument("--profile", type=int, default=0, metavar="N",
                 help="after the timing, each runner's N largest origins of XLA op time")
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                 help="a trainer config override (repeatable), e.g. model.scan_unroll=1")
  a = p.parse_args(argv)
  sizes = ["default"] if a.quick else [s for s in a.sizes.split(",") if s]
  unknown = [s for s in sizes if s not in SIZES]
  if unknown:
    print(f"error: unknown size {unknown[0]!r} in --sizes; use some of {', '.join(SIZES)}",
          file=sys.stderr)
    return 2
  from stablejax.training.config import ConfigError
  try:
    for size in sizes:
      _common.trainer_config("default", [*SIZES[size], *a.set])
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if a.quick:
    a.rounds, a.steps = a.rounds or 3, 2
  _common.print_machine()
  print(f"{a.steps} steps per runner per round; ratios: median (IQR) of the per-round ratios of "
        "seconds per step, peer / runner")
  rows = []
  for size in sizes:
    rows += compare(size, a.rounds or ROUNDS[size], a.steps, a.flat_peer, a.profile, a.set)
  print("\ntargets (tokens/s over the peer's):")
  for r in rows:
    if r["runner"] in TARGETS:
      ok = r["vs_peer"] >= TARGETS[r["runner"]]
      print(f"  {r['size']:8s} {r['runner']:11s} {r['vs_peer']:.3f}x "
            f"(target >= {TARGETS[r['runner']]:.2f}): {'met' if ok else 'NOT met'}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
