"""The tests' shared helpers: tiny trainer configs and runs, reading a run directory, running a
transform over a sequence of gradients, the trainer's GPT parameters, and running a program."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "train.py"

# The session's JAX settings (set by tests/conftest.py): the variables a test keeps when it clears
# the JAX_* environment. The persistent compilation cache's three (without them the trainer would
# use the user's own cache folder), then the MLIR locations' tracebacks.
SESSION_JAX_VARIABLES = ("JAX_COMPILATION_CACHE_DIR",
                         "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                         "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES",
                         "JAX_INCLUDE_FULL_TRACEBACKS_IN_LOCATIONS")

# A model small enough to compile in seconds and learn visibly in a few dozen steps on a CPU.
TINY = [
    "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.max_seq_len=32",
    "model.compute_dtype=\"float32\"", "model.qk_norm=false",
    "train.seq_len=32", "train.batch_size=8", "train.steps=40", "train.warmup_steps=4",
    "train.log_every=2", "train.eval_every=20", "train.eval_batches=2",
    "optimizer.learning_rate=0.01", "optimizer.adam_learning_rate=0.01",
    "optimizer.embedding_learning_rate=0.01", "optimizer.head_learning_rate=0.01",
    "stability.skip_spikes.min_history=8", "stability.skip_spikes.window=16",
    "stability.zclip.warmup_steps=5",
    "checkpoint.every=10", "checkpoint.async_save=false",
    "logging.tensorboard=true", "logging.progress=false",
    # No histograms or activation statistics: they compile two more programs per run. The tests
    # of the diagnostics turn them on (DIAGNOSTICS).
    "logging.histogram_every=0", "logging.activation_every=0",
    # No sample at evals: each run would compile a sampler. Tests of sampling turn it on.
    "logging.sample_every=0",
    # A given peak rate for MFU skips the trainer's CPU matmul benchmark at the end of each run
    # (clean_run keeps measuring it).
    "train.peak_flops_per_device=1e12",
]


DIAGNOSTICS = ("logging.histogram_every=20", "logging.activation_every=20")


def once_per_config(make):
  """``make(*args)`` memoised by the repr of its arguments (model configs are unhashable
  dataclasses): a test module builds each config's parameters or jitted programs once."""
  made: dict = {}

  def get(*args, **kwargs):
    key = repr((args, sorted(kwargs.items())))
    if key not in made:
      made[key] = make(*args, **kwargs)
    return made[key]
  return get


def sets(*overrides: str) -> list[str]:
  args = []
  for item in (*TINY, *overrides):
    args += ["--set", item]
  return args


def tiny_config(*overrides: str):
  """The Config object of a tiny run (for Trainer(...) in process, or to re-derive expected
  values)."""
  from stablejax.training.config import load_config
  return load_config(ROOT / "stablejax" / "configs" / "default.json", [*TINY, *overrides])


def optax_lr(cfg, count: int, lr_scale: float = 1.0) -> float:
  """The logged learning rate re-derived from the config with optax (update `count`, 0-based)."""
  import optax
  t = cfg.train
  peak = cfg.optimizer.learning_rate
  schedule = optax.warmup_cosine_decay_schedule(0.0, peak, t.warmup_steps, t.steps,
                                                peak * t.min_lr_ratio)
  return float(schedule(count)) * lr_scale


def run_inprocess(out: Path, *overrides: str, fresh: bool = True) -> int:
  """Runs train.main in this process (no interpreter start-up cost)."""
  from stablejax.cli.train import main
  argv = sets(*overrides) + ["--out", str(out)] + (["--fresh"] if fresh else [])
  return main(argv)


def stopping_run(cfg, out, fresh, stop_at):
  """A Trainer that stops at step `stop_at` as if SIGTERM had arrived just before it."""
  import signal

  from stablejax.training.loop.trainer import Trainer

  run = Trainer(cfg, out, fresh=fresh)
  next_batch = run.batches.next

  def stopping(step):
    if step + 1 == stop_at:
      run.signals.received = signal.SIGTERM  # what the handler does; seen before the next step
    return next_batch(step)
  run.batches.next = stopping
  return run


def xla_flags_with_devices(n: int) -> str:
  """This session's XLA_FLAGS (conftest's optimisation level included) with N simulated CPU
  devices: a subprocess that replaced them would compile differently from the tests' own
  process."""
  from stablejax.training.launch.launcher import with_device_count
  return with_device_count(os.environ.get("XLA_FLAGS", ""), n)


