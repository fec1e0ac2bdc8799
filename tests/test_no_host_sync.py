"""The training hot loop never fetches from the device: metrics are read only at log steps.

Two guards are active in the hot loop:
- `jax.transfer_guard_device_to_host("disallow")`, which stops fetches on GPU/TPU;
- a thread-local trap on `jax.Array._value`, the funnel of every implicit fetch of a multi-shard
  array (`float()`, `int()`, `bool()`, `.item()`, `.tolist()`, `np.asarray`, `jax.device_get`,
  printing). It is needed because on CPU an array already lives in host memory and the transfer
  guard never fires; the first test shows the trap catches each kind of fetch here.
Host-to-device transfers (the batch) stay allowed. The checks run in one subprocess with two
simulated devices and the trainer's FSDP mesh over both (see `report`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import array as jax_array

from stablejax.training.loop import actions
from stablejax.training.config import config_from_dict
from stablejax.training.loop.trainer import Trainer
from stablejax.training.recovery.healing import Healing
from stablejax.training.recovery.replicas import ReplicaCheck
from stablejax.training.recovery.restorer import Restorer

TINY = {
    "model": {"d_model": 32, "n_layers": 2, "n_heads": 2, "max_seq_len": 32,
              "compute_dtype": "float32", "qk_norm": False},
    "data": {"train": "pydoc"},
    "optimizer": {"name": "muon", "learning_rate": 0.01, "adam_learning_rate": 0.003,
                  "embedding_learning_rate": 0.003, "head_learning_rate": 0.003},
    # QK-clip on: the step's forward pass computes every head's max logit for it; with the
    # attention-logit telemetry (on by default) dispatched at log steps, neither may fetch.
    "stability": {"zclip": {"warmup_steps": 2}, "adagc": {"warmup_steps": 2},
                  "skip_spikes": {"window": 8, "min_history": 4},
                  "qk_clip": {"enabled": True, "tau": 0.05}},
    "train": {"steps": 12, "batch_size": 4, "seq_len": 32, "warmup_steps": 2, "log_every": 4,
              "eval_every": 6, "eval_batches": 1, "peak_flops_per_device": 1e12},
    "checkpoint": {"every": 6, "async_save": False},
    "mesh": {"data": 1, "fsdp": 2},
    "logging": {"tensorboard": False, "progress": False, "histogram_every": 0,
                "activation_every": 0, "sample_every": 0},
    "faults": {"nan_grad_steps": [3], "garbage_batch_steps": [5]},
}


class HostFetch(AssertionError):
  pass


_local = threading.local()
_ORIGINAL_VALUE = jax_array.ArrayImpl._value


def _trapped_value(self):
  if getattr(_local, "forbid", False):
    raise HostFetch(f"device-to-host fetch of a {self.dtype}{list(self.shape)} array in the "
                    "hot loop")
  _local.fetches = getattr(_local, "fetches", 0) + 1
  return _ORIGINAL_VALUE.fget(self)


@contextlib.contextmanager
def _device_to_host(forbid: bool):
  """Device-to-host transfers forbidden or allowed (transfer guard + `_value` trap) inside."""
  previous = getattr(_local, "forbid", False)
  _local.forbid = forbid
  try:
    with jax.transfer_guard_device_to_host("disallow" if forbid else "allow"):
      yield
  finally:
    _local.forbid = previous


def hot_loop():
  """No device-to-host transfer (transfer guard + `_value` trap); host-to-device allowed."""
  return _device_to_host(forbid=True)


def fetch_allowed():
  return _device_to_host(forbid=False)


FETCHES = {
    "float": float, "int": int, "bool": bool, "np.asarray": np.asarray,
    "jax.device_get": jax.device_get, "str": str, "item": lambda x: x.item(),
    "tolist": lambda x: x.tolist(), "format": lambda x: f"{x:.3f}",
}


def _trap_catches() -> dict:
  """For each kind of fetch: was it stopped inside `hot_loop()`?"""
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("d",))
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  x = jax.jit(lambda a: a * 2.0, out_shardings=replicated)(jnp.float32(1.5))
  caught = {}
  with hot_loop():
    y = x + 1.0                    # device work is fine
    jnp.asarray(np.float32(2.0))   # host-to-device is allowed
    for name, fetch in FETCHES.items():
      try:
        fetch(y)
        caught[name] = False
      except HostFetch:
        caught[name] = True
  caught["value_outside"] = float(y)  # fetching is fine outside
  return caught


def _step_check(run: Trainer) -> dict:
  state = run.components.init_state(jax.random.PRNGKey(0))
  batches = [run.batches.next(step) for step in range(6)]  # includes the NaN and garbage steps
  # the loop starts over
  run.batches.stream, run.batches.consumed = run.components.data.train_iter(), 0
  history = []
  _local.fetches = 0
  with hot_loop():
    for batch in batches:      # compiles on the first call, under the guard too
      state, metrics = run.components.train_step(state, batch)
      history.append(metrics)
  fetches_inside = _local.fetches
  return {"fetches_inside": fetches_inside,
          "losses": [float(m["loss"]) for m in history],   # fetched after the loop
          "skipped": [bool(m["skip_nonfinite/skipped"]) for m in history],
          "step": int(state.step),
          "shards_per_metric": len(history[0]["loss"].addressable_shards)}


# Where the loop may fetch: the periodic actions at their steps (the replica check's among
# them), the answer to a failure (its replay and rollback), the start and the endings.
ALLOWED = {
    actions.Logging: ("write",), actions.Evaluation: ("__call__",),
    actions.Diagnostics: ("__call__",), actions.Checkpointing: ("save",),
    ReplicaCheck: ("verify",), Restorer: ("restore_or_init", "rollback"),
    Healing: ("answer",), Trainer: ("_banner", "_finish", "_interrupted"),
}


def _loop_check(run: Trainer) -> dict:
  """Trainer.train() with the whole loop guarded; only the actions at their steps may fetch."""
  allowed_calls = []
  for cls, names in ALLOWED.items():
    for name in names:
      method = getattr(cls, name)

      def wrapped(*args, _method=method, _name=f"{cls.__name__}.{name}", **kwargs):
        allowed_calls.append(_name)
        with fetch_allowed():
          return _method(*args, **kwargs)
      setattr(cls, name, wrapped)
  guarded_steps = []
  step_fn = run.components.train_step

  def counted_step(state, batch):
    guarded_steps.append(bool(getattr(_local, "forbid", False)))
    return step_fn(state, batch)
  run.components = dataclasses.replace(run.components, train_step=counted_step)

  _local.fetches = 0
  with hot_loop():
    code = run.train()
  return {"exit_code": code, "guarded_steps": guarded_steps, "allowed_calls": allowed_calls,
          "fetches_in_hooks": _local.fetches,
          "total_skips": int(run.logging.last_record["skip_nonfinite/total_skips"])}


def _child(out: str) -> None:
  """Runs in a subprocess with 2 simulated devices (see `report`)."""
  jax_array.ArrayImpl._value = property(_trapped_value)
  result = {"devices": jax.device_count()}
  # one compile for both checks
  run = Trainer(config_from_dict(TINY), Path(out) / "run", fresh=True)
  for name, check in (("trap", _trap_catches), ("step", lambda: _step_check(run)),
                      ("loop", lambda: _loop_check(run))):
    try:
      result[name] = check()
    except Exception as e:  # reported, so a fetch names the array it touched
      result[name] = {"error": f"{type(e).__name__}: {e}"}
  print("REPORT " + json.dumps(result))


@pytest.fixture(scope="module")
def report(tmp_path_factory):
  """One subprocess with 2 simulated CPU devices runs every check.

  Two devices, because a single-device CPU array hands its memory to numpy through the buffer
  protocol without any Python hook, while the trainer's arrays on a 2-device mesh (FSDP over 2)
  can only be read through `_value`, which the trap watches.
  """
  out = tmp_path_factory.mktemp("no_host_sync")
  from helpers import xla_flags_with_devices
  env = dict(os.environ, XLA_FLAGS=xla_flags_with_devices(2))
  proc = subprocess.run([sys.executable, __file__, str(out)], env=env, capture_output=True,
                        text=True, timeout=600, cwd=Path(__file__).resolve().parent.parent)
  lines = [line for line in proc.stdout.splitlines() if line.startswith("REPORT ")]
  assert proc.returncode == 0 and lines, proc.stderr[-3000:]
  return json.loads(lines[-1][len("REPORT "):])


def test_the_trap_catches_every_kind_of_fetch(report):
  assert report["devices"] == 2
  trap = report["trap"]
  assert "error" not in trap, trap
  assert {name: trap[name] for name in FETCHES} == {name: True for name in FETCHES}
  assert trap["value_outside"] == 4.0


def test_jitted_train_step_runs_many_steps_without_a_fetch(report):
  step = report["step"]
  assert "error" not in step, step["error"] if "error" in step else ""
  assert step["shards_per_metric"] == 2   # so a fetch would have gone through the trap
  assert step["fetches_inside"] == 0
  assert all(np.isfinite(step["losses"]))
  assert step["skipped"] == [False, False, False, True, False, False]  # the NaN-gradient step
  assert step["step"] == 6


def test_training_loop_fetches_only_at_log_eval_and_checkpoint_steps(report):
  loop = report["loop"]
  assert "error" not in loop, loop["error"] if "error" in loop else ""
  t = TINY["train"]
  assert loop["exit_code"] == 0
  assert loop["guarded_steps"] == [True] * t["steps"]
  # one fetch per log step (step 1 and every log_every), plus the checkpoint step 6 that is read
  # at once
  assert loop["allowed_calls"].count("Logging.write") == t["steps"] // t["log_every"] + 2
  assert loop["allowed_calls"].count("Evaluation.__call__") == 2  # step 6 and the final one
  assert loop["fetches_in_hooks"] > 0
  assert loop["total_skips"] == 1


if __name__ == "__main__":
  _child(sys.argv[1])
