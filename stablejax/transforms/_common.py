"""Small helpers shared by the stablejax transforms.

Everything here is traceable: no host transfer, no Python branch on array
values. Statistics are always kept in float32, whatever the gradient dtype.
"""

from __future__ import annotations

import numbers
from typing import Any, Callable, Optional, Sequence, TypeGuard, Union

import jax
import jax.numpy as jnp
import optax
import optax.tree

STAT_DTYPE = jnp.float32
_INT32_MAX = jnp.iinfo(jnp.int32).max


def f32(x: jax.typing.ArrayLike) -> jax.Array:
  """Returns ``x`` as a float32 array (hyperparameters, statistics)."""
  return jnp.asarray(x, dtype=STAT_DTYPE)


def global_norm_f32(tree: optax.Updates) -> jax.Array:
  """Global L2 norm of ``tree`` computed in float32 (bf16 grads do not overflow)."""
  leaves = jax.tree.leaves(tree)
  squares = [jnp.sum(jnp.square(jnp.asarray(x, STAT_DTYPE))) for x in leaves]
  return jnp.sqrt(sum_of_scalars(squares))


def materialize(x: jax.typing.ArrayLike) -> jax.Array:
  """The scalar ``x``, computed once and stored before anything reads it.

  A transform's decision (skip this step, clip by this factor) is a chain of scalar operations
  that every parameter's update and every state entry then reads. XLA copies cheap scalar
  chains into each fusion that reads them (``optimization_barrier`` does not stop it on CPU,
  where it is removed before fusion): a hundred copies of the decision for a 12-layer model.
  Passing the value through a sort keyed by ``[0, 1]`` (a no-op on two copies of it) makes it
  the output of an operation XLA does not look through, so it is computed once.
  """
  x = jnp.asarray(x)
  keys = jnp.arange(2, dtype=jnp.int32)
  return jax.lax.sort((keys, jnp.stack([x, x])), num_keys=1)[1][0]


def sum_of_scalars(values: Sequence[jax.Array]) -> jax.Array:
  """The sum of per-parameter scalars (squared norms, finiteness probes) as one stored value.

  XLA turns a sum of stacked scalars into a chain of adds as long as the model, and copies such
  cheap chains into every fusion that reads the result: a transform that scales every update
  by a global norm, or selects every state leaf by an all-finite flag, then compiles a
  quadratic amount of code (minutes for a 12-layer model on CPU). Sorting the short vector
  first (about one number per parameter tensor) keeps the sum a single reduction that nothing
  copies; it also adds the small numbers first.
  """
  if not values:
    return jnp.zeros((), STAT_DTYPE)
  if len(values) == 1:  # nothing to add: no stack to trace and compile
    return jnp.asarray(values[0], STAT_DTYPE)
  return jnp.sum(jnp.sort(jnp.stack([jnp.asarray(v, STAT_DTYPE) for v in values])))


def leaf_norm_f32(x: jax.Array) -> jax.Array:
  """L2 norm of one array, computed in float32."""
  return optax.tree.norm(jnp.asarray(x, STAT_DTYPE))


def finite_probe(*arrays: jax.typing.ArrayLike) -> jax.Array:
  """float32 scalar: 0 if every entry of every array is finite, NaN otherwise.

  ``x - x`` is 0 for a finite entry and NaN for NaN or +-Inf (XLA keeps floating ``x - x``), so
  the sum is finite exactly when ``x`` is. A sum of plain arithmetic compiles into XLA:CPU's
  reduction kernels, several times faster than the boolean all-reduction of
  ``jnp.all(jnp.isfinite(x))`` (and, unlike ``x * 0``, without a materialised array of zeros to
  multiply by); arrays of one shape (a parameter's update, momentum and second moment) share one
  reduction.
  """
  floats = [jnp.asarray(x) for x in arrays]
  floats = [x for x in floats if jnp.issubdtype(x.dtype, jnp.inexact)]
  if not floats:
    return jnp.zeros((), STAT_DTYPE)
  by_shape: dict[tuple[int, ...], jax.Array] = {}
  for x in floats:
    xf = x.astype(STAT_DTYPE)
    zero = xf - xf
    by_shape[x.shape] = zero if x.shape not in by_shape else by_shape[x.shape] + zero
  return probe_total([jnp.sum(z) for z in by_shape.values()])


def probe_total(probes: Sequence[jax.Array]) -> jax.Array:
  """The sum of values whose sum does not depend on the order of the additions: finiteness
  probes (0 or NaN, :func:`finite_probe`; NaN when any is) or 0/1 flags (a count).

  So unlike :func:`sum_of_scalars` no sort comes first (a sort is one more kernel to compile);
  the result is read by scalar code (a decision, a count), never by every leaf, so XLA has no
  chain of adds to copy into the leaves' kernels.
  """
  if not probes:
    return jnp.zeros((), STAT_DTYPE)
  if len(probes) == 1:  # a tensor's own probe (one shape): no stack to trace and compile
    return jnp.asarray(probes[0], STAT_DTYPE)
  return jnp.sum(jnp.stack([jnp.asarray(p, STAT_DTYPE) for p in probes]))


