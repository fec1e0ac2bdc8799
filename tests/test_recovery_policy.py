"""Recovery policy and checkpoint restore, without a trainer: hand-made metric sequences for every
trigger, the rollback target, the LR backoff schedule against its formula, and restore on real
damaged files versus a transient read error."""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from stablejax.training import checkpoint as checkpoint_lib
from stablejax.training.checkpoint import (CheckpointError, Checkpoints, damage_evidence, read_json,
                                           write_json_atomic)
from stablejax.training.config import RecoveryConfig, stability_config_class
from stablejax.training.recovery.policy import LRBackoff, Recovery, RollbackEvent, backoff_lr_scale

REQ = "skip_nonfinite/rollback_requests"


def _stability(**recovery):
  """A stability section with these recovery settings (the rest at their defaults)."""
  return stability_config_class()(recovery=RecoveryConfig(**recovery))


def record(loss, requests=0, params_finite=True):
  return {"loss": loss, "params_finite": params_finite, REQ: requests,
          "skip_spikes/rollback_requests": 0}


def feed(recovery, losses):
  """Index of the first record that triggers, or None, and its cause."""
  for i, loss in enumerate(losses):
    cause = recovery.check_train(record(loss))
    if cause is not None:
      return i, cause
  return None, None


# A run that trains down to ~2.0, so the line is 3 x 2.0 = 6.0 once the window has filled.
WARM = [5.5, 4.0, 3.0, 2.5, 2.2, 2.1, 2.0, 2.0, 2.05, 2.0]


def test_bump_that_recovers_within_the_window_does_not_trigger():
  # The Post-LN bump of the scenario matrix: four logged losses at ~10, then back down. Four of
  # the last five were above the line, so the median rule this replaces rolled back here.
  r = Recovery(_stability(loss_window=5, loss_explosion_factor=3.0))
  i, cause = feed(r, WARM + [9.5, 10.2, 10.1, 10.2, 2.3, 2.2, 9.0, 9.0, 9.0, 9.0, 2.1])
  assert i is None, cause
  assert r.best_loss_median == pytest.approx(2.0)  # the bump never entered the best median
  assert r.healthy()


def test_an_elevated_loss_never_enters_the_median_window():
  # Window 3: medians of the last 3 losses that were not elevated. [2.0, 2.5, 2.2] has median
  # 2.2; had the elevated 10.0 entered the window, it would hold [2.5, 10.0, 2.2], median 2.5.
  r = Recovery(_stability(loss_window=3, loss_explosion_factor=3.0))
  i, _ = feed(r, [3.0, 3.0, 3.0, 2.0, 2.5])
  assert i is None and r.best_loss_median == 2.5
  i, _ = feed(r, [10.0, 2.2])  # 10.0 > 3 x 2.5: elevated
  assert i is None and r.best_loss_median == 2.2


def test_divergence_triggers_on_the_window_th_elevated_loss():
  r = Recovery(_stability(loss_window=5, loss_explosion_factor=3.0))
  losses = WARM + [6.1, 7.0, 9.0, 12.0, 15.0, 20.0]
  i, cause = feed(r, losses)
  assert i == len(WARM) + 4  # the 5th elevated value in a row, not the 4th
  assert "diverged" in cause and "3 x the best median 2" in cause
  assert not r.healthy()


def test_values_at_the_line_are_not_elevated():
  r = Recovery(_stability(loss_window=3, loss_explosion_factor=2.0))
  # best median of [2, 2, 2] is 2; 4.0 is exactly 2 x best: not above the line
  i, _ = feed(r, [2.0, 2.0, 2.0, 4.0, 4.0, 4.0, 4.0])
  assert i is None
  i, _ = feed(r, [4.01, 4.01, 4.01])
  assert i == 2


def test_non_finite_losses_trigger_even_before_a_best_exists():
  r = Recovery(_stability(loss_window=3))
  i, cause = feed(r, [5.0, math.nan, math.inf, math.nan])
  assert i == 3 and "non-finite" in cause


