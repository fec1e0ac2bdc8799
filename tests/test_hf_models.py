"""stablejax on Hugging Face's Flax models (transformers 4.x), built from small configs.

GPT-2 (fused ``c_attn`` in ``Conv1D`` ``[out, in]`` storage), GPT-Neo (unscaled logits), Llama
and Mistral (grouped-query attention, RoPE) and Gemma (multi-query): routing leaf by leaf
against rules written here from each model's source, the fused kernel's update against
``optax.contrib.muon`` run on its three parts, the max logits from ``capture_intermediates``
against the attention weights the model itself returns, QK-clip bringing every head to ``tau``
on the next forward pass, and the README chain with QK-clip training each model.
"""

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import stablejax
from helpers import load_example
from hf_models import BUILDERS, SEQ, VOCAB, build

MDN = optax.contrib.MuonDimensionNumbers
FAMILIES = tuple(BUILDERS)
# The families whose training runs a path of stablejax's of its own: Mistral's probe recipe, head
# counts and parameter names are Llama's (hf_attention_probe: the same rotary_emb recipe, 2 kv
# heads of 8 dims here), so its chain trains the same way. The routing, probe and QK-clip tests
# run on every family, Mistral's own model included.
TRAINED_FAMILIES = tuple(f for f in FAMILIES if f != "mistral")


@pytest.fixture(scope="module")
def models():
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # transformers' deprecation notice of its Flax classes
    # The forward pass each init runs takes the tests' input shape (the parameters do not depend
    # on it): its eager operations are then compiled once for the init and the probe and QK-clip
    # tests' forward passes, not again for (1, 1) inputs.
    return {family: build(family, input_shape=(2, SEQ)) for family in FAMILIES}


def _flat(tree, is_leaf=None):
  return {"/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path): leaf
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]}


def _expected(family, path, d):
  """(group, dimension numbers) of each parameter, from the model's source."""
  names = path.split("/")
  if names[-1] in ("bias", "scale") or "norm" in names[-2] or names[-2].startswith("ln_"):
    return "adam", None
  if names[-2] in ("wte", "wpe", "embed_tokens"):
    return "embedding", None
  if names[0] == "lm_head":
    return "head", None
  if family == "gpt2":  # FlaxConv1D: kernel (features, in), y = x @ kernel.T
    if names[-2] == "c_attn":
      return "muon", stablejax.FusedDimensionNumbers(-1, -2, -2, 3)
    return "muon", MDN(-1, -2)
  return "muon", MDN(-2, -1)  # nn.Dense: [in, out]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_leaf_routed_as_the_model_source_says_and_no_warning(models, family):
  model = models[family]
  params = model.params
  labels = _flat(stablejax.label_params(params))
  dims = _flat(stablejax.muon_dimension_numbers(params),
               is_leaf=lambda x: x is None or isinstance(x, (MDN,
                                                             stablejax.FusedDimensionNumbers)))
  d = model.config.hidden_size
  for path, label in labels.items():
    group, want = _expected(family, path, d)
    assert label == group, (path, label)
    if group == "muon":
      assert dims[path] == want, (path, dims[path])
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    chain = optax.chain(stablejax.outlier_safe_muon(2e-3),
                        stablejax.qk_clip(100.0, config=model.config))
    chain.init(params)
  if family == "gpt2":  # describe_routing says what it did with the fused kernel
    table = stablejax.describe_routing(params)
    assert "2 fused kernels (96, 32)" in table and "orthogonalised per projection" in table
    assert "3 x 32x32" in table


