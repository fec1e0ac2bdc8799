"""The notes of the routing: what :func:`stablejax.describe_routing` and the trainer banner print
below the routing table, and the warnings ``init`` gives (one ``UserWarning`` per warning note).

Each note that asks the user to act names the argument that changes the decision
(``param_labels={...}`` or ``weight_dimension_numbers=...``).
"""

from __future__ import annotations

import collections
import dataclasses
import warnings
from typing import Sequence

from stablejax.layout import analysis as layout
from stablejax.layout.analysis import FusedDimensionNumbers, Leaf
from stablejax.muon.matrices import batch_ndim, layout_name


@dataclasses.dataclass
class Note:
  """Something :func:`stablejax.describe_routing` and the trainer banner print below the table."""
  kind: str      # "info" (a rule decided by shape), "unsure", or "warning"
  text: str


def labels_hint(path: str, group: str) -> str:
  """The ``param_labels`` override that routes ``path`` to ``group``."""
  return f"param_labels={{{path!r}: {group!r}}}"


def dims_hint(path: str) -> str:
  """The ``weight_dimension_numbers`` override that gives ``path`` its matrix layout."""
  return ("weight_dimension_numbers=lambda p: stablejax.muon_dimension_numbers(p, overrides="
          f"{{{path!r}: optax.contrib.MuonDimensionNumbers(reduction_axis=..., output_axis=...)}})")


def warn_notes(notes: Sequence[Note], who: str, stacklevel: int = 3) -> None:
  """Emits each warning note as one ``UserWarning``."""
  for note in notes:
    if note.kind == "warning":
      warnings.warn(f"{who}: {note.text}", stacklevel=stacklevel)


def unrecognised_note(leaves: Sequence[Leaf], a: layout.Analysis, labels: list, layouts: list,
                       sources: list) -> list[Note]:
  """One warning for every Muon kernel of 3+ non-batch axes that no rule recognised."""
  by_layout: dict = collections.defaultdict(list)
  for i, leaf in enumerate(leaves):
    if labels[i] != "muon" or sources[i] is not None:
      continue
    if len(leaf.shape) - batch_ndim(a, i) < 3:
      continue
    by_layout[(leaf.shape, layout_name(layouts[i], leaf.shape))].append(leaf.path)
  if not by_layout:
    return []
  n = sum(len(v) for v in by_layout.values())
  parts = []
  for (shape, name), paths in by_layout.items():
    shown = ", ".join(paths[:2]) + (f" and {len(paths) - 2} more" if len(paths) > 2 else "")
    parts.append(f"{len(paths)} x {shape} as {name} ({shown})")
  first = next(iter(by_layout.values()))[0]
  return [Note("warning", f"{n} kernel{'s' if n > 1 else ''} of 3+ axes match no layout rule "
                          "(no logical axis names, no single d_model axis, not a recognised "
                          "attention layer), so Muon orthogonalises their last two axes: "
                          + "; ".join(parts) + "; if that is not their layout: "
                          + dims_hint(first))]


def fused_notes(leaves: Sequence[Leaf], a: layout.Analysis, labels: list, layouts: list,
                 sources: list) -> list[Note]:
  """What was done with fused kernels: split per projection (info), or left whole (warning)."""
  notes = []
  split = collections.defaultdict(list)
  for i, leaf in enumerate(leaves):
    if labels[i] == "muon" and isinstance(layouts[i], FusedDimensionNumbers) \
        and sources[i] not in ("given", "per_head"):
      split[(leaf.shape, layout_name(layouts[i], leaf.shape))].append(leaf.path)
  for (shape, name), paths in split.items():
    shown = ", ".join(paths[:2]) + (f" and {len(paths) - 2} more" if len(paths) > 2 else "")
    notes.append(Note("info", f"{len(paths)} fused kernel{'s' if len(paths) > 1 else ''} "
                              f"{shape} ({shown}) orthogonalised per projection as {name}; if "
                              "the parts differ: " + dims_hint(paths[0]).replace(
                                  "optax.contrib.MuonDimensionNumbers(reduction_axis=..., "
                                  "output_axis=...)", "stablejax.FusedDimensionNumbers(...)")))
  whole = [leaves[i].path for i in a.unsplit
           if labels[i] == "muon" and not isinstance(layouts[i], FusedDimensionNumbers)
           and sources[i] != "given"]
  if whole:
    notes.append(Note("warning", f"{whole[0]} {leaves[a.unsplit[0]].shape} is named like a fused "
                                 "projection but its parts cannot be read from the shapes, so "
                                 "Muon orthogonalises it as one matrix"
                                 + (f" (also {len(whole) - 1} more)" if len(whole) > 1 else "")
                                 + "; say how it splits: " + dims_hint(whole[0]).replace(
                                     "optax.contrib.MuonDimensionNumbers(reduction_axis=..., "
                                     "output_axis=...)",
                                     "stablejax.FusedDimensionNumbers(reduction_axis=..., "
                                     "output_axis=..., fused_axis=..., parts=...)")))
  return notes
