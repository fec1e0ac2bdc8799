"""stablejax.hyperball: the Hyperball step against a numpy re-derivation of its formula, the norms
over many steps, the skip wrappers, bf16 parameters, sharding, and the trainer's declaration
(keyed state, the learning-rate scale reaching the step, weight decay refused)."""

import ast
import functools
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax.contrib import MuonDimensionNumbers

import stablejax
from stablejax.transforms.hyperball import normalize_matrix_updates

LAST_TWO = MuonDimensionNumbers(reduction_axis=-2, output_axis=-1)
# w: one matrix; s: a scan-stacked [L, in, out] leaf (L matrices); qkv: a fused [D, 3D] kernel of
# unequal parts (each its own matrix); emb, b: not matrices (left to the optimizer).
MATRICES = {"w": LAST_TWO, "s": LAST_TWO, "emb": None, "b": None,
            "qkv": stablejax.FusedDimensionNumbers(reduction_axis=-2, output_axis=-1,
                                                   fused_axis=-1, parts=(4, 2, 2))}


def _params(seed=0, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  shapes = {"w": (5, 3), "s": (2, 4, 6), "emb": (7, 3), "b": (3,), "qkv": (4, 8)}
  return {k: jnp.asarray(rng.normal(0, 0.5, s), dtype) for k, s in shapes.items()}


def _matrix_slices(name, shape):
  """Index tuples of each matrix of a leaf of MATRICES (numpy's view of the layout)."""
  if name == "s":
    return [(i,) for i in range(shape[0])]
  if name == "qkv":
    return [(slice(None), slice(a, b)) for a, b in ((0, 4), (4, 6), (6, 8))]
  return [()]


def _reference(params0, params, updates, lr, scale=None):
  """The paper's W <- Norm(W + lr Norm(u) ||W0||) ||W0|| per matrix, in float64 numpy. With
  `scale`, the updates are already Norm(u) * scale (prenormalized): W + lr * scale... ."""
  out = {}
  for name, u in updates.items():
    u = np.asarray(u, np.float64)
    if MATRICES[name] is None:
      out[name] = u
      continue
    w = np.asarray(params[name], np.float64)
    w0 = np.asarray(params0[name], np.float64)
    new = np.array(w)
    for idx in _matrix_slices(name, w.shape):
      r = np.linalg.norm(w0[idx])
      step = u[idx] if scale is not None else u[idx] / np.linalg.norm(u[idx])
      moved = w[idx] + lr * step * r
      new[idx] = moved / np.linalg.norm(moved) * r
    out[name] = new - w
  return out


def test_step_is_the_papers_formula():
  params0, params = _params(0), _params(1)   # the state's ||W0|| is not the weights' norm now
  updates = {k: -v for k, v in _params(2).items()}
  tx = stablejax.hyperball(0.05, matrices=MATRICES)
  state = tx.init(params0)
  got, state = jax.jit(tx.update)(updates, state, params)
  want = _reference(params0, params, updates, 0.05)
  for name in MATRICES:
    np.testing.assert_allclose(np.asarray(got[name], np.float64), want[name], rtol=1e-5,
                               atol=1e-6, err_msg=name)
  assert int(state.count) == 1
  # the drift of the weights it was given from the state's norms (float64 re-derivation)
  drift = max(abs(np.linalg.norm(np.asarray(params[n])[i]) / np.linalg.norm(
      np.asarray(params0[n])[i]) - 1) for n in ("w", "s", "qkv")
      for i in _matrix_slices(n, params[n].shape))
  assert float(state.norm_drift) == pytest.approx(drift, rel=1e-5)
  # a schedule is read at the count; a zero update leaves the matrix where it is
  tx = stablejax.hyperball(optax.linear_schedule(0.0, 0.1, 10), matrices=MATRICES)
  zero = jax.tree.map(np.zeros_like, updates)  # numpy: no eager program per shape
  got, _ = jax.jit(tx.update)(zero, tx.init(params), params)
  assert all(np.abs(np.asarray(got[n])).max() < 1e-6 for n in ("w", "s", "qkv"))


def test_prenormalized_steps_carry_the_scale_between():
  # normalize, scale by s, step: the step is lr * s, the formula at rate lr * s
  params0, params = _params(0), _params(1)
  updates = {k: -v for k, v in _params(2).items()}
  normalized, _ = jax.jit(normalize_matrix_updates(MATRICES).update)(updates,
                                                                     optax.EmptyState())
  for name in ("w", "s", "qkv"):
    for idx in _matrix_slices(name, params[name].shape):
      assert np.linalg.norm(np.asarray(normalized[name])[idx]) == pytest.approx(1.0, rel=1e-6)
  np.testing.assert_array_equal(normalized["b"], updates["b"])
  tx = stablejax.hyperball(0.05, matrices=MATRICES, prenormalized=True)
  scaled = jax.tree.map(lambda u: 0.3 * u, normalized)
  got, _ = jax.jit(tx.update)(scaled, tx.init(params0), params)
  want = _reference(params0, params, updates, 0.05 * 0.3)
  for name in ("w", "s", "qkv"):
    np.testing.assert_allclose(np.asarray(got[name], np.float64), want[name], rtol=1e-5,
                               atol=1e-6, err_msg=name)


def _norms(p):
  """The norm of each matrix of w and s, and of each column of qkv, in float32."""
  return {n: jnp.sqrt(jnp.sum(jnp.square(p[n].astype(jnp.float32)),
                              axis=(-2, -1) if n != "qkv" else 0)) for n in ("w", "s", "qkv")}


def _scan(tx, params, steps, grad_scale=1.0):
  """`steps` jitted updates on random gradients in one lax.scan; the relative norm drift of each
  matrix of w, s and qkv at every step, and the final params and state."""

  def run(carry, keys):
    # the initial norms inside the program too: eagerly, each operation compiles on its own
    norms0 = _norms(carry[0])

    def drift(p):
      now = _norms(p)
      # qkv: column norms per part
      parts = jnp.split(now["qkv"] ** 2, [4, 6])
      parts0 = jnp.split(norms0["qkv"] ** 2, [4, 6])
      rel = [jnp.abs(now[n] / norms0[n] - 1).max() for n in ("w", "s")]
      rel += [jnp.abs(jnp.sqrt(a.sum() / b.sum()) - 1) for a, b in zip(parts, parts0)]
      return jnp.max(jnp.stack(rel))

    def body(carry, key):
      p, state = carry
      grads = jax.tree.map(
          lambda x: (grad_scale * jax.random.normal(key, x.shape)).astype(x.dtype), p)
      updates, state = tx.update(grads, state, p)
      p = optax.apply_updates(p, updates)
      return (p, state), drift(p)

    return jax.lax.scan(body, carry, keys)

  keys = jax.random.split(jax.random.key(0), steps)
  (p, state), drifts = jax.jit(run)((params, tx.init(params)), keys)
  return np.asarray(drifts), p, state


def test_norms_stay_at_their_initial_values_over_1000_steps():
  params = _params(0)
  tx = optax.chain(optax.adam(1e-2), stablejax.hyperball(0.05, matrices=MATRICES))
  drifts, p, _ = _scan(tx, params, 1000)
  assert drifts.max() < 1e-5, drifts.max()
  # the matrices moved (not a frozen weight), and plain Adam at that rate does not keep norms
  assert float(jnp.abs(p["w"] - params["w"]).max()) > 0.1
  plain, _, _ = _scan(optax.adam(1e-2), params, 1000)
  assert plain.max() > 0.05


def test_a_skipped_step_leaves_weights_and_norms_bit_identical():
  params = _params(0)
  inner = optax.chain(optax.adam(1e-2), stablejax.hyperball(0.05, matrices=MATRICES))
  for wrapped in (stablejax.skip_nonfinite(inner),
                  stablejax.skip_spikes(inner, window=4, min_history=2)):
    state = wrapped.init(params)
    step = jax.jit(wrapped.update)
    p = params
    for t in range(4):
      g = jax.tree.map(lambda x, v=0.1 * (t + 1): jnp.full(x.shape, v, x.dtype), p)
      updates, state = step(g, state, p, loss=jnp.float32(2.0))
      p = optax.apply_updates(p, updates)
    bad = jax.tree.map(lambda x: jnp.full(x.shape, jnp.nan, x.dtype), p)
    loss = jnp.float32(2.0)
    if "spikes" in type(state).__name__.lower():  # an outlier loss instead of NaN
      bad, loss = jax.tree.map(lambda x: jnp.full(x.shape, 0.1, x.dtype), p), jnp.float32(1e6)
    updates, new_state = step(bad, state, p, loss=loss)
    new_p = optax.apply_updates(p, updates)
    for a, b in zip(jax.tree.leaves((new_p, new_state.inner_state)),
                    jax.tree.leaves((p, state.inner_state))):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(new_state.total_skips) == 1


def test_bf16_parameters_with_the_compensated_update():
  params = _params(0, jnp.bfloat16)
  tx = optax.chain(optax.adam(1e-2), stablejax.hyperball(0.05, matrices=MATRICES),
                   stablejax.compensated_updates())
  drifts, p, _ = _scan(tx, params, 300)
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(p))
  # each step lands within bfloat16 rounding of ||W0|| (8 significant bits: 2**-9 relative per
  # entry, and the Kahan buffer carries one more rounding into the next step), with no drift
  # away from it over the steps (these matrices have 8 to 24 entries: little averaging)
  assert drifts.max() < 2.0**-7, drifts.max()
  assert abs(drifts[-50:].mean() - drifts[:50].mean()) < 2.0**-10
  assert float(jnp.abs(p["w"].astype(jnp.float32) - params["w"].astype(jnp.float32)).max()) > 0.1