def run_subprocess(out: Path, *overrides: str, fresh: bool = False, devices: int | None = None,
                   extra_args: tuple[str, ...] = (), timeout: float = 600
                   ) -> subprocess.CompletedProcess:
  env = dict(os.environ)
  if devices is not None:
    env["XLA_FLAGS"] = xla_flags_with_devices(devices)
  cmd = [sys.executable, str(TRAIN), *sets(*overrides), "--out", str(out), *extra_args]
  if fresh:
    cmd.append("--fresh")
  return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def read_metrics(out: Path) -> list[dict]:
  records = []
  for line in (Path(out) / "metrics.jsonl").read_text().splitlines():
    if line.strip():
      records.append(json.loads(line))
  return records


def train_losses(out: Path) -> dict[int, float]:
  """step -> loss of the train records (a step logged twice, e.g. after a resume, keeps the
  last)."""
  return {r["step"]: r["loss"] for r in read_metrics(out) if "loss" in r and "event" not in r}


def summary(out: Path) -> dict:
  return json.loads((Path(out) / "summary.json").read_text())


slow = pytest.mark.slow


# ----------------------------------------------------------------------------- transforms


def scan_updates(tx, grads):
  """Runs ``tx`` over stacked gradients (every leaf ``[steps, ...]``) in one jitted scan, from
  zero parameters; returns (updates, states), each stacked over the steps."""
  import jax
  import jax.numpy as jnp
  params = jax.tree.map(lambda g: jnp.zeros(g.shape[1:], g.dtype), grads)

  def body(state, g):
    updates, state = tx.update(g, state, params)
    return state, (updates, state)

  _, out = jax.jit(lambda s, g: jax.lax.scan(body, s, g))(tx.init(params), grads)
  return out


# ----------------------------------------------------------------------------- models


def gpt_params(model_cfg, *, seq_len: int = 8, seed: int = 0, abstract: bool = False):
  """The parameters of the trainer's GPT for ``model_cfg`` (a jitted init), or their shapes
  (``abstract``: nothing computed)."""
  import jax
  import jax.numpy as jnp

  from stablejax.modeling.gpt import GPT
  init = GPT(model_cfg).init
  args = (jax.random.key(seed), jnp.zeros((1, seq_len), jnp.int32))
  variables = jax.eval_shape(init, *args) if abstract else jax.jit(init)(*args)
  return variables["params"]


def hf_init_and_logits(hf):
  """A Hugging Face Flax model built with ``_do_init=False``: its own initialisation (what
  ``seed=0`` at construction runs) and its logits as a function of ``(params, tokens)``, each
  jitted: one program each instead of one per operation."""
  import jax
  params = jax.jit(hf.init_weights, static_argnums=1)(jax.random.PRNGKey(0), (1, 1))
  return params, jax.jit(lambda p, t: hf(t, params=p).logits)


def llama_params_from_hf(hf_params, n_layers: int, scan_layers: bool = True) -> dict:
  """The llama family's parameters (stablejax.modeling.llama's layout) holding the weights of a
  Hugging Face ``FlaxLlamaForCausalLM`` or ``FlaxMistralForCausalLM`` (``model.params``)."""
  import jax
  import jax.numpy as jnp
  hp = hf_params["model"]

  def block(layer):
    return {"attn_norm": {"scale": layer["input_layernorm"]["weight"]},
            "mlp_norm": {"scale": layer["post_attention_layernorm"]["weight"]},
            "attn": {n: {"kernel": layer["self_attn"][n]["kernel"]}
                     for n in ("q_proj", "k_proj", "v_proj", "o_proj")},
            "mlp": {n: {"kernel": layer["mlp"][n]["kernel"]}
                    for n in ("gate_proj", "up_proj", "down_proj")}}

  layers = [block(hp["layers"][str(i)]) for i in range(n_layers)]
  params = {"tok_embed": {"embedding": hp["embed_tokens"]["embedding"]},
            "final_norm": {"scale": hp["norm"]["weight"]},
            "lm_head": {"kernel": hf_params["lm_head"]["kernel"]}}
  if scan_layers:
    params["blocks"] = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
  else:
    params.update({f"block_{i}": layer for i, layer in enumerate(layers)})
  return params


# ----------------------------------------------------------------------------- programs


