"""A public JAX model stablejax was not written for: the nanoGPT port of cgarciae/nanoGPT-jax
(``model.py``), its modules and names kept, moved from the early NNX API it was written for
(``nnx.Context``, ``nnx.Seq``) to flax.nnx 0.12 (``nnx.Rngs``, ``nnx.List``).

What it has: a fused ``c_attn = nnx.Linear(D, 3D)`` split with ``jnp.split(..., 3)``, heads
head-major inside each part, ``c_proj`` / ``c_fc`` / ``c_proj`` MLP, ``wte`` tied to the output
(``wte.attend``), and a Flax ``TrainState`` loop stepping with ``state.apply_gradients``. Checked:
routing leaf by leaf, QK-clip finding the heads inside ``c_attn`` and bringing a layer to ``tau``,
the max logits from ``nnx.capture(..., method_outputs=...)`` with an ``AttentionProbe``, and the
README chain training through ``TrainState.apply_gradients`` as written.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import stablejax

D, HEADS, LAYERS, VOCAB, BLOCK = 32, 4, 2, 64, 16
MDN = optax.contrib.MuonDimensionNumbers


class CausalSelfAttention(nnx.Module):
  def __init__(self, n_embd, n_head, rngs):
    self.c_attn = nnx.Linear(n_embd, 3 * n_embd, rngs=rngs)
    self.c_proj = nnx.Linear(n_embd, n_embd, rngs=rngs)
    self.n_head, self.n_embd = n_head, n_embd

  def __call__(self, x):
    B, T, C = x.shape
    q, k, v = jnp.split(self.c_attn(x), 3, axis=-1)
    q = q.reshape(B, T, self.n_head, C // self.n_head).swapaxes(1, 2)
    k = k.reshape(B, T, self.n_head, C // self.n_head).swapaxes(1, 2)
    v = v.reshape(B, T, self.n_head, C // self.n_head).swapaxes(1, 2)
    mask = jnp.tril(jnp.ones((T, T))).reshape((1, 1, T, T))
    att = (q @ k.swapaxes(-2, -1)) * (1.0 / jnp.sqrt(k.shape[-1]))
    att = jnp.where(mask == 0, float("-inf"), att)
    y = nnx.softmax(att, axis=-1) @ v
    return self.c_proj(y.swapaxes(1, 2).reshape(B, T, C))


class MLP(nnx.Module):
  def __init__(self, n_embd, rngs):
    self.c_fc = nnx.Linear(n_embd, 4 * n_embd, rngs=rngs)
    self.c_proj = nnx.Linear(4 * n_embd, n_embd, rngs=rngs)

  def __call__(self, x):
    return self.c_proj(nnx.gelu(self.c_fc(x), approximate=True))


class Block(nnx.Module):
  def __init__(self, n_embd, n_head, rngs):
    self.ln_1 = nnx.LayerNorm(n_embd, epsilon=1e-5, rngs=rngs)
    self.attn = CausalSelfAttention(n_embd, n_head, rngs)
    self.ln_2 = nnx.LayerNorm(n_embd, epsilon=1e-5, rngs=rngs)
    self.mlp = MLP(n_embd, rngs)

  def __call__(self, x):
    x = x + self.attn(self.ln_1(x))
    return x + self.mlp(self.ln_2(x))


class GPT(nnx.Module):
  def __init__(self, rngs):
    self.wte = nnx.Embed(VOCAB, D, rngs=rngs)
    self.wpe = nnx.Embed(BLOCK, D, rngs=rngs)
    self.h = nnx.List([Block(D, HEADS, rngs) for _ in range(LAYERS)])
    self.ln_f = nnx.LayerNorm(D, epsilon=1e-5, rngs=rngs)

  def __call__(self, idx):
    x = self.wte(idx) + self.wpe(jnp.arange(idx.shape[1])[None])
    for block in self.h:
      x = block(x)
    return self.wte.attend(self.ln_f(x))


@pytest.fixture(scope="module")
def split_model():
  graphdef, params = nnx.split(GPT(nnx.Rngs(0)), nnx.Param)
  return graphdef, nnx.as_pure(params)


def _flat(tree, is_leaf=None):
  return {"/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path): leaf
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]}


def test_routing_splits_the_fused_c_attn_and_keeps_the_tied_head(split_model):
  _, params = split_model
  labels = _flat(stablejax.label_params(params))
  dims = _flat(stablejax.muon_dimension_numbers(params), is_leaf=lambda x: x is None or isinstance(
      x, (MDN, stablejax.FusedDimensionNumbers)))
  for path, label in labels.items():
    names = path.split("/")
    if names[-1] in ("bias", "scale"):
      assert label == "adam", path
    elif names[0] in ("wte", "wpe"):
      assert label == "embedding", path
    else:
      assert label == "muon", path
      want = (stablejax.FusedDimensionNumbers(-2, -1, -1, 3) if names[-2] == "c_attn"
              else MDN(-2, -1))        # nnx.Linear: [in, out]
      assert dims[path] == want, path
  assert "head" not in labels.values()   # wte.attend: the head is the embedding


def _probe():
  return stablejax.AttentionProbe("c_attn", "c_attn", HEADS, HEADS, D // HEADS,
                                  1.0 / np.sqrt(D // HEADS), query_part=(0, D),
                                  key_part=(D, D))


def _max_logits(graphdef, params, x):
  forward = nnx.capture(lambda model, x: model(x), nnx.Intermediate,
                        method_outputs=nnx.Intermediate)

  @jax.jit  # one program: eagerly, each of the model's operations compiles on its own
  def max_logits(params, x):
    _, captured = forward(nnx.merge(graphdef, params), x)
    return _probe().max_logits(captured)
  return max_logits(params, x)


def test_qk_clip_finds_the_heads_inside_c_attn_and_clips_a_layer_to_tau(split_model):
  graphdef, params = split_model
  layers = stablejax.layout.heads.find_attention_layers(params, num_heads=HEADS)
  assert [(a.name, a.query[0].span, a.key[0].span) for a in layers] == [
      (f"h/{i}/attn", (0, D), (D, D)) for i in range(LAYERS)]
  x = jax.random.randint(jax.random.key(1), (2, BLOCK), 0, VOCAB)
  before = _max_logits(graphdef, params, x)
  assert sorted(before) == ["h/0/attn", "h/1/attn"]
  # against the model's own attention logits: the same q and k, computed here from c_attn
  @jax.jit
  def first_c_attn(params, x):
    model = nnx.merge(graphdef, params)
    h = model.h[0].ln_1(model.wte(x) + model.wpe(jnp.arange(BLOCK)[None]))
    return model.h[0].attn.c_attn(h)
  q, k, _ = np.split(np.asarray(first_c_attn(params, x)), 3, axis=-1)
  q, k = q.reshape(2, BLOCK, HEADS, -1), k.reshape(2, BLOCK, HEADS, -1)
  logits = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(D // HEADS)
  want = np.where(np.tril(np.ones((BLOCK, BLOCK), bool)), logits, -np.inf).max(axis=(0, 2, 3))
  np.testing.assert_allclose(before["h/0/attn"], want, rtol=1e-5)
  tau = 0.5 * float(before["h/0/attn"].min())
  clip = optax.chain(optax.sgd(0.0), stablejax.qk_clip(tau, num_heads=HEADS))
  only_first = {"h/0/attn": before["h/0/attn"], "h/1/attn": jnp.zeros(HEADS)}
  @jax.jit
  def clipped(params, max_logits):
    updates, _ = clip.update(jax.tree.map(jnp.zeros_like, params), clip.init(params), params,
                             max_logits=max_logits)
    return optax.apply_updates(params, updates)
  after = _max_logits(graphdef, clipped(params, only_first), x)
  np.testing.assert_allclose(after["h/0/attn"], np.minimum(before["h/0/attn"], tau), rtol=1e-4)


@pytest.mark.slow
def test_train_state_loop_as_the_repository_writes_it_trains_with_the_readme_chain(split_model):
  graphdef, params = split_model
  tx = stablejax.skip_nonfinite(stablejax.skip_spikes(optax.chain(
      stablejax.hybrid_clip(),
      stablejax.outlier_safe_muon(learning_rate=0.02, adam_learning_rate=3e-3),
  )), max_consecutive=16)
  state = train_state.TrainState.create(
      apply_fn=lambda p, x: nnx.merge(graphdef, p)(x), params=params, tx=tx)
  starts = jax.random.randint(jax.random.key(2), (8, 1), 0, VOCAB)
  seqs = (starts + 3 * jnp.arange(BLOCK + 1)) % VOCAB
  x, y = seqs[:, :-1], seqs[:, 1:]

  @jax.jit
  def step(state):
    def loss_fn(params):
      return optax.softmax_cross_entropy_with_integer_labels(state.apply_fn(params, x), y).mean()
    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss   # as written: no loss= to the optimizer

  losses = []
  for _ in range(20):
    state, loss = step(state)
    losses.append(float(loss))
  assert np.all(np.isfinite(losses)) and np.mean(losses[-3:]) < 0.6 * np.mean(losses[:3]), losses
  assert int(stablejax.stability_metrics(state.opt_state)["skip_nonfinite/total_skips"]) == 0
