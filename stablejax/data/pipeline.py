"""Training data: sources, document filter, seeded random windows, mixing and sharding with Grain.

Sources (``DataConfig.train`` / ``DataConfig.val``: one entry or a list):
  * ``"pydoc"``: the embedded corpus, the Python documentation text that ships with CPython
    (``pydoc_data.topics``, ~0.46 MB); no download. Byte-level tokens, vocab 256.
  * a text file or a folder of text files (``*.txt``, ``*.md``, ``*.rst``, ``*.text``, searched
    recursively, sorted by path): UTF-8 bytes as tokens, vocab 256.
  * a nanoGPT-style ``*.bin`` file: a flat ``uint16`` token array, memory-mapped (never loaded).
    Vocab ``DataConfig.vocab_size`` or 50304 (GPT-2's 50257 padded to a multiple of 64).
  * a directory written by ``python -m stablejax prepare`` (it has ``meta.json``): its
    ``train.bin`` (one source per prepared input, mixed by the input weights in ``meta.json``
    unless ``weights`` is given) and its ``val.bin`` as the validation set; ``uint16`` or
    ``uint32`` as ``meta.json`` says, vocabulary ``meta.json``'s ``vocab_size`` (the config sets
    ``model.vocab_size`` from it, padded to a multiple of 64, unless it is given). Documents were
    filtered when the directory was prepared, so no filter pass runs here. It must be the only
    entry of ``train`` and ``val`` must be unset. A directory whose ``meta.json`` is missing or
    whose files do not have the sizes it records (an unfinished prepare) is an error, and so is
    one whose files are not the ones prepare wrote (another SHA-256 than ``meta.json`` records;
    `prepared_file`) or hold a token id at or above its vocabulary.

Identity. `data_identity` names the data a config reads as plain JSON (content hashes, token
counts, the tokenizer), and `identity_difference` compares two, so a resumed run can tell its
data from other data under the same names.

Documents and the filter. A *document* is: one topic of the embedded corpus; for text files,
consecutive blank-line-separated paragraphs packed up to 64 KiB (so a file of up to 64 KiB is one
document, a longer file several, and a paragraph longer than 64 KiB is cut into 64 KiB pieces);
for ``.bin`` files, fixed chunks of 65536 tokens. A document is dropped when it holds a run of one
repeated byte/token longer than ``filter_max_repeat`` (runs are measured within the document), or,
for text, when its fraction of non-text bytes exceeds ``filter_max_nontext``. Non-text bytes are
ASCII control bytes other than ``\\t \\n \\v \\f \\r`` plus bytes that are not part of valid UTF-8.
Kept text documents are concatenated (files separated by a blank line); for ``.bin`` files windows
are drawn only from runs of kept chunks. ``Data.stats`` reports the counts. The ``.bin`` filter
pass reads the whole file once at start-up (and checks every token is below the vocabulary size);
``filter_max_repeat=0`` skips it.

Validation. Without ``val``, the last ``val_fraction`` of each train source's kept tokens (at
least one window) is held out. Validation batches are fixed: non-overlapping windows of all val
sources, taken evenly spaced (repeated cyclically if there are fewer windows than needed).

Training windows (all Grain ``MapDataset`` transformations, so the whole pipeline is a pure
function of the index and the seed):
  1. per source, ``range(n_windows).shuffle(seed_i).repeat()``: each epoch visits every window
     slot in a new order; ``random_map`` then jitters each window's start by a random offset in
     ``[0, seq_len]`` (new each epoch), so window boundaries move between epochs;
  2. ``MapDataset.mix(sources, weights)``: weighted interleaving; ``weights`` default to the
     sources' train token counts (the mix then matches plain concatenation);
  3. ``WindowShuffleMapDataset(window_size=shuffle_buffer)``: a shuffle buffer over the mixed
     windows (index based: it stays the same whatever the process count);
  4. ``batch(batch_size // process_count)`` then ``[process_index::process_count]``: global batch
     ``b`` is made of windows ``b*B .. b*B + B - 1``; process ``p`` reads rows ``p*B/P ..
     (p+1)*B/P - 1`` of it, so the processes' batches stacked in order equal the single-process
     batch, and no process reads another's windows.

The iterator (``Data.train_iter()``) is a Grain ``DatasetIterator`` whose state is
``{"next_index": number_of_batches_consumed}``: ``get_state``/``set_state`` round-trip exactly
and it checkpoints with Orbax through ``grain.checkpoint.CheckpointSave/CheckpointRestore``.

Example::

    data = build_data(DataConfig(train="pydoc"), seq_len=128, batch_size=16, seed=0)
    it = data.train_iter()
    batch = next(it)              # {"tokens": int32 [16, 129]}
    val = data.val_batches(4)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import platform
import re
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

import grain
import numpy as np
from grain.experimental import WindowShuffleMapDataset

if TYPE_CHECKING:
  from stablejax.data.tokenizer import Tokenizer

EMBEDDED = "pydoc"
PREPARED_META = "meta.json"         # marks a complete directory written by stablejax.data.prepare
PREPARED_FORMAT = "stablejax.prepared/1"
# Present while stablejax.data.prepare writes a directory (it becomes meta.json at the end): what it
# names is that tool's, and without meta.json the directory is an interrupted prepare.
PREPARED_MARKER = PREPARED_META + ".partial"
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".text")
BIN_SUFFIX = ".bin"
DEFAULT_BIN_VOCAB = 50304
TEXT_DOC_BYTES = 1 << 16
BIN_DOC_TOKENS = 1 << 16
_BIN_BLOCK = 1 << 24       # tokens per block in the .bin filter pass (multiple of BIN_DOC_TOKENS)
_READ_BLOCK = 1 << 24      # bytes per read when hashing or scanning a file
IDENTITY_FORMAT = "stablejax.data-identity/1"
HASH_LIMIT = 1 << 30       # data_identity hashes plain files up to this many bytes in all

# Control bytes other than \t \n \v \f \r, and DEL.
_CONTROL = np.zeros(256, bool)
_CONTROL[list(range(0, 9)) + list(range(14, 32)) + [127]] = True
_SURROGATE = re.compile("[\udc80-\udcff]")
_PARAGRAPH = re.compile(rb".*?(?:\n[ \t\r\f\v]*\n\s*|\Z)", re.S)


class DataError(Exception):
  """A missing, empty, unreadable or unusable data source; one line naming the problem and fix."""


@dataclasses.dataclass
class DataConfig:
  """The ``data`` section of the trainer's config: sources, split, mixing and filters.

  ``train`` is ``"pydoc"`` (the embedded corpus), a path (a text file or folder read as bytes, a
  nanoGPT-style ``.bin`` token file, or a directory written by ``stablejax prepare``) or a list
  of them (mixed by ``weights``, by default in proportion to their sizes). Without ``val`` the
  last ``val_fraction`` of each train source is held out (a prepared directory brings its own
  ``val.bin``). Documents with a run of one byte longer than ``filter_max_repeat`` or a share of
  non-text bytes above ``filter_max_nontext`` are dropped before training.

  Example:
    >>> from stablejax.data.pipeline import DataConfig
    >>> cfg = DataConfig(train="pydoc", val_fraction=0.05)
    >>> cfg.train, cfg.val, cfg.vocab_size      # vocab 0: 256 for text, the meta's for prepared
    ('pydoc', None, 0)
  """

  # "pydoc", a path (text file/folder, .bin, prepared dir) or a list of them
  train: Union[str, list[str]] = "pydoc"
  val: Optional[Union[str, list[str]]] = None  # None -> last val_fraction of each train source
  val_fraction: float = 0.05
  weights: Optional[list[float]] = None    # mixing weights of the train sources; None: by size
  shuffle_buffer: int = 256                # shuffle buffer over windows (<= 1 disables)
  filter_max_repeat: int = 256             # max run of one repeated byte/token (0 disables)
  filter_max_nontext: float = 0.3          # max fraction of non-text bytes (1.0 disables)
  num_threads: int = 0                     # grain read threads (0: read in the calling thread)
  vocab_size: int = 0                      # 0: 256 for text, 50304 for .bin sources


# ----------------------------------------------------------------------------- sources


@dataclasses.dataclass
class _Source:
  name: str
  kind: str                  # "pydoc" | "text" | "bin"
  tokens: np.ndarray         # uint8 (text) or uint16 memmap (.bin)
  ranges: list               # usable [start, end) ranges after filtering
  stats: dict

  @property
  def usable(self) -> int:
    return int(sum(e - s for s, e in self.ranges))


def _as_list(value: Any, key: str) -> list[str]:
  if value is None:
    return []
  items = [value] if isinstance(value, (str, os.PathLike)) else list(value)
  if not items:
    raise DataError(f"data.{key} is an empty list: give at least one source (e.g. \"pydoc\")")
  for item in items:
    if not isinstance(item, (str, os.PathLike)):
      raise DataError(f"data.{key} entry {item!r} is not a string: give a path or \"pydoc\"")
  return [os.fspath(i) for i in items]


def _read_bytes(path: str) -> bytes:
  try:
    with open(path, "rb") as f:
      return f.read()
  except OSError as e:
    raise DataError(f"cannot read data file {path!r} ({e.strerror or e}): check its permissions "
                    f"or remove it from the data config") from None


def _text_documents(raw: bytes) -> list[bytes]:
  """Blank-line paragraphs packed into documents of at most TEXT_DOC_BYTES (lossless)."""
  if len(raw) <= TEXT_DOC_BYTES:
    return [raw]
  docs: list[bytes] = []
  current: list[bytes] = []
  size = 0
  for m in _PARAGRAPH.finditer(raw):
    para = m.group(0)
    if not para:
      continue
    while len(para) > TEXT_DOC_BYTES:
      if current:
        docs.append(b"".join(current))
        current, size = [], 0
      docs.append(para[:TEXT_DOC_BYTES])
      para = para[TEXT_DOC_BYTES:]
    if size + len(para) > TEXT_DOC_BYTES and current:
      docs.append(b"".join(current))
      current, size = [], 0
    current.append(para)
    size += len(para)
  if current:
    docs.append(b"".join(current))
  return docs


def _max_run(a: np.ndarray) -> int:
  if a.size == 0:
    return 0
  breaks = np.flatnonzero(a[1:] != a[:-1])
  bounds = np.concatenate([[-1], breaks, [a.size - 1]])
  return int(np.diff(bounds).max())


def _nontext_fraction(doc: bytes) -> float:
  if not doc:
    return 0.0
  a = np.frombuffer(doc, np.uint8)
  control = int(_CONTROL[a].sum())
  invalid = len(_SURROGATE.findall(doc.decode("utf-8", errors="surrogateescape")))
  return (control + invalid) / len(doc)


def _filter_text(name: str, kind: str, files: list[list[bytes]], cfg: DataConfig) -> _Source:
  """Filters documents (grouped per file) and concatenates the kept ones."""
  kept, n_docs, drop_repeat, drop_nontext = [], 0, 0, 0
  bytes_in = 0
  for docs in files:
    file_kept = []
    for doc in docs:
      n_docs += 1
      bytes_in += len(doc)
      a = np.frombuffer(doc, np.uint8)
      if cfg.filter_max_repeat > 0 and _max_run(a) > cfg.filter_max_repeat:
        drop_repeat += 1
      elif cfg.filter_max_nontext < 1.0 and _nontext_fraction(doc) > cfg.filter_max_nontext:
        drop_nontext += 1
      else:
        file_kept.append(doc)
    if file_kept:
      joined = b"".join(file_kept)
      kept.append(joined if joined.endswith(b"\n\n") else joined.rstrip(b"\n") + b"\n\n")
  tokens = np.frombuffer(b"".join(kept), np.uint8)
  stats = dict(name=name, kind=kind, files=len(files), documents=n_docs,
               kept=n_docs - drop_repeat - drop_nontext, dropped_repeat=drop_repeat,
               dropped_nontext=drop_nontext, bytes_in=bytes_in, tokens=int(tokens.size))
  if tokens.size == 0:
    raise DataError(f"every document of {name!r} was dropped by the filter ({drop_repeat} long "
                    f"repeats, {drop_nontext} non-text): check the data or relax "
                    f"data.filter_max_repeat / data.filter_max_nontext")
  return _Source(name, kind, tokens, [(0, int(tokens.size))], stats)


def _load_pydoc(cfg: DataConfig) -> _Source:
  try:
    from pydoc_data.topics import topics  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise DataError("the embedded corpus needs CPython's pydoc_data module, which this Python "
                    "lacks: point data.train at a text file instead") from None
  files = [[(topics[k].rstrip("\n") + "\n\n").encode("utf-8")] for k in sorted(topics)]
  return _filter_text(EMBEDDED, "pydoc", files, cfg)


def _load_text_file(path: str, cfg: DataConfig) -> _Source:
  raw = _read_bytes(path)
  if not raw:
    raise DataError(f"data file {path!r} is empty: give a file with text in it")
  return _filter_text(path, "text", [_text_documents(raw)], cfg)


def _text_folder_files(path: str) -> list[str]:
  """The text files of a folder the trainer reads, in the order it reads them."""
  found = []
  for root, dirs, names in os.walk(path):
    dirs[:] = sorted(d for d in dirs if not d.startswith("."))
    for n in sorted(names):
      if not n.startswith(".") and n.lower().endswith(TEXT_SUFFIXES):
        found.append(os.path.join(root, n))
  return found


def _load_text_folder(path: str, cfg: DataConfig) -> _Source:
  found = _text_folder_files(path)
  if not found:
    raise DataError(f"data folder {path!r} has no text files ({', '.join(TEXT_SUFFIXES)}): add "
                    f"some, or name a .bin file directly")
  files = []
  for f in found:
    raw = _read_bytes(f)
    if raw:
      files.append(_text_documents(raw))
  if not files:
    raise DataError(f"every text file in data folder {path!r} is empty: give files with text")
  return _filter_text(path, "text", files, cfg)


def _load_bin(path: str, cfg: DataConfig, vocab_size: int) -> _Source:
  try:
    size = os.path.getsize(path)
    with open(path, "rb"):
      pass
  except OSError as e:
    raise DataError(f"cannot read data file {path!r} ({e.strerror or e}): check its permissions"
                    ) from None
  if size == 0:
    raise DataError(f"data file {path!r} is empty: give a nanoGPT uint16 token file")
  if size % 2:
    raise DataError(f"data file {path!r} has an odd byte count ({size}) so it is not a uint16 "
                    f"token file: re-export it as nanoGPT-style uint16 tokens")
  tokens = np.memmap(path, dtype=np.uint16, mode="r")
  n = int(tokens.size)
  n_docs = -(-n // BIN_DOC_TOKENS)
  keep = np.ones(n_docs, bool)
  max_token = None
  if cfg.filter_max_repeat > 0:
    max_token = 0
    for start in range(0, n, _BIN_BLOCK):
      block = np.asarray(tokens[start:start + _BIN_BLOCK])
      max_token = max(max_token, int(block.max()))
      pos = np.arange(block.size)
      is_break = np.ones(block.size, bool)
      is_break[1:] = (block[1:] != block[:-1]) | (pos[1:] % BIN_DOC_TOKENS == 0)
      starts = np.flatnonzero(is_break)
      lengths = np.diff(np.append(starts, block.size))
      longest = np.zeros(-(-block.size // BIN_DOC_TOKENS), np.int64)
      np.maximum.at(longest, starts // BIN_DOC_TOKENS, lengths)
      keep[start // BIN_DOC_TOKENS: start // BIN_DOC_TOKENS + longest.size] = (
          longest <= cfg.filter_max_repeat)
    if max_token >= vocab_size:
      raise DataError(f"data file {path!r} holds token id {max_token} >= vocab size "
                      f"{vocab_size}: set data.vocab_size (and model.vocab_size) above it")
  ranges: list[tuple[int, int]] = []
  for i in np.flatnonzero(keep):
    begin, end = int(i) * BIN_DOC_TOKENS, min(n, (int(i) + 1) * BIN_DOC_TOKENS)
    if ranges and ranges[-1][1] == begin:
      ranges[-1] = (ranges[-1][0], end)
    else:
      ranges.append((begin, end))
  dropped = int(n_docs - keep.sum())
  stats = dict(name=path, kind="bin", files=1, documents=n_docs, kept=n_docs - dropped,
               dropped_repeat=dropped, dropped_nontext=0, tokens=int(sum(e - s for s, e in ranges)),
               max_token=max_token)
  if not ranges:
    raise DataError(f"every chunk of {path!r} was dropped by the repeat filter: check the data "
                    f"or raise data.filter_max_repeat")
  return _Source(path, "bin", tokens, ranges, stats)


def _load(entry: str, cfg: DataConfig, key: str, bin_vocab: int) -> _Source:
  if entry == EMBEDDED:
    return _load_pydoc(cfg)
  path = os.path.expanduser(entry)
  if not os.path.exists(path):
    raise DataError(f"data.{key}: {entry!r} does not exist: check the path, or use "
                    f"\"{EMBEDDED}\" for the embedded corpus")
  if os.path.isdir(path):
    return _load_text_folder(path, cfg)
  if path.lower().endswith(BIN_SUFFIX):
    return _load_bin(path, cfg, bin_vocab)
  return _load_text_file(path, cfg)


def read_prepared(path: str) -> Optional[dict]:
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


def prepared_vocab_size(entry: Any) -> Optional[int]:
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


def _stat_record(st: os.stat_result) -> dict:
  """What a file's status says about its content: a rewrite, a copy or a rename changes one of
  them (ctime cannot be set by hand)."""
  return {"ino": st.st_ino, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns}


_SCANNED: dict[tuple, dict] = {}  # (path, size, stat record, dtype) -> scan_tokens result


def scan_tokens(path: str | os.PathLike, dtype: Any = np.uint16) -> dict:
  """One pass over a token file: ``{"bytes", "sha256", "max_token"}`` (-1 for an empty file).

  Read in 16 MiB blocks (memory does not grow with the file); a file unchanged since it was last
  scanned in this process (same size and status) is not read again.
  """
  path = os.path.realpath(os.fspath(path))
  dtype = np.dtype(dtype)
  st = os.stat(path)
  key = (path, st.st_size, tuple(_stat_record(st).values()), dtype.str)
  if key not in _SCANNED:
    digest, top = hashlib.sha256(), -1
    block = bytearray(_READ_BLOCK - _READ_BLOCK % dtype.itemsize)
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
  if (record.get("stat") == _stat_record(st) and isinstance(record.get("sha256"), str)
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


def _load_prepared(path: str, meta: dict, cfg: DataConfig) -> tuple[list, _Source]:
  """(train sources, one per prepared input; the validation source) of a prepared directory."""
  vocab_size = int(meta["vocab_size"])
  for name in ("train.bin", "val.bin"):
    top = prepared_file(path, meta, name)["max_token"]
    if top >= vocab_size:
      raise DataError(f"{os.path.join(path, name)} holds token id {top} >= vocab size "
                      f"{vocab_size} of its meta.json: the file and meta.json do not belong "
                      f"together; prepare the directory again")
  dtype = np.dtype(meta["dtype"])
  train_tokens = np.memmap(os.path.join(path, "train.bin"), dtype=dtype, mode="r") \
      if meta["train_tokens"] else np.zeros(0, dtype)
  val_tokens = np.memmap(os.path.join(path, "val.bin"), dtype=dtype, mode="r") \
      if meta["val_tokens"] else np.zeros(0, dtype)
  sources = []
  for src in meta["sources"]:
    s, e = src["train_range"]
    if e > s:
      stats = dict(name=f"{path}:{src['input']}", kind="prepared", files=1,
                   documents=src["train_documents"], kept=src["train_documents"],
                   dropped_repeat=src["dropped_repeat"], dropped_nontext=src["dropped_nontext"],
                   tokens=e - s, weight=src.get("weight"))
      sources.append(_Source(stats["name"], "prepared", train_tokens, [(s, e)], stats))
  if not sources:
    raise DataError(f"prepared directory {path!r} has no training tokens: prepare it with a "
                    f"lower --val-fraction")
  if not meta["val_tokens"]:
    raise DataError(f"prepared directory {path!r} has no validation tokens: prepare it with a "
                    f"higher --val-fraction")
  val_stats = dict(name=os.path.join(path, "val.bin"), kind="prepared", files=1,
                   documents=meta["val_documents"], kept=meta["val_documents"], dropped_repeat=0,
                   dropped_nontext=0, tokens=int(meta["val_tokens"]))
  val = _Source(val_stats["name"], "prepared", val_tokens, [(0, int(meta["val_tokens"]))],
                val_stats)
  return sources, val


def _split_tail(ranges: list, n_tail: int) -> tuple[list, list]:
  """Splits usable ranges into (head, tail) where the tail holds the last n_tail tokens."""
  head, remaining = list(ranges), n_tail
  tail: list = []
  while remaining > 0 and head:
    s, e = head.pop()
    if e - s <= remaining:
      tail.insert(0, (s, e))
      remaining -= e - s
    else:
      tail.insert(0, (e - remaining, e))
      head.append((s, e - remaining))
      remaining = 0
  return head, tail


def _window_table(ranges: list, window: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(range starts, range ends, cumulative window counts) for non-overlapping window slots."""
  starts = np.array([s for s, _ in ranges], np.int64)
  ends = np.array([e for _, e in ranges], np.int64)
  counts = (ends - starts) // window
  return starts, ends, np.cumsum(counts)


