"""Which parameter leaves are scan-stacked layers ``[L, ...]``.

A model whose blocks run under ``nn.scan`` / ``jax.lax.scan`` keeps each block
parameter as one leaf with a leading layer axis (``blocks/attn/q_proj/kernel``
of shape ``[L, D, D]`` in :mod:`stablejax.modeling.gpt`; ``layers`` in
MaxText, ``blocks`` in Levanter). Per-layer statistics (AdaGC's thresholds,
the monitor's per-layer gradient norms) treat such a leaf as ``L`` tensors.

The rule: a leaf of at least one axis is stacked when a component of its path
is one of ``stacked_names`` (exact match, case-insensitive) and is not
followed by an integer component. The second condition keeps an unrolled list
of layers (``h/0/attn/kernel``, ``layers/3/mlp/kernel``) per leaf.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence

STACKED_NAMES = ("layers", "blocks", "scan", "h")
"""Path components whose leaves are scan-stacked ``[L, ...]`` by default."""


def key_name(entry: Any) -> str:
  """The name of one ``jax.tree_util`` key-path entry (dict key, attribute or index)."""
  for attr in ("key", "name", "idx"):
    if hasattr(entry, attr):
      return str(getattr(entry, attr))
  return str(entry)


def stacked_component(parts: Sequence[str], stacked_names: Iterable[str] = STACKED_NAMES
                      ) -> Optional[int]:
  """Index of the path component that marks a scan-stacked leaf, or None.

  Args:
    parts: the leaf's path components, e.g. ``["blocks", "attn", "kernel"]``.
    stacked_names: component names that mark stacked leaves (``()``: none).

  Returns:
    The index of the first component in ``stacked_names`` not followed by an
    integer component, or None. The caller also requires ``ndim >= 1``.

  Example:
    >>> from stablejax.transforms.stacked import stacked_component
    >>> stacked_component(["blocks", "attn", "kernel"])
    0
    >>> stacked_component(["h", "0", "attn", "kernel"]) is None
    True
  """
  names = {n.lower() for n in stacked_names}
  for i, part in enumerate(parts):
    following = parts[i + 1] if i + 1 < len(parts) else ""
    if part.lower() in names and not following.isdigit():
      return i
  return None


def is_stacked(path: Sequence[Any], leaf: Any,
               stacked_names: Iterable[str] = STACKED_NAMES) -> bool:
  """Whether the leaf at ``path`` (a ``jax.tree_util`` key path) is a stacked ``[L, ...]`` leaf."""
  if len(getattr(leaf, "shape", ())) < 1:
    return False
  return stacked_component([key_name(e) for e in path], stacked_names) is not None
