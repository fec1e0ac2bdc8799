"""Update clipping against independent references: optax's own block-RMS clip, a numpy
re-derivation of the per-layer RMS rule and of clipping "before the learning rate", and the
float64 ZClip reference of test_zclip on the update norm."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import stablejax
from helpers import scan_updates
from test_zclip import _grads_with_norms, reference_zclip


def _random_tree(rng, steps, scale):
  """Updates whose tensors have RMS values on both sides of 1."""
  return {"blocks": {"w": (rng.standard_normal((steps, 3, 4, 5)) * scale[:, None, None, None]
                           * np.array([0.3, 1.0, 4.0])[None, :, None, None]).astype(np.float32)},
          "head": (rng.standard_normal((steps, 6, 2)) * scale[:, None, None]).astype(np.float32),
          "bias": (rng.standard_normal((steps, 7)) * 0.1).astype(np.float32)}


def reference_rms_clip(u: np.ndarray, max_rms: float, rate: float, per_layer: bool) -> np.ndarray:
  """Adafactor's clip of ``u / rate`` (float64), per layer slice of a stacked leaf, times rate."""
  d = u.astype(np.float64) / rate if rate > 0 else np.zeros_like(u, np.float64)
  axes = tuple(range(1, u.ndim)) if per_layer else None
  rms = np.sqrt(np.mean(d ** 2, axis=axes, keepdims=per_layer))
  return (d / np.maximum(1.0, rms / max_rms)) * rate if rate > 0 else u.astype(np.float64)


def test_without_layer_slices_it_is_optax_clip_by_block_rms():
  rng = np.random.default_rng(0)
  updates = jax.tree.map(lambda x: x[0], _random_tree(rng, 1, np.array([2.0])))
  ours, _ = stablejax.clip_update_rms(1.0, stacked_names=()).update(
      updates, stablejax.clip_update_rms(1.0).init(updates))
  theirs, _ = optax.clip_by_block_rms(1.0).update(updates, optax.EmptyState())
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), ours, theirs)


def test_rms_clip_per_layer_slice_and_before_a_schedule_matches_numpy():
  steps = 12
  rng = np.random.default_rng(1)
  grads = _random_tree(rng, steps, np.linspace(0.5, 3.0, steps))
  schedule = optax.linear_schedule(0.0, 0.2, 5)  # 0 at the first update: nothing to clip
  tx = stablejax.clip_update_rms(0.8, learning_rate=schedule)
  # The incoming updates carry the schedule already, as after optax.adamw(schedule).
  carried = {k: jax.tree.map(lambda x: x * np.array([float(schedule(t)) for t in range(steps)])
                             .reshape((steps,) + (1,) * (x.ndim - 1)).astype(np.float32), v)
             for k, v in grads.items()}
  updates, states = scan_updates(tx, carried)
  for t in range(steps):
    rate = float(schedule(t))
    np.testing.assert_allclose(updates["blocks"]["w"][t],
                               reference_rms_clip(carried["blocks"]["w"][t], 0.8, rate, True),
                               rtol=2e-5, atol=1e-7)
    np.testing.assert_allclose(updates["head"][t],
                               reference_rms_clip(carried["head"][t], 0.8, rate, False),
                               rtol=2e-5, atol=1e-7)
  assert not states.was_clipped[0] and states.was_clipped[1:].all()  # rate 0, then scales > 0.8
  np.testing.assert_array_equal(updates["bias"], carried["bias"])  # RMS 0.1 before the rate
  np.testing.assert_array_equal(states.count, np.arange(1, steps + 1))


