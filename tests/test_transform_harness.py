"""Shared harness: every public transform under jit, bf16/f32, chain, inject, MultiSteps.

To check a new transform against an independent reference, add a ``Case`` to ``CASES`` (and its
public names to ``DOCUMENTED``); every test below then runs on it. Every declared defence of the
trainer also goes through the generic half of the harness from its declaration alone (at the
end).
"""

import dataclasses
import doctest
import functools
import subprocess
import sys
import textwrap
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import stablejax
from test_zclip import reference_zclip


@dataclasses.dataclass(frozen=True)
class Inject:
  """A factory, its keyword arguments and static_args for optax.inject_hyperparams."""

  factory: Callable[..., optax.GradientTransformation]
  kwargs: dict
  static_args: tuple = ()

  def build(self, **options):
    return optax.inject_hyperparams(self.factory, static_args=self.static_args,
                                    **options)(**self.kwargs)


@dataclasses.dataclass(frozen=True)
class Case:
  """One public transform to put through the harness.

  Attributes:
    name: test id.
    make: builds the transform (short warmups so a few steps reach every
      branch).
    inject: the factory and arguments to build it through
      ``optax.inject_hyperparams`` (None when that is not meaningful).
    takes_loss: the update accepts / needs ``loss=``.
    flags: whether a step was flagged (clipped, detected or skipped), from
      ``(stability_metrics, raw gradient norm, update norm)`` after it; the
      x50 spike of ``SPIKE_STEP`` must be flagged, no earlier step.
    flags_spike: False for a transform that must let a finite spike through.
  """

  name: str
  make: Callable[[], optax.GradientTransformation]
  inject: Optional["Inject"] = None
  takes_loss: bool = False
  flags: Callable[[dict, float, float], bool] = lambda m, g, u: False
  flags_spike: bool = True


CASES = [
    Case("zclip",
         lambda: stablejax.zclip(warmup_steps=2),
         Inject(stablejax.zclip, dict(alpha=0.9, z_thresh=2.0, max_grad_norm=5.0,
                                      warmup_steps=2)),
         flags=lambda m, g, u: bool(m["zclip/is_spike"]) and u <= 1.0 + 1e-2),
    Case("zclip_percentile_no_ceiling",
         lambda: stablejax.zclip(warmup_steps=2, mode="percentile",
                                 max_grad_norm=None),
         flags=lambda m, g, u: bool(m["zclip/is_spike"]) and u < g / 10),
    Case("adagc",
         lambda: stablejax.adagc(warmup_steps=2),
         Inject(stablejax.adagc, dict(beta=0.9, lambda_rel=1.1, warmup_steps=2)),
         # every tensor is clipped on every step here; the spike is clipped to its history
         flags=lambda m, g, u: u < g / 100),
    Case("hybrid_clip",
         lambda: stablejax.hybrid_clip(zclip_warmup_steps=2,
                                       adagc_warmup_steps=2),
         Inject(stablejax.hybrid_clip, dict(zclip_z_thresh=2.0, adagc_beta=0.95,
                                            zclip_warmup_steps=2, adagc_warmup_steps=2)),
         flags=lambda m, g, u: bool(m["zclip/is_spike"]) and u <= 1.0 + 1e-2),
    Case("skip_nonfinite",
         lambda: stablejax.skip_nonfinite(optax.adam(1e-3), max_consecutive=2),
         Inject(stablejax.skip_nonfinite, dict(inner=optax.adam(1e-3), max_consecutive=2)),
         takes_loss=True,
         flags=lambda m, g, u: bool(m["skip_nonfinite/skipped"]),
         flags_spike=False),  # a finite spike is not its business
    Case("skip_spikes",
         lambda: stablejax.skip_spikes(optax.adam(1e-3), window=4,
                                       min_history=2),
         Inject(stablejax.skip_spikes, dict(inner=optax.adam(1e-3), window=4, min_history=2,
                                            sigma=3.0), static_args=("window",)),
         takes_loss=True,
         flags=lambda m, g, u: bool(m["skip_spikes/skipped"]) and u == 0.0),
]

# (public object, needs an arXiv reference)
DOCUMENTED = [
    (stablejax.zclip, True),
    (stablejax.adagc, True),
    (stablejax.hybrid_clip, True),
    (stablejax.skip_nonfinite, True),
    (stablejax.skip_spikes, True),
    (stablejax.cross_entropy_with_z_loss, True),
    (stablejax.DynamicLossScale, True),
    (stablejax.DynamicLossScale.create, False),
    (stablejax.DynamicLossScale.scale, False),
    (stablejax.DynamicLossScale.unscale, False),
    (stablejax.DynamicLossScale.adjust, False),
    (stablejax.stability_metrics, False),
    (stablejax.register_state_metrics, False),
]