def test_one_normal_value_resets_the_run_of_elevated_values():
  r = Recovery(_stability(loss_window=3, loss_explosion_factor=3.0))
  i, _ = feed(r, WARM + [7.0, 7.0, 2.1, 7.0, 7.0, 2.1, 7.0, 7.0])
  assert i is None


def test_rollback_request_counter_triggers_until_acknowledged():
  r = Recovery(_stability())
  assert r.check_train(record(2.0, requests=0)) is None
  cause = r.check_train(record(2.0, requests=1))  # a burst ended since the last log: level False
  assert cause is not None and cause.startswith("skip_nonfinite: too many skipped steps")
  # The restored state counted that request already: it is no reason for another rollback.
  r.record(RollbackEvent(step=20, cause=cause, restored_step=10), {REQ: 1})
  assert r.check_train(record(2.0, requests=1)) is None
  assert r.check_train(record(2.0, requests=2)) is not None


def test_non_finite_parameter_triggers_at_once():
  r = Recovery(_stability())
  assert r.check_train(record(2.0, params_finite=False)) == "a parameter became non-finite"


def test_validation_triggers_only_when_non_finite():
  r = Recovery(_stability())
  assert r.check_val(2.0) is None
  assert r.check_val(100.0) is None  # one evaluation cannot tell a bump from a divergence
  assert r.check_val(math.nan) == "validation loss is non-finite"


def test_rollback_target_goes_one_checkpoint_further_back_on_a_repeat():
  r = Recovery(_stability())
  assert r.rollback_target([]) is None
  assert r.rollback_target([0, 10, 20]) == 20
  r.record(RollbackEvent(step=25, cause="x", restored_step=20), {})
  assert r.rollback_target([0, 10, 20]) == 10  # failed again before a newer checkpoint
  assert r.rollback_target([0, 10, 20, 30]) == 30  # a newer checkpoint was saved since
  r.record(RollbackEvent(step=18, cause="x", restored_step=10), {})
  assert r.rollback_target([0, 10]) == 0
  r.record(RollbackEvent(step=5, cause="x", restored_step=0), {})
  assert r.rollback_target([0]) == 0  # nothing older: the same one again


def test_state_dict_round_trip():
  r = Recovery(_stability(loss_window=2))
  feed(r, [3.0, 2.0, 2.0])
  r.record(RollbackEvent(step=7, cause="c", restored_step=4, lr_scale=0.2,
                         skipped_batches=(4, 8)), {})
  again = Recovery(_stability(loss_window=2))
  again.load_state_dict(json.loads(json.dumps(r.state_dict())))
  assert again.events == r.events and again.best_loss_median == r.best_loss_median == 2.0


def test_rollback_budget_is_max_rollbacks():
  r = Recovery(_stability(max_rollbacks=2))
  assert r.budget_left and r.rollbacks == 0
  r.record(RollbackEvent(step=5, cause="x", restored_step=0), {})
  assert r.budget_left and r.rollbacks == 1
  r.record(RollbackEvent(step=9, cause="x", restored_step=0), {})
  assert not r.budget_left and r.rollbacks == 2


def test_a_rollback_starts_the_loss_window_afresh():
  # Best median 5 from [5, 5, 5]; two elevated losses, then a rollback: the state restored is
  # healthy, the elevated run restarts from zero, and the abandoned window does not mix with
  # the losses logged after it.
  r = Recovery(_stability(loss_window=3, loss_explosion_factor=3.0))
  i, _ = feed(r, [5.0, 5.0, 5.0, 20.0, 20.0])
  assert i is None and not r.healthy() and r.best_loss_median == 5.0
  r.record(RollbackEvent(step=6, cause="x", restored_step=0), {})
  assert r.healthy()
  i, _ = feed(r, [20.0, 20.0])  # two more elevated losses: 2 < window, no trigger
  assert i is None
  r.record(RollbackEvent(step=8, cause="x", restored_step=0), {})
  i, _ = feed(r, [1.0, 1.0])  # only 2 losses since the rollback: no new median yet
  assert i is None and r.best_loss_median == 5.0
  i, _ = feed(r, [1.0])
  assert r.best_loss_median == 1.0


