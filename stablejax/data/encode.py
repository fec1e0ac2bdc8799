"""Documents to tokens: the filter, the validation split and the tokenizer, a batch at a time.

`encode_batch` is what prepare's worker processes run (:mod:`stablejax.data.workers`), on batches
of about 1 MiB of documents (`document_batches`). Each document is stripped and decoded (invalid
UTF-8 and lone surrogates become U+FFFD, and are counted), dropped when empty or when the trainer's
filter would drop it (:func:`stablejax.data.sources.max_run`,
:func:`stablejax.data.sources.nontext_fraction`), assigned to validation by the hash of its UTF-8
bytes (`is_val`: independent of order and worker count; duplicates land on the same side), and
encoded as ordinary text followed by the end-of-text id.
"""

from __future__ import annotations

import collections
import hashlib
import re
from typing import Any, Iterable, Iterator

import numpy as np

from stablejax.data import tokenizer as tokenizer_lib
from stablejax.data.config import Options, PrepareError
from stablejax.data.sources import invalid_utf8_bytes, max_run, nontext_fraction

BATCH_BYTES = 1 << 20          # documents per task: about this much text
BATCH_DOCS = 4096
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def as_text(doc: str | bytes) -> tuple[str, bytes, int]:
  """(text, UTF-8 bytes, count of invalid UTF-8 bytes or lone surrogates replaced by U+FFFD)."""
  if isinstance(doc, bytes):
    raw = doc.strip()
    try:
      return raw.decode("utf-8"), raw, 0
    except UnicodeDecodeError:
      invalid = invalid_utf8_bytes(raw)
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


def classify(raw: bytes, opts: Options) -> str:
  """'empty', 'repeat', 'nontext', 'train' or 'val' for one document's UTF-8 bytes."""
  if not raw:
    return "empty"
  if opts.filter_max_repeat > 0 and max_run(np.frombuffer(raw, np.uint8)) > opts.filter_max_repeat:
    return "repeat"
  if opts.filter_max_nontext < 1.0 and nontext_fraction(raw) > opts.filter_max_nontext:
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
    text, raw, invalid = as_text(doc)
    counts["bytes"] += len(raw)
    label = classify(raw, opts)
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


def document_batches(docs: Iterable[str | bytes], extra: tuple) -> Iterator[tuple]:
  """Tasks for `encode_batch`: ``(documents, *extra)`` of about `BATCH_BYTES` of text each."""
  batch, size = [], 0
  for doc in docs:
    batch.append(doc)
    size += len(doc)
    if size >= BATCH_BYTES or len(batch) >= BATCH_DOCS:
      yield (batch, *extra)
      batch, size = [], 0
  if batch:
    yield (batch, *extra)
