"""Shared bench helpers: the machine banner, configs, interleaved timing, tables.

Every bench prints :func:`machine_lines` first, so a number is never separated from the machine
it was measured on. Timings are medians over many repeats *after* compilation; compile time is
measured on its own (``jit(...).lower(...).compile()``). Two or more variants are timed
interleaved (A, B, A, B, ...) so that load from other processes on a shared machine hits all of
them alike.
"""

from __future__ import annotations

import copy
import os
import platform
import statistics
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from stablejax.training.config import Config, config_from_dict


# ----------------------------------------------------------------------------- machine


def cpu_model() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def machine_lines() -> list[str]:
  dev = jax.devices()[0]
  try:
    usable = len(os.sched_getaffinity(0))
  except AttributeError:
    usable = os.cpu_count()
  try:
    load = "load average %.2f %.2f %.2f" % os.getloadavg()
  except OSError:
    load = "load average n/a"
  return [
      f"machine: {platform.system()} {platform.machine()}, CPU {cpu_model()}, "
      f"{os.cpu_count()} cores ({usable} usable), {load}",
      f"jax {jax.__version__}, optax {optax.__version__}, backend {jax.default_backend()}, "
      f"{jax.device_count()} x {dev.device_kind}, python {platform.python_version()}",
  ]


def print_machine() -> None:
  for line in machine_lines():
    print(line)


# ----------------------------------------------------------------------------- configs


def deep_merge(base: dict, extra: dict) -> dict:
  out = copy.deepcopy(base)
  for k, v in extra.items():
    if isinstance(v, dict) and isinstance(out.get(k), dict):
      out[k] = deep_merge(out[k], v)
    else:
      out[k] = copy.deepcopy(v)
  return out


def make_config(*parts: dict) -> Config:
  raw: dict = {}
  for part in parts:
    raw = deep_merge(raw, part)
  return config_from_dict(raw)


def stability_off() -> dict:
  """A ``stability`` section with every declared defence and the recovery off: build_optimizer
  then gives ``chain(main, lr_scale)``. From the declarations, so a new defence is off here too."""
  from stablejax.transforms import defence
  off: dict = {d.name: {"enabled": False} for d in defence.registered()}
  return {**off, "recovery": {"enabled": False}}


def defences_on(*names: str) -> dict:
  """``stability_off()`` with the named defences on (at their declared defaults)."""
  from stablejax.transforms import defence
  unknown = [n for n in names if defence.get(n) is None]
  if unknown:
    raise ValueError(f"no defence named {', '.join(unknown)}: the declared ones are "
                     f"{', '.join(d.name for d in defence.registered())}")
  return {**stability_off(), **{n: {"enabled": True} for n in names}}


def plain_adamw_chain(cfg: Config, max_grad_norm: float | None = 1.0):
  """`clip_by_global_norm + AdamW`, the plain optax setup, with the trainer's LR schedule.

  The trailing `inject_hyperparams(scale)(1.0)` is the trainer's LR-backoff multiplier
  (`stablejax.training.optim`); the train step reads it, and the stability stack carries the same
  one, so both sides of a comparison pay for it.
  """
  from stablejax.training.optim import lr_schedule
  o = cfg.optimizer
  parts = [] if max_grad_norm is None else [optax.clip_by_global_norm(max_grad_norm)]
  parts += [optax.adamw(lr_schedule(cfg, o.learning_rate), b1=o.b1, b2=o.b2, eps=o.eps,
                        weight_decay=o.weight_decay),
            optax.inject_hyperparams(optax.scale)(step_size=1.0)]
  return optax.with_extra_args_support(optax.chain(*parts))


# ----------------------------------------------------------------------------- train steps


