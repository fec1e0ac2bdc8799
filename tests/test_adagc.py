"""AdaGC against an independent float64 re-derivation of the paper's update."""

import functools
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import stablejax
from helpers import scan_updates

STEPS = 300
SHAPES = {"emb": (6, 4), "w": (4, 4), "b": (4,)}


def _grad_sequence(seed):
  """Per-tensor grads with different scales, a drift and per-tensor spikes."""
  rng = np.random.default_rng(seed)
  scales = {"emb": 0.3, "w": 0.8, "b": 0.05}
  grads = {}
  for k, shape in SHAPES.items():
    g = rng.standard_normal((STEPS,) + shape) * scales[k]
    g *= np.linspace(1.0, 0.5, STEPS).reshape((-1,) + (1,) * len(shape))
    grads[k] = g
  grads["w"][[5, 40, 41, 130, 260]] *= 20.0   # spikes in one tensor
  grads["emb"][[90, 200]] *= 50.0
  grads["b"][[150, 151, 152]] *= 8.0
  return {k: v.astype(np.float32) for k, v in grads.items()}


def reference_adagc(grads, beta, lambda_rel, lambda_abs, warmup_steps):
  """Plain-Python AdaGC (float64). Returns per-step scales and gammas."""
  gamma = {k: np.inf for k in grads}
  scales, gammas = [], []
  for t in range(STEPS):
    g = {k: grads[k][t].astype(np.float64) for k in grads}
    norm = {k: np.sqrt(np.sum(g[k]**2)) for k in g}
    h = {}
    if t < warmup_steps:
      total = np.sqrt(sum(n**2 for n in norm.values()))
      for k in g:
        h[k] = min(1.0, lambda_abs / total)
        clipped = np.sqrt(np.sum((h[k] * g[k])**2))
        gamma[k] = min(gamma[k], clipped)
    else:
      for k in g:
        h[k] = min(1.0, lambda_rel * gamma[k] / norm[k])
        clipped = np.sqrt(np.sum((h[k] * g[k])**2))
        gamma[k] = beta * gamma[k] + (1 - beta) * clipped
    scales.append(dict(h))
    gammas.append(dict(gamma))
  return scales, gammas


@pytest.mark.parametrize("beta,lambda_rel,lambda_abs,warmup_steps", [
    (0.98, 1.05, 1.0, 20),
    (0.9, 1.5, 0.5, 100),
])
def test_matches_reference(beta, lambda_rel, lambda_abs, warmup_steps):
  grads = _grad_sequence(int(beta * 100))
  ref_scales, ref_gammas = reference_adagc(grads, beta, lambda_rel, lambda_abs,
                                           warmup_steps)
  updates, states = scan_updates(
      stablejax.adagc(beta=beta, lambda_rel=lambda_rel, lambda_abs=lambda_abs,
                      warmup_steps=warmup_steps), grads)
  for k, shape in SHAPES.items():
    h = np.array([s[k] for s in ref_scales]).reshape((-1,) + (1,) * len(shape))
    np.testing.assert_allclose(updates[k], grads[k] * h, rtol=2e-5, atol=1e-8)
    np.testing.assert_allclose(states.gamma[k], [g[k] for g in ref_gammas],
                               rtol=2e-5)
  h_all = np.array([[s[k] for k in SHAPES] for s in ref_scales])
  clipped = h_all < 1.0
  # The injected spikes were clipped after warmup, tensor by tensor.
  assert clipped[warmup_steps:].sum() >= 5
  assert not clipped[warmup_steps:].all(axis=1).all()
  np.testing.assert_allclose(states.clipped_fraction, clipped.mean(axis=1))
  norms = np.sqrt(sum((grads[k].astype(np.float64)**2).reshape(STEPS, -1)
                      .sum(axis=1) for k in SHAPES))
  np.testing.assert_allclose(states.grad_norm, norms, rtol=1e-5)
  after = np.sqrt(sum(((grads[k] * h_all[:, i].reshape(
      (-1,) + (1,) * len(SHAPES[k]))).astype(np.float64)**2).reshape(
          STEPS, -1).sum(axis=1) for i, k in enumerate(SHAPES)))
  np.testing.assert_allclose(states.clipped_grad_norm, after, rtol=2e-5)
  np.testing.assert_array_equal(states.count, np.arange(1, STEPS + 1))


