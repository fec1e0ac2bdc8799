"""The settings that fix the order of a run's batches over its data.

A run records them in ``run.json``
(:attr:`stablejax.training.run_folder.folder.RunDirectory.data_order`); a resume with other settings
trains on the same data in another order, which the trainer says in one line (`order_difference`)
rather than refuses.

Example:
  >>> from stablejax.training.config import load_config
  >>> from stablejax.training.run_folder.data_order import data_order, order_difference
  >>> before = data_order(load_config(None, []))
  >>> after = data_order(load_config(None, ["train.seed=1"]))
  >>> order_difference(before, after)
  'train.seed 0 -> 1'
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
  from stablejax.training.config import Config


def data_order(cfg: Config) -> dict:
  """The settings that fix the order of the batches over the same data (recorded in run.json)."""
  return {"train.seed": cfg.train.seed, "train.batch_size": cfg.train.batch_size,
          "train.seq_len": cfg.train.seq_len, "data.shuffle_buffer": cfg.data.shuffle_buffer}


def order_difference(recorded: dict, current: dict) -> str:
  """``train.seed 0 -> 1, ...``: the settings of the data order that changed."""
  return ", ".join(f"{key} {recorded.get(key)} -> {value}" for key, value in current.items()
                   if recorded.get(key) != value)
