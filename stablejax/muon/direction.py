"""The Muon direction of one matrix group: momentum, outlier clamp, Newton-Schulz, health check.

:func:`scale_by_outlier_safe_muon` turns gradients of hidden weight matrices into Muon's
direction (Jordan et al.): Nesterov momentum as in ``optax.contrib.scale_by_muon``, the outlier
clamp of the Newton-Schulz input (:mod:`stablejax.muon.outliers`), Newton-Schulz
(:mod:`stablejax.muon.newton_schulz`), a health check of its output with an emergency fallback
(:func:`ns_health`), and the shape scale (:func:`shape_scale`, Moonlight's
``0.2 * sqrt(max(fan_in, fan_out))``). Learning rate and weight decay are applied by
:func:`stablejax.outlier_safe_muon`, which chains it.

What NS can produce, and so what the health check accepts: five standard steps map each
normalised singular value ``s = sigma / ||M||_F`` to [0.68, 1.13] when ``s >= 0.0052``, to at
most 1.21 for any ``s`` in (0, 1], and to about ``480 s`` (less than 0.68) when ``s < 0.0015``
(numbers from iterating the polynomial, checked in the tests). Since the largest ``s`` is at
least ``1 / sqrt(rank)``, ``||O||_F`` is at least ``0.1 * ||M||_F / (||M||_F + eps)`` for any
matrix of rank up to about 20 million, and at most ``1.21 sqrt(rank) < 2 sqrt(rank)``; the
check uses those bounds, so a near-zero momentum (``||M||_F ~ 1e-12``, below the ``eps = 1e-8``
of the normalisation) gives the small update NS computes for it, as in optax, and is not
counted as an instability.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from stablejax.layout.analysis import param_leaves, path_to_str
from stablejax.muon import newton_schulz as _ns
from stablejax.muon import routing
from stablejax.muon import sharding as _sharding
from stablejax.muon.matrices import Dims
from stablejax.muon.matrices import split_fused as _split_fused
from stablejax.muon.matrices import to_matrices as _to_matrices
from stablejax.muon.outliers import OUTLIER_METHODS
from stablejax.muon.outliers import clamp_matrices as _clamp
from stablejax.transforms._common import saturating_add as _saturating_add

# NS health bounds on ||O||_F (see the module docstring): at least 0.1 x the Frobenius norm of
# the normalised input ||M|| / (||M|| + eps), at most 2 sqrt(rank) (each output singular value is
# <= 1.21 for the standard coefficients).
_HEALTH_MIN_FRO = 0.1
_HEALTH_MAX_FRO_PER_SQRT_RANK = 2.0
DEFAULT_NS_STEPS = 5


class OutlierSafeMuonState(NamedTuple):
  """State of the Muon branch of :func:`stablejax.outlier_safe_muon` (arrays only).

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
      :func:`stablejax.outlier_safe_muon`, which sets it) skipped because their gradient, new
      state or update was not finite.
    nonfinite_rate: float32 fraction of all tensors skipped that way this step.

  A scan-stacked ``[L, in, out]`` parameter counts as ``L`` matrices.

  Example:
    >>> import jax, jax.numpy as jnp, optax, stablejax
    >>> params = {"w": jnp.full((8, 16), 0.1), "b": jnp.zeros((16,))}
    >>> tx = stablejax.outlier_safe_muon(learning_rate=0.02, adam_learning_rate=1e-3)
    >>> grad_w = jax.random.normal(jax.random.key(0), (8, 16)).at[0, 0].set(1000.0)
    >>> _, state = jax.jit(tx.update)({"w": grad_w, "b": jnp.ones((16,))}, tx.init(params),
    ...                               params)
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



def _total(vectors: list[jax.Array]) -> jax.Array:
  """Sum of the per-matrix numbers of every leaf, as one reduction (see ``sum_of_scalars``)."""
  if not vectors:
    return jnp.zeros((), jnp.float32)
  joined = jnp.concatenate(vectors)
  return jnp.sum(joined) if joined.shape[0] == 1 else jnp.sum(jnp.sort(joined))


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


def shape_scale(fan_in: int, fan_out: int, consistent_rms: Optional[float | jax.Array]
                ) -> float | jax.Array:
  """Muon update scale for a ``[fan_in, fan_out]`` matrix.

  ``consistent_rms * sqrt(max(fan_in, fan_out))`` (Moonlight, arXiv 2502.16982) or, when
  ``consistent_rms`` is None, ``sqrt(max(1, fan_out / fan_in))`` (Jordan's width scaling).
  ``consistent_rms`` may be a traced array (``optax.inject_hyperparams``).
  """
  if consistent_rms is None:
    return math.sqrt(max(1.0, fan_out / fan_in))
  return consistent_rms * math.sqrt(max(fan_in, fan_out))