@pytest.mark.parametrize("schedule", ["linear", "geometric"])
def test_backoff_scale_matches_its_formula(schedule):
  steps = np.array([30, 31, 55, 80, 129, 130, 131, 500])
  backoff = LRBackoff(scale=jnp.float32(0.2), start=jnp.int32(30), steps=jnp.int32(-1))
  got = jax.jit(jax.vmap(lambda s: backoff_lr_scale(backoff, s, 100, schedule)))(jnp.asarray(steps))
  frac = np.clip((steps - 30) / 100.0, 0.0, 1.0)
  if schedule == "linear":
    want = 0.2 + (1.0 - 0.2) * frac
  else:
    want = 0.2 ** (1.0 - frac)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)
  assert float(backoff_lr_scale(LRBackoff.none(), jnp.int32(7), 100, schedule)) == 1.0
  assert float(backoff_lr_scale(backoff, jnp.int32(500), None, schedule)) == pytest.approx(0.2)


# ----------------------------------------------------------------------------- checkpoints


def _state(seed):
  rng = np.random.default_rng(seed)
  return {"w": jnp.asarray(rng.normal(size=(16, 64)), jnp.float32),
          "b": jnp.asarray(rng.normal(size=7), jnp.float32), "n": jnp.int32(seed)}


def _data_iter():
  return iter(grain.MapDataset.range(100).batch(2).to_iter_dataset())


ABSTRACT = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), _state(0))