# ----------------------------------------------------------------------------- pipeline


class _WindowReader:
  """Maps a window slot index (+ jitter) to its token window; picklable for grain workers."""

  def __init__(self, tokens: np.ndarray, ranges: list, window: int):
    self.tokens = tokens
    self.window = window
    self.starts, self.ends, self.cum = _window_table(ranges, window)
    self.num_windows = int(self.cum[-1]) if self.cum.size else 0

  def start_of(self, slot: int, jitter: int) -> int:
    r = int(np.searchsorted(self.cum, slot, side="right"))
    k = slot - (int(self.cum[r - 1]) if r else 0)
    start = int(self.starts[r]) + k * self.window + jitter
    return min(start, int(self.ends[r]) - self.window)

  def read(self, start: int) -> np.ndarray:
    return np.asarray(self.tokens[start:start + self.window], dtype=np.int32)


class Data:
  """Training and validation data built by ``build_data``.

  Attributes:
    vocab_size: 256 for byte-level text, ``DataConfig.vocab_size`` or 50304 for ``.bin`` data.
    stats: ``{"sources": [per-source dict], "train_tokens", "val_tokens", "weights",
      "batch_size", "local_batch_size", "seq_len"}``; each source dict has name, kind, files,
      documents, kept, dropped_repeat, dropped_nontext, tokens, train_tokens, val_tokens.
  """

  def __init__(self, *, vocab_size: int, stats: dict, train_dataset: grain.MapDataset,
               val_readers: list, batch_size: int, process_index: int, process_count: int,
               num_threads: int):
    self.vocab_size = vocab_size
    self.stats = stats
    self.train_dataset = train_dataset
    self._val_readers = val_readers
    self._batch_size = batch_size
    self._process_index = process_index
    self._process_count = process_count
    self._num_threads = num_threads

  def train_iter(self) -> grain.DatasetIterator:
    """A fresh Grain iterator over this process's training batches, from the first batch.

    Yields ``{"tokens": int32 [batch_size // process_count, seq_len + 1]}`` forever. Its state
    is ``{"next_index": batches consumed}`` (``get_state``/``set_state``); setting a larger
    ``next_index`` skips batches.
    """
    if self._num_threads > 0:
      opts = grain.ReadOptions(num_threads=self._num_threads,
                               prefetch_buffer_size=2 * self._num_threads)
    else:
      opts = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
    return iter(self.train_dataset.to_iter_dataset(opts))

  def val_batches(self, num_batches: int) -> list[dict]:
    """Fixed validation batches (same every call): this process's rows of ``num_batches``
    batches."""
    if num_batches < 1:
      return []
    slots = [(r, k) for r, reader in enumerate(self._val_readers)
             for k in range(reader.num_windows)]
    needed = num_batches * self._batch_size
    if len(slots) >= needed:
      picks = np.linspace(0, len(slots) - 1, needed).round().astype(np.int64)
    else:
      picks = np.arange(needed) % len(slots)
    local = self._batch_size // self._process_count
    batches = []
    for b in range(num_batches):
      rows = picks[b * self._batch_size + self._process_index * local:][:local]
      tokens = np.stack([self._val_readers[slots[i][0]].read(
          self._val_readers[slots[i][0]].start_of(slots[i][1], 0)) for i in rows])
      batches.append({"tokens": tokens})
    return batches


