"""Reading numbers from logged records (Python, numpy or jax scalars, or JSON spellings)."""

from __future__ import annotations

from typing import Any, Optional

_SPECIAL_FLOATS = {"nan": float("nan"), "inf": float("inf"), "infinity": float("inf"),
                   "-inf": float("-inf"), "-infinity": float("-inf")}


def _as_float(value: Any) -> Optional[float]:
  """A Python float from a number, bool, numpy/jax scalar, or None if not numeric."""
  if isinstance(value, str):  # "NaN" / "Infinity" as some JSON writers spell them
    return _SPECIAL_FLOATS.get(value.strip().lower())
  if value is None:
    return None
  try:
    return float(value)
  except (TypeError, ValueError):
    return None
