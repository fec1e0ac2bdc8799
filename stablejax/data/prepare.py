"""Prepare a corpus for the trainer: documents -> tokens -> ``train.bin``, ``val.bin``, meta.json.

    python -m stablejax prepare INPUT... --out DIR --tokenizer T [--weights W...] [--workers N]

After nanoGPT's ``data/openwebtext/prepare.py``, as a tool (the command line is
:mod:`stablejax.cli.prepare`; this module is the library it runs, :func:`prepare`). Then
``python -m stablejax train --set data.train=DIR`` trains on it and
``python -m stablejax sample RUN_DIR`` samples with its tokenizer.

INPUT (several mix; ``--weights`` gives their sampling weights, default: their token counts):
  * a text file (any name; ``.gz`` is read compressed): documents are separated by the string
    ``<|endoftext|>`` (the convention of OpenWebText and TinyStories text dumps; change with
    ``--separator``); a file without it is one document;
  * ``.jsonl`` / ``.json`` (JSON Lines, or one JSON array of objects): one document per record,
    its ``--text-field`` (default ``text``);
  * ``.parquet``: one document per row of the ``--text-field`` column, read a batch at a time;
  * a folder: every such file in it, recursively, in sorted order;
  * ``pydoc``: the embedded corpus (Python's documentation topics, one document each);
  * ``hf:NAME[:CONFIG]``: a Hugging Face dataset through ``datasets.load_dataset(NAME, CONFIG,
    split=--hf-split, streaming=True)``; NAME may be a hub name or a local folder of
    JSON/Parquet/CSV files (the library's own idiom for local data).

T: ``bytes``, ``gpt2``, a ``tokenizer.json`` path, or ``bpe:N`` (a byte-level BPE of vocabulary
N trained here with Hugging Face ``tokenizers`` on the training split of all inputs, saved as
``DIR/tokenizer.json``). See ``stablejax.data.tokenizer``.

Output: every document's tokens followed by the end-of-text id, in ``DIR/train.bin`` or
``DIR/val.bin`` (flat ``uint16`` arrays when the vocabulary fits, else ``uint32``), and
``DIR/meta.json`` (tokenizer, vocab_size, eot_id, dtype, token and document counts per split and
per source with each source's token range, weights, the split rule, the filter, the request, the
files written). Document text is encoded as ordinary text with every tokenizer: a literal
``<|endoftext|>`` inside a JSON/Parquet document stays text, and the end-of-text id appears only
where this tool puts it (a tokenizer.json whose end-of-text token text can produce is refused).
A document goes to validation when the first 8 bytes of the BLAKE2b hash of its UTF-8 text,
read as a little-endian integer, fall below ``--val-fraction`` x 2^64: deterministic, independent
of order and worker count, and duplicates land on the same side. An input none of whose
documents lands in the training split is an error (the trainer would never see it). Documents are
filtered like the trainer's text (``--filter-max-repeat``, ``--filter-max-nontext``; counts in
meta.json).

Streaming: documents are read, tokenized in ``--workers`` processes (1: in this process) and
appended to the output a batch at a time, with a bounded number of batches in flight, so memory
does not grow with the corpus (one document is held whole while it is tokenized).

The directory: one prepare at a time holds ``DIR``'s lock (:mod:`stablejax.data.folder`); a
second one into the same DIR is an error naming the first, and touches nothing. This tool
replaces or removes only files it wrote, which its ``meta.json`` names (or ``meta.json.partial``,
its record of the run in progress, written first and removed last). Another file under a name it
writes (``train.bin``, ``val.bin``, ``tokenizer.json``, ``meta.json``, ``meta.json.partial``), or
one of its files that changed since it wrote it (not the size or SHA-256 its ``meta.json``
records), is refused unless ``--force``; other files in DIR are never touched. The tokenizer
file being read is never removed: ``--tokenizer DIR/tokenizer.json --out DIR`` uses it in place.
New files are written under names of this run's own (``NAME.<pid>-<random>.partial``, so no
other process ever writes, renames or removes them); a corpus already in DIR stays usable until
the new one is complete, then the old ``meta.json`` goes, the new files are renamed into place,
``meta.json`` is written with each file's size, SHA-256, largest token id and status, and the
record of the run goes last: the trainer accepts a directory only with a ``meta.json`` that
matches the files, and calls one with ``meta.json.partial`` and no ``meta.json`` incomplete. A
complete directory prepared with the same request is not redone; one prepared differently is an
error unless ``--force``. A run that fails removes its files, and ``DIR`` too when it created it
and no corpus is there. Interrupted (``check_stop`` raising, which the command line does on
SIGINT, SIGTERM or SIGHUP; or Ctrl-C in a Python session), with any ``--workers``: the workers
ignore the signals and are stopped by this process, the files of this run are removed and the
command exits 130; a killed run's files are recognised and replaced by the next run.

Invalid UTF-8 in text files (and lone surrogates in JSON strings) becomes U+FFFD; meta.json
counts it (``invalid_utf8``, also per input) and the summary says so.

Exit codes: 0 done (or already done); 2 bad input (missing, empty, truncated or non-gzip ``.gz``
file, unknown field, unreadable Parquet, unknown or unavailable tokenizer, vocabulary too large for
the dtype, an empty ``--separator``, ``--val-fraction`` outside (0, 1), an input entirely in
validation, an input given twice, ``--out`` naming a file or inside an input folder, files of
another program or another corpus in the way), DIR in use by another prepare, DIR not writable
(read-only, disk full); 130 interrupted (this run's files removed).

Example::

    python -m stablejax prepare pydoc --out data/pydoc_bpe --tokenizer bpe:2048 --val-fraction 0.05
    python -m stablejax prepare owt_train.txt --out data/owt --tokenizer bpe:32000 --workers 8
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import gzip
import hashlib
import json
import multiprocessing
import os
import re
import secrets
import signal
import socket
import sys
import time
import zlib
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import numpy as np
from tqdm import tqdm

from stablejax.data import tokenizer as tokenizer_lib
from stablejax.data.folder import FolderBusy, FolderLock
from stablejax.data.pipeline import (_SURROGATE, EMBEDDED, PREPARED_FORMAT, PREPARED_MARKER,
                                     PREPARED_META, DataError, _max_run, _nontext_fraction,
                                     _stat_record, prepared_file, read_prepared)

TEXT_FIELD = "text"
SEPARATOR = tokenizer_lib.EOT_TEXT
JSON_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")
PARQUET_SUFFIXES = (".parquet",)
TEXT_SUFFIXES = (".txt", ".text", ".md", ".rst", ".txt.gz")
BATCH_BYTES = 1 << 20          # documents per task: about this much text
BATCH_DOCS = 4096
PARTIAL = ".partial"


class PrepareError(Exception):
  """Bad input; the message is one line naming the problem and the fix."""


@dataclasses.dataclass
class Options:
  text_field: str = TEXT_FIELD
  separator: str = SEPARATOR
  hf_split: str = "train"
  val_fraction: float = 0.005
  filter_max_repeat: int = 256
  filter_max_nontext: float = 0.3


# ----------------------------------------------------------------------------- documents


def _need(module: str, what: str) -> Any:
  try:
    return __import__(module)
  except ImportError:
    raise PrepareError(f"{what} needs the {module} package: pip install 'stablejax[data]'"
                       ) from None


def _open(path: Path, mode: str = "rb") -> Any:
  return gzip.open(path, mode) if path.name.endswith(".gz") else open(path, mode)


# What reading a damaged file raises: gzip.BadGzipFile (an OSError) for a file that is not gzip,
# EOFError for a truncated one, zlib.error for corrupt compressed data, OSError for the rest.
_READ_ERRORS = (OSError, EOFError, zlib.error)


def _read_error(path: Path, e: BaseException) -> PrepareError:
  detail = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else 'no detail'}"
  if path.name.endswith(".gz"):
    return PrepareError(f"{path}: not a complete gzip file ({detail}): download it again, or "
                        f"give the uncompressed file (without .gz)")
  return PrepareError(f"{path}: cannot read ({detail}): check the file and its permissions")


def _text_documents(path: Path, opts: Options) -> Iterator[bytes]:
  """Documents of a text file, split on the separator while streaming 1 MiB blocks."""
  sep = opts.separator.encode("utf-8")
  pending: list[bytes] = []
  try:
    with _open(path) as f:
      while True:
        block = f.read(1 << 20)
        if not block:
          break
        tail = pending[-1][1 - len(sep):] if pending else b""
        pending.append(block)
        if sep not in tail + block:  # no separator ends in this block: keep reading
          continue
        parts = b"".join(pending).split(sep)
        pending = [parts.pop()]
        yield from parts
  except _READ_ERRORS as e:
    raise _read_error(path, e) from None
  yield b"".join(pending)


def _record_text(record: Any, opts: Options, where: str) -> Optional[str]:
  if not isinstance(record, dict):
    raise PrepareError(f"{where}: expected a JSON object with a {opts.text_field!r} field, got "
                       f"{type(record).__name__}: give JSON Lines of objects")
  if opts.text_field not in record:
    keys = ", ".join(list(record)[:10])
    raise PrepareError(f"{where}: no field {opts.text_field!r} (fields: {keys}): pass "
                       f"--text-field with one of them")
  value = record[opts.text_field]
  if value is None:
    return None
  if not isinstance(value, str):
    raise PrepareError(f"{where}: field {opts.text_field!r} holds {type(value).__name__}, not "
                       f"text: pass --text-field naming a text field")
  return value


def _json_documents(path: Path, opts: Options) -> Iterator[str]:
  try:
    with _open(path) as f:
      head = f.read(4096).lstrip()
  except _READ_ERRORS as e:
    raise _read_error(path, e) from None
  if head.startswith(b"["):  # one JSON array: read whole (JSON Lines is the streaming format)
    try:
      with _open(path) as f:
        records = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise PrepareError(f"{path}: not valid JSON ({e}): fix the file or convert it to JSON "
                         f"Lines") from None
    except _READ_ERRORS as e:
      raise _read_error(path, e) from None
    for i, record in enumerate(records):
      text = _record_text(record, opts, f"{path} record {i}")
      if text is not None:
        yield text
    return
  try:
    with _open(path) as f:
      for lineno, line in enumerate(f, 1):
        if not line.strip():
          continue
        try:
          record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
          raise PrepareError(f"{path}:{lineno}: not a JSON object ({e}): fix the line or remove "
                             f"it") from None
        text = _record_text(record, opts, f"{path}:{lineno}")
        if text is not None:
          yield text
  except _READ_ERRORS as e:
    raise _read_error(path, e) from None


def _parquet_documents(path: Path, opts: Options) -> Iterator[str]:
  _need("pyarrow", "reading .parquet files")
  import pyarrow.parquet as pq
  try:
    pf = pq.ParquetFile(path)
  except Exception as e:  # noqa: BLE001 - ArrowInvalid, OSError, ...
    raise PrepareError(f"{path}: unreadable Parquet file ({type(e).__name__}: "
                       f"{str(e).splitlines()[0][:160]}): check the file") from None
  names = pf.schema_arrow.names
  if opts.text_field not in names:
    raise PrepareError(f"{path}: no column {opts.text_field!r} (columns: {', '.join(names[:10])}): "
                       f"pass --text-field with one of them")
  try:
    for batch in pf.iter_batches(batch_size=1024, columns=[opts.text_field]):
      for value in batch.column(0).to_pylist():
        if value is not None:
          if not isinstance(value, str):
            raise PrepareError(f"{path}: column {opts.text_field!r} holds "
                               f"{type(value).__name__}, not text: pass --text-field naming a "
                               f"text column")
          yield value
  except PrepareError:
    raise
  except Exception as e:  # noqa: BLE001
    raise PrepareError(f"{path}: unreadable Parquet data ({type(e).__name__}: "
                       f"{str(e).splitlines()[0][:160]}): check the file") from None


def _hf_documents(spec: str, opts: Options) -> Iterator[str]:
  datasets = _need("datasets", f"{spec!r}")
  name, _, config = spec[3:].partition(":")
  try:
    ds = datasets.load_dataset(name, config or None, split=opts.hf_split, streaming=True)
    features = getattr(ds, "features", None)
    if features is not None and opts.text_field not in features:
      raise PrepareError(f"{spec}: no field {opts.text_field!r} (fields: "
                         f"{', '.join(list(features)[:10])}): pass --text-field with one of them")
    for i, record in enumerate(ds):
      text = _record_text(record, opts, f"{spec} record {i}")
      if text is not None:
        yield text
  except PrepareError:
    raise
  except Exception as e:  # noqa: BLE001 - network, hub and format errors all end here
    first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
    raise PrepareError(f"cannot load Hugging Face dataset {spec[3:]!r} ({type(e).__name__}: "
                       f"{first}): check the name and config, the network, or give local files"
                       ) from None


def _kind(path: Path) -> str:
  name = path.name.lower()
  if name.endswith(JSON_SUFFIXES):
    return "json"
  if name.endswith(PARQUET_SUFFIXES):
    return "parquet"
  return "text"


def _folder_files(path: Path) -> list[Path]:
  found = []
  for root, dirs, names in os.walk(path):
    dirs[:] = sorted(d for d in dirs if not d.startswith("."))
    for n in sorted(names):
      if not n.startswith(".") and n.lower().endswith(JSON_SUFFIXES + PARQUET_SUFFIXES
                                                      + TEXT_SUFFIXES):
        found.append(Path(root) / n)
  return found


def input_files(entry: str) -> list[Path]:
  """The files an INPUT names ([] for ``pydoc`` and ``hf:``); checks they exist and hold data."""
  if entry == EMBEDDED or entry.startswith("hf:"):
    return []
  path = Path(entry).expanduser()
  if not path.exists():
    raise PrepareError(f"input {entry!r} does not exist: give a text, .jsonl, .json or .parquet "
                       f"file, a folder of them, \"pydoc\" or hf:NAME")
  if path.is_dir():
    files = _folder_files(path)
    if not files:
      raise PrepareError(f"input folder {entry!r} has no .txt/.jsonl/.json/.parquet files: add "
                         f"some or name the files directly")
  else:
    files = [path]
  for f in files:
    try:
      size = f.stat().st_size
      with open(f, "rb"):
        pass
    except OSError as e:
      raise PrepareError(f"cannot read input {str(f)!r} ({e.strerror or e}): check its "
                         f"permissions") from None
    if size == 0:
      raise PrepareError(f"input file {str(f)!r} is empty: remove it or give a file with text")
  return files


def iter_documents(entry: str, opts: Options) -> Iterator[str | bytes]:
  """The documents of one INPUT, streamed: ``str`` (JSON, Parquet, datasets) or ``bytes`` (text)."""
  if entry == EMBEDDED:
    from pydoc_data.topics import topics
    for key in sorted(topics):
      yield topics[key]
    return
  if entry.startswith("hf:"):
    yield from _hf_documents(entry, opts)
    return
  for path in input_files(entry):
    kind = _kind(path)
    if kind == "json":
      yield from _json_documents(path, opts)
    elif kind == "parquet":
      yield from _parquet_documents(path, opts)
    else:
      yield from _text_documents(path, opts)


# ----------------------------------------------------------------------------- per document


def _as_text(doc: str | bytes) -> tuple[str, bytes, int]:
  """(text, UTF-8 bytes, count of invalid UTF-8 bytes or lone surrogates replaced by U+FFFD)."""
  if isinstance(doc, bytes):
    raw = doc.strip()
    try:
      return raw.decode("utf-8"), raw, 0
    except UnicodeDecodeError:
      invalid = len(_SURROGATE.findall(raw.decode("utf-8", "surrogateescape")))
      return raw.decode("utf-8", "replace"), raw, invalid
  text = doc.strip()
  try:
    return text, text.encode("utf-8"), 0
  except UnicodeEncodeError:  # lone surrogates from JSON escapes
    invalid = len(_LONE_SURROGATE.findall(text))
    text = _LONE_SURROGATE.sub("\ufffd", text)
    return text, text.encode("utf-8"), invalid


def is_val(raw: bytes, val_fraction: float) -> bool:
  """The split rule: BLAKE2b-64 of the document's UTF-8 bytes below val_fraction x 2^64."""
  h = int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")
  return h < val_fraction * 2.0**64