STEPS = 4
SPIKE_STEP = 3


def _toy_params(dtype):
  return {"w": jnp.linspace(-1, 1, 12, dtype=jnp.float32).reshape(4, 3)
               .astype(dtype),
          "b": jnp.zeros(3, dtype),
          "emb": jnp.ones((5, 4), dtype)}


def _grads(t, dtype):
  rng = np.random.default_rng(t)
  scale = 50.0 if t == SPIKE_STEP else 1.0
  return {k: jnp.asarray(rng.normal(0, 0.5 * scale, v.shape), dtype)
          for k, v in _toy_params(jnp.float32).items()}


def _signature(tree):
  leaves, treedef = jax.tree.flatten(tree)
  return treedef, [(jnp.shape(x), jnp.asarray(x).dtype,
                    getattr(x, "weak_type", False)) for x in leaves]


def _drive(tx, dtype, takes_loss, history=None):
  """Runs STEPS jitted updates; checks dtypes, state signature, single trace.

  Appends ``(updates as float32 numpy, stability_metrics, raw gradient norm,
  update norm)`` of each step to ``history`` when given.
  """
  params = _toy_params(dtype)
  state = tx.init(params)
  init_sig = _signature(state)
  traces = []

  def step(state, grads, params, loss):
    traces.append(1)
    extra = {"loss": loss} if takes_loss else {}
    return tx.update(grads, state, params, **extra)

  step = jax.jit(step)
  for t in range(STEPS):
    grads = _grads(t, dtype)
    loss = jnp.float32(2.0 + (10.0 if t == SPIKE_STEP else 0.0))
    updates, state = step(state, grads, params, loss)
    assert jax.tree.structure(updates) == jax.tree.structure(grads)
    for u, g in zip(jax.tree.leaves(updates), jax.tree.leaves(grads)):
      assert u.dtype == g.dtype and u.shape == g.shape
      assert np.all(np.isfinite(np.asarray(u, np.float32)))
    assert _signature(state) == init_sig
    if history is not None:
      f32 = lambda tree: jax.tree.map(lambda x: np.asarray(x, np.float32), tree)  # noqa: E731
      history.append((f32(updates), {k: np.asarray(v) for k, v in
                                     stablejax.stability_metrics(state).items()},
                      float(optax.tree.norm(f32(grads))), float(optax.tree.norm(f32(updates)))))
    params = optax.apply_updates(params, updates)
    assert all(p.dtype == dtype for p in jax.tree.leaves(params))
  assert len(traces) == 1, "state signature changed between steps (retrace)"
  return state


_IDS = [c.name for c in CASES]


@functools.lru_cache(maxsize=None)
def _alone(name, dtype):
  """The history of one case driven alone (once per process: three tests read it)."""
  case = next(c for c in CASES if c.name == name)
  history = []
  _drive(case.make(), dtype, case.takes_loss, history)
  return history


# ---------------------------------------------------------------- independent expected values


def _zclip_scales(norms, warmup, ceiling, mode):
  """Per-step ZClip scale of the default hyperparameters, re-derived in float64."""
  return [scale for scale, _, _, _ in reference_zclip(
      norms, alpha=0.97, z_thresh=2.5, max_grad_norm=ceiling, eps=1e-6, warmup_steps=warmup,
      mode=mode, clip_option="adaptive_scaling", clip_factor=1.0, skip_update_on_spike=False)]


def _adagc_updates(grads, warmup, beta=0.98, lambda_rel=1.05, lambda_abs=1.0):
  """AdaGC (per leaf: no leaf of _params is scan-stacked) re-derived in float64."""
  gamma = {k: np.inf for k in grads[0]}
  out = []
  for t, g in enumerate(grads):
    norms = {k: np.sqrt(np.sum(v ** 2)) for k, v in g.items()}
    total = np.sqrt(sum(n ** 2 for n in norms.values()))
    step = {}
    for k, v in g.items():
      if t < warmup:
        h = min(1.0, lambda_abs / total)
        gamma[k] = min(gamma[k], h * norms[k])
      else:
        h = min(1.0, lambda_rel * gamma[k] / norms[k])
        gamma[k] = beta * gamma[k] + (1 - beta) * h * norms[k]
      step[k] = h * v
    out.append(step)
  return out