def _seeds(seed: int, index: int) -> tuple[int, int]:
  state = np.random.SeedSequence([int(seed) & 0xFFFFFFFF, index]).generate_state(2)
  return int(state[0]), int(state[1])


def _validate(cfg: DataConfig, seq_len: int, batch_size: int, process_index: int,
              process_count: int) -> None:
  if not isinstance(seq_len, int) or seq_len < 1:
    raise DataError(f"train.seq_len={seq_len!r} is not a positive integer: use e.g. 128")
  if not isinstance(batch_size, int) or batch_size < 1:
    raise DataError(f"train.batch_size={batch_size!r} is not a positive integer: use e.g. 16")
  if process_count < 1 or not 0 <= process_index < process_count:
    raise DataError(f"process_index={process_index} is outside [0, {process_count}): pass "
                    f"jax.process_index() and jax.process_count()")
  if batch_size % process_count:
    raise DataError(f"train.batch_size={batch_size} is not divisible by the {process_count} "
                    f"processes: use a multiple of {process_count}")
  if cfg.val is None and not 0.0 < cfg.val_fraction < 1.0:
    raise DataError(f"data.val_fraction={cfg.val_fraction} is outside (0, 1) and data.val is "
                    f"not given: use e.g. 0.05, or give data.val")
  if cfg.filter_max_repeat < 0:
    raise DataError(f"data.filter_max_repeat={cfg.filter_max_repeat} is negative: use e.g. 256 "
                    f"(0 disables)")
  if not 0.0 <= cfg.filter_max_nontext <= 1.0:
    raise DataError(f"data.filter_max_nontext={cfg.filter_max_nontext} is outside [0, 1]: use "
                    f"e.g. 0.3 (1.0 disables)")
  if cfg.num_threads < 0:
    raise DataError(f"data.num_threads={cfg.num_threads} is negative: use 0 (no threads) or more")
  if cfg.vocab_size < 0:
    raise DataError(f"data.vocab_size={cfg.vocab_size} is negative: use 0 (automatic) or the "
                    f"tokenizer's vocabulary size")


