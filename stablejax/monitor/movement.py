"""Parameter movement: relative change per group and updates against the dtype's resolution."""

from __future__ import annotations

import optax
import math
import re
from typing import Any, Callable, Iterable, Mapping, Optional, Union

import jax
import jax.numpy as jnp

from stablejax.monitor._numbers import _as_float
from stablejax.transforms.stacked import key_name


def path_str(path: Iterable[Any]) -> str:
  """``"a/b/0"`` from a ``jax.tree_util`` key path."""
  return "/".join(key_name(k) for k in path)


_GROUP_PATTERNS = (
    ("embedding", re.compile(r"(embed|wte|wpe|tok_emb|pos_emb)")),
    ("head", re.compile(r"^(lm_head|head|unembed|output|logits|out_head)(_\d+)?$")),
    ("norm", re.compile(r"(norm|^ln(_|\d|$)|^layer_?norm|^rms)")),
    ("attention", re.compile(r"(attn|attention|^q_?proj|^k_?proj|^v_?proj|^o_?proj|^qkv|^query"
                             r"|^key$|^value)")),
    ("mlp", re.compile(r"(mlp|ffn|feed_?forward|(^|_)fc|^dense|^w[123]$|^up_?proj|^down_?proj"
                       r"|^gate)")),
)


def default_group(path: str) -> str:
  """Parameter group of a ``"a/b/c"`` path by its names.

  The first match over the path components, checked in order, wins:
  ``embedding`` (embed, wte, wpe), ``head`` (lm_head, head, unembed),
  ``norm`` (norm, ln_*, scale of a norm layer), ``attention`` (attn, q/k/v/o
  projections), ``mlp`` (mlp, ffn, fc, dense, w1/w2/w3); else ``other``.

  Example::

    default_group("blocks/attn/q_proj/kernel")  # "attention"
    default_group("blocks/ln_1/scale")           # "norm"
  """
  components = [c.lower() for c in path.split("/") if c]
  for group, pattern in _GROUP_PATTERNS:
    if any(pattern.search(c) for c in components):
      return group
  return "other"


def _leaf_groups(params: optax.Params, labels: Union[None, Any, Callable[[str], str]]
                 ) -> list[tuple[str, str, Any]]:
  """[(path_str, group, leaf)] for the array leaves of ``params``."""
  leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(params)
  if labels is None or callable(labels):
    fn = default_group if labels is None else labels
    groups = [str(fn(path_str(p))) for p, _ in leaves_with_path]
  else:
    # jaxlib ships no type stub for PyTreeDef, so its methods are unknown to the checker.
    label_leaves = treedef.flatten_up_to(labels)  # type: ignore[attr-defined]
    groups = [str(g) for g in label_leaves]
  return [(path_str(p), g, leaf) for (p, leaf), g in zip(leaves_with_path, groups)]


