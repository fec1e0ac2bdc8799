"""stablejax in models it did not write: Flax NNX and Linen transformers built from Flax's modules.

Routing is asserted leaf by leaf against rules written here from what each Flax module is;
attention updates are compared with optax.contrib.muon given the matching dimension numbers; a
scanned Linen model (tied head) and a scanned NNX model (under nnx.Optimizer) train with the
README's full stack.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import stablejax
from flax_models import LinenLM, NNXLM, linen_params
from helpers import load_example

MDN = optax.contrib.MuonDimensionNumbers
QKV, OUT = MDN(-3, (-2, -1)), MDN((-3, -2), -1)


def _flat(tree, is_leaf=None):
  return {"/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path): leaf
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]}


def _expected_linen(path: str) -> str:
  names = path.split("/")
  if names[0] in ("Embed_0", "pos_embedding"):
    return "embedding"
  if names[-1] == "bias" or names[-2].startswith("LayerNorm"):
    return "adam"
  if names[0] == "Dense_0":  # the model's last, auto-named nn.Dense(vocab)
    return "head"
  return "muon"  # attention q/k/v/out and MLP kernels


def _expected_nnx(path: str) -> str:
  names = path.split("/")
  if names[-1] == "bias" or names[-2].startswith("ln"):
    return "adam"
  if names[0] == "embed":
    return "embedding"
  if names[0] == "out":
    return "head"
  return "muon"


def _expected_layout(path: str):
  names = path.split("/")
  if names[-2] in ("query", "key", "value"):
    return QKV
  return OUT if names[-2] == "out" and len(names) > 2 else stablejax.muon.matrices.LAST_TWO_AXES


def _filled(abstract):
  """``abstract`` (shapes) holding numpy normal values."""
  return jax.tree.map(lambda x: jnp.asarray(
      np.random.default_rng([x.size, 1]).standard_normal(x.shape), x.dtype), abstract)


def _linen_layout(model, seq_len: int = 8):
  """``linen_params(model)``'s tree and shapes (jax.eval_shape runs the init's code) holding
  numpy values: the routing tests read no value of the random init, whose compiled program
  costs a second or two per model."""
  return _filled(jax.eval_shape(model.init, jax.random.key(0),
                                jnp.zeros((1, seq_len), jnp.int32))["params"])


def _nnx_layout(make):
  """The ``nnx.Param`` state of the model ``make()`` builds (nnx.eval_shape runs its
  constructor: the Variables and their metadata), holding numpy values."""
  return _filled(nnx.state(nnx.eval_shape(make), nnx.Param))


LINEN = {"untied": {}, "tied": {"tied": True}, "scan": {"scan": True},
         "scan_tied": {"scan": True, "tied": True}}
NNX = {"untied": {}, "tied": {"tied": True}, "scan": {"scan": True}}


def _check_routing(params, expected):
  labels = _flat(stablejax.label_params(params))
  dims = _flat(stablejax.muon_dimension_numbers(params),
               is_leaf=lambda x: x is None or isinstance(x, MDN))
  shapes = {k: v.shape for k, v in _flat(params).items()}
  assert set(labels) == set(shapes)
  for path, label in labels.items():
    assert label == expected(path), (path, shapes[path], label)
    if label == "muon":
      assert dims[path] == _expected_layout(path), path
  groups = set(labels.values())
  assert groups == {"muon", "adam", "embedding"} | ({"head"} if "head" in groups else set())
  return labels


@pytest.mark.parametrize("variant", LINEN)
def test_linen_routing_leaf_by_leaf(variant):
  kw = LINEN[variant]
  params = _linen_layout(LinenLM(**kw))
  labels = _check_routing(params, _expected_linen)
  assert ("Dense_0/kernel" in labels) == (not kw.get("tied"))
  # The whole variables dict ({'params': ...}) routes the same.
  nested = _flat(stablejax.label_params({"params": params}))
  assert {k[len("params/"):]: v for k, v in nested.items()} == labels
  with_tx = stablejax.describe_routing(params, stablejax.outlier_safe_muon(2e-3))
  notes = [line for line in with_tx.splitlines()
           if line.startswith(("note:", "unsure:", "warning:"))]
  assert len(notes) == 1  # head found by shape, or taken as tied; nothing unrecognised
  assert ("tied to the embedding Embed_0/embedding" in notes[0]) == bool(kw.get("tied"))


@pytest.mark.parametrize("variant", NNX)
def test_nnx_routing_leaf_by_leaf_and_init_update_agree(variant):
  state = _nnx_layout(lambda: NNXLM(**NNX[variant], rngs=nnx.Rngs(0)))
  labels = _check_routing(nnx.as_pure(state), _expected_nnx)
  # At init nnx.Optimizer passes Variables, at update pure arrays: the same labels, leaf by leaf.
  at_init = stablejax.label_params(state)
  assert jax.tree.leaves(at_init) == [labels[k] for k in _flat(nnx.as_pure(state))]
  notes = [line for line in stablejax.describe_routing(state).splitlines()
           if line.startswith(("note:", "unsure:", "warning:"))]
  assert notes == ([] if not NNX[variant].get("tied") else notes[:1])


def test_attention_updates_equal_optax_muon_with_matching_dimension_numbers():
  # A whole scanned NNX model: the Muon branch against optax.contrib.muon, whose dimension numbers
  # are written here by hand (attention [L, D, H, hd] / [L, H, hd, D]; MLP [L, in, out]).
  params = nnx.as_pure(_nnx_layout(lambda: NNXLM(scan=True, rngs=nnx.Rngs(0))))
  flat = _flat(params)

  def dims_for(path):
    names = path.split("/")
    if names[0] != "blocks" or names[-1] != "kernel":
      return None  # optax: not Muon
    if names[-2] in ("query", "key", "value"):
      return MDN(1, (2, 3))
    return MDN((1, 2), 3) if names[-2] == "out" else MDN(1, 2)

  dims = jax.tree_util.tree_map_with_path(
      lambda p, _: dims_for("/".join(str(getattr(k, "key", k)) for k in p)), params)
  # numpy draws: a jax.random.normal per leaf shape would compile a program for each
  grads = jax.tree.map(lambda x: jnp.asarray(
      np.random.default_rng(x.size).standard_normal(x.shape), x.dtype), params)
  ours = stablejax.outlier_safe_muon(0.02, outlier_method=None, ns_backend="xla")
  ref = optax.contrib.muon(0.02, consistent_rms=0.2, eps=1e-8, muon_weight_dimension_numbers=dims)
  # Jitted: eagerly, each of the updates' operations compiles on its own (minutes on a CPU).
  u_ours = _flat(jax.jit(ours.update)(grads, ours.init(params), params)[0])
  u_ref = _flat(jax.jit(ref.update)(grads, ref.init(params), params)[0])
  compared = 0
  for path in flat:
    if dims_for(path) is not None:
      np.testing.assert_allclose(u_ours[path], u_ref[path], rtol=2e-4, atol=1e-7, err_msg=path)
      compared += 1
  assert compared == 6


def _readme_chain(muon_lr, adam_lr):
  return stablejax.skip_nonfinite(stablejax.skip_spikes(optax.chain(
      stablejax.hybrid_clip(),
      stablejax.outlier_safe_muon(learning_rate=muon_lr, adam_learning_rate=adam_lr)),
  ), max_consecutive=16)


def _batches(vocab, n=24, batch=8, seq=8):
  # A learnable stream: token t+1 = (token t + 3) mod vocab, from random starts.
  starts = jax.random.randint(jax.random.key(1), (n, batch, 1), 0, vocab)
  seqs = (starts + 3 * jnp.arange(seq + 1)) % vocab
  return [(s[:, :-1], s[:, 1:]) for s in seqs]


def _assert_trained(losses, metrics):
  assert np.mean(losses[-4:]) < 0.5 * np.mean(losses[:4]), losses
  assert int(metrics["skip_nonfinite/total_skips"]) == 0
  assert int(metrics["muon/fallback_count"]) == 0 and int(metrics["muon/nonfinite_count"]) == 0


@pytest.mark.slow
def test_scanned_tied_linen_model_trains_under_jit():
  model = LinenLM(vocab=32, tied=True, scan=True)
  params = linen_params(model)
  tx = _readme_chain(0.02, 3e-3)
  opt_state = tx.init(params)
  step = load_example("linen_lm").make_train_step(model, tx)  # the example's own step

  losses = []
  for x, y in _batches(32):
    params, opt_state, loss = step(params, opt_state, x, y)
    losses.append(float(loss))
  _assert_trained(losses, stablejax.stability_metrics(opt_state))


@pytest.mark.slow
def test_scanned_nnx_model_trains_under_nnx_optimizer():
  model = NNXLM(vocab=32, scan=True, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, _readme_chain(0.02, 3e-3), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, x, y):
    def loss_fn(model):
      return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads, loss=loss)
    return loss

  losses = [float(step(model, optimizer, x, y)) for x, y in _batches(32)]
  _assert_trained(losses, stablejax.stability_metrics(nnx.as_pure(optimizer.opt_state)))
