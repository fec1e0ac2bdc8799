"""Outlier-safe Muon: Newton-Schulz momentum orthogonalisation with statistical guards.

Muon (Jordan et al., https://github.com/KellerJordan/modded-nanogpt) updates each hidden weight
matrix with the (approximate) polar factor of its momentum, computed by Newton-Schulz (see
:mod:`stablejax.muon.newton_schulz`). Liu et al., "Muon is Scalable for LLM Training" (Moonlight,
arXiv 2502.16982) scale that update by ``0.2 * sqrt(max(fan_in, fan_out))`` so its RMS matches
AdamW's and add decoupled weight decay. Everything that is not a hidden matrix (embeddings, the
output head, norms, biases, scalars) goes to AdamW with its own learning rate
(:mod:`stablejax.muon.routing`).

The "outlier-safe" layer adds, per Muon matrix and per step, all on device:

* **Outlier clamping** before NS: entries of the momentum matrix that are statistical outliers
  (z-score or inter-quartile range) are clamped back to the boundary, so one exploding entry
  cannot take over the Frobenius normalisation and flatten every other direction of the update.
  The matrix keeps its shape and every other entry.
* **NS health check** after NS: a non-finite result, or one whose Frobenius norm is far outside
  what NS produces (about ``sqrt(rank)`` with singular values in [0.68, 1.13]), is replaced by
  the Frobenius-normalised momentum (the "emergency fallback"; zero if the momentum itself is
  non-finite).
* **Counters and rates** in :class:`OutlierSafeMuonState`, exposed by
  :func:`stablejax.stability_metrics` as ``muon/outlier_rate``, ``muon/ns_instability_rate``,
  ``muon/fallback_rate``, ``muon/outlier_count``, ``muon/fallback_count`` and
  ``muon/update_rms/<group>``.
"""

from __future__ import annotations

import math
import numbers
import weakref
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from stablejax.muon import newton_schulz as _ns
from stablejax.muon import routing
from stablejax.transforms.metrics import register_state_metrics

OUTLIER_METHODS = (None, "zscore", "iqr")
# Above this many entries per matrix, IQR quartiles come from a strided subsample.
IQR_EXACT_MAX = 4096
# NS health bounds on ||O||_F: healthy NS gives about sqrt(rank) * [0.68, 1.13], and at least
# ~0.68 for any nonzero input (the largest normalised singular value is >= 1/sqrt(rank) and five
# standard steps multiply small values by 3.44^5 ~ 480 before saturating).
_HEALTH_MIN_FRO = 0.1
_HEALTH_MAX_FRO_PER_SQRT_RANK = 2.0
_INT32_MAX = jnp.iinfo(jnp.int32).max


class OutlierSafeMuonState(NamedTuple):
  """State of the Muon branch of :func:`outlier_safe_muon` (arrays only).

  Attributes:
    count: int32 number of updates applied.
    mu: first-moment (momentum) buffers, one per Muon parameter, in the parameter dtype.
    outlier_count: int32 total number of momentum entries clamped (saturates at int32 max).
    instability_count: int32 total number of matrices whose NS output failed the health check
      while the momentum was finite.
    fallback_count: int32 total number of matrices that used the emergency fallback.
    outlier_rate: float32 fraction of Muon entries clamped this step.
    ns_instability_rate: float32 fraction of Muon matrices whose NS output failed the health
      check this step (with finite momentum).
    fallback_rate: float32 fraction of Muon matrices that used the fallback this step (NS
      unhealthy for any reason, including non-finite momentum).

  A scan-stacked ``[L, in, out]`` parameter counts as ``L`` matrices.
  """
  count: jax.Array
  mu: optax.Updates
  outlier_count: jax.Array
  instability_count: jax.Array
  fallback_count: jax.Array
  outlier_rate: jax.Array
  ns_instability_rate: jax.Array
  fallback_rate: jax.Array


class GroupUpdateRmsState(NamedTuple):
  """Wrapper state of :func:`outlier_safe_muon`: the routed inner state and per-group RMS.

  Attributes:
    inner_state: the ``optax.partition`` state of the four groups.
    muon, adam, embedding, head: float32 RMS of the final update (after learning rate and
      weight decay) applied to that group at the last step; 0 for an empty group.
  """
  inner_state: Any
  muon: jax.Array
  adam: jax.Array
  embedding: jax.Array
  head: jax.Array