def test_gamma_starts_infinite_per_leaf_float32():
  params = {"a": jnp.zeros((2, 3), jnp.bfloat16), "b": [jnp.zeros(2)]}
  state = stablejax.adagc().init(params)
  gammas = jax.tree.leaves(state.gamma)
  assert len(gammas) == 2
  for g in gammas:
    assert g.shape == () and g.dtype == jnp.float32 and np.isinf(g)


def test_nonfinite_step_leaves_gamma_untouched_and_bf16_kept():
  tx = stablejax.adagc(warmup_steps=2)
  params = {"a": jnp.zeros(3, jnp.bfloat16), "b": jnp.zeros(2, jnp.bfloat16)}
  state = tx.init(params)
  update = jax.jit(tx.update)
  for v in (0.2, 0.3, 0.25):
    g = {"a": jnp.full(3, v, jnp.bfloat16), "b": jnp.full(2, v, jnp.bfloat16)}
    updates, state = update(g, state, params)
    assert all(u.dtype == jnp.bfloat16 for u in jax.tree.leaves(updates))
  bad = {"a": jnp.array([jnp.nan, 1, 1], jnp.bfloat16),
         "b": jnp.ones(2, jnp.bfloat16)}
  _, new_state = update(bad, state, params)
  assert int(new_state.count) == int(state.count)
  for old, new in zip(jax.tree.leaves(state.gamma),
                      jax.tree.leaves(new_state.gamma)):
    assert float(old) == float(new) and np.isfinite(float(new))


def test_zero_gradient_tensor_is_not_nan():
  tx = stablejax.adagc(warmup_steps=1)
  params = {"a": np.zeros(3, np.float32), "frozen": np.zeros(2, np.float32)}
  state = tx.init(params)
  update = jax.jit(tx.update)  # eagerly, each operation compiles on its own
  for _ in range(3):
    updates, state = update({"a": np.ones(3, np.float32), "frozen": np.zeros(2, np.float32)},
                            state, params)
  assert np.all(np.isfinite(updates["frozen"]))
  assert np.all(updates["frozen"] == 0)


def test_chain_with_optax_matches_manual():
  tx = optax.chain(stablejax.adagc(warmup_steps=1, lambda_abs=0.5),
                   optax.sgd(1.0))
  params = {"a": np.zeros(4, np.float32)}
  state = tx.init(params)
  updates, state = jax.jit(tx.update)({"a": np.full(4, 1.0, np.float32)}, state, params)
  # Warmup global clip to 0.5, then SGD with lr 1 negates.
  np.testing.assert_allclose(updates["a"], -0.25 * np.ones(4), rtol=1e-5)


@pytest.mark.parametrize("kwargs", [
    dict(beta=1.0), dict(lambda_rel=0.0), dict(lambda_abs=-1.0),
    dict(warmup_steps=0),
])
def test_bad_arguments_raise(kwargs):
  with pytest.raises(ValueError, match=next(iter(kwargs))):
    stablejax.adagc(**kwargs)


def test_hybrid_clip_is_zclip_then_adagc():
  grads = _grad_sequence(3)
  kwargs_z = dict(alpha=0.9, z_thresh=2.0, max_grad_norm=3.0, warmup_steps=10)
  kwargs_a = dict(beta=0.95, lambda_rel=1.1, lambda_abs=2.0, warmup_steps=15)
  hybrid = stablejax.hybrid_clip(
      **{f"zclip_{k}": v for k, v in kwargs_z.items()},
      **{f"adagc_{k}": v for k, v in kwargs_a.items()})
  chained = optax.chain(stablejax.zclip(**kwargs_z),
                        stablejax.adagc(**kwargs_a))
  u_h, s_h = scan_updates(hybrid, grads)
  u_c, s_c = scan_updates(chained, grads)
  assert isinstance(s_h, stablejax.HybridClipState)
  for k in SHAPES:
    np.testing.assert_array_equal(u_h[k], u_c[k])
  assert int(s_h.zclip.spike_count[-1]) > 0
  assert float(s_h.adagc.clipped_fraction.max()) > 0
  for a, b in zip(jax.tree.leaves((s_h.zclip, s_h.adagc)),
                  jax.tree.leaves(s_c)):
    np.testing.assert_array_equal(a, b)


