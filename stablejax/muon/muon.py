"""Outlier-safe Muon: Newton-Schulz momentum orthogonalisation with statistical guards.

Muon (Jordan et al., https://github.com/KellerJordan/modded-nanogpt) updates each hidden weight
matrix with the (approximate) polar factor of its momentum, computed by Newton-Schulz (see
:mod:`stablejax.muon.newton_schulz`). Liu et al., "Muon is Scalable for LLM Training" (Moonlight,
arXiv 2502.16982) scale that update by ``0.2 * sqrt(max(fan_in, fan_out))`` so its RMS matches
AdamW's and add decoupled weight decay. Everything that is not a hidden matrix (embeddings, the
output head, norms, biases, scalars) goes to AdamW with its own learning rate
(:mod:`stablejax.muon.routing`, which also decides each matrix's layout, e.g. Flax attention
kernels ``[D, H, hd]`` as one ``[D, H*hd]`` matrix).

The "outlier-safe" layer adds, per Muon matrix and per step, all on device:

* **Outlier clamping** before NS: entries of the momentum matrix that are statistical outliers
  (z-score or inter-quartile range) are clamped back to the boundary, so one exploding entry
  cannot take over the Frobenius normalisation and flatten every other direction of the update.
  The matrix keeps its shape and every other entry.
* **NS health check** after NS: a non-finite result, or one whose Frobenius norm is outside what
  NS can produce, is replaced by the Frobenius-normalised momentum (the "emergency fallback";
  zero if the momentum itself is non-finite). What NS can produce: five standard steps map each
  normalised singular value ``s = sigma / ||M||_F`` to [0.68, 1.13] when ``s >= 0.0052``, to at
  most 1.21 for any ``s`` in (0, 1], and to about ``480 s`` (less than 0.68) when ``s < 0.0015``
  (numbers from iterating the polynomial, checked in the tests). Since the largest ``s`` is at
  least ``1 / sqrt(rank)``, ``||O||_F`` is at least ``0.1 * ||M||_F / (||M||_F + eps)`` for any
  matrix of rank up to about 20 million, and at most ``1.21 sqrt(rank) < 2 sqrt(rank)``; the
  check uses those bounds, so a near-zero momentum (``||M||_F ~ 1e-12``, below the ``eps = 1e-8``
  of the normalisation) gives the small update NS computes for it, as in optax, and is not
  counted as an instability.
* **Non-finite gradients** (in every group, Muon and AdamW alike): a tensor whose gradient, new
  optimizer state or update is not finite gets a zero update for that step and keeps its
  optimizer state (momentum, Adam moments), so one NaN cannot freeze the matrix for good. The
  other tensors update normally; shared step counts advance. Counted as
  ``muon/nonfinite_count`` / ``muon/nonfinite_rate``.
* **Counters and rates** in :class:`OutlierSafeMuonState` and :class:`GroupUpdateRmsState`,
  exposed by :func:`stablejax.stability_metrics` as ``muon/outlier_rate``,
  ``muon/ns_instability_rate``, ``muon/fallback_rate``, ``muon/outlier_count``,
  ``muon/fallback_count``, ``muon/nonfinite_count``, ``muon/nonfinite_rate`` and
  ``muon/update_rms/<group>``.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from stablejax.muon import newton_schulz as _ns
from stablejax.muon import normuon as _normuon
from stablejax.muon import routing
from stablejax.muon import sharding as _sharding
from stablejax.transforms._common import finite_probe, probe_total
from stablejax.transforms._common import sum_of_scalars
from stablejax.transforms.metrics import Rate, Series, register_state_metrics

OUTLIER_METHODS = (None, "zscore", "iqr")
# Above this many entries per matrix, IQR quartiles come from a strided subsample.
IQR_EXACT_MAX = 4096
# NS health bounds on ||O||_F (see the module docstring): at least 0.1 x the Frobenius norm of
# the normalised input ||M|| / (||M|| + eps), at most 2 sqrt(rank) (each output singular value is
# <= 1.21 for the standard coefficients).
_HEALTH_MIN_FRO = 0.1
_HEALTH_MAX_FRO_PER_SQRT_RANK = 2.0
_INT32_MAX = jnp.iinfo(jnp.int32).max
DEFAULT_NS_STEPS = 5


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
    nonfinite_count: int32 total number of tensors (of every group of
      :func:`outlier_safe_muon`, which sets it) skipped because their gradient, new state or
      update was not finite.
    nonfinite_rate: float32 fraction of all tensors skipped that way this step.

  A scan-stacked ``[L, in, out]`` parameter counts as ``L`` matrices.

  Example:
    >>> import jax, jax.numpy as jnp, optax, stablejax
    >>> params = {"w": jnp.full((8, 16), 0.1), "b": jnp.zeros((16,))}
    >>> tx = stablejax.outlier_safe_muon(learning_rate=0.02, adam_learning_rate=1e-3)
    >>> grad_w = jax.random.normal(jax.random.key(0), (8, 16)).at[0, 0].set(1000.0)
    >>> _, state = tx.update({"w": grad_w, "b": jnp.ones((16,))}, tx.init(params), params)
    >>> muon = {k: optax.tree_utils.tree_get(state, k)
    ...         for k in ("outlier_count", "outlier_rate", "fallback_rate")}
    >>> {k: v.item() for k, v in muon.items()}  # the 1000 is clamped: 1 of 128 entries
    {'outlier_count': 1, 'outlier_rate': 0.0078125, 'fallback_rate': 0.0}
  """
  count: jax.Array  # type: ignore[assignment]  # shadows tuple.count, as in optax states
  mu: optax.Updates
  outlier_count: jax.Array
  instability_count: jax.Array
  fallback_count: jax.Array
  outlier_rate: jax.Array
  ns_instability_rate: jax.Array
  fallback_rate: jax.Array
  nonfinite_count: jax.Array
  nonfinite_rate: jax.Array


