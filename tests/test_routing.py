"""Parameter routing (label_params, describe_routing) and the learning-rate sanity check."""

import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import stablejax


class _Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm(name="ln_1")(x)
    q, k, v = jnp.split(nn.Dense(24, name="attn_qkv")(h), 3, axis=-1)  # a fused projection
    h = nn.Dense(8, name="attn_out", use_bias=False)(v * jnp.tanh(q * k))
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


def _normal(shape, seed=0):
  # numpy draws: jax.random.normal compiles a program for each new shape
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


def _zeros(abstract):
  """Numpy zeros in place of each ``jax.ShapeDtypeStruct`` of a tree (modules kept)."""
  return jax.tree.map(lambda s: np.zeros(s.shape, s.dtype)
                      if isinstance(s, jax.ShapeDtypeStruct) else s, abstract)


def _flax_params():
  # Zeros of the traced shapes: the routing reads shapes and names, and running the init would
  # compile it (eagerly, each initialiser on its own).
  return _zeros(jax.eval_shape(_Tiny().init, jax.random.key(0),
                               jax.ShapeDtypeStruct((1, 4), jnp.int32)))


def test_default_rule_on_flax_model():
  labels = stablejax.label_params(_flax_params())
  p = labels["params"]
  assert p["tok_embed"]["embedding"] == "embedding"
  assert p["pos_embedding"] == "embedding"
  assert p["lm_head"]["kernel"] == "head"
  assert p["lm_head"]["bias"] == "adam"  # a bias: never decayed, whatever module it is in
  assert p["block_0"]["ln_1"]["scale"] == "adam" and p["block_0"]["ln_1"]["bias"] == "adam"
  assert p["block_0"]["rms"]["scale"] == "adam"
  assert p["block_0"]["attn_qkv"]["kernel"] == "muon"
  assert p["block_0"]["attn_qkv"]["bias"] == "adam"
  assert p["block_0"]["attn_out"]["kernel"] == "muon"
  assert p["emb_proj_out"]["kernel"] == "muon"  # "emb" but not "embed": a hidden projection
  assert p["gate"] == "adam"  # scalar


def test_rules_by_path_and_shape():
  params = {
      "embed_norm": {"weight": jnp.ones(4)},  # a norm gain: "adam" beats "embedding"
      "norm_w": jnp.ones((4, 4)),  # "norm" in the path: AdamW even though it is a matrix
      "value_head": {"kernel": jnp.ones((4, 1))},  # owner ends in "head"
      "conv": {"kernel": jnp.ones((3, 3, 4, 8))},
      "vec": jnp.ones(4),
      "embed": {"emb_proj": jnp.ones((4, 4))},  # "emb_proj" excludes the embedding rule
      "ln_f": {"weight": jnp.ones(4)},
      "wte": jnp.ones((10, 4)),
      "unembed": jnp.ones((4, 10)),  # a head name, though it contains "embed"
  }
  labels = stablejax.label_params(params)
  assert labels == {
      "embed_norm": {"weight": "adam"},
      "norm_w": "adam",
      "value_head": {"kernel": "head"},
      "conv": {"kernel": "muon"},
      "vec": "adam",
      "embed": {"emb_proj": "muon"},
      "ln_f": {"weight": "adam"},
      "wte": "embedding",
      "unembed": "head",
  }


def test_scan_stacked_subtree_keeps_roles():
  # nn.scan stacks every parameter of a block on a leading layer axis: [L, D] gains are still
  # gains (even named "weight" under "ln_1", which no name rule catches), [L, in, out] kernels
  # are L matrices. Without the stack, the same [3, 8] leaf is a matrix.
  stack = {"ln_1": {"weight": jnp.ones((3, 8))}, "mlp": {"kernel": jnp.ones((3, 8, 16)),
                                                          "b": jnp.ones((3, 16))},
           "gain": jnp.ones(3)}
  labels = stablejax.label_params({"blocks": stack, "proj": {"w": jnp.ones((3, 8))},
                                   "wte": jnp.ones((10, 8))})
  assert labels == {"blocks": {"ln_1": {"weight": "adam"}, "mlp": {"kernel": "muon", "b": "adam"},
                               "gain": "adam"},
                    "proj": {"w": "muon"}, "wte": "embedding"}


