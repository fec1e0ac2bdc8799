"""The training run: set up, train with logging, eval, checkpoints and automatic recovery,
summarise.

Exit codes: 0 done, 2 bad config/data/checkpoints (raised as errors and reported by train.py),
3 diverged beyond the recovery budget, 130 interrupted (SIGINT/SIGTERM/SIGHUP; a checkpoint was
saved).

A rollback is written to `recovery.json` in the run directory the moment it is decided (after the
restore succeeded, before anything on disk changes); a run killed before its next checkpoint
re-applies it on resume, so the skipped data, the LR backoff and the rollback count survive.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

import stablejax
from stablejax.data.pipeline import build_data, data_tokenizer, garbage_batch
from stablejax.modeling.utils import excess_kurtosis, lambda_warmup
from stablejax.muon.describe import NoOutlierSafeMuonError
from stablejax.training import distributed
from stablejax.training import mesh as mesh_lib
from stablejax.training import runs
from stablejax.training.budget import CLOCK_FILE, PROBE_DIR, Budget, peak_memory
from stablejax.training.checkpoint import CheckpointError, Checkpoints, read_json, write_json_atomic
from stablejax.training.config import Config, ConfigError, ineffective_keys, to_dict
from stablejax.training.generate import EvalSampler
from stablejax.training.logger import RunLogger
from stablejax.modeling.gpt import GPT, count_params, model_flops_per_token
from stablejax.training.optim import (build_optimizer, learning_rate_warnings, learning_rates,
                                      lr_schedule, main_optimizer, set_lr_scale)
from stablejax.training.recovery import LRBackoff, Recovery, RollbackEvent
from stablejax.training.step import (TrainState, make_eval_step, make_logit_telemetry,
                                     make_train_step)

EXIT_OK, EXIT_DIVERGED, EXIT_INTERRUPTED = 0, 3, 130
RECOVERY_FILE = "recovery.json"  # the latest rollback decision, written atomically when it is made


class Interrupted(Exception):
  """SIGINT/SIGTERM during start-up: the run stopped at a safe point before its first step (the
  message is the one line to print; exit code 130). Nothing half-written is left behind: a
  checkpoint save or the time budget's probe in progress completes or is removed first."""

# bf16 dense peak per device, for MFU on accelerators we can name; CPUs are measured instead.
PEAK_FLOPS = {"H100": 989e12, "A100": 312e12, "L4": 121e12, "TPU v4": 275e12,
              "TPU v5 lite": 197e12, "TPU v5p": 459e12, "TPU v6 lite": 918e12}


def measured_peak_flops(n: int = 1024, repeats: int = 5) -> float:
  """Float32 matmul throughput of one device: an honest denominator for MFU on a CPU."""
  a = jnp.ones((n, n), jnp.float32)
  mm = jax.jit(lambda x: x @ x)
  mm(a).block_until_ready()
  t0 = time.perf_counter()
  for _ in range(repeats):
    mm(a).block_until_ready()
  return 2 * n**3 * repeats / (time.perf_counter() - t0)


def peak_flops_per_device(cfg: Config) -> float:
  if cfg.train.peak_flops_per_device:
    return cfg.train.peak_flops_per_device
  kind = jax.devices()[0].device_kind
  for name, flops in PEAK_FLOPS.items():
    if name.lower() in kind.lower():
      return flops
  return measured_peak_flops()


def _total_skips(record: dict) -> int:
  """Skipped steps in a metrics record, over every skip wrapper of the chain."""
  return sum(int(v) for k, v in record.items() if k.endswith("/total_skips"))


def _fetch(tree: Any) -> dict:
  return {k: np.asarray(v).item() for k, v in jax.device_get(tree).items()}


