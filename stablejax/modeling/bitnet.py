"""BitNet b1.58-style quantisation-aware matmul, mixed with full precision by lambda.

Reference: Ma et al., "The Era of 1-bit LLMs: All Large Language Models are in 1.58 Bits"
(arXiv 2402.17764), and the lambda warmup of "Outlier-Safe Pre-Training" (arXiv 2506.19697).

* Weights: absmean scaling, then round-and-clip to {-1, 0, 1} (ternary), rescaled.
* Activations: 8-bit per-token absmax (each token's vector scaled so that its largest entry
  maps to 127), rounded, clipped to [-128, 127], rescaled.
* Both use the straight-through estimator ``x + stop_gradient(q(x) - x)``: the forward pass sees
  the quantised value, the backward pass the identity.
* The layer output is ``(1 - f) * x @ w + f * q(x) @ q(w)``, with ``f`` (``quantized_fraction``)
  a traced scalar, so a warmup schedule can move it every step without recompiling.

Example::

    y = bitnet_matmul(x, kernel, quantized_fraction=jnp.float32(0.5), dtype=jnp.bfloat16)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_EPS = 1e-5


def ternary_weight_quant(w: jax.Array) -> jax.Array:
  """Absmean ternary quantisation of a weight matrix (fake-quantised, no STE).

  Args:
    w: weights of any shape; the absmean scale is taken over the whole tensor.

  Returns:
    ``clip(round(w / s), -1, 1) * s`` with ``s = mean(|w|)``, in float32.
  """
  w = w.astype(jnp.float32)
  scale = jnp.maximum(jnp.mean(jnp.abs(w)), _EPS)
  return jnp.clip(jnp.round(w / scale), -1.0, 1.0) * scale


def int8_activation_quant(x: jax.Array) -> jax.Array:
  """Per-token absmax 8-bit quantisation over the last axis (fake-quantised, no STE).

  Args:
    x: activations ``[..., features]``.

  Returns:
    ``clip(round(x * 127 / max|x|), -128, 127) * max|x| / 127`` per token, in float32.
  """
  x = x.astype(jnp.float32)
  amax = jnp.maximum(jnp.max(jnp.abs(x), axis=-1, keepdims=True), _EPS)
  scale = 127.0 / amax
  return jnp.clip(jnp.round(x * scale), -128.0, 127.0) / scale


def _ste(x: jax.Array, q: jax.Array) -> jax.Array:
  x = x.astype(jnp.float32)
  return x + jax.lax.stop_gradient(q - x)


def bitnet_matmul(x: jax.Array, w: jax.Array, quantized_fraction: jax.Array,
                  dtype: jax.typing.DTypeLike) -> jax.Array:
  """Mixes a full-precision and a BitNet-quantised matmul: ``(1-f) x@w + f q(x)@q(w)``.

  Args:
    x: activations ``[..., in]``.
    w: kernel ``[in, out]`` (the stored parameter, any dtype; never modified).
    quantized_fraction: the quantised product's share of the output, a scalar in [0, 1] (may
      be traced).
    dtype: compute dtype of both matmuls.

  Returns:
    ``[..., out]`` in ``dtype``.
  """
  full = jnp.dot(x.astype(dtype), w.astype(dtype))
  xq = _ste(x, int8_activation_quant(x)).astype(dtype)
  wq = _ste(w, ternary_weight_quant(w)).astype(dtype)
  quant = jnp.dot(xq, wq)
  f = jnp.asarray(quantized_fraction, jnp.float32)
  out = (1.0 - f) * full.astype(jnp.float32) + f * quant.astype(jnp.float32)
  return out.astype(dtype)
