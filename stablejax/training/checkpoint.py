"""Orbax checkpoints of the train state, the Grain iterator and run metadata, saved together.

Only healthy states are saved, so every checkpoint on disk is a "good" one a rollback may return
to. Orbax writes each step into a temporary directory and renames it when complete, so a save cut
off by SIGKILL leaves no step behind.

Restore tells a damaged checkpoint from a failed read. Only proof of damage (see
`damage_evidence`: contents that do not match the fingerprint stored with them, a missing file, a
file shorter than its index says, bytes that do not decode) makes it fall back to the previous
step; the damaged step is then moved to `damaged_checkpoints/` next to the checkpoint directory,
never deleted. Any other error (a timeout, out of memory, a permission or I/O error, a checkpoint
of another model config) stops with `CheckpointError` and leaves every checkpoint as it was.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, Sequence

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp


from stablejax.training.launch import distributed
from stablejax.training.recovery import restore_plan
from stablejax.training.recovery.restore_plan import StateMismatch

if TYPE_CHECKING:
  import optax


class CheckpointError(RuntimeError):
  """No usable checkpoint, or one could not be read; the message says what to do (exit code 2)."""


class CheckpointDamaged(ValueError):
  """A checkpoint was read but its contents are not what was saved."""


class StateMatcher(Protocol):
  """Restores a train state by name (the trainer's is
  :class:`stablejax.training.recovery.restorer.Restorer`)."""

  def plan(self, stored: Any) -> restore_plan.RestorePlan: ...

  def finish(self, plan: restore_plan.RestorePlan, restored: Any) -> Any: ...


# tensorstore reports these status codes for a missing file, a file shorter than the byte range
# its index points to, and bytes that fail a consistency check. Its Python errors are ValueErrors
# whose message starts with the code, except INVALID_ARGUMENT (no prefix).
_DAMAGE_STATUS = ("NOT_FOUND:", "OUT_OF_RANGE:", "DATA_LOSS:")
# Stored bytes that the codec cannot decode, whatever status code carries them: a b-tree node or
# chunk that fails to decode comes as INVALID_ARGUMENT ("Error decoding ..."), a zstd chunk whose
# frame header was zeroed as FAILED_PRECONDITION ("ZSTD_decompressStream() failed: Unknown frame
# descriptor"). The phrases are tensorstore's own (its codec error messages).
_DECODE_FAILURES = ("Error decoding", "ZSTD_decompressStream() failed",
                    "Error in ZSTD_decompressStream", "Blosc error",
                    "Failed to read all expected data during decompression")


def damage_evidence(error: Optional[BaseException]) -> Optional[str]:
  """Why `error` (raised by a restore) proves the checkpoint damaged; None when it does not.

  Proof: the fingerprint check failed (`CheckpointDamaged`); a file is missing
  (`FileNotFoundError`, tensorstore NOT_FOUND, an item directory Orbax does not find); a file is
  truncated (tensorstore OUT_OF_RANGE); bytes do not decode (tensorstore DATA_LOSS, or a codec
  failure such as "Error decoding" or "ZSTD_decompressStream() failed" under any status code;
  invalid JSON or UTF-8 in a metadata file). Anything else, e.g. TimeoutError, MemoryError,
  PermissionError, tensorstore UNAVAILABLE / DEADLINE_EXCEEDED / RESOURCE_EXHAUSTED, or a
  tree/shape mismatch with the model being trained, proves nothing about the files. (Some damage
  surfaces only as such an error, e.g. a missing ``_METADATA`` as a tree mismatch:
  `Checkpoints.restore` then also looks for the files every save writes, `missing_files`.)
  """
  seen: set[int] = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    text = str(error).strip()
    if isinstance(error, CheckpointDamaged):
      return text
    if isinstance(error, FileNotFoundError):
      return f"missing file: {text}"
    if isinstance(error, (json.JSONDecodeError, UnicodeDecodeError)):
      return f"corrupt metadata file: {type(error).__name__}: {text}"
    if isinstance(error, KeyError) and "was not found in the checkpoint" in text:
      return f"missing item: {text}"
    if type(error) is ValueError and (text.startswith(_DAMAGE_STATUS)
                                      or any(phrase in text for phrase in _DECODE_FAILURES)):
      return text
    error = error.__cause__
  return None


# Files that every complete save of `Checkpoints` writes into a step directory, whatever the
# model: the PyTree item's tree metadata, the JSON item's file, and one Grain iterator state per
# process (`data/process_<i>-of-<n>.json`, checked separately). Their absence is proof of damage
# even when the read fails with an error that proves nothing by itself.
_REQUIRED_FILES = ("state/_METADATA", "meta/metadata")
_PROCESS_FILE = re.compile(r"process_(\d+)-of-(\d+)\.json")


def _exists(path: Path) -> Optional[bool]:
  """Whether `path` exists; None when the file system does not say (an I/O error proves nothing)."""
  try:
    path.stat()
    return True
  except FileNotFoundError:
    return False
  except OSError:
    return None


def process_files(step_dir: Path) -> dict[int, set[int]]:
  """The `data/process_<i>-of-<n>.json` files of a step as {n: {i, ...}} ({} when none or the
  directory cannot be listed)."""
  try:
    names = [p.name for p in (Path(step_dir) / "data").iterdir()]
  except OSError:
    return {}
  found: dict[int, set[int]] = {}
  for match in filter(None, map(_PROCESS_FILE.fullmatch, names)):
    found.setdefault(int(match.group(2)), set()).add(int(match.group(1)))
  return found


def missing_files(step_dir: Path) -> list[str]:
  """The files every complete save writes that `step_dir` lacks (paths relative to it).

  Example: ``missing_files(Path("checkpoints/20")) == ["state/_METADATA"]`` after that file was
  deleted; ``[]`` for an intact step (or one whose directory cannot be listed: no proof).
  """
  step_dir = Path(step_dir)
  missing = [name for name in _REQUIRED_FILES if _exists(step_dir / name) is False]
  if _exists(step_dir / "data") is True:
    found = process_files(step_dir)
    if not found:
      missing.append("data/process_<i>-of-<n>.json")
    for n, indices in sorted(found.items()):
      missing += [f"data/process_{i}-of-{n}.json" for i in range(n) if i not in indices]
  return missing


def shorten(text: str, limit: int = 300) -> str:
  """The first line of ``text``, cut at a space before ``limit`` characters (never inside a word
  or a path), with " ..." where it was cut."""
  line = text.strip().splitlines()[0] if text.strip() else ""
  if len(line) <= limit:
    return line
  cut = line.rfind(" ", 0, limit)
  return line[:cut if cut > 0 else limit] + " ..."


def _first_line(error: BaseException, limit: int = 300) -> str:
  text = shorten(str(error), limit)
  return f"{type(error).__name__}: {text}" if text else type(error).__name__


@jax.jit
def _leaf_sums(leaves: list[jax.Array]) -> jax.Array:
  """float32 ``[len(leaves), 3]``: for each leaf, the sum and the sum of squares of its finite
  entries, and the number of its entries that are not finite."""
  rows = []
  for x in leaves:
    x = x.astype(jnp.float32)
    finite = jnp.isfinite(x)
    kept = jnp.where(finite, x, 0.0)
    rows.append(jnp.stack([jnp.sum(kept), jnp.sum(jnp.square(kept)),
                           jnp.sum(~finite).astype(jnp.float32)]))
  return jnp.stack(rows) if rows else jnp.zeros((0, 3), jnp.float32)


def _floating_leaves(tree: Any) -> list:
  return [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]


def _leaf_fingerprints(leaves: list) -> np.ndarray:
  """:func:`_leaf_sums` of each leaf as float64, in the leaves' order.

  Host arrays (a checkpoint read as numpy) are summed by numpy: nothing to compile. Device arrays
  go through one program, given the leaves sorted by shape, dtype and sharding: the program then
  depends only on which leaves there are, not on the tree holding them, so the saves of a train
  state and the check of its restore by name (a dict of the same arrays) share it.
  """
  if all(isinstance(x, np.ndarray) for x in leaves):
    host = []
    for x in leaves:
      x = x.astype(np.float32)
      finite = np.isfinite(x)
      kept = np.where(finite, x, np.float32(0))
      host.append([np.sum(kept, dtype=np.float64), np.sum(np.square(kept), dtype=np.float64),
                   float(np.sum(~finite))])
    return np.array(host, np.float64).reshape(len(leaves), 3)
  order = sorted(range(len(leaves)), key=lambda i: (
      leaves[i].shape, str(leaves[i].dtype), str(getattr(leaves[i], "sharding", "")),
      bool(getattr(getattr(leaves[i], "aval", None), "weak_type", False))))
  sums = np.asarray(_leaf_sums([leaves[i] for i in order]), np.float64)
  rows = np.empty_like(sums)
  rows[order] = sums
  return rows


def fingerprint(tree: optax.Params) -> np.ndarray:
  """Three numbers summarising every floating leaf: the sum and the sum of squares of its finite
  entries, and the number of entries that are not finite.

  Optimizer states hold infinities on purpose (e.g. a clipping threshold before its warmup ends),
  so the sums skip them and the count records them. Compared with a relative tolerance on
  restore: a bit-exact restore matches, a damaged one does not, and a restore onto a different
  device count (different reduction order) still matches. Each leaf is reduced in float32, the
  leaves' sums are added in float64 on the host.
  """
  return _leaf_fingerprints(_floating_leaves(tree)).sum(axis=0)


def state_parts(state: Any, whole: frozenset[str] = frozenset()) -> dict[str, Any]:
  """The parts of a state that are fingerprinted one by one: each field of a dataclass state
  (the train state, or the dict of its fields that a restore by name reads), each entry of a
  field that is a dict (``opt_state/zclip``, ``params/blocks``), so that a restore of some
  entries, by name, can be checked on its own. Any other state is one part. A field named in
  ``whole`` is one part even when it reads back as a dict (a NamedTuple field read by name)."""
  if dataclasses.is_dataclass(state):
    fields = [(f.name, getattr(state, f.name)) for f in dataclasses.fields(state)]
  elif isinstance(state, dict) and "params" in state:
    fields = list(state.items())
  else:
    return {"state": state}
  parts = {}
  for name, value in fields:
    if isinstance(value, dict) and name not in whole:
      parts.update({f"{name}/{key}": entry for key, entry in value.items()})
    else:
      parts[name] = value
  return parts


def part_fingerprints(state: Any, whole: frozenset[str] = frozenset()) -> dict[str, np.ndarray]:
  """:func:`fingerprint` of each of :func:`state_parts` (their sum is the state's)."""
  parts = state_parts(state, whole)
  owners, leaves = [], []
  for name, part in parts.items():
    found = _floating_leaves(part)
    owners += [name] * len(found)
    leaves += found
  rows = _leaf_fingerprints(leaves)
  sums = {name: np.zeros(3) for name in parts}
  for name, row in zip(owners, rows):
    sums[name] += row
  return sums


def fingerprint_matches(expected: Any, actual: Any) -> bool:
  """Whether a restored state's fingerprint equals the saved one (relative tolerance 1e-4)."""
  if len(expected) != len(actual):
    return False
  for e, a in zip(expected, actual):
    if not (math.isfinite(a) and math.isfinite(e)) or abs(a - e) > 1e-4 * max(1.0, abs(e)):
      return False
  return True


class Checkpoints:
  """The run's checkpoints: an Orbax ``CheckpointManager`` with items ``state``, ``data``, ``meta``.

  ``state`` is the train state (any pytree of arrays, sharded or not), ``data`` the Grain
  iterator's position, so a resumed run reads the same batches, and ``meta`` a JSON dict (with the
  step and a fingerprint of the state, checked on restore). Saves are asynchronous; the newest
  ``keep`` are kept. :meth:`restore` falls back past checkpoints proven damaged and moves them to
  ``damaged_checkpoints/``; any other read error stops with nothing moved.

  Args:
    directory: where the checkpoints live (created if missing).
    keep: how many checkpoints to keep.
    async_save: save in the background (the next save or :meth:`wait` waits for it).
    record_step: called as ``record_step(step, fingerprint)`` before each save is started (the
      trainer records what it saves in its run directory's record first).

  Example:
    >>> import pathlib, tempfile, jax, jax.numpy as jnp
    >>> from stablejax.data.config import DataConfig
    >>> from stablejax.data.pipeline import build_data
    >>> from stablejax.training.checkpoint import Checkpoints
    >>> data = build_data(DataConfig(), seq_len=16, batch_size=2, seed=0)
    >>> batches = data.train_iter()
    >>> _ = next(batches), next(batches)
    >>> ckpts = Checkpoints(pathlib.Path(tempfile.mkdtemp()), keep=2)
    >>> state = {"w": jnp.arange(3.0)}
    >>> ckpts.save(2, state, batches, {"note": "two batches read"})
    >>> ckpts.wait()
    >>> fresh = data.train_iter()
    >>> restored, meta = ckpts.restore(jax.eval_shape(lambda: state), fresh)
    >>> restored["w"].tolist(), meta["step"], fresh.get_state()
    ([0.0, 1.0, 2.0], 2, {'next_index': 2})
    >>> ckpts.close()
  """

  def __init__(self, directory: Path, keep: int, async_save: bool = True,
               record_step: Optional[Callable[[int, list[float]], None]] = None):
    self.directory = Path(directory).absolute()
    self.record_step = record_step
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep,
        create=True,
        enable_async_checkpointing=async_save,
        cleanup_tmp_directories=True,  # leftovers of a save that was killed
    )
    self.manager = ocp.CheckpointManager(
        self.directory, options=options, item_names=("state", "data", "meta"))
    self._closed = False

  def all_steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def save(self, step: int, state: Any, data_iter: Any, meta: dict) -> None:
    parts = {name: [float(v) for v in np.asarray(value)]
             for name, value in part_fingerprints(state).items()}
    meta = dict(meta, step=int(step), fingerprints=parts,
                fingerprint=[float(sum(p[i] for p in parts.values())) for i in range(3)])
    if self.record_step is not None:
      self.record_step(int(step), meta["fingerprint"])
    self.manager.save(
        step,
        args=ocp.args.Composite(
            state=ocp.args.PyTreeSave(state),
            data=grain.checkpoint.CheckpointSave(data_iter),
            meta=ocp.args.JsonSave(meta),
        ),
    )

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def restore(self, abstract_state: Any, data_iter: Any, *, at_most: Optional[int] = None,
              on_fallback: Callable[[int, str], None] = lambda step, why: None,
              match: Optional[StateMatcher] = None) -> Optional[tuple[Any, dict]]:
    """Restores the newest checkpoint that is not damaged (at step `at_most` or older when given).

    Returns (state, meta) with `data_iter` moved to the saved position, or None when the
    directory holds no checkpoint. A step proven damaged (`damage_evidence`) is reported through
    `on_fallback(step, reason)` and the previous one tried; once one restores, the damaged ones
    are moved to `damaged_checkpoints/` (their step numbers will be saved again). Any other error
    raises CheckpointError at once, and so does finding every step damaged: nothing is moved or
    deleted then. A checkpoint whose state does not fit ``abstract_state`` (another model, another
    optimizer) raises CheckpointError saying what differs.

    ``match`` restores a train state by name (:mod:`stablejax.training.recovery.restore_plan`): only
    the entries this run has are read, the rest is completed by ``match.finish``, and
    ``meta["changes"]`` says in one line what the restore did (None: nothing).
    """
    self.wait()
    steps = [s for s in self.all_steps() if at_most is None or s <= at_most]
    if not steps:
      return None
    damaged: list[int] = []
    for step in reversed(steps):
      state, meta, error = None, None, None
      try:
        state, meta = self._restore_step(step, abstract_state, data_iter, match)
      except StateMismatch as e:
        raise CheckpointError(
            f"checkpoint {step} in {self.directory} does not fit this run ({e}); every checkpoint "
            "was left as it is") from None
      except Exception as e:  # noqa: BLE001 - sorted into damage / not damage just below
        error = e
      # Each process reads its own shards, so they decide together: a process that fell back
      # alone would wait for the others in a collective that never comes.
      why = None if error is None else (damage_evidence(error) or self._missing_evidence(step))
      if distributed.agree_any(error is not None and why is None):
        cause = _first_line(error) if error is not None else "a read error on another process"
        raise CheckpointError(
            f"reading checkpoint {step} in {self.directory} failed ({cause}"
            f"{self._process_count_note(step)}); that does not show it is damaged, so every"
            " checkpoint was left as it is: fix the cause (memory, storage, or a config that"
            " differs from the run's) and run again") from error
      if distributed.agree_any(why is not None):
        on_fallback(step, shorten(why or "damaged on another process"))
        damaged.append(step)
        continue
      for bad in damaged:
        self._set_aside(bad)
      assert meta is not None, "a restore that raised nothing returned its meta"
      return state, meta
    raise CheckpointError(
        f"all {len(steps)} checkpoints in {self.directory} are damaged (left in place): delete"
        " that directory or pass --fresh to start over")

  def _restore_step(self, step: int, abstract_state: Any, data_iter: Any,
                    match: Optional[StateMatcher]) -> tuple[Any, dict]:
    stored = self._stored_tree(step)
    plan = match.plan(stored) if match is not None and stored is not None else None
    if plan is None and stored is not None:
      restore_plan.plan(stored, abstract_state)  # the same check: another model is named
    target = plan.target if plan is not None else abstract_state
    restored = self.manager.restore(
        step,
        args=ocp.args.Composite(
            state=ocp.args.PyTreeRestore(
                item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                partial_restore=plan is not None),
            data=grain.checkpoint.CheckpointRestore(data_iter),
            meta=ocp.args.JsonRestore(),
        ),
    )
    state, meta = restored["state"], dict(restored["meta"])
    self._check_fingerprints(state, meta, skip=plan.fresh_fields if plan is not None else ())
    if plan is not None and match is not None:
      state = match.finish(plan, state)
      meta["changes"] = plan.describe()
    return state, meta

  @staticmethod
  def _check_fingerprints(state: Any, meta: dict, skip: Sequence[str] = ()) -> None:
    """The restored parts against the fingerprints saved with them (all of them at once for a
    checkpoint of a version that saved one)."""
    saved = meta.get("fingerprints")
    if isinstance(saved, dict):
      # The parts and the whole were saved together: they must agree before either is trusted.
      whole = [sum(float(part[i]) for part in saved.values()) for i in range(3)]
      if not fingerprint_matches(meta.get("fingerprint", []), whole):
        raise CheckpointDamaged("its fingerprints do not agree with each other")
      actual = part_fingerprints(state, frozenset(name for name in saved if "/" not in name))
      for name, value in actual.items():
        if name in skip:
          continue
        if name not in saved or not fingerprint_matches(saved[name], np.asarray(value).tolist()):
          raise CheckpointDamaged(f"contents of {name} do not match the fingerprint saved with "
                                  "it")
      return
    actual_whole = [float(v) for v in np.asarray(fingerprint(state))]
    if not fingerprint_matches(meta.get("fingerprint", []), actual_whole):
      raise CheckpointDamaged("contents do not match the fingerprint saved with it")

  def _stored_tree(self, step: int) -> Any:
    """The checkpoint's state as Orbax's metadata tree (shapes and dtypes, no arrays), or None
    when it cannot be read (the restore itself then says what is wrong). Metadata that cannot
    be read because the files are damaged raises that error: it is the proof, whatever this
    run would have read of the checkpoint (a changed stack reads only a part of it)."""
    try:
      stored = ocp.PyTreeCheckpointHandler().metadata(self.directory / str(step) / "state")
      return getattr(stored, "tree", stored)
    except Exception as e:  # noqa: BLE001 - unreadable metadata: damaged, or the restore says
      if damage_evidence(e):
        raise
      return None

  def _missing_evidence(self, step: int) -> Optional[str]:
    missing = missing_files(self.directory / str(step))
    return f"missing file: {', '.join(missing)}" if missing else None

  def _process_count_note(self, step: int) -> str:
    """Names a process-count difference (a setup change, not damage) when the files show one."""
    found = process_files(self.directory / str(step))
    if len(found) == 1:
      ((n, indices),) = found.items()
      if n != jax.process_count() and indices == set(range(n)):
        return (f"; it was saved by {n} processes and this run has {jax.process_count()}: run"
                f" it with {n} processes")
    return ""

  @property
  def damaged_directory(self) -> Path:
    return self.directory.parent / "damaged_checkpoints"

  def _set_aside(self, step: int) -> None:
    """Moves a damaged step out of Orbax's directory (kept for inspection, never deleted)."""
    if jax.process_index() == 0:
      source = self.directory / str(step)
      target = self.damaged_directory / str(step)
      n = 1
      while target.exists():
        target, n = self.damaged_directory / f"{step}.{n}", n + 1
      self.damaged_directory.mkdir(parents=True, exist_ok=True)
      shutil.move(str(source), str(target))
    distributed.barrier(f"set_aside_{step}")  # every process sees the move before reloading
    self.manager.reload()

  def delete_after(self, step: int) -> None:
    """Removes checkpoints newer than `step`: after a rollback they belong to the abandoned branch
    (a decision of the recovery, never a consequence of a read error)."""
    self.wait()
    for s in self.all_steps():
      if s > step:
        self.manager.delete(s)

  def close(self) -> None:
    """Waits for a save in flight and stops Orbax's threads (a second call does nothing)."""
    if self._closed:
      return
    self._closed = True
    try:
      self.manager.wait_until_finished()
    finally:
      self.manager.close()


def write_json_atomic(path: Path, data: dict, indent: int = 1) -> None:
  """Writes `data` to `path` so that a crash at any moment leaves the old file or the new one:
  a temporary file in the same directory, flushed to disk, then renamed over the old one."""
  path = Path(path)
  tmp = path.with_name(f".{path.name}.tmp")
  try:
    with open(tmp, "w") as f:
      f.write(json.dumps(data, indent=indent, default=float) + "\n")
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    tmp.unlink(missing_ok=True)  # a full disk or a signal: no half-written file stays behind
    raise
  directory = os.open(path.parent, os.O_RDONLY)
  try:
    os.fsync(directory)  # the rename itself
  finally:
    os.close(directory)


def read_json(path: Path) -> Optional[dict]:
  """The JSON object in `path`, None when there is no such file; CheckpointError when unreadable."""
  path = Path(path)
  if not path.exists():
    return None
  try:
    return json.loads(path.read_text())
  except (OSError, ValueError) as e:
    raise CheckpointError(f"{path} cannot be read ({_first_line(e)}): restore it, or delete it to"
                          " resume without the rollbacks recorded since the last checkpoint") from e
