"""The optimizer from the config: the stablejax chain around Muon or AdamW, with optax schedules.

Default shape (every layer switchable in `stability`):

    skip_nonfinite(skip_spikes(chain(hybrid_clip, outlier_safe_muon | adamw, lr_scale)))

`lr_scale` is `optax.inject_hyperparams(optax.scale)`, a multiplier on the final update (so it
scales decoupled weight decay too, like a learning rate). It lives in the optimizer state, so the
recovery's learning-rate backoff is saved in and restored from checkpoints with everything else.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

import stablejax
from stablejax.training.config import Config


def lr_schedule(cfg: Config, peak: float) -> optax.Schedule:
  """Linear warmup from 0 to `peak`, cosine decay to `peak * min_lr_ratio` at the last step."""
  t = cfg.train
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=peak, warmup_steps=t.warmup_steps,
      decay_steps=t.steps, end_value=peak * t.min_lr_ratio)


def _maybe_schedule(cfg: Config, peak: float | None):
  return None if peak is None else lr_schedule(cfg, peak)


def main_optimizer(cfg: Config) -> optax.GradientTransformation:
  o = cfg.optimizer
  if o.name == "adamw":
    return optax.adamw(lr_schedule(cfg, o.learning_rate), b1=o.b1, b2=o.b2, eps=o.eps,
                       weight_decay=o.adam_weight_decay)
  return stablejax.outlier_safe_muon(
      learning_rate=lr_schedule(cfg, o.learning_rate),
      momentum=o.momentum,
      ns_steps=o.ns_steps,
      ns_coeffs=o.ns_coeffs,
      weight_decay=o.weight_decay,
      consistent_rms=o.consistent_rms,
      adam_learning_rate=_maybe_schedule(cfg, o.adam_learning_rate),
      embedding_learning_rate=_maybe_schedule(cfg, o.embedding_learning_rate),
      head_learning_rate=_maybe_schedule(cfg, o.head_learning_rate),
      adam_b1=o.b1,
      adam_b2=o.b2,
      adam_eps=o.eps,
      adam_weight_decay=o.adam_weight_decay,
      outlier_threshold=o.outlier_threshold,
      outlier_method=o.outlier_method,
      ns_backend=o.ns_backend,
  )


def clipping(cfg: Config) -> list[optax.GradientTransformation]:
  s = cfg.stability
  zclip_args = dict(alpha=s.zclip_alpha, z_thresh=s.z_thresh, max_grad_norm=s.max_grad_norm,
                    warmup_steps=s.zclip_warmup_steps)
  adagc_args = dict(beta=s.adagc_beta, lambda_rel=s.adagc_lambda_rel,
                    lambda_abs=s.adagc_lambda_abs, warmup_steps=s.adagc_warmup_steps)
  if s.zclip and s.adagc:
    return [stablejax.hybrid_clip(**{f"zclip_{k}": v for k, v in zclip_args.items()},
                                  **{f"adagc_{k}": v for k, v in adagc_args.items()})]
  if s.zclip:
    return [stablejax.zclip(**zclip_args)]
  if s.adagc:
    return [stablejax.adagc(**adagc_args)]
  if s.max_grad_norm is not None:
    return [optax.clip_by_global_norm(s.max_grad_norm)]
  return []


def build_optimizer(cfg: Config, main: optax.GradientTransformation | None = None
                    ) -> optax.GradientTransformationExtraArgs:
  """The full chain; `main` is `main_optimizer(cfg)` when the caller already built it."""
  s = cfg.stability
  tx = optax.chain(
      *clipping(cfg),
      main if main is not None else main_optimizer(cfg),
      optax.inject_hyperparams(optax.scale)(step_size=1.0),
  )
  if s.skip_spikes:
    tx = stablejax.skip_spikes(
        tx, window=s.spike_window, min_history=s.spike_min_history, sigma=s.spike_sigma,
        factor=s.spike_factor, max_consecutive=s.max_consecutive_skips)
  if s.skip_nonfinite:
    tx = stablejax.skip_nonfinite(tx, max_consecutive=s.max_consecutive_skips)
  return optax.with_extra_args_support(tx)


_INJECT_STATES = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)


def _is_lr_scale_state(node: Any) -> bool:
  return isinstance(node, _INJECT_STATES) and "step_size" in node.hyperparams


def _map_lr_scale(opt_state, fn: Callable[[jax.Array], jax.Array]):
  def visit(node):
    if _is_lr_scale_state(node):
      hyper = dict(node.hyperparams, step_size=fn(node.hyperparams["step_size"]))
      return node._replace(hyperparams=hyper)
    return node
  return jax.tree.map(visit, opt_state, is_leaf=_is_lr_scale_state)


def get_lr_scale(opt_state) -> jax.Array:
  found = []
  _map_lr_scale(opt_state, lambda x: found.append(x) or x)
  if len(found) != 1:
    raise ValueError(f"expected one learning-rate scale in the optimizer state, found {len(found)}")
  return found[0]


def set_lr_scale(opt_state, value: float):
  return _map_lr_scale(opt_state, lambda x: jnp.asarray(value, x.dtype))


def learning_rates(cfg: Config) -> dict[str, float]:
  """Peak learning rates by parameter group, for the banner and the sanity check."""
  o = cfg.optimizer
  if o.name == "adamw":
    return {"adamw": o.learning_rate}
  return {"muon": o.learning_rate, "adam": o.adam_learning_rate,
          "embedding": o.embedding_learning_rate, "head": o.head_learning_rate}
