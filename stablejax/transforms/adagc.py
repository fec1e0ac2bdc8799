"""AdaGC: adaptive per-tensor gradient clipping against an EMA of clipped norms.

Wang et al., "AdaGC: Improving Training Stability for Large Language Model
Pretraining", arXiv:2502.11034.

For each parameter tensor ``i`` (each leaf of the gradient pytree):

* during the first ``warmup_steps`` steps the gradients are clipped globally,
  ``h = min(1, lambda_abs / ||g||)``, and ``gamma_i = min(gamma_i, ||g_hat_i||)``
  (``gamma_i`` starts at ``+inf``);
* afterwards ``h_i = min(1, lambda_rel * gamma_i / ||g_i||)``,
  ``g_hat_i = h_i * g_i`` and ``gamma_i = beta * gamma_i + (1 - beta) * ||g_hat_i||``.

Norms and ``gamma`` are float32; clipped gradients keep their dtype. A step
whose global gradient norm is not finite leaves ``gamma`` and the step count
untouched (the statistics never absorb NaN/Inf, even without
:func:`stablejax.skip_nonfinite`); the updates of such a step are not repaired.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
import optax.tree

from stablejax.transforms import _common


class AdaGCState(NamedTuple):
  """State of :func:`adagc`.

  Attributes:
    count: number of steps with a finite global norm seen so far (int32).
    gamma: pytree like the parameters with one float32 scalar per tensor: the
      EMA of that tensor's clipped gradient norm (``+inf`` before the first
      step).
    clipped_fraction: fraction of tensors scaled down at the last step.
    grad_norm: global gradient norm before AdaGC, last step.
    clipped_grad_norm: global gradient norm after AdaGC, last step.
  """

  count: jax.Array
  gamma: Any
  clipped_fraction: jax.Array
  grad_norm: jax.Array
  clipped_grad_norm: jax.Array


def _validate(beta, lambda_rel, lambda_abs, warmup_steps):
  _common.check("beta", beta, lambda v: 0.0 <= v < 1.0,
                "use an EMA factor in [0, 1), e.g. 0.98")
  _common.check("lambda_rel", lambda_rel, lambda v: v > 0,
                "use a positive relative threshold, e.g. 1.05")
  _common.check("lambda_abs", lambda_abs, lambda v: v > 0,
                "use a positive absolute (warmup) threshold, e.g. 1.0")
  _common.check("warmup_steps", warmup_steps,
                lambda v: v >= 1 and float(v).is_integer(),
                "use an integer >= 1 (gamma is initialised during warmup)")


def adagc(
    beta: float = 0.98,
    lambda_rel: float = 1.05,
    lambda_abs: float = 1.0,
    warmup_steps: int = 100,
) -> optax.GradientTransformation:
  """AdaGC adaptive per-tensor gradient clipping.

  Each parameter tensor gets its own threshold ``lambda_rel * gamma_i``, where
  ``gamma_i`` is an EMA of that tensor's past *clipped* gradient norms; during
  warmup the gradients are clipped globally to ``lambda_abs`` and ``gamma_i``
  is initialised to the smallest clipped norm seen.

  Args:
    beta: EMA factor of ``gamma``.
    lambda_rel: relative threshold: a tensor is clipped to ``lambda_rel``
      times its ``gamma``.
    lambda_abs: global-norm clip used during warmup.
    warmup_steps: number of (finite) steps of global clipping.

  Returns:
    An :class:`optax.GradientTransformation` whose state is an
    :class:`AdaGCState`.

  References:
    Wang et al., `AdaGC: Improving Training Stability for Large Language Model
    Pretraining <https://arxiv.org/abs/2502.11034>`_, 2025 (arXiv:2502.11034).

  Example:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import stablejax
    >>> tx = optax.chain(stablejax.adagc(warmup_steps=10), optax.sgd(0.1))
    >>> params = {"w": jnp.ones(4), "b": jnp.zeros(2)}
    >>> state = tx.init(params)
    >>> grads = {"w": jnp.full(4, 3.0), "b": jnp.ones(2)}
    >>> updates, state = tx.update(grads, state, params)
    >>> round(float(state[0].clipped_grad_norm), 4)
    1.0
  """
  _validate(beta, lambda_rel, lambda_abs, warmup_steps)

  def init_fn(params):
    return AdaGCState(
        count=jnp.zeros([], jnp.int32),
        gamma=jax.tree.map(
            lambda _: jnp.array(jnp.inf, _common.STAT_DTYPE), params),
        clipped_fraction=jnp.zeros([], _common.STAT_DTYPE),
        grad_norm=jnp.zeros([], _common.STAT_DTYPE),
        clipped_grad_norm=jnp.zeros([], _common.STAT_DTYPE),
    )

  def update_fn(updates, state, params=None):
    del params
    b = _common.f32(beta)
    l_rel = _common.f32(lambda_rel)
    l_abs = _common.f32(lambda_abs)

    leaves, treedef = jax.tree.flatten(updates)
    gammas = treedef.flatten_up_to(state.gamma)
    norms = [_common.leaf_norm_f32(u) for u in leaves]
    g = optax.tree.norm(norms).astype(_common.STAT_DTYPE)
    finite = jnp.isfinite(g)
    in_warmup = state.count < jnp.asarray(warmup_steps, jnp.int32)
    h_global = jnp.minimum(1.0, l_abs / g)

    new_leaves, new_gammas, scales = [], [], []
    for u, n, gamma in zip(leaves, norms, gammas):
      # A zero-norm tensor is left alone (avoids 0/0 when gamma is 0 too).
      h_local = jnp.where(n > 0, jnp.minimum(1.0, l_rel * gamma / n), 1.0)
      h = jnp.where(in_warmup, h_global, h_local)
      clipped_norm = h * n
      gamma_new = jnp.where(in_warmup, jnp.minimum(gamma, clipped_norm),
                            b * gamma + (1.0 - b) * clipped_norm)
      new_gammas.append(jnp.where(finite, gamma_new, gamma))
      new_leaves.append(_common.scale_leaf(u, h))
      scales.append(h)

    if scales:
      h_all = jnp.stack(scales)
      clipped_fraction = jnp.mean((h_all < 1.0).astype(_common.STAT_DTYPE))
    else:
      clipped_fraction = jnp.zeros([], _common.STAT_DTYPE)
    clipped_g = optax.tree.norm(
        [h * n for h, n in zip(scales, norms)]).astype(_common.STAT_DTYPE)
    new_state = AdaGCState(
        count=jnp.where(finite, _common.safe_increment(state.count),
                        state.count),
        gamma=treedef.unflatten(new_gammas),
        clipped_fraction=clipped_fraction,
        grad_norm=g,
        clipped_grad_norm=clipped_g,
    )
    return treedef.unflatten(new_leaves), new_state

  return optax.GradientTransformation(init_fn, update_fn)