def _classify(raw: bytes, opts: Options) -> str:
  """'empty', 'repeat', 'nontext', 'train' or 'val' for one document."""
  if not raw:
    return "empty"
  if opts.filter_max_repeat > 0 and _max_run(np.frombuffer(raw, np.uint8)) > opts.filter_max_repeat:
    return "repeat"
  if opts.filter_max_nontext < 1.0 and _nontext_fraction(raw) > opts.filter_max_nontext:
    return "nontext"
  return "val" if is_val(raw, opts.val_fraction) else "train"


_WORKER_TOKENIZER: dict[tuple, tokenizer_lib.Tokenizer] = {}


def _load_tokenizer(spec: tuple) -> tokenizer_lib.Tokenizer:
  if spec not in _WORKER_TOKENIZER:
    kind, arg, eot = spec
    tok = tokenizer_lib.HFTokenizer(arg, eot) if kind == "file" else \
        tokenizer_lib.get_tokenizer(arg, eot)
    _WORKER_TOKENIZER.clear()
    _WORKER_TOKENIZER[spec] = tok
  return _WORKER_TOKENIZER[spec]


def encode_batch(task: tuple) -> dict:
  """Filters, splits and tokenizes one batch of documents (runs in a worker process)."""
  docs, tok_spec, opts, dtype = task
  tok = _load_tokenizer(tok_spec)
  counts: collections.Counter[str] = collections.Counter()
  texts: dict[str, list[str]] = {"train": [], "val": []}
  for doc in docs:
    text, raw, invalid = _as_text(doc)
    counts["bytes"] += len(raw)
    label = _classify(raw, opts)
    counts[label] += 1
    if label in texts:
      texts[label].append(text)
      counts[f"{label}_bytes"] += len(raw)
      if invalid:
        counts["invalid_utf8_documents"] += 1
        counts["invalid_utf8_bytes"] += invalid
  out: dict[str, Any] = {"counts": counts}
  for split, batch in texts.items():
    ids = tok.encode_batch(batch) if batch else []
    lengths = [len(x) + 1 for x in ids]
    arr = np.empty(sum(lengths), dtype)
    pos = 0
    for x, n in zip(ids, lengths):
      arr[pos:pos + n - 1] = x
      arr[pos + n - 1] = tok.eot_id
      pos += n
    if np.count_nonzero(arr == tok.eot_id) != len(ids):  # text must never encode to end-of-text
      raise PrepareError(
          f"document text encodes to the end-of-text id {tok.eot_id} "
          f"({getattr(tok, 'eot_token', 'end-of-text')!r} is an ordinary token of this "
          f"tokenizer), which would cut documents at false boundaries: make it a special token "
          f"of the tokenizer.json or choose another with --eot-token")
    out[split] = arr
  return out


