"""What a run builds once from its config: model, optimizer, mesh, shardings, compiled functions.

:func:`build` returns :class:`Components`, a plain frozen value. The loop holds it and calls its
functions; the time budget times them; :func:`with_steps` gives it a new step count (the run's
length is an argument of the train step, so its programs are the same ones). Nothing here
reads or writes the run directory.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any, Callable, Optional, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax

from stablejax.data.pipeline import Data
from stablejax.data.sources import data_tokenizer
from stablejax.modeling.family import CAPABILITIES, LanguageModel
from stablejax.modeling.losses import cross_entropy_with_z_loss
from stablejax.modeling.utils import excess_kurtosis
from stablejax.monitor.layers import per_layer_grad_norms
from stablejax.monitor.movement import param_movement
from stablejax.training.launch import mesh as mesh_lib
from stablejax.training.config import Config, model_of
from stablejax.training.trained.decoding import EvalSampler
from stablejax.training.optim import (Schedules, build_optimizer, main_optimizer, run_steps,
                                      set_lr_scale)
from stablejax.training.recovery.policy import LRBackoff
from stablejax.training.loop.step import (TrainState, make_eval_step, make_gradient_check,
                                     make_logit_telemetry, make_train_step, metrics_read)
from stablejax.transforms import _registry
from stablejax.transforms.loss_scaling import DynamicLossScale

# `optimizer(cfg, main)`: the chain around the configured main optimizer (Muon or AdamW). The
# default is build_optimizer; a caller may wrap or replace it (the benchmarks swap in baselines).
# The chain must contain one `optax.inject_hyperparams(optax.scale)(step_size=1.0)`, the
# learning-rate scale that the recovery backs off.
OptimizerFactory = Callable[[Config, optax.GradientTransformation],
                            optax.GradientTransformationExtraArgs]



@dataclasses.dataclass(frozen=True)
class Components:
  """The built pieces of a run (see :func:`build`). Every function is jitted with the run's
  shardings; ``train_step`` donates its state."""

  cfg: Config
  data: Data
  mesh: jax.sharding.Mesh
  model: LanguageModel
  tx: optax.GradientTransformationExtraArgs
  schedules: Schedules              # every parameter group's learning rate, built once
  sampler: Optional[EvalSampler]
  abstract_state: Any               # ShapeDtypeStructs with shardings: what a restore fills
  state_sharding: Any
  tokens_sharding: jax.sharding.NamedSharding
  init_state: Callable[[jax.Array], TrainState]
  init_optimizer: Callable[[Any], Any]  # params -> the chain's initial state (a restore's new
                                        # defences)
  train_step: Callable[[TrainState, dict], tuple[TrainState, dict]]
  eval_step: Callable[[Any, jax.Array, Any], jax.Array]
  # (state, scale, start, steps) -> state with that LRBackoff (steps -1: the recovery's return)
  set_lr_backoff: Callable[[TrainState, jax.Array, jax.Array, jax.Array], TrainState]
  logit_telemetry: Callable[[Any, jax.Array, Any], dict]
  activation_stats: Callable[[Any, jax.Array, Any], dict]
  grad_norms: Callable[[Any, jax.Array], dict]
  param_movement: Callable[[Any, Any], Any]
  gradient_check: Callable[[Any, dict, Any], dict]  # stability.determinism's two executions
  optimizer: Optional[OptimizerFactory]  # the caller's chain factory (None: the configured one)

  @property
  def telemetry(self) -> bool:
    """Whether log steps measure the attention logits (``logging.attention_logits``, when the
    model family offers them)."""
    return self.cfg.logging.attention_logits and self.model.supports("attention logits")

  @property
  def activation_statistics(self) -> bool:
    """Whether ``logging.activation_every`` measures the residual stream (when the model family
    offers it)."""
    return bool(self.cfg.logging.activation_every) and self.model.supports("residual stream")

  @property
  def schedule(self) -> optax.Schedule:
    """The main learning rate at an update count, over this run's length (:attr:`total_steps`):
    logged as ``lr`` (with the LR scale)."""
    main, steps = self.schedules.main, self.total_steps

    def at(count: jax.typing.ArrayLike) -> jax.typing.ArrayLike:
      with run_steps(steps):  # the programs' schedules have no length of their own
        return main(count)
    return at

  @property
  def total_steps(self) -> int:
    """train.steps, or the time budget's count once it is planned (a provisional one before)."""
    steps = self.cfg.train.steps
    # build_components() lays the schedule over a provisional count until then
    assert steps is not None
    return steps

  def step_batch(self, tokens: np.ndarray, grad_scale: float = 1.0, *, step: int) -> dict:
    """The batch of ``step`` (0-based index of the step about to run) from host tokens
    ``[B/P, T+1]``: the tokens on device, the fault factor on the gradient (1.0: none), the run's
    length (:attr:`total_steps`) and whether the loop reads the step's metrics
    (:func:`stablejax.training.loop.step.metrics_read`)."""
    steps = self.total_steps
    return {"tokens": self.device_tokens(tokens), "grad_scale": np.float32(grad_scale),
            "run_steps": np.int32(steps),
            "read_metrics": np.bool_(metrics_read(self.cfg, step + 1, steps))}

  def device_tokens(self, tokens: np.ndarray) -> jax.Array:
    """Host batch ``[B/P, T+1]`` (this process's rows) -> global ``[grad_accum, B/accum, T+1]``."""
    accum = self.cfg.train.grad_accum
    local = tokens.reshape(accum, tokens.shape[0] // accum, tokens.shape[1])
    return jax.make_array_from_process_local_data(self.tokens_sharding, local)

  def val_batches(self) -> list[jax.Array]:
    """The fixed validation batches as global ``[B, T+1]`` arrays from this process's rows."""
    sharding = mesh_lib.batch_sharding(self.mesh)
    return [jax.make_array_from_process_local_data(sharding, np.asarray(b["tokens"], np.int32))
            for b in self.data.val_batches(self.cfg.train.eval_batches)]


# The components of the last configs built in this process, by what their programs depend on:
# another run here with the same program config (a resume, a repeated config in a notebook, a
# sweep over seeds or data, the stages of a test, runs that differ only in faults or in when they
# log and save) calls the same jitted functions, which JAX has already traced and compiled,
# instead of tracing, lowering and loading every program again. The least recently used go first,
# so a config a process keeps coming back to (a notebook's, a test suite's tiny run) stays.
_BUILT: collections.OrderedDict[tuple, Components] = collections.OrderedDict()
_BUILT_KEPT = 4

# Settings that only the host reads: the data (its pipeline is built on the host; the programs see
# token ids, and the vocabulary through model.vocab_size), the seed (the initialisation's key is
# an argument), the run's length (the train step's batch["run_steps"]: a resume that trains
# longer, or a time budget's planned count, reuses the step), when to log, save, evaluate, sample
# and report (batch["read_metrics"] says which steps' metrics the loop reads), how many
# checkpoints to keep, the recovery's policy (its LR backoff reaches the programs as arguments),
# the run's checks and the deliberate faults (applied to the batch and the state on the host).
# The programs are built from the config with these at their defaults (:func:`program_config`),
# so configs that differ only here share one set of programs, and no program can depend on one of
# them: it would see the default in every run, not a stale value in some. None: the whole
# section.
HOST_ONLY: dict[str, Optional[tuple[str, ...]]] = {
    "train": ("seed", "steps", "eval_every", "eval_batches", "log_every", "peak_flops_per_device",
              "time_budget_minutes", "target_val_loss", "rewarmup_steps", "compilation_cache"),
    "data": None,
    "checkpoint": ("every", "keep", "async_save"),
    "logging": ("tensorboard", "progress", "histogram_every", "activation_every",
                "attention_logits", "grad_norm_high", "grad_norm_critical", "sample_every",
                "sample_prompt", "sample_tokens"),
    "stability.recovery": ("emergency_lr_factor", "max_rollbacks", "loss_window",
                           "loss_explosion_factor", "max_transients", "transient_window",
                           "reject_after"),
    "stability.determinism": None,
    "stability.replicas": None,
    "stability.watchdog": None,
    "faults": None,
}


def program_config(cfg: Config) -> Config:
  """``cfg`` with the settings of :data:`HOST_ONLY` at their defaults: what the programs are
  built from (the model family's builder sees it too)."""
  def at_defaults(section: Any, fields: Optional[tuple[str, ...]]) -> Any:
    default = type(section)()
    if fields is None:
      return default
    return dataclasses.replace(section, **{f: getattr(default, f) for f in fields})

  sections: dict[str, Any] = {}
  stability: dict[str, Any] = {}
  for path, fields in HOST_ONLY.items():
    top, _, sub = path.partition(".")
    if sub:
      stability[sub] = at_defaults(getattr(cfg.stability, sub), fields)
    else:
      sections[top] = at_defaults(getattr(cfg, top), fields)
  # No length at all, rather than the default one: a schedule called in a program without the
  # run's length (stablejax.training.optim.run_steps) fails instead of decaying over 250 steps.
  sections["train"] = dataclasses.replace(sections["train"], steps=None)
  stability_section: Any = cfg.stability  # a dataclass built from the registry
  return dataclasses.replace(cfg, stability=dataclasses.replace(stability_section, **stability),
                             **sections)


def _program_key(cfg: Config, tx: Optional[optax.GradientTransformationExtraArgs],
                 optimizer: Optional[OptimizerFactory]) -> tuple:
  """What the built programs depend on: the program config (``cfg`` from
  :func:`program_config`; its repr: every field), the caller's chain or factory (by identity),
  the registries' declarations (a plugin loaded since changes them) and the devices."""
  return (repr(cfg), tx, optimizer, _registry.generation(), tuple(jax.devices()))


def build_components(cfg: Config, data: Data, *,
                     tx: Optional[optax.GradientTransformationExtraArgs] = None,
                     optimizer: Optional[OptimizerFactory] = None,
                     warn: Callable[[str], None] = lambda line: None) -> Components:
  """Builds and jits everything a run needs from ``cfg`` (``train.steps`` must be set); the
  programs of a config whose programs were built before in this process are reused (see
  ``_BUILT`` and :data:`HOST_ONLY`).

  Args:
    cfg: the run's config.
    data: the run's data (:func:`stablejax.data.pipeline.build_data`).
    tx: a whole chain instead of the configured one (its schedules are the caller's).
    optimizer: ``(cfg, main) -> chain`` instead of :func:`build_optimizer`.
    warn: where a warning line goes (no samples at evals, no attention telemetry, ...).

  Raises:
    MissingCapability: the model family lacks what the config asks of it (QK-clip's logits).
  """
  programs_cfg = program_config(cfg)
  key = _program_key(programs_cfg, tx, optimizer)
  built = _BUILT.get(key)
  if built is not None:
    _BUILT.move_to_end(key)
  else:
    built = _build_programs(programs_cfg, tx, optimizer)
    # (keyed after building: the first build may load the built-in declarations)
    _BUILT[_program_key(programs_cfg, tx, optimizer)] = built
    while len(_BUILT) > _BUILT_KEPT:
      _BUILT.popitem(last=False)
  _warn_missing(cfg, built.model, warn)
  return dataclasses.replace(built, cfg=cfg, data=data, sampler=_sampler(cfg, built.model, warn))


def _build_programs(cfg: Config, tx: Optional[optax.GradientTransformationExtraArgs],
                    optimizer: Optional[OptimizerFactory]) -> Components:
  """:func:`build_components` without the run's data and sampler (``None`` here: the memo
  holds no run's data), from the program config (:func:`program_config`)."""
  mesh = mesh_lib.make_mesh(cfg.mesh)
  mesh_lib.check_batch(cfg.train.batch_size, cfg.train.grad_accum, mesh)
  model = model_of(cfg)
  schedules = Schedules.of(cfg)
  if tx is not None:
    chain = tx
  elif optimizer is not None:
    chain = optimizer(cfg, main_optimizer(cfg, schedules))
  else:
    chain = build_optimizer(cfg, main_optimizer(cfg, schedules), schedules=schedules)
  t = cfg.train

  def init_state(rng: jax.Array) -> TrainState:
    params = model.init(rng, jnp.zeros((1, t.seq_len), jnp.int32))
    loss_scale = None
    if model.compute_dtype == "float16":
      s = cfg.stability.loss_scale
      loss_scale = DynamicLossScale.create(initial_scale=s.init, growth_interval=s.growth_interval,
                                           growth_factor=s.growth_factor)
    r = cfg.stability.recovery
    device_faults = (jnp.zeros((mesh.size,), jnp.int32) if r.enabled and r.replay else None)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=chain.init(params),
                      loss_scale=loss_scale, lr_backoff=LRBackoff.none(),
                      device_faults=device_faults)

  # The key's shape only: a key made here would be two programs to compile or load.
  abstract = jax.eval_shape(init_state, jax.eval_shape(jax.random.PRNGKey, t.seed))
  state_sharding = mesh_lib.state_shardings(mesh, abstract)
  if abstract.device_faults is not None:  # one count per device, on that device
    state_sharding = state_sharding.replace(device_faults=mesh_lib.batch_sharding(mesh))
  replicated = mesh_lib.replicated(mesh)
  tokens_sharding = jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec(None, mesh_lib.BATCH_AXES))
  batch_sharding = {"tokens": tokens_sharding, "grad_scale": replicated, "run_steps": replicated,
                    "read_metrics": replicated}
  step_fn = _under_mesh(mesh, make_train_step(model, chain, cfg, schedules.main))

  def activation_stats(params: optax.Params, tokens: jax.Array, step: jax.Array) -> dict:
    logits, residual = model.residual_stream(params, tokens[:, :-1], step)
    return {"act_rms": jnp.sqrt(jnp.mean(jnp.square(residual))),
            "act_max": jnp.max(jnp.abs(residual)), "logit_max": jnp.max(jnp.abs(logits)),
            "excess_kurtosis": excess_kurtosis(residual[1:])}

  def grad_norms(params: optax.Params, tokens: jax.Array) -> dict:
    def loss_fn(p: Any) -> jax.Array:
      logits = model.logits(p, tokens[:, :-1], jnp.int32(0))
      return cross_entropy_with_z_loss(logits, tokens[:, 1:])[0]
    return per_layer_grad_norms(jax.grad(loss_fn)(params))

  return Components(
      cfg=cfg, data=cast(Data, None), mesh=mesh, model=model, tx=chain, schedules=schedules,
      sampler=None,
      abstract_state=jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                  abstract, state_sharding),
      state_sharding=state_sharding, tokens_sharding=tokens_sharding,
      init_state=jax.jit(init_state, out_shardings=state_sharding),
      init_optimizer=jax.jit(chain.init, out_shardings=state_sharding.opt_state),
      train_step=jax.jit(step_fn, in_shardings=(state_sharding, batch_sharding),
                         out_shardings=(state_sharding, replicated), donate_argnums=0),
      # Replicated outputs: every process fetches the same values, so all take the same branches.
      eval_step=jax.jit(make_eval_step(model, cfg),
                        in_shardings=(state_sharding.params, mesh_lib.batch_sharding(mesh),
                                      replicated), out_shardings=replicated),
      set_lr_backoff=jax.jit(_with_lr_backoff, out_shardings=state_sharding, donate_argnums=0),
      logit_telemetry=jax.jit(make_logit_telemetry(model, cfg), out_shardings=replicated),
      activation_stats=jax.jit(activation_stats, out_shardings=replicated),
      grad_norms=jax.jit(grad_norms, out_shardings=replicated),
      param_movement=jax.jit(param_movement, out_shardings=replicated),
      gradient_check=jax.jit(_under_mesh(mesh, make_gradient_check(model, cfg)),
                             in_shardings=(state_sharding.params, batch_sharding, replicated),
                             out_shardings=replicated),
      optimizer=optimizer)


