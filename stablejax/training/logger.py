"""Run logs: metrics.jsonl, TensorBoard (tensorboardX) and the console. Only process 0 writes."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, Optional, TextIO

import jax
import numpy as np
import numpy.typing as npt
from tqdm import tqdm


def _plain(value: Any) -> Any:
  """JSON-safe Python scalar (NaN/Inf become strings JSON can carry, as json.dumps does)."""
  if isinstance(value, (np.ndarray, np.generic, jax.Array)):
    value = np.asarray(value)
    if value.ndim:
      return [_plain(v) for v in value.tolist()]
    value = value.item()
  return value


class RunLogger:
  """Appends records to metrics.jsonl and mirrors scalars to TensorBoard."""

  def __init__(self, out_dir: Path, tensorboard: bool = True):
    self.enabled = jax.process_index() == 0
    self.out_dir = Path(out_dir)
    self._jsonl: Optional[TextIO] = None
    self._tb: Any = None  # a tensorboardX SummaryWriter (no type stub published)
    if not self.enabled:
      return
    self._jsonl = open(self.out_dir / "metrics.jsonl", "a", buffering=1)
    if tensorboard:
      from tensorboardX import SummaryWriter
      self._tb = SummaryWriter(logdir=str(self.out_dir / "tensorboard"))

  def record(self, record: dict, tb_scalars: Optional[dict] = None) -> None:
    if not self.enabled or self._jsonl is None:
      return
    plain = {k: _plain(v) for k, v in record.items()}
    self._jsonl.write(json.dumps(plain) + "\n")
    if self._tb is not None and tb_scalars:
      step = int(plain["step"])
      for tag, value in tb_scalars.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
          self._tb.add_scalar(tag, value, step)

  def histogram(self, tag: str, values: npt.ArrayLike, step: int) -> None:
    if self.enabled and self._tb is not None:
      all_values = np.asarray(values, dtype=np.float64)
      finite = all_values[np.isfinite(all_values)]
      if finite.size:
        self._tb.add_histogram(tag, finite, step)

  def text(self, tag: str, text: str, step: int) -> None:
    if self.enabled and self._tb is not None:
      self._tb.add_text(tag, text, step)

  def console(self, line: str) -> None:
    if self.enabled:
      # tqdm.write keeps a progress bar intact and behaves like print without one.
      tqdm.write(line, file=sys.stderr if line.startswith(("warning", "error")) else sys.stdout)

  def close(self) -> None:
    if self._jsonl is not None:
      self._jsonl.close()
    if self._tb is not None:
      self._tb.close()