def _batches(docs: Iterator, extra: tuple) -> Iterator[tuple]:
  batch, size = [], 0
  for doc in docs:
    batch.append(doc)
    size += len(doc)
    if size >= BATCH_BYTES or len(batch) >= BATCH_DOCS:
      yield (batch, *extra)
      batch, size = [], 0
  if batch:
    yield (batch, *extra)


# ----------------------------------------------------------------------------- worker processes

_STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP")
                      if hasattr(signal, name))


def _worker_main(conn: Any, parent_pid: int) -> None:
  """A tokenizing process: `encode_batch` on each task its pipe brings, until None or the end.

  Stop signals are the parent's to handle (a terminal's Ctrl-C, ``kill`` of the process group, a
  scheduler's SIGTERM to every process of the job): the parent stops its workers itself. Without
  a parent (it died) the worker ends within a second.
  """
  for sig in _STOP_SIGNALS:
    signal.signal(sig, signal.SIG_IGN)
  signal.pthread_sigmask(signal.SIG_UNBLOCK, set(_STOP_SIGNALS))  # blocked while it started
  try:
    while True:
      if not conn.poll(1.0):
        if os.getppid() != parent_pid:
          return
        continue
      task = conn.recv()
      if task is None:
        return
      try:
        reply: tuple = (True, encode_batch(task))
      except Exception as e:  # noqa: BLE001 - the parent raises it; it names the problem
        reply = (False, e)
      try:
        conn.send(reply)
      except Exception:  # noqa: BLE001 - an exception that cannot be pickled: its text
        conn.send((False, RuntimeError(f"{type(reply[1]).__name__}: {reply[1]}")))
  except (EOFError, OSError):
    return  # the parent closed the pipe or is gone


