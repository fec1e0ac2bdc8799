"""Orbax checkpoints of the train state, the Grain iterator and run metadata, saved together.

Only healthy states are saved, so every checkpoint on disk is a "good" one a rollback may return
to. Orbax writes each step into a temporary directory and renames it when complete, so a save cut
off by SIGKILL leaves no step behind. A checkpoint whose bytes were damaged later is caught by a
fingerprint stored with it; restore then falls back to the previous step and says so.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any, Callable, Optional

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from stablejax.training import distributed


class CheckpointError(RuntimeError):
  """No usable checkpoint; the message says what was found and what to do."""


@jax.jit
def fingerprint(tree) -> jax.Array:
  """Two float32 numbers summarising every floating leaf (sum and sum of squares).

  Compared with a relative tolerance on restore: a bit-exact restore matches, a damaged one does
  not, and a restore onto a different device count (different reduction order) still matches.
  """
  leaves = [x.astype(jnp.float32) for x in jax.tree.leaves(tree)
            if jnp.issubdtype(x.dtype, jnp.floating)]
  total = sum((jnp.sum(x) for x in leaves), jnp.float32(0))
  squares = sum((jnp.sum(jnp.square(x)) for x in leaves), jnp.float32(0))
  return jnp.stack([total, squares])


def fingerprint_matches(expected, actual) -> bool:
  """Whether a restored state's fingerprint equals the saved one (relative tolerance 1e-4)."""
  for e, a in zip(expected, actual):
    if not math.isfinite(a) or abs(a - e) > 1e-4 * max(1.0, abs(e)):
      return False
  return True


class Checkpoints:
  """A thin layer over `ocp.CheckpointManager` with items `state`, `data` and `meta`."""

  def __init__(self, directory: Path, keep: int, async_save: bool = True):
    self.directory = Path(directory).absolute()
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep,
        create=True,
        enable_async_checkpointing=async_save,
        cleanup_tmp_directories=True,  # leftovers of a save that was killed
    )
    self.manager = ocp.CheckpointManager(
        self.directory, options=options, item_names=("state", "data", "meta"))

  def all_steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def save(self, step: int, state, data_iter, meta: dict) -> None:
    meta = dict(meta, step=int(step),
                fingerprint=[float(v) for v in np.asarray(fingerprint(state))])
    self.manager.save(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=grain.checkpoint.CheckpointSave(data_iter),
            meta=ocp.args.JsonSave(meta),
        ),
    )

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def restore(self, abstract_state, data_iter, *, before: Optional[int] = None,
              on_fallback: Callable[[int, str], None] = lambda step, why: None
              ) -> Optional[tuple[Any, dict]]:
    """Restores the newest readable checkpoint (older than `before` when given).

    Returns (state, meta) with `data_iter` moved to the saved position, or None when the
    directory holds no checkpoint. Unreadable or damaged steps are reported through
    `on_fallback(step, reason)` and skipped; if every step is unusable, raises CheckpointError.
    """
    self.wait()
    steps = [s for s in self.all_steps() if before is None or s < before]
    if not steps:
      return None
    for step in reversed(steps):
      try:
        try:
          restored, read_error = self.manager.restore(
              step,
              args=ocp.args.Composite(
                  state=ocp.args.StandardRestore(abstract_state),
                  data=grain.checkpoint.CheckpointRestore(data_iter),
                  meta=ocp.args.JsonRestore(),
              ),
          ), None
        except Exception as e:  # noqa: BLE001
          restored, read_error = None, e
        # Each process reads its own shards: all fall back together if any of them failed.
        if distributed.agree_any(read_error is not None):
          raise read_error or RuntimeError("unreadable on another process")
        state, meta = restored["state"], dict(restored["meta"])
        actual = [float(v) for v in np.asarray(fingerprint(state))]
        if not fingerprint_matches(meta.get("fingerprint", [math.nan, math.nan]), actual):
          raise ValueError("contents do not match the fingerprint saved with it")
        return state, meta
      except Exception as e:  # noqa: BLE001 - any failure to read means "not usable"
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        on_fallback(step, f"{type(e).__name__}: {reason[:200]}")
    raise CheckpointError(
        f"none of the {len(steps)} checkpoints in {self.directory} could be restored:"
        " delete that directory or pass --fresh to start over")

  def delete_after(self, step: int) -> None:
    """Removes checkpoints newer than `step` (after a rollback they belong to a dead branch)."""
    self.wait()
    for s in self.all_steps():
      if s > step:
        self.manager.delete(s)

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


def remove_run_checkpoints(directory: Path) -> None:
  if Path(directory).exists():
    shutil.rmtree(directory)
