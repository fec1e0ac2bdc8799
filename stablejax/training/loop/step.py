"""The pure training and evaluation steps.

`train_step(state, batch) -> (state, metrics)` does gradient accumulation inside (so the stability
transforms see the accumulated gradient), optional fp16 loss scaling, and fault injection through
`batch["grad_scale"]` (1 normally; NaN or a large factor when a fault is configured for the step).
`batch["run_steps"]` is the run's length (an int32 scalar): the schedules decay over it, so one
compiled step serves any `train.steps`. `batch["read_metrics"]` (a bool scalar, from
:func:`metrics_read` on the host) says whether the loop reads this step's metrics, so when it logs
and saves (`train.log_every`, `checkpoint.every`) is not compiled in either. Metrics stay on
device; the loop fetches them every `log_every` steps, one step late.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import flax.struct
import jax
import jax.numpy as jnp
import optax

from stablejax.modeling.family import LanguageModel
from stablejax.modeling.losses import cross_entropy_with_z_loss
from stablejax.monitor.layers import global_and_layer_norms
from stablejax.training.config import Config
from stablejax.training.optim import (applied_updates, get_lr_scale, run_steps, set_lr_scale,
                                      step_arguments)
from stablejax.training.recovery.policy import LRBackoff, backoff_lr_scale
from stablejax.transforms import defence
from stablejax.transforms.loss_scaling import DynamicLossScale, all_finite
from stablejax.transforms.metrics import stability_metrics


class TrainState(flax.struct.PyTreeNode):
  step: jax.Array                  # int32 optimizer steps taken (applied or skipped)
  params: optax.Params                      # float32 unless model.param_dtype says otherwise
  opt_state: optax.OptState
  loss_scale: Optional[DynamicLossScale] = None  # fp16 mode only
  # The latest rollback's or re-warmup's backoff (None: LR scale untouched)
  lr_backoff: Optional[LRBackoff] = None
  # int32 [devices], sharded like the batch rows: on each device, the steps whose loss on that
  # device's rows was non-finite (read when a failure is replayed, to name the device; None: off)
  device_faults: Optional[jax.Array] = None


LossFn = Callable[[Any, jax.Array, Any], tuple[jax.Array, defence.ForwardPass]]


def make_loss_fn(model: LanguageModel, cfg: Config, needs: frozenset[str] = frozenset()
                 ) -> LossFn:
  """``(params, tokens, step) -> (loss, forward)``: the mean cross-entropy plus z-loss of
  ``tokens`` ``[B, T + 1]`` (inputs ``[:, :-1]``, targets ``[:, 1:]``), and the forward pass
  (:class:`stablejax.transforms.defence.ForwardPass`: ``loss``, ``cross_entropy``, ``z_loss``,
  ``logits``, ``targets``, and ``attention_logits`` when ``needs`` has it)."""
  attention = "attention_logits" in needs

  def loss_fn(params: optax.Params, tokens: jax.Array, step: jax.typing.ArrayLike
              ) -> tuple[jax.Array, defence.ForwardPass]:
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    out: defence.ForwardPass = {"targets": targets}
    if attention:
      logits, out["attention_logits"] = model.logits_and_attention(params, inputs, step)
    else:
      logits = model.logits(params, inputs, step)
    loss, aux = cross_entropy_with_z_loss(logits, targets, z_loss=cfg.stability.z_loss)
    out.update(aux, loss=loss, logits=logits)
    return loss, out
  return loss_fn


def step_argument_specs(cfg: Config, model: LanguageModel) -> list[defence.StepArgument]:
  """The extra ``update`` arguments the configured defences need (``loss`` always), resolved from
  the registry; a model family that cannot give what one needs is refused here, naming it."""
  args = [defence.step_argument(name) for name in sorted(step_arguments(cfg) | {"loss"})]
  for arg in args:
    if "attention_logits" in arg.needs:
      asking = [d.name for d in defence.enabled(cfg.stability) if arg.name in d.step_args]
      model.require("attention logits", f"the step argument {arg.name} (for "
                    f"{', '.join(f'stability.{n}' for n in asking)})")
  return args


def _accumulate(loss_fn: LossFn, params: optax.Params, tokens: jax.Array, step: jax.Array,
                scale: Optional[jax.Array], args: list[defence.StepArgument], unroll: bool = False
                ) -> tuple[Any, jax.Array, jax.Array, dict[str, Any], jax.Array]:
  """Gradients of the mean loss over the micro-batches ``tokens[i]`` (``[grad_accum,
  micro_batch, T + 1]``), one micro-batch live at a time (``lax.scan``, as straight-line code
  when ``unroll``); the loss scaled by ``scale`` (fp16) before differentiation. Returns (summed
  grads in float32, summed loss, summed z-loss, the step arguments combined over the
  micro-batches, bool ``[micro_batch]``: rows whose loss was non-finite in any micro-batch)."""
  def micro_grads(micro: jax.Array) -> tuple[Any, jax.Array, defence.ForwardPass]:
    def scaled(p: Any) -> tuple[jax.Array, tuple[jax.Array, defence.ForwardPass]]:
      loss, forward = loss_fn(p, micro, step)
      return (loss * scale if scale is not None else loss), (loss, forward)
    (_, (loss, forward)), grads = jax.value_and_grad(scaled, has_aux=True)(params)
    return grads, loss, forward

  def values(forward: defence.ForwardPass) -> dict[str, Any]:
    return {arg.name: jax.lax.stop_gradient(arg.compute(forward)) for arg in args}

  def start(shapes: dict[str, Any]) -> tuple:
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    identities = {arg.name: arg.identity(shapes[arg.name]) for arg in args}
    return (zeros, jnp.float32(0), jnp.float32(0), identities, jnp.zeros(tokens.shape[1], bool))

  def body(carry: Optional[tuple], micro: jax.Array) -> tuple[tuple, None]:
    grads, loss, forward = micro_grads(micro)
    new = values(forward)
    if carry is None:  # the only micro-batch: the identities are shaped like its values
      carry = start(jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), new))
    total = jax.tree.map(lambda a, g: a + g.astype(a.dtype), carry[0], grads)
    combined = {arg.name: arg.combine(carry[3][arg.name], new[arg.name]) for arg in args}
    bad_rows = carry[4] | jnp.any(~jnp.isfinite(forward["token_loss"]), axis=-1)
    return (total, carry[1] + loss, carry[2] + forward["z_loss"], combined, bad_rows), None

  n = tokens.shape[0]
  if n == 1:
    # One micro-batch needs no loop, nor a separate trace of the forward pass for the shapes of
    # the scan's carry (a fifth of the train step's tracing): the same operations, once.
    (grads, loss, z_loss, combined, bad_rows), _ = body(None, tokens[0])
  else:
    shapes = jax.eval_shape(lambda p, t: values(loss_fn(p, t, step)[1]), params, tokens[0])
    (grads, loss, z_loss, combined, bad_rows), _ = jax.lax.scan(
        body, start(shapes), tokens, unroll=unroll)
  provided = {arg.name: arg.finish(combined[arg.name], n) for arg in args}
  return grads, loss, z_loss, provided, bad_rows


def _with_lr_backoff(opt_state: optax.OptState, state: "TrainState", cfg: Config) -> Any:
  """The optimizer state with the LR scale of a rollback's backoff at this step (on its way back
  to 1.0 over ``stability.recovery.lr_recovery_steps``); unchanged without a backoff."""
  if state.lr_backoff is None:
    return opt_state
  r = cfg.stability.recovery
  return set_lr_scale(opt_state, backoff_lr_scale(state.lr_backoff, state.step,
                                                  r.lr_recovery_steps, r.lr_recovery_schedule))


def update_norm_metrics(updates: optax.Updates) -> dict[str, jax.Array]:
  """``update_norm`` (the global L2 norm of the applied update, float32; 0 on a skipped step) and
  ``update_norm/layer_<i>`` per layer (`stablejax.monitor.layers.global_and_layer_norms`): the
  monitor's update-norm indicator reads them with the logged ``lr``."""
  total, layers = global_and_layer_norms(updates)
  return {"update_norm": total, **{f"update_norm/layer_{i}": n for i, n in layers.items()}}


