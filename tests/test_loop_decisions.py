"""The training loop's small decisions (faults, data skips, samples, early stop) on a bare Run.

A whole trainer run takes minutes; these build a Run without __init__ and set only what each
decision reads, so each documented rule is checked in milliseconds.
"""

from __future__ import annotations

import time
import types
from typing import Any, Optional

import numpy as np
import pytest

from stablejax.training.config import load_config
from stablejax.training.loop import Run, _total_skips


def _bare_run(*overrides: str) -> Any:
  run: Any = Run.__new__(Run)
  run.cfg = load_config(None, list(overrides))
  run.data = types.SimpleNamespace(vocab_size=256)
  # Batch i of the stream holds the token i, so a batch tells its data position.
  run.train_iter = (({"tokens": np.full((2, 5), i, np.int32)}) for i in range(1000))
  run.batches_consumed = 0
  run.pending_skips = []
  run._device_tokens = lambda tokens: tokens
  return run


def _position(batch: dict) -> int:
  return int(np.asarray(batch["tokens"])[0, 0])


def test_total_skips_adds_up_every_skip_wrapper() -> None:
  record = {"loss": 2.0, "skip_nonfinite/total_skips": 2, "skip_spikes/total_skips": 3,
            "zclip/spike_count": 7}
  assert _total_skips(record) == 5
  assert _total_skips({"loss": 2.0}) == 0


def test_batch_faults_follow_the_data_position_and_step_faults_the_step() -> None:
  # FaultsConfig: a step fault hits "the step about to run"; a batch fault belongs to the data
  # (0-based positions in the stream), whatever step meets it.
  run = _bare_run("faults.nan_grad_batch_indices=[3]", "faults.grad_scale_steps=[2]",
                  "faults.grad_scale_factor=100.0")
  first = run._next_batch(0)
  assert _position(first) == 0 and float(first["grad_scale"]) == 1.0
  run._schedule_skip(1, 3)  # a rollback skipped batches 1 and 2: the stream is at 1, so now
  batch = run._next_batch(1)
  assert _position(batch) == 3 and np.isnan(batch["grad_scale"])  # step 1, batch 3
  batch = run._next_batch(2)
  assert _position(batch) == 4 and float(batch["grad_scale"]) == 100.0
  assert run.batches_consumed == 5


def test_a_deferred_skip_is_taken_when_the_replay_reaches_it() -> None:
  # _schedule_skip: batches [first, last) are skipped "once the replay reaches `first`".
  run = _bare_run()
  run._schedule_skip(2, 4)
  assert run.pending_skips == [(2, 4)] and run.batches_consumed == 0
  positions = [_position(run._next_batch(step)) for step in range(4)]
  assert positions == [0, 1, 4, 5] and run.pending_skips == []


def test_samples_at_their_steps_but_not_at_the_last_one() -> None:
  # logging.sample_every=null: "at each eval"; the final eval samples (not the periodic rule).
  every_eval = ("train.steps=30", "train.warmup_steps=5", "train.eval_every=10")
  run = _bare_run(*every_eval, "logging.sample_every=null")
  run.sampler = object()
  assert [s for s in range(1, 31) if run._sample_due(s)] == [10, 20]
  run = _bare_run(*every_eval, "logging.sample_every=4")
  run.sampler = object()
  assert [s for s in range(1, 31) if run._sample_due(s)] == [4, 8, 12, 16, 20, 24, 28]


def test_early_stop_takes_the_mean_step_time_since_the_previous_check() -> None:
  # _out_of_time: "the next step is taken to last as long as the steps since the previous check
  # did": 10 s over 5 steps is 2 s a step.
  run = _bare_run()
  seen: list[Optional[float]] = []

  def out_of_time(recent: Optional[float]) -> bool:
    seen.append(recent)
    return False

  run.budget = types.SimpleNamespace(out_of_time=out_of_time)
  run.time_check = (time.time() - 10.0, 0)
  assert run._out_of_time(5) is False
  assert seen[0] == pytest.approx(2.0, abs=0.1)
  assert run.time_check[1] == 5