@pytest.fixture
def two_steps(tmp_path):
  """Checkpoints of steps 10 and 20 (different contents), as a finished save leaves them."""
  directory = tmp_path / "checkpoints"
  ckpt = Checkpoints(directory, keep=5, async_save=False)
  for step in (10, 20):
    it = _data_iter()
    for _ in range(step // 10):
      next(it)
    ckpt.save(step, _state(step), it, {"batches_consumed": step // 10})
  ckpt.close()
  return directory


def _restore(directory, at_most=None):
  calls = []
  ckpt = Checkpoints(directory, keep=5, async_save=False)
  try:
    out = ckpt.restore(ABSTRACT, _data_iter(), at_most=at_most,
                       on_fallback=lambda step, why: calls.append((step, why)))
  finally:
    ckpt.close()
  return out, calls


def _listing(directory: Path) -> list[str]:
  return sorted(str(p.relative_to(directory.parent)) for p in directory.parent.rglob("*"))


def _data_files(step_dir: Path) -> list[Path]:
  """The OCDBT data files of the state item (array chunks and b-tree nodes)."""
  files = [f for f in (step_dir / "state").rglob("*") if f.is_file() and f.parent.name == "d"]
  assert files
  return files


def _damage(step_dir: Path, kind: str) -> None:
  if kind == "truncated":
    for f in _data_files(step_dir):
      f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
  elif kind == "missing_file":
    for f in _data_files(step_dir):
      f.unlink()
  elif kind == "flipped_bytes":
    for f in _data_files(step_dir):
      data = bytearray(f.read_bytes())
      for i in range(16, len(data), 97):
        data[i] ^= 0xFF
      f.write_bytes(bytes(data))
  elif kind == "zeroed_metadata":
    (step_dir / "state" / "_METADATA").write_bytes(b"\0" * 8)
  elif kind == "missing_item":
    shutil.rmtree(step_dir / "data")
  elif kind == "fingerprint":  # readable, but not what was saved
    meta_file = step_dir / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    meta["fingerprint"] = [v + 1.0 for v in meta["fingerprint"]]
    meta_file.write_text(json.dumps(meta))
  elif kind == "zeroed_chunk":  # a lost block: the largest array-chunk file reads back as zeros
    chunk = max(_data_files(step_dir), key=lambda f: f.stat().st_size)
    chunk.write_bytes(b"\0" * chunk.stat().st_size)
  elif kind == "missing_data_file":  # the Grain iterator state of process 0
    (step_dir / "data" / "process_0-of-1.json").unlink()
  elif kind == "missing_state_metadata":
    (step_dir / "state" / "_METADATA").unlink()
  elif kind == "missing_meta_file":
    (step_dir / "meta" / "metadata").unlink()
  else:
    raise AssertionError(kind)


def _train_state(seed):
  """The trainer's own state type around `_state`: a flax PyTreeNode holding an optax state."""
  import optax

  from stablejax.training.loop.step import TrainState
  params = {k: v for k, v in _state(seed).items() if k != "n"}
  opt_state = optax.adamw(1e-3).init(params)
  opt_state = jax.tree.map(lambda x: x + seed if jnp.issubdtype(x.dtype, jnp.floating) else x,
                           opt_state)
  return TrainState(step=jnp.int32(seed), params=params, opt_state=opt_state,
                    lr_backoff=LRBackoff.none())


# With shardings, as the trainer restores it (without them Orbax reads a missing _METADATA as a
# FileNotFoundError; with them, as a tree mismatch).
TRAIN_ABSTRACT = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.NamedSharding(
        jax.sharding.Mesh(jax.devices()[:1], ("data",)), jax.sharding.PartitionSpec())),
    _train_state(0))


@pytest.fixture
def train_state_steps(tmp_path):
  """Steps 10 and 20 of a trainer-shaped state (TrainState, optax state, Grain iterator)."""
  directory = tmp_path / "checkpoints"
  ckpt = Checkpoints(directory, keep=5, async_save=False)
  for step in (10, 20):
    ckpt.save(step, _train_state(step), _data_iter(), {"batches_consumed": step // 10})
  ckpt.close()
  return directory


# The damage that a restore of the trainer's own state type reports without a damage status: a
# zeroed chunk fails as FAILED_PRECONDITION ("Unknown frame descriptor"), a missing Grain file as a
# plain ValueError, and a missing _METADATA as a pytree structure mismatch.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("kind", ["zeroed_chunk", "missing_data_file", "missing_state_metadata",
                                  "missing_meta_file", "truncated", "flipped_bytes"])
def test_damaged_train_state_checkpoint_falls_back_and_is_set_aside(train_state_steps, kind):
  _damage(train_state_steps / "20", kind)
  calls = []
  ckpt = Checkpoints(train_state_steps, keep=5, async_save=False)
  try:
    state, meta = ckpt.restore(TRAIN_ABSTRACT, _data_iter(),
                               on_fallback=lambda step, why: calls.append((step, why)))
  finally:
    ckpt.close()
  assert meta["step"] == 10 and [s for s, _ in calls] == [20], calls
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(state),
               jax.device_get(_train_state(10)))
  assert (train_state_steps.parent / "damaged_checkpoints" / "20" / "state").is_dir()
  assert Checkpoints(train_state_steps, keep=5).all_steps() == [10]


def test_checkpoint_of_another_process_count_is_not_damage(train_state_steps):
  # What a 2-process run leaves in `data/`; restored by one process, Grain looks for
  # process_0-of-1.json. The files are complete: a setup difference, not damage.
  for step in (10, 20):
    data = train_state_steps / str(step) / "data"
    text = (data / "process_0-of-1.json").read_text()
    (data / "process_0-of-1.json").rename(data / "process_0-of-2.json")
    (data / "process_1-of-2.json").write_text(text)
  before = _listing(train_state_steps)
  ckpt = Checkpoints(train_state_steps, keep=5, async_save=False)
  with pytest.raises(CheckpointError, match="saved by 2 processes"):
    ckpt.restore(TRAIN_ABSTRACT, _data_iter())
  ckpt.close()
  assert _listing(train_state_steps) == before