def _static_int(value: object, name: str) -> int:
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
                               ns_coeffs: _ns.CoeffsSpec = "standard",
                               consistent_rms: Optional[float] = 0.2,
                               outlier_threshold: float = 5.0,
                               outlier_method: Optional[str] = "zscore",
                               ns_backend: str = "auto", eps: float = 1e-8,
                               weight_dimension_numbers: routing.DimensionNumbersOrFn = None
                               ) -> optax.GradientTransformation:
  """The Muon direction for matrices: momentum, outlier clamp, NS, health check, shape scale.

  Every leaf must have ``ndim >= 2``. Its matrix is given by ``weight_dimension_numbers`` (as
  ``optax.contrib.scale_by_muon`` takes it: a tree, or a callable of the updates, of
  ``optax.contrib.MuonDimensionNumbers``; a None entry, or no argument, means the default
  layout: Flax attention kernels as one matrix, otherwise the last two axes
  ``[..., fan_in, fan_out]`` with leading batch axes). Learning rate and weight decay are applied
  by :func:`stablejax.outlier_safe_muon`.

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
    >>> from stablejax.muon.direction import scale_by_outlier_safe_muon
    >>> tx = optax.chain(scale_by_outlier_safe_muon(), optax.scale(-1e-3))
    >>> state = tx.init({"w": jnp.ones((8, 16))})
  """
  def layouts_of(tree: optax.Params) -> list[Dims]:
    return [d for d in routing.matrix_layouts(tree, weight_dimension_numbers) if d is not None]

  return muon_direction(momentum, nesterov, ns_steps, ns_coeffs, consistent_rms,
                         outlier_threshold, outlier_method, ns_backend, eps, layouts_of)


def muon_direction(momentum: float | jax.Array, nesterov: bool, ns_steps: Optional[int],
                   ns_coeffs: _ns.CoeffsSpec, consistent_rms: Optional[float | jax.Array],
                   outlier_threshold: float | jax.Array, outlier_method: Optional[str],
                   ns_backend: str, eps: float, layouts: Callable[[optax.Params], list[Dims]],
                   ns_method: str = "standard", ns_preconditioning: str = "frobenius"
                   ) -> optax.GradientTransformation:
  """:func:`scale_by_outlier_safe_muon` with the layouts given as ``tree -> [dims per leaf]``."""
  ns_steps = validate_muon_args(momentum, ns_steps, outlier_threshold, outlier_method, ns_backend)
  _ns.resolve_iteration(ns_coeffs, ns_steps, ns_method, ns_preconditioning)  # validates early

  def init_fn(params: optax.Params) -> OutlierSafeMuonState:
    _check_matrices(params)
    layouts(params)  # validates the dimension numbers
    return _zero_state(params)

  def orthogonalise(x: jax.Array) -> tuple[jax.Array, ...]:
    """Clamp, NS, health check and scale of a stack ``[n, fan_in, fan_out]`` of matrices."""
    x, n_out = _clamp(x, outlier_method, outlier_threshold)
    norm = _ns.frobenius_norm(x)  # shared by NS's normalisation and the health check
    o = _ns.newton_schulz_given_norm(x, norm, ns_steps, ns_coeffs, eps, ns_backend, ns_method,
                                     ns_preconditioning)
    healthy, mom_finite, norm = ns_health(o, x, eps, norm)
    o = jnp.where(healthy[..., None, None], o, _fallback(x, mom_finite, norm, eps, o.dtype))
    o = o * shape_scale(o.shape[-2], o.shape[-1], consistent_rms)
    return o, n_out, ~healthy & mom_finite, ~healthy  # per matrix

  def update_fn(updates: optax.Updates, state: OutlierSafeMuonState,
                params: Optional[optax.Params] = None
                ) -> tuple[optax.Updates, OutlierSafeMuonState]:
    del params
    count_inc = jnp.asarray(optax.safe_increment(state.count))
    g_leaves, m_leaves, treedef = _leaves_with_momentum(updates, state.mu)
    corrections = _bias_corrections(momentum, count_inc)
    new_mu, new_leaves, per_matrix = [], [], []
    n_entries = n_mats = 0
    for g, m, d in zip(g_leaves, m_leaves, layouts(updates)):
      m, m_hat = _momentum_input(g, m, momentum, nesterov, corrections)
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
    new_state = _counted(state, count_inc, treedef.unflatten(new_mu), per_matrix, n_entries,
                         n_mats)
    return treedef.unflatten(new_leaves), new_state

  return optax.GradientTransformation(init_fn, update_fn)  # type: ignore[arg-type]


def _check_matrices(params: optax.Params) -> None:
  for leaf in param_leaves(params)[0]:
    if not leaf.masked and len(leaf.shape) < 2:
      raise ValueError(f"Muon needs matrices but {leaf.path} has shape {leaf.shape}; label it "
                       "'adam' in param_labels")


