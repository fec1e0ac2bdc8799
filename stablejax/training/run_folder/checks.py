"""The checks of what is in a run directory, made before the trainer writes anything there.

Each refuses with one `RunDirError` line naming what it found and the fix; none changes a file.

* `check_names`: every trainer name in the folder (`WRITES`) is one the record lists, holds only
  what the trainer writes there (`foreign_content`; a step folder holds Orbax's own files and the
  items the trainer saves, `STEP_ENTRIES`), is no symbolic link where the trainer writes a file
  (nor any link under ``--fresh``) and no ``metrics.jsonl`` with other names (hard links).
* `check_checkpoints`: every step in ``checkpoints/`` is one the record lists, with the
  fingerprint its metadata holds (`step_meta`), so another run's step copied in is never read.
* `recognise_v0_1`: a folder without a record is new, or a run directory of stablejax 0.1
  (recognised by what only the trainer writes: a ``config.json`` with every section of the
  trainer's config, and checkpoints whose metadata is the trainer's), whose names are adopted.
* `check_inputs`: no input of the run (`run_inputs`: ``--config``, the data paths) lies where
  the trainer writes.

Example:
  >>> import pathlib, tempfile
  >>> from stablejax.training.run_folder.checks import check_names
  >>> from stablejax.training.run_folder.record import RunDirError
  >>> out = pathlib.Path(tempfile.mkdtemp())
  >>> (out / "checkpoints").mkdir()
  >>> _ = (out / "checkpoints" / "best.pt").write_text("")
  >>> try:
  ...   check_names(out, recorded={"checkpoints"}, fresh=False)
  ... except RunDirError as e:
  ...   print(str(e).split(":")[1].strip())
  not written by this trainer, inside its checkpoints/ folder
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Optional, Sequence

from stablejax.data.folder import LOCK_NAME
from stablejax.training.run_folder.record import (PROGRAM, RECORD, STEP_ENTRIES, STEP_FOLDERS,
                                                  TRASH,
                                           WRITES, RunDirError)

if TYPE_CHECKING:
  from stablejax.training.config import Config

# The sections of the config the trainer writes, every one of them in full (0.1 wrote the same).
_CONFIG_SECTIONS = ("model", "data", "optimizer", "stability", "train", "checkpoint", "logging",
                    "mesh", "faults")


def foreign_content(folder: Path, patterns: Iterable[re.Pattern]) -> list[str]:
  """Entries of ``folder`` that match none of ``patterns`` (what the trainer does not write)."""
  patterns = tuple(patterns)
  return sorted(p.name for p in folder.iterdir() if not any(r.match(p.name) for r in patterns))


def step_meta(step_dir: Path) -> Optional[dict]:
  """The ``meta`` item a checkpoint step holds (its step, fingerprint, ...); None when it has
  none that can be read (damage is the restore's to judge)."""
  try:
    meta = json.loads((Path(step_dir) / "meta" / "metadata").read_text())
  except (OSError, ValueError):
    return None
  return meta if isinstance(meta, dict) else None


def present_names(root: Path) -> list[str]:
  """The trainer names (`WRITES`) that are in ``root``."""
  return [name for name in WRITES if os.path.lexists(root / name)]


def step_dirs(root: Path, name: str) -> list[Path]:
  """The step folders in the folder ``name`` of `STEP_FOLDERS`, by name ([] when it is absent)."""
  folder = root / name
  try:
    return sorted((p for p in folder.iterdir() if STEP_FOLDERS[name].match(p.name)),
                  key=lambda p: p.name)
  except OSError:
    return []


def fingerprints_on_disk(root: Path) -> dict[str, list]:
  """{step: fingerprint} of the checkpoints in checkpoints/ whose metadata can be read."""
  found = {}
  for step_dir in step_dirs(root, "checkpoints"):
    meta = step_meta(step_dir)
    if meta is not None and isinstance(meta.get("fingerprint"), list):
      found[step_dir.name] = meta["fingerprint"]
  return found


def _shown(paths: Sequence[Path], most: int = 3) -> str:
  return ", ".join(str(p) for p in paths[:most]) + (" ..." if len(paths) > most else "")


# ----------------------------------------------------------------------------- the names


def check_names(root: Path, recorded: set[str], fresh: bool) -> None:
  """Every trainer name in ``root`` is ``recorded`` and holds only what the trainer writes; with
  ``fresh``, none is a symbolic link either. A ``--fresh`` folder left by a run killed while
  deleting holds only trainer names."""
  for name in present_names(root):
    path = root / name
    if name not in recorded:
      raise RunDirError(
          f"{'--fresh: ' if fresh else ''}{path} was not written by this trainer (no record of "
          f"it in {root / RECORD}): move it away or choose another --out; nothing was "
          "changed")
    if WRITES[name] is None and path.is_symlink():
      raise RunDirError(
          f"{path} is a symbolic link (to {os.readlink(path)}), not the file the trainer "
          "wrote: it writes nothing through a link; move it away or choose another --out; "
          "nothing was changed")
    if name == "metrics.jsonl" and not path.is_dir() and path.stat().st_nlink > 1:
      raise RunDirError(
          f"{path} has other names (hard links): the trainer appends to it, and would write "
          "into them too; copy it (cp) instead of linking, or choose another --out; nothing "
          "was changed")
    if fresh and path.is_symlink():
      raise RunDirError(
          f"--fresh: {path} is a symbolic link (to {os.readlink(path)}), not the folder the "
          "trainer made: --fresh deletes nothing through a link; remove the link (or empty "
          "what it points to) yourself, or choose another --out; nothing was deleted")
    _check_content(root, name)
  trash = root / TRASH
  if os.path.lexists(trash):
    foreign = ([] if TRASH in recorded and trash.is_dir() and not trash.is_symlink()
               else [trash])
    foreign += [trash / n for n in (os.listdir(trash) if not foreign else []) if n not in WRITES]
    if foreign:
      raise RunDirError(f"{_shown(foreign)}: not written by this trainer (its --fresh leaves "
                        "only the previous run's names there): move it away or choose another "
                        "--out; nothing was changed")


def _check_content(root: Path, name: str) -> None:
  patterns = WRITES[name]
  path = root / name
  if patterns is None:
    if path.is_dir():
      raise RunDirError(f"{path} is a folder where the trainer writes a file: move it away or "
                        "choose another --out; nothing was changed")
    return
  if not path.is_dir():
    raise RunDirError(f"{path} is a file where the trainer keeps a folder: move it away or "
                      "choose another --out; nothing was changed")
  foreign = [path / f for f in foreign_content(path, patterns)]
  if name in STEP_FOLDERS:  # a step folder holds what Orbax writes, nothing else
    for step_dir in step_dirs(root, name):
      if not step_dir.is_dir():
        foreign.append(step_dir)
        continue
      foreign += [step_dir / f for f in sorted(os.listdir(step_dir)) if f not in STEP_ENTRIES]
  if foreign:
    raise RunDirError(f"{_shown(foreign)}: not written by this trainer, inside its {name}/ "
                      "folder: move it away or choose another --out; nothing was changed")


def check_checkpoints(root: Path, saved: dict) -> None:
  """Every step in checkpoints/ is one this run saved: ``saved`` (the record's {step:
  fingerprint}) lists it with the fingerprint its metadata holds. (A step whose metadata cannot
  be read is the restore's to judge: damaged ones are set aside, never deleted.)"""
  for step_dir in step_dirs(root, "checkpoints"):
    meta = step_meta(step_dir)
    if step_dir.name not in saved:
      listed = ", ".join(sorted(saved, key=int)) or "none"
      raise RunDirError(
          f"{step_dir} is not a checkpoint this run saved ({root / RECORD} lists steps "
          f"{listed}): move it away or choose another --out; nothing was changed")
    if meta is None:
      continue
    if meta.get("fingerprint") != saved[step_dir.name] or str(meta.get("step")) != step_dir.name:
      raise RunDirError(
          f"{step_dir} is not the checkpoint this run saved at step {step_dir.name} (its "
          f"fingerprint is not the one {root / RECORD} records; another run's step?): move "
          "it away or choose another --out; nothing was changed")


# ----------------------------------------------------------------------------- a run of 0.1


def recognise_v0_1(root: Path) -> Optional[dict]:
  """A folder without a record: None when it holds no trainer name (a new run), the record that
  adopts the names of a run directory of stablejax 0.1 (recognised by what only the trainer
  writes), or `RunDirError`."""
  present = present_names(root)
  if not present:
    return None
  problem = _not_v0_1(root)
  if problem is not None:
    one = len(present) == 1
    names = _shown([root / n for n in present], 6)
    raise RunDirError(
        f"{names} {'was' if one else 'were'} not written by this trainer (no record of "
        f"{'it' if one else 'them'} in {root / RECORD}, and "
        f"{problem}; a run directory of stablejax 0.1 is recognised by its checkpoints): move "
        f"{'it' if one else 'them'} away or choose another --out; nothing was changed")
  return {"program": PROGRAM, "adopted": "a run directory of stablejax 0.1",
          "checkpoints": fingerprints_on_disk(root), "written": sorted(present)}


def _not_v0_1(root: Path) -> Optional[str]:
  """Why the folder is not a run directory of stablejax 0.1 (None: it is one)."""
  try:
    raw = json.loads((root / "config.json").read_text())
  except (OSError, ValueError):
    return "no config.json of the trainer"
  if not isinstance(raw, dict) or not all(
      isinstance(raw.get(s), dict) and raw[s] for s in _CONFIG_SECTIONS):
    return "its config.json is not one the trainer wrote (it writes every section in full)"
  from stablejax.training.config import ConfigError, load_run_file
  try:
    load_run_file(root / "config.json")
  except ConfigError:
    return "its config.json is not a config of the trainer"
  metas = [step_meta(p) for p in step_dirs(root, "checkpoints")]
  if not any(m is not None and "fingerprint" in m and "step" in m for m in metas):
    return "no checkpoint the trainer saved in checkpoints/"
  if any(m is not None and "tokenizer" in m for m in metas):
    return (f"its checkpoints were saved by a trainer that keeps {RECORD} (restore {RECORD} to "
            "resume)")
  return None


# ----------------------------------------------------------------------------- the inputs


def run_inputs(cfg: Config, config_file: Optional[Path | str] = None) -> list[tuple[str, Any]]:
  """What a run of ``cfg`` reads, as ``(what, path)`` pairs for
  :meth:`stablejax.training.run_folder.folder.RunDirectory.open` (which checks them with
  `check_inputs`): the config file it was given and the data paths (the embedded corpus is no
  path)."""
  from stablejax.data.config import EMBEDDED
  inputs: list[tuple[str, Any]] = [("--config", config_file)] if config_file else []
  for split in ("train", "val"):
    value = getattr(cfg.data, split)
    for entry in [value] if isinstance(value, str) else list(value or []):
      if isinstance(entry, str) and entry != EMBEDDED:
        inputs.append((f"data.{split}", entry))
  return inputs


def check_inputs(root: Path, recorded: set[str], inputs: Sequence[tuple[str, Any]]) -> None:
  """No input of the run lies where the trainer writes in ``root`` (it would be overwritten or
  read while being written). The run's own config.json (``recorded``), given back as --config to
  resume, may."""
  try:
    resolved_root = root.resolve()
  except OSError:
    return
  for what, given in inputs:
    try:
      path = Path(os.path.expanduser(str(given))).resolve()
      parts = path.relative_to(resolved_root).parts
    except (OSError, ValueError):  # not inside the run directory
      continue
    if not parts:
      raise RunDirError(f"{what} {given} is the run directory --out {root}: the trainer "
                        "writes there; choose another --out")
    if parts[0] not in (*WRITES, RECORD, LOCK_NAME, TRASH):
      continue
    if what == "--config" and parts == ("config.json",) and "config.json" in recorded:
      continue  # the run's own config, resumed from: rewritten with the same content
    if what == "--config":
      raise RunDirError(
          f"--config {given} is where the trainer writes the run's {parts[0]} in --out "
          f"{root}, and it did not write that file: move your config elsewhere (e.g. "
          f"{root.parent / (root.name + '.json')}) and pass that, or choose another "
          "--out; nothing was changed")
    raise RunDirError(f"{what} {given} lies in {root / parts[0]}, which the trainer writes "
                      "in --out: move the data out of the run directory, or choose another "
                      "--out; nothing was changed")
