"""What every skip wrapper shares: a skipped step happens as if it never did.

The two wrappers are :func:`stablejax.skip_nonfinite` (module
:mod:`stablejax.transforms.finite_skip`), which drops steps with NaN/Inf gradients, loss or
updates, and :func:`stablejax.skip_spikes` (:mod:`stablejax.transforms.spike_skip`), which drops
steps whose loss or gradient norm is an outlier against a rolling window.

A skipped step returns zero updates and keeps the *entire* inner state (Adam
moments, counts, ZClip/AdaGC statistics, Muon momentum) exactly as it was, so
a run with a skipped step is identical to the run without that step. The inner
update is always computed and the result chosen with one ``lax.cond`` (zero
updates and the old state, or the inner result): no Python branch on traced
values, no host transfer. Both wrappers count their skips the same way and raise
``needs_rollback`` after ``max_consecutive`` skips in a row, for the training loop to act on.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

import jax
import jax.numpy as jnp
import optax

from stablejax.transforms import _common
from stablejax.transforms.metrics import MetricsFn, Rate, register_state_metrics


class SkipCounters(Protocol):
  """The fields every skip wrapper's state has (:class:`stablejax.SkipNonFiniteState`,
  :class:`stablejax.SkipSpikesState`)."""

  @property
  def skipped(self) -> jax.Array: ...
  @property
  def total_skips(self) -> jax.Array: ...
  @property
  def consecutive_skips(self) -> jax.Array: ...
  @property
  def needs_rollback(self) -> jax.Array: ...
  @property
  def rollback_requests(self) -> jax.Array: ...


COUNTER_FIELDS = ("skipped", "total_skips", "consecutive_skips", "needs_rollback",
                  "rollback_requests")
"""The :class:`SkipCounters` fields, in the order :func:`skip_counters` returns them."""


class WrapperState(SkipCounters, Protocol):
  """A skip wrapper's state: the counters and the wrapped transform's state."""

  @property
  def inner_state(self) -> optax.OptState: ...


def skip_counters(skip: jax.Array, state: SkipCounters, max_consecutive: Optional[int]
                  ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
  """New (skipped, total, consecutive, needs_rollback, rollback_requests): the values of
  :data:`COUNTER_FIELDS`, in that order."""
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


def fresh_skip_counters() -> dict[str, jax.Array]:
  """The :class:`SkipCounters` fields of a new wrapper state (no skip yet), by name."""
  return {
      "skipped": jnp.array(False),
      "total_skips": jnp.zeros([], jnp.int32),
      "consecutive_skips": jnp.zeros([], jnp.int32),
      "needs_rollback": jnp.array(False),
      "rollback_requests": jnp.zeros([], jnp.int32),
  }


def skip_or_apply_step(skip: jax.Array, inner_updates: optax.Updates,
                       inner_new_state: optax.OptState, state: WrapperState,
                       max_consecutive: Optional[int]
                       ) -> tuple[optax.Updates, dict[str, Any]]:
  """A skip wrapper's step once ``skip`` is decided: the updates, and the new state's
  :class:`SkipCounters` fields and ``inner_state`` by name (:func:`apply_or_skip`,
  :func:`skip_counters`)."""
  new_updates, new_inner = apply_or_skip(skip, inner_updates, inner_new_state, state.inner_state)
  counters = skip_counters(skip, state, max_consecutive)
  return new_updates, dict(zip(COUNTER_FIELDS, counters), inner_state=new_inner)


def apply_or_skip(skip: jax.Array, inner_updates: optax.Updates, inner_new_state: optax.OptState,
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


def check_max_consecutive(max_consecutive: Optional[int]) -> None:
  """Raises ``ValueError`` unless ``max_consecutive`` is None or an integer >= 1."""
  _common.check("max_consecutive", max_consecutive,
                lambda v: v >= 1 and float(v).is_integer(),
                "use an integer >= 1, or None for no rollback flag")


def skip_metrics(s: SkipCounters) -> dict[str, jax.Array]:
  """The metrics every skip wrapper reports (:func:`stablejax.stability_metrics`): its counters."""
  return {name: getattr(s, name) for name in COUNTER_FIELDS}



def register_skip_metrics(state_type: type, prefix: str, *, label: str, order: int,
                          fn: MetricsFn = skip_metrics, grad_norm: Optional[str] = None,
                          nonfinite: Optional[str] = None) -> None:
  """Registers a skip wrapper's state (:func:`stablejax.register_state_metrics`): its metrics
  ``fn``, the skip rate ``<prefix>_rate`` (``label``) from its counters, and the counters as the
  steps it acted on, skipped and asked a rollback for; ``grad_norm`` and ``nonfinite`` as there."""
  register_state_metrics(
      state_type, prefix, fn,
      rates=(Rate(f"{prefix}_rate", flag="skipped", counter="total_skips", label=label,
                  skip=True),),
      acted="skipped", skips="total_skips", rollback="rollback_requests", order=order,
      grad_norm=grad_norm, nonfinite=nonfinite)