def _zero_state(params: optax.Params) -> OutlierSafeMuonState:
  zero_f = jnp.zeros((), jnp.float32)
  zero_i = jnp.zeros((), jnp.int32)
  return OutlierSafeMuonState(
      count=zero_i, mu=optax.tree.zeros_like(params), outlier_count=zero_i,
      instability_count=zero_i, fallback_count=zero_i, outlier_rate=zero_f,
      ns_instability_rate=zero_f, fallback_rate=zero_f, nonfinite_count=zero_i,
      nonfinite_rate=zero_f)


def _leaves_with_momentum(updates: optax.Updates, mu: optax.Updates
                          ) -> tuple[list[jax.Array], list[jax.Array], Any]:
  """The leaves of ``updates``, their momentum buffers, and the treedef; a clear error when the
  update's parameters are not the ones the state was initialised with."""
  treedef: Any  # jaxlib ships no type stub for PyTreeDef: its methods are unknown to mypy
  g_leaves, treedef = jax.tree.flatten(updates)
  try:
    m_leaves = treedef.flatten_up_to(mu)
  except (ValueError, TypeError) as e:
    raise ValueError(
        "outlier_safe_muon: the Muon parameters of this update differ from the ones its state "
        "was initialised with; pass update() the same parameter tree (same paths and shapes) "
        f"as init() ({e})") from None
  for path_g, m in zip(jax.tree_util.tree_flatten_with_path(updates)[0], m_leaves):
    if jnp.shape(path_g[1]) != jnp.shape(m):
      raise ValueError(f"outlier_safe_muon: {path_to_str(path_g[0])} has shape "
                       f"{jnp.shape(path_g[1])} in the update but {jnp.shape(m)} in the state")
  return g_leaves, m_leaves, treedef


Corrections = Callable[[Any], tuple[jax.Array, jax.Array, jax.Array]]


def _bias_corrections(momentum: float | jax.Array, count_inc: jax.Array) -> Corrections:
  """``dtype -> (beta, 1 - beta^(t+1), 1 - beta^t)``, computed once per dtype per update
  (the same scalars serve every leaf: traced once, not once per leaf)."""
  per_dtype: dict = {}  # lives for one update

  def corrections(dtype: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
    if dtype not in per_dtype:
      beta = jnp.asarray(momentum, dtype)
      corr_next = 1 - beta ** (count_inc + 1).astype(dtype)
      corr_now = 1 - beta ** count_inc.astype(dtype)
      per_dtype[dtype] = (beta, corr_next, corr_now)
    return per_dtype[dtype]
  return corrections


def _momentum_input(g: jax.Array, m: jax.Array, momentum: float | jax.Array, nesterov: bool,
                    corrections: Corrections) -> tuple[jax.Array, jax.Array]:
  """The new momentum, and the (Nesterov) bias-corrected input of NS, as optax's scale_by_muon."""
  m = (momentum * m + (1 - momentum) * g).astype(m.dtype)
  beta, corr_next, corr_now = corrections(m.dtype)
  if nesterov:
    m_hat = beta * (m / corr_next) + (1 - beta) * (g / corr_now)
  else:
    m_hat = m / corr_now
  return m, m_hat


def _fallback(x: jax.Array, mom_finite: jax.Array, norm: jax.Array, eps: float,
              dtype: Any) -> jax.Array:
  """The emergency fallback: the Frobenius-normalised momentum, zero where it is not finite."""
  xf = x.astype(jnp.float32)
  return jnp.where(mom_finite[..., None, None], xf / (norm[..., None, None] + eps),
                   0.0).astype(dtype)


def _counted(state: OutlierSafeMuonState, count_inc: jax.Array, mu: optax.Updates,
             per_matrix: list[list[jax.Array]], n_entries: int, n_mats: int
             ) -> OutlierSafeMuonState:
  """The new state: the step's clamped entries, unstable and fallen-back matrices added."""
  # Counts over every matrix, each one reduction (see stablejax.transforms._common).
  n_out, n_unstable, n_fallback = (_total([c[k] for c in per_matrix]).astype(jnp.int32)
                                   for k in range(3))
  n_entries, n_mats = max(1, n_entries), max(1, n_mats)
  return OutlierSafeMuonState(
      count=count_inc,
      mu=mu,
      outlier_count=_saturating_add(state.outlier_count, n_out),
      instability_count=_saturating_add(state.instability_count, n_unstable),
      fallback_count=_saturating_add(state.fallback_count, n_fallback),
      outlier_rate=n_out.astype(jnp.float32) / n_entries,
      ns_instability_rate=n_unstable.astype(jnp.float32) / n_mats,
      fallback_rate=n_fallback.astype(jnp.float32) / n_mats,
      nonfinite_count=state.nonfinite_count,
      nonfinite_rate=state.nonfinite_rate,
  )


def validate_muon_args(momentum: float | jax.Array, ns_steps: Optional[int],
                       outlier_threshold: float | jax.Array, outlier_method: Optional[str],
                       ns_backend: str) -> int:
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
