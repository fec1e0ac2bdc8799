"""The spike skip: a step whose loss or gradient norm is an outlier against a rolling window.

:func:`skip_spikes` drops such a step (zero updates, the whole inner state kept, as
:mod:`stablejax.transforms.skipping` describes): by default against a winsorised window (an
outlier enters it clipped to the threshold), or exactly OLMo-core's ``SkipStepOptimizer`` rule
with ``statistics="olmo_core"`` (the two differ in three ways, listed in :func:`skip_spikes`).
See also MaxText's ``skip_step_on_spikes``, Molybog et al., "A Theory on Adam Instability in
Large-Scale Machine Learning", arXiv:2304.09871, and Chowdhery et al., "PaLM", arXiv:2204.02311,
section 5.1, on skipping batches around loss spikes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import optax

from stablejax.transforms import _common
from stablejax.transforms import defence
from stablejax.transforms.skipping import (check_max_consecutive, fresh_skip_counters,
                                           register_skip_metrics, skip_metrics,
                                           skip_or_apply_step)

_WATCHABLE = ("loss", "grad_norm")
_STATISTICS = ("winsorized", "olmo_core", "log_norm")
# The smallest gradient norm the log-norm window takes the logarithm of (a zero norm stays finite).
_LOG_FLOOR = 1e-30
_DEFAULT_WINDOW = 128

# One watched signal's rolling window: (history, count, next), fields of the skip_spikes state.
_Window = tuple[jax.Array, jax.Array, jax.Array]


def _window_fields(signal: str, window: _Window) -> dict[str, jax.Array]:
  """``signal``'s rolling window as the skip_spikes state's fields ``<signal>_history``,
  ``<signal>_count`` and ``<signal>_next``."""
  return dict(zip((f"{signal}_history", f"{signal}_count", f"{signal}_next"), window))


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
  inner_state: optax.OptState


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


class _SpikeRule(NamedTuple):
  """The checked outlier rule of :func:`skip_spikes` (its hyperparameters, in its closure)."""

  min_history: int
  sigma: Optional[float]
  factor: Optional[float]
  statistics: str


def _spike_check(value: jax.Array, window_state: _Window, rule: _SpikeRule,
                 log_scale: bool = False) -> tuple[jax.Array, _Window]:
  """Returns (is_bad, (new_history, new_count, new_next)) for one signal; ``log_scale``: the
  sigma rule on the logarithms of the window (the window itself holds the values)."""
  min_history, sigma, factor, statistics = rule
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


def _watch_signals(state: SkipSpikesState, grad_norm: jax.Array,
                   loss: Optional[jax.typing.ArrayLike], watch: tuple[str, ...],
                   loss_optional: bool, rule: _SpikeRule) -> tuple[jax.Array, _Window, _Window]:
  """Whether a watched signal spiked (or is not finite), and the loss and gradient-norm windows
  after this step. ``loss_optional``: the loss is watched only when ``update()`` is given one."""
  skip = jnp.array(False)
  loss_hist: _Window = (state.loss_history, state.loss_count, state.loss_next)
  norm_hist: _Window = (state.grad_norm_history, state.grad_norm_count, state.grad_norm_next)
  if "loss" in watch and not (loss is None and loss_optional):
    if loss is None:
      raise ValueError(
          "skip_spikes watches 'loss' but update() got no loss=: pass "
          "loss=... or leave watch=None (the loss when given, else the gradient norm "
          "alone), or use watch=('grad_norm',).")
    loss = jnp.mean(_common.f32(loss))
    bad, loss_hist = _spike_check(loss, loss_hist, rule)
    skip = jnp.logical_or(skip, bad)
  if "grad_norm" in watch:
    bad, norm_hist = _spike_check(grad_norm, norm_hist, rule,
                                  log_scale=rule.statistics == "log_norm")
    skip = jnp.logical_or(skip, bad)
  return skip, loss_hist, norm_hist


def _checked_window(window: Optional[int]) -> int:
  """``window``, or the default when None; a Python int (it is a shape)."""
  if window is None:
    window = _DEFAULT_WINDOW
  if isinstance(window, bool) or not isinstance(window, int) or window < 1:
    raise ValueError(
        f"window={window!r} is invalid: use a Python int >= 1 (with "
        "optax.inject_hyperparams pass static_args=('window',)).")
  return window


def _checked_rule(window: int, min_history: Optional[int], sigma: Optional[float],
                  factor: Optional[float], statistics: str) -> _SpikeRule:
  """The outlier rule, its ``min_history`` resolved from the window when None."""
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
  return _SpikeRule(min_history, sigma, factor, statistics)


def _checked_watch(watch: Optional[Sequence[str]]) -> tuple[str, ...]:
  """The watched signals; None: both (the loss when ``update()`` is given one)."""
  if watch is None:
    watch = _WATCHABLE
  if isinstance(watch, str):
    watch = (watch,)
  watch = tuple(watch)
  if not watch or any(w not in _WATCHABLE for w in watch):
    raise ValueError(
        f"watch={watch!r} is invalid: use a non-empty subset of {_WATCHABLE}.")
  return watch


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
  window = _checked_window(window)
  rule = _checked_rule(window, min_history, sigma, factor, statistics)
  loss_optional = watch is None  # the default: the loss when update() is given one
  watched = _checked_watch(watch)
  check_max_consecutive(max_consecutive)
  inner = optax.with_extra_args_support(inner)

  def init_fn(params: optax.Params) -> SkipSpikesState:
    empty: _Window = (jnp.zeros([window], _common.STAT_DTYPE), jnp.zeros([], jnp.int32),
                      jnp.zeros([], jnp.int32))
    return SkipSpikesState(
        **fresh_skip_counters(),
        **_window_fields("loss", empty),
        **_window_fields("grad_norm", empty),
        grad_norm=jnp.zeros([], _common.STAT_DTYPE),
        inner_state=inner.init(params),
    )

  def update_fn(updates: optax.Updates, state: SkipSpikesState,
                params: Optional[optax.Params] = None, **extra_args: Any
                ) -> tuple[optax.Updates, SkipSpikesState]:
    grad_norm = _common.global_norm_f32(updates)
    skip, loss_hist, norm_hist = _watch_signals(
        state, grad_norm, extra_args.get("loss"), watched, loss_optional, rule)
    inner_updates, inner_state = inner.update(
        updates, state.inner_state, params, **extra_args)
    new_updates, fields = skip_or_apply_step(skip, inner_updates, inner_state, state,
                                             max_consecutive)
    return new_updates, SkipSpikesState(
        **fields,
        **_window_fields("loss", loss_hist),
        **_window_fields("grad_norm", norm_hist),
        grad_norm=grad_norm,
    )

  # update_fn takes its own state type where optax's protocol says any OptState.
  return optax.GradientTransformationExtraArgs(init_fn, update_fn)  # type: ignore[arg-type]


def _skip_spikes_metrics(s: SkipSpikesState) -> dict[str, jax.Array]:
  out = skip_metrics(s)
  out["loss_mean"] = window_stats(s.loss_history, s.loss_count)[0]
  out["grad_norm_mean"] = window_stats(s.grad_norm_history, s.grad_norm_count)[0]
  out["grad_norm"] = s.grad_norm.astype(_common.STAT_DTYPE)
  return out


register_skip_metrics(SkipSpikesState, "skip_spikes", label="spike skips", order=60,
                      fn=_skip_spikes_metrics, grad_norm="grad_norm")


# ----------------------------------------------------------------------------- the declaration

# The longest window the trainer's config takes: the state holds two float32 histories of this
# many steps on every device and reduces them at each step (a window of 10^8 steps took 3 GB for a
# 40K-parameter model, 10^9 did not fit), while a spike is judged against the last hundreds.
MAX_WINDOW = 100_000

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
    if self.window > MAX_WINDOW:
      raise ValueError(f"{where}.window={self.window} must be at most {MAX_WINDOW} (steps of "
                       "losses and gradient norms its state holds on every device)")
    if self.min_history is not None and not 1 <= self.min_history <= self.window:
      raise ValueError(f"{where}.min_history={self.min_history} must lie in [1, {where}.window="
                       f"{self.window}]")
    if self.statistics == "olmo_core" and self.min_history is None and self.window < 19:
      raise ValueError(f"{where}.window={self.window} is below 19: OLMo-core's rule "
                       f"({where}.statistics=\"olmo_core\") never skips there; use a window >= 19")
    defence.check_positive(f"{where}.max_consecutive", self.max_consecutive)


SKIP_SPIKES = defence.Defence(
    name="skip_spikes", config=SkipSpikesConfig, position=defence.Position.WRAPPER, order=10,
    factory=skip_spikes, step_args=("loss",),
    label="spike skip (loss and gradient-norm outliers)")