def test_works_with_shape_dtype_structs_and_lists():
  params = jax.eval_shape(lambda: {"layers": [{"kernel": jnp.ones((4, 4))}, {"bias": jnp.ones(4)}]})
  assert stablejax.label_params(params) == {"layers": [{"kernel": "muon"}, {"bias": "adam"}]}


def test_describe_routing_table_with_transform():
  params = _flax_params()
  tx = stablejax.outlier_safe_muon(optax.linear_schedule(0.0, 2e-2, 100), adam_learning_rate=1e-3,
                                   embedding_learning_rate=3e-3, head_learning_rate=5e-4)
  table = stablejax.describe_routing(params, tx)
  lines = table.splitlines()
  assert re.split(r"\s{2,}", lines[0]) == ["path", "shape", "group", "muon matrix", "matrix from",
                                           "learning rate"]
  row = next(line for line in lines if line.startswith("params/tok_embed/embedding"))
  assert row.split()[1:4] == ["(32,", "8)", "embedding"] and row.rstrip().endswith("0.003")
  row = next(line for line in lines if line.startswith("params/lm_head/kernel"))
  assert "head" in row.split() and row.rstrip().endswith("0.0005")
  row = next(line for line in lines if line.startswith("params/block_0/attn_qkv/kernel"))
  assert re.split(r"\s{2,}", row)[2:5] == ["muon", "3 x 8x8", "names and shapes"]
  assert "schedule (start 0, peak 0.02)" in row
  # Summary: tensor and parameter counts per group.
  n_leaves = len(jax.tree.leaves(params))
  groups = stablejax.muon.labels.GROUPS
  summary = {line.split(":")[0]: line for line in lines if line.split(":")[0] in groups}
  assert sum(int(v.split(": ")[1].split()[0]) for v in summary.values()) == n_leaves
  assert "muon: 3 tensors" in summary["muon"] and summary["muon"].endswith("peak 0.02)")
  assert summary["adam"].endswith("learning rate 0.001")


def _group_of(table, path):
  row = next(line for line in table.splitlines() if line.startswith(path + " "))
  return re.split(r"\s{2,}", row)[2]  # columns are separated by at least two spaces


def test_describe_routing_with_labels_or_callable_or_default():
  params = {"w": jnp.ones((4, 4)), "b": jnp.ones(4)}
  default = stablejax.describe_routing(params)
  assert _group_of(default, "w") == "muon" and _group_of(default, "b") == "adam"
  custom = stablejax.describe_routing(params, {"w": "head", "b": "adam"})
  assert _group_of(custom, "w") == "head"
  fn = stablejax.describe_routing(params, lambda p: jax.tree.map(lambda _: "adam", p))
  assert _group_of(fn, "w") == "adam"
  with pytest.raises(ValueError, match="contains no stablejax.outlier_safe_muon"):
    stablejax.describe_routing(params, optax.chain(optax.clip(1.0), optax.adam(1e-3)))
  with pytest.raises(ValueError, match="structure of the params"):
    stablejax.describe_routing(params, {"w": {"x": "muon"}, "b": "adam"})


def _rates(table):
  """group -> learning-rate text, from the summary lines."""
  return {line.split(":")[0]: line.split("learning rate ")[1] for line in table.splitlines()
          if line.split(":")[0] in stablejax.muon.labels.GROUPS}


