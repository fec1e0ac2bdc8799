"""Printing the routing in effect: :func:`describe_routing`.

No global or hidden state: the routing of a transform is read from what the transform itself
holds. ``jax.eval_shape(tx.init, params)`` gives the optimizer state, whose
:class:`~stablejax.GroupUpdateRmsState` nodes say how many ``outlier_safe_muon`` the chain holds
and which parameters each one sees (an enclosing ``optax.masked`` leaves some out); the
arguments that decide each one's routing and learning rates
(:class:`~stablejax.muon.routing.RoutingInfo`) are read from the transform (the closures of
``optax.chain`` and of any wrapper hold the transforms they wrap, as optax builds them); under
``optax.inject_hyperparams`` the wrapper holds the arguments it was given, and the transform is
built again from them. Kept apart from :mod:`stablejax.muon.routing` because it imports
:mod:`stablejax.muon.muon`, which itself imports the routing: this module sits on top of both.
"""

from __future__ import annotations

import functools
import inspect
import math
import types
import warnings
from typing import Any, Optional, cast

import jax
import numpy as np
import optax

from stablejax.muon import lr_check
from stablejax.muon import routing
from stablejax.muon.labels import GROUPS
from stablejax.muon.matrices import layout_name
from stablejax.layout.analysis import param_leaves
from stablejax.muon.muon import GroupUpdateRmsState, outlier_safe_muon, recorded_labels


class NoOutlierSafeMuonError(ValueError):
  """The transform given to :func:`describe_routing` contains no ``outlier_safe_muon``."""


def _is_transform(x: Any) -> bool:
  return callable(getattr(x, "init", None)) and callable(getattr(x, "update", None))


def _closure_env(fn: Any) -> dict:
  env = {}
  code = getattr(fn, "__code__", None)
  for name, cell in zip(getattr(code, "co_freevars", ()), getattr(fn, "__closure__", None) or ()):
    try:
      env[name] = cell.cell_contents
    except ValueError:  # empty cell
      pass
  return env


# Each wrapper (a transform, its init's closure) is two levels: room for a trainer's chain of
# wrapped, keyed and injected transforms; the walk skips what it has seen, so cycles end.
_MAX_DEPTH = 64


def _reachable(tx: object) -> list[object]:
  """Everything ``tx`` holds, depth first in the order it holds it (a chain's transforms in
  order): closures, bound methods, partials, containers and object attributes."""
  seen: set = set()
  out: list = []
  stack: list = [(tx, 0)]
  while stack:
    obj, depth = stack.pop()
    if id(obj) in seen or depth > _MAX_DEPTH or isinstance(obj, (str, bytes, int, float, type,
                                                          types.ModuleType)):
      continue
    seen.add(id(obj))
    out.append(obj)
    children: list = []
    if isinstance(obj, types.MethodType):
      children = [obj.__func__, obj.__self__]
    elif isinstance(obj, types.FunctionType):
      children = list(_closure_env(obj).values())
    elif isinstance(obj, functools.partial):
      children = [obj.func, *obj.args, *obj.keywords.values()]
    elif isinstance(obj, (tuple, list)):
      children = list(obj)
    elif isinstance(obj, dict):
      children = list(obj.values())
    elif hasattr(obj, "__dict__"):
      children = list(vars(obj).values())
    stack += [(c, depth + 1) for c in reversed(children)]
  return out


def _injected(fn: object) -> Optional[dict]:
  """The closure of ``fn`` if it is the ``init`` or ``update`` of
  ``optax.inject_hyperparams(outlier_safe_muon)(...)``: it holds the arguments that wrapper was
  given (``other_hps``, ``numeric_hps``, ``sched_hps``)."""
  env = _closure_env(fn)
  factory = env.get("inner_factory")
  if factory is None or inspect.unwrap(factory) is not outlier_safe_muon \
      or "numeric_hps" not in env:
    return None
  return env


def routing_infos(tx: optax.GradientTransformation) -> list[tuple[routing.RoutingInfo, bool]]:
  """The routing arguments of every ``outlier_safe_muon`` in ``tx``, in chain order, each with
  whether ``optax.inject_hyperparams`` injects its hyperparameters."""
  found: list = []
  wrappers: set = set()  # an injecting wrapper's init and update share their arguments
  for obj in _reachable(tx):
    if isinstance(obj, routing.RoutingInfo):
      found.append((obj, False))
      continue
    env = _injected(obj) if isinstance(obj, types.FunctionType) else None
    if env is None or id(env["numeric_hps"]) in wrappers:
      continue
    wrappers.add(id(env["numeric_hps"]))
    given = dict(env.get("other_hps", {}), **env["numeric_hps"])
    given.update({k: getattr(v, "schedule_fn", v) for k, v in env.get("sched_hps", {}).items()})
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      rebuilt = outlier_safe_muon(**given)
    found += [(info, True) for info, _ in routing_infos(rebuilt)]
  return found


def _format_lr(lr: Any) -> str:
  if lr is None:
    return "-"
  if callable(lr):
    values = lr_check.schedule_values(lr)
    return f"schedule (start {values[0]:.3g}, peak {values.max():.3g})"
  return f"{float(np.asarray(lr)):.3g}"


def _rates_for_display(info: routing.RoutingInfo, injected: bool) -> dict[str, str]:
  suffix = " (injected)" if injected else ""
  return {group: _format_lr(lr) + suffix for group, lr in info.learning_rates.items()}