def _check_not_unfinished(entry: str) -> None:
  """A folder without meta.json but with what `prepare` writes is an unfinished prepare."""
  path = os.path.expanduser(entry)
  if not os.path.isdir(path) or os.path.isfile(os.path.join(path, PREPARED_META)):
    return
  if os.path.exists(os.path.join(path, PREPARED_MARKER)):
    raise DataError(f"{entry!r} is an incomplete prepared directory: python -m stablejax prepare "
                    f"was interrupted while writing it ({PREPARED_MARKER} is there, "
                    f"{PREPARED_META} is not): run the same prepare command again")
  bins = [n for n in ("train.bin", "val.bin") if os.path.isfile(os.path.join(path, n))]
  has_text = any(n.lower().endswith(TEXT_SUFFIXES) for _, _, names in os.walk(path) for n in names)
  if bins and not has_text:  # (a folder of text files with a stray .bin is read as text)
    raise DataError(f"{entry!r} holds {' and '.join(bins)} but no {PREPARED_META}, so it is not "
                    f"a complete prepared directory (a prepare that did not finish): run python "
                    f"-m stablejax prepare again; nanoGPT-style token files of your own are read "
                    f"by naming each file (data.train=DIR/train.bin, data.val=DIR/val.bin)")


def _prepared_entry(train_entries: list, val_entries: list) -> Optional[tuple[str, dict]]:
  """(path, meta) when data.train names a prepared directory; checks it stands alone."""
  for entry in train_entries:
    if entry != EMBEDDED:
      _check_not_unfinished(entry)
  found = [(e, m) for e in train_entries for m in [read_prepared(e)] if m is not None]
  if not found:
    return None
  if len(train_entries) != 1:
    raise DataError("data.train lists a prepared directory with other sources: prepare the "
                    "corpora together (python -m stablejax prepare A B --weights ...) and give "
                    "that one directory")
  if val_entries:
    raise DataError(f"data.val is set but data.train={train_entries[0]!r} is a prepared "
                    f"directory, whose val.bin is the validation set: remove data.val")
  return found[0]