def test_describe_routing_finds_outlier_safe_muon_in_any_chain():
  params = _flax_params()
  muon = stablejax.outlier_safe_muon(2e-3, adam_learning_rate=1e-3, head_learning_rate=5e-4)
  want = {"muon": "0.002", "adam": "0.001", "embedding": "0.001", "head": "0.0005"}
  readme_chain = stablejax.skip_nonfinite(stablejax.skip_spikes(
      optax.chain(stablejax.hybrid_clip(), muon)))
  for tx in [muon, readme_chain, optax.MultiSteps(readme_chain, every_k_schedule=2),
             optax.chain(optax.inject_hyperparams(optax.scale)(step_size=1.0), readme_chain)]:
    assert _rates(stablejax.describe_routing(params, tx)) == want
  # The rates reach the factory traced under inject_hyperparams: the given values are shown.
  injected = optax.inject_hyperparams(stablejax.outlier_safe_muon)(
      learning_rate=optax.linear_schedule(0.0, 2e-2, 100), adam_learning_rate=1e-3)
  rates = _rates(stablejax.describe_routing(params, stablejax.skip_nonfinite(injected)))
  assert rates["muon"] == "schedule (start 0, peak 0.02) (injected)"
  assert rates["adam"] == rates["head"] == "0.001 (injected)"


def test_same_labels_for_every_wrapping_of_the_same_parameters():
  from flax import nnx
  from flax.core import FrozenDict
  params = _flax_params()["params"]
  want = jax.tree.leaves(stablejax.label_params(params))
  for tree in [FrozenDict(params), {"params": params}, jax.eval_shape(lambda: params),
               jax.tree.map(lambda x: x, params)]:
    assert jax.tree.leaves(stablejax.label_params(tree)) == want

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.embed = nnx.Embed(16, 8, rngs=rngs)
      self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=8, decode=False, rngs=rngs)
      self.norm = nnx.RMSNorm(8, rngs=rngs)
      self.out = nnx.Linear(8, 16, rngs=rngs)

  state = nnx.state(Net(nnx.Rngs(0)), nnx.Param)  # what nnx.Optimizer gives init: Variables
  at_init = stablejax.label_params(state)
  at_update = stablejax.label_params(nnx.as_pure(state))  # what nnx.Optimizer.update passes
  assert jax.tree.leaves(at_init) == jax.tree.leaves(at_update)
  assert jax.tree.structure(at_update) == jax.tree.structure(nnx.as_pure(state))
  assert at_update["attn"]["query"]["bias"] == "adam"  # [H, hd] bias: the labels that once split
  assert at_update["attn"]["query"]["kernel"] == "muon" and at_update["out"]["kernel"] == "head"


def test_overrides_mapping():
  params = _flax_params()
  labels = stablejax.label_params(params, overrides={"params/emb_proj_out": "head",
                                                      "*/attn_*/kernel": "adam"})
  p = labels["params"]
  assert p["emb_proj_out"]["kernel"] == "head" and p["emb_proj_out"]["bias"] == "head"
  assert p["block_0"]["attn_qkv"]["kernel"] == "adam"
  assert p["block_0"]["attn_out"]["kernel"] == "adam"
  assert p["tok_embed"]["embedding"] == "embedding"  # untouched by the overrides
  # The same mapping is what outlier_safe_muon's param_labels takes.
  tx = stablejax.outlier_safe_muon(2e-3, param_labels={"params/emb_proj_out": "head"})
  assert _group_of(stablejax.describe_routing(params, tx), "params/emb_proj_out/kernel") == "head"
  # A pattern matching nothing warns once, naming it (one mapping may serve several variants of
  # a model); strict=True makes it an error.
  with pytest.warns(UserWarning, match="'params/nothing' matches no parameter of this model"):
    stablejax.label_params(params, overrides={"params/nothing": "head"})
  with pytest.raises(ValueError, match="'params/nothing' matches no parameter"):
    stablejax.label_params(params, overrides={"params/nothing": "head"}, strict=True)
  tx = stablejax.outlier_safe_muon(2e-3, param_labels={"params/emb_proj_out": "head",
                                                       "params/gqa/*": "adam"})
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("default")  # Python's default: a warning once where it is issued
    state = tx.init(params)
    jax.eval_shape(tx.init, params)  # traced again (as the trainer does): no second warning
    tx.init(params)
    jax.jit(tx.update)(jax.tree.map(jnp.ones_like, params), state, params)  # never warns
  assert [str(w.message).count("'params/gqa/*'") for w in caught] == [1]
  strict = stablejax.outlier_safe_muon(2e-3, param_labels={"params/gqa/*": "adam"},
                                       strict_overrides=True)
  with pytest.raises(ValueError, match="'params/gqa/[*]' matches no parameter"):
    strict.init(params)
  with pytest.raises(ValueError, match="unknown group 'sgd'"):
    stablejax.label_params(params, overrides={"params/lm_head": "sgd"})