class _Workers:
  """Tokenizing processes, each with a pipe of its own and one task at a time.

  No lock or queue is shared between processes, so stopping them (`kill`) at any moment leaves
  nothing stuck (a ``multiprocessing.Pool`` worker killed while holding its queue's lock hangs
  ``Pool.terminate``). Results come back in task order whatever the worker count, so the files
  written do not depend on it.
  """

  def __init__(self, count: int) -> None:
    context = _pool_context()
    self.conns: list[Any] = []
    self.procs: list[Any] = []
    # Stop signals stay blocked while the workers start (they inherit the mask, and a spawned
    # interpreter would die of one before it ignores them); a pending one reaches this process
    # when they are unblocked here.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, set(_STOP_SIGNALS))
    try:
      for _ in range(count):
        parent_end, child_end = context.Pipe()
        proc = context.Process(target=_worker_main, args=(child_end, os.getpid()), daemon=True)
        proc.start()
        child_end.close()
        self.conns.append(parent_end)
        self.procs.append(proc)
    except BaseException:
      self.kill()
      raise
    finally:
      signal.pthread_sigmask(signal.SIG_SETMASK, mask)

  def map(self, fn: Callable[[Any], Any], tasks: Iterable, check_stop: Callable[[], None]
          ) -> Iterator:
    """``fn`` (always `encode_batch` in the workers) of each task, in task order; at most one
    task per worker is read ahead, so memory stays bounded."""
    del fn  # the workers run encode_batch
    idle = collections.deque(range(len(self.procs)))
    pending: collections.deque = collections.deque()  # the worker of each task, in task order
    tasks = iter(tasks)
    more = True
    while True:
      while more and idle:
        task = next(tasks, None)
        if task is None:
          more = False
          break
        worker = idle.popleft()
        self.conns[worker].send(task)
        pending.append(worker)
      if not pending:
        return
      worker = pending.popleft()
      while not self.conns[worker].poll(0.1):
        check_stop()
        if not self.procs[worker].is_alive():
          raise PrepareError(f"a tokenizing worker process died (exit code "
                             f"{self.procs[worker].exitcode}), out of memory or killed: run again "
                             f"with fewer --workers")
      try:
        ok, value = self.conns[worker].recv()
      except EOFError:
        raise PrepareError("a tokenizing worker process died while sending its result: run again "
                           "with fewer --workers") from None
      if not ok:
        raise value
      idle.append(worker)
      check_stop()
      yield value

  def close(self) -> None:
    """Lets the workers finish (they are idle once every result is read)."""
    for conn in self.conns:
      with contextlib.suppress(OSError):
        conn.send(None)
    for proc in self.procs:
      proc.join(timeout=10)
    self.kill()

  def kill(self) -> None:
    """Stops the workers now (SIGKILL: they hold nothing another process waits for)."""
    for proc in self.procs:
      if proc.is_alive():
        proc.kill()
    for proc in self.procs:
      proc.join()
    for conn in self.conns:
      conn.close()
    self.procs, self.conns = [], []


def _map_in_process(tasks: Iterable, check_stop: Callable[[], None]) -> Iterator:
  for task in tasks:
    check_stop()
    yield encode_batch(task)


# ----------------------------------------------------------------------------- the directory

SPLIT_FILES = ("train.bin", "val.bin")
TOKENIZER_FILE = "tokenizer.json"
# This run's partial files: NAME.<process id>-<random>.partial, so that no other process, even
# one that runs where the folder lock does not hold, writes, renames or removes them.
_PRIVATE_PARTIAL = re.compile(
    r"^(train\.bin|val\.bin|tokenizer\.json|meta\.json)\.[0-9]+-[0-9a-f]+\.partial$")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
_OS_ERROR_CODE = re.compile(r"\(os error (\d+)\)")


def _describe_input(entry: str) -> dict:
  if entry == EMBEDDED or entry.startswith("hf:"):
    return {"input": entry}
  files = input_files(entry)
  return {"input": str(Path(entry).expanduser().resolve()), "files": len(files),
          "bytes": sum(f.stat().st_size for f in files),
          "mtime_ns": max(f.stat().st_mtime_ns for f in files)}


def _dtype_for(vocab_size: int, requested: str) -> str:
  fits16 = vocab_size <= 1 << 16
  if requested == "auto":
    return "uint16" if fits16 else "uint32"
  if requested == "uint16" and not fits16:
    raise PrepareError(f"--dtype uint16 cannot hold a vocabulary of {vocab_size} (ids up to "
                       f"65535): use --dtype uint32 or auto")
  return requested


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
class _Existing:
  """What --out holds from earlier runs of this tool."""
  meta: Optional[dict]  # its meta.json (complete or not), else None
  complete: bool        # the trainer would accept the directory
  kept: set[str]        # that meta.json and its files: they stay until the new corpus replaces them
  leftovers: set[str]   # files of an interrupted run (named by the marker, partials): garbage
  changed: set[str]     # files its meta.json names that changed since: no longer this tool's