def _saturating_add(total, inc):
  inc = inc.astype(jnp.int32)
  return jnp.where(total > _INT32_MAX - inc, _INT32_MAX, total + inc).astype(jnp.int32)


def _strided_sample(x2, size):
  """``x2`` is ``[..., r, c]``; returns ``[..., k]`` with k <= IQR_EXACT_MAX entries."""
  r, c = x2.shape[-2:]
  flat = x2.reshape(x2.shape[:-2] + (r * c,))
  if size <= IQR_EXACT_MAX:
    return flat
  stride = -(-size // IQR_EXACT_MAX)
  while math.gcd(stride, c) != 1:  # coprime with the row length: visits every column
    stride += 1
  return flat[..., ::stride]


def clamp_outliers(x, method: Optional[str], threshold: float):
  """Clamps outlier entries of each matrix (last two axes) back to the boundary.

  Args:
    x: float array ``[..., rows, cols]``.
    method: ``"zscore"``: outside ``mean +- threshold * std``; ``"iqr"``: outside
      ``[Q1 - k IQR, Q3 + k IQR]`` with ``k = threshold / 2``; None: unchanged.
      Statistics are per matrix (per slice of a stacked tensor) and computed in float32.
      IQR quartiles are exact (``jnp.quantile``, a sort) up to 4096 entries; above that they come
      from a deterministic strided subsample of about 4096 entries (stride coprime with the row
      length), which keeps the per-step cost at one small sort per matrix instead of sorting
      millions of entries; quartiles of a 4096-sample are within a few percent of the exact
      ones, far below the ``k * IQR`` margin.
    threshold: see ``method``.

  Returns:
    ``(clamped, n_clamped)``: same shape and dtype as ``x``, and an int32 count of changed
    entries. A matrix with zero spread (std or IQR of 0, e.g. mostly-zero momentum) or with
    non-finite statistics is left unchanged.
  """
  if method is None:
    return x, jnp.zeros((), jnp.int32)
  xf = x.astype(jnp.float32)
  axes = (-2, -1)
  if method == "zscore":
    mean = jnp.mean(xf, axis=axes, keepdims=True)
    std = jnp.std(xf, axis=axes, keepdims=True)
    lo, hi = mean - threshold * std, mean + threshold * std
    spread = std
  elif method == "iqr":
    size = x.shape[-2] * x.shape[-1]
    sample = _strided_sample(xf, size)
    q1, q3 = jnp.quantile(sample, jnp.array([0.25, 0.75]), axis=-1)
    q1 = q1[..., None, None]
    q3 = q3[..., None, None]
    spread = q3 - q1
    k = threshold / 2.0
    lo, hi = q1 - k * spread, q3 + k * spread
  else:
    raise ValueError(f"outlier_method must be one of {OUTLIER_METHODS}, got {method!r}")
  active = (spread > 0) & jnp.isfinite(lo) & jnp.isfinite(hi)
  clamped = jnp.where(active, jnp.clip(xf, lo, hi), xf)
  n = jnp.sum((clamped != xf) & jnp.isfinite(xf), dtype=jnp.int32)
  return clamped.astype(x.dtype), n


def ns_health(out, mom):
  """Per-slice health of an NS output ``out`` for momentum ``mom`` (both ``[..., r, c]``).

  Returns:
    ``(healthy, mom_finite)``: bool arrays of shape ``out.shape[:-2]``.
  """
  axes = (-2, -1)
  of = out.astype(jnp.float32)
  mf = mom.astype(jnp.float32)
  fro = jnp.sqrt(jnp.sum(of * of, axis=axes))
  mom_fro = jnp.sqrt(jnp.sum(mf * mf, axis=axes))
  rank_bound = min(out.shape[-2:])
  finite = jnp.all(jnp.isfinite(of), axis=axes)
  mom_finite = jnp.all(jnp.isfinite(mf), axis=axes)
  in_range = (fro <= _HEALTH_MAX_FRO_PER_SQRT_RANK * math.sqrt(rank_bound)) & (
      (fro >= _HEALTH_MIN_FRO) | (mom_fro == 0))
  return finite & in_range & mom_finite, mom_finite


def shape_scale(shape, consistent_rms: Optional[float]) -> float:
  """Muon update scale for a ``[..., fan_in, fan_out]`` matrix.

  ``consistent_rms * sqrt(max(fan_in, fan_out))`` (Moonlight, arXiv 2502.16982) or, when
  ``consistent_rms`` is None, ``sqrt(max(1, fan_out / fan_in))`` (Jordan's width scaling).
  """
  fan_in, fan_out = shape[-2], shape[-1]
  if consistent_rms is None:
    return math.sqrt(max(1.0, fan_out / fan_in))
  return float(consistent_rms) * math.sqrt(max(fan_in, fan_out))


def scale_by_outlier_safe_muon(momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
                               ns_coeffs="standard", consistent_rms: Optional[float] = 0.2,
                               outlier_threshold: float = 5.0, outlier_method: Optional[str] = "zscore",
                               ns_backend: str = "auto", eps: float = 1e-8
                               ) -> optax.GradientTransformation:
  """The Muon direction for matrices: momentum, outlier clamp, NS, health check, shape scale.

  Every leaf must have ``ndim >= 2`` (the last two axes are ``[fan_in, fan_out]``; leading axes
  are batch). Learning rate and weight decay are applied by :func:`outlier_safe_muon`.

  The momentum follows ``optax.contrib.scale_by_muon`` exactly (EMA ``mu = b mu + (1 - b) g``
  with bias correction; Nesterov input ``b mu_hat_{t+1} + (1 - b) g_hat_t``), so with
  ``outlier_method=None`` and a healthy NS the direction equals optax's. The clamp acts on the
  NS input only; the stored momentum is not modified, so a spike that lingers in the buffer is
  clamped (and counted) on every step it would dominate.

  Args:
    momentum: EMA decay of the momentum.
    nesterov: use Nesterov momentum.
    ns_steps: Newton-Schulz iterations.
    ns_coeffs: coefficients, see :func:`stablejax.newton_schulz`.
    consistent_rms: Moonlight scale factor, or None for ``sqrt(max(1, fan_out / fan_in))``.
    outlier_threshold: z threshold (``"zscore"``) or ``2 k`` for ``"iqr"``.
    outlier_method: "zscore", "iqr" or None.
    ns_backend: "auto", "xla" or "pallas" (see :func:`stablejax.newton_schulz`).
    eps: added to the Frobenius norm before NS.

  Returns:
    An ``optax.GradientTransformation`` with :class:`OutlierSafeMuonState`.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> from stablejax.muon.muon import scale_by_outlier_safe_muon
    >>> tx = optax.chain(scale_by_outlier_safe_muon(), optax.scale(-1e-3))
    >>> state = tx.init({"w": jnp.ones((8, 16))})
  """
  _validate_muon_args(momentum, ns_steps, outlier_threshold, outlier_method, ns_backend)
  _ns.resolve_coeffs(ns_coeffs, ns_steps)  # validates early

  def init_fn(params):
    for path, p in jax.tree_util.tree_flatten_with_path(params)[0]:
      if jnp.ndim(p) < 2:
        raise ValueError(f"Muon needs matrices but {routing.path_to_str(path)} has shape "
                         f"{jnp.shape(p)}; label it 'adam' in param_labels")
    zero_f = jnp.zeros((), jnp.float32)
    zero_i = jnp.zeros((), jnp.int32)
    return OutlierSafeMuonState(
        count=zero_i, mu=optax.tree.zeros_like(params), outlier_count=zero_i,
        instability_count=zero_i, fallback_count=zero_i, outlier_rate=zero_f,
        ns_instability_rate=zero_f, fallback_rate=zero_f)

  def one(g, m, count_inc):
    m = (momentum * m + (1 - momentum) * g).astype(m.dtype)
    beta = jnp.asarray(momentum, m.dtype)
    if nesterov:
      corr_next = 1 - beta ** (count_inc + 1).astype(m.dtype)
      corr_now = 1 - beta ** count_inc.astype(m.dtype)
      m_hat = beta * (m / corr_next) + (1 - beta) * (g / corr_now)
    else:
      m_hat = m / (1 - beta ** count_inc.astype(m.dtype))
    m_hat, n_out = clamp_outliers(m_hat, outlier_method, outlier_threshold)
    o = _ns.newton_schulz(m_hat, steps=ns_steps, coeffs=ns_coeffs, eps=eps, backend=ns_backend)
    healthy, mom_finite = ns_health(o, m_hat)
    mf = m_hat.astype(jnp.float32)
    norm = jnp.sqrt(jnp.sum(mf * mf, axis=(-2, -1), keepdims=True))
    usable = mom_finite[..., None, None] & (norm > 0)
    fallback = jnp.where(usable, mf / jnp.where(usable, norm, 1.0), 0.0).astype(o.dtype)
    o = jnp.where(healthy[..., None, None], o, fallback)
    o = (o * shape_scale(o.shape, consistent_rms)).astype(g.dtype)
    n_slices = math.prod(o.shape[:-2])
    unstable = jnp.sum(~healthy & mom_finite, dtype=jnp.int32)
    fell_back = jnp.sum(~healthy, dtype=jnp.int32)
    return o, m, n_out, unstable, fell_back, o.size, n_slices

  def update_fn(updates, state, params=None):
    del params
    count_inc = optax.safe_increment(state.count)
    g_leaves, treedef = jax.tree.flatten(updates)
    m_leaves = treedef.flatten_up_to(state.mu)
    results = [one(g, m, count_inc) for g, m in zip(g_leaves, m_leaves)]
    new_updates = treedef.unflatten([r[0] for r in results])
    new_mu = treedef.unflatten([r[1] for r in results])
    zero_i = jnp.zeros((), jnp.int32)
    n_out = sum((r[2] for r in results), zero_i)
    n_unstable = sum((r[3] for r in results), zero_i)
    n_fallback = sum((r[4] for r in results), zero_i)
    n_entries = max(1, sum(r[5] for r in results))
    n_mats = max(1, sum(r[6] for r in results))
    return new_updates, OutlierSafeMuonState(
        count=count_inc,
        mu=new_mu,
        outlier_count=_saturating_add(state.outlier_count, n_out),
        instability_count=_saturating_add(state.instability_count, n_unstable),
        fallback_count=_saturating_add(state.fallback_count, n_fallback),
        outlier_rate=n_out.astype(jnp.float32) / n_entries,
        ns_instability_rate=n_unstable.astype(jnp.float32) / n_mats,
        fallback_rate=n_fallback.astype(jnp.float32) / n_mats,
    )

  return optax.GradientTransformation(init_fn, update_fn)


def _validate_muon_args(momentum, ns_steps, outlier_threshold, outlier_method, ns_backend):
  if not 0.0 <= float(momentum) < 1.0:
    raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
  if isinstance(ns_steps, bool) or not isinstance(ns_steps, int) or ns_steps < 1:
    raise ValueError(f"ns_steps must be a positive int, got {ns_steps!r}")
  if outlier_method not in OUTLIER_METHODS:
    raise ValueError(f"outlier_method must be one of {OUTLIER_METHODS}, got {outlier_method!r}")
  if outlier_method is not None and not float(outlier_threshold) > 0:
    raise ValueError(f"outlier_threshold must be > 0, got {outlier_threshold!r}")
  if ns_backend not in _ns.BACKENDS:
    raise ValueError(f"ns_backend must be one of {_ns.BACKENDS}, got {ns_backend!r}")


def _group_rms(updates, labels):
  sums = {g: jnp.zeros((), jnp.float32) for g in routing.GROUPS}
  counts = {g: 0 for g in routing.GROUPS}
  for u, label in zip(jax.tree.leaves(updates), jax.tree.leaves(labels)):
    uf = u.astype(jnp.float32)
    sums[label] = sums[label] + jnp.sum(uf * uf)
    counts[label] += u.size
  return {g: jnp.sqrt(sums[g] / max(counts[g], 1)) for g in routing.GROUPS}


def with_group_update_rms(inner: optax.GradientTransformation, labels_fn
                          ) -> optax.GradientTransformationExtraArgs:
  """Wraps ``inner`` and records the RMS of its output updates per routing group.

  Args:
    inner: any transform (here the routed ``optax.partition``).
    labels_fn: ``params_or_updates -> label pytree`` with labels from ``routing.GROUPS``.

  Returns:
    A transform with :class:`GroupUpdateRmsState`.
  """
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    zero = jnp.zeros((), jnp.float32)
    return GroupUpdateRmsState(inner.init(params), zero, zero, zero, zero)

  def update_fn(updates, state, params=None, **extra_args):
    new_updates, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
    rms = _group_rms(new_updates, labels_fn(new_updates))
    return new_updates, GroupUpdateRmsState(inner_state, **rms)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class RoutingInfo(NamedTuple):
  param_labels: Any
  learning_rates: dict


_ROUTING: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def routing_info(tx) -> Optional[RoutingInfo]:
  """Routing (labels and per-group learning rates) of a transform built by outlier_safe_muon."""
  try:
    return _ROUTING.get(tx.init)
  except TypeError:
    return None


def _is_zero(value) -> bool:
  return isinstance(value, numbers.Number) and value == 0


def outlier_safe_muon(learning_rate, momentum=0.95, nesterov=True, ns_steps=5,
                      ns_coeffs="standard", weight_decay=0.0, consistent_rms=0.2,
                      adam_learning_rate=None, embedding_learning_rate=None,
                      head_learning_rate=None, adam_b1=0.9, adam_b2=0.95, adam_eps=1e-8,
                      adam_weight_decay=0.0, outlier_threshold=5.0, outlier_method="zscore",
                      ns_backend="auto", param_labels=None
                      ) -> optax.GradientTransformationExtraArgs:
  """Muon for hidden matrices, AdamW for embeddings, head, norms and biases, with safety guards.

  Routing (see :func:`stablejax.label_params`, printable with :func:`stablejax.describe_routing`):
  hidden matrices -> Muon at ``learning_rate``; embeddings -> AdamW at
  ``embedding_learning_rate``; output head -> AdamW at ``head_learning_rate``; norms, biases and
  scalars -> AdamW at ``adam_learning_rate``.

  Muon branch, per matrix (last two axes ``[fan_in, fan_out]``, leading axes batch):
  Nesterov momentum, outlier clamp of the NS input, Newton-Schulz, health check with emergency
  fallback, scale by ``consistent_rms * sqrt(max(fan_in, fan_out))`` (Moonlight, arXiv
  2502.16982) or ``sqrt(max(1, fan_out / fan_in))`` when ``consistent_rms`` is None, decoupled
  weight decay ``weight_decay * lr * param``, then ``-lr``.

  Compared with ``optax.contrib.muon(..., consistent_rms=..., eps=1e-8)``: with
  ``outlier_method=None`` the Muon branch produces the same updates (same bias-corrected
  Nesterov momentum, NS, scale and decay; only the ``"auto"`` NS backend may differ in rounding
  on GPU/TPU). Intended differences: optax routes by ``ndim == 2`` only (embeddings and the head
  go to Muon, stacked ``[L, in, out]`` kernels need explicit dimension numbers) while this routes
  by path and treats leading axes as batch; optax's AdamW branch uses Nesterov and one learning
  rate, while here the AdamW groups are plain ``optax.adamw`` with three learning rates, and
  AdamW weight decay is not applied to vectors and scalars (norm scales, biases).

  Learning-rate defaults: ``adam_learning_rate=None`` uses ``learning_rate`` when
  ``consistent_rms`` is set (the Moonlight scale matches AdamW's update RMS, so one rate serves
  both); with ``consistent_rms=None`` Muon rates (~0.02) are far too large for AdamW, so
  ``adam_learning_rate`` is then required. ``embedding_learning_rate`` and
  ``head_learning_rate`` default to ``adam_learning_rate``. Every rate may be an optax schedule.

  Args:
    learning_rate: Muon learning rate (float or schedule).
    momentum: Muon momentum (EMA decay).
    nesterov: Nesterov momentum for Muon.
    ns_steps: Newton-Schulz iterations.
    ns_coeffs: "standard", "polar_express", a triple or per-step triples.
    weight_decay: decoupled weight decay for Muon matrices (multiplied by the learning rate).
    consistent_rms: Moonlight RMS factor (0.2) or None for width scaling.
    adam_learning_rate: AdamW rate for norms, biases, scalars.
    embedding_learning_rate: AdamW rate for embeddings.
    head_learning_rate: AdamW rate for the output head.
    adam_b1, adam_b2, adam_eps: AdamW hyperparameters.
    adam_weight_decay: AdamW decoupled weight decay (matrices of the AdamW groups only).
    outlier_threshold: z threshold for "zscore"; ``2 k`` for "iqr".
    outlier_method: "zscore", "iqr" or None (no clamping).
    ns_backend: "auto", "xla" or "pallas".
    param_labels: None (default path rule), a label pytree, or a callable ``params -> labels``;
      labels are "muon", "adam", "embedding", "head".

  Returns:
    An ``optax.GradientTransformationExtraArgs``; its state is :class:`GroupUpdateRmsState`
    around an ``optax.partition`` state whose Muon branch holds :class:`OutlierSafeMuonState`.
    ``update`` needs ``params`` (AdamW weight decay).

  Example:
    >>> import jax, jax.numpy as jnp, optax, stablejax
    >>> params = {"embed": jnp.zeros((32, 8)), "w": jnp.ones((8, 8)), "b": jnp.zeros(8)}
    >>> tx = stablejax.outlier_safe_muon(learning_rate=2e-3, adam_learning_rate=1.5e-3)
    >>> state = tx.init(params)
    >>> grads = jax.tree.map(jnp.ones_like, params)
    >>> updates, state = tx.update(grads, state, params)
    >>> params = optax.apply_updates(params, updates)
    >>> sorted(stablejax.stability_metrics(state))[:2]
    ['muon/fallback_count', 'muon/fallback_rate']
  """
  _validate_muon_args(momentum, ns_steps, outlier_threshold, outlier_method, ns_backend)
  if adam_learning_rate is None:
    if consistent_rms is None:
      raise ValueError("adam_learning_rate is required when consistent_rms=None (Muon's width "
                       "scaling uses rates ~0.02, too large for AdamW); pass e.g. 3e-4")
    adam_learning_rate = learning_rate
  if embedding_learning_rate is None:
    embedding_learning_rate = adam_learning_rate
  if head_learning_rate is None:
    head_learning_rate = adam_learning_rate
  if param_labels is not None and not callable(param_labels):
    routing.resolve_labels(param_labels, param_labels)  # validates the label values early

  def labels_fn(tree):
    return routing.resolve_labels(tree, param_labels)

  muon_parts = [
      scale_by_outlier_safe_muon(
          momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, ns_coeffs=ns_coeffs,
          consistent_rms=consistent_rms, outlier_threshold=outlier_threshold,
          outlier_method=outlier_method, ns_backend=ns_backend, eps=1e-8),
  ]
  if not _is_zero(weight_decay):
    muon_parts.append(optax.add_decayed_weights(weight_decay))
  muon_parts.append(optax.scale_by_learning_rate(learning_rate))

  def matrices_only(params):
    return jax.tree.map(lambda p: jnp.ndim(p) >= 2, params)

  def adamw(lr, mask=None):
    return optax.adamw(lr, b1=adam_b1, b2=adam_b2, eps=adam_eps, weight_decay=adam_weight_decay,
                       mask=mask)

  transforms = {
      "muon": optax.chain(*muon_parts),
      "adam": adamw(adam_learning_rate, mask=matrices_only),
      "embedding": adamw(embedding_learning_rate),
      "head": adamw(head_learning_rate),
  }
  tx = with_group_update_rms(optax.partition(transforms, labels_fn), labels_fn)
  _ROUTING[tx.init] = RoutingInfo(
      param_labels=param_labels,
      learning_rates={"muon": learning_rate, "adam": adam_learning_rate,
                      "embedding": embedding_learning_rate, "head": head_learning_rate})
  return tx


def _muon_metrics(s: OutlierSafeMuonState) -> dict:
  return {
      "outlier_rate": s.outlier_rate,
      "ns_instability_rate": s.ns_instability_rate,
      "fallback_rate": s.fallback_rate,
      "outlier_count": s.outlier_count,
      "fallback_count": s.fallback_count,
  }


def _group_rms_metrics(s: GroupUpdateRmsState) -> dict:
  return {g: getattr(s, g) for g in routing.GROUPS}


register_state_metrics(OutlierSafeMuonState, "muon", _muon_metrics)
register_state_metrics(GroupUpdateRmsState, "muon/update_rms", _group_rms_metrics)
