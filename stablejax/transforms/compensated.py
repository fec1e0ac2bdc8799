"""Compensated updates of low-precision parameters: Kahan summation or stochastic rounding.

Parameters stored in bfloat16 keep 8 significant bits: an update smaller than half the spacing of
bfloat16 numbers around a parameter (``|u| < |p| * 2**-9``) rounds away entirely, and larger ones
lose their low bits, so small learning rates stop training (the underflow the monitor's
parameter-movement check flags). Zamirai et al., "Revisiting BFloat16 Training"
(arXiv:2010.06192), recover float32 quality at bfloat16 parameter memory with either of:

* **Kahan summation** (``method="kahan"``): a second bfloat16 buffer ``c`` per parameter keeps
  what rounding lost and adds it back at the next step::

      y = u - c;  t = round(p + y);  c = (t - p) - y;  p = t

  ``t - p`` is the update actually applied, so ``c`` is minus the part of ``y`` that rounding
  dropped; nothing is lost for good, only delayed. The arithmetic runs in float32 (as a fused
  kernel would) and ``c`` is stored in the parameter's dtype; its own rounding (8 bits of a
  number already below the parameter's last bit) is negligible.
* **Stochastic rounding** (``method="stochastic_rounding"``): ``p + u`` (float32) rounds to one
  of its two bfloat16 neighbours with probabilities that make the expected value exact, so small
  updates move the parameter on average. No buffer; the random bits come from ``seed`` folded
  with the update count (a step replayed after a rollback draws the same bits). bfloat16 only
  (the rounding adds random bits below bfloat16's last bit of the float32 number and truncates).

Memory per parameter: bfloat16 parameters 2 bytes, plus 2 bytes of Kahan buffer (4 in all, the
size of float32 parameters, the buffer instead of 16 more bits of mantissa) or nothing for
stochastic rounding.

**The API, and why it is a transform.** ``optax.apply_updates(params, updates)`` is stateless
(``p + u`` rounded to ``p``'s dtype), so it cannot carry a buffer from one step to the next. The
buffer lives in this transform's state instead, with the rest of the optimizer state: it is
checkpointed, restored after a rollback and sharded like it, and a step dropped by
:func:`stablejax.skip_nonfinite` or :func:`stablejax.skip_spikes` leaves it as it was, as the
Adam moments are. The transform sees the parameters (``update(updates, state, params)``), does
the compensated addition itself and returns ``new_params - params`` in float32, the exact
difference of two bfloat16 numbers; ``optax.apply_updates`` then adds it in float32 and rounds
once, which lands on ``new_params`` exactly (tested). So any optax loop keeps its
``optax.apply_updates``; the transform goes last in the chain (after every scaling of the update,
QK-clip included) and needs ``params``. Float32 (and float64) parameters pass through untouched.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from stablejax.transforms import _common
from stablejax.transforms import defence
from stablejax.transforms.metrics import register_state_metrics

METHODS = ("kahan", "stochastic_rounding")


class CompensatedUpdatesState(NamedTuple):
  """State of :func:`compensated_updates`.

  Attributes:
    compensation: pytree like the parameters: the Kahan buffer (the parameter's dtype and shape)
      of each low-precision leaf; a scalar zero for a float32 leaf and for stochastic rounding.
    count: updates applied (int32); stochastic rounding folds it into its random key.
    lost_fraction: fraction of low-precision entries whose update a plain ``p + u`` would have
      lost entirely at the last step (``u != 0`` rounded back to ``p``): the underflow this
      transform repairs (float32).
    update_norm: global norm of the incoming update at the last step (float32): the update the
      optimizer produced, where the applied one moves each parameter by whole steps of its
      resolution.

  Example:
    >>> import jax.numpy as jnp, stablejax
    >>> tx = stablejax.compensated_updates()
    >>> params = {"w": jnp.ones(3, jnp.bfloat16)}
    >>> _, state = tx.update({"w": jnp.full(3, 1e-3)}, tx.init(params), params)
    >>> float(state.lost_fraction), state.compensation["w"].dtype
    (1.0, dtype(bfloat16))
  """

  compensation: Any
  count: jax.Array  # type: ignore[assignment]  # shadows tuple.count, as in optax's states
  lost_fraction: jax.Array
  update_norm: jax.Array


def _low_precision(x: Any) -> bool:
  dtype = jnp.asarray(x).dtype if not hasattr(x, "dtype") else x.dtype
  return jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32


def kahan_add(params: jax.Array, update: jax.Array, compensation: jax.Array
              ) -> tuple[jax.Array, jax.Array]:
  """One compensated addition ``params + update`` in ``params``' dtype (Kahan).

  Args:
    params: the parameter (e.g. bfloat16).
    update: the update to add (any float dtype).
    compensation: the buffer of the previous step (``params``' shape; zeros at the start).

  Returns:
    ``(new_params, new_compensation)``, both in the dtype of ``params`` / ``compensation``.

  Example:
    Ten updates of 1e-3 to a bfloat16 1.0 (each alone below half its spacing, 2**-8):

    >>> import jax.numpy as jnp
    >>> from stablejax.transforms.compensated import kahan_add
    >>> p, c, plain = jnp.bfloat16(1.0), jnp.bfloat16(0.0), jnp.bfloat16(1.0)
    >>> for _ in range(10):
    ...   p, c = kahan_add(p, jnp.float32(1e-3), c)
    ...   plain = (plain + jnp.float32(1e-3)).astype(jnp.bfloat16)
    >>> float(p), float(plain)  # 1.01 lies between 1.0078125 and 1.015625
    (1.0078125, 1.0)
  """
  p32 = jnp.asarray(params).astype(jnp.float32)
  y = jnp.asarray(update).astype(jnp.float32) - jnp.asarray(compensation).astype(jnp.float32)
  t = (p32 + y).astype(jnp.asarray(params).dtype)
  new_compensation = ((t.astype(jnp.float32) - p32) - y).astype(jnp.asarray(compensation).dtype)
  return t, new_compensation


def stochastic_round_bf16(x: jax.Array, key: jax.Array) -> jax.Array:
  """``x`` (float32) rounded to bfloat16 up or down at random, exact in expectation.

  Adds 16 random bits below bfloat16's last bit of the float32 number and truncates: ``x`` lying
  a fraction ``f`` of the way from its lower bfloat16 neighbour (in magnitude) to the upper one
  rounds up with probability ``f``. Non-finite values pass through.

  Args:
    x: float32 values.
    key: a JAX PRNG key.

  Returns:
    bfloat16 values.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from stablejax.transforms.compensated import stochastic_round_bf16
    >>> x = jnp.full(100_000, 1.0 + 2**-9, jnp.float32)  # a quarter of the way to 1 + 2**-7
    >>> r = stochastic_round_bf16(x, jax.random.PRNGKey(0)).astype(jnp.float32)
    >>> sorted(set(r.tolist())), round(float(jnp.mean(r == 1.0078125)), 2)
    ([1.0, 1.0078125], 0.25)
  """
  x = jnp.asarray(x, jnp.float32)
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  noise = jax.random.bits(key, x.shape, jnp.uint32) & jnp.uint32(0xFFFF)
  rounded = (bits + noise) & jnp.uint32(0xFFFF0000)
  out = jax.lax.bitcast_convert_type(rounded, jnp.float32)
  return jnp.where(jnp.isfinite(x), out, x).astype(jnp.bfloat16)


def compensated_updates(method: str = "kahan", *, seed: int = 0
                        ) -> optax.GradientTransformation:
  """Updates of low-precision parameters without underflow: Kahan summation or stochastic rounding.

  For every bfloat16 (or float16, Kahan only) parameter, the transform adds the incoming update
  to the parameter with compensation (see the module docstring) and returns the exact difference
  ``new_params - params`` in float32, which ``optax.apply_updates`` turns into ``new_params``;
  float32 parameters get their update unchanged. Put it last in the chain; ``update`` needs
  ``params``.

  Args:
    method: ``"kahan"`` (a buffer of the parameters' dtype) or ``"stochastic_rounding"``
      (bfloat16 parameters, no buffer).
    seed: seed of stochastic rounding's random bits (folded with the update count).

  Returns:
    An :class:`optax.GradientTransformation` whose state is a :class:`CompensatedUpdatesState`.

  References:
    Zamirai et al., `Revisiting BFloat16 Training <https://arxiv.org/abs/2010.06192>`_
    (arXiv:2010.06192); Kahan, "Further remarks on reducing truncation errors" (CACM, 1965).

  Example:
    A rate of 1e-4 on bfloat16 weights near 1 (each step alone rounds away):

    >>> import jax.numpy as jnp, optax, stablejax
    >>> params = {"w": jnp.ones(4, jnp.bfloat16)}
    >>> for tx in (optax.sgd(1e-4), optax.chain(optax.sgd(1e-4), stablejax.compensated_updates())):
    ...   p, state = params, tx.init(params)
    ...   for _ in range(100):
    ...     updates, state = tx.update({"w": -jnp.ones(4, jnp.bfloat16)}, state, p)
    ...     p = optax.apply_updates(p, updates)
    ...   print(float(p["w"][0]))  # float32 would give 1.01
    1.0
    1.0078125
  """
  if method not in METHODS:
    raise ValueError(f"method={method!r} is invalid: use one of {', '.join(map(repr, METHODS))}.")
  base_key = jax.random.PRNGKey(seed)

  def init_fn(params: optax.Params) -> CompensatedUpdatesState:
    def buffer(p: Any) -> jax.Array:
      if _low_precision(p):
        if method == "stochastic_rounding" and p.dtype != jnp.bfloat16:
          raise ValueError(f"method='stochastic_rounding' rounds to bfloat16, and a parameter "
                           f"is {p.dtype}: use method='kahan' for it")
        if method == "kahan":
          return jnp.zeros(p.shape, p.dtype)
      return jnp.zeros([], getattr(p, "dtype", jnp.float32))
    zero = jnp.zeros([], _common.STAT_DTYPE)
    return CompensatedUpdatesState(compensation=jax.tree.map(buffer, params),
                                   count=jnp.zeros([], jnp.int32), lost_fraction=zero,
                                   update_norm=zero)

  def update_fn(updates: optax.Updates, state: CompensatedUpdatesState,
                params: Optional[optax.Params] = None
                ) -> tuple[optax.Updates, CompensatedUpdatesState]:
    if params is None:
      raise ValueError("compensated_updates needs the parameters: call "
                       "tx.update(updates, state, params)")
    u_leaves, treedef = jax.tree.flatten(updates)
    p_leaves = treedef.flatten_up_to(params)  # type: ignore[attr-defined]
    c_leaves = treedef.flatten_up_to(state.compensation)  # type: ignore[attr-defined]
    step_key = jax.random.fold_in(base_key, state.count)
    new_u, new_c, lost, total = [], [], [], 0
    for i, (u, p, c) in enumerate(zip(u_leaves, p_leaves, c_leaves)):
      if not _low_precision(p):
        new_u.append(u)
        new_c.append(c)
        continue
      p32, u32 = p.astype(jnp.float32), jnp.asarray(u).astype(jnp.float32)
      if method == "kahan":
        t, c = kahan_add(p, u, c)
      else:
        t = stochastic_round_bf16(p32 + u32, jax.random.fold_in(step_key, i))
      new_u.append(t.astype(jnp.float32) - p32)
      new_c.append(c)
      plain = (p32 + u32).astype(p.dtype)
      lost.append(jnp.sum(jnp.logical_and(plain == p, u32 != 0), dtype=jnp.float32))
      total += int(np.prod(p.shape))
    fraction = (_common.sum_of_scalars(lost) / total if total
                else jnp.zeros([], _common.STAT_DTYPE))
    new_state = CompensatedUpdatesState(
        compensation=jax.tree_util.tree_unflatten(treedef, new_c),
        count=_common.safe_increment(state.count), lost_fraction=fraction,
        update_norm=_common.global_norm_f32(updates))
    return jax.tree_util.tree_unflatten(treedef, new_u), new_state

  # update_fn takes its own state type where optax's protocol says any OptState.
  return optax.GradientTransformation(init_fn, update_fn)  # type: ignore[arg-type]


register_state_metrics(CompensatedUpdatesState, "compensated",
                       lambda s: {"lost_fraction": s.lost_fraction, "update_norm": s.update_norm},
                       update_norm="update_norm", order=70)


# ----------------------------------------------------------------------------- the declaration


_LOW_PRECISION_DTYPES = ("bfloat16", "float16")


@dataclasses.dataclass
class CompensatedUpdatesConfig:
  """``stability.compensated_updates``: Kahan summation (or stochastic rounding) of the update
  into low-precision parameters (``model.param_dtype`` bfloat16 or float16), last in the chain
  (:func:`compensated_updates`). With float32 parameters it has nothing to do and is left out of
  the chain. On by default (README: bf16 parameters)."""

  enabled: bool = True
  method: str = "kahan"

  def validate(self, where: str, ctx: defence.DefenceContext) -> None:
    if self.method not in METHODS:
      raise ValueError(f"{where}.method={self.method!r} is not known: use \"kahan\" or "
                       "\"stochastic_rounding\"")
    dtype = ctx.model.param_dtype if ctx.model is not None else None
    if self.method == "stochastic_rounding" and dtype == "float16":
      raise ValueError(f"{where}.method=\"stochastic_rounding\" rounds to bfloat16 and "
                       "model.param_dtype is float16: use method \"kahan\"")


def _build(c: CompensatedUpdatesConfig, ctx: defence.DefenceContext
           ) -> Optional[optax.GradientTransformation]:
  if ctx.model is not None and ctx.model.param_dtype not in _LOW_PRECISION_DTYPES:
    return None  # float32 parameters: nothing to compensate
  return compensated_updates(c.method)


COMPENSATED_UPDATES = defence.Defence(
    name="compensated_updates", config=CompensatedUpdatesConfig,
    position=defence.Position.FINAL, order=100, build=_build, changes_update_application=True,
    label="compensated low-precision updates (Kahan summation into bf16 parameters)")