def _existing(out: Path) -> _Existing:
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
  return _Existing(meta, complete, kept, leftovers, changed)


def _write_error(path: Path, e: OSError) -> PrepareError:
  full = e.errno in (errno.ENOSPC, errno.EDQUOT)
  reason = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
            errno.EROFS: "read-only file system", errno.EACCES: "permission denied",
            errno.EPERM: "operation not permitted"}.get(e.errno or 0, e.strerror or str(e))
  fix = "free some space or choose another --out" if full else \
      "choose a writable --out (or fix its permissions)"
  return PrepareError(f"cannot write {path} ({reason}): {fix}; nothing this run wrote is kept")


@contextlib.contextmanager
def _writing(path: Path) -> Iterator[None]:
  """An OSError inside (a full disk, a read-only folder) is a one-line PrepareError."""
  try:
    yield
  except OSError as e:
    raise _write_error(path, e) from None


def _remove(out: Path, names: Iterable[str], keep: Optional[Path], quiet: bool = False) -> None:
  for name in sorted(names):
    path = out / name
    if keep is not None and path.exists() and path.resolve() == keep:
      continue  # the tokenizer this prepare reads is never deleted
    try:
      path.unlink(missing_ok=True)
    except OSError:
      if not quiet:  # (cleaning up after an error keeps going; the error is reported)
        raise


def _write_json(path: Path, record: dict, temp: Path) -> None:
  """``record`` as ``path``, atomically (written as ``temp``, synced, renamed)."""
  with _writing(path):
    with open(temp, "w") as f:
      f.write(json.dumps(record, indent=2) + "\n")
      f.flush()
      os.fsync(f.fileno())
    os.replace(temp, path)


def _sync_folder(folder: Path) -> None:
  """Makes the renames in ``folder`` durable (where the platform can)."""
  with contextlib.suppress(OSError):
    fd = os.open(folder, os.O_RDONLY)
    try:
      os.fsync(fd)
    finally:
      os.close(fd)


def _check_paths(inputs: Sequence[str], out: Path, tokenizer_path: Optional[Path]) -> None:
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


def _check_distinct(inputs: Sequence[str]) -> None:
  """Each input (file, folder, dataset) once: a file named twice would be trained on twice."""
  seen: dict[str, str] = {}
  for entry in inputs:
    if entry == EMBEDDED or entry.startswith("hf:"):
      keys = [entry]
    else:
      keys = [str(f.resolve()) for f in input_files(entry)]
    for key in keys:
      if key in seen:
        again = "" if key == entry else f" ({key})"
        raise PrepareError(f"input {entry!r} repeats {seen[key]!r}{again}, so its documents "
                           f"would be in the corpus twice: give each input once (--weights "
                           f"gives one input more weight)")
    for key in keys:
      seen[key] = entry


def _create_out(out: Path) -> list[Path]:
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
    _remove_created(created)
    raise PrepareError(f"cannot create --out {str(out)!r} ({e.strerror or e}): choose a writable "
                       f"directory") from None
  return created


def _remove_created(created: list[Path]) -> None:
  """Removes the folders this run created, innermost first, as long as they are empty."""
  for folder in reversed(created):
    try:
      os.rmdir(folder)
    except OSError:
      return  # not empty (someone else's files), or gone: leave it


