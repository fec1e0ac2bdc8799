"""Parameter routing (label_params, describe_routing) and the learning-rate sanity check."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

import stablejax


class _Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm(name="ln_1")(x)
    h = nn.Dense(16, name="attn_qkv")(h)
    h = nn.Dense(8, name="attn_out", use_bias=False)(h)
    return x + nn.RMSNorm(name="rms")(h)


class _Tiny(nn.Module):
  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(32, 8, name="tok_embed")(tokens)
    x = x + self.param("pos_embedding", nn.initializers.zeros, (4, 8))
    x = _Block(name="block_0")(x)
    x = nn.Dense(8, name="emb_proj_out")(x)
    gate = self.param("gate", nn.initializers.ones, ())
    return nn.Dense(32, name="lm_head")(x * gate)


def _flax_params():
  return _Tiny().init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))


def test_default_rule_on_flax_model():
  labels = stablejax.label_params(_flax_params())
  p = labels["params"]
  assert p["tok_embed"]["embedding"] == "embedding"
  assert p["pos_embedding"] == "embedding"
  assert p["lm_head"]["kernel"] == "head" and p["lm_head"]["bias"] == "head"
  assert p["block_0"]["ln_1"]["scale"] == "adam" and p["block_0"]["ln_1"]["bias"] == "adam"
  assert p["block_0"]["rms"]["scale"] == "adam"
  assert p["block_0"]["attn_qkv"]["kernel"] == "muon"
  assert p["block_0"]["attn_qkv"]["bias"] == "adam"
  assert p["block_0"]["attn_out"]["kernel"] == "muon"
  assert p["emb_proj_out"]["kernel"] == "muon"  # "emb" but not "embed": a hidden projection
  assert p["gate"] == "adam"  # scalar


def test_rules_by_path_and_shape():
  params = {
      "embed_norm": {"weight": jnp.ones(4)},  # rule 1 beats rule 3
      "norm_w": jnp.ones((4, 4)),  # "norm" in the path: AdamW even though it is a matrix
      "value_head": {"kernel": jnp.ones((4, 1))},  # owner ends in "head"
      "stacked_mlp": {"kernel": jnp.ones((3, 4, 8))},  # scan-stacked layers: Muon
      "conv": {"kernel": jnp.ones((3, 3, 4, 8))},
      "vec": jnp.ones(4),
      "embed": {"emb_proj": jnp.ones((4, 4))},  # "emb_proj" excludes the embedding rule
  }
  labels = stablejax.label_params(params)
  assert labels == {
      "embed_norm": {"weight": "embedding"},
      "norm_w": "adam",
      "value_head": {"kernel": "head"},
      "stacked_mlp": {"kernel": "muon"},
      "conv": {"kernel": "muon"},
      "vec": "adam",
      "embed": {"emb_proj": "muon"},
  }


def test_works_with_shape_dtype_structs_and_lists():
  params = jax.eval_shape(lambda: {"layers": [{"kernel": jnp.ones((4, 4))}, {"bias": jnp.ones(4)}]})
  assert stablejax.label_params(params) == {"layers": [{"kernel": "muon"}, {"bias": "adam"}]}


def test_describe_routing_table_with_transform():
  params = _flax_params()
  tx = stablejax.outlier_safe_muon(optax.linear_schedule(0.0, 2e-2, 100), adam_learning_rate=1e-3,
                                   embedding_learning_rate=3e-3, head_learning_rate=5e-4)
  table = stablejax.describe_routing(params, tx)
  lines = table.splitlines()
  assert lines[0].split() == ["path", "shape", "group", "learning", "rate"]
  row = next(l for l in lines if l.startswith("params/tok_embed/embedding"))
  assert row.split()[1:4] == ["(32,", "8)", "embedding"] and row.rstrip().endswith("0.003")
  row = next(l for l in lines if l.startswith("params/lm_head/kernel"))
  assert "head" in row.split() and row.rstrip().endswith("0.0005")
  row = next(l for l in lines if l.startswith("params/block_0/attn_qkv/kernel"))
  assert "muon" in row.split() and "schedule (start 0, peak 0.02)" in row
  # Summary: tensor and parameter counts per group.
  n_leaves = len(jax.tree.leaves(params))
  summary = {l.split(":")[0]: l for l in lines if l.split(":")[0] in stablejax.muon.routing.GROUPS}
  assert sum(int(v.split(": ")[1].split()[0]) for v in summary.values()) == n_leaves
  assert "muon: 3 tensors" in summary["muon"]


def test_describe_routing_with_labels_or_callable_or_default():
  params = {"w": jnp.ones((4, 4)), "b": jnp.ones(4)}
  default = stablejax.describe_routing(params)
  assert "muon" in default and "adam" in default and "  -" in default
  custom = stablejax.describe_routing(params, {"w": "head", "b": "adam"})
  assert any(l.startswith("w ") and "head" in l for l in custom.splitlines())
  fn = stablejax.describe_routing(params, lambda p: jax.tree.map(lambda _: "adam", p))
  assert "muon" not in fn
  with pytest.raises(ValueError, match="not built by outlier_safe_muon"):
    stablejax.describe_routing(params, optax.adam(1e-3))
  with pytest.raises(ValueError, match="same tree structure"):
    stablejax.describe_routing(params, {"w": "muon"})


def test_param_labels_override_routes_updates():
  params = {"w": jnp.ones((8, 8)), "u": jnp.ones((8, 8))}
  tx = stablejax.outlier_safe_muon(0.02, adam_learning_rate=1e-3,
                                   param_labels={"w": "muon", "u": "adam"})
  grads = {"w": jnp.eye(8), "u": jnp.eye(8)}
  updates, _ = tx.update(grads, tx.init(params), params)
  # AdamW's first step is -lr * sign(g); Muon's is an orthogonal matrix scaled 0.2 * sqrt(8).
  assert jnp.allclose(updates["u"], -1e-3 * jnp.eye(8), atol=1e-7)
  assert jnp.allclose(updates["w"] @ updates["w"].T, (0.02 * 0.2 * 8**0.5) ** 2 * jnp.eye(8),
                      rtol=0.3, atol=1e-6)


def test_check_learning_rates_rules():
  assert stablejax.check_learning_rates(muon_lr=2e-2, adam_lr=1e-3) == []
  assert stablejax.check_learning_rates("adamw", 3e-4) == []
  swapped = stablejax.check_learning_rates(muon_lr=3e-4, adam_lr=2e-2)
  assert len(swapped) == 1 and "swapped" in swapped[0]
  assert "muon_lr=0.02" in swapped[0] and "adam_lr=0.0003" in swapped[0]
  low = stablejax.check_learning_rates("muon", 5e-4)
  assert len(low) == 1 and "Muon learning rate 0.0005 is below 0.001" in low[0]
  high = stablejax.check_learning_rates(adam_lr=0.02)
  assert len(high) == 1 and "AdamW learning rate 0.02 is above 0.003" in high[0]
  # Schedules are judged by their peak: warmup from 0 is fine.
  assert stablejax.check_learning_rates(
      muon_lr=optax.warmup_cosine_decay_schedule(0.0, 0.02, 100, 1000),
      adam_lr=optax.warmup_cosine_decay_schedule(0.0, 1e-3, 100, 1000)) == []
  assert stablejax.check_learning_rates(
      adam_lr=optax.warmup_cosine_decay_schedule(0.0, 0.01, 100, 1000))
  bad = stablejax.check_learning_rates(muon_lr=float("nan"), head_lr=-1.0)
  assert len(bad) == 2 and all("not a positive finite number" in b for b in bad)
  # Embedding rates above 3e-3 are common on purpose and are not flagged.
  assert stablejax.check_learning_rates(muon_lr=0.02, adam_lr=1e-3, embedding_lr=0.3) == []
  with pytest.raises(ValueError, match="unknown optimizer"):
    stablejax.check_learning_rates("lion", 1e-4)


def test_check_learning_rates_warn_option():
  with pytest.warns(UserWarning, match="looks like an AdamW rate"):
    stablejax.check_learning_rates(muon_lr=1e-4, warn=True)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert stablejax.check_learning_rates(muon_lr=0.02, warn=True) == []
