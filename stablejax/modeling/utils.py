"""Model-side utilities for outlier-safe training (Outlier-Safe Pre-Training, arXiv 2506.19697).

* ``init_new_token_embeddings``: new tokens start at the vocabulary mean, not at random values
  that stand out as activation outliers.
* ``lambda_warmup``: BitNet-style ramp of the quantisation strength from 0 to 1
  (arXiv 2402.17764 trains quantised; the warmup eases the switch).
* ``excess_kurtosis``: the outlier measure logged during training.
* ``merge_emb_proj``: folds EmbProj into the embedding table and the head after training.
* ``quantize_weights_rtn``: per-channel round-to-nearest weight quantisation (fake-quantised), to
  measure how well a model survives 4-bit weights.

These work on the parameter trees of ``stablejax.modeling.gpt.GPT`` (``tok_embed/embedding``
``[V, D]``, ``lm_head/kernel`` ``[D, V]``, ``emb_proj_in/kernel``, ``emb_proj_out/kernel``);
a tree wrapped as ``{"params": ...}`` is accepted too.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax


def _unwrap(params: optax.Params) -> tuple[Any, Callable[[Any], Any]]:
  """Returns (inner params, rewrap function) for trees given with or without a "params" key."""
  if isinstance(params, dict) and "tok_embed" not in params and "params" in params:
    outer = params
    return params["params"], lambda inner: {**outer, "params": inner}
  return params, lambda inner: inner


def init_new_token_embeddings(params: optax.Params, token_ids: Sequence[int] | np.ndarray) -> Any:
  """Sets the embeddings of new tokens to the mean embedding of the rest of the vocabulary.

  The input embedding rows ``tok_embed/embedding[token_ids]`` and, for an untied model, the output
  head columns ``lm_head/kernel[:, token_ids]`` are set to the mean over all *other* vocabulary
  entries. Randomly initialised new rows (for example a MASK token added for fine-tuning) have a
  different scale and direction from trained ones and create activation outliers; the mean is a
  neutral start. Grow the vocabulary first (pad the table), then call this on the new ids.

  Args:
    params: GPT parameters (optionally wrapped as ``{"params": ...}``).
    token_ids: ids of the new tokens (ints in ``[0, vocab_size)``, not all of them).

  Returns:
    A new parameter tree (same structure and dtypes) with those rows/columns replaced.

  Example:
    Token 2 was just added (its row is still zero); it starts at the mean of tokens 0 and 1:

    >>> import jax.numpy as jnp, stablejax
    >>> params = {"tok_embed": {"embedding": jnp.array([[1.0, 2.0], [3.0, 4.0], [0.0, 0.0]])}}
    >>> stablejax.init_new_token_embeddings(params, [2])["tok_embed"]["embedding"].tolist()
    [[1.0, 2.0], [3.0, 4.0], [2.0, 3.0]]
  """
  inner, rewrap = _unwrap(params)
  if "tok_embed" not in inner or "embedding" not in inner["tok_embed"]:
    raise ValueError("params have no tok_embed/embedding: pass the GPT parameter tree")
  table = inner["tok_embed"]["embedding"]
  vocab = table.shape[0]
  ids = np.unique(np.asarray(token_ids, dtype=np.int64).reshape(-1))
  if ids.size == 0:
    raise ValueError("token_ids is empty: pass the ids of the new tokens")
  if ids.min() < 0 or ids.max() >= vocab:
    raise ValueError(f"token_ids must lie in [0, {vocab}), got {ids.min()}..{ids.max()}: "
                     f"grow the embedding table first")
  if ids.size >= vocab:
    raise ValueError("token_ids covers the whole vocabulary: there is no existing token to "
                     "average over")
  keep = np.ones(vocab, bool)
  keep[ids] = False
  keep_j = jnp.asarray(keep)

  def masked_mean(x: jax.Array, axis: int) -> jax.Array:
    w = keep_j.astype(jnp.float32)
    w = w[:, None] if axis == 0 else w[None, :]
    return jnp.sum(x.astype(jnp.float32) * w, axis=axis) / float(keep.sum())

  new = dict(inner)
  mean_row = masked_mean(table, 0).astype(table.dtype)
  new["tok_embed"] = {**inner["tok_embed"], "embedding": table.at[ids].set(mean_row)}
  if "lm_head" in inner:
    kernel = inner["lm_head"]["kernel"]
    mean_col = masked_mean(kernel, 1).astype(kernel.dtype)
    new["lm_head"] = {**inner["lm_head"],
                      "kernel": kernel.at[:, ids].set(mean_col[:, None])}
  return rewrap(new)


def lambda_warmup(steps: int, schedule: str = "linear"
                  ) -> Callable[[jax.typing.ArrayLike], jax.Array]:
  """Ramp of the BitNet quantisation strength lambda from 0 to 1 over ``steps`` steps.

  ``linear``: ``lambda(s) = min(s / steps, 1)``. ``cosine``: ``lambda(s) = (1 - cos(pi *
  min(s / steps, 1))) / 2`` (slow start and end). Built from optax's own schedules. ``steps=0``
  gives lambda = 1 from the first step.

  Args:
    steps: warmup length (non-negative int).
    schedule: "linear" or "cosine".

  Returns:
    An optax-style schedule ``step -> float32 lambda in [0, 1]`` (jit-friendly).

  Example:
    >>> import stablejax
    >>> lam = stablejax.lambda_warmup(100, "cosine")
    >>> [round(float(lam(step)), 4) for step in (0, 25, 50, 100, 200)]
    [0.0, 0.1464, 0.5, 1.0, 1.0]

    In a model: ``model.apply(variables, tokens, bitnet_lambda=lam(step))``.
  """
  if not isinstance(steps, (int, np.integer)) or isinstance(steps, bool) or steps < 0:
    raise ValueError(f"lambda_warmup steps={steps!r} must be a non-negative integer")
  if schedule not in ("linear", "cosine"):
    raise ValueError(f"lambda_warmup schedule={schedule!r} is unknown: use 'linear' or 'cosine'")
  if steps == 0:
    return lambda step: jnp.ones((), jnp.float32)
  if schedule == "linear":
    inner = optax.linear_schedule(init_value=0.0, end_value=1.0, transition_steps=int(steps))
    return lambda step: jnp.asarray(inner(step), jnp.float32)
  decay = optax.cosine_decay_schedule(init_value=1.0, decay_steps=int(steps))
  return lambda step: jnp.asarray(1.0 - decay(step), jnp.float32)


def excess_kurtosis(hidden: Any) -> jax.Array:
  """Mean over layers of ``max(0, E[(x - mu)^4] / sigma^4 - 3)``.

  Statistics are per layer over *all* entries of that layer (batch, positions and features
  pooled), centred on the layer mean, in float32 from standardised values (``x / max|x|``, then
  ``(x - mean) / std``): finite activations always give a finite value, however large they are
  (a layer of ``n`` entries gives at most ``n - 3``). A Gaussian gives ~0; a few massive
  activations give large values.

  Args:
    hidden: array ``[n_layers, ...]`` (leading axis = layer), e.g. ``activations["residual"]``
      from ``GPT(..., return_activations=True)`` (which includes the embedding output at index 0;
      pass ``residual[1:]`` for the block outputs only), or a list of per-layer arrays.

  Returns:
    float32 scalar.

  Example:
    >>> import jax
    >>> import stablejax
    >>> hidden = jax.random.normal(jax.random.key(0), (2, 4096))   # 2 layers of Gaussians
    >>> float(stablejax.excess_kurtosis(hidden))
    0.0
    >>> spiky = hidden.at[:, 0].set(200.0)    # one massive activation per layer
    >>> float(stablejax.excess_kurtosis(spiky)) > 1000
    True

    On a model (``GPT(..., return_activations=True)``), the block outputs are
    ``excess_kurtosis(activations["residual"][1:])``.
  """
  if isinstance(hidden, (list, tuple)):
    values = [_layer_excess_kurtosis(h) for h in hidden]
    return jnp.mean(jnp.stack(values))
  hidden = jnp.asarray(hidden)
  if hidden.ndim < 2:
    raise ValueError(f"hidden must be [n_layers, ...], got shape {hidden.shape}: add a layer axis")
  flat = hidden.reshape(hidden.shape[0], -1)
  return jnp.mean(jax.vmap(_layer_excess_kurtosis)(flat))


def _layer_excess_kurtosis(x: jax.Array) -> jax.Array:
  # Standardised before any power is taken: y = x / max|x| lies in [-1, 1], and z = (y - mean) / std
  # has |z| <= sqrt(n), so z**4 <= n**2 and neither the moments nor their ratio can overflow
  # float32 for finite activations (the raw fourth moment overflows from |x| ~ 4e9 on).
  x = jnp.asarray(x, jnp.float32).reshape(-1)
  peak = jnp.max(jnp.abs(x))
  # Twice by 1 / sqrt(peak), not once by 1 / peak: near float32's maximum 1 / peak is subnormal,
  # and XLA on CPU flushes subnormals to zero.
  r = jax.lax.rsqrt(jnp.where(peak > 0, peak, 1.0))
  y = (x * r) * r
  centred = y - jnp.mean(y)
  var = jnp.mean(jnp.square(centred))
  z = centred * jnp.where(var > 0, jax.lax.rsqrt(jnp.where(var > 0, var, 1.0)), 0.0)
  kurt = jnp.mean(jnp.square(jnp.square(z)))
  return jnp.maximum(kurt - 3.0, 0.0)


def merge_emb_proj(params: optax.Params, cfg: Any) -> tuple[Any, Any]:
  """Folds the EmbProj projections into the embedding table and the output head.

  The model computes ``x0 = s * E[t] @ P_in`` (``s`` = sqrt(D) with ``embed_scale``, else 1) and
  ``logits = norm(h) @ P_out @ W`` with ``W`` = ``lm_head/kernel`` (untied) or ``E.T`` (tied).
  Both projections touch only linear maps, so ``E' = E @ P_in`` and ``W' = P_out @ W`` give the
  same outputs exactly (up to float rounding; the products are computed in float32 at highest
  precision). ``emb_proj_out`` sits after the final norm for exactly this reason: a projection
  before an RMSNorm could not be folded. A tied model becomes untied (the merged input table
  and head differ), with a new ``lm_head``.

  Args:
    params: GPT parameters of a model with ``cfg.emb_proj=True`` (optionally ``{"params": ...}``).
    cfg: its ``ModelConfig``.

  Returns:
    ``(params, cfg)`` for the same model without EmbProj (``emb_proj=False``,
    ``tie_embeddings=False``); parameter dtypes are kept.

  Example:
    >>> import jax, jax.numpy as jnp, stablejax
    >>> from stablejax.modeling.gpt import GPT, ModelConfig
    >>> cfg = ModelConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, emb_proj=True,
    ...                   compute_dtype="float32")
    >>> tokens = jnp.arange(6)[None]
    >>> params = jax.jit(GPT(cfg).init)(jax.random.key(0), tokens)["params"]
    >>> merged, merged_cfg = stablejax.merge_emb_proj(params, cfg)
    >>> sorted(merged), merged_cfg.emb_proj
    (['blocks', 'final_norm', 'lm_head', 'tok_embed'], False)
    >>> before = jax.jit(GPT(cfg).apply)({"params": params}, tokens)
    >>> after = jax.jit(GPT(merged_cfg).apply)({"params": merged}, tokens)
    >>> bool(jnp.allclose(before, after, atol=1e-5))
    True
  """
  if not getattr(cfg, "emb_proj", False):
    raise ValueError("merge_emb_proj needs a config with emb_proj=True: there is nothing to merge")
  inner, rewrap = _unwrap(params)
  for name in ("emb_proj_in", "emb_proj_out", "tok_embed"):
    if name not in inner:
      raise ValueError(f"params have no {name}: pass the parameters of the emb_proj model")
  hp = jax.lax.Precision.HIGHEST
  table = inner["tok_embed"]["embedding"]
  p_in = inner["emb_proj_in"]["kernel"].astype(jnp.float32)
  p_out = inner["emb_proj_out"]["kernel"].astype(jnp.float32)
  head = table.T if cfg.tie_embeddings else inner["lm_head"]["kernel"]
  new_table = jnp.dot(table.astype(jnp.float32), p_in, precision=hp).astype(table.dtype)
  new_head = jnp.dot(p_out, head.astype(jnp.float32), precision=hp).astype(head.dtype)
  new = {k: v for k, v in inner.items() if k not in ("emb_proj_in", "emb_proj_out")}
  new["tok_embed"] = {**inner["tok_embed"], "embedding": new_table}
  new["lm_head"] = {"kernel": new_head}
  return rewrap(new), dataclasses.replace(cfg, emb_proj=False, tie_embeddings=False)


def _path_str(path: Sequence[Any]) -> str:
  parts = []
  for k in path:
    parts.append(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))))
  return "/".join(parts)


def quantize_weights_rtn(params: optax.Params, bits: int = 4, *, exclude: Sequence[str] = ()
                         ) -> optax.Params:
  """Per-channel symmetric round-to-nearest weight quantisation (returns dequantised weights).

  Every leaf with ``ndim >= 2`` is quantised per output channel: for kernels ``[..., in, out]``
  the scale is ``max|w|`` over the ``in`` axis (axis -2) divided by ``2**(bits-1) - 1``; for
  embedding tables (path containing "embed", ``[..., vocab, D]``) each token row is a channel
  (axis -1). Values become ``clip(round(w / scale), -qmax, qmax) * scale``. Leading axes (the
  stacked layer axis of scanned blocks) are independent channels too. Norm gains (leaves named
  ``scale``, which are ``[L, D]`` in scanned models), scalars and vectors are left alone, as are
  leaves whose path contains any string in ``exclude``.

  Args:
    params: parameter tree.
    bits: bit width, 2..8 (4 by default).
    exclude: substrings of "/"-joined parameter paths to leave in full precision
      (e.g. ``("lm_head",)``).

  Returns:
    A tree of the same structure and dtypes holding the fake-quantised weights.

  Example:
    Per output column, the scale is the column's largest magnitude over ``2**(bits-1) - 1``:

    >>> import jax.numpy as jnp, stablejax
    >>> params = {"mlp": {"kernel": jnp.array([[0.5, -1.0], [0.26, 0.1]])}}
    >>> stablejax.quantize_weights_rtn(params, bits=2)["mlp"]["kernel"].tolist()
    [[0.5, -1.0], [0.5, 0.0]]
  """
  if not isinstance(bits, (int, np.integer)) or isinstance(bits, bool) or not 2 <= bits <= 8:
    raise ValueError(f"bits={bits!r} must be an integer in 2..8 (4 for the usual 4-bit test)")
  qmax = float(2 ** (bits - 1) - 1)

  def quant(path: Sequence[Any], w: jax.Array) -> jax.Array:
    name = _path_str(path)
    leaf = name.rsplit("/", 1)[-1]
    if getattr(w, "ndim", 0) < 2 or leaf == "scale" or any(e in name for e in exclude):
      return w
    axis = -1 if "embed" in name else -2
    w32 = jnp.asarray(w, jnp.float32)
    scale = jnp.max(jnp.abs(w32), axis=axis, keepdims=True) / qmax
    safe = jnp.where(scale > 0, scale, 1.0)
    q = jnp.clip(jnp.round(w32 / safe), -qmax, qmax) * safe
    return q.astype(w.dtype)

  return jax.tree_util.tree_map_with_path(quant, params)
