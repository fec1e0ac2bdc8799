"""Dynamic loss scaling for float16 training.

Micikevicius et al., "Mixed Precision Training", arXiv:1710.03740: multiply the
loss by a scale before differentiating so small float16 gradients do not flush
to zero, divide the gradients by it afterwards, shrink the scale on overflow
and grow it again after a run of finite steps.

The defaults are conservative (start at 2**10, grow x1.5 after 200 finite steps
in a row, halve on overflow, never below 1). bfloat16 and float32 training do
not need loss scaling.
"""

from __future__ import annotations

import optax
from typing import Any, Sequence

import jax
import jax.numpy as jnp

from stablejax.transforms import _common


@jax.tree_util.register_pytree_node_class
class DynamicLossScale:
  """fp16 dynamic loss scale: a pytree of two arrays, usable inside ``jit``.

  The array leaves are ``loss_scale`` (float32) and ``counter`` (int32, finite
  steps in a row since the last change); the policy (``growth_interval``,
  ``growth_factor``, ``backoff_factor``, ``min_scale``) is static pytree
  metadata. Every method returns new values; nothing is mutated.

  Args:
    loss_scale: initial scale (default ``2**10``).
    growth_interval: finite steps in a row after which the scale grows.
    growth_factor: multiplier applied when growing (> 1).
    backoff_factor: multiplier applied on overflow (in (0, 1)).
    min_scale: floor of the scale.
    counter: initial counter (for restoring a saved scale).

  Returns:
    (constructor) a ``DynamicLossScale``.

  References:
    Micikevicius et al., `Mixed Precision Training
    <https://arxiv.org/abs/1710.03740>`_, 2017 (arXiv:1710.03740).

  Example:
    >>> import jax
    >>> import jax.numpy as jnp
    >>> import stablejax
    >>> from stablejax.transforms.loss_scaling import all_finite
    >>> ls = stablejax.DynamicLossScale()
    >>> params = jnp.ones(3, jnp.float16)
    >>> loss_fn = lambda p: jnp.sum(p * p)
    >>> @jax.jit
    ... def step(params, ls):
    ...   grads = jax.grad(lambda p: ls.scale(loss_fn(p)))(params)
    ...   grads = ls.unscale(grads)
    ...   return grads, ls.adjust(all_finite(grads))
    >>> grads, ls = step(params, ls)
    >>> grads.tolist(), float(ls.loss_scale), int(ls.counter)
    ([2.0, 2.0, 2.0], 1024.0, 1)
  """

  def __init__(self, loss_scale: Any = 2.0**10, growth_interval: int = 200,
               growth_factor: float = 1.5, backoff_factor: float = 0.5, min_scale: float = 1.0,
               counter: Any = 0) -> None:
    if isinstance(growth_interval, bool) or not isinstance(
        growth_interval, int) or growth_interval < 1:
      raise ValueError(f"growth_interval={growth_interval!r} is invalid: use "
                       "an int >= 1, e.g. 200.")
    if not float(growth_factor) > 1.0:
      raise ValueError(f"growth_factor={growth_factor!r} is invalid: use a "
                       "factor > 1, e.g. 1.5.")
    if not 0.0 < float(backoff_factor) < 1.0:
      raise ValueError(f"backoff_factor={backoff_factor!r} is invalid: use a "
                       "factor in (0, 1), e.g. 0.5.")
    if not float(min_scale) > 0.0:
      raise ValueError(f"min_scale={min_scale!r} is invalid: use a positive "
                       "floor, e.g. 1.0.")
    if _common.is_concrete_number(loss_scale) and not loss_scale >= min_scale:
      raise ValueError(f"loss_scale={loss_scale!r} is invalid: use a value >= "
                       f"min_scale={min_scale}.")
    self.loss_scale = jnp.asarray(loss_scale, jnp.float32)
    self.counter = jnp.asarray(counter, jnp.int32)
    self.growth_interval = int(growth_interval)
    self.growth_factor = float(growth_factor)
    self.backoff_factor = float(backoff_factor)
    self.min_scale = float(min_scale)

  @classmethod
  def create(cls, initial_scale: float = 2.0**10, *, growth_interval: int = 200,
             growth_factor: float = 1.5, backoff_factor: float = 0.5,
             min_scale: float = 1.0) -> "DynamicLossScale":
    """Builds a fresh loss scale (counter 0); same as the constructor.

    Args:
      initial_scale: initial scale (default ``2**10``).
      growth_interval: finite steps in a row after which the scale grows.
      growth_factor: multiplier applied when growing.
      backoff_factor: multiplier applied on overflow.
      min_scale: floor of the scale.

    Returns:
      a ``DynamicLossScale``.

    Example:
      >>> import stablejax
      >>> float(stablejax.DynamicLossScale.create(initial_scale=256.0).loss_scale)
      256.0
    """
    return cls(loss_scale=initial_scale, growth_interval=growth_interval,
               growth_factor=growth_factor, backoff_factor=backoff_factor,
               min_scale=min_scale)

  # -- pytree protocol: arrays are leaves, the policy is static metadata. --
  def tree_flatten(self) -> tuple[tuple[jax.Array, jax.Array], tuple[int, float, float, float]]:
    aux = (self.growth_interval, self.growth_factor, self.backoff_factor,
           self.min_scale)
    return (self.loss_scale, self.counter), aux

  @classmethod
  def tree_unflatten(cls, aux: tuple[int, float, float, float], children: Sequence[Any]
                     ) -> "DynamicLossScale":
    obj = object.__new__(cls)  # leaves may be tracers, shardings, None...
    obj.loss_scale, obj.counter = children
    (obj.growth_interval, obj.growth_factor, obj.backoff_factor,
     obj.min_scale) = aux
    return obj

  def _replace(self, loss_scale: jax.Array, counter: jax.Array) -> "DynamicLossScale":
    return self.tree_unflatten(self.tree_flatten()[1], (loss_scale, counter))

  def __repr__(self) -> str:
    return (f"DynamicLossScale(loss_scale={self.loss_scale!r}, "
            f"counter={self.counter!r}, growth_interval={self.growth_interval}"
            f", growth_factor={self.growth_factor}, backoff_factor="
            f"{self.backoff_factor}, min_scale={self.min_scale})")

  def scale(self, loss: jax.Array) -> jax.Array:
    """Multiplies the loss by the current scale.

    Args:
      loss: the (scalar) loss, any float dtype.

    Returns:
      ``loss * loss_scale`` in the loss's dtype.

    Example:
      >>> import jax.numpy as jnp
      >>> import stablejax
      >>> float(stablejax.DynamicLossScale().scale(jnp.float16(2.0)))
      2048.0
    """
    loss = jnp.asarray(loss)
    return (loss.astype(jnp.float32) * self.loss_scale).astype(loss.dtype)

  def unscale(self, grads: optax.Updates) -> Any:
    """Divides every gradient by the current scale.

    The division is done in float32 and cast back, so each leaf keeps its
    dtype.

    Args:
      grads: pytree of gradients of the scaled loss.

    Returns:
      the pytree of true gradients, same structure and dtypes.

    Example:
      >>> import jax.numpy as jnp
      >>> import stablejax
      >>> stablejax.DynamicLossScale().unscale(jnp.full(2, 2048.0)).tolist()
      [2.0, 2.0]
    """
    inv = 1.0 / self.loss_scale
    return jax.tree.map(lambda g: _common.scale_leaf(g, inv), grads)

  def adjust(self, grads_finite: jax.Array) -> "DynamicLossScale":
    """Returns the loss scale for the next step.

    A finite step increments the counter; when it reaches ``growth_interval``
    the scale is multiplied by ``growth_factor`` and the counter restarts. An
    overflow multiplies the scale by ``backoff_factor`` (not below
    ``min_scale``) and restarts the counter.

    Args:
      grads_finite: scalar bool, e.g. ``all_finite(grads)``.

    Returns:
      a new ``DynamicLossScale``.

    Example:
      >>> import jax.numpy as jnp
      >>> import stablejax
      >>> float(stablejax.DynamicLossScale().adjust(jnp.array(False)).loss_scale)
      512.0
    """
    grads_finite = jnp.asarray(grads_finite, jnp.bool_)
    counter = self.counter + 1
    grow = counter >= self.growth_interval
    finite_scale = jnp.where(grow, self.loss_scale * self.growth_factor,
                             self.loss_scale)
    finite_counter = jnp.where(grow, 0, counter)
    backoff_scale = jnp.maximum(self.loss_scale * self.backoff_factor,
                                self.min_scale)
    loss_scale = jnp.where(grads_finite, finite_scale, backoff_scale)
    counter = jnp.where(grads_finite, finite_counter, 0)
    return self._replace(loss_scale.astype(jnp.float32),
                         counter.astype(jnp.int32))


def all_finite(tree: optax.Params) -> jax.Array:
  """Scalar bool: every entry of every leaf of ``tree`` is finite.

  Args:
    tree: a pytree of arrays (e.g. unscaled gradients).

  Returns:
    a scalar boolean array, True for an empty tree.

  Example:
    >>> import jax.numpy as jnp
    >>> from stablejax.transforms.loss_scaling import all_finite
    >>> bool(all_finite({"a": jnp.ones(2), "b": jnp.array([1.0, jnp.inf])}))
    False
  """
  return _common.all_finite(tree)