def _table(p: routing.RoutingPlan, rates: dict) -> str:
  rows = []
  totals = {g: [0, 0] for g in GROUPS}
  sources = p.sources or [None] * len(p.leaves)
  for leaf, label, dims, source in zip(p.leaves, p.labels, p.layouts, sources):
    if leaf.masked:
      continue
    matrix = layout_name(dims, leaf.shape) if label == "muon" else "-"
    read = routing.LAYOUT_SOURCES[source] if label == "muon" else "-"
    rows.append((leaf.path, str(leaf.shape), label, matrix, read, rates.get(label, "-")))
    totals[label][0] += 1
    totals[label][1] += math.prod(leaf.shape)
  header = ("path", "shape", "group", "muon matrix", "matrix from", "learning rate")
  widths = [max([len(header[i])] + [len(r[i]) for r in rows]) for i in range(len(header))]
  fmt = "  ".join(f"{{:<{w}}}" for w in widths)
  lines = [fmt.format(*header).rstrip(), fmt.format(*("-" * w for w in widths))]
  lines += [fmt.format(*r).rstrip() for r in rows]
  lines.append("")
  for g in GROUPS:
    n_tensors, n_params = totals[g]
    if n_tensors:
      plural = "s" if n_tensors > 1 else ""
      lines.append(f"{g}: {n_tensors} tensor{plural}, {n_params:,} parameters, "
                   f"learning rate {rates.get(g, '-')}")
  for note in p.notes:
    lines.append(f"{'note' if note.kind == 'info' else note.kind}: {note.text}")
  return "\n".join(lines)


def describe_routing(params: optax.Params,
                     tx_or_labels: routing.LabelsOrFn | optax.GradientTransformation = None
                     ) -> str:
  """The routing in effect as a printable table: path, shape, group, Muon matrix, learning rate.

  Args:
    params: the parameter pytree (arrays, ``jax.ShapeDtypeStruct``, ``nnx.State``...).
    tx_or_labels: any optax transform that contains a :func:`stablejax.outlier_safe_muon`
      (bare, or inside ``optax.chain``, ``skip_nonfinite``, ``skip_spikes``, ``optax.MultiSteps``,
      ``optax.inject_hyperparams``, ... : it is found by tracing ``tx.init`` abstractly, nothing
      is allocated), in which case each group's learning rate is shown; or, without a
      transform, what ``param_labels`` takes (None for the default rule, a ``{pattern: group}``
      mapping, a label tree or a callable).

  Returns:
    A multi-line string: one row per parameter (path, shape, group, the matrix Muon
    orthogonalises, what that matrix was read from: ``metadata``, ``shapes``, ``attention
    layer``, ``attention heads`` (``per_head``), ``given`` or ``last two axes``, and the
    learning rate), one summary line per group
    (tensors, parameters, learning rate), then notes: heads found by shape, heads taken as tied,
    unsure cases, override patterns that match nothing and unrecognised 3+ axis kernels (one
    line for all of them, grouped by layout), each with the override that changes it.

  Raises:
    NoOutlierSafeMuonError: (a ``ValueError``) if the transform contains no outlier_safe_muon.

  Example:
    >>> import jax.numpy as jnp, optax, stablejax
    >>> params = {"embed": jnp.zeros((10, 4)), "w": jnp.zeros((4, 4))}
    >>> tx = stablejax.skip_nonfinite(optax.chain(stablejax.outlier_safe_muon(2e-3)))
    >>> print(stablejax.describe_routing(params, tx))  # doctest: +SKIP
  """
  if not _is_transform(tx_or_labels):
    return _table(routing.plan(params, cast(routing.LabelsOrFn, tx_or_labels)), {})
  tx: Any = tx_or_labels
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # the notes below repeat init's warnings
    state = jax.eval_shape(tx.init, params)
  held = [s for s in jax.tree.leaves(state, is_leaf=_is_muon_state) if _is_muon_state(s)]
  if not held:
    raise NoOutlierSafeMuonError(
        "describe_routing: this transform contains no stablejax.outlier_safe_muon; pass its "
        "param_labels (a {pattern: group} mapping, a label tree or a callable) instead")
  infos = routing_infos(tx)
  tables = []
  for k, muon_state in enumerate(held):
    info, injected = infos[k] if k < len(infos) else (None, False)
    tree = _seen_params(params, muon_state)
    if info is None:  # a wrapper that hides its transform: the groups the state records
      p = routing.plan(tree, functools.partial(_recorded, muon_state))
      rates: dict[str, str] = {}
    else:
      p = routing.plan(tree, info.param_labels, info.weight_dimension_numbers,
                       per_head=info.per_head)
      rates = _rates_for_display(info, injected)
    title = f"outlier_safe_muon #{k + 1} of {len(held)}\n" if len(held) > 1 else ""
    tables.append(title + _table(p, rates))
  return "\n\n".join(tables)


def _is_muon_state(x: object) -> bool:
  return isinstance(x, GroupUpdateRmsState)


def _recorded(muon_state: GroupUpdateRmsState, tree: optax.Params) -> optax.Params:
  """The groups ``muon_state`` records, as ``param_labels`` (a function: a label tree of an
  Equinox module is callable itself)."""
  return recorded_labels(muon_state.inner_state, tree)


def _seen_params(params: optax.Params, muon_state: GroupUpdateRmsState) -> optax.Params:
  """``params`` as the ``outlier_safe_muon`` of ``muon_state`` sees them: ``optax.MaskedNode``
  for those an enclosing ``optax.masked`` leaves out (no group of its state holds them)."""
  try:
    labels = recorded_labels(muon_state.inner_state, params)
  except ValueError:  # a wrapper that gives it another tree: shown as the user gave it
    return params
  leaves, values, treedef = param_leaves(params, with_values=True)
  flat = jax.tree.leaves(labels, is_leaf=lambda x: isinstance(x, optax.MaskedNode))
  return treedef.unflatten([v if isinstance(label, str) else optax.MaskedNode()
                            for v, label in zip(values, flat)])
