"""The pure training and evaluation steps.

`train_step(state, batch) -> (state, metrics)` does gradient accumulation inside (so the stability
transforms see the accumulated gradient), optional fp16 loss scaling, and fault injection through
`batch["grad_scale"]` (1 normally; NaN or a large factor when a fault is configured for the step).
Metrics stay on device; the loop fetches them every `log_every` steps, one step late.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax

from stablejax.modeling.attention import collect_attention_logits
from stablejax.modeling.gpt import layer_max_logits
from stablejax.modeling.losses import cross_entropy_with_z_loss
from stablejax.monitor.layers import global_and_layer_norms
from stablejax.training.config import Config
from stablejax.training.optim import applied_updates, get_lr_scale, set_lr_scale, step_arguments
from stablejax.training.recovery import backoff_lr_scale
from stablejax.transforms.loss_scaling import all_finite
from stablejax.transforms.metrics import stability_metrics


class TrainState(flax.struct.PyTreeNode):
  step: jax.Array                  # int32 optimizer steps taken (applied or skipped)
  params: Any                      # float32 unless model.param_dtype says otherwise
  opt_state: Any
  loss_scale: Optional[Any] = None  # stablejax.DynamicLossScale in fp16 mode, else None
  # recovery.LRBackoff of the latest rollback (None: LR scale untouched)
  lr_backoff: Optional[Any] = None


LossFn = Callable[[Any, jax.Array, Any], tuple[jax.Array, dict[str, Any]]]


def make_loss_fn(model: nn.Module, cfg: Config, max_logits: bool = False) -> LossFn:
  """`(params, tokens, lambda) -> (loss, aux)`; with `max_logits`, `aux["max_logits"]` holds
  each attention layer's per-head max pre-softmax logit of this forward pass
  (`{layer name: [*stack, H]}`, what `stablejax.qk_clip` takes)."""
  def loss_fn(params: Any, tokens: jax.Array,
              bitnet_lambda: Any) -> tuple[jax.Array, dict[str, Any]]:
    kwargs = {"bitnet_lambda": bitnet_lambda} if cfg.model.bitnet else {}
    if max_logits:
      logits, sown = model.apply({"params": params}, tokens[:, :-1], attention_logits=True,
                                 mutable=["intermediates"], **kwargs)
    else:
      logits = model.apply({"params": params}, tokens[:, :-1], **kwargs)
    loss, aux = cross_entropy_with_z_loss(logits, tokens[:, 1:],
                                                    z_loss=cfg.stability.z_loss)
    out: dict[str, Any] = dict(aux)
    if max_logits:
      out["max_logits"] = collect_attention_logits(sown)
    return loss, out
  return loss_fn


# The extra `update` arguments the train step can supply, and whether each costs work: a
# defence asks for them in its declaration (stablejax.transforms.defence.Defence.step_args).
STEP_ARGS = {
    "loss": "the step's mean loss (always passed: it is computed anyway)",
    "max_logits": "each attention layer's per-head max pre-softmax logit of this step's forward "
                  "pass ({layer name: [*stack, H]}, the max over micro-batches)",
}


def _check_step_args(needed: frozenset[str]) -> None:
  unknown = sorted(needed - set(STEP_ARGS))
  if unknown:
    raise ValueError(f"a configured defence needs the step argument(s) {', '.join(unknown)}, "
                     f"which the train step does not compute (it passes {', '.join(STEP_ARGS)})")


def _accumulate(loss_fn: LossFn, params: Any, tokens: jax.Array, lam: jax.Array,
                scale: Optional[jax.Array], want_logits: bool
                ) -> tuple[Any, jax.Array, jax.Array, Any]:
  """Gradients of the mean loss over the micro-batches ``tokens[i]`` (``[grad_accum,
  micro_batch, T + 1]``), one micro-batch live at a time (``lax.scan``); the loss scaled by
  ``scale`` (fp16) before differentiation. Returns (summed grads in float32, summed loss, summed
  z-loss, per-head max logits over the micro-batches or None)."""
  def micro_grads(micro: jax.Array) -> tuple[Any, jax.Array, dict[str, Any]]:
    def scaled(p: Any) -> tuple[jax.Array, tuple[jax.Array, dict[str, Any]]]:
      loss, aux = loss_fn(p, micro, lam)
      return (loss * scale if scale is not None else loss), (loss, aux)
    (_, (loss, aux)), grads = jax.value_and_grad(scaled, has_aux=True)(params)
    return grads, loss, aux

  def step(carry: tuple, micro: jax.Array) -> tuple[tuple, None]:
    grads, loss, aux = micro_grads(micro)
    total = jax.tree.map(lambda a, g: a + g.astype(a.dtype), carry[0], grads)
    peaks = jax.tree.map(jnp.maximum, carry[3], aux["max_logits"]) if want_logits else None
    return (total, carry[1] + loss, carry[2] + aux["z_loss"], peaks), None

  zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
  no_peaks = None
  if want_logits:
    shapes = jax.eval_shape(lambda p, t: loss_fn(p, t, lam)[1]["max_logits"], params, tokens[0])
    no_peaks = jax.tree.map(lambda s: jnp.full(s.shape, -jnp.inf, jnp.float32), shapes)
  (grads, loss, z_loss, max_logits), _ = jax.lax.scan(
      step, (zeros, jnp.float32(0), jnp.float32(0), no_peaks), tokens)
  return grads, loss, z_loss, max_logits


def _with_lr_backoff(opt_state: Any, state: "TrainState", cfg: Config) -> Any:
  """The optimizer state with the LR scale of a rollback's backoff at this step (on its way back
  to 1.0 over ``stability.recovery.lr_recovery_steps``); unchanged without a backoff."""
  if state.lr_backoff is None:
    return opt_state
  r = cfg.stability.recovery
  return set_lr_scale(opt_state, backoff_lr_scale(state.lr_backoff, state.step,
                                                  r.lr_recovery_steps, r.lr_recovery_schedule))


def update_norm_metrics(updates: Any) -> dict[str, jax.Array]:
  """``update_norm`` (the global L2 norm of the applied update, float32; 0 on a skipped step) and
  ``update_norm/layer_<i>`` per layer (`stablejax.monitor.layers.global_and_layer_norms`): the
  monitor's update-norm indicator reads them with the logged ``lr``."""
  total, layers = global_and_layer_norms(updates)
  return {"update_norm": total, **{f"update_norm/layer_{i}": n for i, n in layers.items()}}


