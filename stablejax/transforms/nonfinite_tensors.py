"""Per-tensor finite guard: a tensor whose gradient, new state or update is not finite is skipped.

:func:`stablejax.skip_nonfinite` skips a whole step when anything is not finite;
:func:`skip_nonfinite_tensors` skips only the tensors concerned, with their optimizer state
kept, so one NaN cannot freeze the others (or poison its own momentum) when a transform is used
without that wrapper. :func:`stablejax.outlier_safe_muon` guards each of its groups with it.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from stablejax.transforms._common import finite_probe, probe_total


class TensorGuardState(NamedTuple):
  """State of :func:`skip_nonfinite_tensors`.

  Attributes:
    inner_state: the wrapped transform's state.
    skipped: int32 number of tensors skipped at the last step.
  """
  inner_state: optax.OptState
  skipped: jax.Array


def skip_nonfinite_tensors(inner: optax.GradientTransformation
                           ) -> optax.GradientTransformationExtraArgs:
  """Per-tensor finite guard: a tensor whose gradient, new state or update is not finite is skipped.

  A skipped tensor gets a zero update and keeps its entries of every per-parameter state tree
  (momentum, Adam moments: any subtree of the state with the structure of the updates); the
  other tensors update normally, and shared scalars such as step counts advance. Unlike
  :func:`stablejax.skip_nonfinite`, which skips the whole step, this keeps a single bad tensor
  from poisoning its own state when the transform is used without that wrapper.

  Args:
    inner: the transform to guard (in :func:`stablejax.outlier_safe_muon`, one routing group).

  Returns:
    A transform with :class:`TensorGuardState`.

  References:
    Micikevicius et al., `Mixed Precision Training <https://arxiv.org/abs/1710.03740>`_
    (arXiv 1710.03740), which skips an update whose gradients overflowed; here per tensor.
    Compare ``optax.apply_if_finite``, which skips the whole step.
  """
  inner = optax.with_extra_args_support(inner)

  def init_fn(params: optax.Params) -> TensorGuardState:
    return TensorGuardState(inner.init(params), jnp.zeros((), jnp.int32))

  def update_fn(updates: optax.Updates, state: TensorGuardState,
                params: Optional[optax.Params] = None,
                **extra_args: Any) -> tuple[optax.Updates, TensorGuardState]:
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
