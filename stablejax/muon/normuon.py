"""NorMuon: per-neuron second-moment normalisation of Muon's orthogonalised update.

Li, Liu, Liang, Chen and Zhao, "NorMuon: Making Muon more efficient and scalable" (arXiv
2510.05491, Algorithm 1). Muon's update ``O`` (the Newton-Schulz output) has well-spread singular
values but very uneven neuron norms; NorMuon keeps, per output neuron, an EMA of the mean square
of that neuron's entries of ``O`` and divides them by its square root, then restores the matrix's
Frobenius norm::

    v  = b2 v + (1 - b2) mean_in(O * O)          (one entry per output neuron)
    O' = O / (sqrt(v) + eps)
    O' = O' * ||O||_F / ||O'||_F

The paper sets the step size to ``0.2 lr sqrt(m n) / ||O'||_F``, i.e. an update RMS of ``0.2
lr``; this rescale keeps the Frobenius norm the update had instead (as the authors' distributed
implementation in microsoft/dion does), so with :func:`stablejax.outlier_safe_muon`'s Moonlight
scale before it the update RMS stays what Muon's is (``0.2 lr`` up to Newton-Schulz's spread of
singular values) and a NorMuon run differs from a Muon run by the normalisation alone. No bias
correction: ``v``'s scale cancels in the rescale.

"Neuron" is an output unit: a column of Muon's ``[fan_in, fan_out]`` matrix (a row of PyTorch's
``[out, in]`` weight). Every matrix Muon orthogonalises on its own has its own neurons: each
projection of a fused kernel, each head with ``per_head``, each layer of a scan-stacked kernel.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from stablejax.muon import matrices
from stablejax.muon import routing
from stablejax.muon.matrices import Dims


class NorMuonState(NamedTuple):
  """State of :func:`scale_by_normuon`.

  Attributes:
    nu: per parameter, a float32 vector with one entry per output neuron of each of its matrices
      (the matrices in the order Muon cuts them, leading batch axes first): the EMA of the mean
      square of that neuron's update entries.
  """
  nu: optax.Updates


def neuron_count(shape: tuple[int, ...], dims: Dims) -> int:
  """Output neurons of the matrices ``dims`` cuts out of a ``shape`` leaf (the length of its
  entry of :attr:`NorMuonState.nu`)."""
  return sum(math.prod(batch) * fan_out for batch, _, fan_out in matrices.part_shapes(dims, shape))


def normalise(o: jax.Array, nu: jax.Array, b2: float | jax.Array, eps: float
              ) -> tuple[jax.Array, jax.Array]:
  """One NorMuon step on matrices ``o`` ``[..., fan_in, fan_out]`` with statistics ``nu``
  ``[..., fan_out]``; returns the normalised ``o`` (its dtype) and the new ``nu`` (float32)."""
  of = o.astype(jnp.float32)
  nu = b2 * nu + (1 - b2) * jnp.mean(of * of, axis=-2)
  scaled = of / (jnp.sqrt(nu)[..., None, :] + eps)
  norm = jnp.sqrt(jnp.sum(of * of, axis=(-2, -1), keepdims=True))
  new_norm = jnp.sqrt(jnp.sum(scaled * scaled, axis=(-2, -1), keepdims=True))
  return (scaled * (norm / jnp.maximum(new_norm, 1e-8))).astype(o.dtype), nu


def with_layouts(b2: float | jax.Array, eps: float, layouts: Callable[[optax.Params], list[Dims]]
                 ) -> optax.GradientTransformation:
  """:func:`scale_by_normuon` with the layouts given as ``tree -> [dims per leaf]`` (what
  :func:`stablejax.outlier_safe_muon` chains, with its routing's layouts)."""

  def init_fn(params: optax.Params) -> NorMuonState:
    treedef: Any
    leaves, treedef = jax.tree.flatten(params)
    nu = [jnp.zeros((neuron_count(jnp.shape(p), d),), jnp.float32)
          for p, d in zip(leaves, layouts(params))]
    return NorMuonState(treedef.unflatten(nu))

  def update_fn(updates: optax.Updates, state: NorMuonState,
                params: Optional[optax.Params] = None) -> tuple[optax.Updates, NorMuonState]:
    del params
    treedef: Any
    leaves, treedef = jax.tree.flatten(updates)
    new_leaves, new_nu = [], []
    for u, nu, dims in zip(leaves, treedef.flatten_up_to(state.nu), layouts(updates)):
      pieces, join = matrices.split_fused(u, dims)
      outs, nus, offset = [], [], 0
      for piece, piece_dims in pieces:
        x, back = matrices.to_matrices(piece, piece_dims)
        k = math.prod(x.shape[:-2]) * x.shape[-1]
        o, v = normalise(x, nu[offset:offset + k].reshape(x.shape[:-2] + x.shape[-1:]), b2, eps)
        outs.append(back(o))
        nus.append(v.reshape(-1))
        offset += k
      new_leaves.append(join(outs))
      new_nu.append(jnp.concatenate(nus) if len(nus) > 1 else nus[0])
    return treedef.unflatten(new_leaves), NorMuonState(treedef.unflatten(new_nu))

  return optax.GradientTransformation(init_fn, update_fn)  # type: ignore[arg-type]


def scale_by_normuon(b2: float = 0.95, eps: float = 1e-8,
                     weight_dimension_numbers: routing.DimensionNumbersOrFn = None
                     ) -> optax.GradientTransformation:
  """NorMuon's per-neuron normalisation of an orthogonalised update (arXiv 2510.05491).

  Chain it after the Muon direction; :func:`stablejax.outlier_safe_muon` does so with
  ``normuon=True``. Each matrix (as ``weight_dimension_numbers`` cuts the leaf, exactly as
  :func:`stablejax.muon.direction.scale_by_outlier_safe_muon` takes them) has each output neuron's
  entries divided by the root of the EMA of their mean square, then its Frobenius norm restored
  (see the module docstring for the formula and where it departs from the paper's step size).

  Args:
    b2: EMA decay of the per-neuron second moment (the paper's beta_2; microsoft/dion's
      default 0.95).
    eps: added to the root before dividing.
    weight_dimension_numbers: the matrix of each leaf: a tree or a callable of the updates, as
      ``optax.contrib.scale_by_muon`` takes them; None: the default layouts.

  Returns:
    An ``optax.GradientTransformation`` with :class:`NorMuonState` (float32 arrays, one vector
    per parameter: it jits, shards and checkpoints like Adam's moments, and a skipped step keeps
    it).

  References:
    Li et al., `NorMuon: Making Muon more efficient and scalable
    <https://arxiv.org/abs/2510.05491>`_ (arXiv 2510.05491).

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> from stablejax.muon.normuon import scale_by_normuon
    >>> tx = scale_by_normuon()
    >>> o = {"w": jnp.array([[3.0, 0.1], [4.0, 0.2]])}  # column norms 5 and 0.22
    >>> updates, state = tx.update(o, tx.init(o))
    >>> cols = jnp.linalg.norm(updates["w"], axis=0)
    >>> bool(jnp.allclose(cols[0], cols[1], rtol=1e-3))  # equal neuron norms
    True
    >>> bool(jnp.isclose(jnp.linalg.norm(updates["w"]), jnp.linalg.norm(o["w"])))
    True
  """
  def layouts_of(tree: optax.Params) -> list[Dims]:
    return [d for d in routing.matrix_layouts(tree, weight_dimension_numbers) if d is not None]

  return with_layouts(b2, eps, layouts_of)