def run_python(*args, timeout: float = 120, cwd: Path = ROOT, env=None,
               check: bool = False) -> subprocess.CompletedProcess:
  """``python ARGS...`` in a subprocess (text output captured); ``check``: its exit code must
  be 0 (the assertion shows the end of its output)."""
  result = subprocess.run([sys.executable, *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)
  if check:
    assert result.returncode == 0, (f"python {' '.join(map(str, args))} exited "
                                    f"{result.returncode}\n{result.stderr[-3000:]}")
  return result


def load_example(name: str):
  """The script ``examples/NAME.py`` as a module (imported by path, not through sys.path)."""
  return load_script("examples", name)


def load_tool(name: str):
  """The script ``tools/NAME.py`` as a module (imported by path, not through sys.path)."""
  return load_script("tools", name)


def load_script(folder: str, name: str):
  """``FOLDER/NAME.py`` of the repository as a module named ``FOLDER_NAME``; it imports its
  neighbours in FOLDER (``examples/_shared.py``) as it does when run, where Python puts the
  script's folder first on sys.path."""
  import importlib.util
  path = ROOT / folder / f"{name}.py"
  spec = importlib.util.spec_from_file_location(f"{folder}_{name}", path)
  assert spec is not None and spec.loader is not None, path
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # dataclasses and pickling look a module up by its name
  if str(path.parent) not in sys.path:
    sys.path.append(str(path.parent))
  spec.loader.exec_module(module)
  return module



_LOCK_HOLDER = """
import sys, time
from stablejax.data.folder import FolderLock
FolderLock(sys.argv[1], sys.argv[2]).acquire()
print("locked", flush=True)
time.sleep(120)
"""


def lock_holder(folder, program: str) -> subprocess.Popen:
  """Another process that holds ``folder``'s ``FolderLock`` as ``program`` ("train", "prepare")
  for two minutes; returned once it holds it (the caller kills it)."""
  proc = subprocess.Popen([sys.executable, "-c", _LOCK_HOLDER, str(folder), program],
                          stdout=subprocess.PIPE, text=True)
  assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
  return proc


@contextlib.contextmanager
def folder_locked_by(folder, program: str):
  """:func:`lock_holder` for the ``with`` block; yields its process."""
  holder = lock_holder(folder, program)
  try:
    yield holder
  finally:
    holder.kill()
    holder.wait(timeout=30)


def train_state_class() -> type:
  """A ``flax.struct`` train state ``(step, params, opt_state)``, the layout
  ``restore_plan.plan`` compares a checkpoint with (flax imported only when asked)."""
  import flax.struct
  import jax

  class State(flax.struct.PyTreeNode):
    step: jax.Array
    params: dict
    opt_state: dict

  return State


PLUGINS = ROOT / "tests" / "plugins"


def load_plugin(name: str):
  """``tests/plugins/NAME.py`` loaded as the trainer's ``--plugin`` loads it (its declarations
  registered); returns the module."""
  from stablejax.training import plugins
  (module,) = plugins.load([str(PLUGINS / f"{name}.py")])
  return module


def unusable_path_cases(out_file: str, letter: str) -> list:
  """``(args, the start of the error line)`` of a program that reads a run and writes
  ``--out``: an empty --out, an --out through a loop of symbolic links (``loop`` links to
  itself), and a run_dir name too long for the file system (300 ``letter``s)."""
  return [
      (["run", "--out", ""], "argument --out: the path is empty"),
      (["run", "--out", f"loop/{out_file}"],
       f"argument --out: loop/{out_file} leads through a loop of symbolic links"),
      ([letter * 300], f"argument run_dir: the name {letter * 4}"),
  ]


def assert_unusable_path_is_one_line(main, args, line, tmp_path, monkeypatch, capsys) -> None:
  """``main(args)`` in ``tmp_path`` (where ``loop`` links to itself) exits 2 with one error line
  that starts with ``line``."""
  monkeypatch.chdir(tmp_path)
  (tmp_path / "loop").symlink_to("loop")  # a link to itself
  assert main(args) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith(f"error: {line}"), err


def train_signalled_when(args: list, ready, sig: int, what: str, poll: float
                         ) -> tuple[int, str, str]:
  """Runs ``train.py ARGS`` and sends it ``sig`` once ``ready()`` (which must come within 300 s,
  the process still running; ``what`` names it), checked every ``poll`` seconds; returns its exit
  code, stdout and stderr. The process never outlives the call."""
  import time
  proc = subprocess.Popen([sys.executable, str(TRAIN), *args], cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.monotonic() + 300
    while not ready():
      assert proc.poll() is None, proc.communicate()[1][-2000:]
      assert time.monotonic() < deadline, f"no {what} within 300 s"
      time.sleep(poll)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=300)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  return proc.returncode, stdout, stderr
