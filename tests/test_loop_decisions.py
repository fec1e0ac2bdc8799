"""The training loop's small decisions (faults, data skips, samples, early stop), each on the
piece that makes it (the data stream, the periodic actions), without a trainer run.

A whole trainer run takes minutes; these build only what each decision reads, so each documented
rule is checked in milliseconds.
"""

from __future__ import annotations

import collections
import time
import types
from typing import Any, Optional

import numpy as np
import pytest

from stablejax.training.loop.actions import Checkpointing, Evaluation, Logging, Sampling, TimeBudget
from stablejax.training.loop.batches import Batches, garbage_batch, total_skips
from stablejax.training.config import load_config


def _batches(*overrides: str) -> Batches:
  cfg = load_config(None, list(overrides))
  # Batch i of the stream holds the token i, so a batch tells its data position.
  stream = ({"tokens": np.full((2, 5), i, np.int32)} for i in range(1000))
  return Batches(stream, cfg.faults, 256, lambda tokens, grad_scale, step: {
      "tokens": tokens, "grad_scale": np.float32(grad_scale)})


def _position(batch: dict) -> int:
  return int(np.asarray(batch["tokens"])[0, 0])


def test_total_skips_adds_up_every_skip_wrapper() -> None:
  record = {"loss": 2.0, "skip_nonfinite/total_skips": 2, "skip_spikes/total_skips": 3,
            "zclip/spike_count": 7}
  assert total_skips(record) == 5
  assert total_skips({"loss": 2.0}) == 0


def test_batch_faults_follow_the_data_position_and_step_faults_the_step() -> None:
  # FaultsConfig: a step fault hits "the step about to run"; a batch fault belongs to the data
  # (0-based positions in the stream), whatever step meets it.
  batches = _batches("faults.nan_grad_batch_indices=[3]", "faults.grad_scale_steps=[2]",
                     "faults.grad_scale_factor=100.0")
  first = batches.next(0)
  assert _position(first) == 0 and float(first["grad_scale"]) == 1.0
  batches.schedule_skip(1, 3)  # a rollback skipped batches 1 and 2: the stream is at 1, so now
  batch = batches.next(1)
  assert _position(batch) == 3 and np.isnan(batch["grad_scale"])  # step 1, batch 3
  batch = batches.next(2)
  assert _position(batch) == 4 and float(batch["grad_scale"]) == 100.0
  assert batches.consumed == 5


def test_a_repeated_batch_fault_serves_the_first_listed_batch_again() -> None:
  # faults.repeat_batch_steps: the batch of the first listed step at every listed step; the
  # stream still advances, so the data after the fault is where it would have been.
  batches = _batches("faults.repeat_batch_steps=[1, 2, 3]")
  positions = [_position(batches.next(step)) for step in range(6)]
  assert positions == [0, 1, 1, 1, 4, 5] and batches.consumed == 6


def test_garbage_batch() -> None:
  rep = garbage_batch("repeat", 3, 8, 256, seed=0)["tokens"]
  assert rep.shape == (3, 9) and rep.dtype == np.int32 and len(np.unique(rep)) == 1
  rnd = garbage_batch("random", 3, 8, 256, seed=0)["tokens"]
  assert rnd.shape == (3, 9) and rnd.min() >= 0 and rnd.max() < 256 and len(np.unique(rnd)) > 10
  np.testing.assert_array_equal(rnd, garbage_batch("random", 3, 8, 256, seed=0)["tokens"])
  with pytest.raises(ValueError, match="repeat"):
    garbage_batch("zeros", 3, 8, 256, seed=0)


def test_logs_step_1_and_every_log_every_steps() -> None:
  cfg = load_config(None, ["train.log_every=10"])
  logging = Logging(types.SimpleNamespace(cfg=cfg), *([None] * 6))
  assert [s for s in range(1, 31) if logging.due(s)] == [1, 10, 20, 30]


def test_a_deferred_skip_is_taken_when_the_replay_reaches_it() -> None:
  # Batches.schedule_skip: batches [first, last) are skipped "once the replay reaches `first`".
  batches = _batches()
  batches.schedule_skip(2, 4)
  assert batches.pending == [(2, 4)] and batches.consumed == 0
  positions = [_position(batches.next(step)) for step in range(4)]
  assert positions == [0, 1, 4, 5] and batches.pending == []