def prepare(inputs: Sequence[str], out: str | os.PathLike, tokenizer: str, *,
            weights: Optional[Sequence[float]] = None, workers: int = 1, dtype: str = "auto",
            opts: Options = Options(), eot_token: Optional[str] = None,
            bpe_train_bytes: Optional[int] = None, force: bool = False,
            progress: bool = True, log: Callable[[str], Any] = print,
            check_stop: Callable[[], None] = lambda: None) -> dict:
  """Prepares ``inputs`` into ``out``; returns the written (or existing) ``meta.json`` as a dict.

  One prepare at a time per ``out``: it holds ``out``'s lock (:mod:`stablejax.data.folder`)
  while it runs, and a second one is a ``PrepareError`` naming the first. Only files this tool
  wrote (named by its own ``meta.json``, or by ``meta.json.partial`` while it writes) are
  replaced or removed; another file under a name it writes (``train.bin``, ``val.bin``,
  ``tokenizer.json``, ``meta.json``, ``meta.json.partial``), or one of its files that changed
  since it wrote it (another size or SHA-256 than ``meta.json`` records), is a ``PrepareError``
  unless ``force``. The tokenizer file it reads is never removed: ``--tokenizer
  DIR/tokenizer.json --out DIR`` keeps that file in place as the directory's tokenizer. A corpus
  already in ``out`` stays usable until the new one is complete (``force`` replaces it only
  then). When it fails, nothing it wrote is kept, and a folder it created goes too.

  Args:
    inputs: INPUT entries (see the module docstring); each at most once.
    out: the output directory.
    tokenizer: ``bytes``, ``gpt2``, a tokenizer.json path or ``bpe:N``.
    weights: mixing weight per input (default: token counts, i.e. plain concatenation).
    workers: tokenizing processes (1: in this process).
    dtype: ``auto``, ``uint16`` or ``uint32``.
    opts: document options (text field, separator, split, filter).
    eot_token: end-of-text token name of a tokenizer.json (default: the first known name).
    bpe_train_bytes: ``bpe:N`` trains on at most this many bytes of training documents.
    force: replace a corpus prepared with a different request, and files this tool did not
      write that are in the way.
    progress: tqdm bars.
    log: one-line messages.
    check_stop: called at safe points (between batches, while waiting for workers, between BPE
      training documents); whatever it raises stops the run, which then removes its files (the
      command line raises on SIGINT, SIGTERM and SIGHUP).

  Raises:
    PrepareError: bad input, ``out`` in use by another prepare, or not writable (the message is
      one line naming the problem and the fix).
    KeyboardInterrupt: interrupted (Ctrl-C, or what ``check_stop`` raised); the files this run
      wrote are removed first.

  Example:
    Four hundred JSONL documents as bytes, 5% of the documents held out for validation:

    >>> import json, os, tempfile
    >>> from stablejax.data.prepare import Options, prepare
    >>> folder = tempfile.mkdtemp()
    >>> with open(os.path.join(folder, "docs.jsonl"), "w") as f:
    ...   for i in range(400):
    ...     print(json.dumps({"text": f"Document {i}: the quick brown fox."}), file=f)
    >>> meta = prepare([os.path.join(folder, "docs.jsonl")], os.path.join(folder, "corpus"),
    ...                "bytes", opts=Options(val_fraction=0.05), progress=False, log=print)
    prepared .../corpus: 400 documents (22 val), 13,125 train + 765 val tokens, vocab 256
    (uint16), ...
    >>> meta["tokenizer"]["kind"], meta["vocab_size"], meta["dtype"]
    ('bytes', 256, 'uint16')
    >>> sorted(os.listdir(os.path.join(folder, "corpus")))
    ['meta.json', 'train.bin', 'val.bin']
    >>> meta["files"]["train.bin"]["tokens"], len(meta["files"]["train.bin"]["sha256"])
    (13125, 64)

    Train on it with ``data.train=<folder>/corpus``.
  """
  t0 = time.time()
  inputs = list(inputs)
  if not inputs:
    raise PrepareError("no INPUT given: name text/JSONL/Parquet files or folders, pydoc, or "
                       "hf:NAME")
  if not 0.0 < opts.val_fraction < 1.0:
    raise PrepareError(f"--val-fraction {opts.val_fraction} is outside (0, 1): the trainer needs "
                       f"a validation split; use e.g. 0.005")
  if opts.separator == "":
    raise PrepareError(f"--separator is empty: give the string between documents in text files "
                       f"(default {SEPARATOR})")
  if workers < 1:
    raise PrepareError(f"--workers {workers} must be at least 1")
  if weights is not None:
    weights = [float(w) for w in weights]
    if len(weights) != len(inputs):
      raise PrepareError(f"--weights has {len(weights)} values for {len(inputs)} inputs: give one "
                         f"weight per input")
    if not all(np.isfinite(w) and w > 0 for w in weights):
      raise PrepareError(f"--weights {weights} has a non-positive entry: give positive numbers")
  if opts.text_field == "":
    raise PrepareError("--text-field is empty: name the field that holds the text")
  _check_distinct(inputs)
  bpe_size, given_tok = _tokenizer_checked(tokenizer, eot_token)
  out = Path(out).expanduser()
  # The tokenizer file this prepare reads: kept in place when it is --out's own tokenizer.json.
  tok_path = given_tok.path.resolve() if isinstance(given_tok, tokenizer_lib.HFTokenizer) else None
  _check_paths(inputs, out, tok_path)

  request = {"inputs": [_describe_input(e) for e in inputs], "tokenizer": tokenizer,
             "tokenizer_sha256": (hashlib.sha256(Path(tokenizer).read_bytes()).hexdigest()
                                  if bpe_size is None and Path(tokenizer).is_file() else None),
             "eot_token": eot_token, "weights": weights, "dtype": dtype,
             "options": dataclasses.asdict(opts), "bpe_train_bytes": bpe_train_bytes}
  request = json.loads(json.dumps(request))
  check_stop()
  created = _create_out(out)
  lock = FolderLock(out, "prepare")
  try:
    try:
      lock.acquire()
    except FolderBusy as e:
      raise PrepareError(str(e)) from None
    except OSError as e:
      raise _write_error(out, e) from None
    job = _Job(inputs, out, tokenizer, bpe_size, given_tok, tok_path, request, weights, workers,
               dtype, opts, bpe_train_bytes, force, progress, log, check_stop, t0)
    meta = job.run()
  finally:
    lock.release()
    if created and not (out / PREPARED_META).exists():
      _remove_created(created)
  if job.done:
    mb = meta["bytes"] / 1e6
    seconds = time.time() - t0
    log(f"prepared {out}: {meta['documents']:,} documents ({meta['val_documents']:,} val), "
        f"{meta['train_tokens']:,} train + {meta['val_tokens']:,} val tokens, vocab "
        f"{meta['vocab_size']} ({meta['dtype']}), {mb:.1f} MB of text in {seconds:.1f} s "
        f"({mb / max(seconds, 1e-9):.2f} MB/s)")
    invalid = meta["invalid_utf8"]
    if invalid["documents"]:
      log(f"note: {invalid['documents']:,} document(s) held {invalid['bytes']:,} byte(s) of "
          f"invalid UTF-8 (or lone surrogates), written as U+FFFD (meta.json: invalid_utf8); "
          f"--filter-max-nontext drops the documents where they are a larger share")
  return meta


