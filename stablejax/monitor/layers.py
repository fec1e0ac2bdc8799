"""Per-layer gradient norms (per layer slice for scan-stacked parameters), for histograms."""

from __future__ import annotations

from typing import Any, Iterable

import jax
import jax.numpy as jnp

from stablejax.monitor.movement import path_str
from stablejax.transforms.stacked import STACKED_NAMES, stacked_component


def per_layer_grad_norms(grads: Any, stacked_names: Iterable[str] = STACKED_NAMES
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
