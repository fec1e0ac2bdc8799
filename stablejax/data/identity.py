"""The identity of the data a training config reads, so a resumed run can tell its data again.

`data_identity` names the data a config reads as plain JSON (content hashes, token counts, the
tokenizer); a run records it when it starts, and `identity_difference` compares two, so a resume
refuses other data under the same names. Paths are information only: a corpus moved or copied
elsewhere is the same data.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from typing import Any, Optional, Sequence

from stablejax.data.config import EMBEDDED, DataConfig, DataError, source_entries
from stablejax.data.prepared import READ_BLOCK, prepared_file, read_prepared
from stablejax.data.sources import (BIN_SUFFIX, TEXT_SUFFIXES, check_not_unfinished,
                                    text_folder_files)

IDENTITY_FORMAT = "stablejax.data-identity/1"
HASH_LIMIT = 1 << 30       # data_identity hashes plain files up to this many bytes in all


def _file_sha256(path: str) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    while block := f.read(READ_BLOCK):
      digest.update(block)
  return digest.hexdigest()


def _plain_identity(entry: str, path: str, files: list[str], hash_limit: int) -> dict:
  """Identity of a text file, a folder of text files or a .bin file."""
  real = os.path.realpath(path)
  try:
    sizes = [os.path.getsize(f) for f in files]
    mtimes = [os.stat(f).st_mtime_ns for f in files]
  except OSError as e:
    raise DataError(f"cannot read data file ({e.strerror or e}) of {entry!r}: check the path and "
                    f"its permissions") from None
  kind = ("folder" if os.path.isdir(path) else "bin" if path.lower().endswith(BIN_SUFFIX)
          else "text")
  names = [os.path.relpath(f, real) if kind == "folder" else os.path.basename(f) for f in files]
  ident: dict[str, Any] = {"source": entry, "kind": kind, "path": real, "files": len(files),
                           "bytes": sum(sizes)}
  if sum(sizes) <= hash_limit:
    if kind == "folder":  # the names and contents of every file, in the order they are read
      listing = "".join(f"{n}\0{_file_sha256(f)}\n" for n, f in zip(names, files))
      ident["sha256"] = hashlib.sha256(listing.encode()).hexdigest()
    else:
      ident["sha256"] = _file_sha256(files[0])
    ident["checked"] = "sha256"
  else:  # too large to read at every start: what the file system says about it
    listing = "".join(f"{n}\0{size}\0{mtime}\n" for n, size, mtime in zip(names, sizes, mtimes))
    ident["size_mtime_sha256"] = hashlib.sha256(listing.encode()).hexdigest()
    ident["checked"] = f"sizes and mtimes only (more than {hash_limit} bytes to hash)"
  return ident


def _entry_identity(entry: str, hash_limit: int) -> dict:
  if entry == EMBEDDED:
    try:
      from pydoc_data.topics import topics  # pylint: disable=import-outside-toplevel
    except ImportError:
      raise DataError("the embedded corpus needs CPython's pydoc_data module, which this Python "
                      "lacks: point data.train at a text file instead") from None
    text = "".join(f"{k}\0{topics[k]}\n" for k in sorted(topics)).encode("utf-8")
    return {"source": entry, "kind": "pydoc", "python": platform.python_version(),
            "bytes": len(text), "sha256": hashlib.sha256(text).hexdigest(), "checked": "sha256"}
  path = os.path.expanduser(entry)
  if not os.path.exists(path):
    raise DataError(f"{entry!r} does not exist: check the path, or use \"{EMBEDDED}\" for the "
                    f"embedded corpus")
  check_not_unfinished(entry)
  meta = read_prepared(entry)
  if meta is not None:
    files = {}
    checked = set()
    for name in ("train.bin", "val.bin"):
      facts = prepared_file(path, meta, name)
      files[name] = {"bytes": facts["bytes"], "sha256": facts["sha256"]}
      checked.add(facts["checked"])
    return {"source": entry, "kind": "prepared", "path": os.path.realpath(path),
            "tokenizer": meta.get("tokenizer"), "vocab_size": meta.get("vocab_size"),
            "eot_id": meta.get("eot_id"), "dtype": meta.get("dtype"),
            "train_tokens": meta.get("train_tokens"), "val_tokens": meta.get("val_tokens"),
            "files": files, "checked": "+".join(sorted(checked))}
  if os.path.isdir(path):
    found = text_folder_files(path)
    if not found:
      raise DataError(f"data folder {entry!r} has no text files ({', '.join(TEXT_SUFFIXES)}): "
                      f"add some, or name a .bin file directly")
    return _plain_identity(entry, path, found, hash_limit)
  return _plain_identity(entry, path, [path], hash_limit)


# The data settings that change which tokens the trainer sees (given a DataConfig).
_IDENTITY_SETTINGS = ("val_fraction", "weights", "filter_max_repeat", "filter_max_nontext",
                      "vocab_size")


def data_identity(data: DataConfig | str | os.PathLike | Sequence[str], *,
                  hash_limit: int = HASH_LIMIT) -> dict:
  """A JSON-able identity of the data a training config reads, to tell the same data again.

  A run records it when it starts; a resume compares it (`identity_difference`) to refuse other
  data under the same names. Each source of ``data.train`` and ``data.val`` gets an entry:

  * a prepared directory: what its ``meta.json`` records (tokenizer, vocab_size, eot_id, dtype,
    token counts) and the size and SHA-256 of ``train.bin`` and ``val.bin``, checked against the
    files (`prepared_file`: free when the files are untouched since ``prepare`` wrote them, one
    read otherwise; a directory of an earlier release without recorded hashes is hashed once);
  * a text file, a folder of text files (the files the trainer reads, in its order) or a
    ``.bin`` file: its resolved path, file count, bytes and SHA-256 of the contents, when the
    source holds at most ``hash_limit`` bytes; a larger one is identified by the sizes and
    modification times of its files (``size_mtime_sha256``; ``checked`` says so), so copying it
    elsewhere reads as different data;
  * ``"pydoc"``: the embedded corpus' SHA-256 (it changes with the Python version).

  Every entry also has ``source`` (as given), ``kind`` and ``checked`` (how it was established);
  a path is information only: `identity_difference` compares contents.

  Args:
    data: the trainer's ``DataConfig``, or one source (``"pydoc"``, a path) or a list of them.
    hash_limit: the most bytes of a plain text or ``.bin`` source to hash.

  Returns:
    ``{"format": "stablejax.data-identity/1", "train": [entry, ...], "val": [entry, ...],
    "settings": {...}}``; ``settings`` holds the config's fields that change the token stream
    (``val_fraction``, ``weights``, the filters, ``vocab_size``; empty when ``data`` is not a
    config). It is plain JSON.

  Raises:
    DataError: a missing source, an unfinished prepared directory, or a prepared file whose
      size or SHA-256 is not the one its meta.json records.

  Example:
    >>> from stablejax.data.identity import data_identity, identity_difference
    >>> ident = data_identity("pydoc")
    >>> ident["train"][0]["kind"], len(ident["train"][0]["sha256"])
    ('pydoc', 64)
    >>> identity_difference(ident, data_identity("pydoc")) is None
    True
  """
  if isinstance(data, DataConfig):
    train, val = source_entries(data.train, "train"), source_entries(data.val, "val")
    settings = {k: getattr(data, k) for k in _IDENTITY_SETTINGS}
  else:
    train, val, settings = source_entries(data, "train"), [], {}
  return json.loads(json.dumps({
      "format": IDENTITY_FORMAT,
      "train": [_entry_identity(e, hash_limit) for e in train],
      "val": [_entry_identity(e, hash_limit) for e in val],
      "settings": settings}))


# Entry fields that say what the data is (the rest: where it is and how it was checked).
_CONTENT_KEYS = ("kind", "bytes", "files", "sha256", "size_mtime_sha256", "tokenizer",
                 "vocab_size", "eot_id", "dtype", "train_tokens", "val_tokens", "python")


def identity_difference(recorded: dict, current: dict) -> Optional[str]:
  """None when two `data_identity` results name the same data, else one line saying what
  differs (paths are not compared: a corpus moved or copied elsewhere is the same data)."""
  for split in ("train", "val"):
    a, b = recorded.get(split, []), current.get(split, [])
    if len(a) != len(b):
      return f"data.{split} had {len(a)} source(s), now {len(b)}"
    for i, (x, y) in enumerate(zip(a, b)):
      for key in _CONTENT_KEYS:
        if x.get(key) != y.get(key):
          what = "content (SHA-256)" if key in ("sha256", "files") else key
          return (f"data.{split} source {i} ({y.get('source', '?')}): its {what} differs from "
                  f"the data recorded ({x.get('source', '?')})")
  if recorded.get("settings") != current.get("settings"):
    changed = sorted(k for k in set(recorded.get("settings") or {}) | set(current.get("settings")
                                                                           or {})
                     if (recorded.get("settings") or {}).get(k)
                     != (current.get("settings") or {}).get(k))
    return f"data settings differ: {', '.join(changed)}"
  return None