def test_fused_c_attn_update_is_optax_muon_on_each_projection(models):
  params = models["gpt2"].params
  # numpy draws: a jax.random.normal per leaf shape would compile a program for each
  grads = jax.tree.map(lambda x: jnp.asarray(
      np.random.default_rng(x.size).standard_normal(x.shape), x.dtype), params)
  ours = stablejax.outlier_safe_muon(0.02, outlier_method=None, ns_backend="xla",
                                     consistent_rms=None, adam_learning_rate=1e-3)
  got = jax.jit(ours.update)(grads, ours.init(params), params)[0]
  kernel = "transformer/h/0/attn/c_attn/kernel"
  c_fc = "transformer/h/0/mlp/c_fc/kernel"
  g = np.asarray(_flat(grads)[kernel])                   # [3D, D]: rows are the outputs
  # optax on the three [out, in] parts, each a D x D matrix (square: either orientation), and
  # on the [out, in] MLP kernel c_fc [4D, D]. Muon treats each leaf on its own: one jitted
  # update of the four (eagerly, each of its operations compiles on its own).
  ref = optax.contrib.muon(0.02, consistent_rms=None, eps=1e-8,
                           muon_weight_dimension_numbers=MDN(-1, -2))
  parts = {"q": g[:32], "k": g[32:64], "v": g[64:], "w": _flat(grads)[c_fc]}
  want = jax.jit(ref.update)(parts, ref.init(parts), parts)[0]
  np.testing.assert_allclose(_flat(got)[kernel], np.concatenate([want["q"], want["k"], want["v"]]),
                             rtol=2e-4, atol=1e-7)
  # c_fc: width scaling reads fan_out / fan_in = 4, not 1/4
  np.testing.assert_allclose(_flat(got)[c_fc], want["w"], rtol=2e-4, atol=1e-7)
  # sqrt(max(1, fan_out / fan_in)) = sqrt(128 / 32) = 2 on NS singular values in [0.68, 1.13]
  singular = np.linalg.svd(np.asarray(_flat(got)[c_fc]) / 0.02, compute_uv=False)
  assert 1.3 < np.median(singular) < 2.3, singular


def _inputs(model, batch=2):
  ids = jax.random.randint(jax.random.key(3), (batch, SEQ), 0, VOCAB)
  mask = jnp.ones_like(ids)
  pos = jnp.broadcast_to(jnp.arange(SEQ), ids.shape)
  return ids, mask, pos