def metrics_read(cfg: Config, step: jax.Array) -> jax.Array:
  """Whether the loop reads the metrics of the step that brings the count to ``step``: step 1,
  every ``train.log_every`` steps (`actions.Logging.due`), every ``checkpoint.every`` steps and
  the last (`actions.Checkpointing.due`: a save reads the step's health; a deferred save waits for
  a log step)."""
  t = cfg.train
  read = (step == 1) | (step % t.log_every == 0) | (step % cfg.checkpoint.every == 0)
  return read | (step == t.steps) if t.steps is not None else read


def make_train_step(model: nn.Module, tx: optax.GradientTransformationExtraArgs, cfg: Config,
                    lr_schedule: optax.Schedule,
                    bitnet_lambda: Optional[Callable[[jax.Array], jax.Array]] = None
                    ) -> Callable[[TrainState, dict], tuple[TrainState, dict]]:
  """``train_step(state, batch) -> (state, metrics)``: accumulated gradients, fp16 loss scaling,
  the configured faults (``batch["grad_scale"]``), the rollback's LR backoff, the update with the
  extra arguments the defences declared, and the step's metrics (on device).

  The update norms (``update_norm``, ``update_norm/layer_<i>``, a pass over the update) are
  computed on the steps whose metrics the loop reads (:func:`metrics_read`) and are NaN on the
  others; every other metric is computed on every step."""
  step_args = step_arguments(cfg) | {"loss"}
  _check_step_args(step_args)
  want_logits = "max_logits" in step_args  # decided once, from the declarations
  loss_fn = make_loss_fn(model, cfg, max_logits=want_logits)

  def train_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
    lam = bitnet_lambda(state.step) if bitnet_lambda is not None else jnp.float32(1.0)
    scale = state.loss_scale.loss_scale if state.loss_scale is not None else None
    grads, loss, z_loss, max_logits = _accumulate(loss_fn, state.params, batch["tokens"], lam,
                                                  scale, want_logits)
    n = batch["tokens"].shape[0]
    loss, z_loss = loss / n, z_loss / n
    grads = jax.tree.map(lambda g, p: (g / n).astype(p.dtype), grads, state.params)
    if state.loss_scale is not None:
      grads = state.loss_scale.unscale(grads)
    grads = jax.tree.map(lambda g: g * batch["grad_scale"].astype(g.dtype), grads)  # faults

    opt_state = _with_lr_backoff(state.opt_state, state, cfg)
    # The schedules count applied updates (a skipped step keeps their count), so the rate this
    # step applies is the schedule at that count, not at state.step (see training/optim.py).
    lr = lr_schedule(applied_updates(opt_state)) * get_lr_scale(opt_state)
    provided = {"loss": loss, "max_logits": max_logits}
    updates, opt_state = tx.update(grads, opt_state, state.params,
                                   **{name: provided[name] for name in step_args})
    params = optax.apply_updates(state.params, updates)
    loss_scale = state.loss_scale
    if loss_scale is not None:
      loss_scale = loss_scale.adjust(all_finite(grads))

    update_norms = jax.lax.cond(metrics_read(cfg, state.step + 1), update_norm_metrics,
                                _not_computed(update_norm_metrics), updates)
    metrics = {"loss": loss, "z_loss": z_loss, "grad_norm": optax.tree.norm(grads), "lr": lr,
               "lr_scale": get_lr_scale(opt_state), "params_finite": all_finite(params),
               **update_norms, **stability_metrics(opt_state)}
    if loss_scale is not None:
      metrics["loss_scale"] = loss_scale.loss_scale
    if bitnet_lambda is not None:
      metrics["lambda"] = lam
    new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state,
                              loss_scale=loss_scale)
    return new_state, metrics

  return train_step