def _warn_missing(cfg: Config, model: LanguageModel, warn: Callable[[str], None]) -> None:
  """A report the config asks for that the model family cannot give: one warning line, off."""
  asked = [("logging.attention_logits", cfg.logging.attention_logits, "attention logits"),
           ("logging.activation_every", bool(cfg.logging.activation_every), "residual stream")]
  for key, on, capability in asked:
    if on and not model.supports(capability):
      warn(f"warning: model family {model.family!r} does not offer {capability} "
           f"({CAPABILITIES[capability][1]}): {key} has no effect")


def with_steps(components: Components, steps: int,
               tx: Optional[optax.GradientTransformationExtraArgs]
               ) -> Components:
  """The components for a run of ``steps`` steps (the time budget's count). The run's length is
  host-only (:data:`HOST_ONLY`), so the programs are the ones already built; only a caller's
  whole chain (``tx``, kept as it is) has schedules of its own, laid over its own count."""
  train = dataclasses.replace(components.cfg.train, steps=steps)
  cfg = dataclasses.replace(components.cfg, train=train)
  return build_components(cfg, components.data, tx=tx, optimizer=components.optimizer)


def _sampler(cfg: Config, model: LanguageModel, warn: Callable[[str], None]
             ) -> Optional[EvalSampler]:
  """The sample printed at evals (logging.sample_*); None when off or the tokenizer is unknown.
  A model family without decoding re-runs the model on the growing context (the banner says
  so)."""
  lg = cfg.logging
  if lg.sample_every == 0 or jax.process_count() > 1:
    return None
  try:
    tok = data_tokenizer(cfg.data)
  except ValueError as e:  # e.g. tiktoken's files not cached: train anyway, without samples
    warn(f"warning: no samples at evals: {e}")
    return None
  if tok is None:
    return None
  return EvalSampler(model, tok, lg.sample_prompt, lg.sample_tokens, cfg.train.seed)


def _under_mesh(mesh: jax.sharding.Mesh, fn: Callable[..., Any]) -> Callable[..., Any]:
  """``fn`` traced with ``mesh`` as the context mesh, so code inside the step (Muon's gather of
  each sharded matrix before Newton-Schulz) can place its sharding constraints."""
  def traced(*args: Any) -> Any:
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return fn(*args)
  return traced


def _with_lr_backoff(state: TrainState, scale: jax.Array, start: jax.Array, steps: jax.Array
                     ) -> TrainState:
  """`state` with a new LR backoff and the optimizer's LR scale set to its starting value."""
  return state.replace(lr_backoff=LRBackoff(scale=scale, start=start, steps=steps),
                       opt_state=set_lr_scale(state.opt_state, scale))


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