# Orbax leaves a coroutine behind when tensorstore fails a read; its "event loop is closed" at
# garbage collection is noise, not a result of this test.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("kind", ["truncated", "missing_file", "flipped_bytes", "zeroed_metadata",
                                  "missing_item", "fingerprint"])
def test_damaged_newest_checkpoint_falls_back_and_is_set_aside(two_steps, kind):
  _damage(two_steps / "20", kind)
  (state, meta), calls = _restore(two_steps)
  assert meta["step"] == 10 and [s for s, _ in calls] == [20]
  for key, value in _state(10).items():
    np.testing.assert_array_equal(np.asarray(state[key]), np.asarray(value))
  # not deleted: moved next to the checkpoints, out of Orbax's way (step 20 will be saved again)
  assert not (two_steps / "20").exists()
  assert (two_steps.parent / "damaged_checkpoints" / "20" / "state").is_dir()
  assert Checkpoints(two_steps, keep=5).all_steps() == [10]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_step_damaged_twice_keeps_both_damaged_copies(two_steps):
  # _set_aside: a damaged step is "kept for inspection, never deleted". Step 20 is saved again
  # after its first copy was set aside, and that copy is damaged too: both are kept, apart.
  def contents(directory):
    return {str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*")
            if p.is_file()}

  damaged = two_steps.parent / "damaged_checkpoints"
  _damage(two_steps / "20", "truncated")
  (_, meta), _ = _restore(two_steps)
  assert meta["step"] == 10
  first = contents(damaged / "20")
  ckpt = Checkpoints(two_steps, keep=5, async_save=False)
  it = _data_iter()
  next(it), next(it)
  ckpt.save(20, _state(20), it, {"batches_consumed": 2})
  ckpt.close()
  _damage(two_steps / "20", "flipped_bytes")
  (_, meta), calls = _restore(two_steps)
  assert meta["step"] == 10 and [s for s, _ in calls] == [20]
  assert contents(damaged / "20") == first  # the first copy, untouched
  assert (damaged / "20.1" / "state").is_dir() and sorted(p.name for p in damaged.iterdir()) == [
      "20", "20.1"]


@pytest.mark.parametrize("error", [TimeoutError("read timed out"), MemoryError(),
                                   PermissionError(13, "Permission denied"),
                                   ValueError("UNAVAILABLE: connection reset"),
                                   ValueError("RESOURCE_EXHAUSTED: out of memory")])
def test_transient_read_error_stops_and_leaves_every_checkpoint(two_steps, monkeypatch, error):
  before = _listing(two_steps)
  original = ocp.CheckpointManager.restore
  calls = []

  def fail_once(self, step, *args, **kwargs):
    calls.append(step)
    if len(calls) == 1:
      raise error
    return original(self, step, *args, **kwargs)

  monkeypatch.setattr(ocp.CheckpointManager, "restore", fail_once)
  with pytest.raises(CheckpointError) as info:
    _restore(two_steps)
  message = str(info.value)
  assert "\n" not in message and "reading checkpoint 20" in message
  assert type(error).__name__ in message and "left as it is" in message
  assert calls == [20]  # no fallback to step 10 was even tried
  assert _listing(two_steps) == before
  # The next attempt reads the newest checkpoint as if nothing happened.
  (state, meta), fallbacks = _restore(two_steps)
  assert meta["step"] == 20 and not fallbacks
  np.testing.assert_array_equal(np.asarray(state["w"]), np.asarray(_state(20)["w"]))


def test_checkpoint_of_another_model_is_not_damage(two_steps):
  before = _listing(two_steps)
  ckpt = Checkpoints(two_steps, keep=5)
  other = dict(ABSTRACT, w=jax.ShapeDtypeStruct((16, 65), jnp.float32))
  with pytest.raises(CheckpointError,
                     match=r"checkpoint 20 in .* does not fit this run \(w is \(16, 64\) "
                           r"float32 in the checkpoint and \(16, 65\) float32 in this run\)"):
    ckpt.restore(other, _data_iter())
  ckpt.close()
  assert _listing(two_steps) == before


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # as above
def test_every_checkpoint_damaged_stops_and_moves_nothing(two_steps):
  _damage(two_steps / "10", "truncated")
  _damage(two_steps / "20", "fingerprint")
  before = _listing(two_steps)
  with pytest.raises(CheckpointError, match="all 2 checkpoints .* are damaged"):
    _restore(two_steps)
  assert _listing(two_steps) == before


