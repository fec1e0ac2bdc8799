"""stablejax.qk_clip against a numpy re-derivation of Kimi K2's rule on hand-built logits.

Reference rule (arXiv 2507.20534, Algorithm 1): after the update p' = p + u, every query head h
whose max logit S_h of the step is finite and above tau gets gamma = tau / S_h; with as many key
heads as query heads, the head's query and key columns (kernels and biases) are multiplied by
sqrt(gamma) each; with shared key heads (GQA/MQA), the query head by gamma and the key not at all.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import stablejax
from stablejax.layout.heads import AttentionLayer, HeadParam

TAU = 100.0


def _gamma(s):
  s = np.asarray(s, np.float64)
  over = np.isfinite(s) & (s > TAU)
  return np.where(over, TAU / np.where(over, s, 1.0), 1.0)


def _mha_params(rng, layers=2, d=8, heads=4, hd=2):
  """Stacked Dense layout: kernels [L, D, H*hd], biases [L, H*hd], heads head-major."""
  f = heads * hd
  def proj():
    return {"kernel": rng.normal(size=(layers, d, f)), "bias": rng.normal(size=(layers, f))}
  return {"attn": {"q": proj(), "k": proj(), "v": {"kernel": rng.normal(size=(layers, d, f))}},
          "embed": rng.normal(size=(5, d))}


MHA = AttentionLayer(
    name="attn", num_heads=4, num_kv_heads=4, stack_ndim=1,
    query=(HeadParam("attn/q/kernel", -1), HeadParam("attn/q/bias", -1)),
    key=(HeadParam("attn/k/kernel", -1), HeadParam("attn/k/bias", -1)))


def _as_jnp(tree):
  return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)


def _expected_mha(params, updates, logits, hd=2):
  new = jax.tree.map(lambda p, u: np.asarray(p, np.float64) + np.asarray(u, np.float64),
                     params, updates)
  g = np.sqrt(_gamma(logits))                         # [L, H]
  cols = np.repeat(g, hd, axis=-1)                    # [L, H*hd]
  for proj in ("q", "k"):
    new["attn"][proj]["kernel"] = new["attn"][proj]["kernel"] * cols[:, None, :]
    new["attn"][proj]["bias"] = new["attn"][proj]["bias"] * cols
  return new


def test_mha_matches_numpy_rule_with_biases_stacked_layers_and_non_finite_logits():
  rng = np.random.default_rng(0)
  params = _as_jnp(_mha_params(rng))
  grads = _as_jnp(jax.tree.map(lambda p: rng.normal(size=p.shape), params))
  # Hand-built per-head max logits [L=2, H=4]: above, at, below tau, inf and NaN (no clip).
  logits = jnp.array([[400.0, 100.0, 99.0, 250.0], [np.inf, np.nan, 1e4, 3.0]], jnp.float32)
  tx = optax.chain(optax.sgd(0.1), stablejax.qk_clip(tau=TAU, layers=[MHA]))
  state = tx.init(params)
  updates, state = jax.jit(tx.update)(grads, state, params, max_logits={"attn": logits})
  got = optax.apply_updates(params, updates)
  sgd = jax.tree.map(lambda g: -0.1 * g, grads)
  want = _expected_mha(params, sgd, np.asarray(logits))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), b, rtol=2e-6, atol=2e-6),
               got, want)
  # Untouched entries get exactly the inner update: v, the embedding, and unclipped heads.
  for path in (("attn", "v", "kernel"), ("embed",)):
    u, s = updates, sgd
    for k in path:
      u, s = u[k], s[k]
    np.testing.assert_array_equal(np.asarray(u), np.asarray(s))
  unclipped = np.asarray(updates["attn"]["q"]["kernel"])[1, :, 2:4]     # layer 1, head 1 (NaN)
  np.testing.assert_array_equal(unclipped, np.asarray(sgd["attn"]["q"]["kernel"])[1, :, 2:4])
  assert int(state[1].heads_clipped) == 3                 # 400, 250 and 1e4
  assert int(state[1].total_clipped) == 3
  assert np.isnan(float(state[1].max_logit)) or float(state[1].max_logit) == np.inf
  metrics = stablejax.stability_metrics(state)
  assert int(metrics["qk_clip/heads_clipped"]) == 3


def test_clipped_logit_is_tau_exactly_through_the_biases():
  # The point of scaling biases with kernels: the offending head's max logit on the same input
  # becomes tau, measured with attention_logit_max on q = x Wq + bq, k = x Wk + bk.
  rng = np.random.default_rng(1)
  d, heads, hd, t = 8, 4, 2, 6
  params = _as_jnp({"attn": {p: {"kernel": 3 * rng.normal(size=(1, d, heads * hd)),
                                 "bias": 3 * rng.normal(size=(1, heads * hd))}
                             for p in ("q", "k")}})
  x = jnp.asarray(rng.normal(size=(2, t, d)), jnp.float32)

  def max_logits(p):
    q = (x @ p["attn"]["q"]["kernel"][0] + p["attn"]["q"]["bias"][0]).reshape(2, t, heads, hd)
    k = (x @ p["attn"]["k"]["kernel"][0] + p["attn"]["k"]["bias"][0]).reshape(2, t, heads, hd)
    return stablejax.attention_logit_max(q, k, is_causal=True)

  max_logits = jax.jit(max_logits)  # called twice; eagerly each operation compiles on its own
  before = max_logits(params)
  tau = float(np.sort(np.asarray(before))[1])         # two heads above, one at, one below
  layer = AttentionLayer("attn", heads, heads, stack_ndim=1,
                         query=(HeadParam("attn/q/kernel", -1), HeadParam("attn/q/bias", -1)),
                         key=(HeadParam("attn/k/kernel", -1), HeadParam("attn/k/bias", -1)))
  tx = stablejax.qk_clip(tau=tau, layers=[layer])
  zeros = jax.tree.map(jnp.zeros_like, params)
  updates, _ = jax.jit(tx.update)(zeros, tx.init(params), params, max_logits={"attn": before[None]})
  after = np.asarray(max_logits(optax.apply_updates(params, updates)))
  before = np.asarray(before)
  np.testing.assert_allclose(after, np.minimum(before, tau), rtol=1e-5)
  assert (before > tau * 1.01).sum() >= 2


def test_grouped_query_attention_scales_query_by_gamma_and_leaves_shared_keys():
  # DenseGeneral layout [D, H, hd] (head axis -2), 4 query heads sharing 2 key heads.
  rng = np.random.default_rng(2)
  params = _as_jnp({"q": rng.normal(size=(8, 4, 2)), "k": rng.normal(size=(8, 2, 2))})
  layer = AttentionLayer("blk", num_heads=4, num_kv_heads=2,
                         query=(HeadParam("q", -2),), key=(HeadParam("k", -2),))
  logits = np.array([50.0, 400.0, 200.0, 100.5], np.float32)
  tx = stablejax.qk_clip(tau=TAU, layers=[layer])
  zeros = jax.tree.map(jnp.zeros_like, params)
  updates, state = jax.jit(tx.update)(zeros, tx.init(params), params, max_logits={"blk": logits})
  got = optax.apply_updates(params, updates)
  want_q = np.asarray(params["q"], np.float64) * _gamma(logits)[None, :, None]
  np.testing.assert_allclose(np.asarray(got["q"]), want_q, rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(got["k"]), np.asarray(params["k"]))
  assert int(state.heads_clipped) == 3


def test_fused_projection_select_scales_only_its_slice():
  # Gemma-style qkv_einsum [3, H, D, hd]: query (0, 0), key (0, 1), value (0, 2) untouched.
  rng = np.random.default_rng(3)
  params = _as_jnp({"qkv": rng.normal(size=(3, 2, 4, 2))})
  layer = AttentionLayer("att", 2, 2, query=(HeadParam("qkv", 1, select=(0, 0)),),
                         key=(HeadParam("qkv", 1, select=(0, 1)),))
  logits = np.array([400.0, 10.0], np.float32)
  tx = stablejax.qk_clip(tau=TAU, layers=[layer])
  updates, _ = jax.jit(tx.update)(jax.tree.map(jnp.zeros_like, params), tx.init(params),
                                  params, max_logits={"att": logits})
  got = np.asarray(optax.apply_updates(params, updates)["qkv"])
  want = np.asarray(params["qkv"], np.float64).copy()
  want[0:2, 0] *= np.sqrt(TAU / 400.0)
  np.testing.assert_allclose(got, want, rtol=1e-6)


def _skip_chain(inner_tx):
  return stablejax.skip_nonfinite(optax.chain(inner_tx, stablejax.qk_clip(tau=TAU, layers=[MHA])))


def test_inside_skip_nonfinite_a_skipped_step_clips_nothing():
  rng = np.random.default_rng(4)
  params = _as_jnp(_mha_params(rng))
  logits = jnp.full((2, 4), 1e3, jnp.float32)
  tx = _skip_chain(optax.adamw(1e-2))
  state = tx.init(params)
  bad = jax.tree.map(lambda p: jnp.full(p.shape, jnp.nan), params)
  updates, state = jax.jit(tx.update)(bad, state, params, loss=jnp.float32(1.0),
                                      max_logits={"attn": logits})
  assert bool(state.skipped)
  jax.tree.map(lambda u: np.testing.assert_array_equal(np.asarray(u), 0.0), updates)
  good = jax.tree.map(lambda p: jnp.ones(p.shape), params)
  updates, state = jax.jit(tx.update)(good, state, params, loss=jnp.float32(1.0),
                                      max_logits={"attn": logits})
  assert not bool(state.skipped)
  new_q = np.asarray(optax.apply_updates(params, updates)["attn"]["q"]["kernel"])
  adam_only = optax.adamw(1e-2)
  u, _ = jax.jit(adam_only.update)(good, adam_only.init(params), params)
  want = (np.asarray(params["attn"]["q"]["kernel"]) + np.asarray(u["attn"]["q"]["kernel"])) \
      * np.sqrt(TAU / 1e3)
  np.testing.assert_allclose(new_q, want, rtol=1e-5, atol=1e-6)


def test_inside_skip_spikes_and_after_outlier_safe_muon_under_jit():
  rng = np.random.default_rng(5)
  params = _as_jnp(_mha_params(rng))
  logits = jnp.asarray(rng.uniform(0, 300, size=(2, 4)), jnp.float32)
  muon = stablejax.outlier_safe_muon(learning_rate=0.02, adam_learning_rate=3e-3)
  tx = stablejax.skip_spikes(optax.chain(muon, stablejax.qk_clip(tau=TAU, layers=[MHA])),
                             window=8, min_history=4)
  grads = _as_jnp(jax.tree.map(lambda p: rng.normal(size=p.shape), params))
  updates, state = jax.jit(tx.update)(grads, tx.init(params), params, loss=jnp.float32(2.0),
                                      max_logits={"attn": logits})
  u, _ = jax.jit(muon.update)(grads, muon.init(params), params)
  want = _expected_mha(params, u, np.asarray(logits))
  got = optax.apply_updates(params, updates)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-6),
               got, want)


def test_layers_found_from_flax_mha_params_with_biases():
  # layers=None: find_attention_layers reads Linen MHA's [D, H, hd] kernels and [H, hd] biases.
  import flax.linen as nn
  mha = nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=16)
  x = jnp.ones((1, 3, 16))
  attn = jax.tree.map(lambda p: p, jax.jit(mha.init)(jax.random.key(0), x)["params"])
  for i, proj in enumerate(("query", "key")):   # Flax starts biases at zero: make them count
    attn[proj]["bias"] = jax.random.normal(jax.random.key(i + 1), attn[proj]["bias"].shape)
  params = {"embed": jnp.zeros((50, 16)), "attn": attn}
  logits = np.array([50.0, 400.0, 150.0, 90.0], np.float32)
  tx = stablejax.qk_clip(tau=TAU)
  zeros = jax.tree.map(jnp.zeros_like, params)
  updates, state = jax.jit(tx.update)(zeros, tx.init(params), params, max_logits={"attn": logits})
  got = optax.apply_updates(params, updates)["attn"]
  g = np.sqrt(_gamma(logits))
  for proj in ("query", "key"):
    np.testing.assert_allclose(got[proj]["kernel"], np.asarray(params["attn"][proj]["kernel"])
                               * g[None, :, None], rtol=1e-6)
    np.testing.assert_allclose(got[proj]["bias"], np.asarray(params["attn"][proj]["bias"])
                               * g[:, None], rtol=1e-6)
  np.testing.assert_array_equal(got["value"]["kernel"], params["attn"]["value"]["kernel"])
  assert int(state.heads_clipped) == 2
  with pytest.raises(ValueError, match="config are for layers=None"):
    stablejax.qk_clip(layers=[MHA], num_heads=4)


def test_layers_as_a_function_of_params_and_clear_errors():
  rng = np.random.default_rng(6)
  params = _as_jnp(_mha_params(rng))
  zeros = jax.tree.map(jnp.zeros_like, params)
  tx = stablejax.qk_clip(layers=lambda p: [MHA])
  updates, _ = jax.jit(tx.update)(zeros, tx.init(params), params,
                                  max_logits={"attn": jnp.full((2, 4), 400.0)})
  assert float(jnp.abs(updates["attn"]["q"]["kernel"]).max()) > 0
  with pytest.raises(ValueError, match="max_logits"):
    tx.update(zeros, tx.init(params), params)
  with pytest.raises(ValueError, match="no entry for attention layer 'attn'"):
    tx.update(zeros, tx.init(params), params, max_logits={"other": jnp.zeros((2, 4))})
  with pytest.raises(ValueError, match="expected 1 stacked axes and 4 heads"):
    tx.update(zeros, tx.init(params), params, max_logits={"attn": jnp.zeros((4,))})
  with pytest.raises(ValueError, match="needs params"):
    tx.update(zeros, tx.init(params), None, max_logits={"attn": jnp.zeros((2, 4))})
  wrong = AttentionLayer("attn", 4, 4, stack_ndim=1, query=(HeadParam("attn/nope", -1),),
                         key=(HeadParam("attn/k/kernel", -1),))
  with pytest.raises(ValueError, match="not a parameter"):
    stablejax.qk_clip(layers=[wrong]).update(zeros, None, params,
                                             max_logits={"attn": jnp.zeros((2, 4))})
  with pytest.raises(ValueError, match="tau"):
    stablejax.qk_clip(tau=0.0)
  with pytest.raises(ValueError, match="layers"):
    stablejax.qk_clip(layers="attn")


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_gemma_style_einsum_model_heads_clip_to_tau(kv_heads):
  # A model written the way Flax's examples/gemma writes attention (NNX, fused qkv_einsum
  # [3, H, D, hd], or q_einsum with a fused kv_einsum [2, K, D, hd] for GQA/MQA), layers found
  # by find_attention_layers through the NNX state: after clipping with each head's measured
  # max logit, every head above tau has max logit tau on the same input, the others keep theirs.
  from flax import nnx
  from flax_models import EinsumLM

  model = EinsumLM(kv_heads=kv_heads, head_dim=8, rngs=nnx.Rngs(0))
  attn = model.layers[0].attn
  x = jax.random.normal(jax.random.key(1), (2, 6, 32)) * 4

  def max_logits():
    if kv_heads == 4:
      q, k, _ = attn.qkv_einsum(x)
    else:
      q = attn.q_einsum(x)
      k, _ = attn.kv_einsum(x)
    return stablejax.attention_logit_max(q, k, is_causal=True)

  before = np.asarray(max_logits())
  tau = float(np.median(before)) if kv_heads > 1 else float(before.min()) * 0.999
  params = nnx.as_pure(nnx.state(model, nnx.Param))
  tx = stablejax.qk_clip(tau=tau)
  logits = {"layers/0/attn": jnp.asarray(before), "layers/1/attn": jnp.zeros(4)}
  updates, state = jax.jit(tx.update)(jax.tree.map(jnp.zeros_like, params), tx.init(params),
                                      params, max_logits=logits)
  nnx.update(model, optax.apply_updates(params, updates))
  after = np.asarray(max_logits())
  np.testing.assert_allclose(after, np.minimum(before, tau), rtol=1e-5)
  assert int(state.heads_clipped) == int((before > tau).sum()) >= 1


def test_state_counts_heads_per_step_and_since_init():
  # QKClipState: heads_clipped is the last step's count of rescaled heads (a head of a stacked
  # layer counts once per layer), total_clipped the sum since init, max_logit the step's largest.
  params = jax.tree.map(jnp.asarray, _mha_params(np.random.default_rng(0)))
  tx = stablejax.qk_clip(tau=TAU, layers=[MHA])
  state = tx.init(params)
  zeros = jax.tree.map(jnp.zeros_like, params)
  steps = [np.array([[150.0, 50.0, 120.0, 10.0], [90.0, 300.0, 20.0, 30.0]]),   # 3 heads over
           np.array([[10.0, 20.0, 30.0, 40.0], [50.0, 60.0, 70.0, 101.0]]),    # 1 head over
           np.array([[10.0, 20.0, 30.0, 40.0], [50.0, 60.0, 70.0, 80.0]])]     # none
  totals = []
  for logits in steps:
    _, state = tx.update(zeros, state, params, max_logits={"attn": jnp.asarray(logits)})
    totals.append((int(state.heads_clipped), int(state.total_clipped), float(state.max_logit)))
  assert totals == [(3, 3, 300.0), (1, 4, 101.0), (0, 4, 80.0)]


def _np_head_max(x, wq, wk, heads, kv_heads, hd):
  """max over positions of q.k / sqrt(hd) per query head; query head h uses key head h // G."""
  q = (x @ wq).reshape(len(x), heads, hd)
  k = (x @ wk).reshape(len(x), kv_heads, hd)
  k = np.repeat(k, heads // kv_heads, axis=1)
  return np.einsum("thd,shd->hts", q, k).max(axis=(1, 2)) / np.sqrt(hd)


def test_shared_key_head_whose_query_heads_all_exceed_tau_keeps_its_weights():
  """By hand: 4 query heads share 2 key heads; heads 0 and 1 (both on key head 0) exceed tau.
  The shared key head 0 is not scaled; query head 0 by tau/S_0 and head 1 by tau/S_1, so both
  end at tau exactly on the same batch, and heads 2 and 3 (below tau) keep their logits."""
  rng = np.random.default_rng(7)
  d, hd = 8, 4
  x = rng.normal(size=(6, d))
  wq = rng.normal(size=(d, 4 * hd))
  wk = rng.normal(size=(d, 2 * hd))
  wq[:, :2 * hd] *= 40.0                                   # heads 0 and 1 run away
  before = _np_head_max(x, wq, wk, 4, 2, hd)
  tau = float(before[2:].max()) * 1.5
  assert (before[:2] > tau).all() and (before[2:] < tau).all()
  params = {"embed": jnp.zeros((50, d)),
            "attn": {"q_proj": {"kernel": jnp.asarray(wq, jnp.float32)},
                     "k_proj": {"kernel": jnp.asarray(wk, jnp.float32)},
                     "v_proj": {"kernel": jnp.zeros((d, 2 * hd))},
                     "o_proj": {"kernel": jnp.zeros((4 * hd, d))}}}
  tx = stablejax.qk_clip(tau, num_heads=4, num_kv_heads=2)
  zeros = jax.tree.map(jnp.zeros_like, params)
  updates, state = jax.jit(tx.update)(zeros, tx.init(params), params,
                                      max_logits={"attn": jnp.asarray(before, jnp.float32)})
  got = optax.apply_updates(params, updates)["attn"]
  np.testing.assert_array_equal(got["k_proj"]["kernel"], params["attn"]["k_proj"]["kernel"])
  want_q = wq.copy()
  for h in (0, 1):
    want_q[:, h * hd:(h + 1) * hd] *= tau / before[h]
  np.testing.assert_allclose(got["q_proj"]["kernel"], want_q, rtol=1e-5)
  after = _np_head_max(x, np.asarray(got["q_proj"]["kernel"], np.float64), wk, 4, 2, hd)
  np.testing.assert_allclose(after, np.minimum(before, tau), rtol=1e-5)
  assert int(state.heads_clipped) == 2


def test_fused_2d_qkv_kernel_scales_only_the_query_and_key_spans():
  """GPT-2's fused c_attn, in either storage ([D, 3D] or Conv1D's [3D, D]) with its bias: the
  query and key columns of a clipped head are scaled by sqrt(gamma), the value part never."""
  rng = np.random.default_rng(3)
  d, heads, hd = 8, 2, 4
  logits = np.array([400.0, 20.0], np.float32)
  g = np.sqrt(_gamma(logits))                              # head 0: 0.5, head 1: 1
  per_feature = np.repeat(g, hd)                           # [D]: head-major
  want_cols = np.concatenate([per_feature, per_feature, np.ones(d)])   # q | k | v
  for out_in in (False, True):
    kernel = rng.normal(size=(3 * d, d) if out_in else (d, 3 * d))
    bias = rng.normal(size=(3 * d,))
    params = {"wte": {"embedding": jnp.zeros((50, d))},
              "h": {"0": {"attn": {"c_attn": {"kernel": jnp.asarray(kernel, jnp.float32),
                                              "bias": jnp.asarray(bias, jnp.float32)},
                                   "c_proj": {"kernel": jnp.zeros((d, d))}},
                          "mlp": {"c_fc": {"kernel": jnp.zeros((4 * d, d) if out_in
                                                               else (d, 4 * d))}}}}}
    tx = stablejax.qk_clip(TAU, num_heads=heads)
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = jax.jit(tx.update)(zeros, tx.init(params), params,
                                    max_logits={"h/0/attn": jnp.asarray(logits)})
    got = optax.apply_updates(params, updates)["h"]["0"]["attn"]["c_attn"]
    want = kernel * (want_cols[:, None] if out_in else want_cols[None, :])
    np.testing.assert_allclose(got["kernel"], want, rtol=1e-6, err_msg=f"out_in={out_in}")
    np.testing.assert_allclose(got["bias"], bias * want_cols, rtol=1e-6)


def test_layers_are_checked_at_init_with_the_fix_in_one_line():
  shapes = {"q_proj": (8, 8), "k_proj": (8, 4), "v_proj": (8, 4), "o_proj": (8, 8)}
  params = {"embed": jnp.zeros((50, 8)),
            "attn": {name: {"kernel": jnp.zeros(shape)} for name, shape in shapes.items()}}
  tx = stablejax.qk_clip(TAU)
  with pytest.raises(ValueError, match="^qk_clip: .*pass num_heads= .* or config=") as e:
    tx.init(params)
  assert "\n" not in str(e.value)
  with pytest.raises(ValueError, match="num_kv_heads=1"):
    stablejax.qk_clip(TAU, num_heads=4, num_kv_heads=1).init(params)
  layer = AttentionLayer("attn", 2, 2, (HeadParam("attn/q_proj/kernel", -1),),
                         (HeadParam("attn/k_proj/nothing", -1),))
  with pytest.raises(ValueError, match="names 'attn/k_proj/nothing', which is not a parameter"):
    stablejax.qk_clip(TAU, layers=[layer]).init(params)
  layer = AttentionLayer("attn", 3, 3, (HeadParam("attn/q_proj/kernel", -1),),
                         (HeadParam("attn/k_proj/kernel", -1),))
  with pytest.raises(ValueError, match="neither 3 heads nor a multiple"):
    stablejax.qk_clip(TAU, layers=[layer]).init(params)
  config = {"num_attention_heads": 2, "num_key_value_heads": 1}
  tx = stablejax.qk_clip(TAU, config=config)
  tx.init(params)   # the config gives the head counts
