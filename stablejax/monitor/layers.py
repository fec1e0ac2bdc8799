"""Per-layer gradient norms (per layer slice for scan-stacked parameters), for histograms, and the
global and per-layer norms of an update (the train step's ``update_norm`` metrics)."""

from __future__ import annotations

import optax
import re
from typing import Iterable, Optional

import jax
import jax.numpy as jnp

from stablejax.monitor.movement import path_str
from stablejax.transforms.stacked import STACKED_NAMES, stacked_component


def per_layer_grad_norms(grads: optax.Updates, stacked_names: Iterable[str] = STACKED_NAMES
                         ) -> dict[str, jax.Array]:
  """L2 norm of every gradient leaf, per layer slice for scan-stacked parameters.

  A leaf is scan-stacked when one of its path components is in
  ``stacked_names`` (exact match, case-insensitive) and is not followed by an
  integer component (``h/0/...`` is an unrolled layer; the rule is
  :func:`stablejax.transforms.stacked.stacked_component`, shared with
  :func:`stablejax.adagc`); its leading axis is the layer, and it yields one
  entry per layer with the layer index inserted after that component
  (``blocks/attn/kernel`` -> ``blocks/0/attn/kernel``, ...), the names an
  unrolled model would have. Jittable.

  Args:
    grads: gradient pytree.
    stacked_names: component names that mark stacked leaves (``()`` disables).

  Returns:
    ``{path: float32 scalar}``; log them as a TensorBoard histogram
    (``grads/norms``) and, at a lower rate, as scalars ``grads/<path>``.

  Example:
    A stacked ``[2, 3, 4]`` kernel gives one norm per layer:

    >>> import jax, jax.numpy as jnp
    >>> from stablejax import per_layer_grad_norms
    >>> grads = {"blocks": {"mlp": {"kernel": jnp.ones((2, 3, 4))}},
    ...          "lm_head": {"kernel": jnp.ones((4, 3))}}
    >>> norms = jax.jit(per_layer_grad_norms)(grads)
    >>> {path: round(float(n), 4) for path, n in norms.items()}
    {'blocks/0/mlp/kernel': 3.4641, 'blocks/1/mlp/kernel': 3.4641, 'lm_head/kernel': 3.4641}
  """
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(grads)[0]:
    key = path_str(path)
    x = jnp.asarray(leaf)
    if not jnp.issubdtype(x.dtype, jnp.inexact):
      continue
    parts = key.split("/")
    idx = stacked_component(parts, stacked_names)
    x32 = x.astype(jnp.float32)
    if idx is not None and x.ndim >= 1:
      norms = jnp.sqrt(jnp.sum(jnp.reshape(x32 * x32, (x.shape[0], -1)), axis=1))
      for layer in range(x.shape[0]):
        out["/".join(parts[:idx + 1] + [str(layer)] + parts[idx + 1:])] = norms[layer]
    else:
      out[key] = jnp.sqrt(jnp.sum(x32 * x32))
  return out


# A component naming one layer of an unrolled stack: block_0, layers_3, h_2.
_LAYER_COMPONENT = re.compile(r"^(?:block|blocks|layer|layers|h)_(\d+)$", re.IGNORECASE)


def _layer_of(parts: list[str], stacked_names: Iterable[str]) -> Optional[int]:
  """The layer index of an unrolled leaf: ``block_3/...``, or ``h/3/...`` (an integer after a
  stack name); None for a leaf outside the layers (embeddings, head, final norm)."""
  names = {n.lower() for n in stacked_names}
  for i, part in enumerate(parts):
    match = _LAYER_COMPONENT.match(part)
    if match:
      return int(match.group(1))
    if part.lower() in names and i + 1 < len(parts) and parts[i + 1].isdigit():
      return int(parts[i + 1])
  return None


def global_and_layer_norms(tree: optax.Params, stacked_names: Iterable[str] = STACKED_NAMES
                           ) -> tuple[jax.Array, dict[int, jax.Array]]:
  """The float32 global L2 norm of ``tree`` and the norm of each layer's part of it.

  A layer is a layer slice of the scan-stacked leaves (the rule of :func:`per_layer_grad_norms`)
  together with the leaves of an unrolled layer (a path component ``block_<i>``, ``layers_<i>``,
  ``h_<i>``, or ``h/<i>``); leaves outside the layers (embedding, head, final norm) count only
  in the global norm. Jittable; each leaf is squared and summed once.

  Args:
    tree: a pytree of arrays (an update, a gradient).
    stacked_names: component names that mark stacked leaves.

  Returns:
    ``(global_norm, {layer index: norm})``.

  Example:
    >>> import jax.numpy as jnp
    >>> from stablejax.monitor.layers import global_and_layer_norms
    >>> tree = {"blocks": {"w": jnp.ones((2, 4))}, "lm_head": {"kernel": jnp.ones(8)}}
    >>> total, layers = global_and_layer_norms(tree)
    >>> float(total), {i: float(n) for i, n in layers.items()}
    (4.0, {0: 2.0, 1: 2.0})
  """
  stacked_names = tuple(stacked_names)
  total: list[jax.Array] = []
  per_layer: dict[int, list[jax.Array]] = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    x = jnp.asarray(leaf)
    if not jnp.issubdtype(x.dtype, jnp.inexact):  # an integer leaf is no update
      continue
    parts = path_str(path).split("/")
    x32 = x.astype(jnp.float32)
    stacked_at = stacked_component(parts, stacked_names)
    if stacked_at is not None and x.ndim >= 1:
      slices = jnp.sum(jnp.square(x32).reshape(x.shape[0], -1), axis=-1)
      total.append(jnp.sum(slices))
      for layer in range(x.shape[0]):
        per_layer.setdefault(layer, []).append(slices[layer])
      continue
    square = jnp.sum(x32 * x32)
    total.append(square)
    layer_index = _layer_of(parts, stacked_names)
    if layer_index is not None:
      per_layer.setdefault(layer_index, []).append(square)
  global_norm = jnp.sqrt(sum(total, jnp.zeros((), jnp.float32)))
  return global_norm, {i: jnp.sqrt(sum(v, jnp.zeros((), jnp.float32)))
                       for i, v in sorted(per_layer.items())}
