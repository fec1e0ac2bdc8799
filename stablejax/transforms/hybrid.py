"""Hybrid clipping: ZClip (global, primary layer) then AdaGC (per tensor, secondary).

ZClip: Kumar et al., arXiv:2504.02507. AdaGC: Wang et al., arXiv:2502.11034.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence, cast

import optax

from stablejax.transforms.adagc import AdaGCState
from stablejax.transforms.adagc import adagc
from stablejax.transforms.stacked import STACKED_NAMES
from stablejax.transforms.zclip import ZClipState
from stablejax.transforms.zclip import zclip


class HybridClipState(NamedTuple):
  """State of :func:`hybrid_clip`: the two inner states, in order.

  Example:
    >>> import jax.numpy as jnp, stablejax
    >>> tx = stablejax.hybrid_clip()
    >>> state = tx.init({"w": jnp.zeros(2)})
    >>> _, state = tx.update({"w": jnp.array([3.0, 4.0])}, state)
    >>> float(state.zclip.grad_norm)              # the raw norm ZClip saw
    5.0
    >>> round(float(state.adagc.grad_norm), 4)    # what reached AdaGC: clipped to 1.0 first
    1.0
  """

  zclip: ZClipState
  adagc: AdaGCState


def hybrid_clip(
    *,
    zclip_alpha: float = 0.97,
    zclip_z_thresh: float = 2.5,
    zclip_max_grad_norm: Optional[float] = 1.0,
    zclip_eps: float = 1e-6,
    zclip_warmup_steps: int = 25,
    zclip_mode: str = "zscore",
    zclip_clip_option: str = "adaptive_scaling",
    zclip_clip_factor: float = 1.0,
    zclip_skip_update_on_spike: bool = False,
    adagc_beta: float = 0.98,
    adagc_lambda_rel: float = 1.05,
    adagc_lambda_abs: float = 1.0,
    adagc_warmup_steps: int = 100,
    adagc_stacked_names: Sequence[str] = STACKED_NAMES,
) -> optax.GradientTransformation:
  """ZClip followed by AdaGC in one transform.

  ZClip removes global gradient-norm spikes; AdaGC then bounds each tensor
  against the EMA of its own clipped norms. Equivalent to
  ``optax.chain(zclip(...), adagc(...))`` but with a named state. Every
  argument is the same-named argument of :func:`stablejax.zclip` or
  :func:`stablejax.adagc` with a ``zclip_`` / ``adagc_`` prefix, with the same
  defaults.

  Args:
    zclip_alpha: ZClip EMA factor.
    zclip_z_thresh: ZClip z-score threshold.
    zclip_max_grad_norm: ZClip norm ceiling (and warmup clip); None disables
      it.
    zclip_eps: ZClip epsilon added to the standard deviation.
    zclip_warmup_steps: ZClip warmup length.
    zclip_mode: ZClip mode, ``"zscore"`` or ``"percentile"``.
    zclip_clip_option: ZClip clip option, ``"adaptive_scaling"`` or ``"mean"``.
    zclip_clip_factor: ZClip multiplier of the adaptive clip value.
    zclip_skip_update_on_spike: ZClip: do not update the EMA on a spike.
    adagc_beta: AdaGC EMA factor.
    adagc_lambda_rel: AdaGC relative threshold.
    adagc_lambda_abs: AdaGC global clip during its warmup.
    adagc_warmup_steps: AdaGC warmup length.
    adagc_stacked_names: path components marking scan-stacked leaves, which
      get one AdaGC threshold per layer; ``()`` for one per leaf.

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
  z = zclip(alpha=zclip_alpha, z_thresh=zclip_z_thresh,
            max_grad_norm=zclip_max_grad_norm, eps=zclip_eps,
            warmup_steps=zclip_warmup_steps, mode=zclip_mode,
            clip_option=zclip_clip_option, clip_factor=zclip_clip_factor,
            skip_update_on_spike=zclip_skip_update_on_spike)
  a = adagc(beta=adagc_beta, lambda_rel=adagc_lambda_rel,
            lambda_abs=adagc_lambda_abs, warmup_steps=adagc_warmup_steps,
            stacked_names=adagc_stacked_names)

  # optax's GradientTransformation types its states as any OptState; these are the inner
  # transforms' own state types.
  def init_fn(params: optax.Params) -> HybridClipState:
    return HybridClipState(zclip=cast(ZClipState, z.init(params)),
                           adagc=cast(AdaGCState, a.init(params)))

  def update_fn(updates: optax.Updates, state: HybridClipState,
                params: Optional[optax.Params] = None) -> tuple[optax.Updates, HybridClipState]:
    updates, z_state = z.update(updates, state.zclip, params)
    updates, a_state = a.update(updates, state.adagc, params)
    return updates, HybridClipState(zclip=cast(ZClipState, z_state),
                                    adagc=cast(AdaGCState, a_state))

  # update_fn takes its own state type where optax's protocol says any OptState.
  return optax.GradientTransformation(init_fn, update_fn)  # type: ignore[arg-type]
