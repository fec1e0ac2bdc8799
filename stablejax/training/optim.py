"""The optimizer from the config: the stablejax chain around Muon or AdamW, with optax schedules.

The chain comes from the defence declarations (:mod:`stablejax.transforms.defence`): each
enabled section of ``stability`` puts its transform in its position. The default shape::

    skip_nonfinite(skip_spikes(chain(zclip, outlier_safe_muon | adamw, lr_scale)))

Its state is keyed by name (:mod:`stablejax.transforms.keyed`): ``{"zclip": ..., "optimizer":
{"muon": ...}, "lr_scale": ..., "skip_spikes": ..., "skip_nonfinite": ...}``, so a defence
switched on or off between two starts of a run adds or drops only its own entry.

with ``stability.clip`` / ``stability.adagc`` next to ZClip on the gradient and
``stability.qk_clip`` last, when enabled. A defence that needs an extra ``update`` argument says
so (QK-clip: ``max_logits``, the step's per-head max attention logits, which the train step then
computes in its forward pass; the spike skip: ``loss``).

`lr_scale` is `optax.inject_hyperparams(optax.scale)`, a multiplier on the final update (so it
scales decoupled weight decay too, like a learning rate). It lives in the optimizer state, so the
recovery's learning-rate backoff is saved in and restored from checkpoints with everything else.

The learning-rate schedules count applied updates: a skipped step leaves the whole inner state as
it was, schedule counts included, so the run is the same as one without that batch (the exact
no-op the skip wrappers promise; optax's `apply_if_finite` and Megatron-LM, which steps its
scheduler only after a successful update, do the same). OLMo-core advances its schedule on skipped
steps instead (its scheduler reads the trainer's step). The cost here: after k skipped steps the
schedule runs k steps behind the step number, so the last step ends slightly above the final rate.
The `lr_scale` state's own `count` is the same count (it sits inside the skip wrappers next to the
optimizer), and the train step logs `lr` from it: the rate actually applied.

The run's length (``train.steps``, or the count a time budget plans) reaches the train step as an
argument, the batch's ``run_steps``, not as a constant of the program: inside the step
(:func:`run_steps`) the schedules lay their decay over it. A resume that trains longer, or a
budgeted run once its length is planned, calls the step it already compiled (or finds it in the
compilation cache). Outside a train step a schedule uses the config's ``train.steps``.

Weight decay never touches norm gains, biases and scalars (label "adam" of
`stablejax.label_params`): in adamw mode `optimizer.weight_decay` decays every other leaf
through optax's own `mask=`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Callable, Iterator, Optional

import jax
import jax.numpy as jnp
import optax

from stablejax.muon.labels import label_params
from stablejax.muon.routing import muon_dimension_numbers
from stablejax.training.config import Config, model_of
from stablejax.training.config.optimizers import OptimizerContext
from stablejax.transforms import defence


# The run's length while a train step is traced (a traced int32 scalar), None elsewhere.
_RUN_STEPS: contextvars.ContextVar[Optional[jax.typing.ArrayLike]] = contextvars.ContextVar(
    "run_steps", default=None)


@contextlib.contextmanager
def run_steps(steps: jax.typing.ArrayLike) -> Iterator[None]:
  """Within this block the schedules of :func:`lr_schedule` decay over ``steps`` (the train
  step's ``batch["run_steps"]``) instead of ``train.steps``: every optimizer calls its schedules
  inside ``update``, which the train step calls here."""
  token = _RUN_STEPS.set(steps)
  try:
    yield
  finally:
    _RUN_STEPS.reset(token)


def lr_schedule(cfg: Config, peak: float) -> optax.Schedule:
  """Linear warmup from 0 to `peak`, cosine decay to `peak * min_lr_ratio` at the last step:
  ``optax.warmup_cosine_decay_schedule`` over ``train.steps``, or, inside :func:`run_steps`,
  over the run's length given there.

  Raises:
    ValueError: called outside :func:`run_steps` while ``train.steps`` is unset (a program
      config, or a time budget's run before its plan).
  """
  t = cfg.train
  alpha = 0.0 if peak == 0.0 else t.min_lr_ratio  # optax's end_value / peak_value
  configured = None if t.steps is None else optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=peak, warmup_steps=t.warmup_steps,
      decay_steps=t.steps, end_value=peak * t.min_lr_ratio)
  # The same two pieces optax joins, the decay over a length known only when the step runs:
  # optax's join takes the boundary, and its cosine the length, as Python numbers.
  ramp = optax.linear_schedule(0.0, peak, t.warmup_steps) if t.warmup_steps > 0 else None
  decay = optax.cosine_decay_schedule(peak, decay_steps=1, alpha=alpha)

  def schedule(count: jax.typing.ArrayLike) -> jax.typing.ArrayLike:
    steps = _RUN_STEPS.get()
    if steps is None:
      if configured is None:
        raise ValueError("train.steps is unset: set it, or call the schedule inside "
                         "stablejax.training.optim.run_steps (the train step does)")
      return configured(count)
    count = jnp.asarray(count)
    done = (count - t.warmup_steps) / jnp.maximum(jnp.asarray(steps) - t.warmup_steps, 1)
    decayed = decay(done)  # (done: the fraction of the decay behind)
    return decayed if ramp is None else jnp.where(count < t.warmup_steps, ramp(count), decayed)
  return schedule


@dataclasses.dataclass(frozen=True)
class Schedules:
  """Every parameter group's learning-rate schedule (:func:`lr_schedule` of its peak), built once
  per run (and again when the time budget fixes the step count).

  Attributes:
    by_group: ``{"adamw": ...}`` or ``{"muon": ..., "adam": ..., "embedding": ..., "head": ...}``.
  """

  by_group: dict[str, optax.Schedule]

  @classmethod
  def of(cls, cfg: Config) -> "Schedules":
    return cls({group: lr_schedule(cfg, peak) for group, peak in learning_rates(cfg).items()})

  @property
  def main(self) -> optax.Schedule:
    """The optimizer's first group's rate (``optimizer.learning_rate``: AdamW's, Muon's
    matrices'): logged as ``lr``."""
    return next(iter(self.by_group.values()))


def learning_rates(cfg: Config) -> dict[str, float]:
  """Peak learning rate of each parameter group, resolved: what the optimizer uses (its config
  class's ``learning_rates``: Muon's four groups, AdamW's one, a plugin's own)."""
  return cfg.optimizer.learning_rates()


def learning_rate_warnings(cfg: Config) -> list[str]:
  """`stablejax.check_learning_rates` on the resolved rates (a Muon rate on AdamW groups, ...)."""
  return cfg.optimizer.warnings()


def decay_mask(params: optax.Params) -> Any:
  """True for the leaves weight decay may touch: all but norm gains, biases and scalars."""
  return jax.tree.map(lambda label: label != "adam", label_params(params))


def optimizer_context(cfg: Config, schedules: Optional[Schedules] = None) -> OptimizerContext:
  """What the configured optimizer's ``build`` gets: its schedules, the routing, the decay mask
  and the model's query heads (``optimizer.per_head``)."""
  return OptimizerContext(schedules=(schedules or Schedules.of(cfg)).by_group,
                          labels=label_params, matrices=muon_dimension_numbers,
                          decay_mask=decay_mask, num_heads=_query_heads(cfg))


def main_optimizer(cfg: Config, schedules: Optional[Schedules] = None
                   ) -> optax.GradientTransformation:
  """The optimizer ``cfg.optimizer`` declares (Muon, AdamW, a plugin's), with ``schedules``
  (default: ``Schedules.of(cfg)``)."""
  return cfg.optimizer.build(optimizer_context(cfg, schedules))


def _query_heads(cfg: Config) -> Optional[int]:
  """The query head count ``optimizer.per_head`` splits attention projections by: the model
  family's attention layout (None without ``per_head``)."""
  if not cfg.optimizer.per_head:
    return None
  model = model_of(cfg)
  model.require("attention layout", "optimizer.per_head")
  return model.attention_heads().num_heads


def parameter_learning_rates(cfg: Config, schedules: Optional[Schedules] = None
                             ) -> Callable[[Any], Any]:
  """``params -> pytree of schedules``: the learning rate `main_optimizer(cfg)` multiplies each
  parameter's update by (AdamW: one schedule; Muon: its group's, from `stablejax.label_params`,
  the routing `outlier_safe_muon` uses). The defences at ``Position.UPDATE`` that are stated
  before the learning rate divide by it (`DefenceContext.learning_rates`)."""
  by_group = (schedules or Schedules.of(cfg)).by_group

  def rates(params: optax.Params) -> Any:
    return jax.tree.map(lambda label: by_group[cfg.optimizer.group(label)], label_params(params))
  return rates


def build_optimizer(cfg: Config, main: optax.GradientTransformation | None = None, *,
                    update_scale: optax.GradientTransformation | None = None,
                    schedules: Optional[Schedules] = None
                    ) -> optax.GradientTransformationExtraArgs:
  """The full chain; `main` is `main_optimizer(cfg)` when the caller already built it.

  The enabled defences of ``cfg.stability`` (:mod:`stablejax.transforms.defence`) in their
  positions around the optimizer and the learning-rate scale that the recovery backs off
  (``update_scale``: that scale, by default `optax.inject_hyperparams(optax.scale)(1.0)`; a caller
  that multiplies every rate by a factor of its own chains it there, after the ``UPDATE``
  defences, which are stated before the learning rate).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from stablejax.training.config import load_config
    >>> from stablejax.training.optim import build_optimizer, get_lr_scale
    >>> cfg = load_config(None, ["optimizer.name=adamw", "train.steps=10",
    ...                          "train.warmup_steps=2"])
    >>> tx = build_optimizer(cfg)
    >>> params = {"w": jnp.ones((4, 4))}
    >>> state = jax.jit(tx.init)(params)
    >>> grads = {"w": jnp.full((4, 4), 0.1)}
    >>> # the spike skip watches the loss: the train step passes it as an extra argument
    >>> update = jax.jit(tx.update)
    >>> updates, state = update(grads, state, params, loss=jnp.float32(3.0))
    >>> float(jnp.abs(updates["w"]).max())  # the warmup starts at a learning rate of 0
    0.0
    >>> updates, state = update(grads, state, params, loss=jnp.float32(3.0))
    >>> bool(jnp.all(updates["w"] < 0)), float(get_lr_scale(state))
    (True, 1.0)
  """
  return defence.build_chain(
      cfg.stability, main if main is not None else main_optimizer(cfg, schedules),
      optimizer_name=cfg.optimizer.name,
      update_scale=(update_scale if update_scale is not None
                    else optax.inject_hyperparams(optax.scale)(step_size=1.0)),
      ctx=defence_context(cfg, schedules))


def defence_context(cfg: Config, schedules: Optional[Schedules] = None
                    ) -> defence.DefenceContext:
  """What the defences' builders read: the stability section, the model, the learning rates,
  the matrices (the Muon routing's, whichever optimizer runs) and the optimizer section."""
  return defence.DefenceContext(stability=cfg.stability, model=model_of(cfg),
                                learning_rates=parameter_learning_rates(cfg, schedules),
                                matrices=muon_dimension_numbers, optimizer=cfg.optimizer)


def step_arguments(cfg: Config) -> frozenset[str]:
  """The extra ``update`` arguments the configured defences need (``loss``, ``max_logits``)."""
  return defence.step_args(cfg.stability)


_INJECT_STATES = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)


def _is_lr_scale_state(node: Any) -> bool:
  return isinstance(node, _INJECT_STATES) and "step_size" in node.hyperparams


def _lr_scale_states(opt_state: optax.OptState) -> list:
  nodes = jax.tree.leaves(opt_state, is_leaf=_is_lr_scale_state)
  found = [node for node in nodes if _is_lr_scale_state(node)]
  if len(found) != 1:
    raise ValueError(f"expected one learning-rate scale in the optimizer state, found {len(found)}")
  return found


def _map_lr_scale(opt_state: optax.OptState, fn: Callable[[jax.Array], jax.Array]) -> Any:
  def visit(node: Any) -> Any:
    if _is_lr_scale_state(node):
      hyper = dict(node.hyperparams, step_size=fn(node.hyperparams["step_size"]))
      return node._replace(hyperparams=hyper)
    return node
  return jax.tree.map(visit, opt_state, is_leaf=_is_lr_scale_state)


def get_lr_scale(opt_state: optax.OptState) -> jax.Array:
  return _lr_scale_states(opt_state)[0].hyperparams["step_size"]


def applied_updates(opt_state: optax.OptState) -> jax.Array:
  """Updates applied so far (skipped steps excluded): the count the learning-rate schedules see.

  Read from the `lr_scale` state, which sits inside the skip wrappers like the schedules.
  """
  return _lr_scale_states(opt_state)[0].count


def set_lr_scale(opt_state: optax.OptState, value: float | jax.Array) -> Any:
  return _map_lr_scale(opt_state, lambda x: jnp.asarray(value, x.dtype))
