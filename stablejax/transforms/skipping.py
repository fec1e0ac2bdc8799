"""Wrappers that skip a bad step as if it never happened.

:func:`skip_nonfinite` drops steps with NaN/Inf gradients, loss or updates;
:func:`skip_spikes` drops steps whose loss or gradient norm is an outlier
against a rolling window: by default a winsorised window (an outlier enters it
clipped to the threshold), or exactly OLMo-core's ``SkipStepOptimizer`` rule
with ``statistics="olmo_core"`` (the two differ in three ways, listed in
:func:`skip_spikes`). See also MaxText's ``skip_step_on_spikes``, Molybog et
al., "A Theory on Adam Instability in Large-Scale Machine Learning",
arXiv:2304.09871, and Chowdhery et al., "PaLM", arXiv:2204.02311, section 5.1,
on skipping batches around loss spikes.

A skipped step returns zero updates and keeps the *entire* inner state (Adam
moments, counts, ZClip/AdaGC statistics, Muon momentum) exactly as it was, so
a run with a skipped step is identical to the run without that step. The inner
update is always computed and the result chosen with one ``lax.cond`` (zero
updates and the old state, or the inner result): no Python branch on traced
values, no host transfer.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import optax
import optax.tree

from stablejax.transforms import _common
from stablejax.transforms import defence
from stablejax.transforms.metrics import Rate, register_state_metrics

_WATCHABLE = ("loss", "grad_norm")
_STATISTICS = ("winsorized", "olmo_core", "log_norm")
# The smallest gradient norm the log-norm window takes the logarithm of (a zero norm stays finite).
_LOG_FLOOR = 1e-30

# One watched signal's rolling window: (history, count, next), fields of the skip_spikes state.
_Window = tuple[jax.Array, jax.Array, jax.Array]


class SkipNonFiniteState(NamedTuple):
  """State of :func:`skip_nonfinite`.

  Attributes:
    skipped: whether the last step was skipped (bool).
    total_skips: number of skipped steps since init (int32).
    consecutive_skips: number of skipped steps in a row, 0 after a good step.
    needs_rollback: ``consecutive_skips >= max_consecutive`` (always False when
      ``max_consecutive`` is None). Clears after the next good step.
    rollback_requests: number of times ``needs_rollback`` was raised since init
      (int32, never decreases). A loop that reads the state only every N steps
      compares it with the value it last acted on, so a burst of skips that
      ended between two reads is not missed.
    inner_state: state of the wrapped transform (unchanged by skipped steps).

  Example:
    Two non-finite steps in a row: both skipped, and with ``max_consecutive=2`` a rollback is
    requested:

    >>> import jax.numpy as jnp, optax, stablejax
    >>> tx = stablejax.skip_nonfinite(optax.sgd(0.1), max_consecutive=2)
    >>> params = {"w": jnp.ones(2)}
    >>> state = tx.init(params)
    >>> for bad in (jnp.nan, jnp.inf):
    ...   updates, state = tx.update({"w": jnp.array([bad, 1.0])}, state, params)
    >>> updates["w"].tolist(), int(state.total_skips), bool(state.needs_rollback)
    ([0.0, 0.0], 2, True)
  """

  skipped: jax.Array
  total_skips: jax.Array
  consecutive_skips: jax.Array
  needs_rollback: jax.Array
  rollback_requests: jax.Array
  inner_state: Any


class SkipSpikesState(NamedTuple):
  """State of :func:`skip_spikes`.

  Attributes:
    skipped: whether the last step was skipped (bool).
    total_skips: number of skipped steps since init (int32).
    consecutive_skips: number of skipped steps in a row, 0 after a good step.
    needs_rollback: ``consecutive_skips >= max_consecutive``.
    rollback_requests: number of times ``needs_rollback`` was raised since init
      (see :class:`SkipNonFiniteState`).
    loss_history: ring buffer (float32, ``[window]``) of recent losses.
    loss_count: number of valid entries in ``loss_history`` (int32).
    loss_next: ring-buffer position of the next loss (int32).
    grad_norm_history: ring buffer of recent raw global gradient norms.
    grad_norm_count: number of valid entries in ``grad_norm_history``.
    grad_norm_next: ring-buffer position of the next gradient norm.
    grad_norm: raw global gradient norm of the last step (float32).
    inner_state: state of the wrapped transform (unchanged by skipped steps).

  Example:
    A loss of 50 after four losses near 2 is skipped:

    >>> import jax.numpy as jnp, optax, stablejax
    >>> tx = stablejax.skip_spikes(optax.sgd(0.1), window=8, min_history=4)
    >>> params = {"w": jnp.ones(2)}
    >>> state = tx.init(params)
    >>> for loss in (2.0, 2.1, 1.9, 2.0, 50.0):
    ...   updates, state = tx.update({"w": jnp.ones(2)}, state, params, loss=jnp.asarray(loss))
    >>> bool(state.skipped), updates["w"].tolist(), int(state.loss_count)
    (True, [0.0, 0.0], 5)
  """

  skipped: jax.Array
  total_skips: jax.Array
  consecutive_skips: jax.Array
  needs_rollback: jax.Array
  rollback_requests: jax.Array
  loss_history: jax.Array
  loss_count: jax.Array
  loss_next: jax.Array
  grad_norm_history: jax.Array
  grad_norm_count: jax.Array
  grad_norm_next: jax.Array
  grad_norm: jax.Array
  inner_state: Any


def _skip_counters(skip: jax.Array, state: Union[SkipNonFiniteState, SkipSpikesState],
                   max_consecutive: Optional[int]
                   ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
  """New (skipped, total, consecutive, needs_rollback, rollback_requests)."""
  total = jnp.where(skip, _common.safe_increment(state.total_skips),
                    state.total_skips)
  consecutive = jnp.where(skip,
                          _common.safe_increment(state.consecutive_skips),
                          jnp.zeros([], jnp.int32))
  requests = state.rollback_requests
  if max_consecutive is None:
    rollback = jnp.array(False)
  else:
    limit = jnp.asarray(max_consecutive, jnp.int32)
    rollback = consecutive >= limit
    # Counted once per run of skips (consecutive passes the limit exactly once):
    # a level read only every N steps misses a burst that ended in between.
    requests = jnp.where(consecutive == limit,
                         _common.safe_increment(requests), requests)
  return skip, total, consecutive, rollback, requests


def _apply_or_skip(skip: jax.Array, inner_updates: optax.Updates, inner_new_state: optax.OptState,
                   inner_old_state: optax.OptState) -> tuple[optax.Updates, optax.OptState]:
  """Zero updates and the old inner state if ``skip``; else the inner result.

  One conditional picks the whole result (as :func:`optax.apply_if_finite` does), not a
  ``jnp.where`` per leaf: each of those fused with the computation of its leaf into a kernel of
  its own, which XLA:CPU compiled one by one.
  """
  new_state = jax.tree.map(lambda new, old: jnp.asarray(new).astype(jnp.asarray(old).dtype),
                           inner_new_state, inner_old_state)

  def skipped(updates: optax.Updates, new: optax.OptState, old: optax.OptState
              ) -> tuple[optax.Updates, optax.OptState]:
    return jax.tree.map(jnp.zeros_like, updates), old

  def applied(updates: optax.Updates, new: optax.OptState, old: optax.OptState
              ) -> tuple[optax.Updates, optax.OptState]:
    return updates, new

  return jax.lax.cond(skip, skipped, applied, inner_updates, new_state, inner_old_state)


def _loss_all_finite(loss: jax.typing.ArrayLike) -> jax.Array:
  return jnp.all(jnp.isfinite(jnp.asarray(loss)))


def _check_max_consecutive(max_consecutive: Optional[int]) -> None:
  _common.check("max_consecutive", max_consecutive,
                lambda v: v >= 1 and float(v).is_integer(),
                "use an integer >= 1, or None for no rollback flag")


def skip_nonfinite(
    inner: optax.GradientTransformation,
    max_consecutive: Optional[int] = None,
) -> optax.GradientTransformationExtraArgs:
  """Skips every step with a NaN/Inf gradient, loss or update, exactly.

  When any gradient entry, the ``loss=`` extra argument (if given) or any
  update produced by ``inner`` is NaN/Inf, the step returns zero updates and
  the whole inner state is kept as it was: the run is identical to one where
  the step never happened. Checking ``inner``'s updates as well means no
  non-finite update ever leaves this wrapper, even when the gradients were
  finite (e.g. an overflow inside the inner transform). Unlike
  :func:`optax.apply_if_finite` it never gives up and lets a non-finite update
  through; instead it raises ``needs_rollback`` once ``max_consecutive`` steps
  in a row were skipped, for the training loop to act on, and counts it in
  ``rollback_requests`` (which a loop reading the state every N steps uses).

  Extra arguments (``loss=`` and any other) are forwarded to ``inner`` (through
  :func:`optax.with_extra_args_support`, so a plain ``GradientTransformation``
  just ignores them).

  Args:
    inner: the transform (or chain) to protect.
    max_consecutive: number of consecutive skips that raises
      ``needs_rollback``; None never raises it.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs` whose state is a
    :class:`SkipNonFiniteState`.

  References:
    Micikevicius et al., `Mixed Precision Training
    <https://arxiv.org/abs/1710.03740>`_ (arXiv:1710.03740), which skips the
    weight update of a step whose gradients overflowed; compare
    :func:`optax.apply_if_finite`.

  Example:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import stablejax
    >>> tx = stablejax.skip_nonfinite(optax.adam(1e-3), max_consecutive=3)
    >>> params = {"w": jnp.ones(2)}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.array([jnp.nan, 1.0])}, state,
    ...                            params, loss=jnp.array(2.0))
    >>> updates["w"].tolist(), bool(state.skipped)
    ([0.0, 0.0], True)
  """
  _check_max_consecutive(max_consecutive)
  inner = optax.with_extra_args_support(inner)

  def init_fn(params: optax.Params) -> SkipNonFiniteState:
    return SkipNonFiniteState(
        skipped=jnp.array(False),
        total_skips=jnp.zeros([], jnp.int32),
        consecutive_skips=jnp.zeros([], jnp.int32),
        needs_rollback=jnp.array(False),
        rollback_requests=jnp.zeros([], jnp.int32),
        inner_state=inner.init(params),
    )

  def update_fn(updates: optax.Updates, state: SkipNonFiniteState,
                params: Optional[optax.Params] = None, **extra_args: Any
                ) -> tuple[optax.Updates, SkipNonFiniteState]:
    inner_updates, inner_state = inner.update(
        updates, state.inner_state, params, **extra_args)
    ok = _common.all_finite_pairs(updates, inner_updates)
    loss = extra_args.get("loss")
    if loss is not None:
      ok = jnp.logical_and(ok, _loss_all_finite(loss))
    skip = jnp.logical_not(ok)
    new_updates, new_inner = _apply_or_skip(
        skip, inner_updates, inner_state, state.inner_state)
    skipped, total, consecutive, rollback, requests = _skip_counters(
        skip, state, max_consecutive)
    return new_updates, SkipNonFiniteState(
        skipped=skipped,
        total_skips=total,
        consecutive_skips=consecutive,
        needs_rollback=rollback,
        rollback_requests=requests,
        inner_state=new_inner,
    )

  # update_fn takes its own state type where optax's protocol says any OptState.
  return optax.GradientTransformationExtraArgs(init_fn, update_fn)  # type: ignore[arg-type]


def window_stats(history: jax.Array, count: jax.Array, ddof: int = 0
                 ) -> tuple[jax.Array, jax.Array]:
  """Mean and std of the first ``count`` entries of ``history``.

  ``ddof=0`` gives the population std, ``ddof=1`` the unbiased one (torch's
  default, used by OLMo-core).
  """
  valid = jnp.arange(history.shape[0]) < count
  n = jnp.maximum(count, 1).astype(_common.STAT_DTYPE)
  mean = jnp.sum(jnp.where(valid, history, 0.0)) / n
  dof = jnp.maximum(count - ddof, 1).astype(_common.STAT_DTYPE)
  var = jnp.sum(jnp.where(valid, jnp.square(history - mean), 0.0)) / dof
  return mean, jnp.sqrt(var)


def log_sigma_threshold(history: jax.Array, count: jax.Array, sigma: float) -> jax.Array:
  """``exp(mean + sigma * std)`` of the logarithms of the first ``count`` entries (population
  std): the sigma rule on the log scale, a multiple of the window's geometric mean."""
  logs = jnp.log(jnp.maximum(history, _LOG_FLOOR))
  mean, std = window_stats(logs, count)
  return jnp.exp(mean + _common.f32(sigma) * std)