def reference_adagc_tensors(tensors, beta, lambda_rel, lambda_abs, warmup_steps):
  """float64 AdaGC over named tensors ``{name: [T, ...]}``, one threshold per name.

  As the paper, except that a zero norm never initialises gamma: during warmup
  ``gamma = min(gamma, ||g_hat||)`` only for a non-zero norm, and after warmup a
  gamma that is still infinite starts at the first non-zero clipped norm.
  """
  steps = len(next(iter(tensors.values())))
  gamma = {k: np.inf for k in tensors}
  scales, gammas = [], []
  for t in range(steps):
    g = {k: v[t].astype(np.float64) for k, v in tensors.items()}
    norm = {k: np.sqrt(np.sum(x**2)) for k, x in g.items()}
    total = np.sqrt(sum(n**2 for n in norm.values()))
    h = {}
    for k in g:
      if t < warmup_steps:
        h[k] = min(1.0, lambda_abs / total)
        if norm[k] > 0:
          gamma[k] = min(gamma[k], h[k] * norm[k])
      else:
        h[k] = 1.0 if norm[k] == 0 else min(1.0, lambda_rel * gamma[k] / norm[k])
        if np.isinf(gamma[k]):
          gamma[k] = h[k] * norm[k] if norm[k] > 0 else np.inf
        else:
          gamma[k] = beta * gamma[k] + (1 - beta) * h[k] * norm[k]
    scales.append(h)
    gammas.append(dict(gamma))
  return scales, gammas


def test_tensor_with_zero_gradient_during_warmup_trains_after_it():
  # A zero-initialised output projection gives the layers before it an exactly zero gradient on
  # the first step; with the paper's gamma = min(gamma, 0) = 0 they would be frozen for good.
  rng = np.random.default_rng(0)
  steps, warmup = 30, 5
  grads = {k: (rng.standard_normal((steps, 3, 4)) * s).astype(np.float32)
           for k, s in (("w", 1.0), ("q", 0.5), ("late", 0.2))}
  grads["q"][:2] = 0.0        # zero on the first two warmup steps, then normal
  grads["late"][:warmup] = 0.0  # zero during the whole warmup
  grads["q"][20] *= 30.0      # a spike after warmup is still clipped
  kw = dict(beta=0.9, lambda_rel=1.05, lambda_abs=1.0, warmup_steps=warmup)
  ref_scales, ref_gammas = reference_adagc_tensors(grads, **kw)
  updates, states = scan_updates(stablejax.adagc(**kw), grads)
  for k in grads:
    h = np.array([s[k] for s in ref_scales]).reshape(-1, 1, 1)
    np.testing.assert_allclose(updates[k], grads[k] * h, rtol=2e-5, atol=1e-8)
    np.testing.assert_allclose(states.gamma[k], [g[k] for g in ref_gammas], rtol=2e-5)
  for k in ("q", "late"):
    after = np.abs(updates[k][warmup:]).reshape(steps - warmup, -1).sum(axis=1)
    assert np.all(after > 0), k   # trains normally after warmup
  assert ref_scales[20]["q"] < 0.2  # and its spike is clipped against a real gamma


def _stacked_grads(steps=40, layers=3, seed=1):
  rng = np.random.default_rng(seed)
  grads = {
      "blocks": {"attn": {"kernel": rng.standard_normal((steps, layers, 4, 5)) * 0.5},
                 "attn_norm": {"scale": rng.standard_normal((steps, layers, 4)) * 0.1}},
      "lm_head": {"kernel": rng.standard_normal((steps, 4, 6)) * 0.3},
  }
  # Layer 0 has ten times the gradient of layers 1 and 2; layer 2 spikes once.
  grads["blocks"]["attn"]["kernel"][:, 0] *= 10.0
  grads["blocks"]["attn"]["kernel"][25, 2] *= 8.0
  return jax.tree.map(lambda x: x.astype(np.float32), grads)


def _split_layers(grads):
  """Named per-layer tensors of a scan-stacked gradient tree, for the reference."""
  out = {"lm_head": grads["lm_head"]["kernel"]}
  for name, leaf in (("attn", grads["blocks"]["attn"]["kernel"]),
                     ("attn_norm", grads["blocks"]["attn_norm"]["scale"])):
    for layer in range(leaf.shape[1]):
      out[f"{name}/{layer}"] = leaf[:, layer]
  return out


