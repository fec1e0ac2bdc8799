"""The training data stream of a run: its position, the data a rollback skips, and the faults.

Position ``i`` is the ``i``-th batch read from the stream since the run started (what a
checkpoint stores as ``batches_consumed``). A rollback skips the batches read since its target
checkpoint: at once when the stream is already there, else when the replay of good batches
reaches them (``pending``). Positions rejected too often (``blocked``,
:mod:`stablejax.training.recovery.rejected`) are read and dropped, never trained on. The configured
faults (``faults.*``, :class:`FaultsConfig`) change the batch a step gets: a step fault strikes
whatever data the step reads, a batch fault the data at its position, so a rollback that skips the
batch never meets it again; a transient fault strikes a step's first execution in this process only
(a replay or a rollback runs it clean), as a flaky device does.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import jax
import numpy as np

from stablejax.monitor.specs import total_skips  # noqa: F401 (the loop's import of it)
from stablejax.training.config import FaultsConfig

if TYPE_CHECKING:
  import optax


class Batches:
  """The run's stream of device batches (``next``), with its skips and faults.

  Args:
    stream: the data iterator (Grain's, checkpointed with the state).
    faults: the run's ``faults`` section.
    vocab_size: the data's vocabulary (garbage batches draw from it).
    step_batch: ``(host tokens [B/P, T+1], fault factor, step=) -> the step's batch on device``
      (:meth:`stablejax.training.loop.components.Components.step_batch`).
  """

  def __init__(self, stream: Iterator[dict], faults: FaultsConfig, vocab_size: int,
               step_batch: Callable[..., dict]):
    self.stream = stream
    self.faults = faults
    self.vocab_size = vocab_size
    self.step_batch = step_batch
    self.consumed = 0                                  # position of the next batch
    self.pending: list[tuple[int, int]] = []           # skips [first, last) the replay has not met
    self.checkpoint_positions: dict[int, int] = {}     # checkpoint step -> its position
    self.repeated: Optional[np.ndarray] = None         # faults.repeat_batch_steps' batch
    self.blocked: set[int] = set()                     # positions never trained on
    self.dropped: list[tuple[int, int]] = []           # (position, step) of blocked ones dropped
    self.positions: dict[int, int] = {}                # step -> position of its batch (recent)
    self.last_step = -1                                # steps above it run for the first time
    self.first_execution = False                       # of the step last served
    self.noise = np.random.default_rng()               # faults.nondeterministic_steps' draws

  def load(self, meta: dict) -> None:
    """The position, the deferred skips and the positions of older checkpoints, as a restored
    checkpoint recorded them (``{}``: a fresh run, or a checkpoint that predates them)."""
    self.consumed = int(meta.get("batches_consumed", 0))
    self.pending = sorted((int(a), int(b)) for a, b in meta.get("pending_skips", []))
    known = {int(k): int(v) for k, v in meta.get("checkpoint_batches", {}).items()}
    if "step" in meta:
      known[int(meta["step"])] = self.consumed
    self.checkpoint_positions = known

  def state_dict(self, step: int, on_disk: set[int]) -> dict:
    """What a checkpoint at ``step`` stores (positions of the checkpoints still ``on_disk``)."""
    self.checkpoint_positions[step] = self.consumed
    return {"batches_consumed": self.consumed,
            "pending_skips": [list(r) for r in self.pending],
            "checkpoint_batches": {str(s): b for s, b in sorted(self.checkpoint_positions.items())
                                   if s in on_disk | {step}}}

  def next(self, step: int) -> dict:
    """The batch of ``step`` (0-based index of the step about to run), on device."""
    f = self.faults
    while True:
      while self.pending and self.consumed >= self.pending[0][0]:
        _, last = self.pending.pop(0)  # a rollback's skip, deferred until the replay got here
        self.skip(last - self.consumed)
      if self.consumed not in self.blocked:
        break
      self.dropped.append((self.consumed, step))
      self.skip(1)
    index = self.consumed
    tokens = next(self.stream)["tokens"]
    self.consumed += 1
    self.positions[step] = index
    self.positions.pop(step - 100_000, None)  # a long run keeps only recent steps
    first_execution, self.last_step = step > self.last_step, max(self.last_step, step)
    self.first_execution = first_execution
    if step in f.garbage_batch_steps or index in f.garbage_batch_indices:
      seed = step if step in f.garbage_batch_steps else index
      tokens = garbage_batch(f.garbage_kind, tokens.shape[0], tokens.shape[1] - 1,
                             self.vocab_size, seed=seed)["tokens"]
    if step in f.repeat_batch_steps:  # the stream still advances: the data order after it holds
      if self.repeated is None:
        self.repeated = np.asarray(tokens)
      tokens = self.repeated
    return self.step_batch(np.asarray(tokens, np.int32),
                           self.grad_scale(step, index, first_execution), step=step)

  def grad_scale(self, step: int, index: int, first_execution: bool) -> float:
    """The factor the configured faults put on the gradient of ``step`` (batch ``index``): 1.0
    without a fault. Each call is one execution (the nondeterministic fault draws anew)."""
    f = self.faults
    scale = 1.0
    device_fault = f.transient_device is not None  # then the NaN comes from that device's copy
    if (step in f.nan_grad_steps or index in f.nan_grad_batch_indices
        or (first_execution and step in f.transient_nan_steps and not device_fault)):
      scale = float("nan")
    elif step in f.grad_scale_steps or (first_execution and step in f.transient_grad_scale_steps):
      scale = f.grad_scale_factor
    if step in f.nondeterministic_steps:
      scale *= 1.0 + f.nondeterminism * float(self.noise.standard_normal())
    return scale

  def schedule_skip(self, first: int, last: int) -> None:
    """Skips positions ``[first, last)``: now when the stream is at ``first`` or past it, else
    once the replay reaches ``first`` (the batches before it were good)."""
    if self.consumed >= first:
      self.skip(last - self.consumed)
    else:
      self.pending = sorted(self.pending + [(first, last)])

  def skip(self, n: int) -> None:
    """Advances the stream by ``n`` batches without training on them."""
    for _ in range(n):
      next(self.stream)
    self.consumed += max(0, n)


def garbage_batch(kind: str, batch_size: int, seq_len: int, vocab_size: int, seed: int) -> dict:
  """A deliberately bad batch for fault injection.

  Args:
    kind: "repeat" (every position is one token, chosen from the seed) or "random" (uniform
      random token ids, i.e. random bytes for vocab 256).
    batch_size: rows.
    seq_len: model sequence length (the batch has ``seq_len + 1`` columns like real batches).
    vocab_size: token ids are drawn from ``[0, vocab_size)``.
    seed: seed.

  Returns:
    ``{"tokens": int32 [batch_size, seq_len + 1]}``.
  """
  rng = np.random.default_rng(seed)
  shape = (batch_size, seq_len + 1)
  if kind == "repeat":
    return {"tokens": np.full(shape, int(rng.integers(0, vocab_size)), np.int32)}
  if kind == "random":
    return {"tokens": rng.integers(0, vocab_size, size=shape, dtype=np.int64).astype(np.int32)}
  raise ValueError(f"garbage kind {kind!r} is unknown: use 'repeat' or 'random'")


def state_faults(state: Any, faults: FaultsConfig, step: int, first_execution: bool) -> Any:
  """``state`` with the configured faults of the parameters at ``step``: one device's copy
  changed (``faults.corrupt_replica_step``, a replica that diverged silently) or turned NaN on
  the step's first execution (``faults.transient_device``, a flaky device)."""
  from stablejax.training.recovery.replicas import corrupt_copy
  last = jax.device_count() - 1
  if faults.corrupt_replica_step == step:
    device = last if faults.corrupt_replica_device is None else faults.corrupt_replica_device
    state = state.replace(params=corrupt_copy(state.params, device))
  if (faults.transient_device is not None and first_execution
      and step in faults.transient_nan_steps):
    state = state.replace(params=corrupt_copy(state.params, faults.transient_device, nan=True))
  return state


def hang_if_due(faults: FaultsConfig, step: int) -> None:
  """Blocks this thread for good just before ``faults.hang_at_step`` (a hung host)."""
  if faults.hang_at_step is not None and step == faults.hang_at_step:
    threading.Event().wait()


def hang_in_pipeline(dataset: Any, faults: FaultsConfig) -> Any:
  """``dataset`` (a Grain ``MapDataset`` of batches), blocking for good when the pipeline reads
  position ``faults.hang_at_batch`` (a stuck input pipeline: the trainer waits in ``next``)."""
  position = faults.hang_at_batch
  if position is None:
    return dataset

  def read(index: int, batch: Any) -> Any:
    if index == position:
      threading.Event().wait()
    return batch
  return dataset.map_with_index(read)


def kill_if_due(faults: FaultsConfig, n: int, when: str) -> None:
  """SIGKILL at the configured step, checkpoint save or rollback (``faults.kill_*``)."""
  target = {"step": faults.kill_at_step, "save": faults.kill_during_save_step,
            "rollback": faults.kill_after_rollback}[when]
  if target is not None and n == target:
    os.kill(os.getpid(), signal.SIGKILL)


def fetch(tree: optax.Params) -> dict:
  """A dict of device scalars as Python numbers (one transfer)."""
  return {k: np.asarray(v).item() for k, v in jax.device_get(tree).items()}

