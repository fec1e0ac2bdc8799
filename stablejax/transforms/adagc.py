"""AdaGC: adaptive per-tensor gradient clipping against an EMA of clipped norms.

Wang et al., "AdaGC: Improving Training Stability for Large Language Model
Pretraining", arXiv:2502.11034.

For each parameter tensor ``i`` (each leaf of the gradient pytree, or each
layer slice of a scan-stacked leaf, see below):

* during the first ``warmup_steps`` steps the gradients are clipped globally,
  ``h = min(1, lambda_abs / ||g||)``, and ``gamma_i = min(gamma_i, ||g_hat_i||)``
  (``gamma_i`` starts at ``+inf``);
* afterwards ``h_i = min(1, lambda_rel * gamma_i / ||g_i||)``,
  ``g_hat_i = h_i * g_i`` and ``gamma_i = beta * gamma_i + (1 - beta) * ||g_hat_i||``.

One departure from the paper: a zero norm never initialises ``gamma``. A
tensor can have an exactly zero gradient during warmup (the layers before a
zero-initialised output projection on the first step, frozen parameters, MoE
experts that got no tokens); the paper's ``min(gamma, 0) = 0`` would then give
``h = 0`` after warmup and freeze that tensor for good. So the warmup minimum
skips zero norms, and a ``gamma`` still at ``+inf`` after warmup starts at the
tensor's first non-zero norm. With no exactly-zero gradients during warmup the
result equals the paper's.

Per layer: the paper's tensors are the layers' weight matrices. A model whose
blocks run under ``nn.scan`` keeps each block parameter as one ``[L, ...]``
leaf; such a leaf (recognised by its path, see
:mod:`stablejax.transforms.stacked`) gets ``L`` thresholds, one per layer
slice. ``stacked_names=()`` gives every leaf a single threshold instead.

Norms and ``gamma`` are float32; clipped gradients keep their dtype. A step
whose global gradient norm is not finite leaves ``gamma`` and the step count
untouched (the statistics never absorb NaN/Inf, even without
:func:`stablejax.skip_nonfinite`); the updates of such a step are not repaired.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import optax
import optax.tree

from stablejax.transforms import _common
from stablejax.transforms import defence
from stablejax.transforms.metrics import Rate, register_state_metrics
from stablejax.transforms.stacked import STACKED_NAMES
from stablejax.transforms.stacked import is_stacked


class AdaGCState(NamedTuple):
  """State of :func:`adagc`.

  Attributes:
    count: number of steps with a finite global norm seen so far (int32).
    gamma: pytree like the parameters holding, per leaf, the EMA of the
      clipped gradient norm in float32: a scalar, or a ``[L]`` vector (one per
      layer) for a scan-stacked leaf; ``+inf`` until initialised.
    clipped_fraction: fraction of tensors (layer slices of stacked leaves
      counted one by one) scaled down at the last step.
    grad_norm: global gradient norm before AdaGC, last step.
    clipped_grad_norm: global gradient norm after AdaGC, last step.

  Example:
    After the warmup every tensor has its own threshold ``gamma`` (an EMA of its clipped norms):

    >>> import jax.numpy as jnp, stablejax
    >>> tx = stablejax.adagc(warmup_steps=2)
    >>> grads = {"a": jnp.array([3.0, 4.0]), "b": jnp.array([0.0, 0.0, 1.0])}
    >>> state = tx.init(grads)
    >>> for _ in range(3):
    ...   _, state = tx.update(grads, state)
    >>> int(state.count), sorted(state.gamma)
    (3, ['a', 'b'])
    >>> round(float(state.gamma["a"]), 3), round(float(state.gamma["b"]), 3)
    (0.982, 0.196)
  """

  count: jax.Array  # type: ignore[assignment]  # shadows tuple.count, as in optax's states
  gamma: Any
  clipped_fraction: jax.Array
  grad_norm: jax.Array
  clipped_grad_norm: jax.Array


def _validate(beta: Any, lambda_rel: Any, lambda_abs: Any, warmup_steps: Any) -> None:
  _common.check("beta", beta, lambda v: 0.0 <= v < 1.0,
                "use an EMA factor in [0, 1), e.g. 0.98")
  _common.check("lambda_rel", lambda_rel, lambda v: v > 0,
                "use a positive relative threshold, e.g. 1.05")
  _common.check("lambda_abs", lambda_abs, lambda v: v > 0,
                "use a positive absolute (warmup) threshold, e.g. 1.0")
  _common.check("warmup_steps", warmup_steps,
                lambda v: v >= 1 and float(v).is_integer(),
                "use an integer >= 1 (gamma is initialised during warmup)")


def _layer_norms_f32(x: jax.Array) -> jax.Array:
  """``[L]`` float32 L2 norms of the layer slices ``x[0], x[1], ...`` of a stacked leaf."""
  x32 = jnp.asarray(x, _common.STAT_DTYPE)
  return jnp.sqrt(jnp.sum(jnp.square(x32.reshape(x32.shape[0], -1)), axis=1))


def _per_layer(h: jax.Array, x: jax.Array) -> jax.Array:
  """A scalar or ``[L]`` scale shaped to broadcast against the leaf ``x``."""
  return h.reshape(h.shape + (1,) * (jnp.ndim(x) - h.ndim)) if h.ndim else h


def adagc(
    beta: float = 0.98,
    lambda_rel: float = 1.05,
    lambda_abs: float = 1.0,
    *,
    warmup_steps: int = 100,
    stacked_names: Sequence[str] = STACKED_NAMES,
) -> optax.GradientTransformation:
  """AdaGC adaptive per-tensor gradient clipping.

  Each parameter tensor gets its own threshold ``lambda_rel * gamma_i``, where
  ``gamma_i`` is an EMA of that tensor's past *clipped* gradient norms; during
  warmup the gradients are clipped globally to ``lambda_abs`` and ``gamma_i``
  is initialised to the smallest non-zero clipped norm seen (a zero norm is no
  measurement: taking it would freeze the tensor after warmup). A
  scan-stacked ``[L, ...]`` leaf gets one threshold per layer.

  Args:
    beta: EMA factor of ``gamma``.
    lambda_rel: relative threshold: a tensor is clipped to ``lambda_rel``
      times its ``gamma``.
    lambda_abs: global-norm clip used during warmup.
    warmup_steps: number of (finite) steps of global clipping.
    stacked_names: path components that mark a scan-stacked leaf, whose
      leading axis is the layer (default ``("layers", "blocks", "scan",
      "h")``; not when followed by an integer component, which is an unrolled
      list). ``()`` gives every leaf one threshold, whatever its path.

  Returns:
    An :class:`optax.GradientTransformation` whose state is an
    :class:`AdaGCState`.

  References:
    Wang et al., `AdaGC: Improving Training Stability for Large Language Model
    Pretraining <https://arxiv.org/abs/2502.11034>`_, 2025 (arXiv:2502.11034).

  Example:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import stablejax
    >>> tx = optax.chain(stablejax.adagc(warmup_steps=10), optax.sgd(0.1))
    >>> params = {"w": jnp.ones(4), "b": jnp.zeros(2)}
    >>> state = tx.init(params)
    >>> grads = {"w": jnp.full(4, 3.0), "b": jnp.ones(2)}
    >>> updates, state = tx.update(grads, state, params)
    >>> round(float(state[0].clipped_grad_norm), 4)
    1.0
  """
  _validate(beta, lambda_rel, lambda_abs, warmup_steps)
  if isinstance(stacked_names, str):
    stacked_names = (stacked_names,)
  stacked_names = tuple(stacked_names)

  def init_gamma(path: jax.tree_util.KeyPath, leaf: jax.Array) -> jax.Array:
    shape = leaf.shape[:1] if is_stacked(path, leaf, stacked_names) else ()
    return jnp.full(shape, jnp.inf, _common.STAT_DTYPE)

  def init_fn(params: optax.Params) -> AdaGCState:
    return AdaGCState(
        count=jnp.zeros([], jnp.int32),
        gamma=jax.tree_util.tree_map_with_path(init_gamma, params),
        clipped_fraction=jnp.zeros([], _common.STAT_DTYPE),
        grad_norm=jnp.zeros([], _common.STAT_DTYPE),
        clipped_grad_norm=jnp.zeros([], _common.STAT_DTYPE),
    )

  def update_fn(updates: optax.Updates, state: AdaGCState, params: Optional[optax.Params] = None
                ) -> tuple[optax.Updates, AdaGCState]:
    del params
    b = _common.f32(beta)
    l_rel = _common.f32(lambda_rel)
    l_abs = _common.f32(lambda_abs)

    leaves, treedef = jax.tree.flatten(updates)
    # jaxlib ships no type stub for PyTreeDef, so its methods are unknown to the checker.
    gammas = treedef.flatten_up_to(state.gamma)  # type: ignore[attr-defined]
    # A [L] gamma marks a stacked leaf: one norm per layer slice.
    norms = [_layer_norms_f32(u) if gamma.ndim else _common.leaf_norm_f32(u)
             for u, gamma in zip(leaves, gammas)]
    g = optax.tree.norm(norms).astype(_common.STAT_DTYPE)
    finite = jnp.isfinite(g)
    in_warmup = state.count < jnp.asarray(warmup_steps, jnp.int32)
    h_global = jnp.minimum(1.0, l_abs / g)

    new_leaves, new_gammas, scales = [], [], []
    for u, n, gamma in zip(leaves, norms, gammas):
      # A zero-norm tensor is left alone (avoids 0/0 when gamma is 0 too).
      h_local = jnp.where(n > 0, jnp.minimum(1.0, l_rel * gamma / n), 1.0)
      h = jnp.where(in_warmup, h_global, h_local)
      clipped_norm = h * n
      # Zero norms are no measurement: they never initialise gamma (see the module docstring).
      measured = n > 0
      warmup_gamma = jnp.where(measured, jnp.minimum(gamma, clipped_norm), gamma)
      ema_gamma = jnp.where(jnp.isinf(gamma),
                            jnp.where(measured, clipped_norm, gamma),
                            b * gamma + (1.0 - b) * clipped_norm)
      gamma_new = jnp.where(in_warmup, warmup_gamma, ema_gamma)
      new_gammas.append(jnp.where(finite, gamma_new, gamma))
      new_leaves.append(_common.scale_leaf(u, _per_layer(h, u)))
      scales.append(jnp.broadcast_to(h, n.shape).reshape(-1))

    if scales:
      h_all = jnp.concatenate(scales)
      clipped_fraction = jnp.mean((h_all < 1.0).astype(_common.STAT_DTYPE))
    else:
      clipped_fraction = jnp.zeros([], _common.STAT_DTYPE)
    clipped_g = optax.tree.norm(
        [h * n for h, n in zip(scales, [n.reshape(-1) for n in norms])]
    ).astype(_common.STAT_DTYPE)
    new_state = AdaGCState(
        count=jnp.where(finite, _common.safe_increment(state.count),
                        state.count),
        gamma=jax.tree.unflatten(treedef, new_gammas),
        clipped_fraction=clipped_fraction,
        grad_norm=g,
        clipped_grad_norm=clipped_g,
    )
    return jax.tree.unflatten(treedef, new_leaves), new_state

  # update_fn takes its own state type where optax's protocol says any OptState.
  return optax.GradientTransformation(init_fn, update_fn)  # type: ignore[arg-type]


def _adagc_metrics(s: AdaGCState) -> dict[str, jax.Array]:
  return {name: getattr(s, name) for name in ("clipped_fraction", "grad_norm", "clipped_grad_norm")}


# The clipped fraction is reported, not scored: AdaGC clips some tensors on most steps by design.
register_state_metrics(
    AdaGCState, "adagc", _adagc_metrics,
    rates=(Rate("adagc_clip_rate", flag="clipped_fraction", label="AdaGC clipped tensors"),),
    grad_norm="grad_norm", acted="clipped_fraction", order=20)


# ----------------------------------------------------------------------------- the declaration


@dataclasses.dataclass
class AdaGCConfig:
  """``stability.adagc``: AdaGC on the gradient, after ZClip (arguments of :func:`adagc`).

  Off by default: on clean runs AdaGC (lambda_rel 1.05) acts as a learning-rate cut and cost final
  loss in every ``bench/stress.py`` cell, with no gain at high learning rates (README).
  ``per_layer``: one threshold per layer of scan-stacked ``[L, ...]`` leaves.
  """

  enabled: bool = False
  beta: float = 0.98
  lambda_rel: float = 1.05
  lambda_abs: float = 1.0
  warmup_steps: int = 100
  per_layer: bool = True

  def validate(self, where: str, ctx: defence.DefenceContext) -> None:
    if not 0 < self.beta < 1:
      raise ValueError(f"{where}.beta={self.beta} must lie in (0, 1) (AdaGC's EMA factor)")
    defence.check_positive(f"{where}.lambda_rel", self.lambda_rel)
    defence.check_positive(f"{where}.lambda_abs", self.lambda_abs)
    defence.check_positive(f"{where}.warmup_steps", self.warmup_steps, allow_zero=True)


def _unstacked(c: AdaGCConfig, ctx: defence.DefenceContext) -> list[tuple[str, str]]:
  if ctx.model is None or ctx.model.stacked_layers:
    return []
  return [("stability.adagc.per_layer", "model.scan_layers=false (no stacked layers)")]


ADAGC = defence.Defence(
    name="adagc", config=AdaGCConfig, position=defence.Position.GRADIENT, order=30,
    build=lambda c, ctx: adagc(beta=c.beta, lambda_rel=c.lambda_rel, lambda_abs=c.lambda_abs,
                               warmup_steps=c.warmup_steps,
                               stacked_names=STACKED_NAMES if c.per_layer else ()),
    ineffective=_unstacked, label="AdaGC (adaptive per-tensor gradient clipping)")
