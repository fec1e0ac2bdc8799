"""ZClip: adaptive gradient clipping from z-scores of the global gradient norm.

Kumar et al., "ZClip: Adaptive Spike Mitigation for LLM Pre-Training",
arXiv:2504.02507. This module follows the behaviour of the authors' reference
implementation (``ZClip`` in github.com/bluorion-com/ZClip, ``zclip.py``):

* Warmup: the first ``warmup_steps`` raw global norms are collected while the
  gradients are clipped to ``max_grad_norm`` (as ``clip_grad_norm_`` does:
  scale ``min(1, max_grad_norm / (g + 1e-6))``). On the last warmup step the
  EMA mean and variance are initialised with the mean and population variance
  of the collected norms. Here they are accumulated with Welford's update, so
  no buffer is kept in the state.
* Afterwards ``z = (g - mean) / (std + eps)``. In ``"zscore"`` mode a step with
  ``z > z_thresh`` gets the clip value ``(mean + z_thresh * std / (z / z_thresh))
  * clip_factor`` (``"adaptive_scaling"``) or ``mean`` (``"mean"``). In
  ``"percentile"`` mode the clip value ``mean + z_thresh * std`` is used
  whenever ``g`` exceeds it. The clip actually applied is
  ``min(clip value or g, max_grad_norm)``; gradients are scaled by
  ``clip / (g + 1e-6)`` when ``g > clip``.
* The EMA is updated with the clip value when one was computed, else with ``g``
  (mean first, then the variance with the new mean), and not at all on a spike
  when ``skip_update_on_spike``.

Beyond the reference: a step whose global norm is not finite leaves the
statistics, the warmup progress and the counters untouched (the EMA never
absorbs a NaN/Inf, even without :func:`stablejax.skip_nonfinite`). The updates
of such a step are not repaired: wrap the chain in
:func:`stablejax.skip_nonfinite` to drop them.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from stablejax.transforms import _common
from stablejax.transforms import defence
from stablejax.transforms.metrics import Rate, Series, register_state_metrics

_MODES = ("zscore", "percentile")
_CLIP_OPTIONS = ("adaptive_scaling", "mean")
# clip_grad_norm_ and the reference both divide by (norm + 1e-6).
_NORM_EPS = 1e-6


class ZClipState(NamedTuple):
  """State of :func:`zclip`.

  Attributes:
    count: number of steps with a finite global norm seen so far (int32); the
      warmup lasts while ``count < warmup_steps``.
    ema_mean: EMA of the gradient norm (during warmup: running mean of the
      warmup norms).
    ema_var: EMA of the variance (during warmup: running population variance).
    grad_norm: raw global norm of the last step.
    clipped_grad_norm: global norm after clipping, last step.
    z: z-score of the last step (0 during warmup).
    threshold: clip value in effect at the last step: ``max_grad_norm`` (or
      ``inf``) during warmup; the applied clip when clipping; otherwise the
      norm above which clipping would start (capped by ``max_grad_norm``).
    was_clipped: whether the last step's gradients were scaled down.
    is_spike: whether the last step was a spike (after warmup, finite and
      ``z > z_thresh`` in ``"zscore"`` mode, ``g > mean + z_thresh * std`` in
      ``"percentile"``).
    spike_count: total number of spikes (int32).
    clip_count: total number of clipped steps (int32).

  Example:
    Three steps of a gradient of norm 5, still in the warmup, are clipped to the 1.0 ceiling:

    >>> import jax.numpy as jnp, stablejax
    >>> tx = stablejax.zclip()
    >>> state = tx.init({"w": jnp.zeros(2)})
    >>> for _ in range(3):
    ...   _, state = tx.update({"w": jnp.array([3.0, 4.0])}, state)
    >>> int(state.count), float(state.grad_norm), bool(state.was_clipped)
    (3, 5.0, True)
    >>> round(float(state.clipped_grad_norm), 4)
    1.0
  """

  count: jax.Array  # type: ignore[assignment]  # shadows tuple.count, as in optax's states
  ema_mean: jax.Array
  ema_var: jax.Array
  grad_norm: jax.Array
  clipped_grad_norm: jax.Array
  z: jax.Array
  threshold: jax.Array
  was_clipped: jax.Array
  is_spike: jax.Array
  spike_count: jax.Array
  clip_count: jax.Array


def _validate(alpha: float, z_thresh: float, max_grad_norm: Optional[float], eps: float,
              warmup_steps: int, mode: str, clip_option: str, clip_factor: float) -> None:
  _common.check("alpha", alpha, lambda v: 0.0 < v < 1.0,
                "use an EMA factor strictly between 0 and 1, e.g. 0.97")
  _common.check("z_thresh", z_thresh, lambda v: v > 0,
                "use a positive z-score threshold, e.g. 2.5")
  _common.check("max_grad_norm", max_grad_norm, lambda v: v > 0,
                "use a positive norm, or None to disable the ceiling")
  _common.check("eps", eps, lambda v: v >= 0, "use a small non-negative value")
  _common.check("warmup_steps", warmup_steps,
                lambda v: v >= 1 and float(v).is_integer(),
                "use an integer >= 1 (the EMA is initialised from warmup norms)")
  _common.check("clip_factor", clip_factor, lambda v: v > 0,
                "use a positive factor, e.g. 1.0")
  if not isinstance(mode, str) or mode.lower() not in _MODES:
    raise ValueError(
        f"mode={mode!r} is invalid: use one of {', '.join(map(repr, _MODES))}.")
  if mode.lower() == "zscore" and (
      not isinstance(clip_option, str)
      or clip_option.lower() not in _CLIP_OPTIONS):
    raise ValueError(
        f"clip_option={clip_option!r} is invalid: use one of "
        f"{', '.join(map(repr, _CLIP_OPTIONS))}.")


class _Verdict(NamedTuple):
  """One phase's rule applied to a step's norm: the factor its updates are scaled by, the
  statistics after it, and the threshold the state reports."""

  scale: jax.Array
  mean: jax.Array
  var: jax.Array
  threshold: jax.Array


def _warmup_verdict(g: jax.Array, state: ZClipState, ceiling: Optional[jax.Array]) -> _Verdict:
  """Warmup: Welford accumulation of the mean and population variance; the fixed clip."""
  mean, var = state.ema_mean, state.ema_var
  n_new = (state.count + 1).astype(_common.STAT_DTYPE)
  warm_mean = mean + (g - mean) / n_new
  warm_var = var + ((g - mean) * (g - warm_mean) - var) / n_new
  if ceiling is None:
    warm_scale = jnp.ones([], _common.STAT_DTYPE)
    warm_threshold = jnp.array(jnp.inf, _common.STAT_DTYPE)
  else:
    warm_scale = jnp.minimum(1.0, ceiling / (g + _NORM_EPS))
    warm_threshold = ceiling
  return _Verdict(warm_scale, warm_mean, warm_var, warm_threshold)


def _detect_spike(g: jax.Array, mean: jax.Array, std: jax.Array, zt: jax.Array, cf: jax.Array,
                  eps: jax.Array, mode: str, clip_option: Optional[str]
                  ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """(z, spike, clip value, detection level): the z-score / percentile test and the adaptive
  clip value of a spike."""
  z = (g - mean) / (std + eps)
  if mode == "percentile":
    clip_value = mean + zt * std
    spike = g > clip_value
    detect_level = clip_value
  else:
    spike = z > zt
    if clip_option == "adaptive_scaling":
      clip_value = (mean + zt * std / (z / zt)) * cf
    else:
      clip_value = mean
    detect_level = mean + zt * (std + eps)
  return z, spike, clip_value, detect_level


def _adaptive_verdict(g: jax.Array, state: ZClipState, spike: jax.Array, clip_value: jax.Array,
                      detect_level: jax.Array, alpha: jax.Array, ceiling: Optional[jax.Array],
                      skip_update_on_spike: bool) -> _Verdict:
  """After warmup: clip a spike to its clip value (and every norm to the ceiling); the EMA takes
  the clip value of a spike (the norm otherwise), mean first, and none of a spike when
  ``skip_update_on_spike``."""
  mean, var = state.ema_mean, state.ema_var
  adaptive = jnp.where(spike, clip_value, g)
  if ceiling is None:
    effective = adaptive
    idle_threshold = detect_level
  else:
    effective = jnp.minimum(adaptive, ceiling)
    idle_threshold = jnp.minimum(detect_level, ceiling)
  post_scale = jnp.where(g > effective, effective / (g + _NORM_EPS), 1.0)
  ema_mean = alpha * mean + (1.0 - alpha) * adaptive
  ema_var = alpha * var + (1.0 - alpha) * jnp.square(adaptive - ema_mean)
  keep_stats = jnp.logical_and(spike, jnp.asarray(skip_update_on_spike))
  post_mean = jnp.where(keep_stats, mean, ema_mean)
  post_var = jnp.where(keep_stats, var, ema_var)
  return _Verdict(post_scale, post_mean, post_var, jnp.where(spike, effective, idle_threshold))


def zclip(
    alpha: float = 0.97,
    z_thresh: float = 2.5,
    max_grad_norm: Optional[float] = 1.0,
    *,
    eps: float = 1e-6,
    warmup_steps: int = 25,
    mode: str = "zscore",
    clip_option: str = "adaptive_scaling",
    clip_factor: float = 1.0,
    skip_update_on_spike: bool = False,
) -> optax.GradientTransformation:
  """ZClip adaptive gradient clipping (z-score of the global gradient norm).

  Tracks an EMA of the mean and variance of the global gradient norm and clips
  steps whose norm is an outlier to an adaptive threshold, as in the
  reference implementation (see the module docstring for the exact rules).
  Norms and statistics are computed in float32; updates keep their dtype.
  A step with a non-finite norm does not enter the statistics.

  Args:
    alpha: EMA smoothing factor for the mean and variance.
    z_thresh: z-score above which a step is a spike (``"zscore"``), or number
      of standard deviations above the mean for the clip (``"percentile"``).
    max_grad_norm: ceiling applied on top of the adaptive clip and the clip
      used during warmup; ``None`` disables it.
    eps: added to the standard deviation in the z-score.
    warmup_steps: number of (finite) steps whose norms initialise the EMA.
    mode: ``"zscore"`` or ``"percentile"``.
    clip_option: for ``"zscore"``: ``"adaptive_scaling"`` (clip to
      ``mean + z_thresh * std / (z / z_thresh)``, times ``clip_factor``) or
      ``"mean"`` (clip to the EMA mean). Ignored in ``"percentile"`` mode.
    clip_factor: multiplier of the ``"adaptive_scaling"`` clip value.
    skip_update_on_spike: if True, a spike does not update the EMA.

  Returns:
    An :class:`optax.GradientTransformation` whose state is a
    :class:`ZClipState`.

  References:
    Kumar et al., `ZClip: Adaptive Spike Mitigation for LLM Pre-Training
    <https://arxiv.org/abs/2504.02507>`_, 2025 (arXiv:2504.02507).

  Example:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import stablejax
    >>> tx = optax.chain(stablejax.zclip(z_thresh=2.5), optax.adam(1e-3))
    >>> params = {"w": jnp.ones(3)}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.full(3, 2.0)}, state, params)
    >>> float(state[0].grad_norm) > 3.4
    True
  """
  _validate(alpha, z_thresh, max_grad_norm, eps, warmup_steps, mode,
            clip_option, clip_factor)
  mode = mode.lower()
  clip_option = clip_option.lower() if isinstance(clip_option, str) else None

  def init_fn(params: optax.Params) -> ZClipState:
    del params
    zero_f = jnp.zeros([], _common.STAT_DTYPE)
    zero_i = jnp.zeros([], jnp.int32)
    return ZClipState(
        count=zero_i,
        ema_mean=zero_f,
        ema_var=zero_f,
        grad_norm=zero_f,
        clipped_grad_norm=zero_f,
        z=zero_f,
        threshold=zero_f,
        was_clipped=jnp.array(False),
        is_spike=jnp.array(False),
        spike_count=zero_i,
        clip_count=zero_i,
    )

  def update_fn(updates: optax.Updates, state: ZClipState, params: Optional[optax.Params] = None
                ) -> tuple[optax.Updates, ZClipState]:
    del params
    a = _common.f32(alpha)
    zt = _common.f32(z_thresh)
    cf = _common.f32(clip_factor)
    ceiling = (None if max_grad_norm is None else _common.f32(max_grad_norm))

    g = _common.global_norm_f32(updates)
    finite = jnp.isfinite(g)
    in_warmup = state.count < jnp.asarray(warmup_steps, jnp.int32)
    warm = _warmup_verdict(g, state, ceiling)
    z, spike, clip_value, detect_level = _detect_spike(
        g, state.ema_mean, jnp.sqrt(state.ema_var), zt, cf, _common.f32(eps), mode, clip_option)
    after = _adaptive_verdict(g, state, spike, clip_value, detect_level, a, ceiling,
                              skip_update_on_spike)

    scale = jnp.where(in_warmup, warm.scale, after.scale)
    new_mean = jnp.where(in_warmup, warm.mean, after.mean)
    new_var = jnp.where(in_warmup, warm.var, after.var)
    is_spike = jnp.logical_and(jnp.logical_and(~in_warmup, spike), finite)
    was_clipped = scale < 1.0
    threshold = jnp.where(in_warmup, warm.threshold, after.threshold)

    scale = _common.materialize(scale)  # read by every parameter's update
    updates = jax.tree.map(lambda u: _common.scale_leaf(u, scale), updates)
    new_state = ZClipState(
        count=jnp.where(finite, _common.safe_increment(state.count),
                        state.count),
        ema_mean=jnp.where(finite, new_mean, state.ema_mean),
        ema_var=jnp.where(finite, new_var, state.ema_var),
        grad_norm=g,
        clipped_grad_norm=g * scale,
        z=jnp.where(in_warmup, 0.0, z).astype(_common.STAT_DTYPE),
        threshold=threshold.astype(_common.STAT_DTYPE),
        was_clipped=was_clipped,
        is_spike=is_spike,
        spike_count=jnp.where(is_spike,
                              _common.safe_increment(state.spike_count),
                              state.spike_count),
        clip_count=jnp.where(was_clipped,
                             _common.safe_increment(state.clip_count),
                             state.clip_count),
    )
    return updates, new_state

  # update_fn takes its own state type where optax's protocol says any OptState.
  return optax.GradientTransformation(init_fn, update_fn)  # type: ignore[arg-type]


def _zclip_metrics(s: ZClipState) -> dict[str, jax.Array]:
  return {
      "grad_norm": s.grad_norm,
      "clipped_grad_norm": s.clipped_grad_norm,
      "z": s.z,
      "threshold": s.threshold,
      "ema_mean": s.ema_mean,
      "ema_std": jnp.sqrt(s.ema_var),
      "was_clipped": s.was_clipped,
      "is_spike": s.is_spike,
      "spike_count": s.spike_count,
      "clip_count": s.clip_count,
  }


# Only z-score spikes are scored: ZClip's warmup and ceiling clips happen on most early steps of
# healthy runs by design.
register_state_metrics(
    ZClipState, "zclip", _zclip_metrics,
    rates=(Rate("zclip_spike_rate", flag="is_spike", counter="spike_count",
                label="ZClip spike rate", budget=0.2,
                advice="ZClip spike rate {value:.3g} > 0.2: lower the learning rates by 20%"),
           Rate("zclip_clip_rate", flag="was_clipped", counter="clip_count",
                label="ZClip clip rate")),
    series=(Series("clipped_grad_norm", "clipped grad norm", "grad_norm"),
            Series("threshold", "ZClip threshold", "grad_norm", ":")),
    band=("ema_mean", "ema_std", "ZClip EMA mean +- std"),
    grad_norm="grad_norm", threshold="threshold", acted="was_clipped", order=10)


# ----------------------------------------------------------------------------- the declaration


@dataclasses.dataclass
class ZClipConfig:
  """``stability.zclip``: ZClip on the gradient, first in the chain (arguments of :func:`zclip`).

  ``max_grad_norm`` is ZClip's ceiling: every step's norm is clipped to it (and to the fixed clip
  during warmup); null removes it.
  """

  enabled: bool = True
  alpha: float = 0.97
  z_thresh: float = 2.5
  max_grad_norm: Optional[float] = 1.0
  warmup_steps: int = 25

  def validate(self, where: str, ctx: defence.DefenceContext) -> None:
    if not 0 < self.alpha < 1:
      raise ValueError(f"{where}.alpha={self.alpha} must lie in (0, 1) (ZClip's EMA factor)")
    defence.check_positive(f"{where}.z_thresh", self.z_thresh)
    defence.check_positive(f"{where}.warmup_steps", self.warmup_steps, allow_zero=True)
    if self.max_grad_norm is not None:
      defence.check_positive(f"{where}.max_grad_norm", self.max_grad_norm)


ZCLIP = defence.Defence(
    name="zclip", config=ZClipConfig, position=defence.Position.GRADIENT, order=20,
    factory=zclip, label="ZClip (z-score clipping of the global gradient norm)")
