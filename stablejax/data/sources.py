"""The trainer's data sources, read into token arrays, and the document filter they pass.

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
    :func:`stablejax.data.prepared.prepared_file`) or hold a token id at or above its vocabulary.

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
``filter_max_repeat=0`` skips it. ``python -m stablejax prepare`` filters its documents with the
same measures (`max_run`, `nontext_fraction`).
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Optional

import numpy as np

from stablejax.data import tokenizer as tokenizer_lib
from stablejax.data.config import EMBEDDED, DataConfig, DataError, source_entries
from stablejax.data.prepared import PREPARED_MARKER, PREPARED_META, prepared_file, read_prepared

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".text")
BIN_SUFFIX = ".bin"
DEFAULT_BIN_VOCAB = 50304
TEXT_DOC_BYTES = 1 << 16
BIN_DOC_TOKENS = 1 << 16
_BIN_BLOCK = 1 << 24       # tokens per block in the .bin filter pass (multiple of BIN_DOC_TOKENS)

# Control bytes other than \t \n \v \f \r, and DEL.
_CONTROL = np.zeros(256, bool)
_CONTROL[list(range(0, 9)) + list(range(14, 32)) + [127]] = True
_SURROGATE = re.compile("[\udc80-\udcff]")
_PARAGRAPH = re.compile(rb".*?(?:\n[ \t\r\f\v]*\n\s*|\Z)", re.S)


@dataclasses.dataclass
class Source:
  """One source's tokens and the ranges of them that training and validation may use."""
  name: str
  kind: str                  # "pydoc" | "text" | "bin" | "prepared"
  tokens: np.ndarray         # uint8 (text), a uint16 memmap (.bin) or the prepared dtype's
  ranges: list[tuple[int, int]]  # usable [start, end) ranges after filtering
  stats: dict

  @property
  def usable(self) -> int:
    return int(sum(e - s for s, e in self.ranges))


# ----------------------------------------------------------------------------- the filter


def max_run(a: np.ndarray) -> int:
  """The longest run of one repeated value in ``a`` (0 when empty)."""
  if a.size == 0:
    return 0
  breaks = np.flatnonzero(a[1:] != a[:-1])
  bounds = np.concatenate([[-1], breaks, [a.size - 1]])
  return int(np.diff(bounds).max())


def invalid_utf8_bytes(raw: bytes) -> int:
  """How many bytes of ``raw`` are not part of valid UTF-8."""
  return len(_SURROGATE.findall(raw.decode("utf-8", errors="surrogateescape")))


def nontext_fraction(doc: bytes) -> float:
  """The share of ``doc``'s bytes that are control bytes (not whitespace) or invalid UTF-8."""
  if not doc:
    return 0.0
  a = np.frombuffer(doc, np.uint8)
  control = int(_CONTROL[a].sum())
  invalid = invalid_utf8_bytes(doc)
  return (control + invalid) / len(doc)


# ----------------------------------------------------------------------------- sources


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


def _filter_text(name: str, kind: str, files: list[list[bytes]], cfg: DataConfig) -> Source:
  """Filters documents (grouped per file) and concatenates the kept ones."""
  kept, n_docs, drop_repeat, drop_nontext = [], 0, 0, 0
  bytes_in = 0
  for docs in files:
    file_kept = []
    for doc in docs:
      n_docs += 1
      bytes_in += len(doc)
      a = np.frombuffer(doc, np.uint8)
      if cfg.filter_max_repeat > 0 and max_run(a) > cfg.filter_max_repeat:
        drop_repeat += 1
      elif cfg.filter_max_nontext < 1.0 and nontext_fraction(doc) > cfg.filter_max_nontext:
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
  return Source(name, kind, tokens, [(0, int(tokens.size))], stats)


def _load_pydoc(cfg: DataConfig) -> Source:
  try:
    from pydoc_data.topics import topics  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise DataError("the embedded corpus needs CPython's pydoc_data module, which this Python "
                    "lacks: point data.train at a text file instead") from None
  files = [[(topics[k].rstrip("\n") + "\n\n").encode("utf-8")] for k in sorted(topics)]
  return _filter_text(EMBEDDED, "pydoc", files, cfg)


def _load_text_file(path: str, cfg: DataConfig) -> Source:
  raw = _read_bytes(path)
  if not raw:
    raise DataError(f"data file {path!r} is empty: give a file with text in it")
  return _filter_text(path, "text", [_text_documents(raw)], cfg)


def text_folder_files(path: str) -> list[str]:
  """The text files of a folder the trainer reads, in the order it reads them."""
  found = []
  for root, dirs, names in os.walk(path):
    dirs[:] = sorted(d for d in dirs if not d.startswith("."))
    for n in sorted(names):
      if not n.startswith(".") and n.lower().endswith(TEXT_SUFFIXES):
        found.append(os.path.join(root, n))
  return found


def _load_text_folder(path: str, cfg: DataConfig) -> Source:
  found = text_folder_files(path)
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


def _load_bin(path: str, cfg: DataConfig, vocab_size: int) -> Source:
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
  return Source(path, "bin", tokens, ranges, stats)


def load_source(entry: str, cfg: DataConfig, key: str, bin_vocab: int) -> Source:
  """One entry of ``data.<key>`` (not a prepared directory), filtered; ``.bin`` files get
  ``bin_vocab``."""
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


# ----------------------------------------------------------------------------- prepared directories


def check_not_unfinished(entry: str) -> None:
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


def prepared_entry(train_entries: list[str], val_entries: list[str]
                   ) -> Optional[tuple[str, dict]]:
  """(path, meta) when data.train names a prepared directory; checks it stands alone."""
  for entry in train_entries:
    if entry != EMBEDDED:
      check_not_unfinished(entry)
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


def load_prepared(path: str, meta: dict) -> tuple[list[Source], Source]:
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
      sources.append(Source(stats["name"], "prepared", train_tokens, [(s, e)], stats))
  if not sources:
    raise DataError(f"prepared directory {path!r} has no training tokens: prepare it with a "
                    f"lower --val-fraction")
  if not meta["val_tokens"]:
    raise DataError(f"prepared directory {path!r} has no validation tokens: prepare it with a "
                    f"higher --val-fraction")
  val_stats = dict(name=os.path.join(path, "val.bin"), kind="prepared", files=1,
                   documents=meta["val_documents"], kept=meta["val_documents"], dropped_repeat=0,
                   dropped_nontext=0, tokens=int(meta["val_tokens"]))
  val = Source(val_stats["name"], "prepared", val_tokens, [(0, int(meta["val_tokens"]))],
               val_stats)
  return sources, val


def data_tokenizer(cfg: DataConfig) -> Optional[tokenizer_lib.Tokenizer]:
  """The tokenizer of a data config, or None when it cannot be known (plain ``.bin`` files).

  A prepared directory's own tokenizer; byte-level text and ``pydoc`` get the ``bytes``
  tokenizer whose ``start_ids`` (the prompt of an empty sample) is a blank line instead of the
  end-of-text id, which those sources never contain.
  """
  entries = source_entries(cfg.train, "train")
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
