"""A chain whose state is keyed by name, wrappers included: the trainer's optimizer state.

``optax.named_chain`` keys the states of a chain's transforms by name; a wrapper around the chain
(the skip wrappers, optax's ``apply_if_finite``) still nests the whole chain's state inside its
own (``inner_state``), so switching a wrapper on or off moves every other state. :func:`keyed_chain`
keeps each wrapper's own fields under its name too, next to the chain's entries::

    {"skip_nonfinite": SkipNonFiniteState(..., inner_state=None),
     "skip_spikes": SkipSpikesState(..., inner_state=None),
     "zclip": ZClipState(...), "optimizer": {"muon": ...}, "lr_scale": ...}

Each ``update`` nests the state as the wrappers expect, runs the wrapped chain, and keys the
result again: pure tree rearrangement, nothing computed. A defence switched on between two starts
of a run then only adds its key, one switched off only removes its own (after Levanter's keyed
``SkipStepState``, which survives its wrapper being switched on or off).
"""

from __future__ import annotations

import collections
from typing import Any, Optional, Sequence

import optax

KeyedState = dict
OPTIMIZER_KEY = "optimizer"   # the entry {optimizer name: its state} of the trainer's state


def nest(name: str, tx: Any) -> optax.GradientTransformationExtraArgs:
  """``tx`` with its state under ``{name: state}`` (the optimizer's name in the trainer's state).

  Example:
    >>> import jax.numpy as jnp, optax
    >>> tx = nest("adamw", optax.adamw(1e-3))
    >>> list(tx.init({"w": jnp.ones(2)}))
    ['adamw']
  """
  tx = optax.with_extra_args_support(tx)

  def init(params: optax.Params) -> dict:
    return {name: tx.init(params)}

  def update(updates: optax.Updates, state: dict, params: Optional[optax.Params] = None,
             **extra: Any) -> tuple[optax.Updates, dict]:
    updates, inner = tx.update(updates, state[name], params, **extra)
    return updates, {name: inner}

  # update takes its own state type where optax's protocol says any OptState.
  return optax.GradientTransformationExtraArgs(init, update)  # type: ignore[arg-type]


def keyed_chain(entries: Sequence[tuple[str, Any]],
                wrappers: Sequence[tuple[str, Any]] = ()) -> optax.GradientTransformationExtraArgs:
  """``optax.named_chain(*entries)`` inside ``wrappers`` (innermost first), state keyed by name.

  Args:
    entries: ``(name, transform)`` pairs, applied in order.
    wrappers: ``(name, inner -> wrapped)`` pairs, innermost first; each wrapped transform's state
      must be a NamedTuple with an ``inner_state`` field.

  Returns:
    A transform whose state is a dict with one entry per name (a wrapper's entry is its state with
    ``inner_state=None``); its updates are those of the nested chain.

  Raises:
    ValueError: a name occurs twice.

  Example:
    >>> import jax.numpy as jnp, optax, stablejax
    >>> tx = keyed_chain([("zclip", stablejax.zclip()), ("sgd", optax.sgd(0.1))],
    ...                  [("skip_nonfinite", stablejax.skip_nonfinite)])
    >>> state = tx.init({"w": jnp.ones(2)})
    >>> sorted(state)
    ['sgd', 'skip_nonfinite', 'zclip']
    >>> state["skip_nonfinite"].inner_state is None
    True
    >>> updates, state = tx.update({"w": jnp.full(2, jnp.nan)}, state, {"w": jnp.ones(2)})
    >>> int(state["skip_nonfinite"].total_skips), updates["w"].tolist()
    (1, [0.0, 0.0])
  """
  names = [name for name, _ in entries] + [name for name, _ in wrappers]
  repeated = sorted({n for n in names if names.count(n) > 1})
  if repeated:
    raise ValueError(f"keyed_chain: the name(s) {', '.join(repeated)} occur twice")
  tx: Any = optax.named_chain(*[(name, optax.with_extra_args_support(t)) for name, t in entries])
  for _, wrap in wrappers:
    tx = wrap(tx)
  tx = optax.with_extra_args_support(tx)
  outermost_first = [name for name, _ in reversed(wrappers)]

  def to_keys(nested: Any) -> KeyedState:
    keyed = {}
    for name in outermost_first:
      keyed[name] = nested._replace(inner_state=None)
      nested = nested.inner_state
    return {**keyed, **nested}  # a plain dict: checkpoints store it by key

  def to_nested(keyed: KeyedState) -> Any:
    # named_chain's own state type (an OrderedDict), so a wrapper can select between its old
    # and new inner states
    nested: Any = collections.OrderedDict((name, keyed[name]) for name, _ in entries)
    for name in reversed(outermost_first):
      nested = keyed[name]._replace(inner_state=nested)
    return nested

  def init(params: optax.Params) -> KeyedState:
    return to_keys(tx.init(params))

  def update(updates: optax.Updates, state: KeyedState, params: Optional[optax.Params] = None,
             **extra: Any) -> tuple[optax.Updates, KeyedState]:
    updates, nested = tx.update(updates, to_nested(state), params, **extra)
    return updates, to_keys(nested)

  return optax.GradientTransformationExtraArgs(init, update)  # type: ignore[arg-type]


def is_keyed(opt_state: optax.OptState) -> bool:
  """Whether ``opt_state`` is the trainer's keyed state (a dict with an ``"optimizer"`` entry)."""
  return isinstance(opt_state, dict) and isinstance(opt_state.get(OPTIMIZER_KEY), dict)


def to_positional(keyed: KeyedState, chain: Sequence[str], wrappers: Sequence[str]) -> Any:
  """The state the same defences had as a positional ``optax.chain`` in their wrappers (the
  layout checkpoints had before states were keyed): ``chain`` names the entries in order (the
  optimizer's entry holds its state directly), ``wrappers`` innermost first.

  Example:
    >>> state = {"zclip": "z", "optimizer": {"adamw": "a"}, "lr_scale": "s"}
    >>> to_positional(state, ["zclip", "optimizer", "lr_scale"], [])
    ('z', 'a', 's')
  """
  def entry(name: str) -> Any:
    value = keyed[name]
    return next(iter(value.values())) if name == OPTIMIZER_KEY else value

  nested: Any = tuple(entry(name) for name in chain)
  for name in wrappers:
    nested = keyed[name]._replace(inner_state=nested)
  return nested


def from_positional(positional: Any, chain: Sequence[str], wrappers: Sequence[str],
                    optimizer_name: str) -> KeyedState:
  """The inverse of :func:`to_positional`.

  Example:
    >>> from_positional(("z", "a", "s"), ["zclip", "optimizer", "lr_scale"], [], "adamw")
    {'zclip': 'z', 'optimizer': {'adamw': 'a'}, 'lr_scale': 's'}
  """
  keyed: KeyedState = {}
  node = positional
  for name in reversed(list(wrappers)):
    keyed[name] = node._replace(inner_state=None)
    node = node.inner_state
  for name, value in zip(chain, node):
    keyed[name] = {optimizer_name: value} if name == OPTIMIZER_KEY else value
  return keyed