class CompiledStep:
  """The trainer's `train_step` for one optimizer, jitted (with donation) and compiled.

  Uses `stablejax.training.loop.step.make_train_step` and the config's model family, i.e. exactly
  the step `train.py` runs, on one device.
  """

  def __init__(self, cfg: Config, tx, batch: dict, seed: int = 0):
    from stablejax.training.config import model_of
    from stablejax.training.optim import lr_schedule
    from stablejax.training.loop.step import TrainState, make_train_step
    self.cfg, self.tx = cfg, tx
    model = model_of(cfg)

    def init(rng):
      params = model.init(rng, jnp.zeros((1, cfg.train.seq_len), jnp.int32))
      return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))

    self.state = jax.jit(init)(jax.random.PRNGKey(seed))
    step = make_train_step(model, tx, cfg, lr_schedule(cfg, 1.0))
    t0 = time.perf_counter()
    self.compiled = jax.jit(step, donate_argnums=0).lower(self.state, batch).compile()
    self.compile_seconds = time.perf_counter() - t0
    self.batch = batch
    self.last_metrics = None

  def planned_bytes(self) -> int | None:
    return planned_bytes(self.compiled)

  def fork(self) -> "CompiledStep":
    """A second runner of the same compiled step with its own copy of the state (no second
    compilation)."""
    other = copy.copy(self)
    other.state = jax.tree.map(jnp.copy, self.state)
    return other

  def run(self, n: int) -> float:
    """Runs `n` steps back to back (dispatch is asynchronous), waits, returns seconds per step."""
    t0 = time.perf_counter()
    state, metrics = self.state, None
    for _ in range(n):
      state, metrics = self.compiled(state, self.batch)
    jax.block_until_ready((state, metrics))
    dt = (time.perf_counter() - t0) / n
    self.state, self.last_metrics = state, metrics
    return dt


def planned_bytes(compiled) -> int | None:
  """Device memory a compiled function plans for: arguments + outputs + temporaries - donated
  (XLA's `memory_analysis`; None where the backend does not report it)."""
  try:
    m = compiled.memory_analysis()
  except Exception:  # noqa: BLE001 - a backend without the analysis
    return None
  if m is None:
    return None
  return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
             - m.alias_size_in_bytes)


# The trainer's config keys the benches set, in one place (the config's layout may change).
_QK_NORM_KEY = "model.qk_norm"
_QK_CLIP_KEYS = ("stability.qk_clip.enabled=true", "stability.qk_clip.tau={tau}")
STACKS = ("full", "clip_adamw")


def trainer_config(name: str, overrides: Sequence[str] = (), *, qk_norm: bool | None = None,
                   qk_clip_tau: float | None = None) -> Config:
  """A packaged config (``"gpt2_small"``, ...) with ``section.key=value`` overrides, and the
  model's QK-norm and the QK-clip threshold set by name rather than by config key."""
  from stablejax.training.config import load_config
  extra = list(overrides)
  if qk_norm is not None:
    extra.append(f"{_QK_NORM_KEY}={str(qk_norm).lower()}")
  if qk_clip_tau is not None:
    extra += [key.format(tau=qk_clip_tau) for key in _QK_CLIP_KEYS]
  return load_config(name, extra)


def trainer_step(cfg: Config, stack: str = "full", batch: dict | None = None,
                 seed: int = 0) -> "CompiledStep":
  """The trainer's compiled train step for ``cfg`` with one optimizer stack.

  ``stack``: ``"full"``, the chain ``build_optimizer(cfg)`` builds from the config (what
  ``python -m stablejax train`` runs: the stability stack around Muon or AdamW, QK-clip when
  configured); ``"clip_adamw"``, ``clip_by_global_norm(1.0)`` + AdamW with the trainer's schedule
  (`plain_adamw_chain`). ``batch`` defaults to `random_batch`. This is the one place where the
  benches that time the trainer's step build it, so a change of the trainer's API is adapted
  here.
  """
  from stablejax.training.optim import build_optimizer
  if stack not in STACKS:
    raise ValueError(f"stack must be one of {STACKS}, got {stack!r}")
  tx = build_optimizer(cfg) if stack == "full" else plain_adamw_chain(cfg, 1.0)
  return CompiledStep(cfg, tx, random_batch(cfg, seed) if batch is None else batch, seed)


