"""Flat, stably named stability metrics from any optax state tree.

Every stablejax transform keeps its diagnostics (raw and clipped norms,
z-scores, thresholds, skip counters...) in its state. :func:`stability_metrics`
walks an optimizer state of any shape (``optax.chain`` tuples,
``MaskedState``, ``MultiStepsState``, ``InjectHyperparamsState``,
``PartitionState``, wrapper states holding an ``inner_state``, any custom
pytree) and returns one flat ``dict[str, jax.Array]`` of scalars, so a training
loop can log them without knowing the chain. Other modules add their own state
types with :func:`register_state_metrics`.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Union

import jax
import jax.numpy as jnp

from stablejax.transforms import _common
from stablejax.transforms.adagc import AdaGCState
from stablejax.transforms.skipping import SkipNonFiniteState
from stablejax.transforms.skipping import SkipSpikesState
from stablejax.transforms.skipping import window_stats
from stablejax.transforms.zclip import ZClipState

MetricsFn = Callable[[Any], Dict[str, jax.Array]]

# state type -> (prefix, fn). Looked up along the type's MRO.
_REGISTRY: dict[type, tuple[str, MetricsFn]] = {}


def register_state_metrics(state_type: type, prefix: str,
                           fn: MetricsFn) -> None:
  """Registers how to turn a state type into metrics.

  :func:`stability_metrics` calls ``fn(state)`` for every instance of
  ``state_type`` (or a subclass) found in an optimizer state and emits
  ``f"{prefix}/{key}"`` for each key of the returned dict. Registering the
  same type again replaces the earlier entry. The walk continues inside a
  registered state, so wrapper states that hold an ``inner_state`` expose the
  inner metrics too.

  Args:
    state_type: the state class (usually a ``NamedTuple`` of arrays).
    prefix: metric prefix without a trailing slash, e.g. ``"muon"``.
    fn: ``state -> dict[str, scalar jax.Array]`` (keys without the prefix);
      must be traceable (no host transfer).

  Returns:
    None.

  Example:
    >>> from typing import NamedTuple
    >>> import jax
    >>> import jax.numpy as jnp
    >>> import stablejax
    >>> class MyState(NamedTuple):
    ...   hits: jax.Array
    >>> stablejax.register_state_metrics(MyState, "mine",
    ...                                  lambda s: {"hits": s.hits})
    >>> stablejax.stability_metrics((MyState(jnp.int32(3)),))
    {'mine/hits': Array(3, dtype=int32)}
  """
  if not isinstance(state_type, type):
    raise ValueError(f"state_type={state_type!r} is invalid: pass the state "
                     "class itself, e.g. ZClipState.")
  if not isinstance(prefix, str) or not prefix or prefix.endswith("/"):
    raise ValueError(f"prefix={prefix!r} is invalid: use a non-empty name "
                     "without a trailing '/', e.g. 'muon'.")
  if not callable(fn):
    raise ValueError("fn is not callable: pass state -> dict of scalars.")
  _REGISTRY[state_type] = (prefix, fn)


def _lookup(node: Any) -> Optional[tuple[str, MetricsFn]]:
  for klass in type(node).__mro__:
    entry = _REGISTRY.get(klass)
    if entry is not None:
      return entry
  return None


def _is_registered(node: Any) -> bool:
  return _lookup(node) is not None


def _registered_inside(state: Any) -> Callable[[Any], bool]:
  """``is_leaf`` for flattening ``state``: the registered states nested in it (not itself)."""
  return lambda x: x is not state and _is_registered(x)


def _walk(node: Any, out: list[tuple[Any, tuple[str, MetricsFn]]]) -> None:
  """Depth-first, in pytree order: collects registered states with their entries."""
  found = jax.tree_util.tree_leaves(node, is_leaf=_is_registered)
  for leaf in found:
    entry = _lookup(leaf)
    if entry is None:
      continue
    out.append((leaf, entry))
    # Look inside the registered state for nested ones (e.g. inner_state).
    fields = jax.tree_util.tree_flatten(leaf, is_leaf=_registered_inside(leaf))[0]
    for field in fields:
      if _is_registered(field):
        _walk(field, out)


def stability_metrics(opt_state: Any) -> dict[str, jax.Array]:
  """Flat dict of scalar stability metrics from any optimizer state.

  Finds every registered state (ZClip, AdaGC, skip wrappers, and whatever
  other modules registered) anywhere in ``opt_state`` and returns
  ``{f"{prefix}/{key}": scalar}``; when a prefix occurs again (e.g. two ZClips
  in one chain) the later ones get ``prefix_1``, ``prefix_2``... in pytree
  order (outer wrappers before their inner states). Works under ``jax.jit``;
  nothing is transferred to the host.

  Keys emitted by the stablejax transforms:

  * ``zclip/``: ``grad_norm``, ``clipped_grad_norm``, ``z``, ``threshold``,
    ``ema_mean``, ``ema_std``, ``was_clipped``, ``is_spike``, ``spike_count``,
    ``clip_count``
  * ``adagc/``: ``clipped_fraction``, ``grad_norm``, ``clipped_grad_norm``
  * ``skip_nonfinite/``: ``skipped``, ``total_skips``, ``consecutive_skips``,
    ``needs_rollback``, ``rollback_requests``
  * ``skip_spikes/``: the five above plus ``loss_mean``, ``grad_norm_mean``
    (means of the rolling windows, 0 while empty) and ``grad_norm``

  Inside ``optax.MultiSteps`` the inner states (and so the metrics) change
  only on the mini-step that applies the accumulated update. A step dropped by
  a skip wrapper leaves the inner states, and so their metrics, as they were
  after the last accepted step; the wrapper's own ``skipped`` says so.

  Args:
    opt_state: any optax optimizer state (or pytree containing one).

  Returns:
    ``dict[str, jax.Array]`` of scalar arrays (float32, int32 or bool).

  Example:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import stablejax
    >>> tx = stablejax.skip_nonfinite(optax.chain(stablejax.zclip(),
    ...                                           optax.sgd(0.1)))
    >>> state = tx.init({"w": jnp.ones(2)})
    >>> m = stablejax.stability_metrics(state)
    >>> m["skip_nonfinite/total_skips"], "zclip/z" in m
    (Array(0, dtype=int32), True)
  """
  states: list[tuple[Any, tuple[str, MetricsFn]]] = []
  _walk(opt_state, states)
  metrics: dict[str, jax.Array] = {}
  seen: dict[str, int] = {}
  for state, (prefix, fn) in states:
    n = seen.get(prefix, 0)
    seen[prefix] = n + 1
    name = prefix if n == 0 else f"{prefix}_{n}"
    for key, value in fn(state).items():
      metrics[f"{name}/{key}"] = jnp.asarray(value)
  return metrics


def _zclip_metrics(s: ZClipState) -> dict[str, jax.Array]:
  return {
      "grad_norm": s.grad_norm,
      "clipped_grad_norm": s.clipped_grad_norm,
      "z": s.z,
      "threshold": s.threshold,
      "ema_mean": s.ema_mean,
      "ema_std": jnp.sqrt(s.ema_var),
      "was_clipped": s.was_clipped,
      "is_spike": s.is_spike,
      "spike_count": s.spike_count,
      "clip_count": s.clip_count,
  }


def _adagc_metrics(s: AdaGCState) -> dict[str, jax.Array]:
  return {
      "clipped_fraction": s.clipped_fraction,
      "grad_norm": s.grad_norm,
      "clipped_grad_norm": s.clipped_grad_norm,
  }


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
  out["grad_norm_mean"] = window_stats(s.grad_norm_history,
                                       s.grad_norm_count)[0]
  out["grad_norm"] = s.grad_norm.astype(_common.STAT_DTYPE)
  return out


register_state_metrics(ZClipState, "zclip", _zclip_metrics)
register_state_metrics(AdaGCState, "adagc", _adagc_metrics)
register_state_metrics(SkipNonFiniteState, "skip_nonfinite", _skip_metrics)
register_state_metrics(SkipSpikesState, "skip_spikes", _skip_spikes_metrics)
