"""What the monitor, the score, TensorBoard and the report know about each metric: the specs
that states register with :func:`stablejax.register_state_metrics` (their rates, report lines,
gradient-norm and threshold keys). Importing this module registers the built-in ones: every
module of :mod:`stablejax.transforms` and :mod:`stablejax.muon` found on disk is imported (a
transform added there is found by being there, with no list to edit), so a run's records can be
read without building an optimizer first. The specs come in their declared order
(:func:`stablejax.transforms.metrics.metric_specs`), not in the order of any import."""

from __future__ import annotations

import re
from typing import Iterator, Mapping

from stablejax.transforms._registry import package_modules
from stablejax.transforms.metrics import MetricsSpec, Rate, metric_specs

for _package in ("stablejax.transforms", "stablejax.muon"):  # their metrics register on import
  package_modules(_package)

SKIP_RATE = "skip_rate"          # skipped steps per step: the sum of the skip rates, at most 1
SKIP_RATE_BUDGET = 0.05
SKIP_RATE_ADVICE = ("skipped-step rate {value:.3g} > 0.05: look for bad data windows; lower the "
                    "learning rate (under fp16, a smaller loss scale)")
ROLLBACKS = "rollbacks"          # rollbacks in the window
ROLLBACKS_BUDGET = 1.0


def rates() -> Iterator[tuple[MetricsSpec, Rate]]:
  """Every registered rate with its spec, in registration order."""
  for spec in metric_specs():
    for rate in spec.rates:
      yield spec, rate


def grad_norm_keys() -> tuple[str, ...]:
  """Where a record holds the raw global gradient norm: ``grad_norm``, then each spec's key."""
  return ("grad_norm",) + tuple(spec.key(spec.grad_norm) for spec in metric_specs()
                                if spec.grad_norm)


def nonfinite_keys() -> tuple[str, ...]:
  """Flags saying that a step's gradient was non-finite (the step was skipped for it)."""
  return tuple(spec.key(spec.nonfinite) for spec in metric_specs() if spec.nonfinite)


def acted_keys() -> tuple[str, ...]:
  """Flags (or fractions) saying that a defence clipped or skipped the step."""
  return tuple(spec.key(spec.acted) for spec in metric_specs() if spec.acted)


def update_norm_keys() -> tuple[str, ...]:
  """Where a record holds the norm of the update the optimizer produced, when the applied one
  differs from it (then before the record's ``update_norm``)."""
  return tuple(spec.key(spec.update_norm) for spec in metric_specs() if spec.update_norm)


def prefixes() -> tuple[str, ...]:
  """The metric prefixes of every registered state, each with its trailing slash."""
  return tuple(spec.prefix + "/" for spec in metric_specs())


def counter_keys(record: Mapping, field: str) -> list[str]:
  """The keys of ``record`` that hold a spec's cumulative ``field`` counter (``"skips"`` or
  ``"rollback"``: :func:`stablejax.register_state_metrics`), a repeated prefix (``name_1/``)
  included."""
  found = []
  for spec in metric_specs():
    name = getattr(spec, field)
    if name:
      pattern = re.compile(rf"{re.escape(spec.prefix)}(_\d+)?/{re.escape(name)}")
      found += [key for key in record if pattern.fullmatch(key)]
  return found


def total_skips(record: Mapping) -> int:
  """Skipped steps in a metrics record, over every transform that counts them (``skips``)."""
  return sum(int(record[key]) for key in counter_keys(record, "skips"))


def skip_flag_keys(record: Mapping) -> list[str]:
  """The keys of ``record`` that flag a skipped step (each skip rate's ``flag``)."""
  return [spec.key(rate.flag) for spec, rate in rates()
          if rate.skip and rate.flag and spec.key(rate.flag) in record]


def rollback_request_counts(record: Mapping) -> dict[str, int]:
  """The rollback-request counters (``rollback``) of a metrics record, by key."""
  return {key: int(record[key]) for key in counter_keys(record, "rollback")}
