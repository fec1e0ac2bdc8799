"""config.validate and config.ineffective_keys at the edges their messages state."""

from __future__ import annotations

import pytest

from stablejax.training.config import Config, ConfigError, ineffective_keys, load_config


def _load(*overrides: str) -> Config:
  return load_config(None, list(overrides))


# (overrides just inside the documented range, the same key just outside it, message)
EDGES = [
    # "train.warmup_steps=... must be below train.steps"
    (["train.steps=10", "train.warmup_steps=9"], ["train.steps=10", "train.warmup_steps=10"],
     "train.warmup_steps=10 must be below train.steps=10"),
    (["train.batch_size=8", "train.grad_accum=4"], ["train.batch_size=8", "train.grad_accum=3"],
     "not divisible by train.grad_accum=3"),
    (["model.max_seq_len=64", "train.seq_len=64"], ["model.max_seq_len=64", "train.seq_len=65"],
     "train.seq_len=65 exceeds model.max_seq_len=64"),
    (["train.min_lr_ratio=1.0"], ["train.min_lr_ratio=1.5"], "must lie in \\[0, 1\\]"),
    (["stability.spike_window=16", "stability.spike_min_history=16"],
     ["stability.spike_window=16", "stability.spike_min_history=17"],
     "spike_min_history=17 must lie in \\[1, stability.spike_window=16\\]"),
    # OLMo-core's rule needs 19 losses before it can skip.
    (["stability.spike_statistics=\"olmo_core\"", "stability.spike_window=19"],
     ["stability.spike_statistics=\"olmo_core\"", "stability.spike_window=18"],
     "spike_window=18 is below 19"),
    (["stability.emergency_lr_factor=1.0"], ["stability.emergency_lr_factor=0.0"],
     "emergency_lr_factor=0.0 must lie in \\(0, 1\\]"),
    (["mesh.distributed=true", "mesh.process_id=0"], ["mesh.process_id=0"],
     "mesh.process_id is set but mesh.distributed=false"),
]


@pytest.mark.parametrize("inside,outside,message", EDGES)
def test_each_bound_accepts_its_edge_and_rejects_the_next_value(inside: list[str],
                                                                outside: list[str],
                                                                message: str) -> None:
  _load(*inside)
  with pytest.raises(ConfigError, match=message):
    _load(*outside)


def test_keys_left_at_their_defaults_are_never_named_as_ineffective() -> None:
  # AdamW mode leaves every Muon key unused; at their defaults (momentum 0.95, ns_steps 5, ...)
  # none of them was set, so none is named.
  assert ineffective_keys(_load("optimizer.name=\"adamw\"")) == []
  lines = ineffective_keys(_load("optimizer.name=\"adamw\"", "optimizer.momentum=0.9"))
  assert lines == ["optimizer.momentum=0.9 has no effect with optimizer.name=\"adamw\" (AdamW uses "
                   "optimizer.learning_rate and optimizer.weight_decay)"]


def test_outlier_threshold_without_an_outlier_method_is_named_as_ineffective() -> None:
  assert ineffective_keys(_load("optimizer.outlier_method=null")) == []
  lines = ineffective_keys(_load("optimizer.outlier_method=null",
                                 "optimizer.outlier_threshold=3.0"))
  assert lines == ["optimizer.outlier_threshold=3.0 has no effect with "
                   "optimizer.outlier_method=null"]
