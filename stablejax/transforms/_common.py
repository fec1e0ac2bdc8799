"""Small helpers shared by the stablejax transforms.

Everything here is traceable: no host transfer, no Python branch on array
values. Statistics are always kept in float32, whatever the gradient dtype.
"""

from __future__ import annotations

import numbers
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import optax
import optax.tree

STAT_DTYPE = jnp.float32


def f32(x: Any) -> jax.Array:
  """Returns ``x`` as a float32 array (hyperparameters, statistics)."""
  return jnp.asarray(x, dtype=STAT_DTYPE)


def global_norm_f32(tree: Any) -> jax.Array:
  """Global L2 norm of ``tree`` computed in float32 (bf16 grads do not overflow)."""
  return optax.tree.norm(optax.tree.cast(tree, STAT_DTYPE))


def leaf_norm_f32(x: jax.Array) -> jax.Array:
  """L2 norm of one array, computed in float32."""
  return optax.tree.norm(jnp.asarray(x, STAT_DTYPE))


def all_finite(tree: Any) -> jax.Array:
  """Scalar bool: every entry of every leaf of ``tree`` is finite (True if empty)."""
  leaves = jax.tree.leaves(tree)
  if not leaves:
    return jnp.array(True)
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def scale_leaf(x: jax.Array, scale: jax.Array) -> jax.Array:
  """Multiplies ``x`` by a float32 scalar in float32 and casts back to ``x.dtype``."""
  return (jnp.asarray(x, STAT_DTYPE) * scale).astype(jnp.asarray(x).dtype)


def select_tree(pred: jax.Array, on_true: Any, on_false: Any) -> Any:
  """Per-leaf ``jnp.where(pred, a, b)`` keeping the dtype of ``on_false``."""
  return jax.tree.map(
      lambda a, b: jnp.where(pred, a, b).astype(jnp.asarray(b).dtype),
      on_true,
      on_false,
  )


def safe_increment(count: jax.Array) -> jax.Array:
  """int32 counter + 1 that saturates instead of overflowing (optax's)."""
  # optax annotates its result as ArrayLike; it is always an Array (asarray does not copy it).
  return jnp.asarray(optax.safe_increment(count))


def is_concrete_number(value: Any) -> bool:
  """True for Python / numpy numbers (not tracers), the values we can validate."""
  return isinstance(value, numbers.Number) and not isinstance(value, bool)


def check(name: str, value: Any, ok: Callable[[Any], bool], requirement: str) -> None:
  """Raises ``ValueError`` if a concrete ``value`` fails ``ok(value)``.

  Traced values (e.g. from ``optax.inject_hyperparams``) are not checked.
  """
  if value is None or not is_concrete_number(value):
    return
  if not ok(value):
    raise ValueError(f"{name}={value!r} is invalid: {requirement}.")


def extra_arg_scalar(extra_args: Mapping[str, Any], name: str) -> jax.Array | None:
  """Returns ``extra_args[name]`` as a float32 array, or None if absent."""
  value = extra_args.get(name)
  if value is None:
    return None
  return f32(value)
