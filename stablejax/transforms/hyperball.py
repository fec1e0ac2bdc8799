"""Hyperball optimisation: every projection matrix kept at its initial norm, moved by a
normalised step (AdamH, MuonH).

Wen, Dang, Lyu, Ma and Liang ("Fantastic Pretraining Optimizers and Where to Find Them 2.1:
Hyperball Optimization", Dec 2025) replace weight decay on the matrices of a Transformer by a
constraint: each matrix ``W`` stays on the sphere of its initial Frobenius norm, and each step
moves it by a fixed fraction of that norm in the direction of the optimizer's update ``u``::

    W <- Norm(W - lr * Norm(u) * ||W0||) * ||W0||,   Norm(x) = x / ||x||_F

with ``u`` the AdamW or Muon update (AdamH, MuonH); embeddings, the output head and vectors keep
their AdamW steps. Weight decay only steers ``||W||`` indirectly (its equilibrium norm sets the
step's size relative to the weight, ``~sqrt(lr * wd)``), and a growing weight norm is what lets
attention and output logits grow; here the norm is fixed and the step's size relative to the
weight is the learning rate itself. Levanter ships it (``optim/adamh.py``, ``optim/muonh.py``).

**The transform.** :func:`hyperball` needs ``params``; it keeps ``||W0||`` of each matrix in its
state (one number per matrix, not a copy), computes the new matrix and returns
``W_new - W``, so ``optax.apply_updates`` lands on the Hyperball ``W_new``. Which leaves are
matrices, and which of their axes form the matrix, comes from ``matrices=``: the Muon routing's
:func:`stablejax.muon_dimension_numbers` (hidden matrices only; a scan-stacked ``[L, in, out]``
leaf is ``L`` matrices, each kept at its own norm; a fused query/key/value kernel is one matrix
per projection), or a pytree of ``optax.contrib.MuonDimensionNumbers`` of your own (None: not a
matrix). Other leaves pass through untouched. A matrix initialised to zero has norm 0 and stays
zero: leave it out.

**The learning rate.** An update coming out of an optax optimizer already carries its learning
rate (``optax.adamw(lr)`` returns ``-lr * direction``), and ``Norm(u)`` removes it, so the
Hyperball step takes its rate separately: ``learning_rate`` (a number or an optax schedule of
this transform's update count) or ``learning_rates`` (one per parameter). As in Levanter's
AdamH/MuonH, where the configured learning rate is the Hyperball step of the matrices and the
AdamW groups have their own, pass the same schedule the optimizer has: the step's size relative
to ``||W0||`` is then that rate. When a multiplier comes after the optimizer (the trainer's
learning-rate scale, which its recovery backs off), normalise before the multiplier and step
after it, ``prenormalized=True``::

    optax.chain(optimizer, normalize_matrix_updates(matrices), scale_s,
                hyperball(schedule, matrices=matrices, prenormalized=True))

The step is then ``s * lr``, as a multiplied rate should be. The trainer does this
(``stability.hyperball``: the normalisation just before its learning-rate scale, the step at
``Position.FINAL`` with its optimizer's rate of each matrix, before QK-clip and the compensated
bf16 update).

**Arithmetic.** Per matrix one reduction of three sums, ``<W, W>``, ``<W, u>``, ``<u, u>``, in
float32 (a sharded matrix: partial sums and one all-reduce, no gather), then
``||W + c u||^2 = <W,W> + 2c <W,u> + c^2 <u,u>`` gives the new norm without a second pass. The
new matrix is scaled to ``||W0||`` exactly from the weights it is given, so rounding never
accumulates: the norm stays within float32 rounding of ``||W0||`` for any number of steps (with
bfloat16 parameters, within their rounding, the compensated update keeping what rounding drops).
A zero update leaves the matrix where it is; a non-finite one gives a non-finite update, which
:func:`stablejax.skip_nonfinite` drops, keeping this state (its count too) as it was.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import optax

from stablejax.layout.orientation import FusedDimensionNumbers
from stablejax.transforms import _common
from stablejax.transforms import defence
from stablejax.transforms.metrics import register_state_metrics

MatricesArg = Union[Any, Callable[[Any], Any]]
"""Which leaves are matrices: a pytree with the structure of the parameters holding an
``optax.contrib.MuonDimensionNumbers`` (or :class:`stablejax.FusedDimensionNumbers`) per matrix
and None elsewhere, or a function ``params -> such a pytree``
(:func:`stablejax.muon_dimension_numbers`)."""

_DIMS = (optax.contrib.MuonDimensionNumbers, FusedDimensionNumbers)


class HyperballState(NamedTuple):
  """State of :func:`hyperball`.

  Attributes:
    count: updates applied (int32): the count ``learning_rate`` schedules are evaluated at.
    norms: pytree like the parameters: each matrix leaf's initial Frobenius norms (float32, one
      per matrix: the leaf's shape with its matrix axes reduced to 1, the parts of a fused axis
      kept), a scalar zero for every other leaf.
    norm_drift: the largest ``| ||W|| / ||W0|| - 1 |`` over the matrices as the last step found
      them (float32): 0 up to rounding while nothing else changes the matrices.

  Example:
    >>> import jax.numpy as jnp, optax, stablejax
    >>> from optax.contrib import MuonDimensionNumbers
    >>> params = {"w": jnp.full((2, 2), 2.0), "b": jnp.zeros(2)}
    >>> tx = stablejax.hyperball(0.1, matrices={"w": MuonDimensionNumbers(), "b": None})
    >>> state = tx.init(params)
    >>> float(state.norms["w"][0, 0]), state.norms["b"].shape  # ||W0||_F = sqrt(4 * 4)
    (4.0, ())
  """

  count: jax.Array  # type: ignore[assignment]  # shadows tuple.count, as in optax's states
  norms: Any
  norm_drift: jax.Array


@dataclasses.dataclass(frozen=True)
class _Layout:
  """A matrix leaf's axes: ``axes`` (sorted, non-negative) form each matrix; ``fused`` (one of
  them, or None) holds side-by-side parts of ``sizes``, each its own matrix."""

  axes: tuple[int, ...]
  fused: Optional[int]
  sizes: tuple[int, ...]


def _axes(value: Union[int, Sequence[int]], ndim: int) -> tuple[int, ...]:
  values = (value,) if isinstance(value, int) else tuple(value)
  return tuple(int(a) % ndim for a in values)


def _layout(dims: Any, shape: tuple[int, ...], path: str) -> Optional[_Layout]:
  if dims is None:
    return None
  if not isinstance(dims, _DIMS):
    raise ValueError(f"matrices gives {path} {dims!r}: use an optax.contrib."
                     "MuonDimensionNumbers, a stablejax.FusedDimensionNumbers or None")
  ndim = len(shape)
  axes = _axes(dims.reduction_axis, ndim) + _axes(dims.output_axis, ndim)
  if ndim < 2 or len(set(axes)) != len(axes) or not axes:
    raise ValueError(f"matrices gives {path} (shape {shape}) the axes {dims!r}, which do not "
                     "name distinct axes of a matrix")
  if isinstance(dims, FusedDimensionNumbers):
    fused = int(dims.fused_axis) % ndim
    return _Layout(tuple(sorted(axes)), fused, dims.part_sizes(shape))
  return _Layout(tuple(sorted(axes)), None, ())


def _per_matrix_sum(x: jax.Array, layout: _Layout, lead: int = 0) -> jax.Array:
  """Sums of ``x`` over each matrix (one reduction), keeping every axis (size 1 for the matrix
  axes, the number of parts for a fused one); ``lead`` leading axes of ``x`` come first."""
  reduce = tuple(lead + a for a in layout.axes if a != layout.fused)
  sums = jnp.sum(x, axis=reduce, keepdims=True)
  if layout.fused is None:
    return sums
  axis, start, parts = lead + layout.fused, 0, []
  for size in layout.sizes:
    part = jax.lax.slice_in_dim(sums, start, start + size, axis=axis)
    parts.append(jnp.sum(part, axis=axis, keepdims=True))
    start += size
  return jnp.concatenate(parts, axis=axis)


def _expand(per_matrix: jax.Array, layout: _Layout) -> jax.Array:
  """Per-matrix values broadcast to the leaf (each part of a fused axis repeated over its
  entries)."""
  if layout.fused is None:
    return per_matrix
  return jnp.repeat(per_matrix, jnp.asarray(layout.sizes), axis=layout.fused,
                    total_repeat_length=sum(layout.sizes))


def _layouts(matrices: MatricesArg, params: optax.Params) -> tuple[list, Any]:
  """(one layout or None per leaf of ``params``, the params' treedef)."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(params)
  per_leaf = _common.per_leaf_argument(
      matrices, params, treedef,
      "matrices does not match the parameters: give a pytree with their structure (None for a "
      "leaf that is not a matrix), or a function params -> such a pytree such as "
      "stablejax.muon_dimension_numbers")
  return [_layout(d, tuple(jnp.shape(p)), jax.tree_util.keystr(path))
          for (path, p), d in zip(flat, per_leaf)], treedef


def _compute_dtype(x: Any) -> Any:
  return jnp.promote_types(jnp.asarray(x).dtype, _common.STAT_DTYPE)


def _normalized(u: jax.Array, layout: _Layout) -> jax.Array:
  """``u / ||u||_F`` per matrix (0 for a zero matrix), in at least float32."""
  u = jnp.asarray(u, _compute_dtype(u))
  sq = _per_matrix_sum(jnp.square(u), layout)
  inv = jnp.where(sq > 0, jax.lax.rsqrt(jnp.where(sq > 0, sq, 1.0)), 0.0)
  return u * _expand(inv, layout)


def normalize_matrix_updates(matrices: MatricesArg) -> optax.GradientTransformation:
  """Each matrix's update divided by its Frobenius norm (a zero update stays zero); other leaves
  untouched. No state.

  The first half of :func:`hyperball` for a chain with a learning-rate multiplier between the
  optimizer and the Hyperball step (see the module docstring): it goes before the multiplier,
  ``hyperball(..., prenormalized=True)`` after it.

  Args:
    matrices: the matrices and their axes (:data:`MatricesArg`), as for :func:`hyperball`.

  Returns:
    An :class:`optax.GradientTransformation` with ``optax.EmptyState``.

  Example:
    >>> import jax.numpy as jnp
    >>> from optax.contrib import MuonDimensionNumbers
    >>> from stablejax.transforms.hyperball import normalize_matrix_updates
    >>> tx = normalize_matrix_updates({"w": MuonDimensionNumbers(), "b": None})
    >>> u = {"w": jnp.full((2, 2), 3.0), "b": jnp.full(2, 3.0)}
    >>> out, _ = tx.update(u, tx.init(u))
    >>> out["w"].tolist(), out["b"].tolist()
    ([[0.5, 0.5], [0.5, 0.5]], [3.0, 3.0])
  """

  def init_fn(params: optax.Params) -> optax.EmptyState:
    del params
    return optax.EmptyState()

  def update_fn(updates: optax.Updates, state: optax.EmptyState,
                params: Optional[optax.Params] = None) -> tuple[optax.Updates, optax.EmptyState]:
    del params  # the updates have the parameters' structure and shapes
    layouts, treedef = _layouts(matrices, updates)
    leaves = treedef.flatten_up_to(updates)
    out = [u if lay is None else _normalized(u, lay) for u, lay in zip(leaves, layouts)]
    return jax.tree_util.tree_unflatten(treedef, out), state

  return optax.GradientTransformation(init_fn, update_fn)  # type: ignore[arg-type]


def _step(w: jax.Array, u: jax.Array, norm0: jax.Array, rate: jax.Array, layout: _Layout,
          prenormalized: bool) -> tuple[jax.Array, jax.Array]:
  """One matrix leaf's Hyperball update ``W_new - W`` (in the incoming update's dtype) and its
  largest norm drift."""
  out_dtype = jnp.asarray(u).dtype
  dtype = jnp.promote_types(_compute_dtype(w), _compute_dtype(u))
  w, u = jnp.asarray(w, dtype), jnp.asarray(u, dtype)
  # <W,W>, <W,u>, <u,u> of every matrix in one reduction (one all-reduce when sharded).
  sums = _per_matrix_sum(jnp.stack([w * w, w * u, u * u]), layout, lead=1)
  ww, wu, uu = sums[0], sums[1], sums[2]
  r = norm0.astype(dtype)
  if prenormalized:  # u = s * Norm(direction): the step is rate * s * ||W0||
    c = rate * r
  else:
    c = jnp.where(uu > 0, rate * r * jax.lax.rsqrt(jnp.where(uu > 0, uu, 1.0)), 0.0)
  new_sq = ww + 2.0 * c * wu + c * c * uu
  scale = jnp.where(new_sq > 0, r * jax.lax.rsqrt(jnp.where(new_sq > 0, new_sq, 1.0)), 0.0)
  new = (w + _expand(c, layout) * u) * _expand(scale, layout)
  drift = jnp.where(r > 0, jnp.abs(jnp.sqrt(ww) / jnp.where(r > 0, r, 1.0) - 1.0), 0.0)
  return (new - w).astype(out_dtype), jnp.max(drift).astype(_common.STAT_DTYPE)


def hyperball(learning_rate: Optional[_common.LearningRate] = None, *, matrices: MatricesArg,
              learning_rates: _common.LearningRates = None, prenormalized: bool = False
              ) -> optax.GradientTransformation:
  """The Hyperball step for every matrix: ``W <- Norm(W + lr * Norm(u) * ||W0||) * ||W0||``.

  ``u`` is the incoming update (optax's sign: added to the weights, so ``-u`` is the paper's
  update), ``||W0||`` the matrix's Frobenius norm when the state was initialised. The transform
  returns ``W_new - W`` for each matrix (``optax.apply_updates`` then gives ``W_new``) and every
  other leaf's update unchanged. Put it after the optimizer and after anything that scales the
  update, before QK-clip and the compensated update; ``update`` needs ``params``. See the module
  docstring for the learning rate's way in and for ``prenormalized``.

  Args:
    learning_rate: the step: a number or an optax schedule of this transform's count of
      updates, the fraction of ``||W0||`` each matrix moves by (before projecting back to the
      sphere). Usually the optimizer's own schedule.
    matrices: which leaves are matrices and their axes (:data:`MatricesArg`), e.g.
      ``stablejax.muon_dimension_numbers`` for the matrices the Muon routing trains (not the
      embedding, the head, norms and biases).
    learning_rates: the step per parameter instead (a pytree of numbers or schedules with the
      parameters' structure, or a function ``params -> such a pytree``).
    prenormalized: the updates arrive normalised per matrix by :func:`normalize_matrix_updates`
      and multiplied since by a learning-rate scale ``s``: the step is ``lr * s * ||W0||`` along
      them, not renormalised (``s`` reaches the step).

  Returns:
    An :class:`optax.GradientTransformation` whose state is a :class:`HyperballState`.

  Raises:
    ValueError: no step given, or both ``learning_rate`` and ``learning_rates``, or a negative
      rate; ``matrices`` that do not fit the parameters (at ``init``).

  References:
    Wen, Dang, Lyu, Ma and Liang, `Fantastic Pretraining Optimizers and Where to Find Them 2.1:
    Hyperball Optimization <https://whenwen.github.io/wd_blog/public/hyperball-part-1.html>`_
    (December 2025); Levanter's ``optim/adamh.py`` and ``optim/muonh.py``.

  Example:
    AdamW's direction on the sphere of the initial norm (AdamH), the embedding-like ``b`` left
    to AdamW:

    >>> import jax.numpy as jnp, optax, stablejax
    >>> from optax.contrib import MuonDimensionNumbers
    >>> params = {"w": jnp.array([[3.0, 0.0], [0.0, 4.0]]), "b": jnp.ones(2)}
    >>> matrices = {"w": MuonDimensionNumbers(), "b": None}
    >>> tx = optax.chain(optax.adamw(1e-2), stablejax.hyperball(0.1, matrices=matrices))
    >>> state = tx.init(params)
    >>> for _ in range(3):
    ...   grads = {"w": jnp.array([[1.0, 2.0], [-1.0, 0.5]]), "b": jnp.ones(2)}
    ...   updates, state = tx.update(grads, state, params)
    ...   params = optax.apply_updates(params, updates)
    >>> round(float(jnp.linalg.norm(params["w"])), 5)  # ||W0|| = 5, kept
    5.0
    >>> [round(float(x), 3) for x in params["b"]]  # AdamW: three steps of 1e-2
    [0.97, 0.97]
  """
  if learning_rate is None and learning_rates is None:
    raise ValueError("hyperball needs its step: learning_rate=... (a number or a schedule, "
                     "usually the optimizer's) or learning_rates=... per parameter")
  _common.check_rate_args(learning_rate, learning_rates)

  def init_fn(params: optax.Params) -> HyperballState:
    layouts, treedef = _layouts(matrices, params)
    leaves = treedef.flatten_up_to(params)
    norms = [jnp.zeros([], _common.STAT_DTYPE) if lay is None else jnp.sqrt(
        _per_matrix_sum(jnp.square(jnp.asarray(p, _common.STAT_DTYPE)), lay))
        for p, lay in zip(leaves, layouts)]
    return HyperballState(count=jnp.zeros([], jnp.int32),
                          norms=jax.tree_util.tree_unflatten(treedef, norms),
                          norm_drift=jnp.zeros([], _common.STAT_DTYPE))

  def update_fn(updates: optax.Updates, state: HyperballState,
                params: Optional[optax.Params] = None) -> tuple[optax.Updates, HyperballState]:
    if params is None:
      raise ValueError("hyperball needs the parameters: call tx.update(updates, state, params)")
    layouts, treedef = _layouts(matrices, params)
    u_leaves = treedef.flatten_up_to(updates)
    p_leaves = treedef.flatten_up_to(params)
    n_leaves = treedef.flatten_up_to(state.norms)
    rates = _common.leaf_rates(updates, state.count, learning_rate, learning_rates)
    out, drifts = [], []
    for u, p, n, lay, rate in zip(u_leaves, p_leaves, n_leaves, layouts, rates):
      if lay is None:
        out.append(u)
        continue
      assert rate is not None  # a rate is required above
      new_u, drift = _step(p, u, n, rate, lay, prenormalized)
      out.append(new_u)
      drifts.append(drift)
    largest = jnp.max(jnp.stack(drifts)) if drifts else jnp.zeros([], _common.STAT_DTYPE)
    return jax.tree_util.tree_unflatten(treedef, out), HyperballState(
        count=_common.safe_increment(state.count), norms=state.norms, norm_drift=largest)

  # update_fn takes its own state type where optax's protocol says any OptState.
  return optax.GradientTransformation(init_fn, update_fn)  # type: ignore[arg-type]


register_state_metrics(HyperballState, "hyperball", lambda s: {"norm_drift": s.norm_drift},
                       order=45)


# ----------------------------------------------------------------------------- the declaration


@dataclasses.dataclass
class HyperballConfig:
  """``stability.hyperball``: the Hyperball step (AdamH, MuonH) for the matrices the Muon routing
  trains, at the optimizer's rate of each (:func:`hyperball`): normalised just before the
  learning-rate scale, stepped and projected back to the initial norm after it. Embeddings, the
  head, norms and biases keep the optimizer's own update. Weight decay on those matrices has no
  effect and is refused. Off by default (README: the learning-rate goal)."""

  enabled: bool = False

  def validate(self, where: str, ctx: defence.DefenceContext) -> None:
    decay = getattr(ctx.optimizer, "weight_decay", 0.0)
    if decay:
      raise ValueError(f"{where}.enabled=true keeps every matrix at its initial norm, so "
                       f"optimizer.weight_decay={decay} has no effect on them: set "
                       "optimizer.weight_decay=0 (Hyperball replaces weight decay)")


def _matrices(ctx: defence.DefenceContext) -> MatricesArg:
  if ctx.matrices is None:
    raise ValueError("stability.hyperball needs the optimizer's matrices "
                     "(DefenceContext.matrices, which the trainer sets)")
  return ctx.matrices


HYPERBALL = defence.Defence(
    name="hyperball", config=HyperballConfig, position=defence.Position.FINAL, order=5,
    build=lambda c, ctx: hyperball(matrices=_matrices(ctx), learning_rates=ctx.learning_rates,
                                   prenormalized=True),
    before_scale=lambda c, ctx: normalize_matrix_updates(_matrices(ctx)),
    label="Hyperball (matrices kept at their initial norm, normalised steps)")
