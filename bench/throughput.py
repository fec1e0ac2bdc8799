"""Tokens/s of train.py's training loop over a minimal hand-written flax + optax loop.

Usage:
  python -m bench.throughput            # stablejax/configs/default.json model, 100 steps, 2 repeats
  python -m bench.throughput --quick    # a smaller model, 40 steps, 1 repeat

Both sides train the same GPT (`stablejax.modeling.gpt.GPT`, same config, same seed), on the
same batches (`stablejax.data.pipeline.build_data`, same seed and order) with the same optimizer
(`clip_by_global_norm(1.0)` + AdamW with the trainer's warmup-cosine schedule) and the same loss
(cross-entropy + 1e-4 z-loss), fetching the loss every `train.log_every` steps. The trainer side is
`stablejax.training.loop.Trainer(cfg, out, fresh=True).train()`, i.e. `python -m stablejax train`,
with optimizer.name="adamw" and the stability layers off (so only the trainer's own machinery
differs: its step with metrics and fault hooks, sharded batches, the StabilityMonitor, JSONL and
TensorBoard logging, the progress bookkeeping). Its evaluation and checkpoints are placed outside
the timed window (eval_every and checkpoint.every = steps); a second trainer row adds the
diagnostics (activation statistics, per-layer gradient norms, parameter-movement check) every
`steps // 2` steps, so one diagnostics pass falls inside the timed window (the default cadence
is every 100 steps).

Throughput on both sides = tokens of steps log_every+1 .. steps / wall time between the fetch at
step log_every and the fetch at step `steps` (so compilation and the first interval are
excluded). For the trainer that is computed from the `tokens_per_sec` of every logged interval
in its metrics.jsonl. The runs alternate (hand, trainer, trainer+diagnostics, hand, ...).
Target: trainer / hand >= 0.95.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import flax.linen  # noqa: F401
import jax
import jax.numpy as jnp
import numpy as np
import optax

from bench import _common
from stablejax.data.pipeline import build_data
from stablejax.training.loop.trainer import Trainer
from stablejax.modeling.gpt import GPT, count_params
from stablejax.training.optim import lr_schedule

ROOT = Path(__file__).resolve().parent.parent

DEFAULT_CONFIG = ROOT / "stablejax" / "configs" / "default.json"
QUICK_MODEL = {"model": {"d_model": 128, "n_layers": 2, "n_heads": 4, "max_seq_len": 64},
               "train": {"seq_len": 64, "batch_size": 8}}
TARGET = 0.95


def hand_loop(cfg) -> tuple[float, float]:
  """The minimal loop. Returns (tokens/s over steps log_every+1..steps, last fetched loss)."""
  t, z = cfg.train, cfg.stability.z_loss
  model = GPT(cfg.model)
  tx = optax.chain(optax.clip_by_global_norm(1.0),
                   optax.adamw(lr_schedule(cfg, cfg.optimizer.learning_rate), b1=cfg.optimizer.b1,
                               b2=cfg.optimizer.b2, eps=cfg.optimizer.eps,
                               weight_decay=cfg.optimizer.weight_decay))
  params = model.init(jax.random.PRNGKey(t.seed), jnp.zeros((1, t.seq_len), jnp.int32))["params"]
  opt_state = tx.init(params)

  def loss_fn(params, tokens):
    logits = model.apply({"params": params}, tokens[:, :-1])
    lse = jax.nn.logsumexp(logits, axis=-1)
    target = jnp.take_along_axis(logits, tokens[:, 1:, None], axis=-1)[..., 0]
    return jnp.mean(lse - target) + z * jnp.mean(jnp.square(lse))

  @partial(jax.jit, donate_argnums=(0, 1))
  def step(params, opt_state, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  data = build_data(cfg.data, seq_len=t.seq_len, batch_size=t.batch_size, seed=t.seed)
  it = data.train_iter()
  t_start, loss = None, float("nan")
  for i in range(1, t.steps + 1):
    tokens = jnp.asarray(np.asarray(next(it)["tokens"], np.int32))
    params, opt_state, loss_dev = step(params, opt_state, tokens)
    if i % t.log_every == 0:
      loss = float(loss_dev)
      if i == t.log_every:
        t_start = time.perf_counter()
  elapsed = time.perf_counter() - t_start
  return (t.steps - t.log_every) * t.batch_size * t.seq_len / elapsed, loss


def trainer_loop(cfg, out: Path) -> tuple[float, float]:
  """train.py's Trainer. Returns (tokens/s over the same window from metrics.jsonl, last loss)."""
  with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    code = Trainer(cfg, out, fresh=True).train()
  if code != 0:
    raise RuntimeError(f"trainer run exited with code {code}")
  records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
  train = [r for r in records if "tokens_per_sec" in r]
  window = train[1:]  # the first interval holds compilation
  steps = [train[0]["step"]] + [r["step"] for r in window]
  tokens = [(b - a) * cfg.train.batch_size * cfg.train.seq_len for a, b in zip(steps, steps[1:])]
  seconds = sum(n / r["tokens_per_sec"] for n, r in zip(tokens, window))
  return sum(tokens) / seconds, train[-1]["loss"]


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--quick", action="store_true")
  p.add_argument("--steps", type=int, default=None)
  p.add_argument("--repeats", type=int, default=None)
  args = p.parse_args(argv)
  steps = args.steps or (40 if args.quick else 100)
  repeats = args.repeats or (1 if args.quick else 2)
  if steps < 20:  # the timed window starts after the first fetch, at step 10
    p.error(f"--steps {steps}: use at least 20 (the first 10 steps are compilation and warm-up)")

  base = json.loads(DEFAULT_CONFIG.read_text())
  if args.quick:
    base = _common.deep_merge(base, QUICK_MODEL)
  common = {
      "optimizer": {"name": "adamw", "learning_rate": 1e-3},
      "stability": _common.defences_on("clip"),
      "train": {"steps": steps, "warmup_steps": min(30, steps // 4), "eval_every": steps,
                "log_every": 10, "peak_flops_per_device": 1e12},
      "checkpoint": {"every": steps},
      "logging": {"progress": False, "tensorboard": True},
  }
  quiet = {"logging": {"histogram_every": 0, "activation_every": 0}}
  cfg = _common.make_config(base, common, quiet)
  every = steps // 2
  cfg_diag = _common.make_config(base, common, {"logging": {"histogram_every": every,
                                                            "activation_every": every}})

  _common.print_machine()
  m, t = cfg.model, cfg.train
  n_params = count_params(jax.eval_shape(
      lambda: GPT(m).init(jax.random.PRNGKey(0), jnp.zeros((1, t.seq_len), jnp.int32)))["params"])
  print(f"model: GPT d_model {m.d_model}, {m.n_layers} layers, {n_params / 1e6:.2f}M params, "
        f"compute {m.compute_dtype}; batch {t.batch_size} x seq {t.seq_len}; {steps} steps, loss "
        f"fetched every {t.log_every}; timed window steps {t.log_every + 1}..{steps}; "
        f"{repeats} alternating repeat(s)")
  print(f"trainer+diagnostics: activation stats, movement check and per-layer grad norms at "
        f"step {every} (inside the timed window)")
  print()

  results: dict[str, list[tuple[float, float]]] = {
      "hand": [], "trainer": [], "trainer+diagnostics": []}
  with tempfile.TemporaryDirectory(prefix="stablejax_throughput_") as tmp:
    for rep in range(repeats):
      results["hand"].append(hand_loop(cfg))
      results["trainer"].append(trainer_loop(cfg, Path(tmp) / f"run{rep}"))
      results["trainer+diagnostics"].append(trainer_loop(cfg_diag, Path(tmp) / f"diag{rep}"))
      each = ", ".join(f"{k} {v[-1][0]:,.0f} tok/s" for k, v in results.items())
      print(f"repeat {rep + 1}: {each}", flush=True)

  hand = [v[0] for v in results["hand"]]
  rows = []
  for name, vals in results.items():
    tps = [v[0] for v in vals]
    ratios = [a / b for a, b in zip(tps, hand)]
    rows.append([name, f"{_common.median(tps):,.0f}", ", ".join(f"{x:,.0f}" for x in tps),
                 f"{_common.median(ratios):.3f}", f"{vals[-1][1]:.4f}"])
  print()
  print(_common.table(rows, ["loop", "median tok/s", "each repeat", "ratio vs hand",
                             f"loss at step {steps}"]))
  ratio = _common.median([a[0] / b for a, b in zip(results["trainer"], hand)])
  print()
  verdict = "met" if ratio >= TARGET else "NOT met"
  print(f"trainer / hand = {ratio:.3f}; target >= {TARGET}: {verdict} (equal losses at step "
        f"{steps} show both loops ran the same computation on the same data)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