def metrics_read(cfg: Config, step: int, steps: Optional[int] = None) -> bool:
  """Whether the loop reads the metrics of the step that brings the count to ``step``: step 1,
  every ``train.log_every`` steps (`actions.Logging.due`), every ``checkpoint.every`` steps and
  the last (`actions.Checkpointing.due`: a save reads the step's health; a deferred save waits for
  a log step). Evaluated on the host, with Python ints (``steps``: the run's length, default
  ``train.steps``), for the batch's ``read_metrics``."""
  t = cfg.train
  steps = t.steps if steps is None else steps
  return (step == 1 or step % t.log_every == 0 or step % cfg.checkpoint.every == 0
          or step == steps)


def make_train_step(model: LanguageModel, tx: optax.GradientTransformationExtraArgs, cfg: Config,
                    lr_schedule: optax.Schedule
                    ) -> Callable[[TrainState, dict], tuple[TrainState, dict]]:
  """``train_step(state, batch) -> (state, metrics)``: accumulated gradients, fp16 loss scaling,
  the configured faults (``batch["grad_scale"]``), the rollback's LR backoff, the update with the
  extra arguments the defences declared, and the step's metrics (on device). The schedules decay
  over ``batch["run_steps"]`` (:func:`stablejax.training.optim.run_steps`).

  The update norms (``update_norm``, ``update_norm/layer_<i>``, a pass over the update) are
  computed on the steps whose metrics the loop reads (``batch["read_metrics"]``, from
  :func:`metrics_read`) and are NaN on the others; every other metric is computed on every
  step. On XLA:CPU with several devices the norms are computed on every step and masked, and the
  micro-batch loop is unrolled, since a collective in control flow can run out of order there
  (:func:`control_flow_collectives_ordered`)."""
  args = step_argument_specs(cfg, model)  # decided once, from the declarations
  loss_fn = make_loss_fn(model, cfg, frozenset().union(*(arg.needs for arg in args)))

  def train_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
    scale = state.loss_scale.loss_scale if state.loss_scale is not None else None
    ordered = control_flow_collectives_ordered()
    grads, loss, z_loss, provided, bad_rows = _accumulate(
        loss_fn, state.params, batch["tokens"], state.step, scale, args, unroll=not ordered)
    n = batch["tokens"].shape[0]
    loss, z_loss = loss / n, z_loss / n
    grads = jax.tree.map(lambda g, p: (g / n).astype(p.dtype), grads, state.params)
    if state.loss_scale is not None:
      grads = state.loss_scale.unscale(grads)
    grads = jax.tree.map(lambda g: g * batch["grad_scale"].astype(g.dtype), grads)  # faults

    opt_state = _with_lr_backoff(state.opt_state, state, cfg)
    with run_steps(batch["run_steps"]):  # the schedules decay over the run's length
      # The schedules count applied updates (a skipped step keeps their count), so the rate this
      # step applies is the schedule at that count, not at state.step (see training/optim.py).
      lr = lr_schedule(applied_updates(opt_state)) * get_lr_scale(opt_state)
      updates, opt_state = tx.update(grads, opt_state, state.params, **provided)
    params = optax.apply_updates(state.params, updates)
    loss_scale = state.loss_scale
    if loss_scale is not None:
      loss_scale = loss_scale.adjust(all_finite(grads))

    read = batch["read_metrics"]
    if ordered:
      update_norms = jax.lax.cond(read, update_norm_metrics, _not_computed(update_norm_metrics),
                                  updates)
    else:  # the same values, computed on every step (see control_flow_collectives_ordered)
      update_norms = jax.tree.map(lambda v: jnp.where(read, v, jnp.nan),
                                  update_norm_metrics(updates))
    metrics = {"loss": loss, "z_loss": z_loss, "grad_norm": optax.tree.norm(grads), "lr": lr,
               "lr_scale": get_lr_scale(opt_state), "params_finite": all_finite(params),
               **update_norms, **stability_metrics(opt_state),
               **model.step_metrics(state.step)}
    if loss_scale is not None:
      metrics["loss_scale"] = loss_scale.loss_scale
    new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state,
                              loss_scale=loss_scale,
                              device_faults=count_device_faults(state.device_faults, bad_rows))
    return new_state, metrics

  return train_step


