"""The prepared format: the directory ``python -m stablejax prepare`` writes and the trainer reads.

A prepared directory holds ``train.bin`` and ``val.bin`` (every document's tokens followed by the
end-of-text id, as flat ``uint16`` arrays when the vocabulary fits, else ``uint32``), the
tokenizer's ``tokenizer.json`` when it has one, and ``meta.json`` (format
``stablejax.prepared/1``: tokenizer, vocab_size, eot_id, dtype, token and document counts per
split and per input with each input's token range in ``train.bin`` and its weight, the split rule,
the filter, the request, the files written, and each ``.bin`` file's size, SHA-256, largest token
id and status). ``meta.json`` is written last, so a directory without it is incomplete;
``meta.json.partial`` is the record of a prepare in progress (it names that run's files).

Reading: `read_prepared` (``meta.json``, checked against the files' sizes), `prepared_file` (a
file checked against its record: by its status when untouched since it was written, else by its
SHA-256), `scan_tokens`. Writing: `TokenFile` (a split file and its record), `corpus_meta`,
`write_json` (atomic), `dtype_for`; where the files go and whose they are is
:mod:`stablejax.data.out_dir`.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
from pathlib import Path
from typing import Iterator, Mapping, Optional

import numpy as np
import numpy.typing as npt

from stablejax.data import tokenizer as tokenizer_lib
from stablejax.data.config import DataError, Options, PrepareError

PREPARED_META = "meta.json"         # marks a complete directory written by stablejax.data.prepare
PREPARED_FORMAT = "stablejax.prepared/1"
# Present while stablejax.data.prepare writes a directory (it becomes meta.json at the end): what it
# names is that tool's, and without meta.json the directory is an interrupted prepare.
PREPARED_MARKER = PREPARED_META + ".partial"
SPLIT_FILES = ("train.bin", "val.bin")
TOKENIZER_FILE = "tokenizer.json"
READ_BLOCK = 1 << 24       # bytes per read when hashing or scanning a file


# ----------------------------------------------------------------------------- reading


def read_prepared(path: str | os.PathLike) -> Optional[dict]:
  """The ``meta.json`` of a prepared directory, checked against its files; None if not one.

  Raises:
    DataError: the directory has ``meta.json`` but it is unreadable, of another format, or its
      ``train.bin``/``val.bin`` do not have the sizes it records.
  """
  path = os.path.expanduser(os.fspath(path))
  meta_path = os.path.join(path, PREPARED_META)
  if not os.path.isdir(path) or not os.path.isfile(meta_path):
    return None
  try:
    with open(meta_path) as f:
      meta = json.load(f)
  except (OSError, ValueError) as e:
    raise DataError(f"{meta_path} is unreadable ({e}): prepare the directory again with "
                    f"python -m stablejax prepare") from None
  if not isinstance(meta, dict) or meta.get("format") != PREPARED_FORMAT:
    raise DataError(f"{meta_path} is not a meta.json of python -m stablejax prepare (format "
                    f"{PREPARED_FORMAT}): prepare the directory again")
  itemsize = np.dtype(meta["dtype"]).itemsize
  for split in ("train", "val"):
    file = os.path.join(path, f"{split}.bin")
    expected = int(meta[f"{split}_tokens"]) * itemsize
    actual = os.path.getsize(file) if os.path.isfile(file) else None
    if actual != expected:
      raise DataError(f"{file} has {actual} bytes but meta.json records {expected}: the prepare "
                      f"did not finish or the file changed; run python -m stablejax prepare again")
  return meta


def prepared_vocab_size(entry: object) -> Optional[int]:
  """``vocab_size`` of a prepared directory named by a ``data.train`` value, else None.

  Used by the config to set ``model.vocab_size`` when it is not given; any problem is left to
  ``build_data`` to report.
  """
  entries = [entry] if isinstance(entry, str) else entry
  if not isinstance(entries, list) or len(entries) != 1 or not isinstance(entries[0], str):
    return None
  try:
    meta = read_prepared(entries[0])
  except (DataError, KeyError, TypeError, ValueError):
    return None
  return int(meta["vocab_size"]) if meta else None


def stat_record(st: os.stat_result) -> dict:
  """What a file's status says about its content: a rewrite, a copy or a rename changes one of
  them (ctime cannot be set by hand)."""
  return {"ino": st.st_ino, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns}


_SCANNED: dict[tuple, dict] = {}  # (path, size, stat record, dtype) -> scan_tokens result


def scan_tokens(path: str | os.PathLike, dtype: npt.DTypeLike = np.uint16) -> dict:
  """One pass over a token file: ``{"bytes", "sha256", "max_token"}`` (-1 for an empty file).

  Read in 16 MiB blocks (memory does not grow with the file); a file unchanged since it was last
  scanned in this process (same size and status) is not read again.
  """
  path = os.path.realpath(os.fspath(path))
  dtype = np.dtype(dtype)
  st = os.stat(path)
  key = (path, st.st_size, tuple(stat_record(st).values()), dtype.str)
  if key not in _SCANNED:
    digest, top = hashlib.sha256(), -1
    block = bytearray(READ_BLOCK - READ_BLOCK % dtype.itemsize)
    with open(path, "rb") as f:
      while n := f.readinto(block):
        view = memoryview(block)[:n]
        digest.update(view)
        ids = np.frombuffer(view[:n - n % dtype.itemsize], dtype)
        if ids.size:
          top = max(top, int(ids.max()))
    _SCANNED[key] = {"bytes": st.st_size, "sha256": digest.hexdigest(), "max_token": top}
  return dict(_SCANNED[key])


def prepared_file(path: str | os.PathLike, meta: dict, name: str) -> dict:
  """What ``path/name`` (``train.bin`` or ``val.bin``) of a prepared directory holds, checked
  against the record its ``meta.json`` keeps of it.

  ``python -m stablejax prepare`` records each file's size, SHA-256, largest token id and status
  (inode, mtime, ctime) once it is in place. A file whose size and status are still the recorded
  ones has not been written, copied or replaced since, so the record is taken as is and nothing
  is read ("checked": "status"); any other file is read once (`scan_tokens`) and its SHA-256
  compared ("checked": "sha256"; a directory of an earlier release, whose meta.json records no
  hash: "read", the content is what it is).

  Returns:
    ``{"bytes", "sha256", "max_token", "checked"}``.

  Raises:
    DataError: the file is missing, or its size or SHA-256 is not the recorded one.
  """
  file = os.path.join(os.path.expanduser(os.fspath(path)), name)
  try:
    st = os.stat(file)
  except OSError as e:
    raise DataError(f"{file} is missing or unreadable ({e.strerror or e}): prepare the directory "
                    f"again with python -m stablejax prepare") from None
  files = meta.get("files")
  record = files.get(name) if isinstance(files, dict) else None
  record = record if isinstance(record, dict) else {}
  if "bytes" in record and record["bytes"] != st.st_size:
    raise DataError(f"{file} has {st.st_size} bytes but meta.json records {record['bytes']}: the "
                    f"file changed since it was prepared; prepare the directory again")
  if (record.get("stat") == stat_record(st) and isinstance(record.get("sha256"), str)
      and isinstance(record.get("max_token"), int)):
    return {"bytes": st.st_size, "sha256": record["sha256"], "max_token": record["max_token"],
            "checked": "status"}
  facts = scan_tokens(file, meta.get("dtype", "uint16"))
  if isinstance(record.get("sha256"), str):
    if facts["sha256"] != record["sha256"]:
      raise DataError(f"{file} is not the file python -m stablejax prepare wrote (its SHA-256 "
                      f"differs from the one meta.json records): it was changed or replaced; "
                      f"prepare the directory again")
    return {**facts, "checked": "sha256"}
  return {**facts, "checked": "read"}


# ----------------------------------------------------------------------------- writing


def write_error(path: Path, e: OSError) -> PrepareError:
  """``e``, raised while writing ``path``, as the one line prepare reports."""
  full = e.errno in (errno.ENOSPC, errno.EDQUOT)
  reason = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
            errno.EROFS: "read-only file system", errno.EACCES: "permission denied",
            errno.EPERM: "operation not permitted"}.get(e.errno or 0, e.strerror or str(e))
  fix = "free some space or choose another --out" if full else \
      "choose a writable --out (or fix its permissions)"
  return PrepareError(f"cannot write {path} ({reason}): {fix}; nothing this run wrote is kept")


@contextlib.contextmanager
def writing(path: Path) -> Iterator[None]:
  """An OSError inside (a full disk, a read-only folder) is a one-line PrepareError."""
  try:
    yield
  except OSError as e:
    raise write_error(path, e) from None


def write_json(path: Path, record: dict, temp: Path) -> None:
  """``record`` as ``path``, atomically (written as ``temp``, synced, renamed)."""
  with writing(path):
    with open(temp, "w") as f:
      f.write(json.dumps(record, indent=2) + "\n")
      f.flush()
      os.fsync(f.fileno())
    os.replace(temp, path)


def dtype_for(vocab_size: int, requested: str) -> str:
  """The element type of the split files: ``requested`` (``auto``: the smallest that holds
  every id of ``vocab_size``)."""
  fits16 = vocab_size <= 1 << 16
  if requested == "auto":
    return "uint16" if fits16 else "uint32"
  if requested == "uint16" and not fits16:
    raise PrepareError(f"--dtype uint16 cannot hold a vocabulary of {vocab_size} (ids up to "
                       f"65535): use --dtype uint32 or auto")
  return requested


class TokenFile:
  """One split's partial file: appends token arrays and keeps what meta.json records of it
  (the record `prepared_file` checks the file against)."""

  def __init__(self, path: Path, final: Path) -> None:
    self.path, self.final = path, final
    with writing(final):
      self._file = open(path, "wb")
    self.sha256 = hashlib.sha256()
    self.bytes = 0
    self.tokens = 0
    self.max_token = -1

  def append(self, ids: np.ndarray) -> None:
    if not ids.size:
      return
    data = np.ascontiguousarray(ids).view(np.uint8).data
    with writing(self.final):
      self._file.write(data)
    self.sha256.update(data)
    self.bytes += data.nbytes
    self.tokens += int(ids.size)
    self.max_token = max(self.max_token, int(ids.max()))

  def close(self) -> None:
    """Flushes and syncs the file (on disk before meta.json says it is complete)."""
    with writing(self.final):
      self._file.flush()
      os.fsync(self._file.fileno())
      self._file.close()

  def abort(self) -> None:
    with contextlib.suppress(OSError):
      self._file.close()

  def record(self) -> dict:
    return {"bytes": self.bytes, "tokens": self.tokens, "sha256": self.sha256.hexdigest(),
            "max_token": self.max_token}


def source_record(entry: str, documents: int, counts: Mapping[str, int],
                  start: Mapping[str, int], end: Mapping[str, int]) -> dict:
  """meta.json's record of one input: its document counts (``counts`` of `encode_batch`'s
  labels) and its token range ``[start, end)`` in each split file."""
  return {
      "input": entry, "documents": documents, "train_documents": counts["train"],
      "val_documents": counts["val"], "dropped_repeat": counts["repeat"],
      "dropped_nontext": counts["nontext"], "empty": counts["empty"],
      "bytes": counts["bytes"],
      "invalid_utf8_documents": counts["invalid_utf8_documents"],
      "invalid_utf8_bytes": counts["invalid_utf8_bytes"],
      "train_range": [start["train"], end["train"]],
      "val_range": [start["val"], end["val"]],
      "train_tokens": end["train"] - start["train"],
      "val_tokens": end["val"] - start["val"]}


def corpus_meta(tok: tokenizer_lib.Tokenizer, dtype: str, totals: Mapping[str, int],
                sources: list[dict], files: Mapping[str, TokenFile], opts: Options) -> dict:
  """meta.json of a corpus whose split files are written and closed (each input's record with
  its ``weight``); the job adds its request and the names it wrote, `finish` each file's status.
  """
  return {
      "format": PREPARED_FORMAT,
      "tokenizer": {**tok.describe(), **({"file": "tokenizer.json"} if tok.kind == "hf" else {}),
                    "vocab_size": tok.vocab_size, "eot_id": tok.eot_id},
      "vocab_size": tok.vocab_size, "eot_id": tok.eot_id, "dtype": dtype,
      "train_tokens": totals["train"], "val_tokens": totals["val"],
      "documents": sum(s["documents"] for s in sources),
      "train_documents": sum(s["train_documents"] for s in sources),
      "val_documents": sum(s["val_documents"] for s in sources),
      "bytes": sum(s["bytes"] for s in sources),
      "invalid_utf8": {"documents": sum(s["invalid_utf8_documents"] for s in sources),
                       "bytes": sum(s["invalid_utf8_bytes"] for s in sources),
                       "written_as": "U+FFFD"},
      "sources": sources,
      "split": {"rule": "validation iff blake2b(utf8, digest_size=8) as little-endian int < "
                        "val_fraction * 2**64", "val_fraction": opts.val_fraction},
      "filter": {"max_repeat": opts.filter_max_repeat, "max_nontext": opts.filter_max_nontext},
      "files": {f"{split}.bin": f.record() for split, f in files.items()},
  }
