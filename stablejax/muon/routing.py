"""Which optimizer updates which parameter: Muon for hidden matrices, AdamW for the rest.

Muon is defined for the hidden weight matrices of a network. Embedding tables (a lookup, not a
matrix-vector product), the output head, and vectors (norm scales, biases) are trained with AdamW
in every published Muon setup (Jordan et al., modded-nanogpt; Liu et al., arXiv 2502.16982).
Optimizers that route by ``ndim == 2`` alone silently send the embedding and the head to Muon,
so the routing here goes by parameter path and can be printed with :func:`describe_routing`.

Groups: ``"muon"``, ``"adam"`` (norms, biases, scalars), ``"embedding"``, ``"head"``.

Matrix convention: the last two axes of a leaf are the matrix, ``[..., fan_in, fan_out]`` (Flax
``Dense`` kernels are ``[in, out]``); leading axes are batch axes, so a scan-stacked kernel of
shape ``[L, in, out]`` is ``L`` matrices, each orthogonalised and scaled on its own.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Union

import jax
import numpy as np

GROUPS = ("muon", "adam", "embedding", "head")

LabelsOrFn = Union[Any, Callable[[Any], Any]]


def _key_name(entry) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(entry, attr):
      return str(getattr(entry, attr))
  return str(entry)


def path_to_str(path) -> str:
  """``('params', 'block_0', 'attn', 'kernel')`` style key path -> ``params/block_0/attn/kernel``."""
  return "/".join(_key_name(e) for e in path)


def _label_one(path, leaf) -> str:
  names = [_key_name(e).lower() for e in path]
  joined = "/".join(names)
  leaf_name = names[-1] if names else ""
  owner = names[-2] if len(names) >= 2 else ""
  if "embed" in joined and "emb_proj" not in joined:
    return "embedding"
  if "lm_head" in joined or leaf_name.endswith("head") or owner.endswith("head"):
    return "head"
  if leaf_name in ("bias", "scale") or "norm" in joined:
    return "adam"
  if np.ndim(leaf) >= 2:
    return "muon"
  return "adam"


def label_params(params) -> Any:
  """Default routing: a pytree of group labels with the structure of ``params``.

  Rules, applied to the lower-cased ``/``-joined path of each leaf, first match wins:

  1. path contains ``"embed"`` (and not ``"emb_proj"``) -> ``"embedding"``;
  2. path contains ``"lm_head"``, or the leaf name or its parent module name ends in
     ``"head"`` -> ``"head"``;
  3. leaf named ``"bias"`` or ``"scale"``, or path contains ``"norm"`` -> ``"adam"``;
  4. ``ndim >= 2`` -> ``"muon"`` (leading axes beyond the last two are batch axes);
  5. anything else (vectors, scalars) -> ``"adam"``.

  Args:
    params: any pytree of arrays (or ``jax.ShapeDtypeStruct``); typically Flax params.

  Returns:
    A pytree of strings from :data:`GROUPS` with the structure of ``params``.

  Example:
    >>> import jax.numpy as jnp
    >>> from stablejax import label_params
    >>> label_params({"wte": {"embedding": jnp.zeros((10, 4))},
    ...               "mlp": {"kernel": jnp.zeros((4, 8)), "bias": jnp.zeros(8)},
    ...               "lm_head": {"kernel": jnp.zeros((4, 10))}})
    {'lm_head': {'kernel': 'head'}, 'mlp': {'bias': 'adam', 'kernel': 'muon'}, 'wte': {'embedding': 'embedding'}}
  """
  return jax.tree_util.tree_map_with_path(_label_one, params)


def resolve_labels(params, param_labels: LabelsOrFn = None):
  """Labels for ``params`` from None (default rule), a callable, or a label pytree; validated."""
  if param_labels is None:
    labels = label_params(params)
  elif callable(param_labels):
    labels = param_labels(params)
  else:
    labels = param_labels
  flat_labels = jax.tree_util.tree_leaves(labels)
  bad = sorted({str(l) for l in flat_labels if l not in GROUPS})
  if bad:
    raise ValueError(f"param_labels contains unknown group(s) {bad}; use labels from {GROUPS}")
  if jax.tree_util.tree_structure(labels) != jax.tree_util.tree_structure(params):
    raise ValueError("param_labels must have the same tree structure as the params "
                     "(one label per leaf); pass a callable params -> labels to derive it")
  return labels


def _format_lr(lr) -> str:
  if lr is None:
    return "-"
  if callable(lr):
    samples = [float(lr(s)) for s in (0, 10, 100, 1000, 10000, 100000)]
    return f"schedule (start {samples[0]:.3g}, peak {max(samples):.3g})"
  return f"{float(lr):.3g}"


def describe_routing(params, tx_or_labels: LabelsOrFn = None) -> str:
  """The routing in effect as a printable table: path, shape, group, learning rate.

  Args:
    params: the parameter pytree (arrays or ``jax.ShapeDtypeStruct``).
    tx_or_labels: a transform returned by :func:`stablejax.outlier_safe_muon` (then the learning
      rate of each group is shown), a label pytree, a callable ``params -> labels``, or None for
      the default rule :func:`label_params`.

  Returns:
    A multi-line string: one row per leaf, then one summary line per group (number of tensors
    and parameters).

  Example:
    >>> import jax.numpy as jnp, stablejax
    >>> params = {"embed": jnp.zeros((10, 4)), "w": jnp.zeros((4, 4))}
    >>> tx = stablejax.outlier_safe_muon(learning_rate=2e-3)
    >>> print(stablejax.describe_routing(params, tx))  # doctest: +SKIP
  """
  from stablejax.muon import muon as _muon  # local import: muon imports this module

  lrs = {}
  info = None
  if tx_or_labels is not None and hasattr(tx_or_labels, "init") and hasattr(tx_or_labels, "update"):
    info = _muon.routing_info(tx_or_labels)
    if info is None:
      raise ValueError("describe_routing: this transform was not built by outlier_safe_muon; "
                       "pass its param_labels (a pytree or a callable) instead")
    labels = resolve_labels(params, info.param_labels)
    lrs = info.learning_rates
  else:
    labels = resolve_labels(params, tx_or_labels)

  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  label_leaves = jax.tree_util.tree_leaves(labels)
  rows = []
  totals = {g: [0, 0] for g in GROUPS}
  for (path, leaf), label in zip(leaves, label_leaves):
    shape = tuple(np.shape(leaf))
    rows.append((path_to_str(path), str(shape), label, _format_lr(lrs.get(label))))
    totals[label][0] += 1
    totals[label][1] += math.prod(shape)
  header = ("path", "shape", "group", "learning rate")
  widths = [max(len(header[i]), *(len(r[i]) for r in rows)) if rows else len(header[i])
            for i in range(4)]
  fmt = "  ".join(f"{{:<{w}}}" for w in widths)
  lines = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
  lines += [fmt.format(*r) for r in rows]
  lines.append("")
  for g in GROUPS:
    n_tensors, n_params = totals[g]
    if n_tensors:
      lines.append(f"{g}: {n_tensors} tensors, {n_params:,} parameters, "
                   f"learning rate {_format_lr(lrs.get(g))}")
  return "\n".join(lines)