def test_scan_stacked_leaf_gets_one_threshold_per_layer():
  grads = _stacked_grads()
  kw = dict(beta=0.9, lambda_rel=1.05, lambda_abs=100.0, warmup_steps=10)
  ref_scales, ref_gammas = reference_adagc_tensors(_split_layers(grads), **kw)
  updates, states = scan_updates(stablejax.adagc(**kw), grads)
  assert states.gamma["blocks"]["attn"]["kernel"].shape == (40, 3)   # [steps, L]
  assert states.gamma["lm_head"]["kernel"].shape == (40,)
  for name, path in (("attn", ("attn", "kernel")), ("attn_norm", ("attn_norm", "scale"))):
    got_u = updates["blocks"][path[0]][path[1]]
    got_g = states.gamma["blocks"][path[0]][path[1]]
    g = grads["blocks"][path[0]][path[1]]
    for layer in range(3):
      h = np.array([s[f"{name}/{layer}"] for s in ref_scales])
      h_per_step = h.reshape((-1,) + (1,) * (g.ndim - 2))
      np.testing.assert_allclose(got_u[:, layer], g[:, layer] * h_per_step, rtol=2e-5, atol=1e-8)
      np.testing.assert_allclose(got_g[:, layer], [x[f"{name}/{layer}"] for x in ref_gammas],
                                 rtol=2e-5)
  # The spike of layer 2 is clipped against layer 2's own gamma; one shared threshold (the
  # per-leaf rule) would be set by layer 0's larger norms and let it through.
  layer2 = np.array([s["attn/2"] for s in ref_scales[10:]])
  assert ref_scales[25]["attn/2"] < 0.3 * np.median(layer2)
  tensors = len(ref_scales[0])
  clipped = np.array([[s[k] < 1.0 for k in s] for s in ref_scales])
  assert tensors == 7
  np.testing.assert_allclose(states.clipped_fraction, clipped.mean(axis=1), rtol=1e-6)


def test_per_leaf_threshold_is_one_argument_away():
  grads = _stacked_grads()
  kw = dict(beta=0.9, lambda_rel=1.05, lambda_abs=100.0, warmup_steps=10)
  whole = {"attn": grads["blocks"]["attn"]["kernel"],
           "attn_norm": grads["blocks"]["attn_norm"]["scale"],
           "lm_head": grads["lm_head"]["kernel"]}
  ref_scales, _ = reference_adagc_tensors(whole, **kw)
  updates, states = scan_updates(stablejax.adagc(**kw, stacked_names=()), grads)
  assert states.gamma["blocks"]["attn"]["kernel"].shape == (40,)
  h = np.array([s["attn"] for s in ref_scales]).reshape(-1, 1, 1, 1)
  np.testing.assert_allclose(updates["blocks"]["attn"]["kernel"],
                             grads["blocks"]["attn"]["kernel"] * h, rtol=2e-5, atol=1e-8)
  # Per leaf, the layer-2 spike is clipped no harder than an ordinary step.
  leaf = np.array([s["attn"] for s in ref_scales[10:]])
  assert ref_scales[25]["attn"] > 0.5 * np.median(leaf)


def test_stacked_leaf_recognition():
  params = {"blocks": {"mlp": {"kernel": jnp.zeros((2, 3, 4))}},     # nn.scan: stacked
            "h": {"0": {"attn": {"kernel": jnp.zeros((3, 4))}}},      # unrolled list: not stacked
            "layers": {"bias": jnp.zeros((2, 4)), "step": jnp.zeros(())},
            "head": {"kernel": jnp.zeros((3, 4))}}
  gamma = stablejax.adagc().init(params).gamma
  assert gamma["blocks"]["mlp"]["kernel"].shape == (2,)
  assert gamma["h"]["0"]["attn"]["kernel"].shape == ()
  assert gamma["layers"]["bias"].shape == (2,)
  assert gamma["layers"]["step"].shape == ()      # a scalar has no layer axis
  assert gamma["head"]["kernel"].shape == ()
  custom = stablejax.adagc(stacked_names=("head",)).init(params).gamma
  assert custom["head"]["kernel"].shape == (3,) and custom["blocks"]["mlp"]["kernel"].shape == ()


def test_hybrid_clip_passes_stacked_names():
  grads = _stacked_grads()
  for names in ((), ("blocks",)):
    hybrid = stablejax.hybrid_clip(adagc_warmup_steps=10, adagc_stacked_names=names)
    chained = optax.chain(stablejax.zclip(), stablejax.adagc(warmup_steps=10, stacked_names=names))
    u_h, _ = scan_updates(hybrid, grads)
    u_c, _ = scan_updates(chained, grads)
    for a, b in zip(jax.tree.leaves(u_h), jax.tree.leaves(u_c)):
      np.testing.assert_array_equal(a, b)