def _inner_directly(inner, dtype, grads_of):
  """Updates of `inner` applied directly (no wrapper, no jit) to the harness gradients."""
  state = inner.init(_toy_params(dtype))
  out = []
  for t in range(STEPS):
    updates, state = inner.update(grads_of(t), state)
    out.append({k: np.asarray(v, np.float64) for k, v in updates.items()})
  return out


def _expected(name, dtype):
  """The updates each case must produce on the harness gradients, from an independent source:
  ZClip and AdaGC re-derived in float64 from their papers' rules (on the gradients as rounded to
  `dtype`), the skip wrappers from their inner optax.adam applied directly (a run without a bad
  step is the inner run; skip_spikes drops the x50 step)."""
  grads = [{k: np.asarray(np.asarray(v, np.float32), np.float64)
            for k, v in _grads(t, dtype).items()} for t in range(STEPS)]
  norms = [np.sqrt(sum(np.sum(v ** 2) for v in g.values())) for g in grads]

  def scaled(scales):
    return [{k: v * s for k, v in g.items()} for g, s in zip(grads, scales)]

  if name == "zclip":
    return scaled(_zclip_scales(norms, 2, 1.0, "zscore"))
  if name == "zclip_percentile_no_ceiling":
    return scaled(_zclip_scales(norms, 2, None, "percentile"))
  if name == "adagc":
    return _adagc_updates(grads, 2)
  if name == "hybrid_clip":
    return _adagc_updates(scaled(_zclip_scales(norms, 2, 1.0, "zscore")), 2)
  adam = _inner_directly(optax.adam(1e-3), dtype, lambda t: _grads(t, dtype))
  if name == "skip_nonfinite":
    return adam
  if name == "skip_spikes":  # the x50 step (loss 12 after three 2s) is skipped
    return adam[:SPIKE_STEP] + [{k: np.zeros_like(v) for k, v in adam[SPIKE_STEP].items()}]
  raise KeyError(name)


def _assert_updates_close(got, want, dtype, where, rel=None):
  """Per leaf, to the rounding of `dtype`: float32 1e-5 of the leaf's largest entry, bfloat16
  one percent (8 significant bits), or `rel` of it."""
  rel = rel or (1e-5 if dtype == jnp.float32 else 1e-2)
  assert got.keys() == want.keys()
  for k in want:
    np.testing.assert_allclose(np.asarray(got[k], np.float64), want[k], rtol=0,
                               atol=rel * np.abs(want[k]).max() + 1e-12, err_msg=f"{where} {k}")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=_IDS)
def test_alone(case, dtype):
  history = _alone(case.name, dtype)
  assert len(history) == STEPS
  for t, ((updates, *_), want) in enumerate(zip(history, _expected(case.name, dtype))):
    _assert_updates_close(updates, want, dtype, f"{case.name} step {t}")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=_IDS)
def test_x50_spike_is_flagged_at_its_step(case, dtype):
  history = _alone(case.name, dtype)
  flagged = [case.flags(m, g, u) for _, m, g, u in history]
  assert flagged == [False] * SPIKE_STEP + [case.flags_spike], flagged


@pytest.mark.parametrize("case", CASES, ids=_IDS)
def test_bf16_agrees_with_float32(case):
  # The same gradients rounded to bf16 (8 significant bits): every update leaf agrees with the
  # float32 run to 3% of its largest entry, and every logged statistic to 3% relative. Counts,
  # flags and clipped fractions are decisions, compared through their effect on the updates
  # (bf16 rounding may tip a norm that sits exactly at a threshold, e.g. ZClip's ceiling 1.0
  # meeting AdaGC's warmup clip 1.0, to the other side with no visible effect).
  runs = {dtype: _alone(case.name, dtype) for dtype in (jnp.float32, jnp.bfloat16)}
  for t, (want, got) in enumerate(zip(runs[jnp.float32], runs[jnp.bfloat16])):
    for a, b in zip(jax.tree.leaves(got[0]), jax.tree.leaves(want[0])):
      np.testing.assert_allclose(a, b, rtol=0, atol=0.03 * np.abs(b).max() + 1e-12,
                                 err_msg=f"step {t}")
    assert got[1].keys() == want[1].keys()
    for key in want[1]:
      if not np.issubdtype(want[1][key].dtype, np.floating) or key.endswith("_fraction"):
        continue
      np.testing.assert_allclose(got[1][key], want[1][key], rtol=0.03, atol=1e-6,
                                 err_msg=f"step {t} {key}")