def _spike_check(value: jax.Array, window_state: _Window, min_history: int,
                 sigma: Optional[float], factor: Optional[float], statistics: str,
                 log_scale: bool = False) -> tuple[jax.Array, _Window]:
  """Returns (is_bad, (new_history, new_count, new_next)) for one signal; ``log_scale``: the
  sigma rule on the logarithms of the window (the window itself holds the values)."""
  history, count, nxt = window_state
  window = history.shape[0]
  olmo = statistics == "olmo_core"
  mean, std = window_stats(history, count, ddof=1 if olmo else 0)
  threshold = jnp.array(jnp.inf, _common.STAT_DTYPE)
  if sigma is not None and log_scale:
    threshold = jnp.minimum(threshold, log_sigma_threshold(history, count, sigma))
  elif sigma is not None:
    threshold = jnp.minimum(threshold, mean + _common.f32(sigma) * std)
  if factor is not None:
    threshold = jnp.minimum(threshold, _common.f32(factor) * mean)
  active = count >= jnp.asarray(min_history, jnp.int32)
  finite = jnp.isfinite(value)
  outlier = jnp.logical_and(active, value > threshold)
  bad = jnp.logical_or(~finite, outlier)
  # Winsorised: an outlier enters clipped to the threshold. OLMo-core: raw.
  entry = value if olmo else jnp.where(active, jnp.minimum(value, threshold),
                                       value)
  new_history = jnp.where(finite, history.at[nxt].set(entry), history)
  new_count = jnp.where(finite, jnp.minimum(count + 1, window), count)
  new_next = jnp.where(finite, (nxt + 1) % window, nxt)
  return bad, (new_history, new_count.astype(jnp.int32), new_next.astype(jnp.int32))


