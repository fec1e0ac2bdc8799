"""Flax's ``TrainState`` with the extra arguments of a stablejax chain.

Most Flax examples train with ``flax.training.train_state.TrainState`` and step with
``state.apply_gradients(grads=grads)``, which calls ``tx.update(grads, opt_state, params)`` and
can pass nothing else. A stablejax chain used that way works (``skip_spikes`` then watches the
gradient norm alone, ``skip_nonfinite`` the gradients and updates); :func:`apply_gradients` is the
same step with the extra arguments optax's ``GradientTransformationExtraArgs`` take: ``loss=``
for the spike check, ``max_logits=`` for :func:`stablejax.qk_clip`.
"""

from __future__ import annotations

from typing import Any, TypeVar

import optax

State = TypeVar("State")


def apply_gradients(state: State, *, grads: optax.Updates, **extra_args: Any) -> State:
  """``state.apply_gradients(grads=grads)`` that also hands ``extra_args`` to ``tx.update``.

  ``state`` is a ``flax.training.train_state.TrainState`` (or any dataclass with ``step``,
  ``params``, ``tx``, ``opt_state`` and ``replace``, as Flax's ``struct.PyTreeNode`` gives).
  Flax's own method calls ``tx.update(grads, opt_state, params)`` with no extra argument, so a
  chain that reads ``loss=`` (:func:`stablejax.skip_spikes`) or ``max_logits=``
  (:func:`stablejax.qk_clip`) cannot get them through it; this is the same step with them:
  ``step + 1``, ``params`` updated with ``optax.apply_updates``, the new ``opt_state``.

  Args:
    state: the train state.
    grads: gradients with the structure of ``state.params``.
    **extra_args: keyword arguments for ``state.tx.update`` (``loss=``, ``max_logits=``...).

  Returns:
    The new train state.

  Example:
    >>> import jax, jax.numpy as jnp, optax, stablejax
    >>> from flax.training import train_state
    >>> tx = stablejax.skip_spikes(optax.sgd(0.1), window=4, min_history=2)
    >>> state = train_state.TrainState.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=tx)
    >>> for loss in (1.0, 1.1, 0.9, 80.0):   # the last loss is a spike: skipped
    ...   state = stablejax.apply_gradients(state, grads={"w": jnp.ones(2)}, loss=jnp.asarray(loss))
    >>> int(state.step), bool(state.opt_state.skipped), state.params["w"].tolist()
    (4, True, [0.7, 0.7])
  """
  for name in ("step", "params", "tx", "opt_state", "replace"):
    if not hasattr(state, name):
      raise ValueError(f"apply_gradients: state has no {name!r}; pass a "
                       "flax.training.train_state.TrainState (or a dataclass with step, params, "
                       "tx, opt_state and replace)")
  s: Any = state
  updates, opt_state = optax.with_extra_args_support(s.tx).update(grads, s.opt_state, s.params,
                                                                  **extra_args)
  return s.replace(step=s.step + 1, params=optax.apply_updates(s.params, updates),
                   opt_state=opt_state)