def data_tokenizer(cfg: DataConfig) -> Optional[Tokenizer]:
  """The tokenizer of a data config, or None when it cannot be known (plain ``.bin`` files).

  A prepared directory's own tokenizer; byte-level text and ``pydoc`` get the ``bytes``
  tokenizer whose ``start_ids`` (the prompt of an empty sample) is a blank line instead of the
  end-of-text id, which those sources never contain.
  """
  from stablejax.data import tokenizer as tokenizer_lib
  entries = _as_list(cfg.train, "train")
  if len(entries) == 1:
    meta = read_prepared(entries[0])
    if meta is not None:
      tok = tokenizer_lib.from_meta(meta, os.path.expanduser(entries[0]))
      tok.start_ids = [tok.eot_id]
      return tok
  if any(e != EMBEDDED and e.lower().endswith(BIN_SUFFIX) for e in entries):
    return None
  tok = tokenizer_lib.BytesTokenizer()
  tok.start_ids = list(b"\n\n")
  return tok


def _file_sha256(path: str) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    while block := f.read(_READ_BLOCK):
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
  _check_not_unfinished(entry)
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
    found = _text_folder_files(path)
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
    >>> from stablejax.data.pipeline import data_identity, identity_difference
    >>> ident = data_identity("pydoc")
    >>> ident["train"][0]["kind"], len(ident["train"][0]["sha256"])
    ('pydoc', 64)
    >>> identity_difference(ident, data_identity("pydoc")) is None
    True
  """
  if isinstance(data, DataConfig):
    train, val = _as_list(data.train, "train"), _as_list(data.val, "val")
    settings = {k: getattr(data, k) for k in _IDENTITY_SETTINGS}
  else:
    train, val, settings = _as_list(data, "train"), [], {}
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


def build_data(cfg: DataConfig, *, seq_len: int, batch_size: int, seed: int,
               process_index: int = 0, process_count: int = 1) -> Data:
  """Loads, filters and splits the sources and builds the seeded window pipeline.

  Args:
    cfg: the data config.
    seq_len: model sequence length; windows hold ``seq_len + 1`` tokens (inputs + next token).
    batch_size: global batch size (all processes together).
    seed: data seed; the same seed gives the same batches.
    process_index: this host's index (``jax.process_index()``).
    process_count: number of hosts (``jax.process_count()``); each reads
      ``batch_size // process_count`` rows of every global batch.

  Returns:
    A ``Data``.

  Raises:
    DataError: a missing, empty or unreadable source, a folder without text files, a ``.bin``
      file with an odd byte count, a corpus shorter than one window, bad weights.

  Example:
    The embedded corpus, as windows of 64 + 1 byte tokens:

    >>> from stablejax.data.pipeline import DataConfig, build_data
    >>> data = build_data(DataConfig(), seq_len=64, batch_size=4, seed=0)
    >>> data.vocab_size, data.stats["sources"][0]["name"]
    (256, 'pydoc')
    >>> batch = next(data.train_iter())
    >>> batch["tokens"].shape, batch["tokens"].dtype
    ((4, 65), dtype('int32'))
  """
  _validate(cfg, seq_len, batch_size, process_index, process_count)
  window = seq_len + 1
  train_entries = _as_list(cfg.train, "train")
  if not train_entries:
    raise DataError("data.train is empty: give a path or \"pydoc\"")
  val_entries = _as_list(cfg.val, "val")
  all_entries = train_entries + val_entries
  prepared = _prepared_entry(train_entries, val_entries)
  bin_vocab = cfg.vocab_size or DEFAULT_BIN_VOCAB
  is_bin = [e != EMBEDDED and not os.path.isdir(os.path.expanduser(e))
            and e.lower().endswith(BIN_SUFFIX) for e in all_entries]
  if any(is_bin) and not all(is_bin):
    raise DataError("data mixes .bin token files with byte-level text sources, whose token ids "
                    "mean different things: use only one kind")
  vocab_size = bin_vocab if any(is_bin) else (cfg.vocab_size or 256)
  if not any(is_bin) and not prepared and vocab_size < 256:
    raise DataError(f"data.vocab_size={vocab_size} is below 256, too small for byte-level text: "
                    f"use 0 (automatic) or >= 256")

  prepared_val = None
  if prepared:
    path, meta = prepared
    vocab_size = int(meta["vocab_size"])
    if cfg.vocab_size and cfg.vocab_size < vocab_size:
      raise DataError(f"data.vocab_size={cfg.vocab_size} is below the prepared vocabulary "
                      f"{vocab_size} of {path!r}: use 0 (automatic)")
    train, prepared_val = _load_prepared(path, meta, cfg)
  else:
    train = [_load(e, cfg, "train", bin_vocab) for e in train_entries]
  train_ranges, val_ranges = _split(train, prepared_val, val_entries, cfg, window, bin_vocab)
  train_readers = _readers(zip(train, train_ranges), window, "train")
  val_readers = _readers(val_ranges, window, "validation")
  sizes = [sum(e - s for s, e in r) for r in train_ranges]
  weights = _mixing_weights(cfg, train, sizes, prepared_val is not None)
  ds = _train_dataset(train_readers, weights, cfg, seed, batch_size // process_count,
                      process_index, process_count)

  total_w = sum(weights)
  source_stats = []
  for i, src in enumerate(train):
    st = dict(src.stats, train_tokens=sizes[i], weight=weights[i] / total_w)
    if cfg.val is None and prepared_val is None:
      st["val_tokens"] = sum(e - s for s, e in val_ranges[i][1])
    source_stats.append(st)
  separate_val = cfg.val is not None or prepared_val is not None
  stats = dict(
      sources=source_stats,
      val_sources=([dict(s.stats) for s, _ in val_ranges] if separate_val else []),
      train_tokens=int(sum(sizes)),
      val_tokens=int(sum(sum(e - s for s, e in r) for _, r in val_ranges)),
      weights=[w / total_w for w in weights],
      batch_size=batch_size, local_batch_size=batch_size // process_count, seq_len=seq_len)
  return Data(vocab_size=vocab_size, stats=stats, train_dataset=ds, val_readers=val_readers,
              batch_size=batch_size, process_index=process_index, process_count=process_count,
              num_threads=cfg.num_threads)


def _split(train: list, prepared_val: Any, val_entries: list, cfg: DataConfig, window: int,
           bin_vocab: int) -> tuple[list, list]:
  """(each train source's training ranges, [(validation source, its ranges)]): the tail of each
  source held out (``val_fraction``), or the given ``data.val``, or a prepared ``val.bin``."""
  seq_len = window - 1
  train_ranges, val_ranges = [], []
  for src in train:
    if prepared_val is not None:
      train_ranges.append(src.ranges)
    elif cfg.val is None:
      n_val = max(window, math.ceil(src.usable * cfg.val_fraction))
      if src.usable - n_val < window:
        raise DataError(f"data source {src.name!r} has {src.usable} usable tokens, too few to "
                        f"hold out validation windows and still train with seq_len={seq_len}: "
                        f"use more text, a smaller train.seq_len, or give data.val")
      head, tail = _split_tail(src.ranges, n_val)
      train_ranges.append(head)
      val_ranges.append((src, tail))
    else:
      train_ranges.append(src.ranges)
  if prepared_val is not None:
    val_ranges = [(prepared_val, prepared_val.ranges)]
  elif cfg.val is not None:
    val_ranges = [(s, s.ranges) for s in (_load(e, cfg, "val", bin_vocab) for e in val_entries)]
  return train_ranges, val_ranges


def _readers(sources: Any, window: int, split: str) -> list["_WindowReader"]:
  """A window reader per (source, ranges); a source without one whole window is an error."""
  readers = []
  for src, ranges in sources:
    reader = _WindowReader(src.tokens, ranges, window)
    if reader.num_windows == 0:
      what = f"data source {src.name!r}" if split == "train" else f"validation data {src.name!r}"
      usable = "usable train tokens" if split == "train" else "usable tokens"
      raise DataError(f"{what} has {sum(e - s for s, e in ranges)} {usable}, fewer than one "
                      f"window of seq_len+1={window}: use a longer corpus or a smaller "
                      f"train.seq_len")
    readers.append(reader)
  return readers


def _mixing_weights(cfg: DataConfig, train: list, sizes: list[int], prepared: bool
                    ) -> list[float]:
  """``data.weights``, or the prepared sources' recorded weights, or the token counts."""
  if cfg.weights is None and prepared:
    weights = [float(src.stats["weight"] or size) for src, size in zip(train, sizes)]
  elif cfg.weights is None:
    weights = [float(s) for s in sizes]
  else:
    weights = [float(w) for w in cfg.weights]
    if len(weights) != len(train):
      raise DataError(f"data.weights has {len(weights)} entries but data.train has "
                      f"{len(train)} sources: give one weight per source")
    if not all(math.isfinite(w) and w > 0 for w in weights):
      raise DataError(f"data.weights={cfg.weights} has a non-positive or non-finite entry: give "
                      f"positive numbers")
  return weights


def _train_dataset(train_readers: list, weights: list[float], cfg: DataConfig, seed: int,
                   local: int, process_index: int, process_count: int) -> grain.MapDataset:
  """Seeded, shuffled, jittered windows of every source, mixed by ``weights``, in batches of
  this process's ``local`` rows (each process reads its own rows of every global batch)."""
  per_source = []
  for i, reader in enumerate(train_readers):
    shuffle_seed, jitter_seed = _seeds(seed, i)

    def to_window(slot: int, rng: np.random.Generator, reader: _WindowReader = reader) -> dict:
      start = reader.start_of(int(slot), int(rng.integers(0, reader.window)))
      return {"tokens": reader.read(start)}

    ds = (grain.MapDataset.range(reader.num_windows)
          .shuffle(seed=shuffle_seed)
          .repeat()
          .random_map(to_window, seed=jitter_seed))
    per_source.append(ds)
  ds = per_source[0] if len(per_source) == 1 else grain.MapDataset.mix(per_source, weights)
  if cfg.shuffle_buffer > 1:
    buffer_seed, _ = _seeds(seed, len(per_source) + 1)
    ds = WindowShuffleMapDataset(ds, window_size=int(cfg.shuffle_buffer), seed=buffer_seed)
  ds = ds.batch(local, drop_remainder=True)
  if process_count > 1:
    ds = ds[process_index::process_count]
  return ds


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
