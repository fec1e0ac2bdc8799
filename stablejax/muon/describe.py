"""Printing the routing in effect: :func:`describe_routing`.

Kept apart from :mod:`stablejax.muon.routing` because it must find an ``outlier_safe_muon`` inside
any chain (it traces ``tx.init`` and reads what :func:`stablejax.muon.routing.record_init`
captured, and the closures of ``optax.inject_hyperparams``), so it imports
:mod:`stablejax.muon.muon`, which itself imports the routing: this module sits on top of both.
"""

from __future__ import annotations

import functools
import inspect
import math
import types
import warnings
from typing import Any

import jax
import numpy as np

from stablejax.muon import lr_check
from stablejax.muon import routing
from stablejax.muon.labels import GROUPS
from stablejax.muon.matrices import layout_name
from stablejax.muon.muon import outlier_safe_muon


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


def _injected_hyperparams(tx: Any) -> dict:
  """Arguments given to ``optax.inject_hyperparams(outlier_safe_muon)(...)`` inside ``tx``.

  Under ``inject_hyperparams`` the rates reach outlier_safe_muon as traced arrays; the values the
  user gave (floats or schedules) are only in the wrapper's closure, read here for display.
  """
  seen, stack = set(), [(tx, 0)]
  while stack:
    obj, depth = stack.pop()
    if id(obj) in seen or depth > 12 or isinstance(obj, (str, bytes, int, float, type,
                                                          types.ModuleType)):
      continue
    seen.add(id(obj))
    if isinstance(obj, types.MethodType):
      stack += [(obj.__func__, depth + 1), (obj.__self__, depth + 1)]
    elif isinstance(obj, types.FunctionType):
      env = _closure_env(obj)
      factory = env.get("inner_factory")
      if factory is not None and inspect.unwrap(factory) is outlier_safe_muon \
          and "numeric_hps" in env:
        given = dict(env["numeric_hps"])
        given.update({k: getattr(v, "schedule_fn", v) for k, v in env.get("sched_hps", {}).items()})
        return given
      stack += [(v, depth + 1) for v in env.values()]
    elif isinstance(obj, functools.partial):
      stack += [(obj.func, depth + 1)] + [(a, depth + 1) for a in obj.args]
    elif isinstance(obj, (tuple, list)):
      stack += [(v, depth + 1) for v in obj]
    elif isinstance(obj, dict):
      stack += [(v, depth + 1) for v in obj.values()]
    elif hasattr(obj, "__dict__"):
      stack += [(v, depth + 1) for v in vars(obj).values()]
  return {}


def _format_lr(lr: Any) -> str:
  if lr is None:
    return "-"
  if callable(lr):
    values = lr_check.schedule_values(lr)
    return f"schedule (start {values[0]:.3g}, peak {values.max():.3g})"
  return f"{float(np.asarray(lr)):.3g}"


def _rates_for_display(info: routing.RoutingInfo, tx: Any) -> dict:
  rates = {}
  injected = None
  for group, lr in info.learning_rates.items():
    if isinstance(lr, jax.core.Tracer):
      if injected is None:
        injected = _injected_hyperparams(tx)
      source = info.rate_sources.get(group)
      rates[group] = (f"{_format_lr(injected[source])} (injected)" if source in injected
                      else "injected by inject_hyperparams")
    else:
      rates[group] = _format_lr(lr)
  return rates


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


def describe_routing(params: Any, tx_or_labels: routing.LabelsOrFn = None) -> str:
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
    return _table(routing.plan(params, tx_or_labels), {})
  tx: Any = tx_or_labels
  with routing._capture() as found, warnings.catch_warnings():
    warnings.simplefilter("ignore")  # the notes below repeat init's warnings
    jax.eval_shape(tx.init, params)
  if not found:
    raise NoOutlierSafeMuonError(
        "describe_routing: this transform contains no stablejax.outlier_safe_muon; pass its "
        "param_labels (a {pattern: group} mapping, a label tree or a callable) instead")
  tables = []
  for k, (info, tree) in enumerate(found):
    p = routing.plan(tree, info.param_labels, info.weight_dimension_numbers,
                     per_head=info.per_head)
    title = f"outlier_safe_muon #{k + 1} of {len(found)}\n" if len(found) > 1 else ""
    tables.append(title + _table(p, _rates_for_display(info, tx)))
  return "\n\n".join(tables)