def _notes(table):
  return [line for line in table.splitlines()
          if line.startswith(("note:", "unsure:", "warning:"))]


def test_head_found_by_shape_or_reported():
  emb = jnp.zeros((50, 8))
  # Linen's auto-named last Dense: the only [D, V] matrix outside the blocks is the head.
  params = {"Embed_0": {"embedding": emb}, "Block_0": {"Dense_0": {"kernel": jnp.zeros((8, 50))}},
            "Dense_0": {"kernel": jnp.zeros((8, 32))}, "Dense_1": {"kernel": jnp.zeros((8, 50)),
                                                                   "bias": jnp.zeros(50)}}
  labels = stablejax.label_params(params)
  assert labels["Dense_1"] == {"kernel": "head", "bias": "adam"}
  assert labels["Block_0"]["Dense_0"]["kernel"] == "muon"  # same shape, but inside a block
  assert labels["Dense_0"]["kernel"] == "muon"
  notes = _notes(stablejax.describe_routing(params))
  assert len(notes) == 1
  assert notes[0].startswith("note: Dense_1/kernel (8, 50) is routed to 'head'")
  assert "param_labels={'Dense_1/kernel': 'muon'}" in notes[0]
  # "out" / "decoder" count as heads only when shaped like one.
  params = {"embed": emb, "attn": {"out": {"kernel": jnp.zeros((8, 8))}},
            "model": {"decoder": {"kernel": jnp.zeros((8, 50))}}}
  labels = stablejax.label_params(params)
  assert labels["attn"]["out"]["kernel"] == "muon"
  assert labels["model"]["decoder"]["kernel"] == "head"
  # Tied: no other leaf has the vocabulary's size.
  notes = _notes(stablejax.describe_routing({"embed": emb, "w": jnp.zeros((8, 8))}))
  assert len(notes) == 1 and "taken as tied to the embedding embed (50, 8)" in notes[0]
  # A [D, V] matrix inside a block (an MLP as wide as the vocabulary) is not the head: tied, and
  # the note names no MLP kernel.
  notes = _notes(stablejax.describe_routing(
      {"embed": emb, "block": {"proj": {"kernel": jnp.zeros((8, 50))}}}))
  assert len(notes) == 1 and "taken as tied" in notes[0] and "block/proj" not in notes[0]
  # A nested [D, V] matrix outside the blocks is the head whatever its parent is called.
  labels = stablejax.label_params({"decoder": {"embed": emb, "logitdense": {
      "kernel": jnp.zeros((8, 50))}, "layer_0": {"mlp": {"kernel": jnp.zeros((8, 50))}}}})
  assert labels["decoder"]["logitdense"]["kernel"] == "head"
  assert labels["decoder"]["layer_0"]["mlp"]["kernel"] == "muon"
  # [V, D] outside the blocks (a transposed head) is taken too, as unsure.
  notes = _notes(stablejax.describe_routing({"embed": emb, "w_out": jnp.zeros((50, 8))}))
  assert len(notes) == 1 and notes[0].startswith("unsure: w_out (50, 8) is routed to 'head'")
  # Unsure: a vocabulary-sized axis on a matrix of another shape.
  notes = _notes(stablejax.describe_routing({"embed": emb, "w_out": jnp.zeros((50, 4))}))
  assert len(notes) == 1 and "w_out also have a vocabulary-sized axis" in notes[0]
  # A named head needs no note.
  assert _notes(stablejax.describe_routing({"embed": emb, "lm_head": jnp.zeros((8, 50))})) == []