# Non-default values of every ZClip / AdaGC option, chosen so each changes the result on
# _grad_sequence(3) (checked below): a hybrid_clip that dropped or misrouted one would differ
# from the chain built by hand.
ZCLIP_OPTIONS = dict(alpha=0.8, z_thresh=1.5, max_grad_norm=2.0, eps=0.5, warmup_steps=7,
                     mode="percentile", clip_option="mean", clip_factor=0.5,
                     skip_update_on_spike=True)
ADAGC_OPTIONS = dict(beta=0.9, lambda_rel=1.2, lambda_abs=0.5, warmup_steps=9,
                     stacked_names=("w",))
_ZCLIP_BASE = dict(warmup_steps=10, max_grad_norm=None)  # so the options above are reached
# clip_option and clip_factor act in zscore mode only (eps too, there)
_NEEDS_ZSCORE = {"clip_option", "clip_factor", "eps"}


def test_hybrid_clip_options_cover_every_zclip_and_adagc_argument():
  import inspect
  hybrid = set(inspect.signature(stablejax.hybrid_clip).parameters)
  want = ({f"zclip_{k}" for k in inspect.signature(stablejax.zclip).parameters}
          | {f"adagc_{k}" for k in inspect.signature(stablejax.adagc).parameters})
  assert hybrid == want
  assert set(ZCLIP_OPTIONS) == set(inspect.signature(stablejax.zclip).parameters)
  assert set(ADAGC_OPTIONS) == set(inspect.signature(stablejax.adagc).parameters)
  for name, param in inspect.signature(stablejax.hybrid_clip).parameters.items():
    inner = stablejax.zclip if name.startswith("zclip_") else stablejax.adagc
    default = inspect.signature(inner).parameters[name.split("_", 1)[1]].default
    assert param.default == default, name  # "with the same defaults"


@functools.lru_cache(maxsize=None)
def _hybrid_updates(zclip_options: tuple, adagc_options: tuple):
  """hybrid_clip's updates on _grad_sequence(3) given only these options (``(name, value)``
  pairs): computed once per set, which the tests of every option compare with."""
  tx = stablejax.hybrid_clip(**{f"zclip_{k}": v for k, v in zclip_options},
                             **{f"adagc_{k}": v for k, v in adagc_options})
  return scan_updates(tx, _grad_sequence(3))[0]


@pytest.mark.parametrize("option", sorted(ZCLIP_OPTIONS))
def test_hybrid_clip_forwards_zclip_option(option):
  grads = _grad_sequence(3)
  z = dict(_ZCLIP_BASE)
  if option in _NEEDS_ZSCORE:
    z["mode"] = "zscore"
  z_changed = dict(z, **{option: ZCLIP_OPTIONS[option]})
  hybrid = lambda zk: stablejax.hybrid_clip(  # noqa: E731
      **{f"zclip_{k}": v for k, v in zk.items()}, adagc_stacked_names=())
  u_h, s_h = scan_updates(hybrid(z_changed), grads)
  u_c, s_c = scan_updates(optax.chain(stablejax.zclip(**z_changed),
                                      stablejax.adagc(stacked_names=())), grads)
  for k in SHAPES:
    np.testing.assert_array_equal(u_h[k], u_c[k])
  for a, b in zip(jax.tree.leaves(s_h.zclip), jax.tree.leaves(s_c[0])):
    np.testing.assert_array_equal(a, b)
  u_default = _hybrid_updates(tuple(sorted(z.items())), (("stacked_names", ()),))
  assert any(not np.array_equal(u_h[k], u_default[k]) for k in SHAPES), option  # it matters


@pytest.mark.parametrize("option", sorted(ADAGC_OPTIONS))
def test_hybrid_clip_forwards_adagc_option(option):
  grads = _grad_sequence(3)
  changed = {option: ADAGC_OPTIONS[option]}
  hybrid = lambda ak: stablejax.hybrid_clip(  # noqa: E731
      zclip_warmup_steps=10, **{f"adagc_{k}": v for k, v in ak.items()})
  u_h, s_h = scan_updates(hybrid(changed), grads)
  u_c, s_c = scan_updates(optax.chain(stablejax.zclip(warmup_steps=10),
                                      stablejax.adagc(**changed)), grads)
  for k in SHAPES:
    np.testing.assert_array_equal(u_h[k], u_c[k])
  for a, b in zip(jax.tree.leaves(s_h.adagc), jax.tree.leaves(s_c[1])):
    np.testing.assert_array_equal(a, b)
  u_default = _hybrid_updates((("warmup_steps", 10),), ())
  assert any(not np.array_equal(u_h[k], u_default[k]) for k in SHAPES), option