def test_state_holding_infinities_restores(tmp_path):
  # An optimizer state before warmup holds inf thresholds on purpose: the checkpoint of step 0
  # must be restorable (a rollback to it is the last resort).
  ckpt = Checkpoints(tmp_path / "checkpoints", keep=2, async_save=False)
  state = dict(_state(0), b=jnp.array([1.0, jnp.inf, -jnp.inf, 2.0, 0.0, 0.0, 0.0], jnp.float32))
  ckpt.save(0, state, _data_iter(), {})
  ckpt.close()
  (restored, meta), fallbacks = _restore(tmp_path / "checkpoints")
  assert not fallbacks and meta["step"] == 0
  np.testing.assert_array_equal(np.asarray(restored["b"]), np.asarray(state["b"]))


def test_at_most_restores_an_older_step(two_steps):
  (_, meta), _ = _restore(two_steps, at_most=19)
  assert meta["step"] == 10
  assert _restore(two_steps, at_most=20)[0][1]["step"] == 20
  assert _restore(two_steps, at_most=10)[0][1]["step"] == 10
  assert _restore(two_steps, at_most=5)[0] is None


def test_fingerprint_by_hand():
  tree = {"a": jnp.array([1.0, -2.0, jnp.inf], jnp.float32), "b": jnp.array([[3.0, jnp.nan]]),
          "n": jnp.int32(7)}  # integer leaves are not part of it
  np.testing.assert_array_equal(np.asarray(checkpoint_lib.fingerprint(tree)),
                                [1.0 - 2.0 + 3.0, 1.0 + 4.0 + 9.0, 2.0])


def test_fingerprints_share_one_program_across_trees_and_compile_nothing_for_numpy():
  """A save fingerprints the train state, the check of a restore by name a dict of the same
  arrays: the same numbers, from one compiled program. A checkpoint read as numpy (`sample`)
  gives the same numbers with nothing compiled."""
  from helpers import train_state_class
  state = train_state_class()(
      step=jnp.int32(3),
      params={"w": jnp.array([[1.0, -2.0], [0.5, 4.0]]), "b": jnp.array([3.0, jnp.nan])},
      opt_state={"zclip": (jnp.float32(jnp.inf), jnp.array([1.0, 2.0], jnp.bfloat16)),
                 "mu": {"w": jnp.array([[0.25, 0.0], [1.0, -1.0]])}})
  saved = checkpoint_lib.part_fingerprints(state)
  compiled = checkpoint_lib._leaf_sums._cache_size()
  # Read back by name: dicts, their entries in another order (Orbax sorts the keys).
  by_name = {"opt_state": dict(reversed(state.opt_state.items())), "step": state.step,
             "params": dict(reversed(state.params.items()))}
  restored = checkpoint_lib.part_fingerprints(by_name, frozenset({"step"}))
  assert checkpoint_lib._leaf_sums._cache_size() == compiled
  want = {"step": [0, 0, 0],  # an integer leaf is in no sum
          "params/w": [3.5, 1 + 4 + 0.25 + 16, 0], "params/b": [3.0, 9.0, 1],
          "opt_state/zclip": [3.0, 5.0, 1], "opt_state/mu": [0.25, 0.0625 + 2, 0]}
  assert saved.keys() == restored.keys() == want.keys()
  for name, value in want.items():
    np.testing.assert_allclose(saved[name], value, err_msg=name)
    np.testing.assert_array_equal(restored[name], saved[name], err_msg=name)
  on_host = jax.tree.map(np.asarray, by_name)
  before = checkpoint_lib._leaf_sums._cache_size()
  np.testing.assert_allclose(checkpoint_lib.fingerprint(on_host),
                             np.sum([value for value in want.values()], axis=0))
  assert checkpoint_lib._leaf_sums._cache_size() == before