def test_adam_group_is_never_weight_decayed():
  # Issue: the AdamW decay mask was ndim >= 2, so scan-stacked [L, D] norm gains were decayed.
  params = {"tok_embed": {"embedding": _normal((20, 8))},
            "blocks": {"attn_norm": {"scale": jnp.ones((3, 8))},
                       "mlp": {"kernel": _normal((3, 8, 8)), "bias": _normal((3, 8))}},
            "final_norm": {"scale": jnp.ones(8)},
            "lm_head": {"kernel": _normal((8, 20)), "bias": _normal((20,))}}
  labels = stablejax.label_params(params)
  assert labels["blocks"] == {"attn_norm": {"scale": "adam"},
                              "mlp": {"kernel": "muon", "bias": "adam"}}
  tx = stablejax.outlier_safe_muon(2e-3, adam_learning_rate=1e-3, adam_weight_decay=0.5)
  grads = jax.tree.map(lambda p: _normal(p.shape, seed=p.size), params)
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)  # one compile, not one per op
  no_decay = optax.adam(1e-3, b1=0.9, b2=0.95, eps=1e-8)
  decay = optax.adamw(1e-3, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.5)
  # adam's first steps jitted the same way (adamw's stay eager: jitted, XLA fuses its decay
  # differently, one rounding off at rtol 1e-6)
  first_step = jax.jit(lambda tx, g, p: tx.update(g, tx.init(p), p), static_argnums=0)
  for path in [("blocks", "attn_norm", "scale"), ("blocks", "mlp", "bias"),
               ("final_norm", "scale"), ("lm_head", "bias")]:
    p, g, u = params, grads, updates
    for k in path:
      p, g, u = p[k], g[k], u[k]
    want, _ = first_step(no_decay, g, p)
    np.testing.assert_allclose(u, want, rtol=1e-6, err_msg="/".join(path))
  for path in [("tok_embed", "embedding"), ("lm_head", "kernel")]:
    p, g, u = params[path[0]][path[1]], grads[path[0]][path[1]], updates[path[0]][path[1]]
    want, _ = decay.update(g, decay.init(p), p)
    np.testing.assert_allclose(u, want, rtol=1e-6, err_msg="/".join(path))