def test_a_checkpoint_stores_the_positions_of_the_checkpoints_still_on_disk() -> None:
  batches = _batches()
  for step in range(3):
    batches.next(step)
  assert batches.state_dict(3, on_disk={0}) == {
      "batches_consumed": 3, "pending_skips": [], "checkpoint_batches": {"3": 3}}
  batches.load({"step": 3, "batches_consumed": 3, "pending_skips": [[5, 7]],
                "checkpoint_batches": {"0": 0}})
  assert batches.checkpoint_positions == {0: 0, 3: 3} and batches.pending == [(5, 7)]


def test_samples_at_their_steps_but_not_at_the_last_one() -> None:
  # logging.sample_every=null: "at each eval"; the final eval samples (not the periodic rule).
  every_eval = ("train.steps=30", "train.warmup_steps=5", "train.eval_every=10")

  def sampling(*overrides: str) -> Sampling:
    cfg = load_config(None, list(overrides))
    return Sampling(types.SimpleNamespace(cfg=cfg, sampler=object(), total_steps=30), log=None)

  run = sampling(*every_eval, "logging.sample_every=null")
  assert [s for s in range(1, 31) if run.due(s)] == [10, 20]
  run = sampling(*every_eval, "logging.sample_every=4")
  assert [s for s in range(1, 31) if run.due(s)] == [4, 8, 12, 16, 20, 24, 28]


def test_early_stop_takes_the_mean_step_time_since_the_previous_check() -> None:
  # TimeBudget: "the next step is taken to last as long as the steps since the previous check
  # did": 10 s over 5 steps is 2 s a step.
  seen: list[Optional[float]] = []

  def out_of_time(recent: Optional[float]) -> bool:
    seen.append(recent)
    return False

  budget: Any = TimeBudget(types.SimpleNamespace(out_of_time=out_of_time), log=None,
                           agree_any=lambda flag: flag)
  budget.checked = (time.time() - 10.0, 0)
  assert budget.out_of_time(5) is False
  assert seen[0] == pytest.approx(2.0, abs=0.1)
  assert budget.checked[1] == 5



def test_the_periodic_eval_skips_the_last_step_which_has_the_final_one() -> None:
  cfg = load_config(None, ["train.steps=30", "train.warmup_steps=5", "train.eval_every=10"])
  components = types.SimpleNamespace(cfg=cfg, total_steps=30)
  evaluation = Evaluation(components, [], None, None, None, None, None)
  assert [s for s in range(1, 31) if evaluation.due(s)] == [10, 20]


def test_a_deferred_checkpoint_is_retried_at_the_next_log_step() -> None:
  # checkpoint.every=10, train.log_every=4: saves at 10, 20 and the last step (25); a save
  # deferred (the loss was elevated) is due again at each log step until it is taken.
  cfg = load_config(None, ["train.steps=25", "train.warmup_steps=5", "train.log_every=4",
                           "checkpoint.every=10"])
  components = types.SimpleNamespace(cfg=cfg, total_steps=25)
  checkpointing = Checkpointing(components, None, None, dict, None, None)
  assert [s for s in range(1, 26) if checkpointing.due(s)] == [10, 20, 25]
  checkpointing.deferred = True
  assert [s for s in range(11, 20) if checkpointing.due(s)] == [12, 16]