class GroupUpdateRmsState(NamedTuple):
  """Wrapper state of :func:`outlier_safe_muon`: the routed inner state and per-group numbers.

  Attributes:
    inner_state: the ``optax.partition`` state of the four groups (each group's state wrapped
      in a :class:`TensorGuardState`).
    muon, adam, embedding, head: float32 RMS of the final update (after learning rate and
      weight decay) applied to that group at the last step; 0 for an empty group.

  Example:
    >>> import jax, jax.numpy as jnp, stablejax
    >>> params = {"w": jnp.full((8, 16), 0.1), "b": jnp.zeros((16,))}
    >>> tx = stablejax.outlier_safe_muon(learning_rate=0.02, adam_learning_rate=1e-3)
    >>> grads = {"w": jax.random.normal(jax.random.key(0), (8, 16)), "b": jnp.ones((16,))}
    >>> updates, state = tx.update(grads, tx.init(params), params)
    >>> rms = lambda x: float(jnp.sqrt(jnp.mean(jnp.square(x))))
    >>> bool(jnp.isclose(state.muon, rms(updates["w"])))
    True
    >>> # Adam's first step has the size of its learning rate; there is no embedding here
    >>> round(float(state.adam), 6), float(state.embedding)
    (0.001, 0.0)
  """
  inner_state: Any
  muon: jax.Array
  adam: jax.Array
  embedding: jax.Array
  head: jax.Array


class TensorGuardState(NamedTuple):
  """State of :func:`skip_nonfinite_tensors`.

  Attributes:
    inner_state: the wrapped transform's state.
    skipped: int32 number of tensors skipped at the last step.
  """
  inner_state: Any
  skipped: jax.Array


def _total(vectors: list) -> jax.Array:
  """Sum of the per-matrix numbers of every leaf, as one reduction (see ``sum_of_scalars``)."""
  if not vectors:
    return jnp.zeros((), jnp.float32)
  joined = jnp.concatenate(vectors)
  return jnp.sum(joined) if joined.shape[0] == 1 else jnp.sum(jnp.sort(joined))


def _saturating_add(total: jax.Array, inc: jax.Array) -> jax.Array:
  inc = inc.astype(jnp.int32)
  return jnp.where(total > _INT32_MAX - inc, _INT32_MAX, total + inc).astype(jnp.int32)