_DEFAULT_WINDOW = 128


def skip_spikes(
    inner: optax.GradientTransformation,
    *,
    window: Optional[int] = None,
    min_history: Optional[int] = None,
    sigma: Optional[float] = 6.0,
    factor: Optional[float] = None,
    watch: Optional[Sequence[str]] = None,
    max_consecutive: Optional[int] = 16,
    statistics: str = "winsorized",
) -> optax.GradientTransformationExtraArgs:
  """Skips a step whose loss or gradient norm spikes against a rolling window.

  For each watched signal (the ``loss=`` extra argument and/or the raw global
  norm of the incoming gradients, in float32) a ring buffer keeps the last
  ``window`` values. Once it holds ``min_history`` values, a step is an
  outlier when ``value - mean > sigma * std`` or, when ``factor`` is set,
  ``value > factor * mean`` (either rule is enough; ``sigma=None`` leaves only
  the factor rule, so ``sigma=None, factor=10`` is "skip if the gradient norm
  is more than 10x the average"). A non-finite watched value also skips the
  step. A skipped step returns zero updates and keeps the whole inner state.

  The window never absorbs a non-finite value. With the default
  ``statistics="winsorized"`` an outlier enters it clipped to the threshold,
  so one spike does not inflate the statistics (and hide the next one) while a
  lasting change of scale is absorbed over a few steps; the std is the
  population std and skipping starts after ``window // 2`` values.

  ``statistics="olmo_core"`` is OLMo-core's ``SkipStepOptimizer`` rule
  (``get_step_factor``; window 128, sigma 6 there): every finite value enters
  the window raw, skipped or not; the std is unbiased (``ddof=1``, torch's
  default); skipping starts once ``max(20, window // 2) - 1`` earlier values
  are held (OLMo-core counts the current value in its list). With ``sigma=6,
  factor=None`` and both signals watched it gives OLMo-core's decisions on
  every finite value. The one difference kept on purpose: a non-finite value
  skips the step but never enters the window, where in OLMo-core it makes the
  window's mean NaN and skips the next ``window + 1`` steps too.

  ``statistics="log_norm"`` (the trainer's default) is the winsorized window
  with the gradient norm's sigma rule taken on the logarithms of its window:
  a norm is an outlier above ``exp(mean(log g) + sigma * std(log g))``, a
  multiple of the window's geometric mean (the loss keeps the linear rule, and
  the window still holds the norms, winsorized at that threshold). Gradient
  norms are positive and fluctuate by factors: on a clean Muon run of
  ``bench/stress.py --long`` (1x) every skip of the linear rule was a norm
  2.3x to 3.5x the window mean at a coefficient of variation near 0.2, which
  ``mean + 6 std`` (about 2.2x the mean there) calls a spike; on the log scale
  a 2.5x step is about 4.6 standard deviations, while a 10x spike stays far
  beyond 6 (README, "spike skip").

  Args:
    inner: the transform (or chain) to protect.
    window: number of recent values kept per signal; None: 128. A Python int
      (it is a shape): left at its default it stays static under
      :func:`optax.inject_hyperparams`; an explicit value needs
      ``static_args=("window",)`` there.
    min_history: number of earlier values needed before skipping can start;
      None: ``window // 2`` (winsorized) or ``max(20, window // 2) - 1``
      (olmo_core), i.e. 64 and 63 at ``window=128``.
    sigma: skip when ``value - mean > sigma * std``; None disables this rule.
    factor: skip when ``value > factor * mean``; None (default) disables it.
    watch: signals to watch, a subset of ``("loss", "grad_norm")``. Watching
      ``"loss"`` explicitly requires ``update(..., loss=loss)`` (a non-scalar
      loss is averaged). None (default): the gradient norm always, and the loss
      whenever ``update`` is given ``loss=``; an update without it (Flax's
      ``TrainState.apply_gradients(grads=...)``, which passes no extra
      argument) watches the gradient norm alone. The trade-off: there a loss
      spike that leaves the gradient norm in range goes through; pass
      ``loss=`` (see :func:`stablejax.apply_gradients`) to watch both.
    max_consecutive: consecutive skips that raise ``needs_rollback``; None
      never raises it.
    statistics: ``"winsorized"`` (default), ``"olmo_core"`` or ``"log_norm"``, see
      above.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs` whose state is a
    :class:`SkipSpikesState`.

  References:
    OLMo-core, ``olmo_core/optim/skip_step_optimizer.py``
    (https://github.com/allenai/OLMo-core); Chowdhery et al., `PaLM <https://arxiv.org/abs/2204.02311>`_
    (arXiv:2204.02311), section 5.1; Molybog et al., `A Theory on Adam
    Instability in Large-Scale Machine Learning
    <https://arxiv.org/abs/2304.09871>`_ (arXiv:2304.09871).

  Example:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import stablejax
    >>> tx = stablejax.skip_spikes(optax.sgd(0.1), window=8, min_history=4,
    ...                            watch=("grad_norm",), sigma=None, factor=10)
    >>> params = {"w": jnp.ones(2)}
    >>> state = tx.init(params)
    >>> for _ in range(4):
    ...   _, state = tx.update({"w": jnp.ones(2)}, state, params)
    >>> updates, state = tx.update({"w": jnp.full(2, 100.0)}, state, params)
    >>> bool(state.skipped), updates["w"].tolist()
    (True, [0.0, 0.0])
  """
  if window is None:
    window = _DEFAULT_WINDOW
  if isinstance(window, bool) or not isinstance(window, int) or window < 1:
    raise ValueError(
        f"window={window!r} is invalid: use a Python int >= 1 (with "
        "optax.inject_hyperparams pass static_args=('window',)).")
  if statistics not in _STATISTICS:
    raise ValueError(f"statistics={statistics!r} is invalid: use one of "
                     f"{_STATISTICS}.")
  if min_history is None:
    if statistics == "olmo_core":
      min_history = max(20, window // 2) - 1
      if min_history > window:
        raise ValueError(
            f"window={window} is too short for statistics='olmo_core': its "
            "rule needs 19 earlier values, so it never skips with a window "
            "below 19; use window >= 19.")
    else:
      min_history = max(1, window // 2)
  _common.check("min_history", min_history,
                lambda v: 1 <= v <= window and float(v).is_integer(),
                f"use an integer between 1 and window={window}")
  _common.check("sigma", sigma, lambda v: v > 0,
                "use a positive number of standard deviations, or None")
  _common.check("factor", factor, lambda v: v > 0,
                "use a positive multiple of the mean, or None")
  if sigma is None and factor is None:
    raise ValueError("sigma and factor are both None: set at least one rule, "
                     "e.g. sigma=6.0 or factor=10.0.")
  loss_optional = watch is None  # the default: the loss when update() is given one
  if watch is None:
    watch = _WATCHABLE
  if isinstance(watch, str):
    watch = (watch,)
  watch = tuple(watch)
  if not watch or any(w not in _WATCHABLE for w in watch):
    raise ValueError(
        f"watch={watch!r} is invalid: use a non-empty subset of {_WATCHABLE}.")
  _check_max_consecutive(max_consecutive)
  inner = optax.with_extra_args_support(inner)

  def init_fn(params: optax.Params) -> SkipSpikesState:
    empty = jnp.zeros([window], _common.STAT_DTYPE)
    zero = jnp.zeros([], jnp.int32)
    return SkipSpikesState(
        skipped=jnp.array(False),
        total_skips=zero,
        consecutive_skips=zero,
        needs_rollback=jnp.array(False),
        rollback_requests=jnp.zeros([], jnp.int32),
        loss_history=empty,
        loss_count=zero,
        loss_next=zero,
        grad_norm_history=empty,
        grad_norm_count=zero,
        grad_norm_next=zero,
        grad_norm=jnp.zeros([], _common.STAT_DTYPE),
        inner_state=inner.init(params),
    )

  def update_fn(updates: optax.Updates, state: SkipSpikesState,
                params: Optional[optax.Params] = None, **extra_args: Any
                ) -> tuple[optax.Updates, SkipSpikesState]:
    grad_norm = _common.global_norm_f32(updates)
    skip = jnp.array(False)
    loss_hist: _Window = (state.loss_history, state.loss_count, state.loss_next)
    norm_hist: _Window = (state.grad_norm_history, state.grad_norm_count,
                          state.grad_norm_next)
    loss = extra_args.get("loss")
    if "loss" in watch and not (loss is None and loss_optional):
      if loss is None:
        raise ValueError(
            "skip_spikes watches 'loss' but update() got no loss=: pass "
            "loss=... or leave watch=None (the loss when given, else the gradient norm "
            "alone), or use watch=('grad_norm',).")
      loss = jnp.mean(_common.f32(loss))
      bad, loss_hist = _spike_check(loss, loss_hist, min_history, sigma,
                                    factor, statistics)
      skip = jnp.logical_or(skip, bad)
    if "grad_norm" in watch:
      bad, norm_hist = _spike_check(grad_norm, norm_hist, min_history, sigma, factor,
                                    statistics, log_scale=statistics == "log_norm")
      skip = jnp.logical_or(skip, bad)

    inner_updates, inner_state = inner.update(
        updates, state.inner_state, params, **extra_args)
    new_updates, new_inner = _apply_or_skip(
        skip, inner_updates, inner_state, state.inner_state)
    skipped, total, consecutive, rollback, requests = _skip_counters(
        skip, state, max_consecutive)
    return new_updates, SkipSpikesState(
        skipped=skipped,
        total_skips=total,
        consecutive_skips=consecutive,
        needs_rollback=rollback,
        rollback_requests=requests,
        loss_history=loss_hist[0],
        loss_count=loss_hist[1],
        loss_next=loss_hist[2],
        grad_norm_history=norm_hist[0],
        grad_norm_count=norm_hist[1],
        grad_norm_next=norm_hist[2],
        grad_norm=grad_norm,
        inner_state=new_inner,
    )

  # update_fn takes its own state type where optax's protocol says any OptState.
  return optax.GradientTransformationExtraArgs(init_fn, update_fn)  # type: ignore[arg-type]


def _skip_metrics(s: Union[SkipNonFiniteState, SkipSpikesState]) -> dict[str, jax.Array]:
  return {
      "skipped": s.skipped,
      "total_skips": s.total_skips,
      "consecutive_skips": s.consecutive_skips,
      "needs_rollback": s.needs_rollback,
      "rollback_requests": s.rollback_requests,
  }


def _skip_spikes_metrics(s: SkipSpikesState) -> dict[str, jax.Array]:
  out = _skip_metrics(s)
  out["loss_mean"] = window_stats(s.loss_history, s.loss_count)[0]
  out["grad_norm_mean"] = window_stats(s.grad_norm_history, s.grad_norm_count)[0]
  out["grad_norm"] = s.grad_norm.astype(_common.STAT_DTYPE)
  return out


register_state_metrics(
    SkipNonFiniteState, "skip_nonfinite", _skip_metrics,
    rates=(Rate("skip_nonfinite_rate", flag="skipped", counter="total_skips",
                label="non-finite skips", skip=True),),
    nonfinite="skipped", acted="skipped", skips="total_skips", rollback="rollback_requests")
register_state_metrics(
    SkipSpikesState, "skip_spikes", _skip_spikes_metrics,
    rates=(Rate("skip_spikes_rate", flag="skipped", counter="total_skips",
                label="spike skips", skip=True),),
    grad_norm="grad_norm", acted="skipped", skips="total_skips", rollback="rollback_requests")


# ----------------------------------------------------------------------------- the declarations


@dataclasses.dataclass
class SkipSpikesConfig:
  """``stability.skip_spikes``: skip a step whose loss or gradient norm is an outlier of its
  rolling window (arguments of :func:`skip_spikes`; it watches both). ``min_history`` null: the
  rule's default (64, or 63 for ``statistics="olmo_core"``, OLMo-core's exact rule).
  ``statistics`` ``"log_norm"``: the gradient norm's sigma rule on the log scale (the linear
  ``"winsorized"`` rule skipped 2.3x-3.5x norms of clean Muon runs, README)."""

  enabled: bool = True
  window: int = 64
  min_history: Optional[int] = 32
  sigma: Optional[float] = 6.0
  factor: Optional[float] = None
  statistics: str = "log_norm"
  max_consecutive: int = 16

  def validate(self, where: str, ctx: defence.DefenceContext) -> None:
    if self.sigma is None and self.factor is None:
      raise ValueError(f"{where}.sigma and {where}.factor are both null: set one (e.g. "
                       f"sigma=6.0 or factor=10.0) or {where}.enabled=false")
    for name in ("sigma", "factor"):
      if getattr(self, name) is not None:
        defence.check_positive(f"{where}.{name}", getattr(self, name))
    if self.statistics not in _STATISTICS:
      raise ValueError(f"{where}.statistics={self.statistics!r} is not known: use \"log_norm\", "
                       "\"winsorized\" or \"olmo_core\"")
    defence.check_positive(f"{where}.window", self.window)
    if self.min_history is not None and not 1 <= self.min_history <= self.window:
      raise ValueError(f"{where}.min_history={self.min_history} must lie in [1, {where}.window="
                       f"{self.window}]")
    if self.statistics == "olmo_core" and self.min_history is None and self.window < 19:
      raise ValueError(f"{where}.window={self.window} is below 19: OLMo-core's rule "
                       f"({where}.statistics=\"olmo_core\") never skips there; use a window >= 19")
    defence.check_positive(f"{where}.max_consecutive", self.max_consecutive)


@dataclasses.dataclass
class SkipNonFiniteConfig:
  """``stability.skip_nonfinite``: a NaN/Inf step leaves parameters and every optimizer state
  untouched, outermost in the chain (:func:`skip_nonfinite`); ``max_consecutive`` skips in a row
  ask the trainer for a rollback."""

  enabled: bool = True
  max_consecutive: int = 16

  def validate(self, where: str, ctx: defence.DefenceContext) -> None:
    defence.check_positive(f"{where}.max_consecutive", self.max_consecutive)


SKIP_SPIKES = defence.Defence(
    name="skip_spikes", config=SkipSpikesConfig, position=defence.Position.WRAPPER, order=10,
    factory=skip_spikes, step_args=("loss",),
    label="spike skip (loss and gradient-norm outliers)")

SKIP_NONFINITE = defence.Defence(
    name="skip_nonfinite", config=SkipNonFiniteConfig, position=defence.Position.WRAPPER,
    order=20, factory=skip_nonfinite, label="finite-check skip (NaN/Inf steps)")
