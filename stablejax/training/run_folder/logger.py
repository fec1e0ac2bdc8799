"""Run logs: metrics.jsonl, TensorBoard (tensorboardX) and the console. Only process 0 writes."""

from __future__ import annotations

import json
import math
import sys
from typing import Any, Optional, TextIO

import jax
import numpy as np
import numpy.typing as npt
from tqdm import tqdm

from stablejax.monitor.tensorboard import tensorboard_scalars


def _plain(value: Any) -> Any:
  """JSON-safe Python scalar (NaN/Inf become strings JSON can carry, as json.dumps does)."""
  if isinstance(value, (np.ndarray, np.generic, jax.Array)):
    value = np.asarray(value)
    if value.ndim:
      return [_plain(v) for v in value.tolist()]
    value = value.item()
  return value


class RunLogger:
  """Appends records to metrics.jsonl and mirrors scalars to TensorBoard; prints to the console.

  The files are opened by :meth:`open`, once the run's start-up checks passed (nothing in the run
  directory changes before); records logged before that are kept and written then.
  """

  def __init__(self, run_dir: Any, tensorboard: bool = True):
    self.enabled = jax.process_index() == 0
    self.run_dir = run_dir  # a RunDirectory: the files are created through its record
    self.tensorboard = tensorboard
    self._jsonl: Optional[TextIO] = None
    self._tb: Any = None  # a tensorboardX SummaryWriter (no type stub published)
    self._early: list[tuple[dict, Optional[dict]]] = []

  def open(self) -> None:
    """Opens metrics.jsonl (appending) and the TensorBoard writer (process 0)."""
    if not self.enabled or self._jsonl is not None:
      return
    self._jsonl = open(self.run_dir.path("metrics.jsonl"), "a", buffering=1)
    if self.tensorboard:
      from tensorboardX import SummaryWriter
      self._tb = SummaryWriter(logdir=str(self.run_dir.path("tensorboard")))
    early, self._early = self._early, []
    for record, tb_scalars in early:
      self.record(record, tb_scalars)

  def record(self, record: dict, tb_scalars: Optional[dict] = None) -> None:
    """Appends ``record`` to metrics.jsonl and ``tb_scalars`` to TensorBoard (an event record
    without them: its :func:`tensorboard_scalars`, ``events/<event>`` among them)."""
    if not self.enabled:
      return
    if tb_scalars is None and "event" in record:
      tb_scalars = tensorboard_scalars(record)
    if self._jsonl is None:
      self._early.append((record, tb_scalars))
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
    """Closes both files, the second even when the first fails (a full disk)."""
    jsonl, tb, self._jsonl, self._tb = self._jsonl, self._tb, None, None
    try:
      if jsonl is not None:
        jsonl.close()
    finally:
      if tb is not None:
        try:
          tb.close()
        except OSError:
          _give_up(tb)
          raise


def _give_up(tb: Any) -> None:
  """After a close that failed (a full disk), marks tensorboardX's event files closed: its own
  exit hook would flush them again and print the same error as a traceback."""
  for writer in getattr(tb, "all_writers", {}).values():
    events = getattr(writer, "event_writer", None)
    if events is not None and hasattr(events, "_closed"):
      events._closed = True
