"""Hybrid clipping: ZClip (global, primary layer) then AdaGC (per tensor, secondary).

ZClip: Kumar et al., arXiv:2504.02507. AdaGC: Wang et al., arXiv:2502.11034.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import optax

from stablejax.transforms.adagc import AdaGCState
from stablejax.transforms.adagc import adagc
from stablejax.transforms.zclip import ZClipState
from stablejax.transforms.zclip import zclip


class HybridClipState(NamedTuple):
  """State of :func:`hybrid_clip`: the two inner states, in order."""

  zclip: ZClipState
  adagc: AdaGCState


def hybrid_clip(
    alpha: float = 0.97,
    z_thresh: float = 2.5,
    max_grad_norm: Optional[float] = 1.0,
    eps: float = 1e-6,
    zclip_warmup_steps: int = 25,
    mode: str = "zscore",
    clip_option: str = "adaptive_scaling",
    clip_factor: float = 1.0,
    skip_update_on_spike: bool = False,
    beta: float = 0.98,
    lambda_rel: float = 1.05,
    lambda_abs: float = 1.0,
    adagc_warmup_steps: int = 100,
) -> optax.GradientTransformation:
  """ZClip followed by AdaGC in one transform.

  ZClip removes global gradient-norm spikes; AdaGC then bounds each tensor
  against the EMA of its own clipped norms. Equivalent to
  ``optax.chain(zclip(...), adagc(...))`` but with a named state. Both
  warmups take their own argument because both transforms call it
  ``warmup_steps``.

  Args:
    alpha: ZClip EMA factor.
    z_thresh: ZClip z-score threshold.
    max_grad_norm: ZClip norm ceiling (and warmup clip); None disables it.
    eps: ZClip epsilon added to the standard deviation.
    zclip_warmup_steps: ZClip ``warmup_steps``.
    mode: ZClip mode, ``"zscore"`` or ``"percentile"``.
    clip_option: ZClip clip option, ``"adaptive_scaling"`` or ``"mean"``.
    clip_factor: ZClip multiplier of the adaptive clip value.
    skip_update_on_spike: ZClip: do not update the EMA on a spike.
    beta: AdaGC EMA factor.
    lambda_rel: AdaGC relative threshold.
    lambda_abs: AdaGC global clip during its warmup.
    adagc_warmup_steps: AdaGC ``warmup_steps``.

  Returns:
    An :class:`optax.GradientTransformation` whose state is a
    :class:`HybridClipState` (``zclip``: :class:`ZClipState`, ``adagc``:
    :class:`AdaGCState`).

  References:
    Kumar et al., `ZClip <https://arxiv.org/abs/2504.02507>`_ (arXiv:2504.02507);
    Wang et al., `AdaGC <https://arxiv.org/abs/2502.11034>`_ (arXiv:2502.11034).

  Example:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import stablejax
    >>> tx = optax.chain(stablejax.hybrid_clip(), optax.adamw(1e-3))
    >>> params = {"w": jnp.ones((2, 2))}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.ones((2, 2))}, state, params)
    >>> sorted(stablejax.stability_metrics(state))[:2]
    ['adagc/clipped_fraction', 'adagc/clipped_grad_norm']
  """
  z = zclip(alpha=alpha, z_thresh=z_thresh, max_grad_norm=max_grad_norm,
            eps=eps, warmup_steps=zclip_warmup_steps, mode=mode,
            clip_option=clip_option, clip_factor=clip_factor,
            skip_update_on_spike=skip_update_on_spike)
  a = adagc(beta=beta, lambda_rel=lambda_rel, lambda_abs=lambda_abs,
            warmup_steps=adagc_warmup_steps)

  def init_fn(params):
    return HybridClipState(zclip=z.init(params), adagc=a.init(params))

  def update_fn(updates, state, params=None):
    updates, z_state = z.update(updates, state.zclip, params)
    updates, a_state = a.update(updates, state.adagc, params)
    return updates, HybridClipState(zclip=z_state, adagc=a_state)

  return optax.GradientTransformation(init_fn, update_fn)