class Run:
  """One training run in `out_dir`; `Run(cfg, out_dir, fresh).train()` returns the exit code.

  The exit codes are train.py's: 0 done, 2 bad config/data/checkpoints, 3 diverged beyond the
  recovery budget, 130 interrupted (checkpoint saved). `out_dir` receives the checkpoints,
  ``metrics.jsonl``, ``summary.json`` and the TensorBoard logs; a checkpoint there resumes.

  Example:
    >>> import contextlib, io, json, pathlib, tempfile
    >>> from stablejax.training.config import load_config
    >>> from stablejax.training.loop import Run
    >>> cfg = load_config(None, [
    ...     "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.max_seq_len=16",
    ...     "train.seq_len=16", "train.batch_size=4", "train.steps=4", "train.warmup_steps=1",
    ...     "train.eval_every=4", "train.eval_batches=1", "train.peak_flops_per_device=1e12",
    ...     "logging.sample_every=0", "logging.progress=false", "checkpoint.every=4"])
    >>> out = pathlib.Path(tempfile.mkdtemp())
    >>> with contextlib.redirect_stdout(io.StringIO()):
    ...   code = Run(cfg, out).train()
    >>> code, json.loads((out / "summary.json").read_text())["steps"]
    (0, 4)
  """

  def __init__(self, cfg: Config, out_dir: Path, fresh: bool = False,
               tx: Optional[optax.GradientTransformationExtraArgs] = None):
    """`tx` replaces the optimizer the config describes (any optax chain; it must contain one
    `optax.inject_hyperparams(optax.scale)(step_size=1.0)`, the learning-rate scale that the
    recovery backs off)."""
    self.cfg = cfg
    self.out_dir = Path(out_dir)
    self.t_start = time.time()
    # From here a signal stops the run at the next safe point (between start-up phases, or at a
    # step), never in the middle of a compilation, a checkpoint save or the budget's probe.
    self.stop_signal: Optional[int] = None
    self._install_signal_handlers()
    distributed.initialize(cfg.mesh)  # before anything touches a JAX backend
    self.is_main = distributed.is_main()
    if fresh and self.is_main:
      for name in ("checkpoints", "damaged_checkpoints", RECOVERY_FILE, RECOVERY_FILE + ".stale",
                   "tensorboard", "metrics.jsonl", "summary.json", "report.png",
                   "quantize_eval.json", CLOCK_FILE, PROBE_DIR):
        path = self.out_dir / name
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    distributed.barrier("fresh")  # no process may look for checkpoints before they are gone
    self.out_dir.mkdir(parents=True, exist_ok=True)

    # Data first: a bad path is the commonest mistake and should fail before any compilation.
    t = cfg.train
    self.data = build_data(cfg.data, seq_len=t.seq_len, batch_size=t.batch_size, seed=t.seed,
                           process_index=jax.process_index(), process_count=jax.process_count())
    if self.data.vocab_size > cfg.model.vocab_size:
      raise ConfigError(f"the data has {self.data.vocab_size} token ids but model.vocab_size="
                        f"{cfg.model.vocab_size}: set model.vocab_size >= {self.data.vocab_size}")
    self._startup_check("loading the data")
    self.budget = Budget(cfg.train, self.t_start, clock_file=self.out_dir / CLOCK_FILE)
    if cfg.train.steps is None:
      # The time budget fixes the count (Budget.plan) after timing the compiled step, which does
      # not depend on it: until then the schedule is laid over a provisional count.
      cfg = self.cfg = dataclasses.replace(
          cfg, train=dataclasses.replace(cfg.train, steps=cfg.train.warmup_steps + 1))

    self.mesh = mesh_lib.make_mesh(cfg.mesh)
    mesh_lib.check_batch(t.batch_size, t.grad_accum, self.mesh)
    self.model = GPT(cfg.model)
    self.custom_tx = tx
    self._load_data_skips({})  # none yet: the restored checkpoint's replace them (_start)
    self._build_optimizer()
    self.bitnet_lambda = None
    if cfg.model.bitnet:
      self.bitnet_lambda = lambda_warmup(t.lambda_warmup_steps, t.lambda_schedule)
    self.sampler = self._make_sampler()

    self.log = RunLogger(self.out_dir, tensorboard=cfg.logging.tensorboard)
    self.recovery = Recovery(cfg.stability)
    self.monitor = stablejax.StabilityMonitor(
        thresholds=stablejax.HealthThresholds(high=cfg.logging.grad_norm_high,
                                              critical=cfg.logging.grad_norm_critical))
    self.checkpoints = Checkpoints(self.out_dir / "checkpoints", cfg.checkpoint.keep,
                                   cfg.checkpoint.async_save)
    self._compile()

  # ------------------------------------------------------------------ setup

  @property
  def total_steps(self) -> int:
    """The run's step count: train.steps, or the time budget's count once it is planned."""
    steps = self.cfg.train.steps
    assert steps is not None  # __init__ replaces null (the budget's to fix) with a provisional one
    return steps

  def _startup_check(self, phase: str) -> None:
    """Raises Interrupted when a signal came during start-up (all processes agree on it)."""
    stop = self.stop_signal or 0
    if jax.process_count() > 1:
      stop = int(distributed.agree_max(np.array(stop)))
    if stop:
      raise Interrupted(f"{signal.Signals(stop).name} during start-up ({phase}): stopped before "
                        "the first step; run the same command to start again")

  def _build_optimizer(self) -> None:
    cfg, tx = self.cfg, self.custom_tx
    self.main_tx = main_optimizer(cfg) if tx is None else None
    self.tx = build_optimizer(cfg, self.main_tx) if tx is None else tx
    # Logged as "lr": the main learning rate (Muon's, or AdamW's) with the recovery's backoff.
    self.schedule = lr_schedule(cfg, cfg.optimizer.learning_rate)

  def _record_tokenizer(self, resuming: bool) -> None:
    """RUN_DIR/tokenizer/: what decoding this run needs (runs.write_tokenizer_record). A resumed
    run's data must have the tokenizer it recorded (then the record is written again, the same,
    which restores a deleted copy)."""
    try:
      problem = runs.tokenizer_mismatch(self.out_dir, self.cfg.data) if resuming else None
      if problem:
        raise ConfigError(problem)
      if self.is_main:
        runs.write_tokenizer_record(self.out_dir, self.cfg.data)
    except runs.RunError as e:
      raise ConfigError(str(e)) from None

  def _apply_budget(self) -> None:
    """train.time_budget_minutes: fix the step count and lay the schedule over it (budget.py)."""
    steps = self.budget.plan(self, self._startup_check)
    if steps is None:
      return
    if self.custom_tx is not None:
      self.log.console("warning: train.time_budget_minutes with Run(tx=...): the step count is "
                       "fixed, but the schedules inside that tx are the caller's")
    if steps != self.cfg.train.steps:
      self.cfg = dataclasses.replace(self.cfg,
                                     train=dataclasses.replace(self.cfg.train, steps=steps))
      self._build_optimizer()
      self._compile()
    self.log.console(self.budget.describe())

  def _make_sampler(self) -> Optional[EvalSampler]:
    """The sample printed at evals (logging.sample_*); None when off or the tokenizer is unknown."""
    lg = self.cfg.logging
    if lg.sample_every == 0 or jax.process_count() > 1:
      return None
    try:
      tok = data_tokenizer(self.cfg.data)
    except ValueError as e:  # e.g. tiktoken's files not cached: train anyway, without samples
      self.log.console(f"warning: no samples at evals: {e}")
      return None
    if tok is None:
      return None
    return EvalSampler(self.cfg.model, tok, lg.sample_prompt, lg.sample_tokens,
                       self.cfg.train.seed, self.bitnet_lambda)

  def _init_state(self, rng: jax.Array) -> TrainState:
    tokens = jnp.zeros((1, self.cfg.train.seq_len), jnp.int32)
    params = self.model.init(rng, tokens)["params"]
    loss_scale = None
    if self.cfg.model.compute_dtype == "float16":
      s = self.cfg.stability.loss_scale
      loss_scale = stablejax.DynamicLossScale.create(
          initial_scale=s.init, growth_interval=s.growth_interval, growth_factor=s.growth_factor)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      opt_state=self.tx.init(params), loss_scale=loss_scale,
                      lr_backoff=LRBackoff.none())

  def _compile(self) -> None:
    cfg, mesh = self.cfg, self.mesh
    rng = jax.random.PRNGKey(cfg.train.seed)
    abstract = jax.eval_shape(self._init_state, rng)
    self.state_sharding = mesh_lib.state_shardings(mesh, abstract)
    self.abstract_state = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract,
        self.state_sharding)
    self.init_state = jax.jit(self._init_state, out_shardings=self.state_sharding)
    self.tokens_sharding = jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec(None, mesh_lib.BATCH_AXES))
    batch_sharding = {"tokens": self.tokens_sharding, "grad_scale": mesh_lib.replicated(mesh)}
    step_fn = _under_mesh(mesh, make_train_step(self.model, self.tx, cfg, self.schedule,
                                                self.bitnet_lambda))
    self.train_step = jax.jit(step_fn, in_shardings=(self.state_sharding, batch_sharding),
                              out_shardings=(self.state_sharding, mesh_lib.replicated(mesh)),
                              donate_argnums=0)
    eval_fn = make_eval_step(self.model, cfg, self.bitnet_lambda)
    replicated = mesh_lib.replicated(mesh)
    # Replicated outputs: every process fetches the same values, so all take the same branches.
    self.eval_step = jax.jit(eval_fn, in_shardings=(self.state_sharding.params,
                                                    mesh_lib.batch_sharding(mesh), replicated),
                             out_shardings=replicated)
    self.set_lr_backoff = jax.jit(_with_lr_backoff, out_shardings=self.state_sharding,
                                  donate_argnums=0)
    self.activation_stats = jax.jit(self._activation_stats, out_shardings=replicated)
    # At log steps: attention-logit growth and output-logit statistics on a slice of the batch.
    self.logit_telemetry = jax.jit(make_logit_telemetry(self.model, cfg, self.bitnet_lambda),
                                   out_shardings=replicated)
    self.grad_norms = jax.jit(self._grad_norms, out_shardings=replicated)
    self.param_movement = jax.jit(stablejax.param_movement, out_shardings=replicated)
    self.previous_params = None

  def _device_tokens(self, tokens: np.ndarray) -> jax.Array:
    """Host batch [B/P, T+1] (this process's rows) -> global [grad_accum, B/accum, T+1] array."""
    accum = self.cfg.train.grad_accum
    local = tokens.reshape(accum, tokens.shape[0] // accum, tokens.shape[1])
    return jax.make_array_from_process_local_data(self.tokens_sharding, local)

  def _val_batches(self) -> list[jax.Array]:
    """The fixed validation batches as global [B, T+1] arrays built from this process's rows."""
    sharding = mesh_lib.batch_sharding(self.mesh)
    return [jax.make_array_from_process_local_data(sharding, np.asarray(b["tokens"], np.int32))
            for b in self.data.val_batches(self.cfg.train.eval_batches)]

  # ------------------------------------------------------------------ run

  def train(self) -> int:
    try:
      step = self._start()
    except Interrupted as e:
      self.log.console(str(e))
      self.checkpoints.close()  # a step-0 save in flight completes
      self.log.close()
      return EXIT_INTERRUPTED
    return self._train_from(step)

  def _start(self) -> int:
    """Restores or initialises the state, fixes the budget's step count and saves step 0; returns
    the step to continue from. Raises Interrupted when a signal came in the meantime."""
    self.train_iter = self.data.train_iter()
    self.state, meta = self._restore_or_init()
    self.batches_consumed = int(meta.get("batches_consumed", 0))
    self._load_data_skips(meta)
    self.abandoned_skips = int(meta.get("abandoned_skips", 0))  # skips on rolled-back branches
    self.recovery.load_state_dict(meta.get("recovery", {}))
    if meta.get("monitor"):
      self.monitor.load_state_dict(meta["monitor"])
    step = int(meta.get("step", 0))
    self._record_tokenizer(resuming=bool(meta))
    self._startup_check("restoring the checkpoint" if meta else "initialising the model")
    self.budget.load_state_dict(meta)
    self._apply_budget()
    if step == 0 and not self.checkpoints.all_steps():
      self._save(0)  # the initial state is good by definition: a rollback target from the start
      self._startup_check("saving step 0")
    self._banner(step)
    self.val_batches = self._val_batches()
    if self.budget.active and self.val_batches:
      # Compile the eval (and sample) now, at start-up: the budget's margin for the final eval
      # holds their compiled times, and a resumed segment has not compiled them yet.
      jax.block_until_ready(self.eval_step(self.state.params, self.val_batches[0], np.int32(step)))
      if self.sampler is not None:
        self.sampler(self.state.params, step)
      self._startup_check("compiling the evaluation")
    self.agreed_stop: Optional[int] = None
    return step

  def _train_from(self, step: int) -> int:
    cfg, total = self.cfg, self.total_steps
    bar = tqdm(total=total, initial=step, disable=not (self.is_main and cfg.logging.progress),
               dynamic_ncols=True, desc="train")
    pending: Optional[tuple[int, Any]] = None
    save_deferred = False  # a checkpoint step came while the loss was elevated
    self.t_interval, self.tokens_interval = time.time(), 0
    self.tokens_per_sec = float("nan")
    exit_code = EXIT_OK
    self.time_check = (time.time(), step)  # the steps since the last out-of-time check, timed
    if step < total and self._out_of_time():  # earlier segments used up the budget
      self._stop_for_time(step, saved=step in self.checkpoints.all_steps())
      step_limit = step
    else:
      step_limit = total
    while step < step_limit:
      if self._stop_requested():
        exit_code = self._interrupted(step)
        break
      self._maybe_kill(step, when="step")
      batch = self._next_batch(step)
      self.state, metrics = self.train_step(self.state, batch)
      step += 1
      self.tokens_interval += cfg.train.batch_size * cfg.train.seq_len
      bar.update(1)

      # Metrics of step s are read after step s+1 is dispatched: the host never stalls the device.
      cause = self._log(*pending, bar) if pending else None
      pending = None
      is_log = step % cfg.train.log_every == 0
      is_ckpt = step % cfg.checkpoint.every == 0 or step == total or (
          save_deferred and is_log)
      if is_log or is_ckpt:
        if cfg.logging.attention_logits:
          metrics = {**metrics, **self.logit_telemetry(self.state.params, batch["tokens"],
                                                       np.int32(step))}
        pending = (step, metrics)
      if is_ckpt and cause is None:
        cause = self._log(step, metrics, bar)  # a checkpoint needs this step's health now
        pending = None
      if cause is None and step % cfg.train.eval_every == 0 and step < total:
        cause = self._evaluate(step)
      if cause is None and self._sample_due(step):
        self._sample(step)
      if cause is None and self._diagnostics_due(step):
        self._diagnostics(step)
      if cause is None and is_ckpt:
        # Only a state whose latest loss is not elevated becomes a rollback target.
        save_deferred = not self.recovery.healthy()
        if save_deferred:
          self.log.record({"step": step, "event": "checkpoint_deferred",
                           "cause": "train loss elevated"})
        else:
          self._save(step)
      if is_log:
        self.budget.tick()
      if cause is None and is_log and step < total and self._out_of_time(step):
        self._stop_for_time(step, saved=is_ckpt)
        break
      if cause is not None:
        if not (cfg.stability.recovery.enabled and self.recovery.budget_left):
          exit_code = self._diverged(step, cause)
          break
        step = self._rollback(step, cause)
        bar.reset(total=total)
        bar.update(step)
        pending = None
        save_deferred = False
    bar.close()
    if exit_code == EXIT_OK:
      self._evaluate(step, final=True)
    return self._finish(step, exit_code)

  # ------------------------------------------------------------------ batches and faults

  def _next_batch(self, step: int) -> dict:
    f = self.cfg.faults
    while self.pending_skips and self.batches_consumed >= self.pending_skips[0][0]:
      _, last = self.pending_skips.pop(0)  # a rollback's skip, deferred until the replay got here
      self._skip_batches(last - self.batches_consumed)
    index = self.batches_consumed  # position of this batch in the data stream
    tokens = next(self.train_iter)["tokens"]
    self.batches_consumed += 1
    if step in f.garbage_batch_steps or index in f.garbage_batch_indices:
      seed = step if step in f.garbage_batch_steps else index
      tokens = garbage_batch(f.garbage_kind, tokens.shape[0], tokens.shape[1] - 1,
                             self.data.vocab_size, seed=seed)["tokens"]
    grad_scale = 1.0
    if step in f.nan_grad_steps or index in f.nan_grad_batch_indices:
      grad_scale = float("nan")
    elif step in f.grad_scale_steps:
      grad_scale = f.grad_scale_factor
    return {"tokens": self._device_tokens(np.asarray(tokens, np.int32)),
            "grad_scale": np.float32(grad_scale)}

  def _load_data_skips(self, meta: dict) -> None:
    """The deferred data skips and the data position of each older checkpoint, as a restored
    checkpoint recorded them (empty for a fresh run or a checkpoint that predates them)."""
    self.pending_skips: list[tuple[int, int]] = sorted(
        (int(a), int(b)) for a, b in meta.get("pending_skips", []))
    known = {int(k): int(v) for k, v in meta.get("checkpoint_batches", {}).items()}
    if "step" in meta:
      known[int(meta["step"])] = int(meta.get("batches_consumed", 0))
    self.checkpoint_batches: dict[int, int] = known

  def _schedule_skip(self, first: int, last: int) -> None:
    """Skips data batches [first, last): now when the stream is at `first` or past it, else once
    the replay reaches `first` (the batches before it were good)."""
    if self.batches_consumed >= first:
      self._skip_batches(last - self.batches_consumed)
    else:
      self.pending_skips = sorted(self.pending_skips + [(first, last)])

  def _skip_batches(self, n: int) -> None:
    """Advances the data stream by `n` batches without training on them."""
    for _ in range(n):
      next(self.train_iter)
    self.batches_consumed += max(0, n)

  def _maybe_kill(self, n: int, when: str) -> None:
    """SIGKILL at the configured step, checkpoint save or rollback (faults.kill_*)."""
    f = self.cfg.faults
    target = {"step": f.kill_at_step, "save": f.kill_during_save_step,
              "rollback": f.kill_after_rollback}[when]
    if target is not None and n == target:
      os.kill(os.getpid(), signal.SIGKILL)

  # ------------------------------------------------------------------ logging

  def _log(self, step: int, device_metrics: Any, bar: Any) -> Optional[str]:
    record = {"step": step, **_fetch(device_metrics)}
    now = time.time()
    if self.tokens_interval:
      self.tokens_per_sec = self.tokens_interval / max(now - self.t_interval, 1e-9)
    self.t_interval, self.tokens_interval = now, 0
    record["tokens_per_sec"] = self.tokens_per_sec
    for line in self.monitor.update(step, record):
      self.log.console(f"warning: {line}")
      self.log.record({"step": step, "event": "warning", "cause": line})
    record["stability_score"] = self.monitor.score()
    record["health"] = self.monitor.level
    self.log.record(record, stablejax.tensorboard_scalars(record, rates=self.monitor.rates()))
    skipped = _total_skips(record) + self.abandoned_skips
    bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{self.tokens_per_sec:,.0f}",
                    skipped=skipped, refresh=False)
    self.last_record = record
    check = self.cfg.stability.recovery.enabled
    return self._agree(self.recovery.check_train(record) if check else None)

  def _evaluate(self, step: int, final: bool = False) -> Optional[str]:
    losses = [self.eval_step(self.state.params, b, np.int32(step)) for b in self.val_batches]
    val_loss = float(np.mean(jax.device_get(losses)))
    self.last_val_loss = val_loss
    record = {"step": step, "val_loss": val_loss}
    self.log.record(record, stablejax.tensorboard_scalars(record))
    self.log.console(f"step {step}: val_loss {val_loss:.4f}" + (" (final)" if final else ""))
    if self.budget.check_target(step, val_loss):
      self.log.console(f"step {step}: val_loss below the target {self.budget.target} after "
                       f"{self.budget.time_to_target:.0f} s")
    if final and self.sampler is not None:
      self._sample(step)
    if final or not self.cfg.stability.recovery.enabled:
      return None
    return self._agree(self.recovery.check_val(val_loss))

  def _sample_due(self, step: int) -> bool:
    """logging.sample_every: at the steps it names (None: at each eval); the final eval samples."""
    every = self.cfg.logging.sample_every
    if self.sampler is None or step >= self.total_steps:
      return False
    return step % (self.cfg.train.eval_every if every is None else every) == 0

  def _sample(self, step: int) -> None:
    assert self.sampler is not None
    text = self.sampler(self.state.params, step)
    self.log.console(f"step {step}: sample {json.dumps(text, ensure_ascii=False)}")
    self.log.text("samples", f"```\n{text}\n```", step)

  def _diagnostics_due(self, step: int) -> bool:
    every = self.cfg.logging
    return any(n and step % n == 0 for n in (every.activation_every, every.histogram_every))

  def _activation_stats(self, params: Any, tokens: jax.Array, step: jax.Array) -> dict:
    lam = self.bitnet_lambda(step) if self.bitnet_lambda is not None else jnp.float32(1.0)
    kwargs: dict[str, Any] = {"bitnet_lambda": lam} if self.cfg.model.bitnet else {}
    logits, acts = self.model.apply({"params": params}, tokens[:, :-1], return_activations=True,
                                    **kwargs)
    residual = acts["residual"]
    return {"act_rms": jnp.sqrt(jnp.mean(jnp.square(residual))),
            "act_max": jnp.max(jnp.abs(residual)),
            "logit_max": jnp.max(jnp.abs(logits)),
            "excess_kurtosis": excess_kurtosis(residual[1:])}

  def _grad_norms(self, params: Any, tokens: jax.Array) -> dict:
    def loss_fn(p: Any) -> jax.Array:
      logits: jax.Array = self.model.apply({"params": p}, tokens[:, :-1])  # type: ignore[assignment]
      return stablejax.cross_entropy_with_z_loss(logits, tokens[:, 1:])[0]
    return stablejax.per_layer_grad_norms(jax.grad(loss_fn)(params))

  def _diagnostics(self, step: int) -> None:
    """Activation statistics and per-layer gradient norms on a fixed validation batch."""
    batch = self.val_batches[0]
    record = {"step": step}
    if self.cfg.logging.activation_every and step % self.cfg.logging.activation_every == 0:
      record.update(_fetch(self.activation_stats(self.state.params, batch, np.int32(step))))
      self.last_kurtosis = record["excess_kurtosis"]
      record.update(self._movement_check(step))
    if self.cfg.logging.histogram_every and step % self.cfg.logging.histogram_every == 0:
      norms = _fetch(self.grad_norms(self.state.params, batch))
      self.log.histogram("grads/layer_norms", list(norms.values()), step)
      for name, value in norms.items():
        record[f"grad_norm/{name}"] = value
    self.log.record(record, stablejax.tensorboard_scalars(record))

  def _movement_check(self, step: int) -> dict:
    """Per-group relative parameter change since the previous check ("are parameters moving?")."""
    previous, self.previous_params = self.previous_params, jax.tree.map(jnp.copy, self.state.params)
    if previous is None:
      return {}
    movement = jax.device_get(self.param_movement(previous, self.state.params))
    dtypes = stablejax.param_dtypes(self.state.params)
    for line in stablejax.movement_warnings(movement, dtypes=dtypes, step=step):
      self.log.console(f"warning: {line}")
      self.log.record({"step": step, "event": "warning", "cause": line})
    return stablejax.movement_record(movement)

  def _banner(self, step: int) -> None:
    if not self.is_main:
      return
    cfg = self.cfg
    n_params = count_params(self.state.params)
    lines = [
        f"stablejax {stablejax.__version__}: {n_params / 1e6:.2f}M parameters "
        f"({cfg.model.n_layers} layers, d_model {cfg.model.d_model}), "
        f"params {cfg.model.param_dtype}, compute {cfg.model.compute_dtype}",
        f"devices: {jax.device_count()} x {jax.devices()[0].device_kind} "
        f"({jax.process_count()} process(es)); mesh {dict(self.mesh.shape)}",
        f"data: {json.dumps(self.data.stats, default=str)}",
        f"optimizer: {cfg.optimizer.name}, peak learning rates {learning_rates(cfg)}, "
        f"{self.total_steps} steps ({self.budget.describe_length(self.total_steps)}), warmup "
        f"{cfg.train.warmup_steps}",
        f"output: {self.out_dir}" + (f" (resuming at step {step})" if step else ""),
    ]
    try:  # the configured chain or Run(tx=...): any chain holding an outlier_safe_muon
      lines.append(stablejax.describe_routing(self.state.params, self.tx))
    except NoOutlierSafeMuonError:
      pass
    for line in lines:
      self.log.console(line)
    for warning in learning_rate_warnings(cfg) + ineffective_keys(cfg):
      self.log.console(f"warning: {warning}")

  # ------------------------------------------------------------------ checkpoints and recovery

  def _meta(self, step: int) -> dict:
    self.checkpoint_batches[step] = self.batches_consumed
    on_disk = set(self.checkpoints.all_steps()) | {step}
    return {"step": step, "batches_consumed": self.batches_consumed,
            "pending_skips": [list(r) for r in self.pending_skips],
            "checkpoint_batches": {str(s): b for s, b in sorted(self.checkpoint_batches.items())
                                   if s in on_disk},
            "abandoned_skips": self.abandoned_skips,
            "recovery": self.recovery.state_dict(), "monitor": self.monitor.state_dict(),
            **self.budget.state_dict(), "good": True}

  def _save(self, step: int) -> None:
    self.checkpoints.save(step, self.state, self.train_iter, self._meta(step))
    self._maybe_kill(step, when="save")

  def _state_metrics(self, state: TrainState) -> dict:
    return _fetch(stablejax.stability_metrics(state.opt_state))

  def _restore(self, at_most: Optional[int] = None) -> Optional[tuple[TrainState, dict]]:
    return self.checkpoints.restore(self.abstract_state, self.train_iter, at_most=at_most,
                                    on_fallback=self._checkpoint_fallback)

  def _restore_or_init(self) -> tuple[TrainState, dict]:
    """The newest undamaged checkpoint, with a rollback decided after it re-applied; or step 0."""
    state, meta = self._restore_checkpoint_or_init()
    self.recovery.acknowledge(self._state_metrics(state))  # requests the saved state already had
    return state, meta

  def _restore_checkpoint_or_init(self) -> tuple[TrainState, dict]:
    restored = self._restore()
    if restored is None:
      stale = self.out_dir / RECOVERY_FILE
      if self.is_main and stale.exists():  # its checkpoints are gone: it describes another run
        stale.replace(stale.with_name(RECOVERY_FILE + ".stale"))
        self.log.console(f"warning: no checkpoint in {self.checkpoints.directory}: starting at step"
                         f" 0 and keeping the old rollback record as {RECOVERY_FILE}.stale")
      return self.init_state(jax.random.PRNGKey(self.cfg.train.seed)), {}
    state, meta = restored
    decision = read_json(self.out_dir / RECOVERY_FILE)
    saved_events = len(meta.get("recovery", {}).get("events", []))
    if decision is None or len(decision["recovery"]["events"]) <= saved_events:
      return state, meta
    # The run stopped after a rollback and before its next checkpoint: redo that rollback.
    event = RollbackEvent(**{**decision["recovery"]["events"][-1]})
    if int(meta["step"]) > event.restored_step:  # a checkpoint of the abandoned branch
      restored = self._restore(at_most=event.restored_step)
      if restored is None:
        raise CheckpointError(f"{self.out_dir / RECOVERY_FILE} records a rollback to step "
                              f"{event.restored_step}, but no checkpoint that old is left: pass "
                              "--fresh to start over")
      state, meta = restored
    self.checkpoints.delete_after(int(meta["step"]))
    self.batches_consumed = int(meta.get("batches_consumed", 0))
    self._load_data_skips(meta)
    self._schedule_skip(*event.skipped_batches)
    self.log.console(f"re-applying rollback {len(decision['recovery']['events'])} "
                     f"({event.describe()}) recorded in {RECOVERY_FILE}")
    state = self.set_lr_backoff(state, jnp.float32(event.lr_scale), jnp.int32(meta["step"]))
    meta = {**meta, "batches_consumed": self.batches_consumed,
            "pending_skips": [list(r) for r in self.pending_skips],
            "abandoned_skips": decision["abandoned_skips"], "recovery": decision["recovery"],
            "monitor": decision["monitor"]}
    return state, meta

  def _checkpoint_fallback(self, step: int, reason: str) -> None:
    self.log.console(f"warning: checkpoint {step} is damaged ({reason}); trying the previous one"
                     f" (the damaged one goes to {self.checkpoints.damaged_directory})")
    self.log.record({"step": step, "event": "fallback_checkpoint", "cause": reason})

  def _rollback(self, step: int, cause: str) -> int:
    """Restores a good checkpoint with a lower LR and skips the data that led here.

    The decision is written to recovery.json as soon as the restore succeeded and before the
    abandoned branch's checkpoints are deleted: a crash from here on cannot undo it.
    """
    failed_at = self.batches_consumed
    record = getattr(self, "last_record", {})
    self.checkpoints.wait()
    target = self.recovery.rollback_target(self.checkpoints.all_steps())
    restored = self._restore(at_most=target) if target is not None else None
    if restored is None:
      raise CheckpointError(f"no checkpoint left in {self.checkpoints.directory} to roll back to:"
                            " pass --fresh to start over")
    self.state, meta = restored
    restored_step = int(meta["step"])
    restored_metrics = self._state_metrics(self.state)
    self.abandoned_skips += max(0, _total_skips(record) - _total_skips(restored_metrics))
    # The data to skip is what was read since the target checkpoint. When the target was damaged
    # and an older one restored, the batches between the two were good: they are replayed, and
    # the skip waits until the stream reaches the target's position.
    target_batches = self.checkpoint_batches.get(target) if target is not None else None
    self.batches_consumed = int(meta.get("batches_consumed", 0))
    self._load_data_skips(meta)
    first_skipped = self.batches_consumed if target_batches is None else target_batches
    self._schedule_skip(first_skipped, failed_at)
    # The LR that failed, backed off; it returns to 1.0 over stability.recovery.lr_recovery_steps.
    lr_scale = float(record.get("lr_scale", 1.0)) * self.cfg.stability.recovery.emergency_lr_factor
    self.state = self.set_lr_backoff(self.state, jnp.float32(lr_scale), jnp.int32(restored_step))
    event = RollbackEvent(step=step, cause=cause, restored_step=restored_step, lr_scale=lr_scale,
                          skipped_batches=(first_skipped, failed_at))
    self.recovery.record(event, restored_metrics)
    self.monitor.record_rollback(step, cause)
    if self.is_main:
      write_json_atomic(self.out_dir / RECOVERY_FILE, {
          "recovery": self.recovery.state_dict(), "abandoned_skips": self.abandoned_skips,
          "monitor": self.monitor.state_dict()})
    self.log.console(f"warning: rollback {self.recovery.rollbacks}/"
                     f"{self.cfg.stability.recovery.max_rollbacks}"
                     f" at {event.describe()}")
    self.log.record({"step": step, "event": "rollback", **dataclasses.asdict(event)},
                    {"recovery/rollbacks": self.recovery.rollbacks, "recovery/lr_scale": lr_scale})
    self.log.text("recovery/events", event.describe(), step)
    self._maybe_kill(self.recovery.rollbacks, when="rollback")
    self.checkpoints.delete_after(restored_step)  # the abandoned branch
    return restored_step

  def _diverged(self, step: int, cause: str) -> int:
    self.log.record({"step": step, "event": "diverged", "cause": cause})
    lines = [f"error: training diverged at step {step}: {cause}",
             f"recovery budget used: {self.recovery.rollbacks} of "
             f"{self.cfg.stability.recovery.max_rollbacks} rollbacks"]
    lines += [f"  rollback {i + 1}: {e.describe()}" for i, e in enumerate(self.recovery.events)]
    lines.append("try: a lower optimizer.learning_rate, a longer train.warmup_steps, or check the "
                 "data"
                 f" (see {self.out_dir / 'metrics.jsonl'})")
    for line in lines:
      self.log.console(line)
    self.diverged_cause = cause
    return EXIT_DIVERGED

  def _install_signal_handlers(self) -> None:
    def handler(signum: int, frame: Any) -> None:
      self.stop_signal = signum
    # SIGHUP too: a closed terminal (or `stablejax launch` passing one on) saves like SIGTERM.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
      signal.signal(sig, handler)

  # Multi-process: every process must take the same branch, or the next collective deadlocks.
  # Rollback causes come from `Recovery.check_train(record)` / `check_val(val_loss)` on values
  # fetched from replicated arrays, identical on every process; `_agree` still reduces the
  # decision (any process's trigger rolls back all), and carries the host-local stop signal, at
  # the log and eval steps, where the host already waits for the device. A signal therefore takes
  # effect at the next log step (within train.log_every steps) on a multi-process run.

  def _agree(self, cause: Optional[str]) -> Optional[str]:
    if jax.process_count() == 1:
      return cause
    rollback, stop = distributed.agree_max(np.array([cause is not None, self.stop_signal or 0]))
    if stop:
      self.agreed_stop = int(stop)
    if rollback and cause is None:
      cause = "a rollback trigger on another process"
    return cause

  def _out_of_time(self, step: Optional[int] = None) -> bool:
    """The time budget's early stop; processes read their own clocks, so they agree on it. The
    next step is taken to last as long as the steps since the previous check did, if longer than
    measured (a busier machine, or a resumed run on a slower one)."""
    recent = None
    if step is not None:
      (then, previous), now = self.time_check, time.time()
      if step > previous:
        recent = (now - then) / (step - previous)
      self.time_check = (now, step)
    return distributed.agree_any(self.budget.out_of_time(recent))

  def _stop_for_time(self, step: int, saved: bool) -> None:
    """Ends the run early at `step` because the budget would be exceeded (a checkpoint first)."""
    why = ("earlier segments of this run used the rest of it" if self.budget.segments > 1
           else "steps ran slower than measured")
    self.log.console(f"warning: step {step}: stopping before the planned {self.cfg.train.steps} "
                     f"steps to stay within train.time_budget_minutes ({why}); the learning rate"
                     f" is not at its floor")
    self.budget.stopped_at = step
    if not saved and self.recovery.healthy():
      self._save(step)

  def _stop_requested(self) -> bool:
    if jax.process_count() == 1:
      return self.stop_signal is not None
    return self.agreed_stop is not None

  def _interrupted(self, step: int) -> int:
    signum = self.agreed_stop or self.stop_signal
    name = signal.Signals(signum).name if signum is not None else "a stop request"
    if self.recovery.healthy() and step not in self.checkpoints.all_steps():
      self._save(step)
    self.log.console(f"{name} at step {step}: checkpoint saved; run the same command to resume")
    return EXIT_INTERRUPTED

  # ------------------------------------------------------------------ summary

  def _finish(self, step: int, exit_code: int) -> int:
    self.checkpoints.close()
    self.budget.tick(force=True)
    wall = time.time() - self.t_start
    record = getattr(self, "last_record", {})
    skipped = _total_skips(record) + self.abandoned_skips
    flops = model_flops_per_token(self.cfg.model, self.cfg.train.seq_len)
    peak = peak_flops_per_device(self.cfg) * jax.device_count()
    summary = {
        "final_val_loss": getattr(self, "last_val_loss", None),
        "final_train_loss": record.get("loss"),
        "steps": step,
        "skipped_steps": skipped,
        "rollbacks": self.recovery.rollbacks,
        "tokens_per_sec": self.tokens_per_sec,
        "mfu": flops * self.tokens_per_sec / peak if math.isfinite(self.tokens_per_sec) else None,
        "stability_score": self.monitor.score(),
        "excess_kurtosis": getattr(self, "last_kurtosis", None),
        "wall_seconds": wall,
        "total_wall_seconds": self.budget.elapsed(),
        "exit_code": exit_code,
        "events": [e.describe() for e in self.recovery.events],
        **self.budget.summary(),
        **peak_memory(),
    }
    if self.is_main:
      text = json.dumps(summary, indent=2, default=float)
      (self.out_dir / "summary.json").write_text(text + "\n")
      if exit_code == EXIT_OK:
        self.log.console(
            f"done: {step} steps in {wall:.0f}s, val_loss {summary['final_val_loss']:.4f}, "
            f"{skipped} skipped steps, {self.recovery.rollbacks} rollbacks, "
            f"stability score {summary['stability_score']:.2f}; logs in {self.out_dir}")
        for line in self.monitor.advice():
          self.log.console(f"advice: {line}")
    self.log.close()
    return exit_code


def _under_mesh(mesh: jax.sharding.Mesh, fn: Callable[..., Any]) -> Callable[..., Any]:
  """``fn`` traced with ``mesh`` as the context mesh, so code inside the step (Muon's gather of
  each sharded matrix before Newton-Schulz) can place its sharding constraints."""
  def traced(*args: Any) -> Any:
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return fn(*args)
  return traced


def _with_lr_backoff(state: TrainState, scale: jax.Array, start: jax.Array) -> TrainState:
  """`state` with a new LR backoff and the optimizer's LR scale set to its starting value."""
  return state.replace(lr_backoff=LRBackoff(scale=scale, start=start),
                       opt_state=set_lr_scale(state.opt_state, scale))


def write_config(cfg: Config, out_dir: Path) -> None:
  """Writes the run's config.json (atomically: an interrupted write leaves the old file)."""
  distributed.initialize(cfg.mesh)  # process_index() below would otherwise start a backend
  if distributed.is_main():
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    write_json_atomic(Path(out_dir) / "config.json", to_dict(cfg), indent=2)