def test_a_config_built_before_in_this_process_reuses_its_jitted_programs() -> None:
  # A second run here with an equal config calls the same jitted functions (traced and compiled
  # once); another config, or a declaration registered since, builds afresh. No program runs.
  from typing import NamedTuple

  from helpers import optax_lr, tiny_config
  from stablejax.data.pipeline import build_data
  from stablejax.training.loop import components as components_lib
  from stablejax.transforms import metrics

  cfg = tiny_config()
  data = build_data(cfg.data, seq_len=cfg.train.seq_len, batch_size=cfg.train.batch_size, seed=0)
  first = components_lib.build_components(cfg, data)
  again = components_lib.build_components(tiny_config(), data)  # equal, not the same object
  assert again.train_step is first.train_step and again.init_state is first.init_state
  assert again.eval_step is first.eval_step and again.data is data
  # A longer run (a resume that trains on, a time budget's count): the run's length is an
  # argument of the step, so the programs are the same.
  longer = components_lib.build_components(tiny_config("train.steps=41"), data)
  assert longer.train_step is first.train_step and longer.total_steps == 41
  assert float(longer.schedule(41)) == pytest.approx(optax_lr(longer.cfg, 41), rel=1e-5)
  warmer = components_lib.build_components(tiny_config("train.warmup_steps=5"), data)
  assert warmer.train_step is not first.train_step  # the schedule's warmup is in the program
  # Settings only the host reads (faults, when to save and log, the recovery's policy, the seed
  # and the data) share the programs; the run's own config stays the caller's.
  # When to log and save reach the step as its batch's read_metrics.
  host_only = tiny_config("faults.nan_grad_steps=[3]", "checkpoint.keep=1",
                          "logging.progress=false", "stability.recovery.max_rollbacks=7",
                          "train.seed=5", "data.shuffle_buffer=64", "checkpoint.every=7",
                          "train.log_every=3")
  shared = components_lib.build_components(host_only, data)
  assert shared.train_step is first.train_step and shared.cfg is host_only
  batches = [shared.step_batch(np.zeros((8, 33), np.int32), step=s) for s in range(7)]
  assert [bool(b["read_metrics"]) for b in batches] == [True, False, True, False, False, True,
                                                        True]  # steps 1, 3, 6 (logs) and 7 (save)

  class ProbeState(NamedTuple):
    hits: Any

  metrics.register_state_metrics(ProbeState, "reuse_probe", lambda s: {})
  try:
    after = components_lib.build_components(cfg, data)  # (the memo holds four: cfg is still one)
    assert after.train_step is not first.train_step
  finally:
    metrics.unregister_state_metrics(ProbeState)
  assert len(components_lib._BUILT) <= components_lib._BUILT_KEPT
  # The least recently used config goes first: the first of four, used again, outlives the
  # second when a fifth comes. (The memo is put back: later tests here reuse its programs.)
  kept = collections.OrderedDict(components_lib._BUILT)
  try:
    runs = [tiny_config(f"train.warmup_steps={6 + i}")
            for i in range(components_lib._BUILT_KEPT + 1)]
    built = [components_lib.build_components(c, data) for c in runs[:-1]]
    assert components_lib.build_components(runs[0], data).train_step is built[0].train_step
    components_lib.build_components(runs[-1], data)
    assert components_lib.build_components(runs[0], data).train_step is built[0].train_step
    assert components_lib.build_components(runs[1], data).train_step is not built[1].train_step
  finally:
    components_lib._BUILT.clear()
    components_lib._BUILT.update(kept)


def _changed(value: Any) -> Any:
  """A value other than ``value`` of its kind (the programs must not read it)."""
  if isinstance(value, bool):
    return not value
  if isinstance(value, (int, float)):
    return value * 2 + 3
  if isinstance(value, str):
    return value + "changed"
  if isinstance(value, list):
    return [*value, 7]
  return 7  # None: an optional step, device, count or rate


def test_no_program_reads_a_host_only_setting() -> None:
  # Every HOST_ONLY setting changed at once, bypassing program_config: each program lowers to the
  # same module as with the defaults, so sharing programs between such configs never runs a stale
  # one. A program that read one of them would differ here.
  import dataclasses

  import jax
  import jax.numpy as jnp

  from helpers import tiny_config
  from stablejax.training.loop import components as components_lib

  cfg = tiny_config()
  changed = {}
  for path, fields in components_lib.HOST_ONLY.items():
    top, _, sub = path.partition(".")
    section = getattr(cfg.stability, sub) if sub else getattr(cfg, top)
    names = fields if fields is not None else [f.name for f in dataclasses.fields(section)]
    changed[path] = dataclasses.replace(section, **{n: _changed(getattr(section, n))
                                                    for n in names})
  other = dataclasses.replace(
      cfg, stability=dataclasses.replace(cfg.stability, **{
          p.split(".")[1]: v for p, v in changed.items() if "." in p}),
      **{p: v for p, v in changed.items() if "." not in p})
  assert other.faults.nan_grad_steps == [7] and other.checkpoint.keep != cfg.checkpoint.keep

  def lowered(c: Any) -> list[str]:
    built = components_lib._build_programs(c, None, None)
    t = c.train
    tokens = jax.ShapeDtypeStruct((t.grad_accum, t.batch_size // t.grad_accum, t.seq_len + 1),
                                  jnp.int32, sharding=built.tokens_sharding)
    batch = {"tokens": tokens, "grad_scale": jax.ShapeDtypeStruct((), jnp.float32),
             "run_steps": jax.ShapeDtypeStruct((), jnp.int32),
             "read_metrics": jax.ShapeDtypeStruct((), jnp.bool_)}
    params, step = built.abstract_state.params, jax.ShapeDtypeStruct((), jnp.int32)
    return [built.train_step.lower(built.abstract_state, batch).as_text(),
            built.init_state.lower(jax.ShapeDtypeStruct((2,), jnp.uint32)).as_text(),
            built.logit_telemetry.lower(params, tokens, step).as_text()]

  assert lowered(other) == lowered(cfg)
