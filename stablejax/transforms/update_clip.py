"""Clipping the optimizer's update: per-tensor RMS (Adafactor, StableAdamW) and a z-score of its
global norm (ZClip's rule on the update).

Gradient clipping bounds what goes into the optimizer. An adaptive optimizer can still turn a
gradient of ordinary size into an update spike: Adam divides by a second moment estimated from
past gradients, and when that estimate is out of date (the gradient scale dropped for a while,
then came back) ``m / sqrt(v)`` jumps while the gradient norm looks normal. Wortsman et al.
("Stable and low-precision training for large-scale vision-language models", arXiv 2304.13013,
section 3.4) trace loss spikes to exactly this second-moment underestimate, a few steps before
the loss moves; Marin's 32B run saw update-norm spikes precede its loss spikes and contained them
with clipping on the update norm (Levanter's ``update_rms_clipping`` and ``clip_update_norm``).

* :func:`clip_update_rms`: each tensor's update ``u`` becomes ``u / max(1, RMS(u) / max_rms)``,
  the RMS taken over the tensor (each layer slice of a scan-stacked ``[L, ...]`` leaf, see
  :mod:`stablejax.transforms.stacked`). This is Adafactor's update clipping (Shazeer and Stern,
  "Adafactor: Adaptive Learning Rates with Sublinear Memory Cost", arXiv 1804.04235, section 6,
  threshold ``d = 1``) applied to whatever update it is given: after ``optax.scale_by_adam`` it
  clips ``RMS(m / sqrt(v))``, as Levanter's ``update_rms_clipping`` does (there after the weight
  decay term, as here after ``optax.adamw``'s). StableAdamW (arXiv 2304.13013) divides each
  tensor's learning rate by ``max(1, RMS(g / sqrt(v)))`` instead, a ratio of the gradient, not
  of the momentum. Without layer slices the rule is ``optax.clip_by_block_rms(max_rms)``.
* :func:`zclip_update_norm`: ZClip's rule (:func:`stablejax.zclip`: EMA mean and variance, a
  warmup that initialises them, a z-score outlier cut to its adaptive value, statistics that
  never absorb a non-finite value) on the step-to-step change of the log update norm. A jump of
  the update norm is cut to the growth the run has shown; drift and falls pass. Levanter's
  ``clip_update_norm`` (Marin 32B: window 128, mean + 2 sigma) works on the level of the norm
  over a rolling window; on the level, Adam's falling update norm of the first steps makes the
  statistics too wide to see a 2x jump (:func:`zclip_update_norm` says why).

**Before the learning rate.** Both rules are stated on the update before the learning rate:
Adafactor's ``d = 1`` is a bound on the RMS of a unit-scale direction, and a z-score of the
update norm after a warmup-and-decay schedule would take the schedule's ramp for spikes. In a
chain where the learning rate comes later, place them before it and give no rate::

    optax.chain(optax.scale_by_adam(), stablejax.clip_update_rms(1.0),
                optax.scale_by_learning_rate(schedule))

After an optimizer that carries its own rate (``optax.adamw(schedule)``,
:func:`stablejax.outlier_safe_muon` with one rate per parameter group) pass that rate,
``learning_rate=`` (one number or schedule) or ``learning_rates=`` (one per parameter): the rule
is applied to ``update / rate`` and its factor to ``update``, the same update as clipping before
the rate wherever the rate is positive (a parameter at rate 0 has no update to clip, and counts
as a zero update). Schedules are evaluated at this transform's own count of updates, which is
the optimizer's count when both sit inside the same skip wrappers (a skipped step keeps both).
The trainer does this (``stability.clip_update_rms``, ``stability.zclip_update_norm``, at
``Position.UPDATE`` with the rates of its optimizer's groups).

Norms, RMS values and statistics are float32; updates keep their dtype. A non-finite update is
passed through unclipped (wrap the chain in :func:`stablejax.skip_nonfinite` to drop it) and
never enters the statistics.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import optax

from stablejax.transforms import _common
from stablejax.transforms import defence
from stablejax.transforms.metrics import Rate, Series, register_state_metrics
from stablejax.transforms.stacked import STACKED_NAMES, is_stacked

Rate_ = _common.LearningRate
"""A learning rate: a number, or an optax schedule (count -> rate)."""
RatesArg = _common.LearningRates
"""Per-parameter learning rates: a pytree of :data:`Rate_` with the structure of the parameters,
or a function ``params -> such a pytree``."""
_check_rate_args = _common.check_rate_args
_leaf_rates = _common.leaf_rates


def _before_rate(x: jax.Array, rate: Optional[jax.Array]) -> jax.Array:
  """A float32 quantity of the update (a norm or an RMS) as it was before ``rate``: ``x / rate``,
  0 where the rate is 0 (a parameter at rate 0 has no update)."""
  if rate is None:
    return x
  return jnp.where(rate > 0, x / jnp.where(rate > 0, rate, 1.0), 0.0)


# ----------------------------------------------------------------------------- RMS clipping


class ClipUpdateRmsState(NamedTuple):
  """State of :func:`clip_update_rms`.

  Attributes:
    count: number of updates seen (int32): the count the learning-rate schedules are evaluated at.
    max_rms: the largest RMS of a tensor's update before the learning rate and before clipping,
      last step (float32; NaN when an update was not finite).
    clipped_fraction: fraction of tensors (layer slices of stacked leaves) clipped, last step.
    was_clipped: whether any tensor was clipped at the last step.
    clip_count: number of steps with at least one tensor clipped (int32, saturating).

  Example:
    A tensor at RMS 5 is scaled to RMS 1; one at RMS 0.5 is left alone:

    >>> import jax.numpy as jnp, stablejax
    >>> tx = stablejax.clip_update_rms(1.0)
    >>> updates = {"a": jnp.full(4, 5.0), "b": jnp.full(4, 0.5)}
    >>> clipped, state = tx.update(updates, tx.init(updates))
    >>> clipped["a"].tolist(), clipped["b"].tolist()
    ([1.0, 1.0, 1.0, 1.0], [0.5, 0.5, 0.5, 0.5])
    >>> float(state.max_rms), float(state.clipped_fraction), int(state.clip_count)
    (5.0, 0.5, 1)
  """

  count: jax.Array  # type: ignore[assignment]  # shadows tuple.count, as in optax's states
  max_rms: jax.Array
  clipped_fraction: jax.Array
  was_clipped: jax.Array
  clip_count: jax.Array


def _tensor_rms(path: Any, u: jax.Array, stacked_names: Sequence[str]) -> jax.Array:
  """RMS of ``u`` in float32: a scalar, or ``[L]`` (one per layer slice) for a stacked leaf."""
  x = jnp.square(jnp.asarray(u, _common.STAT_DTYPE))
  if stacked_names and is_stacked(path, u, stacked_names):
    return jnp.sqrt(jnp.mean(jnp.reshape(x, (x.shape[0], -1)), axis=1))
  return jnp.sqrt(jnp.mean(x))


def clip_update_rms(max_rms: float = 1.0, *, learning_rate: Optional[Rate_] = None,
                    learning_rates: RatesArg = None,
                    stacked_names: Sequence[str] = STACKED_NAMES
                    ) -> optax.GradientTransformation:
  """Clips each tensor's update to an RMS of ``max_rms`` (Adafactor's update clipping).

  Per tensor ``u <- u / max(1, RMS(u / rate) / max_rms)``: a tensor whose update, before the
  learning rate, has a root-mean-square above ``max_rms`` is scaled down to it; the others are
  untouched. A scan-stacked ``[L, ...]`` leaf is ``L`` tensors. See the module docstring for
  where it goes in a chain and for ``learning_rate`` / ``learning_rates``.

  Args:
    max_rms: the largest RMS a tensor's update may have before the learning rate (Adafactor's
      ``d``; 1.0 there and in Levanter).
    learning_rate: the rate (a number or an optax schedule of the update count) the incoming
      updates were already multiplied by; None (default) when the rate comes after this.
    learning_rates: the same per parameter: a pytree of rates with the structure of the updates,
      or a function ``updates -> such a pytree`` (called on the updates, which have the
      parameters' structure and shapes).
    stacked_names: path components that mark scan-stacked leaves (``()``: one RMS per leaf,
      ``optax.clip_by_block_rms``'s rule).

  Returns:
    An :class:`optax.GradientTransformation` whose state is a :class:`ClipUpdateRmsState`.

  References:
    Shazeer and Stern, `Adafactor <https://arxiv.org/abs/1804.04235>`_ (arXiv:1804.04235),
    section 6; Wortsman et al., `Stable and low-precision training for large-scale
    vision-language models <https://arxiv.org/abs/2304.13013>`_ (arXiv:2304.13013), StableAdamW.

  Example:
    Adam's direction clipped before the learning rate, as in Adafactor and Levanter:

    >>> import jax.numpy as jnp, optax, stablejax
    >>> tx = optax.chain(optax.scale_by_adam(), stablejax.clip_update_rms(1.0),
    ...                  optax.scale_by_learning_rate(1e-3))
    >>> params = {"w": jnp.ones(3)}
    >>> updates, state = tx.update({"w": jnp.array([1.0, -2.0, 3.0])}, tx.init(params), params)
    >>> [round(float(x), 6) for x in updates["w"]]  # Adam's first step is sign(g): RMS 1, kept
    [-0.001, 0.001, -0.001]
  """
  _common.check("max_rms", max_rms, lambda v: v > 0, "use a positive RMS, e.g. 1.0")
  _check_rate_args(learning_rate, learning_rates)
  if isinstance(stacked_names, str):
    stacked_names = (stacked_names,)
  stacked_names = tuple(stacked_names)

  def init_fn(params: optax.Params) -> ClipUpdateRmsState:
    del params
    zero_f = jnp.zeros([], _common.STAT_DTYPE)
    return ClipUpdateRmsState(count=jnp.zeros([], jnp.int32), max_rms=zero_f,
                              clipped_fraction=zero_f, was_clipped=jnp.array(False),
                              clip_count=jnp.zeros([], jnp.int32))

  def update_fn(updates: optax.Updates, state: ClipUpdateRmsState,
                params: Optional[optax.Params] = None
                ) -> tuple[optax.Updates, ClipUpdateRmsState]:
    del params
    limit = _common.f32(max_rms)
    flat, treedef = jax.tree_util.tree_flatten_with_path(updates)
    rates = _leaf_rates(updates, state.count, learning_rate, learning_rates)
    new_leaves, rms_values, clipped = [], [], []
    for (path, u), rate in zip(flat, rates):
      rms = _before_rate(_tensor_rms(path, u, stacked_names), rate)
      over = jnp.logical_and(jnp.isfinite(rms), rms > limit)  # a non-finite update passes
      scale = jnp.where(over, limit / jnp.where(over, rms, 1.0), 1.0)
      if scale.ndim:  # one factor per layer slice
        scale = jnp.reshape(scale, scale.shape + (1,) * (jnp.ndim(u) - 1))
      new_leaves.append(_common.scale_leaf(u, scale))
      rms_values.append(jnp.reshape(rms, (-1,)))
      clipped.append(jnp.reshape(over, (-1,)))
    if rms_values:
      all_rms, all_over = jnp.concatenate(rms_values), jnp.concatenate(clipped)
      largest = jnp.max(all_rms)
      fraction = jnp.mean(all_over.astype(_common.STAT_DTYPE))
      any_clipped = jnp.any(all_over)
    else:
      largest = fraction = jnp.zeros([], _common.STAT_DTYPE)
      any_clipped = jnp.array(False)
    new_state = ClipUpdateRmsState(
        count=_common.safe_increment(state.count), max_rms=largest, clipped_fraction=fraction,
        was_clipped=any_clipped,
        clip_count=jnp.where(any_clipped, _common.safe_increment(state.clip_count),
                             state.clip_count))
    return jax.tree_util.tree_unflatten(treedef, new_leaves), new_state

  # update_fn takes its own state type where optax's protocol says any OptState.
  return optax.GradientTransformation(init_fn, update_fn)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- z-score clipping


class ZClipUpdateNormState(NamedTuple):
  """State of :func:`zclip_update_norm`: ZClip's statistics of the step-to-step change of the log
  update norm (before the learning rate), and the update count.

  Attributes:
    count: number of updates seen (int32): the count the learning-rate schedules are evaluated at.
    stats_count: changes entered in the statistics (int32; the warmup lasts while it is below
      ``warmup_steps``).
    ema_mean: EMA of the change ``log(norm / last applied norm)`` (Welford mean during warmup).
    ema_var: EMA of its variance (Welford population variance during warmup).
    last_norm: the update norm applied at the last step with a positive, finite one (before the
      learning rate, after clipping; 0 before the first).
    update_norm: global norm of the last update before the learning rate and before clipping.
    clipped_update_norm: the same after clipping.
    z: z-score of the last change (0 during warmup).
    threshold: the norm above which the last update would have been clipped (``inf`` during
      warmup).
    was_clipped: whether the last update was scaled down.
    is_spike: whether the last change was a z-score outlier.
    spike_count: spikes since init (int32).
    clip_count: clipped steps since init (int32).

  Example:
    >>> import jax.numpy as jnp, stablejax
    >>> tx = stablejax.zclip_update_norm(warmup_steps=3)
    >>> state = tx.init({"w": jnp.zeros(2)})
    >>> for norm in (5.0, 5.0, 5.0, 5.0):
    ...   _, state = tx.update({"w": jnp.array([norm, 0.0])}, state)
    >>> int(state.stats_count), float(state.ema_mean), float(state.last_norm)
    (3, 0.0, 5.0)
  """

  count: jax.Array  # type: ignore[assignment]  # shadows tuple.count, as in optax's states
  stats_count: jax.Array
  ema_mean: jax.Array
  ema_var: jax.Array
  last_norm: jax.Array
  update_norm: jax.Array
  clipped_update_norm: jax.Array
  z: jax.Array
  threshold: jax.Array
  was_clipped: jax.Array
  is_spike: jax.Array
  spike_count: jax.Array
  clip_count: jax.Array


def zclip_update_norm(alpha: float = 0.97, z_thresh: float = 2.5, *, warmup_steps: int = 25,
                      eps: float = 1e-6, learning_rate: Optional[Rate_] = None,
                      learning_rates: RatesArg = None) -> optax.GradientTransformation:
  """ZClip's z-score rule on the growth of the global update norm, before the learning rate.

  The quantity is ``r = log(norm / last)``: the change of the update norm (of ``update / rate``)
  from the norm applied at the previous step. ZClip's rule (:func:`stablejax.zclip`) runs on it:
  the first ``warmup_steps`` changes initialise its mean and variance (Welford) and nothing is
  clipped; afterwards a change whose z-score ``(r - mean) / (std + eps)`` exceeds ``z_thresh``
  is cut to ``mean + z_thresh * std`` (ZClip's ``"percentile"`` clip value) and every update
  scaled by ``exp(r_clipped - r)``; the EMA (``alpha``) takes the clipped change, and the next
  change is measured from the clipped norm. So an update norm may drift and fall freely, while
  a jump is let in at the largest growth per step the run has shown (a rate limit, not a
  ceiling: a lasting 2.5x change passes in about a dozen steps at a growth spread of 3% per
  step). ZClip's default ``"adaptive_scaling"`` value, ``mean + z_thresh * std / (z /
  z_thresh)``, would let a large jump in at a small fraction of that growth, and the clipped
  changes entering the EMA would narrow it further: a lasting change would stay held.

  Why the change and not the level, as ZClip does with the gradient norm: Adam's update norm
  before the learning rate falls by a factor of 2 to 3 over the first ``1 / (1 - b2)`` steps as
  its second moment fills, so statistics of the level initialised in a warmup carry that fall as
  variance (a standard deviation half the mean in this project's runs) and miss a 2x jump for
  dozens of steps; the change per step is stationary from the start (``bench/scenarios.py``,
  README). A zero or non-finite norm (a skipped step, a learning rate of 0, a NaN) is passed
  through and changes nothing in the state.

  Args:
    alpha: EMA factor of the mean and variance (ZClip's 0.97).
    z_thresh: z-score above which a change is a spike (ZClip's 2.5).
    warmup_steps: changes collected before clipping starts.
    eps: added to the standard deviation in the z-score.
    learning_rate: the rate (number or schedule) the incoming updates were multiplied by; None
      when the rate comes after this.
    learning_rates: the same per parameter (a pytree, or a function of the updates).

  Returns:
    An :class:`optax.GradientTransformation` whose state is a :class:`ZClipUpdateNormState`.

  References:
    Kumar et al., `ZClip: Adaptive Spike Mitigation for LLM Pre-Training
    <https://arxiv.org/abs/2504.02507>`_ (arXiv:2504.02507); Levanter's
    ``clip_update_by_historical_norm`` (``levanter/optim/clip_update_norm.py``, a rolling window
    of the level).

  Example:
    After 5 warmup updates of norm about 1, a jump to 10 is held to the growth seen so far:

    >>> import jax.numpy as jnp, optax, stablejax
    >>> tx = stablejax.zclip_update_norm(warmup_steps=5)
    >>> state = tx.init({"w": jnp.zeros(2)})
    >>> for norm in (1.0, 1.02, 0.98, 1.0, 1.03, 1.0):
    ...   _, state = tx.update({"w": jnp.array([norm, 0.0])}, state)
    >>> u, state = tx.update({"w": jnp.array([10.0, 0.0])}, state)
    >>> bool(state.is_spike), float(u["w"][0]) < 1.2
    (True, True)
  """
  _common.check("alpha", alpha, lambda v: 0.0 < v < 1.0,
                "use an EMA factor strictly between 0 and 1, e.g. 0.97")
  _common.check("z_thresh", z_thresh, lambda v: v > 0, "use a positive z-score, e.g. 2.5")
  _common.check("warmup_steps", warmup_steps, lambda v: v >= 1 and float(v).is_integer(),
                "use an integer >= 1 (the statistics are initialised from warmup changes)")
  _common.check("eps", eps, lambda v: v >= 0, "use a small non-negative value")
  _check_rate_args(learning_rate, learning_rates)

  def init_fn(params: optax.Params) -> ZClipUpdateNormState:
    del params
    zero_f, zero_i = jnp.zeros([], _common.STAT_DTYPE), jnp.zeros([], jnp.int32)
    return ZClipUpdateNormState(
        count=zero_i, stats_count=zero_i, ema_mean=zero_f, ema_var=zero_f, last_norm=zero_f,
        update_norm=zero_f, clipped_update_norm=zero_f, z=zero_f, threshold=zero_f,
        was_clipped=jnp.array(False), is_spike=jnp.array(False), spike_count=zero_i,
        clip_count=zero_i)

  def update_fn(updates: optax.Updates, state: ZClipUpdateNormState,
                params: Optional[optax.Params] = None
                ) -> tuple[optax.Updates, ZClipUpdateNormState]:
    del params
    a, zt, e = _common.f32(alpha), _common.f32(z_thresh), _common.f32(eps)
    leaves = jax.tree.leaves(updates)
    rates = _leaf_rates(updates, state.count, learning_rate, learning_rates)
    squares = [_before_rate(jnp.sum(jnp.square(jnp.asarray(u, _common.STAT_DTYPE))),
                            None if r is None else jnp.square(r))
               for u, r in zip(leaves, rates)]
    norm = jnp.sqrt(_common.sum_of_scalars(squares))
    usable = jnp.logical_and(jnp.isfinite(norm), norm > 0)
    measured = jnp.logical_and(usable, state.last_norm > 0)  # a change exists
    safe_norm = jnp.where(usable, norm, 1.0)
    change = jnp.log(safe_norm) - jnp.log(jnp.where(state.last_norm > 0, state.last_norm, 1.0))
    in_warmup = state.stats_count < jnp.asarray(warmup_steps, jnp.int32)
    mean, var = state.ema_mean, state.ema_var
    # Warmup: Welford mean and population variance of the changes, no clipping.
    n_new = (state.stats_count + 1).astype(_common.STAT_DTYPE)
    warm_mean = mean + (change - mean) / n_new
    warm_var = var + ((change - mean) * (change - warm_mean) - var) / n_new
    # After it: ZClip's z-score and adaptive clip value, on the change.
    std = jnp.sqrt(var)
    z = (change - mean) / (std + e)
    spike = jnp.logical_and(measured, jnp.logical_and(~in_warmup, z > zt))
    clipped_change = jnp.where(spike, mean + zt * std, change)
    ema_mean = a * mean + (1.0 - a) * clipped_change
    ema_var = a * var + (1.0 - a) * jnp.square(clipped_change - ema_mean)
    new_mean = jnp.where(in_warmup, warm_mean, ema_mean)
    new_var = jnp.where(in_warmup, warm_var, ema_var)
    scale = _common.materialize(jnp.where(spike, jnp.exp(clipped_change - change), 1.0))
    updates = jax.tree.map(lambda u: _common.scale_leaf(u, scale), updates)
    threshold = jnp.where(in_warmup, jnp.inf, state.last_norm * jnp.exp(mean + zt * (std + e)))
    new_state = ZClipUpdateNormState(
        count=_common.safe_increment(state.count),
        stats_count=jnp.where(measured, _common.safe_increment(state.stats_count),
                              state.stats_count),
        ema_mean=jnp.where(measured, new_mean, mean),
        ema_var=jnp.where(measured, new_var, var),
        last_norm=jnp.where(usable, norm * scale, state.last_norm),
        update_norm=norm, clipped_update_norm=norm * scale,
        z=jnp.where(jnp.logical_and(measured, ~in_warmup), z, 0.0).astype(_common.STAT_DTYPE),
        threshold=jnp.where(measured, threshold, jnp.inf).astype(_common.STAT_DTYPE),
        was_clipped=spike, is_spike=spike,
        spike_count=jnp.where(spike, _common.safe_increment(state.spike_count),
                              state.spike_count),
        clip_count=jnp.where(spike, _common.safe_increment(state.clip_count), state.clip_count))
    return updates, new_state

  # update_fn takes its own state type where optax's protocol says any OptState.
  return optax.GradientTransformation(init_fn, update_fn)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- metrics


def _rms_metrics(s: ClipUpdateRmsState) -> dict[str, jax.Array]:
  return {"max_rms": s.max_rms, "clipped_fraction": s.clipped_fraction,
          "was_clipped": s.was_clipped, "clip_count": s.clip_count}


def _znorm_metrics(s: ZClipUpdateNormState) -> dict[str, jax.Array]:
  return {"update_norm": s.update_norm, "clipped_update_norm": s.clipped_update_norm, "z": s.z,
          "threshold": s.threshold, "change_mean": s.ema_mean,
          "change_std": jnp.sqrt(s.ema_var), "was_clipped": s.was_clipped,
          "is_spike": s.is_spike, "spike_count": s.spike_count, "clip_count": s.clip_count}


# Reported, not scored: a clip on the update is the defence doing its work (as ZClip's clips).
register_state_metrics(
    ClipUpdateRmsState, "update_rms_clip", _rms_metrics,
    rates=(Rate("update_rms_clip_rate", flag="was_clipped", counter="clip_count",
                label="update-RMS clip rate"),),
    series=(Series("max_rms", "largest tensor update RMS (before the LR)", "update_rms", ":"),),
    acted="was_clipped", order=30)
register_state_metrics(
    ZClipUpdateNormState, "update_zclip", _znorm_metrics,
    rates=(Rate("update_zclip_spike_rate", flag="is_spike", counter="spike_count",
                label="update-norm spike rate"),),
    acted="was_clipped", order=31)


# ----------------------------------------------------------------------------- the declarations


@dataclasses.dataclass
class ClipUpdateRmsConfig:
  """``stability.clip_update_rms``: Adafactor's per-tensor RMS clip of the update before the
  learning rate (:func:`clip_update_rms`), after the optimizer; the trainer divides out its
  optimizer's rates (every group's schedule). Off by default (README: update clipping)."""

  enabled: bool = False
  max_rms: float = 1.0

  def validate(self, where: str, ctx: defence.DefenceContext) -> None:
    defence.check_positive(f"{where}.max_rms", self.max_rms)


@dataclasses.dataclass
class ZClipUpdateNormConfig:
  """``stability.zclip_update_norm``: ZClip's z-score clip on the global update norm before the
  learning rate (:func:`zclip_update_norm`), after the RMS clip when both run. Off by default
  (README: update clipping)."""

  enabled: bool = False
  alpha: float = 0.97
  z_thresh: float = 2.5
  warmup_steps: int = 25

  def validate(self, where: str, ctx: defence.DefenceContext) -> None:
    if not 0 < self.alpha < 1:
      raise ValueError(f"{where}.alpha={self.alpha} must lie in (0, 1) (ZClip's EMA factor)")
    defence.check_positive(f"{where}.z_thresh", self.z_thresh)
    defence.check_positive(f"{where}.warmup_steps", self.warmup_steps)


def _learning_rates(ctx: defence.DefenceContext) -> dict:
  return {"learning_rates": ctx.learning_rates}


CLIP_UPDATE_RMS = defence.Defence(
    name="clip_update_rms", config=ClipUpdateRmsConfig, position=defence.Position.UPDATE,
    order=10, factory=clip_update_rms, context=_learning_rates,
    label="update RMS clip (Adafactor, per tensor, before the learning rate)")

ZCLIP_UPDATE_NORM = defence.Defence(
    name="zclip_update_norm", config=ZClipUpdateNormConfig, position=defence.Position.UPDATE,
    order=20, factory=zclip_update_norm, context=_learning_rates,
    label="update-norm ZClip (z-score of the update norm, before the learning rate)")
