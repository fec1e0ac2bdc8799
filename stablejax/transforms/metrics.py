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

import optax
import dataclasses
from typing import Any, Callable, Dict, Optional, Sequence

import jax
import jax.numpy as jnp

from stablejax.transforms import _registry

MetricsFn = Callable[[Any], Dict[str, jax.Array]]


@dataclasses.dataclass(frozen=True)
class Rate:
  """A window rate the monitor keeps from a state's metrics (:class:`stablejax.StabilityMonitor`).

  With a ``counter`` (a cumulative count), the events between two logged steps are the counter's
  difference; without a baseline (the first record, a rollback) the per-step ``flag`` of the
  logged step is a one-step sample. Without a counter the rate is the mean of the per-step
  ``flag`` values (a fraction) over the logged steps of the window.

  Attributes:
    name: the rate's name in ``StabilityMonitor.rates()``, e.g. ``"zclip_spike_rate"``.
    flag: metric key (without the prefix) of the per-step flag or fraction.
    counter: metric key (without the prefix) of the cumulative count, if any.
    label: how the report and the benchmarks name it, e.g. ``"ZClip spike rate"``.
    budget: the rate at which this signal alone brings the stability score to 0.8 (None: it
      is reported, not scored).
    advice: the troubleshooting line when the rate exceeds its budget (``{value}`` is the rate).
    skip: counts skipped steps (the monitor's ``skip_rate`` is the sum of these, at most 1).
    tensors: counts tensors, not steps (a flag above 0 is one event; the rate is not capped at
      one per step).
  """

  name: str
  flag: str
  counter: Optional[str] = None
  label: str = ""
  budget: Optional[float] = None
  advice: Optional[str] = None
  skip: bool = False
  tensors: bool = False


@dataclasses.dataclass(frozen=True)
class Series:
  """A line of a state's metrics in a panel of the run report (``python -m stablejax report``).

  Attributes:
    key: metric key without the prefix; ``"*"`` plots every key of the prefix.
    label: the legend entry (``"*"``: each key's own name).
    panel: ``"grad_norm"`` (the gradient-norm panel), ``"update_rms"`` or ``"attention"``.
    style: matplotlib line style.
  """

  key: str
  label: str
  panel: str
  style: str = "-"


@dataclasses.dataclass(frozen=True)
class MetricsSpec:
  """How one state type becomes metrics, and how the monitor, TensorBoard and the report read
  them (see :func:`register_state_metrics`)."""

  state_type: type
  prefix: str
  fn: MetricsFn
  rates: tuple[Rate, ...] = ()
  series: tuple[Series, ...] = ()
  band: Optional[tuple[str, str, str]] = None
  grad_norm: Optional[str] = None
  threshold: Optional[str] = None
  nonfinite: Optional[str] = None
  acted: Optional[str] = None
  update_norm: Optional[str] = None
  skips: Optional[str] = None
  rollback: Optional[str] = None
  order: int = 1000

  def key(self, name: str) -> str:
    """The full metric key of ``name`` (``"spike_count"`` -> ``"zclip/spike_count"``)."""
    return f"{self.prefix}/{name}"


# state type -> spec. Looked up along the type's MRO.
_REGISTRY: dict[type, MetricsSpec] = {}


def register_state_metrics(state_type: type, prefix: str, fn: MetricsFn, *,
                           rates: Sequence[Rate] = (), series: Sequence[Series] = (),
                           band: Optional[tuple[str, str, str]] = None,
                           grad_norm: Optional[str] = None,
                           threshold: Optional[str] = None,
                           nonfinite: Optional[str] = None,
                           acted: Optional[str] = None,
                           update_norm: Optional[str] = None,
                           skips: Optional[str] = None,
                           rollback: Optional[str] = None,
                           order: int = 1000) -> None:
  """Registers how to turn a state type into metrics, and how they are monitored.

  :func:`stability_metrics` calls ``fn(state)`` for every instance of
  ``state_type`` (or a subclass) found in an optimizer state and emits
  ``f"{prefix}/{key}"`` for each key of the returned dict. Registering the
  same type again replaces the earlier entry. The walk continues inside a
  registered state, so wrapper states that hold an ``inner_state`` expose the
  inner metrics too. The keyword arguments tell the rest of stablejax what the
  keys mean: :class:`stablejax.StabilityMonitor` keeps the ``rates`` (and the
  stability score their budgets), TensorBoard files every key under
  ``stability/<prefix>/``, and the run report draws the ``series``.

  Args:
    state_type: the state class (usually a ``NamedTuple`` of arrays).
    prefix: metric prefix without a trailing slash, e.g. ``"muon"``.
    fn: ``state -> dict[str, scalar jax.Array]`` (keys without the prefix);
      must be traceable (no host transfer).
    rates: the window rates the monitor keeps from these metrics.
    series: the report's lines drawn from these metrics.
    band: ``(mean key, std key, label)``: a shaded mean +- std band in the report's
      gradient-norm panel.
    grad_norm: key of the raw global gradient norm, a reading of the gradient health
      when a record has no top-level ``grad_norm``.
    threshold: key of the clip value in effect (``StabilityMonitor.rates()`` reports the
      latest as ``<prefix>_threshold``).
    nonfinite: key of a flag saying the step's gradient was non-finite (the gradient health
      level is then "exploded").
    acted: key of a per-step flag (or fraction of tensors) that is above 0 when this transform
      acted on the step: clipped or skipped it. The monitor does not warn about a gradient
      health transition of a single logged step that a defence acted on (it was handled).
    update_norm: key of the global norm of the update the optimizer produced, where the update
      applied to the parameters differs from it (a compensated bf16 update moves each parameter
      by whole steps of its resolution); the monitor's update-norm rule reads it instead of the
      record's ``update_norm``.
    skips: key of the cumulative count of steps this transform skipped: the trainer sums these
      for its skipped-step count.
    rollback: key of the cumulative count of rollback requests (a run of skips too long to wait
      out): the trainer rolls back when it grows.
    order: where its rates and lines come among the others (smaller first, then by prefix):
      the monitor's rates, the report and the generated tables list them in this order, whatever
      order the modules were imported in (the built-in transforms' follow the chain).

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
  _REGISTRY[state_type] = MetricsSpec(state_type, prefix, fn, tuple(rates), tuple(series),
                                      band, grad_norm, threshold, nonfinite, acted, update_norm,
                                      skips, rollback, order)
  _registry.changed()


def unregister_state_metrics(state_type: type) -> None:
  """Forgets ``state_type`` (a no-op when it was not registered)."""
  if _REGISTRY.pop(state_type, None) is not None:
    _registry.changed()


def metric_specs() -> tuple[MetricsSpec, ...]:
  """Every registered spec, by ``order`` then prefix (the monitor and the report read these)."""
  return tuple(sorted(_REGISTRY.values(), key=lambda spec: (spec.order, spec.prefix)))


def _lookup(node: Any) -> Optional[MetricsSpec]:
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


def _walk(node: Any, out: list[tuple[Any, MetricsSpec]]) -> None:
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


def stability_metrics(opt_state: optax.OptState) -> dict[str, jax.Array]:
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
  states: list[tuple[Any, MetricsSpec]] = []
  _walk(opt_state, states)
  metrics: dict[str, jax.Array] = {}
  seen: dict[str, int] = {}
  for state, spec in states:
    n = seen.get(spec.prefix, 0)
    seen[spec.prefix] = n + 1
    name = spec.prefix if n == 0 else f"{spec.prefix}_{n}"
    for key, value in spec.fn(state).items():
      metrics[f"{name}/{key}"] = jnp.asarray(value)
  return metrics