@pytest.mark.parametrize("case", CASES, ids=_IDS)
def test_in_chain_bf16(case):
  # The chain's updates are optax's Adam (float32, applied directly) of the case's expected
  # updates: the case feeds the rest of the chain what it promises, in bf16.
  history = []
  _drive(optax.chain(case.make(), optax.scale_by_adam(), optax.scale(-1e-3)),
         jnp.bfloat16, case.takes_loss, history)
  expected = _expected(case.name, jnp.bfloat16)
  rest = optax.chain(optax.scale_by_adam(), optax.scale(-1e-3))
  want = _inner_directly(rest, jnp.float32,
                         lambda t: {k: jnp.asarray(v, jnp.float32) for k, v in expected[t].items()})
  for t, ((updates, *_), w) in enumerate(zip(history, want)):
    # 3%: the chain's Adam moments are bf16 too (as in test_bf16_agrees_with_float32).
    _assert_updates_close(updates, w, jnp.bfloat16, f"{case.name} in a chain, step {t}", 0.03)


@pytest.mark.parametrize("case", [c for c in CASES if c.inject is not None],
                         ids=[c.name for c in CASES if c.inject is not None])
def test_inject_hyperparams_bf16(case):
  inject = case.inject
  # optax casts injected float hyperparameters to the params' dtype: with bf16 params they are
  # rounded to bf16 (alpha 0.9 -> 0.8984), so the transform differs from the one built directly.
  state = _drive(inject.build(), jnp.bfloat16, case.takes_loss)
  rounded = {k: v for k, v in inject.kwargs.items()
             if isinstance(v, float) and k not in inject.static_args}
  for k, v in rounded.items():
    assert state.hyperparams[k].dtype == jnp.bfloat16
    assert float(state.hyperparams[k]) == float(jnp.asarray(v, jnp.bfloat16))
  # hyperparam_dtype=float32 keeps them exact: then the injected transform is the directly
  # built one, step for step (updates and logged statistics, through the wrapper).
  injected, direct = [], []
  _drive(inject.build(hyperparam_dtype=jnp.float32), jnp.bfloat16, case.takes_loss, injected)
  _drive(inject.factory(**inject.kwargs), jnp.bfloat16, case.takes_loss, direct)
  for (u_i, m_i, _, _), (u_d, m_d, _, _) in zip(injected, direct):
    for a, b in zip(jax.tree.leaves(u_i), jax.tree.leaves(u_d)):
      np.testing.assert_allclose(a, b, rtol=1e-6, atol=0)
    assert m_i.keys() == m_d.keys() and m_i
    for key in m_d:
      np.testing.assert_allclose(np.asarray(m_i[key], np.float64),
                                 np.asarray(m_d[key], np.float64), rtol=1e-5, err_msg=key)


@pytest.mark.parametrize("case", CASES, ids=_IDS)
def test_multisteps(case):
  tx = optax.MultiSteps(case.make(), every_k_schedule=2)
  state = _drive(tx, jnp.float32, case.takes_loss)
  assert int(state.gradient_step) == STEPS // 2


@pytest.mark.parametrize("obj,needs_arxiv", DOCUMENTED,
                         ids=[o.__qualname__ for o, _ in DOCUMENTED])
def test_docstrings(obj, needs_arxiv):
  doc = obj.__doc__ or ""
  for section in ("Args:", "Returns:", "Example"):
    assert section in doc, f"{obj.__qualname__} docstring lacks {section!r}"
  if needs_arxiv:
    assert "arxiv" in doc.lower(), f"{obj.__qualname__} lacks an arXiv reference"
  # The examples run and print what they claim.
  runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
  tests = doctest.DocTestFinder(recurse=False).find(
      obj, obj.__qualname__, globs={})
  assert tests and tests[0].examples, f"{obj.__qualname__}: no runnable example"
  for test in tests:
    runner.run(test)
  assert runner.failures == 0, f"{obj.__qualname__}: example failed"


def test_every_public_transform_is_covered():
  exported = {n for n in stablejax.__all__ if n in {
      "zclip", "adagc", "hybrid_clip", "skip_nonfinite", "skip_spikes"}}
  covered = {c.name for c in CASES}
  assert exported <= covered
  for name in exported:
    assert getattr(stablejax, name) in [o for o, _ in DOCUMENTED]