def test_clipping_after_the_rate_with_learning_rate_is_clipping_before_it():
  # optax.adam(schedule) + clip_update_rms(learning_rate=schedule) against the Adafactor/Levanter
  # chain scale_by_adam -> clip -> scale_by_learning_rate(schedule): the same updates.
  schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 3, 20)
  before = optax.chain(optax.scale_by_adam(b2=0.999), stablejax.clip_update_rms(0.5),
                       optax.scale_by_learning_rate(schedule))
  after = optax.chain(optax.adam(schedule, b2=0.999),
                      stablejax.clip_update_rms(0.5, learning_rate=schedule))
  rng = np.random.default_rng(2)
  grads = {"w": (rng.standard_normal((20, 8, 3)) * np.geomspace(1, 100, 20)[:, None, None])
           .astype(np.float32)}
  u_before, s_before = scan_updates(before, grads)
  u_after, s_after = scan_updates(after, grads)
  np.testing.assert_allclose(u_after["w"], u_before["w"], rtol=1e-5, atol=1e-9)
  # The same clips, but for the first update: at rate 0 there is nothing to clip after it.
  assert s_before[1].clip_count[-1] - 1 == s_after[1].clip_count[-1] >= 3


def test_per_parameter_rates_divide_each_parameter_by_its_own():
  rates = {"a": 0.5, "b": optax.constant_schedule(2.0)}
  tx = stablejax.clip_update_rms(1.0, learning_rates=lambda updates: rates)
  updates = {"a": jnp.full(4, 1.0), "b": jnp.full(4, 1.0)}  # before the rate: RMS 2 and 0.5
  clipped, state = tx.update(updates, tx.init(updates))
  np.testing.assert_allclose(clipped["a"], 0.5)  # clipped to RMS 1 before the rate, times 0.5
  np.testing.assert_allclose(clipped["b"], 1.0)
  assert float(state.max_rms) == 2.0 and float(state.clipped_fraction) == 0.5


def reference_change_zclip(norms, alpha, z_thresh, warmup, eps=1e-6):
  """ZClip on r = log(norm / last applied norm), float64: per-step scales and spike flags."""
  mean = var = 0.0
  n, last, out = 0, None, []
  for g in norms:
    if not (np.isfinite(g) and g > 0):
      out.append((1.0, False))
      continue
    if last is None:
      last = g
      out.append((1.0, False))
      continue
    r = np.log(g) - np.log(last)
    if n < warmup:
      n += 1
      d = r - mean
      mean += d / n
      var += (d * (r - mean) - var) / n
      last = g
      out.append((1.0, False))
      continue
    std = np.sqrt(var)
    z = (r - mean) / (std + eps)
    spike = z > z_thresh
    rc = mean + z_thresh * std if spike else r
    mean = alpha * mean + (1 - alpha) * rc
    var = alpha * var + (1 - alpha) * (rc - mean) ** 2
    n += 1
    last = g * np.exp(rc - r)
    out.append((np.exp(rc - r), spike))
  return out


def test_update_norm_zclip_matches_numpy_on_the_norm_before_the_rate():
  rng = np.random.default_rng(3)
  steps = 200
  # Adam's shape: a fall over the first steps, noise, a 2.5x jump that lasts, a NaN.
  norms = 3.0 * np.exp(-np.arange(steps) / 15.0) + 1.0
  norms *= np.exp(0.03 * rng.standard_normal(steps))
  norms[50:] *= 2.5
  norms[90] = np.nan
  norms[91] = 0.0  # a skipped step
  grads = _grads_with_norms(np.nan_to_num(norms), 3)
  grads["a"][90] = np.nan
  rate = 0.01  # the updates arrive multiplied by it
  carried = jax.tree.map(lambda x: x * rate, grads)
  tx = stablejax.zclip_update_norm(alpha=0.97, z_thresh=2.5, warmup_steps=25, learning_rate=rate)
  updates, states = scan_updates(tx, carried)
  ref = reference_change_zclip(norms, 0.97, 2.5, 25)
  scales = np.array([r[0] for r in ref])
  spikes = np.array([r[1] for r in ref])
  np.testing.assert_array_equal(states.is_spike, spikes)
  assert 5 <= spikes[50:70].sum() and spikes[:50].sum() + spikes[70:].sum() <= 3  # the jump...
  assert np.exp(np.mean(np.log(scales[80:120]))) > 0.95  # ...let in within some 20 steps
  ok = np.isfinite(norms)
  np.testing.assert_allclose(updates["b"][ok], (carried["b"] * scales[:, None])[ok], rtol=1e-4)
  np.testing.assert_allclose(states.clipped_update_norm[ok], (norms * scales)[ok], rtol=1e-4)
  np.testing.assert_array_equal(states.count, np.arange(1, steps + 1))
  # The ZClip level rule on the same norms misses the jump: its warmup took Adam's fall for
  # variance.
  plain = norms.copy()
  plain[90:92] = norms[89]
  level = reference_zclip(plain, 0.97, 2.5, None, 1e-6, 25, "zscore", "adaptive_scaling", 1.0,
                          False)
  assert sum(r[3] for r in level[50:70]) <= 2