@dataclasses.dataclass
class _Job:
  """One prepare, from the moment it holds --out's lock."""
  inputs: list[str]
  out: Path
  tokenizer: str
  bpe_size: Optional[int]
  given_tok: Any
  tok_path: Optional[Path]
  request: dict
  weights: Optional[list[float]]
  workers: int
  dtype: str
  opts: Options
  bpe_train_bytes: Optional[int]
  force: bool
  progress: bool
  log: Callable[[str], Any]
  check_stop: Callable[[], None]
  started: float
  done: bool = False  # a corpus was written (False: already prepared)

  def run(self) -> dict:
    out, tok_path, force = self.out, self.tok_path, self.force
    existing = _existing(out)
    if existing.changed and not force:
      raise PrepareError(f"{out} holds {', '.join(sorted(existing.changed))}, changed since "
                         f"python -m stablejax prepare wrote it (not the size or SHA-256 its "
                         f"meta.json records): move it away, choose another --out, or pass "
                         f"--force to replace it")
    if existing.meta is not None and not existing.changed:
      same = existing.meta.get("request") == self.request
      if existing.complete and same:
        with _writing(out):
          _remove(out, existing.leftovers, tok_path)  # of an interrupted --force run
        self.log(f"{out} is already prepared with these settings "
                 f"({existing.meta['train_tokens']:,} train tokens, "
                 f"{existing.meta['val_tokens']:,} val tokens): nothing to do")
        return existing.meta
      if not same and not force:
        raise PrepareError(f"{out} already holds a corpus prepared with other settings: choose "
                           f"another --out or pass --force to replace it")
      if not existing.complete:
        self.log(f"{out}: its files do not match its meta.json; preparing it again")
    given_tok = self.given_tok
    in_place = tok_path is not None and tok_path == (out / TOKENIZER_FILE).resolve()
    writes = [*SPLIT_FILES] + ([TOKENIZER_FILE] if given_tok is None or (
        isinstance(given_tok, tokenizer_lib.HFTokenizer) and not in_place) else [])
    ours = existing.kept | existing.leftovers
    in_the_way = []
    for name in (*writes, PREPARED_META, PREPARED_MARKER):
      path = out / name
      if path.is_dir():
        raise PrepareError(f"{path} is a directory, where prepare writes a file: move it or "
                           f"choose another --out")
      if os.path.lexists(path) and name not in ours and name not in existing.changed:
        in_the_way.append(name)
    if in_the_way and not force:
      raise PrepareError(f"{out} holds {', '.join(in_the_way)}, not written by python -m "
                         f"stablejax prepare (no meta.json of its own names them): choose another "
                         f"--out, or pass --force to replace them")

    # The marker names this run's partial files, and (`_finish`, just before they are renamed
    # into place) each file it puts in --out with that file's identity, so an interrupted run's
    # files are recognised (and removed) by the next one, and a file put there since under the
    # same name is not. `stale`: files of the corpus already there that the new one does not
    # have (removed once it is in place); leftovers of an interrupted run are removed now.
    stale = existing.kept - {PREPARED_META} - set(writes) - (
        {TOKENIZER_FILE} if in_place else set())
    tag = f"{os.getpid()}-{secrets.token_hex(4)}"
    partials = {name: f"{name}.{tag}{PARTIAL}" for name in (*writes, PREPARED_META)}
    marker = {"format": PREPARED_FORMAT, "incomplete": True, "written": [], "claims": {},
              "partials": sorted(partials.values()), "request": self.request,
              "writer": {"pid": os.getpid(), "host": socket.gethostname(), "tag": tag}}
    with _writing(out):
      _remove(out, existing.leftovers - {PREPARED_MARKER}, tok_path)
    state: dict = {"old_meta_removed": False, "renamed": []}
    workers = None
    try:
      _write_json(out / PREPARED_MARKER, marker, out / partials[PREPARED_META])
      self.check_stop()
      if self.workers > 1:  # started before any tokenizer runs, so no library thread is forked
        workers = _Workers(self.workers)
      tok, tok_spec = _make_tokenizer(self.tokenizer, self.bpe_size, given_tok, in_place,
                                      self.inputs, out, self.opts, self.bpe_train_bytes,
                                      self.progress, self.log, partials, self.check_stop)
      meta = _tokenize(self.inputs, out, tok, tok_spec, _dtype_for(tok.vocab_size, self.dtype),
                       self.weights, self.opts, workers, self.progress, self.check_stop,
                       partials)
      if workers is not None:
        workers.close()
        workers = None
      meta["request"] = self.request
      meta["written"] = writes
      meta["seconds"] = time.time() - self.started
      self.check_stop()  # the last moment a stop leaves the directory as it was
      _finish(out, meta, writes, stale, tok_path, state, partials, marker)
    except BaseException:
      # Cleaning up must not be cut short by a second Ctrl-C (it is delivered when done).
      mask = signal.pthread_sigmask(signal.SIG_BLOCK, set(_STOP_SIGNALS))
      try:
        if workers is not None:
          workers.kill()
        _remove(out, partials.values(), tok_path, quiet=True)
        if state["old_meta_removed"]:  # the earlier corpus is gone: none of its files stay
          _remove(out, {*state["renamed"], *existing.kept, *stale}, tok_path, quiet=True)
        _remove(out, [PREPARED_MARKER], tok_path, quiet=True)
      finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
      raise
    self.done = True
    return meta


def _pool_context() -> Any:
  """fork (cheap) unless this process has started JAX's backends, whose threads must not be
  forked (prepare() called from a training script or a bench); then spawn."""
  xla_bridge = sys.modules.get("jax._src.xla_bridge")
  if xla_bridge is not None and xla_bridge.backends_are_initialized():
    return multiprocessing.get_context("spawn")
  return multiprocessing.get_context("fork" if sys.platform == "linux" else None)


def _tokenizer_checked(spec: str, eot_token: Optional[str]) -> tuple[Optional[int], Any]:
  """(N of bpe:N, None) or (None, the loaded tokenizer); loaded before anything is written, so an
  unknown name, a missing file or a needed download fails early."""
  try:
    bpe = tokenizer_lib.parse_bpe_size(spec)
    return (bpe, None) if bpe is not None else (None, tokenizer_lib.get_tokenizer(spec, eot_token))
  except tokenizer_lib.TokenizerError as e:
    raise PrepareError(str(e)) from None


def _make_tokenizer(spec: str, bpe_size: Optional[int],
                    given_tok: Optional[tokenizer_lib.Tokenizer], in_place: bool,
                    inputs: list[str], out: Path, opts: Options,
                    bpe_train_bytes: Optional[int], progress: bool, log: Callable[[str], Any],
                    partials: dict[str, str], check_stop: Callable[[], None]
                    ) -> tuple[tokenizer_lib.Tokenizer, tuple]:
  partial = out / partials.get(TOKENIZER_FILE, TOKENIZER_FILE + PARTIAL)
  if bpe_size is None:
    assert given_tok is not None, "a named tokenizer is loaded before this"
    tok = given_tok
    if isinstance(tok, tokenizer_lib.HFTokenizer):
      if in_place:  # --out's own tokenizer.json: read in place, never rewritten
        return tok, ("file", str(tok.path), tok.eot_token)
      with _writing(out / TOKENIZER_FILE):
        partial.write_bytes(tok.path.read_bytes())  # the directory carries its own tokenizer
      return tok, ("file", str(partial), tok.eot_token)
    return tok, ("name", spec, None)
  log(f"training a byte-level BPE of vocabulary {bpe_size} on the training split")
  bar = tqdm(unit="B", unit_scale=True, desc="bpe data", disable=not progress)
  limit = bpe_train_bytes if bpe_train_bytes else float("inf")

  def training_texts() -> Iterator[str]:
    seen = 0
    for entry in inputs:
      for doc in iter_documents(entry, opts):
        check_stop()
        text, raw, _ = _as_text(doc)
        if _classify(raw, opts) == "train":
          yield text
          seen += len(raw)
          bar.update(len(raw))
          if seen >= limit:
            return

  try:
    tok = tokenizer_lib.train_bpe(training_texts(), bpe_size, partial)
  except (PrepareError, KeyboardInterrupt):
    raise
  except Exception as e:  # noqa: BLE001 - tokenizers reports a failed save as a plain Exception
    code = _OS_ERROR_CODE.search(str(e))
    if code is None:
      raise
    raise _write_error(out / TOKENIZER_FILE, OSError(int(code.group(1)), str(e))) from None
  finally:
    bar.close()
  if tok.vocab_size < bpe_size:
    log(f"note: the corpus supports only {tok.vocab_size} BPE tokens, fewer than {bpe_size}")
  return tok, ("file", str(partial), tok.eot_token)