def param_movement(prev_params: optax.Params, params: optax.Params,
                   labels: Union[None, Any, Callable[[str], str]] = None
                   ) -> dict[str, dict[str, jax.Array]]:
  """How far each parameter group moved, and whether its updates are resolvable.

  Per group ``G`` (sums over all float leaves in the group, in float32)::

    rel_change            = ||p - p_prev|| / ||p_prev||
    resolution_ratio      = rms(p - p_prev) / (eps(dtype) * rms(p_prev))
    resolution_ratio_bf16 = rms(p - p_prev) / (eps(bfloat16) * rms(p_prev))
    frozen_fraction       = fraction of entries with p == p_prev
    param_rms             = rms(p)

  ``eps(dtype) * |p|`` is the dtype's spacing at ``|p|`` (within a factor 2),
  so a ratio below 1 means typical updates are at or below the resolution of
  the parameter values: they are mostly rounded away. ``dtype`` is the
  group's own parameter dtype (the lowest-precision one if mixed);
  ``resolution_ratio_bf16`` tells an fp32-parameter run what a bf16 copy of
  the parameters would lose. ``prev_params`` must be a separate copy (not a
  buffer the train step donates).

  Jittable: call it inside a jitted function with ``labels`` closed over
  (``jax.jit(functools.partial(param_movement, labels=labels))``); the result
  is a dict of scalar arrays. Fetch it with ``jax.device_get`` and read it with
  :func:`movement_warnings`.

  Args:
    prev_params: parameter pytree at the last check.
    params: current parameter pytree (same structure).
    labels: ``None`` (group by path with :func:`default_group`), a callable
      ``path_str -> group``, or a pytree of group-name strings matching
      ``params`` (like ``optax.multi_transform`` labels).

  Returns:
    ``{group: {"rel_change", "resolution_ratio", "resolution_ratio_bf16",
    "frozen_fraction", "param_rms"}}`` with float32 scalars.

  Example:
    The kernel moved by 1%; the norm gains did not move at all:

    >>> import jax, jax.numpy as jnp
    >>> from stablejax import param_movement
    >>> old = {"mlp": {"kernel": jnp.ones((4, 4))}, "norm": {"scale": jnp.ones(4)}}
    >>> new = {"mlp": {"kernel": jnp.full((4, 4), 1.01)}, "norm": {"scale": jnp.ones(4)}}
    >>> move = jax.device_get(jax.jit(param_movement)(old, new))
    >>> round(float(move["mlp"]["rel_change"]), 4), float(move["norm"]["frozen_fraction"])
    (0.01, 1.0)
  """
  prev_leaves = jax.tree_util.tree_leaves(prev_params)
  groups = _leaf_groups(params, labels)
  if len(prev_leaves) != len(groups):
    raise ValueError(
        "param_movement: prev_params and params have different structures; pass snapshots of "
        "the same parameter tree")
  acc: dict[str, dict[str, Any]] = {}
  for (_, group, p), q in zip(groups, prev_leaves):
    p = jnp.asarray(p)
    if not jnp.issubdtype(p.dtype, jnp.floating):
      continue
    p32 = p.astype(jnp.float32)
    q32 = jnp.asarray(q).astype(jnp.float32)
    d = p32 - q32
    a = acc.setdefault(group, {"dd": 0.0, "qq": 0.0, "pp": 0.0, "frozen": 0.0, "n": 0,
                               "eps": 0.0})
    a["dd"] = a["dd"] + jnp.sum(d * d)
    a["qq"] = a["qq"] + jnp.sum(q32 * q32)
    a["pp"] = a["pp"] + jnp.sum(p32 * p32)
    a["frozen"] = a["frozen"] + jnp.sum((d == 0).astype(jnp.float32))
    a["n"] += p.size
    a["eps"] = max(a["eps"], float(jnp.finfo(p.dtype).eps))
  eps_bf16 = float(jnp.finfo(jnp.bfloat16).eps)
  tiny = jnp.float32(1e-30)
  out = {}
  for group, a in acc.items():
    n = max(a["n"], 1)
    rms_d = jnp.sqrt(a["dd"] / n)
    rms_q = jnp.sqrt(a["qq"] / n)
    out[group] = {
        "rel_change": jnp.sqrt(a["dd"]) / jnp.maximum(jnp.sqrt(a["qq"]), tiny),
        "resolution_ratio": rms_d / jnp.maximum(a["eps"] * rms_q, tiny),
        "resolution_ratio_bf16": rms_d / jnp.maximum(eps_bf16 * rms_q, tiny),
        "frozen_fraction": jnp.asarray(a["frozen"] / n, jnp.float32),
        "param_rms": jnp.sqrt(a["pp"] / n),
    }
  return out


def param_dtypes(params: optax.Params, labels: Union[None, Any, Callable[[str], str]] = None
                 ) -> dict[str, str]:
  """``{group: dtype name}`` of the parameters (lowest precision in a mixed group).

  Args:
    params: the parameter pytree.
    labels: the grouping, as :func:`param_movement` takes it.

  Returns:
    ``{group: dtype name}`` for the groups with floating-point parameters.

  Example:
    >>> import jax.numpy as jnp
    >>> from stablejax import param_dtypes
    >>> param_dtypes({"mlp": {"kernel": jnp.ones((2, 2), jnp.bfloat16),
    ...                       "extra": jnp.ones(2, jnp.float32)},
    ...               "norm": {"scale": jnp.ones(2)}})
    {'mlp': 'bfloat16', 'norm': 'float32'}
  """
  out: dict[str, str] = {}
  for _, group, p in _leaf_groups(params, labels):
    dt = jnp.asarray(p).dtype if not hasattr(p, "dtype") else p.dtype
    if not jnp.issubdtype(dt, jnp.floating):
      continue
    old = out.get(group)
    if old is None or jnp.finfo(dt).eps > jnp.finfo(old).eps:
      out[group] = jnp.dtype(dt).name
  return out


