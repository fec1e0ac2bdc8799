"""NorMuon (outlier_safe_muon(normuon=True)) against a numpy re-derivation of arXiv 2510.05491.

The Muon direction does not depend on NorMuon's statistics, so over several steps the NorMuon
update must be the plain Muon update (same gradients) with numpy's per-neuron normalisation of
each matrix applied: ``v = b2 v + (1 - b2) mean_in(O^2)`` per output neuron, ``O / (sqrt(v) +
eps)`` rescaled to ``O``'s Frobenius norm. Matrices as Muon cuts them: a scan-stacked kernel per
layer, a per-head projection per head. And the state: in the Muon group's chain, float32, kept
by a skipped step and by the per-tensor guard, restored from a checkpoint.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import stablejax
from helpers import gpt_params
from stablejax.muon.normuon import NorMuonState, normalise, scale_by_normuon

B2, EPS = 0.95, 1e-8


def _numpy_normuon(o, v):
  """One step on a float64 ``[fan_in, fan_out]`` matrix, written from the paper's Algorithm 1
  with the Frobenius-norm rescale."""
  v = B2 * v + (1 - B2) * np.mean(o * o, axis=0)
  scaled = o / (np.sqrt(v)[None, :] + EPS)
  return scaled * np.linalg.norm(o) / np.linalg.norm(scaled), v


def test_normalise_matches_numpy_over_steps():
  rng = np.random.default_rng(0)
  v_ours = jnp.zeros((3, 12), jnp.float32)
  v_np = np.zeros((3, 12))
  for step in range(4):
    o = rng.standard_normal((3, 20, 12)) * np.linspace(0.1, 3.0, 12)  # uneven neuron norms
    got, v_ours = normalise(jnp.asarray(o, jnp.float32), v_ours, B2, EPS)
    for k in range(3):
      want, v_np[k] = _numpy_normuon(o[k], v_np[k])
      np.testing.assert_allclose(got[k], want, rtol=1e-4, atol=1e-6, err_msg=f"step {step}")
    np.testing.assert_allclose(v_ours, v_np, rtol=1e-5)
  # the neuron norms of the first step's output are equal (v is that step's own mean square)
  first, _ = normalise(jnp.asarray(o, jnp.float32), jnp.zeros((3, 12)), 0.0, EPS)
  norms = np.linalg.norm(np.asarray(first), axis=1)
  np.testing.assert_allclose(norms, norms[:, :1] * np.ones_like(norms), rtol=1e-4)


def _model():
  from stablejax.modeling.gpt import ModelConfig
  cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=16,
                    qk_norm=False)
  return gpt_params(cfg)  # a jitted init: one program, not one per operation


def _muon_state(state, kind):
  found = [s for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, kind))
           if isinstance(s, kind)]
  assert len(found) == 1
  return found[0]


def test_outlier_safe_muon_normuon_is_muon_then_numpy_normalisation():
  params = _model()
  kw = dict(outlier_method=None, ns_backend="xla", per_head=True, num_heads=4)
  plain = stablejax.outlier_safe_muon(1.0, **kw)
  nor = stablejax.outlier_safe_muon(1.0, normuon=True, normuon_b2=B2, **kw)
  s_plain, s_nor = jax.jit(plain.init)(params), jax.jit(nor.init)(params)
  up_plain, up_nor = jax.jit(plain.update), jax.jit(nor.update)
  q = ("blocks", "attn", "q_proj", "kernel")      # [L, D, H*hd]: per layer, per head [D, hd]
  o_proj = ("blocks", "attn", "o_proj", "kernel")  # [L, H*hd, D]: per head [hd, D]
  up = ("blocks", "mlp", "up_proj", "kernel")      # [L, D, F]: per layer
  v = {q: np.zeros((2, 4, 8)), o_proj: np.zeros((2, 4, 32)), up: np.zeros((2, 64))}

  def get(tree, path):
    for k in path:
      tree = tree[k]
    return np.asarray(tree, np.float64)

  for step in range(3):
    # numpy draws: a jax.random.normal per leaf shape would compile a program for each
    grads = jax.tree.map(lambda p, s=step: np.random.default_rng(s + p.size % 7).standard_normal(
        p.shape).astype(np.float32), params)
    muon, s_plain = up_plain(grads, s_plain, params)
    got, s_nor = up_nor(grads, s_nor, params)
    for layer in range(2):
      o = -get(muon, up)[layer]
      want, v[up][layer] = _numpy_normuon(o, v[up][layer])
      np.testing.assert_allclose(-get(got, up)[layer], want, rtol=2e-4, atol=1e-6)
      for h in range(4):
        cols = slice(8 * h, 8 * (h + 1))
        want, v[q][layer, h] = _numpy_normuon(-get(muon, q)[layer][:, cols], v[q][layer, h])
        np.testing.assert_allclose(-get(got, q)[layer][:, cols], want, rtol=2e-4, atol=1e-6)
        want, v[o_proj][layer, h] = _numpy_normuon(-get(muon, o_proj)[layer][cols],
                                                   v[o_proj][layer, h])
        np.testing.assert_allclose(-get(got, o_proj)[layer][cols], want, rtol=2e-4, atol=1e-6)
    # embeddings, head and gains are AdamW's: NorMuon leaves them alone
    np.testing.assert_array_equal(got["tok_embed"]["embedding"], muon["tok_embed"]["embedding"])
  nu = _muon_state(s_nor, NorMuonState).nu
  assert nu["blocks"]["attn"]["q_proj"]["kernel"].shape == (2 * 4 * 8,)
  assert nu["blocks"]["mlp"]["down_proj"]["kernel"].shape == (2 * 32,)
  assert nu["blocks"]["attn"]["q_proj"]["kernel"].dtype == jnp.float32


def test_state_kept_on_a_skipped_step_and_per_tensor():
  params = {"w": jnp.zeros((16, 16)), "v": jnp.zeros((16, 32)), "b": jnp.zeros(16)}
  good = {"w": jax.random.normal(jax.random.key(1), (16, 16)),
          "v": jax.random.normal(jax.random.key(2), (16, 32)), "b": jnp.ones(16)}
  bad = dict(good, w=good["w"].at[0, 0].set(jnp.nan))
  tx = stablejax.skip_nonfinite(stablejax.outlier_safe_muon(0.01, normuon=True))
  update = jax.jit(tx.update)
  state = tx.init(params)
  for _ in range(2):
    _, state = update(good, state, params)
  before = jax.tree.map(np.asarray, _muon_state(state, NorMuonState).nu)
  assert np.all(before["w"] > 0) and np.all(before["v"] > 0)
  _, state = update(bad, state, params)  # the whole step is skipped: every state as it was
  after = _muon_state(state, NorMuonState).nu
  np.testing.assert_array_equal(after["w"], before["w"])
  np.testing.assert_array_equal(after["v"], before["v"])
  # without the wrapper, the per-tensor guard keeps w's statistics and updates v's
  inner = stablejax.outlier_safe_muon(0.01, normuon=True)
  update = jax.jit(inner.update)
  state = inner.init(params)
  for _ in range(2):
    _, state = update(good, state, params)
  before = jax.tree.map(np.asarray, _muon_state(state, NorMuonState).nu)
  _, state = update(bad, state, params)
  after = _muon_state(state, NorMuonState).nu
  np.testing.assert_array_equal(after["w"], before["w"])
  assert not np.array_equal(after["v"], before["v"])


def test_state_round_trips_through_an_orbax_checkpoint(tmp_path):
  import orbax.checkpoint as ocp
  params = {"w": jnp.zeros((8, 24))}
  tx = scale_by_normuon()
  o = {"w": jax.random.normal(jax.random.key(0), (8, 24))}
  _, state = tx.update(o, tx.init(params))
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(tmp_path / "state", state)
  with ocp.StandardCheckpointer() as ckpt:
    restored = ckpt.restore(tmp_path / "state", jax.tree.map(np.zeros_like, state))
  np.testing.assert_array_equal(restored.nu["w"], state.nu["w"])
  assert isinstance(restored, NorMuonState) and restored.nu["w"].shape == (24,)


def test_bad_normuon_arguments():
  with pytest.raises(ValueError, match="normuon"):
    stablejax.outlier_safe_muon(0.01, normuon="yes")
  u, state = optax.chain(scale_by_normuon()).update(
      {"w": jnp.zeros((4, 6))}, optax.chain(scale_by_normuon()).init({"w": jnp.zeros((4, 6))}))
  assert np.all(np.asarray(u["w"]) == 0)  # a zero update stays zero (no 0/0)


def test_trainer_config_keys_reach_the_optimizer():
  from stablejax.modeling.gpt import GPT
  from stablejax.training.config import ConfigError, ineffective_keys, load_config
  from stablejax.training.optim import build_optimizer
  cfg = load_config(None, ["optimizer.per_head=true", "optimizer.normuon=true",
                           "optimizer.normuon_b2=0.9", "optimizer.ns_method=\"gram\"",
                           "model.n_layers=1", "model.d_model=32", "model.n_heads=4",
                           "model.qk_norm=false", "model.vocab_size=64"])
  params = GPT(cfg.model).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
  tx = build_optimizer(cfg)
  state = tx.init(params)
  nu = _muon_state(state, NorMuonState).nu  # normuon=true reached the chain
  assert nu["blocks"]["attn"]["q_proj"]["kernel"].shape == (32,)
  table = stablejax.describe_routing(params, tx)  # per_head with model.n_heads as the count
  assert "4 x 32x8" in table and "attention heads" in table
  assert ineffective_keys(load_config(None, ["optimizer.normuon_b2=0.9"])) != []
  for bad in ('optimizer.ns_preconditioning="spectral"', "optimizer.normuon_b2=1.5"):
    with pytest.raises(ConfigError, match="optimizer"):
      load_config(None, [bad])


_SHARDED = """
import os, sys
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=4")
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh
import stablejax
from stablejax.modeling.gpt import GPT, ModelConfig
from stablejax.muon.normuon import NorMuonState
from stablejax.training.launch.mesh import state_shardings

cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=16, qk_norm=False)
# Init, gradients and optimizer state jitted: eagerly, each of their operations compiles on its
# own in this fresh process.
params = jax.jit(GPT(cfg).init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
grads = jax.jit(lambda ps: jax.tree.map(
    lambda p: jax.random.normal(jax.random.key(p.size % 13), p.shape), ps))(params)
# outlier_method=None: at the suite's --xla_backend_optimization_level=0, XLA:CPU miscounts the
# outlier clamp of a kernel cut into equal parts (eager and the default level count none)
tx = stablejax.outlier_safe_muon(0.01, per_head=True, num_heads=4, normuon=True,
                                 outlier_method=None)
state = jax.jit(tx.init)(params)
want, want_state = jax.jit(tx.update)(grads, state, params)
mesh = Mesh(np.asarray(jax.devices()).reshape(1, 4), ("data", "fsdp"))
p_sh, s_sh = state_shardings(mesh, params), state_shardings(mesh, state)
nu_sh = [s for s in jax.tree.leaves(s_sh, is_leaf=lambda x: isinstance(x, NorMuonState))
         if isinstance(s, NorMuonState)][0].nu
assert any(not s.is_fully_replicated for s in jax.tree.leaves(nu_sh))  # NorMuon's state sharded
def update(g, s, p):  # traced under the mesh, as the trainer's step is
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    return tx.update(g, s, p)
step = jax.jit(update, in_shardings=(p_sh, s_sh, p_sh), out_shardings=(p_sh, s_sh))
got, got_state = step(jax.device_put(grads, p_sh), jax.device_put(state, s_sh),
                      jax.device_put(params, p_sh))
for a, b in zip(jax.tree.leaves((got, got_state)), jax.tree.leaves((want, want_state))):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
print("ok")
"""


def test_sharded_state_gives_the_single_device_update():
  import subprocess
  import sys
  proc = subprocess.run([sys.executable, "-c", _SHARDED], capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
