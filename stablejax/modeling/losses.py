"""Cross-entropy with the z-loss auxiliary term.

The z-loss ``z_loss * log(sum(exp(logits)))**2`` keeps the softmax normaliser
close to 1 and stops the logits from drifting, which removes a common source of
late-training loss spikes (Chowdhery et al., "PaLM", arXiv:2204.02311, section
5; Zoph et al., "ST-MoE", arXiv:2202.08906).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp


def cross_entropy_with_z_loss(
    logits: jax.Array,
    labels: jax.Array,
    z_loss: float = 1e-4,
    mask: Optional[jax.Array] = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Mean softmax cross-entropy over integer labels plus the z-loss.

  Computed in float32 whatever the logits dtype (bf16 logits are upcast), so
  the log-sum-exp neither overflows nor loses precision.

  Args:
    logits: ``[..., vocab]`` unnormalised log-probabilities.
    labels: ``[...]`` integer class ids.
    z_loss: weight of ``log(sum(exp(logits)))**2``; 0 gives plain
      cross-entropy.
    mask: optional ``[...]`` bool or float weights; positions with weight 0
      (e.g. padding) do not count. Means are weighted by it.

  Returns:
    ``(loss, aux)`` where ``loss`` is the float32 scalar mean of
    ``cross_entropy + z_loss_term`` and ``aux`` is
    ``{"cross_entropy": mean cross-entropy, "z_loss": mean z-loss term,
    "token_loss": cross_entropy + z_loss_term at each position}``
    (``loss == aux["cross_entropy"] + aux["z_loss"]``; ``token_loss`` has the labels' shape and
    is unweighted: a trainer reads which rows went non-finite from it).

  References:
    Chowdhery et al., `PaLM: Scaling Language Modeling with Pathways
    <https://arxiv.org/abs/2204.02311>`_, 2022 (arXiv:2204.02311).

  Example:
    >>> import jax.numpy as jnp
    >>> import stablejax
    >>> logits = jnp.zeros((2, 4))
    >>> loss, aux = stablejax.cross_entropy_with_z_loss(logits, jnp.array([0, 3]))
    >>> round(float(aux["cross_entropy"]), 4), round(float(aux["z_loss"]), 6)
    (1.3863, 0.000192)
  """
  logits = jnp.asarray(logits)
  labels = jnp.asarray(labels)
  if logits.shape[:-1] != labels.shape:
    raise ValueError(
        f"logits shape {logits.shape} and labels shape {labels.shape} do not "
        "match: labels must have the logits' shape without the last axis.")
  if mask is not None and jnp.shape(mask) != labels.shape:
    raise ValueError(
        f"mask shape {jnp.shape(mask)} is invalid: use the labels' shape "
        f"{labels.shape}.")
  logits = logits.astype(jnp.float32)
  log_z = jax.nn.logsumexp(logits, axis=-1)
  label_logits = jnp.take_along_axis(
      logits, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]
  cross_entropy = log_z - label_logits
  z_term = jnp.asarray(z_loss, jnp.float32) * jnp.square(log_z)

  if mask is None:
    weights = jnp.ones(labels.shape, jnp.float32)
  else:
    weights = jnp.asarray(mask).astype(jnp.float32)
  total = jnp.sum(weights)
  denom = jnp.where(total > 0, total, 1.0)

  def _mean(x: jax.Array) -> jax.Array:
    # where() so a masked NaN/Inf position cannot leak into the mean.
    return jnp.sum(jnp.where(weights > 0, x * weights, 0.0)) / denom

  ce = _mean(cross_entropy)
  zl = _mean(z_term)
  return ce + zl, {"cross_entropy": ce, "z_loss": zl, "token_loss": cross_entropy + z_term}
