"""The finite-check skip: a step with a NaN/Inf gradient, loss or update is dropped exactly.

:func:`skip_nonfinite` returns zero updates for such a step and keeps the whole inner state as it
was (:mod:`stablejax.transforms.skipping`), so the run is identical to one where the step never
happened; after ``max_consecutive`` skips in a row it asks the training loop for a rollback.
Compare :func:`optax.apply_if_finite`, which gives up and lets a non-finite update through after
a number of skips. Micikevicius et al., "Mixed Precision Training", arXiv:1710.03740, skip the
weight update of a step whose gradients overflowed.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from stablejax.transforms import _common
from stablejax.transforms import defence
from stablejax.transforms.skipping import (check_max_consecutive, fresh_skip_counters,
                                           register_skip_metrics, skip_or_apply_step)


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
  inner_state: optax.OptState


def _loss_all_finite(loss: jax.typing.ArrayLike) -> jax.Array:
  return jnp.all(jnp.isfinite(jnp.asarray(loss)))


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
  check_max_consecutive(max_consecutive)
  inner = optax.with_extra_args_support(inner)

  def init_fn(params: optax.Params) -> SkipNonFiniteState:
    return SkipNonFiniteState(**fresh_skip_counters(), inner_state=inner.init(params))

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
    new_updates, fields = skip_or_apply_step(skip, inner_updates, inner_state, state,
                                             max_consecutive)
    return new_updates, SkipNonFiniteState(**fields)

  # update_fn takes its own state type where optax's protocol says any OptState.
  return optax.GradientTransformationExtraArgs(init_fn, update_fn)  # type: ignore[arg-type]


register_skip_metrics(SkipNonFiniteState, "skip_nonfinite", label="non-finite skips", order=50,
                      nonfinite="skipped")


# ----------------------------------------------------------------------------- the declaration


@dataclasses.dataclass
class SkipNonFiniteConfig:
  """``stability.skip_nonfinite``: a NaN/Inf step leaves parameters and every optimizer state
  untouched, outermost in the chain (:func:`skip_nonfinite`); ``max_consecutive`` skips in a row
  ask the trainer for a rollback."""

  enabled: bool = True
  max_consecutive: int = 16

  def validate(self, where: str, ctx: defence.DefenceContext) -> None:
    defence.check_positive(f"{where}.max_consecutive", self.max_consecutive)


SKIP_NONFINITE = defence.Defence(
    name="skip_nonfinite", config=SkipNonFiniteConfig, position=defence.Position.WRAPPER,
    order=20, factory=skip_nonfinite, label="finite-check skip (NaN/Inf steps)")
