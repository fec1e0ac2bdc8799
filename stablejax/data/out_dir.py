"""prepare's ``--out``: whose files are there, what a run may replace, and how it puts a corpus
in place.

This tool replaces or removes only files it wrote, which its ``meta.json`` names (or
``meta.json.partial``, the record of a run in progress, written first and removed last, which
names that run's partial files and, by their identity, the files it put in place). Another file
under a name it writes, or one of its files that changed since it wrote it, is refused unless
``--force`` (`refuse_in_the_way`, `Existing.changed`); other files in the folder are never
touched, and the tokenizer file being read is never removed. New files are written under names
of this run's own (``NAME.<pid>-<random>.partial``); the corpus already there stays usable until
the new one is complete, then `finish` puts it in place. A run that fails removes its files
(`remove_failed`), and the folder too when it created it (`create_out`, `remove_created`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import secrets
import socket
from pathlib import Path
from typing import Iterable, Optional, Sequence

import numpy as np

from stablejax.data.config import EMBEDDED, DataError, PrepareError
from stablejax.data.inputs import input_files
from stablejax.data.prepared import (PREPARED_FORMAT, PREPARED_MARKER, PREPARED_META,
                                     SPLIT_FILES, TOKENIZER_FILE, prepared_file, read_prepared,
                                     stat_record, write_json, writing)

PARTIAL = ".partial"

# This run's partial files: NAME.<process id>-<random>.partial, so that no other process, even
# one that runs where the folder lock does not hold, writes, renames or removes them.
_PRIVATE_PARTIAL = re.compile(
    r"^(train\.bin|val\.bin|tokenizer\.json|meta\.json)\.[0-9]+-[0-9a-f]+\.partial$")


def _read_own_record(path: Path) -> Optional[dict]:
  """A meta.json (or the marker) this tool wrote: a JSON object of its format; else None."""
  try:
    data = json.loads(path.read_text())
  except (OSError, ValueError):  # missing, a directory, unreadable, not JSON, not UTF-8
    return None
  return data if isinstance(data, dict) and data.get("format") == PREPARED_FORMAT else None


def _named_files(record: dict) -> set[str]:
  """The files of --out that a meta.json or marker of this tool says the tool wrote."""
  if isinstance(record.get("written"), list):
    names = {n for n in record["written"] if isinstance(n, str)}
  else:  # a meta.json of an earlier release, which always wrote its tokenizer.json
    names = set(SPLIT_FILES)
    tok = record.get("tokenizer")
    if isinstance(tok, dict) and isinstance(tok.get("file"), str):
      names.add(tok["file"])
  return names & {*SPLIT_FILES, TOKENIZER_FILE}  # a record claims only the tool's own names


def _file_identity(path: Path) -> Optional[list[int]]:
  """What tells one file from another under the same name: device, inode, size, modification
  time (kept by a rename; a file copied or written there has others). None when missing."""
  try:
    st = os.lstat(path)
  except OSError:
    return None
  return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]


def _claimed_files(out: Path, marker: dict) -> set[str]:
  """The files of --out that a marker's run wrote: those its ``claims`` name with the identity
  the file still has (a file put there since under the same name is not the run's). A marker of
  an earlier release claims no finished file, only its partials (`_named_partials`)."""
  claims = marker.get("claims")
  if not isinstance(claims, dict):
    return set()
  names = {*SPLIT_FILES, TOKENIZER_FILE}  # a marker claims only the tool's own names
  return {name for name, identity in claims.items()
          if name in names and identity is not None and _file_identity(out / name) == identity}


def _named_partials(record: dict) -> set[str]:
  """The partial files a marker says its run writes (NAME.partial for an earlier release's)."""
  if isinstance(record.get("partials"), list):
    return {n for n in record["partials"] if isinstance(n, str) and _PRIVATE_PARTIAL.match(n)}
  return {n + PARTIAL for n in _named_files(record)}


def _changed_files(out: Path, meta: dict) -> set[str]:
  """The files a meta.json of this tool names that are no longer the ones it wrote: another size
  than it records, another SHA-256 (when it records one), or a tokenizer.json of another hash."""
  changed = set()
  for name in _named_files(meta):
    if not os.path.lexists(out / name):
      continue  # missing: nothing in the way
    if name == TOKENIZER_FILE:
      recorded = meta.get("tokenizer", {}).get("sha256") if isinstance(
          meta.get("tokenizer"), dict) else None
      try:
        if recorded is not None and \
            hashlib.sha256((out / name).read_bytes()).hexdigest() != recorded:
          changed.add(name)
      except OSError:
        changed.add(name)
      continue
    try:
      size = np.dtype(meta["dtype"]).itemsize * int(meta[f"{name[:-4]}_tokens"])
      if (out / name).stat().st_size != size:
        changed.add(name)
      else:
        prepared_file(out, meta, name)
    except (DataError, OSError, KeyError, TypeError, ValueError):
      changed.add(name)
  return changed


@dataclasses.dataclass
class Existing:
  """What --out holds from earlier runs of this tool."""
  meta: Optional[dict]  # its meta.json (complete or not), else None
  complete: bool        # the trainer would accept the directory
  kept: set[str]        # that meta.json and its files: they stay until the new corpus replaces them
  leftovers: set[str]   # files of an interrupted run (named by the marker, partials): garbage
  changed: set[str]     # files its meta.json names that changed since: no longer this tool's


def existing(out: Path) -> Existing:
  """What earlier runs of this tool left in ``out`` (nothing for a new folder)."""
  meta = _read_own_record(out / PREPARED_META)
  marker = _read_own_record(out / PREPARED_MARKER)
  changed = _changed_files(out, meta) if meta is not None else set()
  try:
    complete = meta is not None and not changed and read_prepared(str(out)) is not None
  except (DataError, KeyError, TypeError, ValueError):
    complete = False
  kept = (_named_files(meta) | {PREPARED_META}) - changed if meta is not None else set()
  leftovers = set()
  if marker is not None:
    finals = _claimed_files(out, marker)
    leftovers = (finals - kept - changed) | _named_partials(marker) | {PREPARED_MARKER}
  return Existing(meta, complete, kept, leftovers, changed)


def remove(out: Path, names: Iterable[str], keep: Optional[Path], quiet: bool = False) -> None:
  """Removes ``out``'s files ``names``, all but ``keep`` (the tokenizer being read); ``quiet``:
  keeps going past a file that cannot be removed (cleaning up after an error)."""
  for name in sorted(names):
    path = out / name
    if keep is not None and path.exists() and path.resolve() == keep:
      continue  # the tokenizer this prepare reads is never deleted
    try:
      path.unlink(missing_ok=True)
    except OSError:
      if not quiet:  # (cleaning up after an error keeps going; the error is reported)
        raise


def _sync_folder(folder: Path) -> None:
  """Makes the renames in ``folder`` durable (where the platform can)."""
  with contextlib.suppress(OSError):
    fd = os.open(folder, os.O_RDONLY)
    try:
      os.fsync(fd)
    finally:
      os.close(fd)


def check_paths(inputs: Sequence[str], out: Path, tokenizer_path: Optional[Path]) -> None:
  """--out must not be a file, lie inside an input folder, or hold an input or the tokenizer
  under a name this tool writes."""
  if out.exists() and not out.is_dir():
    raise PrepareError(f"--out {str(out)!r} is a file, not a directory: give a directory path "
                       f"(it is created when missing)")
  where = out.resolve()
  own_names = {*SPLIT_FILES, TOKENIZER_FILE, PREPARED_META, PREPARED_MARKER}
  for entry in inputs:
    if entry == EMBEDDED or entry.startswith("hf:"):
      continue
    path = Path(entry).expanduser().resolve()
    if path.is_dir() and (path == where or path in where.parents):
      raise PrepareError(f"--out {str(out)!r} is inside the input folder {entry!r}, whose files "
                         f"would be read as input: put --out outside it")
    for f in input_files(entry):
      if f.resolve().parent == where and f.name in own_names:
        raise PrepareError(f"input {str(f)!r} is a file prepare writes in --out: choose another "
                           f"--out")
  if tokenizer_path is not None and tokenizer_path.parent == where and \
      tokenizer_path.name in own_names - {TOKENIZER_FILE}:
    raise PrepareError(f"--tokenizer {str(tokenizer_path)!r} is a file prepare writes in --out: "
                       f"copy it elsewhere or choose another --out")


def refuse_in_the_way(out: Path, writes: Sequence[str], found: Existing, force: bool) -> None:
  """Refuses (unless ``force``) files under the names this run writes that no record of this
  tool names (a folder under one of them, always)."""
  ours = found.kept | found.leftovers
  in_the_way = []
  for name in (*writes, PREPARED_META, PREPARED_MARKER):
    path = out / name
    if path.is_dir():
      raise PrepareError(f"{path} is a directory, where prepare writes a file: move it or "
                         f"choose another --out")
    if os.path.lexists(path) and name not in ours and name not in found.changed:
      in_the_way.append(name)
  if in_the_way and not force:
    raise PrepareError(f"{out} holds {', '.join(in_the_way)}, not written by python -m "
                       f"stablejax prepare (no meta.json of its own names them): choose another "
                       f"--out, or pass --force to replace them")


def start_record(writes: Sequence[str], request: dict) -> tuple[dict[str, str], dict]:
  """(this run's partial file of each name it writes, meta.json included; the marker).

  The marker names this run's partial files, and (`finish`, just before they are renamed into
  place) each file it puts in --out with that file's identity, so an interrupted run's files are
  recognised (and removed) by the next one, and a file put there since under the same name is
  not.
  """
  tag = f"{os.getpid()}-{secrets.token_hex(4)}"
  partials = {name: f"{name}.{tag}{PARTIAL}" for name in (*writes, PREPARED_META)}
  marker = {"format": PREPARED_FORMAT, "incomplete": True, "written": [], "claims": {},
            "partials": sorted(partials.values()), "request": request,
            "writer": {"pid": os.getpid(), "host": socket.gethostname(), "tag": tag}}
  return partials, marker


def remove_failed(out: Path, partials: dict[str, str], state: dict, found: Existing,
                  stale: set[str], keep: Optional[Path]) -> None:
  """Removes what a failed run wrote: its partial files, the corpus it was putting in place once
  the old one's meta.json was gone (`finish`'s ``state``), and its marker."""
  remove(out, partials.values(), keep, quiet=True)
  if state["old_meta_removed"]:  # the earlier corpus is gone: none of its files stay
    remove(out, {*state["renamed"], *found.kept, *stale}, keep, quiet=True)
  remove(out, [PREPARED_MARKER], keep, quiet=True)


def create_out(out: Path) -> list[Path]:
  """Creates --out and its missing parents; returns the folders it created, outermost first."""
  missing = []
  folder = out
  while not os.path.lexists(folder) and folder != folder.parent:
    missing.append(folder)
    folder = folder.parent
  created: list[Path] = []
  try:
    for folder in reversed(missing):
      try:
        os.mkdir(folder)
        created.append(folder)
      except FileExistsError:
        if not folder.is_dir():  # made by someone else meanwhile: a folder is fine
          raise
  except OSError as e:
    remove_created(created)
    raise PrepareError(f"cannot create --out {str(out)!r} ({e.strerror or e}): choose a writable "
                       f"directory") from None
  return created


def remove_created(created: list[Path]) -> None:
  """Removes the folders this run created, innermost first, as long as they are empty."""
  for folder in reversed(created):
    try:
      os.rmdir(folder)
    except OSError:
      return  # not empty (someone else's files), or gone: leave it


def finish(out: Path, meta: dict, writes: Sequence[str], stale: set[str],
            tok_path: Optional[Path], state: dict, partials: dict[str, str],
            marker: dict) -> None:
  """Puts the new corpus in place: the marker first claims the files it is about to put there
  and the old corpus' files it removes (each by its identity), the old meta.json goes (from then
  on the directory is incomplete and the marker says so), the partial files are renamed, files of
  the old corpus that the new one lacks are removed, meta.json is written (atomically) with the
  status of the files now in place, and the marker goes last."""
  claims = {name: _file_identity(out / partials[name]) for name in writes}
  claims.update({name: _file_identity(out / name) for name in stale})
  write_json(out / PREPARED_MARKER, dict(marker, claims=claims), out / partials[PREPARED_META])
  state["old_meta_removed"] = True
  with writing(out / PREPARED_META):
    (out / PREPARED_META).unlink(missing_ok=True)
    for name in writes:
      os.replace(out / partials[name], out / name)
      state["renamed"].append(name)
    remove(out, stale, tok_path)
    for name in SPLIT_FILES:
      meta["files"][name]["stat"] = stat_record(os.stat(out / name))
  write_json(out / PREPARED_META, meta, out / partials[PREPARED_META])
  with writing(out / PREPARED_MARKER):
    (out / PREPARED_MARKER).unlink(missing_ok=True)
  _sync_folder(out)
