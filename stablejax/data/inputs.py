"""The INPUTs of ``python -m stablejax prepare``, streamed as documents.

An INPUT (:mod:`stablejax.data.prepare` lists them) is a text file split on
``Options.separator`` (``.gz`` read compressed, 1 MiB at a time), a JSON Lines file or JSON array
(one document per record's ``Options.text_field``), a Parquet file (one per row, a batch at a
time), a folder of such files (recursively, in sorted order), the embedded corpus, or a Hugging
Face dataset (``hf:NAME[:CONFIG]``, streamed). A file that cannot be read, or a record without
its text field, is a `PrepareError` naming the file and the fix.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import types
import zlib
from pathlib import Path
from typing import Iterator, Optional, Sequence

from stablejax.data.config import EMBEDDED, Options, PrepareError

JSON_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")
PARQUET_SUFFIXES = (".parquet",)
TEXT_SUFFIXES = (".txt", ".text", ".md", ".rst", ".txt.gz")


def _need(module: str, what: str) -> types.ModuleType:
  try:
    return __import__(module)
  except ImportError:
    raise PrepareError(f"{what} needs the {module} package: pip install 'stablejax[data]'"
                       ) from None


def _open(path: Path) -> io.BufferedIOBase:
  return gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")


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


def _record_text(record: object, opts: Options, where: str) -> Optional[str]:
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


def describe_input(entry: str) -> dict:
  """What the request records of an INPUT: its resolved path, file count, bytes and latest
  modification time (the name alone for ``pydoc`` and ``hf:``)."""
  if entry == EMBEDDED or entry.startswith("hf:"):
    return {"input": entry}
  files = input_files(entry)
  return {"input": str(Path(entry).expanduser().resolve()), "files": len(files),
          "bytes": sum(f.stat().st_size for f in files),
          "mtime_ns": max(f.stat().st_mtime_ns for f in files)}


def check_distinct(inputs: Sequence[str]) -> None:
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