def test_param_labels_override_routes_updates():
  params = {"w": np.ones((8, 8), np.float32), "u": np.ones((8, 8), np.float32)}
  tx = stablejax.outlier_safe_muon(0.02, adam_learning_rate=1e-3,
                                   param_labels={"w": "muon", "u": "adam"})
  grads = {"w": np.eye(8, dtype=np.float32), "u": np.eye(8, dtype=np.float32)}
  # jitted, and checked in numpy: eagerly, each operation compiles on its own
  updates = jax.tree.map(np.asarray, jax.jit(tx.update)(grads, tx.init(params), params)[0])
  # Adam's first step is -lr * sign(g); Muon's is an orthogonal matrix scaled 0.2 * sqrt(8).
  assert np.allclose(updates["u"], -1e-3 * np.eye(8), atol=1e-7)
  assert np.allclose(updates["w"] @ updates["w"].T, (0.02 * 0.2 * 8**0.5) ** 2 * np.eye(8),
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
  # A short schedule peaks between round step counts: its real peak is judged.
  short = optax.warmup_cosine_decay_schedule(0.0, 0.005, 17, 40)
  assert "AdamW learning rate 0.005 is above" in stablejax.check_learning_rates(adam_lr=short)[0]
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


def test_a_callable_param_labels_sees_the_arrays_of_a_boxed_tree():
  # Boxed and unboxed trees route alike: a callable `params -> labels` is given the arrays inside
  # Linen metadata boxes, so one callable serves both.
  def by_ndim(p):
    return {k: "adam" if v.ndim < 2 else "muon" for k, v in p.items()}
  plain = {"w": jnp.ones((4, 8)), "b": jnp.ones(8)}
  boxed = {"w": nn.LogicallyPartitioned(plain["w"], ("embed", "mlp")),
           "b": nn.LogicallyPartitioned(plain["b"], ("mlp",))}
  for tree in (plain, boxed):
    routed = stablejax.muon.routing.plan(tree, by_ndim)
    assert [leaf.path for leaf in routed.leaves] == ["b", "w"]
    assert routed.labels == ["adam", "muon"]


def test_logical_axis_names_decide_before_shapes_and_names():
  # Metadata first: no name rule knows "table", "out" or "w", and without a named embedding no
  # head can be found by shape; the logical axis names alone say embedding, head, stacked gain.
  def boxed(shape, names):
    return nn.LogicallyPartitioned(jnp.ones(shape), names)
  tree = {"table": boxed((32, 8), ("vocab", "embed")),
          "blocks": {"w": boxed((3, 8), ("layers", "embed"))},
          "proj": {"kernel": boxed((8, 16), ("embed", "mlp"))},
          "out": {"kernel": boxed((8, 32), ("embed", "vocab"))}}
  assert stablejax.label_params(tree) == {
      "table": "embedding", "blocks": {"w": "adam"}, "proj": {"kernel": "muon"},
      "out": {"kernel": "head"}}
  # The same arrays without metadata: shapes and names only.
  assert stablejax.label_params(stablejax.muon.labels.pure(tree)) == {
      "table": "muon", "blocks": {"w": "muon"}, "proj": {"kernel": "muon"},
      "out": {"kernel": "muon"}}


def test_a_metadata_model_axis_of_the_wrong_size_is_not_trusted():
  # The table says the model width is 8; a kernel whose 'embed' axis has 16 entries has wrong
  # metadata, so its layout is not taken from it (the last two axes, with a warning, instead).
  def boxed(shape, names):
    return nn.LogicallyPartitioned(jnp.ones(shape), names)
  routing, matrices = stablejax.muon.routing, stablejax.muon.matrices
  for width, want, source in ((8, matrices.ATTENTION_QKV, "metadata"),
                              (16, matrices.LAST_TWO_AXES, None)):
    tree = {"embed": boxed((32, 8), ("vocab", "embed")),
            "proj": {"kernel": boxed((width, 2, 4), ("embed", "heads", "kv"))}}
    routed = routing.plan(tree)
    i = [leaf.path for leaf in routed.leaves].index("proj/kernel")
    assert routed.labels[i] == "muon"
    assert (routed.layouts[i], routed.sources[i]) == (want, source)


def test_without_an_embedding_table_the_model_width_comes_from_metadata_or_norm_gains():
  # No table gives the model width 16: a boxed kernel's 'embed' axis says it, or the norm gains
  # do; either way the unnamed [D, H, hd] and [H, hd, D] kernels are read against it.
  routing = stablejax.muon.routing
  kernels = {"proj": {"kernel": jnp.ones((16, 2, 8))}, "out": {"kernel": jnp.ones((2, 8, 16))}}
  boxed = nn.LogicallyPartitioned(jnp.ones((16, 64)), ("embed", "mlp"))
  for hint in ({"mlp": {"kernel": boxed}}, {"norm": {"scale": jnp.ones(16)}}):
    routed = routing.plan({**kernels, **hint})
    got = {leaf.path: (routed.layouts[i], routed.sources[i])
           for i, leaf in enumerate(routed.leaves)}
    assert got["proj/kernel"] == (stablejax.muon.matrices.ATTENTION_QKV, "shape")
    attention_out = MDN(reduction_axis=(-3, -2), output_axis=-1)
    assert got["out/kernel"] == (attention_out, "shape")


MDN = optax.contrib.MuonDimensionNumbers


def _gpt2_like(d=8, vocab=40, storage="out_in"):
  """GPT-2's layout: wte, fused c_attn, c_proj, MLP c_fc / c_proj; Conv1D kernels [out, in]."""
  def k(fan_in, fan_out, seed):
    shape = (fan_out, fan_in) if storage == "out_in" else (fan_in, fan_out)
    return {"kernel": _normal(shape, seed), "bias": jnp.zeros(fan_out)}
  block = lambda s: {"attn": {"c_attn": k(d, 3 * d, s), "c_proj": k(d, d, s + 1)},  # noqa: E731
                     "mlp": {"c_fc": k(d, 4 * d, s + 2), "c_proj": k(4 * d, d, s + 3)},
                     "ln_1": {"scale": jnp.ones(d), "bias": jnp.zeros(d)}}
  return {"wte": {"embedding": _normal((vocab, d), 9)}, "h": {"0": block(0), "1": block(10)}}


def test_out_in_storage_read_from_the_models_own_kernels():
  FDN = stablejax.FusedDimensionNumbers
  for storage, plain, fused in (("out_in", MDN(-1, -2), FDN(-1, -2, -2, 3)),
                                ("in_out", MDN(-2, -1), FDN(-2, -1, -1, 3))):
    dims = stablejax.muon_dimension_numbers(_gpt2_like(storage=storage))["h"]["0"]
    assert dims["attn"]["c_attn"]["kernel"] == fused, storage
    assert dims["mlp"]["c_fc"]["kernel"] == plain and dims["mlp"]["c_proj"]["kernel"] == plain
    assert dims["attn"]["c_proj"]["kernel"] == plain, storage
  # Kernels that disagree say nothing: the default [in, out] reading stays.
  params = _gpt2_like()
  params["h"]["1"]["mlp"]["c_fc"]["kernel"] = _normal((8, 32), 3)   # [in, out] this one
  dims = stablejax.muon_dimension_numbers(params)["h"]["0"]
  assert dims["mlp"]["c_proj"]["kernel"] == MDN(-2, -1)


def test_equinox_linear_weights_are_out_in_by_module_type():
  import equinox as eqx

  def build():
    keys = jax.random.split(jax.random.key(0), 3)
    return {"embed": eqx.nn.Embedding(50, 8, key=keys[0]),
            "blocks": eqx.filter_vmap(lambda k: eqx.nn.Linear(8, 24, key=k))(
                jax.random.split(keys[1], 2)),
            "sq": eqx.nn.Linear(8, 8, key=keys[2])}
  # zeros of the traced shapes: the layouts come from shapes and module types
  model = _zeros(eqx.filter_eval_shape(build))
  dims = stablejax.muon_dimension_numbers(eqx.filter(model, eqx.is_array))
  assert dims["blocks"].weight == MDN(-1, -2) and dims["sq"].weight == MDN(-1, -2)
  table = stablejax.describe_routing(eqx.filter(model, eqx.is_array))
  row = next(line for line in table.splitlines() if line.startswith("blocks/weight"))
  assert re.split(r"\s{2,}", row)[2:5] == ["muon", "2 x 8x24", "module type"]


def test_fused_parts_from_names_shapes_and_metadata():
  FDN = stablejax.FusedDimensionNumbers
  d = 16
  gqa = {"embed": _normal((64, d)),  # Phi-3 style: qkv_proj [D, H*hd + 2 K*hd], o_proj [H*hd, D]
         "layers": {"0": {"attn": {"qkv_proj": {"kernel": _normal((d, 16 + 2 * 4))},
                                   "o_proj": {"kernel": _normal((16, d))}},
                          "mlp": {"gate_up_proj": {"kernel": _normal((d, 2 * 24))},
                                  "down_proj": {"kernel": _normal((24, d))}}}}}
  dims = stablejax.muon_dimension_numbers(gqa)["layers"]["0"]
  assert dims["attn"]["qkv_proj"]["kernel"] == FDN(-2, -1, -1, (16, 4, 4))
  assert dims["mlp"]["gate_up_proj"]["kernel"] == FDN(-2, -1, -1, 2)
  # a 2-D kernel whose logical axis names say 'qkv' on its features
  boxed = {"embed": _normal((64, d)),
           "attn": {"wqkv": nn.LogicallyPartitioned(_normal((d, 3 * d)), ("embed", "qkv"))}}
  labels = stablejax.label_params(boxed)
  assert labels["attn"]["wqkv"] == "muon"
  got = stablejax.muon_dimension_numbers(boxed)["attn"]["wqkv"]
  assert got == FDN(-2, -1, -1, 3)
  # named fused but no split fits the shapes: a warning naming the override
  odd = {"embed": _normal((64, d)), "attn": {"qkv": {"kernel": _normal((d, 20))}}}
  with pytest.warns(UserWarning, match="attn/qkv/kernel .* named like a fused projection.*"
                                       "FusedDimensionNumbers"):
    stablejax.outlier_safe_muon(2e-3).init(odd)
  # an override says what no rule can see, and a bad one is refused in one line
  dims = stablejax.muon_dimension_numbers(odd, overrides={"attn/qkv/kernel": FDN(-2, -1, -1,
                                                                                 (12, 4, 4))})
  assert dims["attn"]["qkv"]["kernel"].part_sizes((d, 20)) == (12, 4, 4)
  with pytest.raises(ValueError, match="attn/qkv/kernel: .*does not split into 3 equal parts"):
    stablejax.muon_dimension_numbers(odd, overrides={"attn/qkv/kernel": FDN(-2, -1, -1, 3)})


def test_a_leaf_that_is_not_a_muon_matrix_is_refused_and_given_layouts_are_reported():
  params = {"w": jnp.zeros((4, 6)), "b": jnp.zeros(4)}
  with pytest.raises(ValueError, match=r"Muon needs matrices but b has shape \(4,\)"):
    stablejax.muon_dimension_numbers(params, param_labels={"b": "muon"})
  with pytest.raises(ValueError, match="gives dimension numbers to b, which is routed to 'adam'"):
    stablejax.muon_dimension_numbers(params, overrides={"b": MDN(0, 0)})
  routed = stablejax.muon.routing.plan(params, weight_dimension_numbers={"w": MDN(1, 0), "b": None})
  assert [leaf.path for leaf in routed.leaves] == ["b", "w"]
  assert routed.layouts == [None, MDN(1, 0)] and routed.sources == [None, "given"]


def test_a_layout_only_metadata_decides_warns_at_init_with_the_fix():
  # Without an embedding table the shapes do not say which axis of [8, 2, 4] is the model
  # width; the logical names do. update() reads layouts from the arrays it gets (nnx.Optimizer
  # passes them without their metadata), so init says how to pin them.
  boxed = {"proj": {"kernel": nn.LogicallyPartitioned(jnp.ones((8, 2, 4)),
                                                      ("embed", "heads", "kv"))}}
  routed = stablejax.muon.routing.plan(boxed)
  assert routed.layouts == [stablejax.muon.matrices.ATTENTION_QKV]
  tx = stablejax.outlier_safe_muon(0.02)
  with pytest.warns(UserWarning, match=r"layouts of proj/kernel come from their Flax metadata.*"
                                       r"weight_dimension_numbers=stablejax.muon_dimension_numb"):
    tx.init(boxed)
  pinned = stablejax.outlier_safe_muon(
      0.02, weight_dimension_numbers=stablejax.muon_dimension_numbers(boxed))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    pinned.init(boxed)