def test_fingerprint_matches_tolerance_and_missing_values():
  match = checkpoint_lib.fingerprint_matches
  assert match([100.0, 2000.0, 1.0], [100.0 * (1 + 5e-5), 2000.0, 1.0])  # reduction order
  assert not match([100.0, 2000.0, 1.0], [100.2, 2000.0, 1.0])          # 2e-3 off: damage
  assert not match([0.5, 2.0, 0.0], [0.5, 2.0, 1.0])                      # one more non-finite
  assert not match([], [0.5, 2.0, 0.0])                                   # saved without one
  assert not match([0.5, 2.0, 0.0], [math.nan, 2.0, 0.0])
  assert not match([math.inf, 2.0, 0.0], [math.inf, 2.0, 0.0])


def test_leftover_of_a_killed_save_is_ignored_and_cleaned_up(two_steps):
  # What SIGKILL during an async save leaves (seen in test_recovery's kill-during-save run).
  tmp = two_steps / "30.orbax-checkpoint-tmp"
  for item in ("state", "data", "meta"):
    (tmp / f"{item}.orbax-checkpoint-tmp").mkdir(parents=True)
  (tmp / "_CHECKPOINT_METADATA").write_text("{}")
  ckpt = Checkpoints(two_steps, keep=5, async_save=False)
  assert ckpt.all_steps() == [10, 20]
  ckpt.close()
  # Orbax removes it in the background once the manager is open (not awaited by close()).
  deadline = time.monotonic() + 60
  while tmp.exists() and time.monotonic() < deadline:
    time.sleep(0.1)
  assert not tmp.exists()
  (state, meta), fallbacks = _restore(two_steps)
  assert meta["step"] == 20 and not fallbacks


def test_keep_and_delete_after(tmp_path):
  ckpt = Checkpoints(tmp_path / "checkpoints", keep=2, async_save=False)
  for step in (10, 20, 30):
    ckpt.save(step, _state(step), _data_iter(), {})
  ckpt.wait()
  assert ckpt.all_steps() == [20, 30]  # checkpoint.keep
  ckpt.delete_after(20)  # the abandoned branch after a rollback to 20
  assert ckpt.all_steps() == [20]
  ckpt.close()
  (state, meta), _ = _restore(tmp_path / "checkpoints")
  assert meta["step"] == 20
  np.testing.assert_array_equal(np.asarray(state["w"]), np.asarray(_state(20)["w"]))


def test_damage_evidence_classification():
  proof = [FileNotFoundError("no such file"), ValueError("NOT_FOUND: Error reading x"),
           ValueError("OUT_OF_RANGE: Requested byte range [0, 323) is not valid"),
           ValueError("DATA_LOSS: Error decoding manifest"),
           ValueError('Error reading "b/.zarray": Error decoding b-tree node: ZSTD failed'),
           ValueError('FAILED_PRECONDITION: Error reading "params.w/0.0" in OCDBT database at '
                      'local file "/c/20/state/": ZSTD_decompressStream() failed: Unknown frame '
                      'descriptor; at byte 0; at uncompressed byte 0'),
           json.JSONDecodeError("Expecting value", "", 0),
           KeyError('Item "data" was not found in the checkpoint. Available items: []'),
           checkpoint_lib.CheckpointDamaged("contents do not match the fingerprint")]
  for error in proof:
    assert damage_evidence(error), error
  wrapped = RuntimeError("restore failed")
  wrapped.__cause__ = FileNotFoundError("gone")
  assert damage_evidence(wrapped)
  for error in [TimeoutError(), MemoryError(), OSError(5, "Input/output error"),
                PermissionError(13, "denied"), ValueError("DEADLINE_EXCEEDED: timed out"),
                # damage-like words from anything but tensorstore's ValueError prove nothing
                RuntimeError("Error decoding the storage server's reply"),
                ConnectionError("NOT_FOUND: route to host"),
                ValueError("Requested shape: (10, 101) is not compatible with the stored shape"),
                KeyError("params"), RuntimeError("anything")]:
    assert damage_evidence(error) is None, error