def random_batch(cfg: Config, seed: int = 0) -> dict:
  """A batch of uniformly random tokens in the trainer's layout (grad_accum, B, T + 1): for
  timing on a machine without the config's data (speed does not depend on the tokens). Its step
  is one whose metrics the loop does not read, as most are (no pass for the update norms)."""
  t = cfg.train
  tokens = jax.random.randint(jax.random.PRNGKey(seed),
                              (t.grad_accum, t.batch_size // t.grad_accum, t.seq_len + 1),
                              0, cfg.model.vocab_size, jnp.int32)
  return {"tokens": tokens, "grad_scale": jnp.float32(1.0), "run_steps": jnp.int32(t.steps),
          "read_metrics": jnp.bool_(False)}


def logit_telemetry(cfg: Config):
  """The loop's attention-logit telemetry pass for ``cfg``, jitted: ``(params, tokens, step)``."""
  from stablejax.training.config import model_of
  from stablejax.training.loop.step import make_logit_telemetry
  return jax.jit(make_logit_telemetry(model_of(cfg), cfg))


def fixed_batch(cfg: Config, seed: int = 0) -> dict:
  """One real batch of the embedded corpus in the trainer's layout (grad_accum, B, T + 1), of a
  step whose metrics the loop does not read (as `random_batch`)."""
  from stablejax.data.pipeline import build_data
  t = cfg.train
  data = build_data(cfg.data, seq_len=t.seq_len, batch_size=t.batch_size, seed=seed)
  tokens = np.asarray(next(data.train_iter())["tokens"], np.int32)
  tokens = tokens.reshape(t.grad_accum, t.batch_size // t.grad_accum, tokens.shape[1])
  return {"tokens": jnp.asarray(tokens), "grad_scale": jnp.float32(1.0),
          "run_steps": jnp.int32(t.steps), "read_metrics": jnp.bool_(False)}


def interleaved(runners: dict[str, Callable[[], float]], rounds: int, warmup: int = 1
                ) -> dict[str, list[float]]:
  """Calls each runner in turn (A, B, A, B, ...) `rounds` times after `warmup` untimed rounds."""
  for _ in range(warmup):
    for fn in runners.values():
      fn()
  times: dict[str, list[float]] = {name: [] for name in runners}
  for _ in range(rounds):
    for name, fn in runners.items():
      times[name].append(fn())
  return times


def time_steps(runners: dict[str, Callable[[], float]], rounds: int, steps_per_call: int
               ) -> dict[str, list[float]]:
  """:func:`interleaved` over ``runners`` (each runs ``steps_per_call`` steps and returns the
  seconds per step) after one warm-up round, saying first what it times."""
  print(f"timing: {rounds} interleaved rounds of {steps_per_call} steps per variant after "
        f"1 warm-up round; ms per step")
  print()
  return interleaved(runners, rounds)


def ms_median_and_iqr(seconds: Sequence[float]) -> list[str]:
  """The table cells ``median ms`` and ``IQR ms`` (``q1-q3``) of per-step times in seconds."""
  q1, q3 = quartiles(seconds)
  return [f"{median(seconds) * 1e3:.2f}", f"{q1 * 1e3:.2f}-{q3 * 1e3:.2f}"]


def median(xs: Sequence[float]) -> float:
  return statistics.median(xs)


def quartiles(xs: Sequence[float]) -> tuple[float, float]:
  q = np.percentile(np.asarray(xs), [25, 75])
  return float(q[0]), float(q[1])


def paired_ratio(num: Sequence[float], den: Sequence[float]) -> tuple[float, float, float]:
  """Median and quartiles of the per-round ratios num[i] / den[i] (pairs share machine load)."""
  r = np.asarray(num) / np.asarray(den)
  q = np.percentile(r, [25, 50, 75])
  return float(q[1]), float(q[0]), float(q[2])


# ----------------------------------------------------------------------------- output


def table(rows: Sequence[Sequence[Any]], headers: Sequence[str]) -> str:
  cells = [[str(h) for h in headers]] + [[_fmt(c) for c in row] for row in rows]
  widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
  lines = []
  for j, row in enumerate(cells):
    lines.append("  ".join(c.rjust(w) if j and _numeric(c) else c.ljust(w)
                           for c, w in zip(row, widths)).rstrip())
    if j == 0:
      lines.append("  ".join("-" * w for w in widths))
  return "\n".join(lines)


def markdown_table(rows: Sequence[Sequence[Any]], headers: Sequence[str]) -> str:
  lines = ["| " + " | ".join(map(str, headers)) + " |",
           "|" + "|".join("---" for _ in headers) + "|"]
  lines += ["| " + " | ".join(_fmt(c) for c in row) + " |" for row in rows]
  return "\n".join(lines)


def _fmt(c: Any) -> str:
  if isinstance(c, float):
    if c != c:
      return "nan"
    if abs(c) >= 1000:
      return f"{c:,.0f}"
    if abs(c) >= 10:
      return f"{c:.1f}"
    return f"{c:.3f}"
  return str(c)


def _numeric(s: str) -> bool:
  try:
    float(s.replace(",", "").rstrip("x%"))
    return True
  except ValueError:
    return False


def ms(seconds: float) -> str:
  return f"{seconds * 1e3:.2f} ms"


# ----------------------------------------------------------------------------- trainer runs
#
# Shared by the benches that run the real trainer (`stablejax.training.loop.Trainer`) in-process,
# many
# runs in a pool of worker processes that share one persistent XLA compilation cache.


def use_compilation_cache(cache_dir: str | None) -> None:
  """Points this process's JAX at a persistent compilation cache shared by the worker pool."""
  if cache_dir:
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _scale_by_lr_factor(lr_factor):
  return optax.scale(lr_factor)


def with_lr_factor(tx):
  """`tx` followed by a multiplier held in the optimizer state (`set_lr_factor` changes it).

  The multiplier is a traced hyperparameter (`optax.inject_hyperparams`), so a chain compiled once
  serves every factor. It sits outside any skip wrapper: a skipped step's zero update stays zero.
  """
  return optax.with_extra_args_support(optax.chain(
      tx, optax.inject_hyperparams(_scale_by_lr_factor)(lr_factor=1.0)))


def _is_factor_state(node) -> bool:
  return (isinstance(node, (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState))
          and "lr_factor" in node.hyperparams)


def set_lr_factor(opt_state, factor: float):
  def visit(node):
    if _is_factor_state(node):
      old = node.hyperparams["lr_factor"]
      return node._replace(hyperparams={**node.hyperparams,
                                        "lr_factor": jnp.asarray(factor, old.dtype)})
    return node
  return jax.tree.map(visit, opt_state, is_leaf=_is_factor_state)


def trainer_run_class():
  """`Trainer` with two bench hooks, built lazily so importing this module stays light.

  - `lr_factor`: every learning rate times this factor, applied by a multiplier held in the
    optimizer state instead of through the config: next to the trainer's learning-rate scale
    inside the configured chain (after the update clipping, which is stated before the learning
    rate; before QK-clip and the compensated update, which must see the final update), or after
    the whole chain of a `tx` given to `Trainer` (`with_lr_factor`). The
    update is the same (`lr * factor * u`; weight decay scales with it, as with a larger
    configured rate), but the compiled train step does not depend on the rate, so every rate of a
    grid reuses one compilation from the persistent cache. The trainer's own learning-rate scale
    (the one the recovery backs off and returns to 1.0) multiplies it: a rollback backs off to
    `factor * stability.recovery.emergency_lr_factor` and returns to `factor`.
  - `init_val_loss`: the validation loss of the initial parameters, computed once before step 1
    on the run's own validation batches; `init_attn_logit_max`: their maximum attention logit
    (the trainer's telemetry on the first validation batch).
  """
  from stablejax.training.loop.trainer import Trainer

  class BenchRun(Trainer):
    lr_factor = 1.0
    init_val_loss = None
    init_attn_logit_max = None

    def __init__(self, cfg, out_dir, fresh=False, tx=None, **kwargs):
      from stablejax.training.optim import build_optimizer

      def factored(cfg, main):
        # The factor next to the trainer's learning-rate scale, inside the configured chain: after
        # the defences stated before the learning rate (update clipping divides out the
        # optimizer's configured rates, not this factor), before QK-clip and the compensated
        # update, which must see the final update (a factor after them would scale their
        # corrections too).
        return build_optimizer(cfg, main, update_scale=optax.chain(
            optax.inject_hyperparams(optax.scale)(step_size=1.0),
            optax.inject_hyperparams(_scale_by_lr_factor)(lr_factor=1.0)))

      if tx is None:
        super().__init__(cfg, out_dir, fresh, optimizer=factored, **kwargs)
      else:
        super().__init__(cfg, out_dir, fresh, tx=with_lr_factor(tx), **kwargs)
      restore = self.restorer.restore_or_init

      def restore_with_factor():
        state, meta = restore()
        if not meta:  # a fresh start (a rollback or resume restores the factor with the state)
          state = state.replace(opt_state=set_lr_factor(state.opt_state, self.lr_factor))
        return state, meta
      self.restorer.restore_or_init = restore_with_factor

    def _banner(self, step):
      super()._banner(step)
      if step == 0 and self.init_val_loss is None:
        batches = [jnp.asarray(b["tokens"])
                   for b in self.components.data.val_batches(self.cfg.train.eval_batches)]
        losses = [self.components.eval_step(self.state.params, b, jnp.int32(0)) for b in batches]
        self.init_val_loss = float(np.mean(jax.device_get(losses)))
        if self.cfg.logging.attention_logits:  # the logits before the first update
          tokens = batches[0][None]  # the telemetry's layout: [grad_accum, micro_batch, T + 1]
          self.init_attn_logit_max = float(jax.device_get(self.components.logit_telemetry(
              self.state.params, tokens, np.int32(0))["attn_logit_max"]))

  return BenchRun


def read_run(out_dir) -> tuple[dict, list[dict]]:
  """`summary.json` and the records of `metrics.jsonl` (file order: rolled-back steps included)."""
  import json
  from pathlib import Path
  out_dir = Path(out_dir)
  summary = json.loads((out_dir / "summary.json").read_text())
  records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()
             if line.strip()]
  return summary, records