class _TokenFile:
  """One split's partial file: appends token arrays and keeps what meta.json records of it."""

  def __init__(self, path: Path, final: Path) -> None:
    self.path, self.final = path, final
    with _writing(final):
      self._file = open(path, "wb")
    self.sha256 = hashlib.sha256()
    self.bytes = 0
    self.tokens = 0
    self.max_token = -1

  def append(self, ids: np.ndarray) -> None:
    if not ids.size:
      return
    data = np.ascontiguousarray(ids).view(np.uint8).data
    with _writing(self.final):
      self._file.write(data)
    self.sha256.update(data)
    self.bytes += data.nbytes
    self.tokens += int(ids.size)
    self.max_token = max(self.max_token, int(ids.max()))

  def close(self) -> None:
    """Flushes and syncs the file (on disk before meta.json says it is complete)."""
    with _writing(self.final):
      self._file.flush()
      os.fsync(self._file.fileno())
      self._file.close()

  def abort(self) -> None:
    with contextlib.suppress(OSError):
      self._file.close()

  def record(self) -> dict:
    return {"bytes": self.bytes, "tokens": self.tokens, "sha256": self.sha256.hexdigest(),
            "max_token": self.max_token}


def _tokenize(inputs: list[str], out: Path, tok: tokenizer_lib.Tokenizer, tok_spec: tuple,
              dtype: str, weights: Optional[list[float]], opts: Options,
              workers: Optional[_Workers], progress: bool, check_stop: Callable[[], None],
              partials: dict[str, str]) -> dict:
  files = {split: _TokenFile(out / partials[f"{split}.bin"], out / f"{split}.bin")
           for split in ("train", "val")}
  totals = {"train": 0, "val": 0}
  sources: list[dict[str, Any]] = []
  bar = tqdm(unit="B", unit_scale=True, desc="tokenize", disable=not progress, smoothing=0.1)
  closed = False
  try:
    for index, entry in enumerate(inputs):
      counts: collections.Counter[str] = collections.Counter()
      start = dict(totals)
      tasks = _batches(iter_documents(entry, opts), (tok_spec, opts, np.dtype(dtype)))
      results = (workers.map(encode_batch, tasks, check_stop) if workers is not None
                 else _map_in_process(tasks, check_stop))
      for result in results:
        for split in ("train", "val"):
          files[split].append(result[split])
          totals[split] += int(result[split].size)
        counts.update(result["counts"])
        bar.update(result["counts"]["bytes"])
      documents = sum(counts[k] for k in ("train", "val", "repeat", "nontext", "empty"))
      if documents == 0:
        raise PrepareError(f"input {entry!r} holds no documents: check the file (and "
                           f"--text-field)")
      if counts["train"] + counts["val"] == 0:
        raise PrepareError(f"every document of input {entry!r} was dropped by the filter "
                           f"({counts['repeat']} long repeats, {counts['nontext']} non-text, "
                           f"{counts['empty']} empty): check the data or relax "
                           f"--filter-max-repeat / --filter-max-nontext")
      if counts["train"] == 0:  # it would be in val.bin only, and never trained on
        raise PrepareError(f"all {counts['val']} document(s) of input {entry!r} fell into the "
                           f"validation split (--val-fraction {opts.val_fraction}), so training "
                           f"would never see it: split it into more documents (--separator for "
                           f"text files, one record per document in JSON Lines/Parquet), lower "
                           f"--val-fraction, or leave the input out")
      sources.append({
          "input": entry, "documents": documents, "train_documents": counts["train"],
          "val_documents": counts["val"], "dropped_repeat": counts["repeat"],
          "dropped_nontext": counts["nontext"], "empty": counts["empty"],
          "bytes": counts["bytes"],
          "invalid_utf8_documents": counts["invalid_utf8_documents"],
          "invalid_utf8_bytes": counts["invalid_utf8_bytes"],
          "train_range": [start["train"], totals["train"]],
          "val_range": [start["val"], totals["val"]],
          "train_tokens": totals["train"] - start["train"],
          "val_tokens": totals["val"] - start["val"]})
    for f in files.values():
      f.close()
    closed = True
  finally:
    bar.close()
    if not closed:
      for f in files.values():
        f.abort()
  if totals["val"] == 0:
    n = sum(s["train_documents"] for s in sources)
    split = ("split the text into documents (--separator for text files, one record per "
             "document in JSON Lines/Parquet)")
    if n == 1:  # no --val-fraction gives a validation split without losing the only document
      raise PrepareError(f"the corpus is one document, which cannot be split into training and "
                         f"validation documents: {split}, or add text")
    raise PrepareError(f"none of the {n} documents fell into the validation split "
                       f"(--val-fraction {opts.val_fraction}): raise --val-fraction (about "
                       f"{min(0.5, 2 / n):.2g} puts a document there), {split}, or add text")
  if weights is None:
    weights = [float(s["train_tokens"]) for s in sources]
  total_w = sum(weights)
  for s, w in zip(sources, weights):
    s["weight"] = w / total_w
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


def _finish(out: Path, meta: dict, writes: Sequence[str], stale: set[str],
            tok_path: Optional[Path], state: dict, partials: dict[str, str],
            marker: dict) -> None:
  """Puts the new corpus in place: the marker first claims the files it is about to put there
  and the old corpus' files it removes (each by its identity), the old meta.json goes (from then
  on the directory is incomplete and the marker says so), the partial files are renamed, files of
  the old corpus that the new one lacks are removed, meta.json is written (atomically) with the
  status of the files now in place, and the marker goes last."""
  claims = {name: _file_identity(out / partials[name]) for name in writes}
  claims.update({name: _file_identity(out / name) for name in stale})
  _write_json(out / PREPARED_MARKER, dict(marker, claims=claims), out / partials[PREPARED_META])
  state["old_meta_removed"] = True
  with _writing(out / PREPARED_META):
    (out / PREPARED_META).unlink(missing_ok=True)
    for name in writes:
      os.replace(out / partials[name], out / name)
      state["renamed"].append(name)
    _remove(out, stale, tok_path)
    for name in SPLIT_FILES:
      meta["files"][name]["stat"] = _stat_record(os.stat(out / name))
  _write_json(out / PREPARED_META, meta, out / partials[PREPARED_META])
  with _writing(out / PREPARED_MARKER):
    (out / PREPARED_MARKER).unlink(missing_ok=True)
  _sync_folder(out)