def test_write_json_atomic_replaces_whole_or_not_at_all(tmp_path, monkeypatch):
  path = tmp_path / "recovery.json"
  write_json_atomic(path, {"events": [1]})
  assert read_json(path) == {"events": [1]}

  def crash(*args, **kwargs):
    raise OSError("disk full")
  monkeypatch.setattr(checkpoint_lib.os, "replace", crash)
  with pytest.raises(OSError):
    write_json_atomic(path, {"events": [1, 2]})
  assert read_json(path) == {"events": [1]}  # the old decision, intact
  assert read_json(tmp_path / "absent.json") is None
  (tmp_path / "bad.json").write_text("{")
  with pytest.raises(CheckpointError, match="bad.json cannot be read"):
    read_json(tmp_path / "bad.json")


@pytest.mark.parametrize("override,match", [
    ("stability.recovery.lr_recovery_steps=0", "lr_recovery_steps=0 must be > 0"),
    ("stability.recovery.lr_recovery_schedule=\"cosine\"",
     "lr_recovery_schedule='cosine' is not known"),
    ("stability.recovery.loss_explosion_factor=1.0", "loss_explosion_factor=1.0 must be > 1"),
    ("stability.recovery.loss_window=0", "loss_window=0 must be > 0"),
    ("faults.garbage_batch_indices=[3, -1]", "garbage_batch_indices=\\[3, -1\\] has a negative"),
])
def test_recovery_config_errors_name_the_key(override, match):
  from stablejax.training.config import ConfigError, load_config
  with pytest.raises(ConfigError, match=match):
    load_config(None, [override])
  cfg = load_config(None, ["stability.recovery.lr_recovery_steps=null"])
  assert cfg.stability.recovery.lr_recovery_steps is None


def test_rollback_line_names_the_skipped_batches_as_an_inclusive_range():
  # skipped_batches is [first, last): batches 20 to 29 for (20, 30).
  event = RollbackEvent(step=30, cause="loss spike", restored_step=20, lr_scale=0.2,
                        skipped_batches=(20, 30))
  assert event.describe() == ("step 30: loss spike; restored step 20, lr scale 0.2, "
                              "skipped data batches 20..29")


def test_a_long_damage_reason_is_cut_between_words_not_inside_a_path():
  from stablejax.training.checkpoint import shorten
  path = "/runs/a/checkpoints/10/state/ocdbt.process_0/d/" + "f" * 40
  reason = "missing file: " + " ".join([path] * 8)
  short = shorten(reason)
  assert short.endswith(" ...") and len(short) <= 304
  assert all(word == path for word in short[len("missing file: "):-len(" ...")].split())
  assert shorten("one line\nsecond line") == "one line"


def test_skip_and_rollback_counters_come_from_the_metric_specs():
  # The counters a state declares (register_state_metrics(skips=..., rollback=...)), a repeated
  # prefix included; other counters of the same record are not skips.
  from stablejax.monitor.specs import rollback_request_counts, total_skips
  record = {"skip_spikes/total_skips": 2, "skip_nonfinite/total_skips": 3,
            "skip_spikes_1/total_skips": 4, "zclip/spike_count": 7, "muon/fallback_count": 5,
            "skip_spikes/rollback_requests": 1, "skip_nonfinite/rollback_requests": 0,
            "loss": 2.0}
  assert total_skips(record) == 9
  assert rollback_request_counts(record) == {"skip_spikes/rollback_requests": 1,
                                             "skip_nonfinite/rollback_requests": 0}