@pytest.mark.parametrize("family", FAMILIES)
def test_probe_max_logits_equal_the_models_own_logits(models, family):
  """The probe's per-head maximum against the pre-softmax logits recovered from the model's
  own returned attention weights: log(p) differs from the logit by each row's log-sum-exp, so
  on the diagonal (every row keeps it) logit - log p is the row constant; compared through the
  row maxima of log p plus that constant."""
  model = models[family]
  probe = stablejax.hf_attention_probe(model.config)
  ids, mask, pos = _inputs(model)
  (out, max_logits) = probe.apply(model.module, {"params": model.params}, ids, mask, pos,
                                  output_attentions=True)
  attentions = out.attentions                            # per layer [B, H, T, S] probabilities
  layers = stablejax.layout.heads.find_attention_layers(model.params, config=model.config)
  assert sorted(max_logits) == [layer.name for layer in layers] and len(layers) == 2
  # the logits themselves, from the captured q and k with the scale the model uses
  _, state = model.module.apply({"params": model.params}, ids, mask, pos,
                                capture_intermediates=True, mutable=["intermediates"])
  for i, name in enumerate(sorted(max_logits)):
    q, k = _queries_and_keys(family, state["intermediates"], name, model.config)
    h, kh = q.shape[-2], k.shape[-2]
    k = np.repeat(k, h // kh, axis=-2)
    scale = 1.0 if family == "gpt_neo" else 1.0 / math.sqrt(q.shape[-1])
    logits = np.einsum("bthd,bshd->bhts", q, k) * scale
    causal = np.tril(np.ones((SEQ, SEQ), bool))
    probs = np.exp(logits - logits.max(-1, keepdims=True), where=causal, out=np.zeros_like(logits))
    probs /= probs.sum(-1, keepdims=True)
    np.testing.assert_allclose(probs, attentions[i], atol=2e-5)  # the model's own softmax
    want = np.where(causal, logits, -np.inf).max(axis=(0, 2, 3))
    np.testing.assert_allclose(max_logits[name], want, rtol=1e-5, atol=1e-5)


def _queries_and_keys(family, inter, name, config):
  node = inter
  for part in name.split("/"):
    node = node[part]
  d, heads = config.hidden_size, config.num_attention_heads
  if family == "gpt2":
    qkv = np.asarray(node["c_attn"]["__call__"][0])
    q, k = qkv[..., :d], qkv[..., d:2 * d]
    return q.reshape(q.shape[:-1] + (heads, -1)), k.reshape(k.shape[:-1] + (heads, -1))
  if family == "gpt_neo":
    q, k = np.asarray(node["q_proj"]["__call__"][0]), np.asarray(node["k_proj"]["__call__"][0])
    return q.reshape(q.shape[:-1] + (heads, -1)), k.reshape(k.shape[:-1] + (heads, -1))
  key, query = node["rotary_emb"]["__call__"][0]
  return np.asarray(query), np.asarray(key)


@pytest.mark.parametrize("family", FAMILIES)
def test_qk_clip_brings_every_head_to_tau_on_the_next_forward_pass(models, family):
  model = models[family]
  probe = stablejax.hf_attention_probe(model.config)
  ids, mask, pos = _inputs(model)
  params = model.params

  def max_logits(params):
    return probe.apply(model.module, {"params": params}, ids, mask, pos)[1]

  before = max_logits(params)
  tau = 0.5 * min(float(v.min()) for v in before.values())
  assert tau > 0
  clip = optax.chain(optax.sgd(0.0), stablejax.qk_clip(tau, config=model.config))
  zeros = jax.tree.map(jnp.zeros_like, params)
  # One layer at a time (a clipped layer changes the input of the layers above it): every head
  # of that layer is at tau exactly on the same batch, and the layers below it are untouched.
  names = sorted(before)
  for n, name in enumerate(names):
    only = {m: before[m] if m == name else jnp.zeros_like(before[m]) for m in names}
    updates, state = clip.update(zeros, clip.init(params), params, max_logits=only)
    after = max_logits(optax.apply_updates(params, updates))
    np.testing.assert_allclose(after[name], np.minimum(before[name], tau), rtol=1e-4)
    for below in names[:n]:
      np.testing.assert_allclose(after[below], before[below], rtol=1e-6)
    assert int(state[1].heads_clipped) == before[name].size


def test_qk_clip_without_head_count_fails_at_init_with_the_fix(models):
  params = models["llama"].params
  with pytest.raises(ValueError, match="qk_clip: .*pass num_heads= .* or config="):
    stablejax.qk_clip(100.0).init(params)
  with pytest.raises(ValueError, match="num_kv_heads=4 disagrees with the config's 2"):
    stablejax.qk_clip(100.0, num_kv_heads=4, config=models["llama"].config)


@pytest.mark.slow
@pytest.mark.parametrize("family", TRAINED_FAMILIES)
def test_readme_chain_with_qk_clip_trains_30_steps(models, family):
  model = models[family]
  probe = stablejax.hf_attention_probe(model.config)
  tx = stablejax.skip_nonfinite(stablejax.skip_spikes(optax.chain(
      stablejax.hybrid_clip(),
      stablejax.outlier_safe_muon(learning_rate=0.02, adam_learning_rate=3e-3),
      stablejax.qk_clip(30.0, config=model.config),
  )), max_consecutive=16)
  params = model.params
  opt_state = tx.init(params)
  starts = jax.random.randint(jax.random.key(1), (8, 1), 0, VOCAB)
  seqs = (starts + 3 * jnp.arange(SEQ + 1)) % VOCAB         # token t+1 = token t + 3
  x, y = seqs[:, :-1], seqs[:, 1:]
  step = load_example("hf_flax_lm").make_train_step(model, probe, tx)  # the example's own step

  losses = []
  for _ in range(30):
    params, opt_state, loss = step(params, opt_state, x, y)
    losses.append(float(loss))
  assert np.all(np.isfinite(losses)) and np.mean(losses[-5:]) < 0.7 * np.mean(losses[:5]), losses
  metrics = stablejax.stability_metrics(opt_state)
  assert int(metrics["skip_nonfinite/total_skips"]) == 0
  assert int(metrics["muon/fallback_count"]) == 0