def count_device_faults(counts: Optional[jax.Array], bad_rows: jax.Array
                        ) -> Optional[jax.Array]:
  """``counts`` (int32 ``[devices]``, sharded like the rows) plus one on each device whose rows
  (``bad_rows``, bool ``[rows]``, that device's block of rows) had a non-finite loss. Each device
  counts its own rows: nothing crosses devices."""
  if counts is None:
    return None
  per_device = jnp.any(bad_rows.reshape(counts.shape[0], -1), axis=1)
  return counts + per_device.astype(counts.dtype)


def control_flow_collectives_ordered() -> bool:
  """Whether a collective inside a conditional or a loop keeps its place among the step's
  collectives.

  Not on XLA:CPU with more than one device. Its thunk runtime orders the collectives of a program
  only by when each *starts*; a conditional or a while loop starts its body and counts as
  started, so a collective in the body can still be running when a later collective starts, and
  the two can meet the other devices in the other order. Across processes (gloo) that deadlocks:
  a job of two processes with two devices each, whose step had the update norms' all-reduce
  inside a conditional, hung at a log step with one process's devices in all-reduces and the
  other's already in the next program's all-gather. GPU and TPU run collectives in stream order.
  Where this is False the train step puts no collective in control flow: the update norms are
  computed on every step and masked, and the micro-batch loop is unrolled
  (tests/test_multiprocess.py checks the compiled step).
  """
  return not (jax.default_backend() == "cpu" and jax.device_count() > 1)


