"""An optimizer's moments, per parameter, whatever the optimizer: for defences that read or reset
them.

A defence such as SPAM (Huang et al., "SPAM: Spike-Aware Adam with Momentum Reset for Stable
LLM Training", ICLR 2025, arXiv 2501.06842) clips gradient entries against Adam's second moment
and resets the moments every so many steps. Where those moments live depends on the optimizer
and on how it is assembled: ``optax.adamw`` keeps ``ScaleByAdamState(count, mu, nu)``; inside
``optax.masked``, ``optax.partition`` or ``stablejax.outlier_safe_muon`` each group's state holds
only its parameters; Muon's matrices have a momentum (``mu``) and no second moment; Lion has
``mu`` only. This module finds them by what optax's states have in common: a NamedTuple state
whose fields ``mu`` (the first moment, a momentum) and ``nu`` (the second moment) are shaped like
the parameters, with ``optax.MaskedNode`` where a group does not hold a parameter.

A defence that uses them is a **wrapper** (``Position.WRAPPER``, its state a NamedTuple with an
``inner_state``): it sees the optimizer's state inside its inner state, reads the moments with
:func:`parameter_moments`, runs the inner update and changes the moments with
:func:`map_moments`. ``tests/plugins/spam.py`` is one, written as a user writes it.

Example:
  >>> import jax.numpy as jnp, optax
  >>> from stablejax.transforms.moments import map_moments, parameter_moments
  >>> params = {"w": jnp.ones(2), "b": jnp.ones(3)}
  >>> tx = optax.partition({"a": optax.adam(0.1), "s": optax.sgd(0.1, momentum=0.9)},
  ...                      {"w": "a", "b": "s"})
  >>> state = tx.init(params)
  >>> _, state = tx.update({"w": jnp.full(2, 2.0), "b": jnp.ones(3)}, state, params)
  >>> second = parameter_moments(state, params, "nu")
  >>> second["w"].tolist(), second["b"]     # Adam has a second moment; SGD's momentum does not
  ([0.004..., 0.004...], None)
  >>> state = map_moments(state, lambda kind, path, x: jnp.zeros_like(x))
  >>> parameter_moments(state, params, "mu")["w"].tolist()
  [0.0, 0.0]
"""

from __future__ import annotations

from typing import Any, Callable, Literal

import jax
import optax

Kind = Literal["mu", "nu"]
KINDS: tuple[Kind, ...] = ("mu", "nu")


def _holds_moments(node: Any) -> bool:
  return isinstance(node, tuple) and hasattr(node, "_fields") and any(
      kind in node._fields for kind in KINDS)


def _key(path: tuple) -> tuple[str, ...]:
  return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def parameter_moments(state: optax.OptState, params: optax.Params, kind: Kind) -> Any:
  """``params``' tree with each leaf's ``kind`` moment (``"mu"``: first, ``"nu"``: second) from
  wherever it lies in ``state``, or None for a parameter without one.

  Args:
    state: any optimizer state (a chain's, a keyed one, a wrapper's inner state).
    params: the parameters (or a tree of their shapes): the moments are matched by path.
    kind: ``"mu"`` or ``"nu"``.

  Returns:
    A tree like ``params``; a parameter's moment appears once (a parameter in two groups' states
    would be an optimizer of its own kind: the last one found is returned).
  """
  found: dict[tuple[str, ...], jax.Array] = {}
  for node in jax.tree.leaves(state, is_leaf=_holds_moments):
    if _holds_moments(node) and kind in node._fields:
      for path, leaf in jax.tree_util.tree_leaves_with_path(getattr(node, kind)):
        found[_key(path)] = leaf
  return jax.tree_util.tree_map_with_path(lambda path, _: found.get(_key(path)), params)


def map_moments(state: optax.OptState,
                fn: Callable[[Kind, tuple[str, ...], jax.Array], jax.Array]) -> Any:
  """``state`` with every moment replaced by ``fn(kind, parameter path, moment)``: the same
  shape and dtype (a reset: ``jnp.zeros_like``; a reset of some steps: ``jnp.where(now, 0, x)``).

  Only the moments change: counts, the other fields and every other state stay as they are."""
  def visit(node: Any) -> Any:
    if not _holds_moments(node):
      return node
    changed = {kind: jax.tree_util.tree_map_with_path(
        lambda path, x, kind=kind: fn(kind, _key(path), x), getattr(node, kind))
        for kind in KINDS if kind in node._fields}
    return node._replace(**changed)
  return jax.tree.map(visit, state, is_leaf=_holds_moments)


def has_moments(state: optax.OptState, kind: Kind) -> bool:
  """Whether ``state`` holds any ``kind`` moment (an optimizer without one: SGD, Lion's ``nu``)."""
  return any(_holds_moments(node) and kind in node._fields and jax.tree.leaves(getattr(node, kind))
             for node in jax.tree.leaves(state, is_leaf=_holds_moments))