def movement_warnings(movement: Mapping[str, Mapping[str, Any]], min_rel_change: float = 1e-6,
                      min_resolution_ratio: float = 1.0,
                      dtypes: Optional[Mapping[str, str]] = None,
                      step: Optional[int] = None) -> list[str]:
  """The "parameters are not moving" warning from :func:`param_movement` results.

  A group is stuck when its relative change since the last check is below
  ``min_rel_change`` or its typical update is below the resolution of its own
  dtype (``resolution_ratio < min_resolution_ratio``). The cause is named:
  updates underflowing a low-precision (bf16/fp16) parameter copy, or a
  learning rate that is too low. Norm scales sitting at 1.0 are called out.
  Groups whose values are non-finite get their own line.

  Args:
    movement: ``{group: {"rel_change", "resolution_ratio", ...}}`` as Python
      floats or scalars (``jax.device_get(param_movement(...))``).
    min_rel_change: relative change since the last check below which a group
      counts as not moving (default 1e-6).
    min_resolution_ratio: resolution ratio below which updates count as
      underflowing the parameter dtype (default 1.0).
    dtypes: optional ``{group: dtype name}`` (:func:`param_dtypes`) to name the
      cause; without it the cause is stated as either.
    step: optional step for the line prefix.

  Returns:
    Zero, one or two warning lines.

  Example:
    >>> from stablejax import movement_warnings
    >>> movement_warnings({"mlp": {"rel_change": 0.01, "resolution_ratio": 8e4},
    ...                    "norm": {"rel_change": 0.0, "resolution_ratio": 0.0, "param_rms": 1.0}},
    ...                   dtypes={"mlp": "float32", "norm": "float32"}, step=100)
    ['step 100: parameters are not moving: norm scales stuck at 1.000: norm (rel change 0,
      updates 0x the float32 resolution); learning rate too low']
  """
  stuck, nonfinite = [], []
  low_precision = False
  for group in sorted(movement):
    m = movement[group]
    rel = _as_float(m.get("rel_change"))
    ratio = _as_float(m.get("resolution_ratio"))
    rms = _as_float(m.get("param_rms"))
    if rel is None:
      continue
    if not math.isfinite(rel) or (ratio is not None and math.isnan(ratio)):
      nonfinite.append(group)
      continue
    if rel < min_rel_change or (ratio is not None and ratio < min_resolution_ratio):
      dtype = (dtypes or {}).get(group)
      desc = f"{group} (rel change {rel:.2g}"
      if ratio is not None:
        desc += f", updates {ratio:.2g}x the {dtype or 'dtype'} resolution"
      desc += ")"
      if group == "norm" and rms is not None and abs(rms - 1.0) < 1e-3:
        desc = f"norm scales stuck at {rms:.3f}: " + desc
      if dtype in ("bfloat16", "float16"):
        low_precision = True
      stuck.append(desc)
  prefix = "" if step is None else f"step {step}: "
  lines = []
  if stuck:
    if dtypes is None:
      cause = "learning rate too low, or updates underflowing a low-precision parameter copy"
    elif low_precision:
      cause = ("updates underflow the low-precision parameters: keep float32 master parameters "
               "(compute in bf16), or raise the learning rate")
    else:
      cause = "learning rate too low"
    lines.append(f"{prefix}parameters are not moving: {'; '.join(stuck)}; {cause}")
  if nonfinite:
    lines.append(f"{prefix}non-finite parameters or movement in groups: {', '.join(nonfinite)}")
  return lines


def movement_record(movement: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
  """Flat ``metrics.jsonl`` keys from :func:`param_movement` results.

  Args:
    movement: ``{group: {"rel_change", ...}}`` (``jax.device_get(param_movement(...))``).

  Returns:
    ``{"param_move/<group>": rel_change, "param_move/<group>/resolution_ratio": ...,
    "param_move/<group>/resolution_ratio_bf16": ...}`` as Python floats.

  Example:
    >>> from stablejax import movement_record
    >>> movement_record({"mlp": {"rel_change": 0.5, "resolution_ratio": 80.0}})
    {'param_move/mlp': 0.5, 'param_move/mlp/resolution_ratio': 80.0}
  """
  out = {}
  for group, m in movement.items():
    out[f"param_move/{group}"] = float(m["rel_change"])
    for key in ("resolution_ratio", "resolution_ratio_bf16"):
      if key in m:
        out[f"param_move/{group}/{key}"] = float(m[key])
  return out