_SHARDING_SCRIPT = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=4")
    import jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import NamedSharding, PartitionSpec as P
    import stablejax

    devices = jax.devices()
    assert len(devices) == 4, devices
    mesh = jax.sharding.Mesh(np.array(devices), ("fsdp",))
    w_sharding = NamedSharding(mesh, P("fsdp", None))
    replicated = NamedSharding(mesh, P())
    tx = stablejax.skip_nonfinite(stablejax.skip_spikes(optax.chain(
        stablejax.hybrid_clip(zclip_warmup_steps=2, adagc_warmup_steps=2),
        optax.adamw(1e-2)), window=4, min_history=2), max_consecutive=3)

    def grads(t):
        rng = np.random.default_rng(t)
        s = 30.0 if t == 4 else 1.0
        return {"w": rng.normal(0, s, (8, 4)).astype(np.float32),
                "b": rng.normal(0, s, (4,)).astype(np.float32)}

    def step(params, state, g, loss):
        updates, state = tx.update(g, state, params, loss=loss)
        return optax.apply_updates(params, updates), state

    def run(put_w, put_rest):
        params = {"w": put_w(jnp.linspace(-1, 1, 32).reshape(8, 4)),
                  "b": put_rest(jnp.zeros(4))}
        state = jax.jit(tx.init)(params)
        f = jax.jit(step, donate_argnums=(1,))
        for t in range(7):
            g = grads(t)
            g = {"w": put_w(g["w"]), "b": put_rest(g["b"])}
            params, state = f(params, state, g, put_rest(jnp.float32(t % 3)))
        return params, state

    sharded = run(lambda x: jax.device_put(x, w_sharding),
                  lambda x: jax.device_put(x, replicated))
    single = run(lambda x: jax.device_put(x, devices[0]),
                 lambda x: jax.device_put(x, devices[0]))
    params, state = sharded
    for leaf in jax.tree.leaves(state):
        assert leaf.sharding.device_set == set(devices), leaf.sharding
    adam_mu = state.inner_state.inner_state[1][0].mu["w"]
    assert adam_mu.sharding.is_equivalent_to(w_sharding, 2), adam_mu.sharding
    assert params["w"].sharding.is_equivalent_to(w_sharding, 2)
    for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(single)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b),
                                   rtol=1e-5, atol=1e-7)
    m = stablejax.stability_metrics(state)
    assert int(m["zclip/spike_count"]) >= 1, m
    print("SHARDING_OK")
""")


def test_state_keeps_sharding_on_a_4_device_mesh():
  proc = subprocess.run([sys.executable, "-c", _SHARDING_SCRIPT],
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-4000:]
  assert "SHARDING_OK" in proc.stdout


# ------------------------------------------------------------------------ every declared defence


def _declared() -> list:
  """The trainer's declared defences whose update needs nothing from a model (``loss`` at most)
  and returns updates in the gradients' dtype: the registry, so a new defence is covered here
  with no edit of this file. (A defence that changes how updates are applied, the compensated
  update, returns float32 differences of bf16 parameters; tests/test_compensated.py. One with a
  half before the learning-rate scale is whole only in the trainer's chain, around the
  optimizer whose matrices and rates it reads: Hyperball, tests/test_hyperball.py.)"""
  from stablejax.transforms import defence
  return [d for d in defence.registered()
          if set(d.step_args) <= {"loss"} and not d.changes_update_application
          and d.before_scale is None]


def _declared_tx(d):
  from stablejax.training.config import Config
  from stablejax.transforms import defence
  made = d.make(d.config(), defence.DefenceContext(stability=Config().stability))
  return made(optax.adam(1e-3)) if d.position is defence.Position.WRAPPER else made


@pytest.mark.parametrize("name", [d.name for d in _declared()])
def test_every_declared_defence_at_its_defaults_jits_keeps_dtypes_and_agrees_in_bf16(name):
  # The generic half of the harness, from the declaration alone: one trace, the gradients'
  # dtypes and shapes, a state of fixed signature, finite updates (_drive checks these), and a
  # bf16 run within 3% of the float32 one.
  from stablejax.transforms import defence
  d = defence.get(name)
  runs = {}
  for dtype in (jnp.float32, jnp.bfloat16):
    runs[dtype] = []
    _drive(_declared_tx(d), dtype, "loss" in d.step_args, runs[dtype])
  for t, (want, got) in enumerate(zip(runs[jnp.float32], runs[jnp.bfloat16])):
    for a, b in zip(jax.tree.leaves(got[0]), jax.tree.leaves(want[0])):
      np.testing.assert_allclose(a, b, rtol=0, atol=0.03 * np.abs(b).max() + 1e-12,
                                 err_msg=f"{name} step {t}")
