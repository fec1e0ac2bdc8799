"""cross_entropy_with_z_loss against optax and a numpy log-sum-exp."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import stablejax


def _np_logsumexp(x):
  m = x.max(axis=-1, keepdims=True)
  return (m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True)))[..., 0]


def _data(seed=0, shape=(3, 5), vocab=11, scale=4.0):
  rng = np.random.default_rng(seed)
  logits = (rng.standard_normal(shape + (vocab,)) * scale).astype(np.float32)
  labels = rng.integers(0, vocab, shape).astype(np.int32)
  return logits, labels


@pytest.mark.parametrize("z_loss", [0.0, 1e-4, 0.1])
def test_matches_optax_and_numpy(z_loss):
  logits, labels = _data()
  loss, aux = jax.jit(stablejax.cross_entropy_with_z_loss)(logits, labels,
                                                           z_loss)
  ce_optax = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  lse = _np_logsumexp(logits.astype(np.float64))
  np.testing.assert_allclose(aux["cross_entropy"], np.mean(ce_optax),
                             rtol=1e-6)
  np.testing.assert_allclose(aux["z_loss"], z_loss * np.mean(lse**2),
                             rtol=1e-6, atol=1e-12)
  np.testing.assert_allclose(loss, np.mean(ce_optax) + z_loss * np.mean(lse**2),
                             rtol=1e-6)
  assert loss.dtype == jnp.float32 and loss.shape == ()


def test_default_weight_is_1e_4():
  logits, labels = _data(1)
  _, aux = stablejax.cross_entropy_with_z_loss(logits, labels)
  lse = _np_logsumexp(logits.astype(np.float64))
  np.testing.assert_allclose(aux["z_loss"], 1e-4 * np.mean(lse**2), rtol=1e-6)


def test_mask_excludes_positions():
  logits, labels = _data(2)
  mask = np.zeros(labels.shape, bool)
  mask[:, :3] = True
  logits_bad = logits.copy()
  logits_bad[:, 3:] = np.nan  # masked-out garbage must not leak in
  loss, aux = stablejax.cross_entropy_with_z_loss(logits_bad, labels, 1e-3,
                                                  mask=mask)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits[:, :3],
                                                       labels[:, :3])
  lse = _np_logsumexp(logits[:, :3].astype(np.float64))
  np.testing.assert_allclose(aux["cross_entropy"], np.mean(ce), rtol=1e-6)
  np.testing.assert_allclose(loss, np.mean(ce) + 1e-3 * np.mean(lse**2),
                             rtol=1e-6)
  # Float weights are a weighted mean.
  w = np.linspace(0.1, 1.0, labels.size).reshape(labels.shape)
  loss_w, _ = stablejax.cross_entropy_with_z_loss(logits, labels, 0.0, mask=w)
  ce_all = np.asarray(optax.softmax_cross_entropy_with_integer_labels(
      logits, labels), np.float64)
  np.testing.assert_allclose(loss_w, (ce_all * w).sum() / w.sum(), rtol=1e-6)


def test_bf16_logits_computed_in_float32():
  logits, labels = _data(3, scale=30.0)  # large logits: bf16 math would drift
  logits_bf16 = jnp.asarray(logits, jnp.bfloat16)
  loss, aux = stablejax.cross_entropy_with_z_loss(logits_bf16, labels, 1e-4)
  assert loss.dtype == jnp.float32
  exact = np.asarray(logits_bf16.astype(jnp.float32), np.float64)
  lse = _np_logsumexp(exact)
  ce = lse - np.take_along_axis(exact, labels[..., None], -1)[..., 0]
  np.testing.assert_allclose(aux["cross_entropy"], ce.mean(), rtol=1e-5)
  np.testing.assert_allclose(aux["z_loss"], 1e-4 * (lse**2).mean(), rtol=1e-5)


def test_gradient_of_z_loss_term():
  logits, labels = _data(4, shape=(2,), vocab=5)
  z = 0.5

  def z_only(lg):
    return stablejax.cross_entropy_with_z_loss(lg, labels, z)[1]["z_loss"]

  grad = jax.grad(z_only)(jnp.asarray(logits))
  x = logits.astype(np.float64)
  lse = _np_logsumexp(x)
  softmax = np.exp(x - lse[:, None])
  # d/dx mean(z * lse^2) = z * 2 * lse * softmax / n
  np.testing.assert_allclose(grad, z * 2 * lse[:, None] * softmax / 2,
                             rtol=1e-5)


def test_shape_errors():
  logits, labels = _data()
  with pytest.raises(ValueError, match="labels"):
    stablejax.cross_entropy_with_z_loss(logits, labels[:, :2])
  with pytest.raises(ValueError, match="mask"):
    stablejax.cross_entropy_with_z_loss(logits, labels, mask=np.ones(3))