def _strided_sample(x2: jax.Array, size: int) -> jax.Array:
  """``x2`` is ``[..., r, c]``; returns ``[..., k]`` with k <= IQR_EXACT_MAX entries."""
  r, c = x2.shape[-2:]
  flat = x2.reshape(x2.shape[:-2] + (r * c,))
  if size <= IQR_EXACT_MAX:
    return flat
  stride = -(-size // IQR_EXACT_MAX)
  while math.gcd(stride, c) != 1:  # coprime with the row length: visits every column
    stride += 1
  return flat[..., ::stride]


def clamp_outliers(x: jax.Array, method: Optional[str],
                   threshold: float) -> tuple[jax.Array, jax.Array]:
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
  clamped, per_matrix = _clamp(x, method, threshold)
  return clamped, jnp.sum(per_matrix, dtype=jnp.int32)


def _clamp(x: jax.Array, method: Optional[str],
           threshold: float) -> tuple[jax.Array, jax.Array]:
  """:func:`clamp_outliers` with the count per matrix (shape ``x.shape[:-2]``)."""
  if method is None:
    return x, jnp.zeros(x.shape[:-2], jnp.int32)
  xf = x.astype(jnp.float32)
  axes = (-2, -1)
  if method == "zscore":
    mean = jnp.mean(xf, axis=axes, keepdims=True)
    # jnp.std's own arithmetic (mean of squared deviations, square root), reusing the mean.
    std = jnp.sqrt(jnp.mean(jnp.square(xf - mean), axis=axes, keepdims=True))
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
  # Counted as a float32 sum of ones (exact up to 2**24 per matrix, per row beyond): an int32
  # reduction is a separate tree of kernels on XLA:CPU for every matrix, a float sum is not.
  moved = ((clamped != xf) & jnp.isfinite(xf)).astype(jnp.float32)
  if x.shape[-2] * x.shape[-1] <= 2**24:
    n = jnp.sum(moved, axis=axes).astype(jnp.int32)
  else:
    n = jnp.sum(jnp.sum(moved, axis=-1).astype(jnp.int32), axis=-1)
  return clamped.astype(x.dtype), n



def ns_health(out: jax.Array, mom: jax.Array, eps: float = 0.0, mom_norm: Optional[jax.Array] = None
              ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Per-slice health of an NS output ``out`` for momentum ``mom`` (both ``[..., r, c]``).

  Healthy: finite, and ``0.1 * ||mom|| / (||mom|| + eps) <= ||out||_F <= 2 sqrt(rank)`` (see the
  module docstring for why NS output always lies there). "Finite" is read off the Frobenius
  norms (NaN or Inf in any entry makes them so; so does a norm above about 1e19, far outside
  what NS produces), which also serve the bounds: one sum per slice (two without ``mom_norm``),
  no boolean all-reductions (several times slower to compile on XLA:CPU).

  Args:
    out: the NS output.
    mom: its input.
    eps: the ``eps`` NS normalised with.
    mom_norm: the float32 Frobenius norms of ``mom``'s slices, if already computed.

  Returns:
    ``(healthy, mom_finite, mom_norm)``: bool arrays of shape ``out.shape[:-2]`` and the float32
    Frobenius norm of each momentum slice.
  """
  fro = _ns.frobenius_norm(out)
  mom_fro = _ns.frobenius_norm(mom) if mom_norm is None else mom_norm
  rank_bound = min(out.shape[-2:])
  finite = jnp.isfinite(fro)
  mom_finite = jnp.isfinite(mom_fro)
  normalised = mom_fro / (mom_fro + eps) if eps else jnp.where(mom_fro > 0, 1.0, 0.0)
  in_range = (fro <= _HEALTH_MAX_FRO_PER_SQRT_RANK * math.sqrt(rank_bound)) & (
      fro >= _HEALTH_MIN_FRO * normalised)
  return finite & in_range & mom_finite, mom_finite, mom_fro


def shape_scale(fan_in: int, fan_out: int, consistent_rms: Any) -> Any:
  """Muon update scale for a ``[fan_in, fan_out]`` matrix.

  ``consistent_rms * sqrt(max(fan_in, fan_out))`` (Moonlight, arXiv 2502.16982) or, when
  ``consistent_rms`` is None, ``sqrt(max(1, fan_out / fan_in))`` (Jordan's width scaling).
  ``consistent_rms`` may be a traced array (``optax.inject_hyperparams``).
  """
  if consistent_rms is None:
    return math.sqrt(max(1.0, fan_out / fan_in))
  return consistent_rms * math.sqrt(max(fan_in, fan_out))


# The matrices of a leaf (routing.to_matrices, routing.split_fused): shared with NorMuon.
_to_matrices = routing.to_matrices
_split_fused = routing.split_fused


def _static_int(value: Any, name: str) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise ValueError(f"{name} must be a Python int, got {value!r} (under optax.inject_hyperparams "
                     f"pass static_args=({name!r},))")
  return int(value)


def _concrete(value: Any) -> Optional[float]:
  """``float(value)``, or None for a traced value (a hyperparameter under inject_hyperparams)."""
  try:
    return float(value)
  except (TypeError, jax.errors.ConcretizationTypeError):
    return None


def scale_by_outlier_safe_muon(momentum: float = 0.95, nesterov: bool = True,
                               ns_steps: Optional[int] = None,
                               ns_coeffs: Any = "standard", consistent_rms: Optional[float] = 0.2,
                               outlier_threshold: float = 5.0,
                               outlier_method: Optional[str] = "zscore",
                               ns_backend: str = "auto", eps: float = 1e-8,
                               weight_dimension_numbers: Any = None
                               ) -> optax.GradientTransformation:
  """The Muon direction for matrices: momentum, outlier clamp, NS, health check, shape scale.

  Every leaf must have ``ndim >= 2``. Its matrix is given by ``weight_dimension_numbers`` (as
  ``optax.contrib.scale_by_muon`` takes it: a tree, or a callable of the updates, of
  ``optax.contrib.MuonDimensionNumbers``; a None entry, or no argument, means the default
  layout: Flax attention kernels as one matrix, otherwise the last two axes
  ``[..., fan_in, fan_out]`` with leading batch axes). Learning rate and weight decay are applied
  by :func:`outlier_safe_muon`.

  The momentum follows ``optax.contrib.scale_by_muon`` exactly (EMA ``mu = b mu + (1 - b) g``
  with bias correction; Nesterov input ``b mu_hat_{t+1} + (1 - b) g_hat_t``), so with
  ``outlier_method=None`` and a healthy NS the direction equals optax's for the same dimension
  numbers. The clamp acts on the NS input only; the stored momentum is not modified, so a spike
  that lingers in the buffer is clamped (and counted) on every step it would dominate.

  Args:
    momentum: EMA decay of the momentum.
    nesterov: use Nesterov momentum.
    ns_steps: Newton-Schulz iterations (a Python int); None: 5.
    ns_coeffs: coefficients, see :func:`stablejax.newton_schulz`.
    consistent_rms: Moonlight scale factor, or None for ``sqrt(max(1, fan_out / fan_in))``.
    outlier_threshold: z threshold (``"zscore"``) or ``2 k`` for ``"iqr"``.
    outlier_method: "zscore", "iqr" or None.
    ns_backend: "auto", "xla" or "pallas" (see :func:`stablejax.newton_schulz`).
    eps: added to the Frobenius norm before NS.
    weight_dimension_numbers: matrix layouts, see above.

  Returns:
    An ``optax.GradientTransformation`` with :class:`OutlierSafeMuonState`.

  References:
    Jordan et al., `Muon <https://kellerjordan.github.io/posts/muon/>`_ (2024); Liu et al.,
    `Muon is Scalable for LLM Training <https://arxiv.org/abs/2502.16982>`_ (arXiv 2502.16982).

  Example:
    >>> import jax.numpy as jnp, optax
    >>> from stablejax.muon.muon import scale_by_outlier_safe_muon
    >>> tx = optax.chain(scale_by_outlier_safe_muon(), optax.scale(-1e-3))
    >>> state = tx.init({"w": jnp.ones((8, 16))})
  """
  def layouts_of(tree: Any) -> list:
    return [d for d in routing.matrix_layouts(tree, weight_dimension_numbers) if d is not None]

  return _muon_direction(momentum, nesterov, ns_steps, ns_coeffs, consistent_rms,
                         outlier_threshold, outlier_method, ns_backend, eps, layouts_of)


def _muon_direction(momentum: Any, nesterov: bool, ns_steps: Optional[int], ns_coeffs: Any,
                    consistent_rms: Any, outlier_threshold: Any, outlier_method: Optional[str],
                    ns_backend: str, eps: float, layouts: Any, ns_method: str = "standard",
                    ns_preconditioning: str = "frobenius") -> optax.GradientTransformation:
  """:func:`scale_by_outlier_safe_muon` with the layouts given as ``tree -> [dims per leaf]``."""
  ns_steps = _validate_muon_args(momentum, ns_steps, outlier_threshold, outlier_method, ns_backend)
  _ns.resolve_iteration(ns_coeffs, ns_steps, ns_method, ns_preconditioning)  # validates early

  def init_fn(params: Any) -> OutlierSafeMuonState:
    leaves, _ = routing.param_leaves(params)
    for leaf in leaves:
      if not leaf.masked and len(leaf.shape) < 2:
        raise ValueError(f"Muon needs matrices but {leaf.path} has shape {leaf.shape}; label it "
                         "'adam' in param_labels")
    layouts(params)  # validates the dimension numbers
    zero_f = jnp.zeros((), jnp.float32)
    zero_i = jnp.zeros((), jnp.int32)
    return OutlierSafeMuonState(
        count=zero_i, mu=optax.tree.zeros_like(params), outlier_count=zero_i,
        instability_count=zero_i, fallback_count=zero_i, outlier_rate=zero_f,
        ns_instability_rate=zero_f, fallback_rate=zero_f, nonfinite_count=zero_i,
        nonfinite_rate=zero_f)

  def bias_corrections(count_inc: jax.Array) -> Callable[[Any], tuple[jax.Array, ...]]:
    """``dtype -> (beta, 1 - beta^(t+1), 1 - beta^t)``, computed once per dtype per update
    (the same scalars serve every leaf: traced once, not once per leaf)."""
    cache: dict = {}

    def corrections(dtype: Any) -> tuple[jax.Array, ...]:
      if dtype not in cache:
        beta = jnp.asarray(momentum, dtype)
        corr_next = 1 - beta ** (count_inc + 1).astype(dtype)
        corr_now = 1 - beta ** count_inc.astype(dtype)
        cache[dtype] = (beta, corr_next, corr_now)
      return cache[dtype]
    return corrections

  def momentum_input(g: jax.Array, m: jax.Array,
                     corrections: Callable[[Any], tuple[jax.Array, ...]]
                     ) -> tuple[jax.Array, jax.Array]:
    m = (momentum * m + (1 - momentum) * g).astype(m.dtype)
    beta, corr_next, corr_now = corrections(m.dtype)
    if nesterov:
      m_hat = beta * (m / corr_next) + (1 - beta) * (g / corr_now)
    else:
      m_hat = m / corr_now
    return m, m_hat

  def orthogonalise(x: jax.Array) -> tuple[jax.Array, ...]:
    """Clamp, NS, health check and scale of a stack ``[n, fan_in, fan_out]`` of matrices."""
    x, n_out = _clamp(x, outlier_method, outlier_threshold)
    norm = _ns.frobenius_norm(x)  # shared by NS's normalisation and the health check
    o = _ns.newton_schulz_given_norm(x, norm, ns_steps, ns_coeffs, eps, ns_backend, ns_method,
                                     ns_preconditioning)
    healthy, mom_finite, norm = ns_health(o, x, eps, norm)
    xf = x.astype(jnp.float32)
    fallback = jnp.where(mom_finite[..., None, None], xf / (norm[..., None, None] + eps),
                         0.0).astype(o.dtype)
    o = jnp.where(healthy[..., None, None], o, fallback)
    o = o * shape_scale(o.shape[-2], o.shape[-1], consistent_rms)
    return o, n_out, ~healthy & mom_finite, ~healthy  # per matrix

  def update_fn(updates: Any, state: OutlierSafeMuonState,
                params: Any = None) -> tuple[Any, OutlierSafeMuonState]:
    del params
    count_inc = jnp.asarray(optax.safe_increment(state.count))
    treedef: Any  # jaxlib ships no type stub for PyTreeDef: its methods are unknown to mypy
    g_leaves, treedef = jax.tree.flatten(updates)
    try:
      m_leaves = treedef.flatten_up_to(state.mu)
    except (ValueError, TypeError) as e:
      raise ValueError(
          "outlier_safe_muon: the Muon parameters of this update differ from the ones its state "
          "was initialised with; pass update() the same parameter tree (same paths and shapes) "
          f"as init() ({e})") from None
    for path_g, m in zip(jax.tree_util.tree_flatten_with_path(updates)[0], m_leaves):
      if jnp.shape(path_g[1]) != jnp.shape(m):
        raise ValueError(f"outlier_safe_muon: {routing.path_to_str(path_g[0])} has shape "
                         f"{jnp.shape(path_g[1])} in the update but {jnp.shape(m)} in the state")
    dims = layouts(updates)
    corrections = bias_corrections(count_inc)
    new_mu, new_leaves, per_matrix = [], [], []
    n_entries = n_mats = 0
    for g, m, d in zip(g_leaves, m_leaves, dims):
      m, m_hat = momentum_input(g, m, corrections)
      new_mu.append(m)
      # NS needs whole matrices: a sharded leaf is gathered once here (not once per iteration).
      m_hat, restore = _sharding.gather(m_hat)
      pieces, join = _split_fused(m_hat, d)  # a fused kernel: each projection its own matrix
      outs = []
      for piece, piece_dims in pieces:
        x, back = _to_matrices(piece, piece_dims)
        o, *counts = orthogonalise(_sharding.replicated(x))
        outs.append(back(_sharding.replicated(o).astype(g.dtype)))
        per_matrix.append([c.reshape(-1).astype(jnp.float32) for c in counts])
        n_entries += x.size
        n_mats += math.prod(x.shape[:-2])
      new_leaves.append(restore(join(outs)))
    # Counts over every matrix, each one reduction (see stablejax.transforms._common).
    n_out, n_unstable, n_fallback = (_total([c[k] for c in per_matrix]).astype(jnp.int32)
                                     for k in range(3))
    n_entries, n_mats = max(1, n_entries), max(1, n_mats)
    return treedef.unflatten(new_leaves), OutlierSafeMuonState(
        count=count_inc,
        mu=treedef.unflatten(new_mu),
        outlier_count=_saturating_add(state.outlier_count, n_out),
        instability_count=_saturating_add(state.instability_count, n_unstable),
        fallback_count=_saturating_add(state.fallback_count, n_fallback),
        outlier_rate=n_out.astype(jnp.float32) / n_entries,
        ns_instability_rate=n_unstable.astype(jnp.float32) / n_mats,
        fallback_rate=n_fallback.astype(jnp.float32) / n_mats,
        nonfinite_count=state.nonfinite_count,
        nonfinite_rate=state.nonfinite_rate,
    )

  return optax.GradientTransformation(init_fn, update_fn)  # type: ignore[arg-type]


def _validate_muon_args(momentum: Any, ns_steps: Any, outlier_threshold: Any,
                        outlier_method: Any, ns_backend: Any) -> int:
  """Validates the arguments that are concrete (traced ones come from inject_hyperparams)."""
  m = _concrete(momentum)
  if m is not None and not 0.0 <= m < 1.0:
    raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
  if ns_steps is None:  # the default: a non-numeric default stays static under inject_hyperparams
    ns_steps = DEFAULT_NS_STEPS
  if isinstance(ns_steps, (int, np.integer)) and not isinstance(ns_steps, bool) and ns_steps < 1:
    raise ValueError(f"ns_steps must be a positive int, got {ns_steps!r}")
  ns_steps = _static_int(ns_steps, "ns_steps")
  if outlier_method not in OUTLIER_METHODS:
    raise ValueError(f"outlier_method must be one of {OUTLIER_METHODS}, got {outlier_method!r}")
  t = _concrete(outlier_threshold)
  if outlier_method is not None and t is not None and not t > 0:
    raise ValueError(f"outlier_threshold must be > 0, got {outlier_threshold!r}")
  if ns_backend not in _ns.BACKENDS:
    raise ValueError(f"ns_backend must be one of {_ns.BACKENDS}, got {ns_backend!r}")
  return ns_steps


def skip_nonfinite_tensors(inner: optax.GradientTransformation
                           ) -> optax.GradientTransformationExtraArgs:
  """Per-tensor finite guard: a tensor whose gradient, new state or update is not finite is skipped.

  A skipped tensor gets a zero update and keeps its entries of every per-parameter state tree
  (momentum, Adam moments: any subtree of the state with the structure of the updates); the
  other tensors update normally, and shared scalars such as step counts advance. Unlike
  :func:`stablejax.skip_nonfinite`, which skips the whole step, this keeps a single bad tensor
  from poisoning its own state when the transform is used without that wrapper.

  Args:
    inner: the transform to guard (here one routing group of :func:`outlier_safe_muon`).

  Returns:
    A transform with :class:`TensorGuardState`.

  References:
    Micikevicius et al., `Mixed Precision Training <https://arxiv.org/abs/1710.03740>`_
    (arXiv 1710.03740), which skips an update whose gradients overflowed; here per tensor.
    Compare ``optax.apply_if_finite``, which skips the whole step.
  """
  inner = optax.with_extra_args_support(inner)

  def init_fn(params: Any) -> TensorGuardState:
    return TensorGuardState(inner.init(params), jnp.zeros((), jnp.int32))

  def update_fn(updates: Any, state: TensorGuardState, params: Any = None,
                **extra_args: Any) -> tuple[Any, TensorGuardState]:
    treedef: Any  # jaxlib ships no type stub for PyTreeDef: its methods are unknown to mypy
    leaves, treedef = jax.tree.flatten(updates)
    if not leaves:
      new_updates, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
      return new_updates, TensorGuardState(inner_state, jnp.zeros((), jnp.int32))
    # Finiteness as sums of x * 0 (0 or NaN; see stablejax.transforms._common.finite_probe).
    # The inner transform sees the gradient with its non-finite entries zeroed (an elementwise
    # select: no reduction before the update), so a bad tensor cannot disturb shared statistics;
    # the tensor is then skipped all the same, since its gradient is part of the check below.
    safe = treedef.unflatten([jnp.where(jnp.isfinite(g), g, jnp.zeros_like(g))
                              if jnp.issubdtype(g.dtype, jnp.inexact) else g for g in leaves])
    new_updates, inner_state = inner.update(safe, state.inner_state, params, **extra_args)

    def per_param(x: Any) -> bool:
      return jax.tree.structure(x) == treedef

    new_leaves = treedef.flatten_up_to(new_updates)
    per_leaf = [[g, u] for g, u in zip(leaves, new_leaves)]  # and every state entry of each
    for tree in jax.tree.leaves(inner_state, is_leaf=per_param):
      if per_param(tree):
        for arrays, x in zip(per_leaf, treedef.flatten_up_to(tree)):
          arrays.append(x)
    ok = [jnp.isfinite(finite_probe(*arrays)) for arrays in per_leaf]

    def keep_old(new: Any, old: Any) -> Any:
      if not per_param(new):
        return new
      return treedef.unflatten([jnp.where(k, n, o) for k, n, o in
                                zip(ok, treedef.flatten_up_to(new), treedef.flatten_up_to(old))])

    inner_state = jax.tree.map(keep_old, inner_state, state.inner_state, is_leaf=per_param)
    new_updates = treedef.unflatten([jnp.where(k, u, jnp.zeros_like(u))
                                     for k, u in zip(ok, new_leaves)])
    skipped = probe_total([(~k).astype(jnp.float32) for k in ok]).astype(jnp.int32)
    return new_updates, TensorGuardState(inner_state, skipped)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)  # type: ignore[arg-type]


def _group_rms(updates: Any, labels: list) -> dict:
  squares: dict = {g: [] for g in routing.GROUPS}
  counts = {g: 0 for g in routing.GROUPS}
  for u, label in zip(jax.tree.leaves(updates), labels):
    uf = u.astype(jnp.float32)
    squares[label].append(jnp.sum(uf * uf))
    counts[label] += u.size
  return {g: jnp.sqrt(sum_of_scalars(squares[g]) / max(counts[g], 1)) for g in routing.GROUPS}


def _is_zero(value: Any) -> bool:
  return isinstance(value, numbers.Number) and value == 0


def _check_same_parameters(updates: Any, params: Any) -> None:
  got, _ = routing.param_leaves(updates)
  want, _ = routing.param_leaves(params)
  for u, p in zip(got, want):
    if (u.names, u.shape) != (p.names, p.shape):
      raise ValueError(f"outlier_safe_muon.update: the updates hold {u.path} {u.shape} where the "
                       f"params hold {p.path} {p.shape}; pass updates and params with the same "
                       "structure as the params given to init")
  if len(got) != len(want):
    raise ValueError(f"outlier_safe_muon.update: {len(got)} updates for {len(want)} params; pass "
                     "updates and params with the same structure as the params given to init")


def outlier_safe_muon(
    learning_rate: optax.ScalarOrSchedule,
    momentum: float = 0.95,
    *,
    nesterov: bool = True,
    ns_steps: Optional[int] = None,
    ns_coeffs: _ns.CoeffsSpec = "standard",
    weight_decay: float = 0.0,
    consistent_rms: Optional[float] = 0.2,
    adam_learning_rate: Optional[optax.ScalarOrSchedule] = None,
    embedding_learning_rate: Optional[optax.ScalarOrSchedule] = None,
    head_learning_rate: Optional[optax.ScalarOrSchedule] = None,
    adam_b1: float = 0.9,
    adam_b2: float = 0.95,
    adam_eps: float = 1e-8,
    adam_weight_decay: float = 0.0,
    outlier_threshold: float = 5.0,
    outlier_method: Optional[str] = "zscore",
    ns_backend: str = "auto",
    param_labels: routing.LabelsOrFn = None,
    weight_dimension_numbers: routing.DimensionNumbersOrFn = None,
    strict_overrides: bool = False,
    ns_method: str = "standard",
    ns_preconditioning: str = "frobenius",
    per_head: bool = False,
    num_heads: Optional[int] = None,
    normuon: bool = False,
    normuon_b2: float = 0.95,
) -> optax.GradientTransformationExtraArgs:
  """Muon for hidden matrices, AdamW for embeddings, head, norms and biases, with safety guards.

  Routing (see :func:`stablejax.label_params`, printable with :func:`stablejax.describe_routing`):
  hidden matrices -> Muon at ``learning_rate``; embeddings -> AdamW at
  ``embedding_learning_rate``; output head -> AdamW at ``head_learning_rate``; norm gains, biases
  and scalars -> Adam at ``adam_learning_rate``, never weight decayed. Labels are a function of
  each parameter's path and shape only, so ``init`` and ``update`` agree however the tree is
  wrapped (Linen params, ``FrozenDict``, ``nnx.State`` with ``Variable``s at ``init`` and pure
  arrays at ``update`` as ``nnx.Optimizer`` does); an update tree with other parameters than
  ``init`` saw is a clear error.

  Muon branch, per matrix: Nesterov momentum, outlier clamp of the NS input, Newton-Schulz,
  health check with emergency fallback, scale by ``consistent_rms * sqrt(max(fan_in, fan_out))``
  (Moonlight, arXiv 2502.16982) or ``sqrt(max(1, fan_out / fan_in))`` when ``consistent_rms`` is
  None, decoupled weight decay ``weight_decay * lr * param``, then ``-lr``. The matrix of each
  leaf: see ``weight_dimension_numbers``.

  Every group: a tensor whose gradient (or new state, or update) is not finite gets a zero
  update and keeps its optimizer state for that step (``muon/nonfinite_count``); wrap the chain
  in :func:`stablejax.skip_nonfinite` to skip the whole step instead.

  Compared with ``optax.contrib.muon(..., consistent_rms=..., eps=1e-8)``: with
  ``outlier_method=None`` and the same dimension numbers the Muon branch produces the same
  updates (same bias-corrected Nesterov momentum, NS, scale and decay; only the ``"auto"`` NS
  backend may differ in rounding on GPU/TPU). Intended differences: optax routes by
  ``ndim == 2`` only (embeddings and the head go to Muon, other layouts need explicit dimension
  numbers) while this routes by role and recognises Flax attention and scan-stacked layouts;
  optax's AdamW branch uses Nesterov and one learning rate, while here the AdamW groups are plain
  ``optax.adamw`` with three learning rates, and norm gains and biases are never decayed.

  Learning-rate defaults: ``adam_learning_rate=None`` uses ``learning_rate`` when
  ``consistent_rms`` is set (the Moonlight scale matches AdamW's update RMS, so one rate serves
  both); with ``consistent_rms=None`` Muon rates (~0.02) are far too large for AdamW, so
  ``adam_learning_rate`` is then required. ``embedding_learning_rate`` and
  ``head_learning_rate`` default to ``adam_learning_rate``. Every rate may be an optax schedule,
  and every float hyperparameter may be injected with
  ``optax.inject_hyperparams(stablejax.outlier_safe_muon)(learning_rate=...)``: ``ns_steps``
  (a loop count) stays static at its default; an explicit ``ns_steps`` (or ``num_heads``) needs
  ``static_args=("ns_steps",)`` there (add ``"param_labels"`` / ``"weight_dimension_numbers"``
  when passing callables, which ``inject_hyperparams`` would take for schedules).

  Every argument after ``momentum`` is keyword-only.

  Args:
    learning_rate: Muon learning rate (float or schedule).
    momentum: Muon momentum (EMA decay).
    nesterov: Nesterov momentum for Muon.
    ns_steps: Newton-Schulz iterations (a Python int); None: 5.
    ns_coeffs: "standard", "polar_express", a triple or per-step triples.
    weight_decay: decoupled weight decay for Muon matrices (multiplied by the learning rate).
    consistent_rms: Moonlight RMS factor (0.2) or None for width scaling.
    adam_learning_rate: Adam rate for norm gains, biases, scalars (group "adam").
    embedding_learning_rate: AdamW rate for embeddings.
    head_learning_rate: AdamW rate for the output head.
    adam_b1, adam_b2, adam_eps: AdamW hyperparameters.
    adam_weight_decay: AdamW decoupled weight decay of the "embedding" and "head" groups (the
      "adam" group, norm gains, biases and scalars, is never decayed).
    outlier_threshold: z threshold for "zscore"; ``2 k`` for "iqr".
    outlier_method: "zscore", "iqr" or None (no clamping).
    ns_backend: "auto", "xla" or "pallas".
    param_labels: None (the default rule of :func:`stablejax.label_params`); a mapping
      ``{path pattern: group}`` applied on top of it (``{"params/Dense_3": "head"}``: fnmatch
      globs or path prefixes on ``/``-joined paths); a full label pytree (or a prefix of one);
      or a callable ``params -> labels``. Groups: "muon", "adam" (never decayed), "embedding",
      "head".
    weight_dimension_numbers: which axes of each Muon leaf form its matrix, exactly as
      ``optax.contrib.muon`` takes them: a tree (or a prefix of one) of
      ``optax.contrib.MuonDimensionNumbers``, or a callable ``params -> tree``. A None entry
      keeps the default layout (routing is ``param_labels``' job here, so unlike optax a None
      does not move the leaf to AdamW). :func:`stablejax.muon_dimension_numbers` returns the
      default tree and takes per-leaf overrides. Without it, Flax attention kernels are one
      ``[D, H*hd]`` / ``[H*hd, D]`` matrix, other leaves their last two axes, and a leaf of 3+
      axes that no rule recognises gets a warning at init naming it and this fix.
    strict_overrides: a ``param_labels`` pattern that matches no parameter is an error (by
      default it warns once at ``init``, so one mapping can serve several variants of a model).
    ns_method: "standard" or "gram" (Gram Newton-Schulz where it takes fewer FLOPs, see
      :func:`stablejax.newton_schulz`).
    ns_preconditioning: "frobenius" or "aol" (Turbo-Muon; use it with one step fewer).
    per_head: orthogonalise attention projections per head: query, key and value per head
      (grouped-query key and value per key head; a fused query/key/value kernel per head of each
      part), the output projection per head (:func:`stablejax.layout.heads.per_head_layouts`),
      in every layout the routing recognises; given ``weight_dimension_numbers`` win. With
      ``consistent_rms`` the update RMS is unchanged; with width scaling the output projection's
      per-head ``[hd, D]`` matrices get ``sqrt(D / hd)``.
    num_heads: the query head count, needed by ``per_head`` for attention layers of 2-D kernels
      without a query/key norm (a clear error at ``init`` names it when missing).
    normuon: NorMuon (arXiv 2510.05491): after orthogonalisation, each output neuron of each
      matrix divided by the root of an EMA of its mean square, the matrix's Frobenius norm kept
      (:mod:`stablejax.muon.normuon`; its :class:`~stablejax.muon.normuon.NorMuonState` sits in
      the Muon group's chain state).
    normuon_b2: that EMA's decay.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; its state is :class:`GroupUpdateRmsState`
    around an ``optax.partition`` state whose Muon branch holds :class:`OutlierSafeMuonState`.
    ``update`` needs ``params`` (weight decay).

  References:
    Jordan et al., `Muon: An optimizer for hidden layers in neural networks
    <https://kellerjordan.github.io/posts/muon/>`_ (2024) and modded-nanogpt; Liu et al.,
    `Muon is Scalable for LLM Training <https://arxiv.org/abs/2502.16982>`_ (arXiv 2502.16982),
    the ``0.2 * sqrt(max(fan_in, fan_out))`` scale and decoupled weight decay; Loshchilov and
    Hutter, `Decoupled Weight Decay Regularization <https://arxiv.org/abs/1711.05101>`_
    (arXiv 1711.05101), the AdamW groups.

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
  ns_steps = _validate_muon_args(momentum, ns_steps, outlier_threshold, outlier_method, ns_backend)
  _ns.resolve_iteration(ns_coeffs, ns_steps, ns_method, ns_preconditioning)  # validates early
  heads = routing.per_head_of(per_head, num_heads)
  if not isinstance(normuon, bool):
    raise ValueError(f"normuon must be True or False, got {normuon!r}")
  rate_sources = {"muon": "learning_rate", "adam": "adam_learning_rate",
                  "embedding": "embedding_learning_rate", "head": "head_learning_rate"}
  if adam_learning_rate is None:
    if consistent_rms is None:
      raise ValueError("adam_learning_rate is required when consistent_rms=None (Muon's width "
                       "scaling uses rates ~0.02, too large for AdamW); pass e.g. 3e-4")
    adam_learning_rate = learning_rate
    rate_sources["adam"] = "learning_rate"
  if embedding_learning_rate is None:
    embedding_learning_rate = adam_learning_rate
    rate_sources["embedding"] = rate_sources["adam"]
  if head_learning_rate is None:
    head_learning_rate = adam_learning_rate
    rate_sources["head"] = rate_sources["adam"]
  if isinstance(param_labels, dict) or not (param_labels is None or callable(param_labels)):
    bad = sorted({str(lab) for lab in jax.tree.leaves(param_labels) if lab not in routing.GROUPS})
    if bad:  # validates the label values early
      raise ValueError(f"param_labels contains unknown group(s) {bad}; use labels from "
                       f"{routing.GROUPS}")

  # The routing of a parameter tree is decided once, at its first init (where nnx.Optimizer
  # passes Variables that still carry their metadata), and reused for every tree with the same
  # paths and shapes: update's pure arrays and the Muon branch's masked view of them.
  plans: dict = {}
  warned: set = set()

  def plan(tree: Any) -> routing.RoutingPlan:
    key = routing.layout.structure_key(routing.param_leaves(tree)[0])
    found = plans.get(key)
    if found is None:
      found = routing.plan(tree, param_labels, weight_dimension_numbers, strict_overrides,
                           heads)
      plans[key] = found
      plans.setdefault(found.muon_only_key(), found)
    return found

  def labels_fn(tree: Any) -> Any:
    return plan(tree).label_tree()

  def muon_layouts(tree: Any) -> list:
    found = plans.get(routing.layout.structure_key(routing.param_leaves(tree)[0]))
    if found is None:  # a tree the router never saw: route it as it is
      return [d for d in routing.matrix_layouts(tree, weight_dimension_numbers, heads)
              if d is not None]
    return found.muon_layouts()

  muon_parts = [
      _muon_direction(momentum, nesterov, ns_steps, ns_coeffs, consistent_rms, outlier_threshold,
                      outlier_method, ns_backend, 1e-8, muon_layouts, ns_method,
                      ns_preconditioning),
  ]
  if normuon:
    muon_parts.append(_normuon.with_layouts(normuon_b2, 1e-8, muon_layouts))
  if not _is_zero(weight_decay):
    muon_parts.append(optax.add_decayed_weights(weight_decay))
  muon_parts.append(optax.scale_by_learning_rate(learning_rate))

  def adamw(lr: Any, weight_decay: Any) -> optax.GradientTransformation:
    return optax.adamw(lr, b1=adam_b1, b2=adam_b2, eps=adam_eps, weight_decay=weight_decay)

  # "adam" holds exactly norm gains, biases and scalars: never decayed, whatever their rank.
  transforms = {
      "muon": optax.chain(*muon_parts),
      "adam": optax.adam(adam_learning_rate, b1=adam_b1, b2=adam_b2, eps=adam_eps),
      "embedding": adamw(embedding_learning_rate, adam_weight_decay),
      "head": adamw(head_learning_rate, adam_weight_decay),
  }
  partition = optax.partition({g: skip_nonfinite_tensors(t) for g, t in transforms.items()},
                              labels_fn)
  info = routing.RoutingInfo(
      param_labels=param_labels, weight_dimension_numbers=weight_dimension_numbers,
      learning_rates={"muon": learning_rate, "adam": adam_learning_rate,
                      "embedding": embedding_learning_rate, "head": head_learning_rate},
      rate_sources=rate_sources, per_head=heads)

  def init_fn(params: Any) -> GroupUpdateRmsState:
    found = plan(params)
    if id(found) not in warned and not routing.capturing():  # once; describe_routing repeats them
      warned.add(id(found))
      routing.warn_notes(found.notes, "outlier_safe_muon")
    routing.record_init(info, params)
    zero = jnp.zeros((), jnp.float32)
    return GroupUpdateRmsState(partition.init(params), zero, zero, zero, zero)

  def update_fn(updates: Any, state: GroupUpdateRmsState, params: Any = None,
                **extra_args: Any) -> tuple[Any, GroupUpdateRmsState]:
    if params is not None:
      _check_same_parameters(updates, params)
    new_updates, inner_state = partition.update(updates, state.inner_state, params, **extra_args)
    labels = plan(new_updates).unmasked_labels()
    rms = _group_rms(new_updates, labels)
    guards = [s for s in jax.tree.leaves(inner_state, is_leaf=lambda x: isinstance(
        x, TensorGuardState)) if isinstance(s, TensorGuardState)]
    skipped = sum((s.skipped for s in guards), jnp.zeros((), jnp.int32))

    def count_skips(node: Any) -> Any:  # every group's skipped tensors, with the Muon counters
      if not isinstance(node, OutlierSafeMuonState):
        return node
      return node._replace(nonfinite_count=_saturating_add(node.nonfinite_count, skipped),
                           nonfinite_rate=skipped.astype(jnp.float32) / max(1, len(labels)))

    inner_state = jax.tree.map(count_skips, inner_state,
                               is_leaf=lambda x: isinstance(x, OutlierSafeMuonState))
    return new_updates, GroupUpdateRmsState(inner_state, **rms)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)  # type: ignore[arg-type]


def _muon_metrics(s: OutlierSafeMuonState) -> dict:
  return {
      "outlier_rate": s.outlier_rate,
      "ns_instability_rate": s.ns_instability_rate,
      "fallback_rate": s.fallback_rate,
      "outlier_count": s.outlier_count,
      "fallback_count": s.fallback_count,
      "nonfinite_count": s.nonfinite_count,
      "nonfinite_rate": s.nonfinite_rate,
  }


def _group_rms_metrics(s: GroupUpdateRmsState) -> dict:
  return {g: getattr(s, g) for g in routing.GROUPS}


register_state_metrics(
    OutlierSafeMuonState, "muon", _muon_metrics,
    rates=(Rate("muon_outlier_rate", flag="outlier_rate", label="Muon outlier rate", budget=0.05,
                advice="Muon outlier rate {value:.3g} > 0.05: lower the Muon learning rate or "
                       "check the data for pathological batches"),
           Rate("muon_ns_instability_rate", flag="ns_instability_rate",
                label="NS instability rate", budget=0.05,
                advice="Newton-Schulz instability rate {value:.3g} > 0.05: use fewer NS steps "
                       "(e.g. 5 -> 3) or run NS in float32"),
           Rate("muon_fallback_rate", flag="fallback_rate", counter="fallback_count",
                label="Muon fallbacks / step", budget=0.01, tensors=True,
                advice="Muon emergency fallbacks {value:.3g} per step > 0.01: lower the Muon "
                       "learning rate")))
register_state_metrics(GroupUpdateRmsState, "muon/update_rms", _group_rms_metrics,
                       series=(Series("*", "*", "update_rms"),))