def _not_computed(fn: Callable[[Any], dict]) -> Callable[[Any], dict]:
  """``fn``'s float outputs as NaN, without computing them (the other branch of a cond)."""
  def nans(x: Any) -> dict:
    return jax.tree.map(lambda s: jnp.full(s.shape, jnp.nan, s.dtype), jax.eval_shape(fn, x))
  return nans


def make_eval_step(model: nn.Module, cfg: Config,
                   bitnet_lambda: Optional[Callable[[jax.Array], jax.Array]] = None
                   ) -> Callable[[Any, jax.Array, jax.Array], jax.Array]:
  loss_fn = make_loss_fn(model, cfg)

  def eval_step(params: Any, tokens: jax.Array, step: jax.Array) -> jax.Array:
    lam = bitnet_lambda(step) if bitnet_lambda is not None else jnp.float32(1.0)
    _, aux = loss_fn(params, tokens, lam)
    return aux["cross_entropy"]

  return eval_step


def make_logit_telemetry(model: nn.Module, cfg: Config,
                         bitnet_lambda: Optional[Callable[[jax.Array], jax.Array]] = None
                         ) -> Callable[[Any, jax.Array, jax.Array], dict[str, jax.Array]]:
  """`(params, tokens, step) -> metrics`: attention-logit growth and output-logit statistics.

  Wortsman et al. (arXiv 2309.14322) sections 3.1.1 and 3.1.2: one forward pass of the first
  `logging.attention_sequences` sequences of a batch (`tokens`: `[grad_accum, micro_batch,
  T + 1]`) gives each layer's maximum pre-softmax attention logit (`attn_logit_max/layer_<i>`,
  their maximum `attn_logit_max`, per head with `logging.attention_per_head`) and the output
  logits' maximum and mean and maximum log Z. The loop calls it at log steps, so the train step
  itself is untouched.
  """
  lg = cfg.logging

  def telemetry(params: Any, tokens: jax.Array, step: jax.Array) -> dict[str, jax.Array]:
    rows = tokens[0, :min(lg.attention_sequences, tokens.shape[1])]
    kwargs: dict[str, Any] = {}
    if cfg.model.bitnet:
      kwargs["bitnet_lambda"] = bitnet_lambda(step) if bitnet_lambda is not None else 1.0
    logits, sown = model.apply({"params": params}, rows[:, :-1], attention_logits=True,
                               mutable=["intermediates"], **kwargs)
    per_head = layer_max_logits(cfg.model, collect_attention_logits(sown))  # [L, H]
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