def all_finite(tree: optax.Updates) -> jax.Array:
  """Scalar bool: every entry of every leaf of ``tree`` is finite (True if empty)."""
  return jnp.isfinite(probe_total([finite_probe(x) for x in jax.tree.leaves(tree)]))


def all_finite_pairs(tree: optax.Updates, other: optax.Updates) -> jax.Array:
  """``all_finite(tree) & all_finite(other)``, one reduction per pair of same-shaped leaves
  when the trees have the same structure (gradients and updates)."""
  a, b = jax.tree.leaves(tree), jax.tree.leaves(other)
  if jax.tree.structure(tree) != jax.tree.structure(other):  # type: ignore[operator]
    return jnp.logical_and(all_finite(tree), all_finite(other))
  return jnp.isfinite(probe_total([finite_probe(x, y) for x, y in zip(a, b)]))


def scale_leaf(x: jax.Array, scale: jax.Array) -> jax.Array:
  """Multiplies ``x`` by a float32 scalar in float32 and casts back to ``x.dtype``."""
  return (jnp.asarray(x, STAT_DTYPE) * scale).astype(jnp.asarray(x).dtype)


def safe_increment(count: jax.Array) -> jax.Array:
  """int32 counter + 1 that saturates instead of overflowing (optax's)."""
  # optax annotates its result as ArrayLike; it is always an Array (asarray does not copy it).
  return jnp.asarray(optax.safe_increment(count))


def saturating_add(total: jax.Array, inc: jax.Array) -> jax.Array:
  """int32 ``total + inc`` that saturates at int32 max instead of wrapping around."""
  inc = inc.astype(jnp.int32)
  return jnp.where(total > _INT32_MAX - inc, _INT32_MAX, total + inc).astype(jnp.int32)


def is_concrete_number(value: object) -> TypeGuard[float]:
  """True for Python / numpy numbers (not tracers, not bools), the values we can validate."""
  return isinstance(value, numbers.Number) and not isinstance(value, bool)


def check(name: str, value: object, ok: Callable[[float], bool], requirement: str) -> None:
  """Raises ``ValueError`` if a concrete ``value`` fails ``ok(value)``.

  Traced values (e.g. from ``optax.inject_hyperparams``) are not checked.
  """
  if value is None or not is_concrete_number(value):
    return
  if not ok(value):
    raise ValueError(f"{name}={value!r} is invalid: {requirement}.")


# ----------------------------------------------------------------------------- learning rates


LearningRate = Union[float, jax.Array, Callable[[jax.Array], Any]]
"""A learning rate: a number, or an optax schedule (count -> rate)."""
LearningRates = Union[Any, Callable[[Any], Any], None]
"""Per-parameter learning rates: a pytree of :data:`LearningRate` with the structure of the
parameters, or a function ``params -> such a pytree``."""


def check_rate_args(learning_rate: Optional[LearningRate], learning_rates: LearningRates) -> None:
  """Raises ``ValueError`` when both are given, or ``learning_rate`` is a negative number."""
  if learning_rate is not None and learning_rates is not None:
    raise ValueError("learning_rate and learning_rates are both set: give one rate for every "
                     "parameter (learning_rate) or one per parameter (learning_rates), not both.")
  if learning_rate is not None and not callable(learning_rate):
    check("learning_rate", learning_rate, lambda v: v >= 0,
          "use the non-negative rate the incoming updates were multiplied by")


def per_leaf_argument(given: Any, tree: Any, treedef: Any, mismatch: str) -> list[Any]:
  """A per-parameter argument as one entry per leaf of ``tree`` (whose treedef is ``treedef``).

  ``given`` is a pytree with the structure of ``tree`` (its leaves may be subtrees, e.g. None),
  or a function ``tree -> such a pytree``; one that does not match raises ``ValueError`` with
  ``mismatch`` (the problem and the fix) and the structures' difference.
  """
  per_leaf_tree = given(tree) if callable(given) else given
  try:
    return list(treedef.flatten_up_to(per_leaf_tree))
  except (ValueError, TypeError) as e:
    raise ValueError(f"{mismatch} ({e})") from None


def leaf_rates(updates: optax.Updates, count: jax.Array, learning_rate: Optional[LearningRate],
               learning_rates: LearningRates) -> list[Optional[jax.Array]]:
  """The rate of each leaf of ``updates`` at ``count`` (float32, >= 0), or None for no rate."""
  leaves, treedef = jax.tree.flatten(updates)

  def value(rate: LearningRate) -> jax.Array:
    return jnp.abs(f32(rate(count) if callable(rate) else rate))

  if learning_rate is not None:
    shared = value(learning_rate)
    return [shared] * len(leaves)
  if learning_rates is not None:
    per_leaf = per_leaf_argument(
        learning_rates, updates, treedef,
        "learning_rates does not match the updates: give a pytree with the structure of the "
        "parameters (or a function params -> such a pytree)")
    return [value(r) for r in per_leaf]
  return [None] * len(leaves)