def test_a_non_finite_update_passes_unclipped_and_stays_out_of_the_statistics():
  tx = stablejax.zclip_update_norm(warmup_steps=2)
  u = {"w": jnp.ones(3)}
  state = tx.init(u)
  for _ in range(3):
    _, state = tx.update(u, state)
  bad, after = tx.update({"w": jnp.array([jnp.nan, 1.0, 1.0])}, state)
  assert np.isnan(bad["w"][0]) and float(bad["w"][1]) == 1.0
  assert after.ema_mean == state.ema_mean and after.stats_count == state.stats_count
  rms = stablejax.clip_update_rms(1.0)
  out, s = rms.update({"w": jnp.array([jnp.inf, 5.0])}, rms.init(u))
  assert float(out["w"][1]) == 5.0 and not bool(s.was_clipped)


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_rms=0.0), "max_rms"),
    (dict(learning_rate=0.1, learning_rates={"w": 0.1}), "both set"),
    (dict(learning_rate=-1.0), "learning_rate"),
])
def test_bad_arguments_are_one_line_errors(kwargs, match):
  with pytest.raises(ValueError, match=match):
    stablejax.clip_update_rms(**kwargs)


def test_the_trainer_divides_by_the_rate_of_each_parameter_group():
  from stablejax.muon.labels import label_params
  from stablejax.training.config import load_config
  from stablejax.training.optim import learning_rates, lr_schedule, parameter_learning_rates
  cfg = load_config(None, ["train.steps=50", "train.warmup_steps=5",
                           "optimizer.embedding_learning_rate=0.002",
                           "optimizer.head_learning_rate=0.004"])
  params = {"blocks": {"attn": {"q_proj": {"kernel": jnp.zeros((2, 8, 8))}},
                       "attn_norm": {"scale": jnp.zeros((2, 8))}},
            "tok_embed": {"embedding": jnp.zeros((16, 8))},
            "lm_head": {"kernel": jnp.zeros((8, 16))}}
  got = parameter_learning_rates(cfg)(params)
  peaks = learning_rates(cfg)
  labels = label_params(params)
  assert sorted(set(jax.tree.leaves(labels))) == ["adam", "embedding", "head", "muon"]
  for rate, label in zip(jax.tree.leaves(got), jax.tree.leaves(labels)):
    for count in (0, 3, 30):
      assert float(rate(count)) == pytest.approx(float(lr_schedule(cfg, peaks[label])(count)))


def test_the_trainer_chain_clips_the_update_before_its_learning_rate():
  from stablejax.training.config import load_config
  from stablejax.training.optim import build_optimizer
  cfg = load_config(None, ["optimizer.name=adamw", "optimizer.learning_rate=0.003",
                           "train.steps=20", "train.warmup_steps=2",
                           "stability.clip_update_rms.enabled=true",
                           "stability.clip_update_rms.max_rms=0.5"])
  tx = build_optimizer(cfg)
  params = {"w": jnp.ones((4, 4))}
  state = tx.init(params)
  grads = {"w": jnp.full((4, 4), 0.1)}  # constant: Adam's direction is 1 in every entry
  for _ in range(3):
    updates, state = tx.update(grads, state, params, loss=jnp.float32(2.0))
  metrics = stablejax.stability_metrics(state)
  assert float(metrics["update_rms_clip/max_rms"]) == pytest.approx(1.0, rel=1e-3)
  # clipped to RMS 0.5 before the rate: half of AdamW's step at the third update's rate
  rate = float(optax.warmup_cosine_decay_schedule(0.0, 0.003, 2, 20, 0.0003)(2))
  np.testing.assert_allclose(updates["w"], -0.5 * rate, rtol=1e-3)