_SHARDED = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=4")
    import jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import NamedSharding, PartitionSpec as P
    from optax.contrib import MuonDimensionNumbers
    import stablejax

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("fsdp",))
    last_two = MuonDimensionNumbers(reduction_axis=-2, output_axis=-1)
    matrices = {"w": last_two, "s": last_two, "b": None}
    rng = np.random.default_rng(0)
    params = {"w": rng.normal(size=(16, 8)), "s": rng.normal(size=(2, 8, 16)),
              "b": rng.normal(size=(8,))}
    params = {k: jnp.asarray(v, jnp.float32) for k, v in params.items()}
    grads = jax.tree.map(lambda x: jnp.cos(3.0 * x), params)
    spec = {"w": P("fsdp", None), "s": P(None, None, "fsdp"), "b": P()}
    tx = stablejax.hyperball(0.1, matrices=matrices)

    def step(p, g, s):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    put = lambda t: {k: jax.device_put(v, NamedSharding(mesh, spec[k])) for k, v in t.items()}
    sharded_p, sharded_g = put(params), put(grads)
    state = jax.jit(tx.init)(sharded_p)
    f = jax.jit(step)
    hlo = f.lower(sharded_p, sharded_g, state).compile().as_text()
    new_p, _ = f(sharded_p, sharded_g, state)
    single_p, _ = jax.jit(step)(params, grads, tx.init(params))
    for k in params:
        np.testing.assert_allclose(np.asarray(new_p[k]), np.asarray(single_p[k]), rtol=1e-6,
                                   atol=1e-6)
        assert new_p[k].sharding.is_equivalent_to(sharded_p[k].sharding, params[k].ndim), k
    # (result shapes, op) of each collective: XLA may combine several all-reduces into one
    ops = [(line.split("=", 1)[1].split(" all-")[0].strip(), op)
           for line in hlo.splitlines() for op in ("all-reduce(", "all-reduce-start(",
                                                   "all-gather(", "all-gather-start(")
           if " " + op in line]
    print("COLLECTIVES", ops)