def _not_computed(fn: Callable[[Any], dict]) -> Callable[[Any], dict]:
  """``fn``'s float outputs as NaN, without computing them (the other branch of a cond)."""
  def nans(x: Any) -> dict:
    return jax.tree.map(lambda s: jnp.full(s.shape, jnp.nan, s.dtype), jax.eval_shape(fn, x))
  return nans


def make_gradient_check(model: LanguageModel, cfg: Config
                        ) -> Callable[[Any, dict, jax.Array], dict[str, jax.Array]]:
  """``(params, batch, step) -> {"loss", "grad_norm"}``: the train step's forward and backward
  (accumulated over the micro-batches, the batch's fault factor applied), without the update.
  ``stability.determinism`` runs it twice on the same inputs: two executions of one program that
  should agree bit for bit."""
  loss_fn = make_loss_fn(model, cfg)

  def check(params: optax.Params, batch: dict, step: jax.Array) -> dict[str, jax.Array]:
    grads, loss, _, _, _ = _accumulate(loss_fn, params, batch["tokens"], step, None, [],
                                       unroll=not control_flow_collectives_ordered())
    n = batch["tokens"].shape[0]
    grads = jax.tree.map(lambda g: g / n * batch["grad_scale"].astype(g.dtype), grads)
    return {"loss": loss / n, "grad_norm": optax.tree.norm(grads)}

  return check


def make_eval_step(model: LanguageModel, cfg: Config
                   ) -> Callable[[Any, jax.Array, jax.Array], jax.Array]:
  """``(params, tokens, step) -> cross-entropy`` of ``tokens`` ``[B, T + 1]``."""
  loss_fn = make_loss_fn(model, cfg)

  def eval_step(params: optax.Params, tokens: jax.Array, step: jax.Array) -> jax.Array:
    _, forward = loss_fn(params, tokens, step)
    return forward["cross_entropy"]

  return eval_step


def make_logit_telemetry(model: LanguageModel, cfg: Config
                         ) -> Callable[[Any, jax.Array, jax.Array], dict[str, jax.Array]]:
  """`(params, tokens, step) -> metrics`: attention-logit growth and output-logit statistics.

  Wortsman et al. (arXiv 2309.14322) sections 3.1.1 and 3.1.2: one forward pass of the first
  `logging.attention_sequences` sequences of a batch (`tokens`: `[grad_accum, micro_batch,
  T + 1]`) gives each layer's maximum pre-softmax attention logit (`attn_logit_max/layer_<i>`,
  their maximum `attn_logit_max`, per head with `logging.attention_per_head`) and the output
  logits' maximum and mean and maximum log Z. The loop calls it at log steps, so the train step
  itself is untouched. Needs the model family's attention logits.
  """
  lg = cfg.logging

  def telemetry(params: optax.Params, tokens: jax.Array, step: jax.Array) -> dict[str, jax.Array]:
    rows = tokens[0, :min(lg.attention_sequences, tokens.shape[1])]
    logits, collected = model.logits_and_attention(params, rows[:, :-1], step)
    per_head = model.layer_max_logits(collected)  # [L, H]
    log_z = jax.nn.logsumexp(logits, axis=-1)
    out = {"attn_logit_max": jnp.max(per_head), "output_logit_max": jnp.max(logits),
           "output_log_z_mean": jnp.mean(log_z), "output_log_z_max": jnp.max(log_z)}
    for i in range(per_head.shape[0]):
      out[f"attn_logit_max/layer_{i}"] = jnp.max(per_head[i])
      if lg.attention_per_head:
        for h in range(per_head.shape[1]):
          out[f"attn_logit_max/layer_{i}/head_{h}"] = per_head[i, h]
    return out

  return telemetry