""")


def test_one_reduction_per_sharded_matrix_and_the_same_numbers():
  proc = subprocess.run([sys.executable, "-c", _SHARDED], capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0, proc.stderr[-4000:]
  line = next(x for x in proc.stdout.splitlines() if x.startswith("COLLECTIVES"))
  ops = ast.literal_eval(line.split(" ", 1)[1])
  # two sharded matrix leaves: one reduction of their three sums each (w: f32[3], s: f32[3,2],
  # one per layer slice), whether XLA combines the two all-reduces or not; no gather
  assert not [op for _, op in ops if op.startswith("all-gather")], ops
  shapes = re.findall(r"f32\[[0-9,]*\]", " ".join(shape for shape, _ in ops))
  assert sorted(shapes) == ["f32[3,2]", "f32[3]"], ops


# ----------------------------------------------------------------------------- the trainer


@functools.cache
def _tiny_gpt_params():
  """The tiny config's GPT parameters, initialised once for the module (both optimizers' tests
  train the same model)."""
  from helpers import gpt_params, tiny_config
  return gpt_params(tiny_config().model)


def _trainer_chains(optimizer):
  """The trainer's chain of a tiny config with Hyperball on and the same chain with it off."""
  from helpers import tiny_config
  from stablejax.training.optim import build_optimizer
  # the optimizer, the learning-rate scale and Hyperball: the other defences of the stack off
  # (each compiles code of its own; the keyed state is the same with them)
  base = [f"optimizer.name={optimizer}", "optimizer.learning_rate=0.02", "train.warmup_steps=0",
          "stability.zclip.enabled=false", "stability.skip_spikes.enabled=false",
          "stability.skip_nonfinite.enabled=false"]
  on = tiny_config(*base, "stability.hyperball.enabled=true")
  off = tiny_config(*base)
  assert on.model == off.model == tiny_config().model
  return build_optimizer(on), build_optimizer(off), _tiny_gpt_params()


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_trainer_declaration_keyed_state_and_the_learning_rate_scale(optimizer):
  # The trainer's chain with stability.hyperball on against the same chain with it off and the
  # paper's formula in numpy at the optimizer's rate times the learning-rate scale (which the
  # recovery backs off): the scale reaches the Hyperball step.
  from stablejax.training.optim import set_lr_scale
  on, off, params = _trainer_chains(optimizer)
  state_on, state_off = on.init(params), off.init(params)
  assert isinstance(state_on["hyperball"], stablejax.HyperballState)
  # the normalisation before the scale has no entry: the scale's state is the scale's alone
  assert type(state_on["lr_scale"]) is type(state_off["lr_scale"])
  assert set(state_on) - set(state_off) == {"hyperball"}
  labels = jax.tree.leaves(stablejax.label_params(params))
  # numpy: eagerly, each operation compiles a program per shape
  grads = jax.tree.map(lambda x: np.sin(7.0 * np.asarray(x) + 1.0), params)
  step = jax.jit(lambda tx, g, s, p: tx.update(g, s, p, loss=jnp.float32(3.0)),
                 static_argnums=0)
  for scale in (1.0, 0.25):
    got, _ = step(on, grads, set_lr_scale(state_on, scale), params)
    plain, _ = step(off, grads, set_lr_scale(state_off, scale), params)
    for w, u, g, label in zip(jax.tree.leaves(params), jax.tree.leaves(plain),
                              jax.tree.leaves(got), labels):
      if label != "muon":  # embedding, head, norms: the optimizer's own update
        np.testing.assert_array_equal(np.asarray(g), np.asarray(u))
        continue
      w, u = np.asarray(w, np.float64), np.asarray(u, np.float64)
      want = np.empty_like(w)
      for i in range(w.shape[0]):  # each layer slice of a scan-stacked kernel
        r = np.linalg.norm(w[i])
        moved = w[i] + 0.02 * scale * r * u[i] / np.linalg.norm(u[i])
        want[i] = moved / np.linalg.norm(moved) * r - w[i]
      np.testing.assert_allclose(np.asarray(g, np.float64), want, rtol=1e-4, atol=1e-7)


def test_weight_decay_on_hyperball_matrices_is_one_config_error():
  from stablejax.training.config import ConfigError, load_config
  with pytest.raises(ConfigError) as e:
    load_config(None, ["stability.hyperball.enabled=true", "optimizer.weight_decay=0.1"])
  message = str(e.value)
  assert "\n" not in message
  assert "stability.hyperball" in message and "optimizer.weight_decay=0" in message
  load_config(None, ["stability.hyperball.enabled=true", "optimizer.adam_weight_decay=0.1"])


def test_a_half_before_the_scale_holds_no_state_and_belongs_to_a_final_defence():
  import dataclasses
  from stablejax.transforms import defence

  @dataclasses.dataclass
  class Section:
    enabled: bool = False

  with pytest.raises(ValueError, match="position=Position.FINAL"):
    defence.register(defence.Defence(
        name="early_half", config=Section, position=defence.Position.UPDATE,
        factory=optax.identity, before_scale=lambda c, ctx: optax.identity()))
  assert defence.get("early_half") is None
  tx = defence.stateless_prefix([optax.trace(decay=0.9)], optax.scale(2.0))
  with pytest.raises(ValueError, match="holds state"):
    tx.init({"w": jnp.ones(2)})
