"""Prepare a corpus for the trainer: documents -> tokens -> ``train.bin``, ``val.bin``, meta.json.

    python -m stablejax prepare INPUT... --out DIR --tokenizer T [--weights W...] [--workers N]

After nanoGPT's ``data/openwebtext/prepare.py``, as a tool (the command line is
:mod:`stablejax.cli.prepare`; this module is the library it runs, :func:`prepare`, and the job;
its parts are :mod:`~stablejax.data.inputs`, :mod:`~stablejax.data.encode`,
:mod:`~stablejax.data.workers`, :mod:`~stablejax.data.tokenizer_choice`,
:mod:`~stablejax.data.out_dir` and the format, :mod:`~stablejax.data.prepared`). Then
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
import dataclasses
import hashlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
from tqdm import tqdm

from stablejax.data import out_dir
from stablejax.data import tokenizer as tokenizer_lib
from stablejax.data.config import SEPARATOR, Options, PrepareError
from stablejax.data.encode import document_batches, encode_batch
from stablejax.data.folder import FolderBusy, FolderLock
from stablejax.data.inputs import check_distinct, describe_input, iter_documents
from stablejax.data.paths import PathError, checked_path
from stablejax.data.prepared import (PREPARED_MARKER, PREPARED_META, SPLIT_FILES, TOKENIZER_FILE,
                                     TokenFile, corpus_meta, dtype_for, source_record,
                                     write_error, write_json, writing)
from stablejax.data.tokenizer_choice import checked_tokenizer, make_tokenizer
from stablejax.data.workers import STOP_SIGNALS, Workers, map_in_process


def prepare(inputs: Sequence[str], out: str | os.PathLike, tokenizer: str, *,
            weights: Optional[Sequence[float]] = None, workers: int = 1, dtype: str = "auto",
            opts: Options = Options(), eot_token: Optional[str] = None,
            bpe_train_bytes: Optional[int] = None, force: bool = False,
            progress: bool = True, log: Callable[[str], object] = print,
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
  try:
    out = checked_path(out, "--out").expanduser()
  except PathError as e:
    raise PrepareError(str(e)) from None
  check_distinct(inputs)
  bpe_size, given_tok = checked_tokenizer(tokenizer, eot_token)
  # The tokenizer file this prepare reads: kept in place when it is --out's own tokenizer.json.
  tok_path = given_tok.path.resolve() if isinstance(given_tok, tokenizer_lib.HFTokenizer) else None
  out_dir.check_paths(inputs, out, tok_path)

  request = {"inputs": [describe_input(e) for e in inputs], "tokenizer": tokenizer,
             "tokenizer_sha256": (hashlib.sha256(Path(tokenizer).read_bytes()).hexdigest()
                                  if bpe_size is None and Path(tokenizer).is_file() else None),
             "eot_token": eot_token, "weights": weights, "dtype": dtype,
             "options": dataclasses.asdict(opts), "bpe_train_bytes": bpe_train_bytes}
  request = json.loads(json.dumps(request))
  check_stop()
  created = out_dir.create_out(out)
  lock = FolderLock(out, "prepare")
  try:
    try:
      lock.acquire()
    except FolderBusy as e:
      raise PrepareError(str(e)) from None
    except OSError as e:
      raise write_error(out, e) from None
    job = _Job(inputs, out, tokenizer, bpe_size, given_tok, tok_path, request, weights, workers,
               dtype, opts, bpe_train_bytes, force, progress, log, check_stop, t0)
    meta = job.run()
  finally:
    lock.release()
    if created and not (out / PREPARED_META).exists():
      out_dir.remove_created(created)
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
  given_tok: Optional[tokenizer_lib.Tokenizer]
  tok_path: Optional[Path]
  request: dict
  weights: Optional[list[float]]
  workers: int
  dtype: str
  opts: Options
  bpe_train_bytes: Optional[int]
  force: bool
  progress: bool
  log: Callable[[str], object]
  check_stop: Callable[[], None]
  started: float
  done: bool = False  # a corpus was written (False: already prepared)

  def run(self) -> dict:
    out, tok_path, force = self.out, self.tok_path, self.force
    existing = out_dir.existing(out)
    if existing.changed and not force:
      raise PrepareError(f"{out} holds {', '.join(sorted(existing.changed))}, changed since "
                         f"python -m stablejax prepare wrote it (not the size or SHA-256 its "
                         f"meta.json records): move it away, choose another --out, or pass "
                         f"--force to replace it")
    if existing.meta is not None and not existing.changed:
      same = existing.meta.get("request") == self.request
      if existing.complete and same:
        with writing(out):
          out_dir.remove(out, existing.leftovers, tok_path)  # of an interrupted --force run
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
    out_dir.refuse_in_the_way(out, writes, existing, force)

    # `stale`: files of the corpus already there that the new one does not have (removed once it
    # is in place); leftovers of an interrupted run are removed now.
    stale = existing.kept - {PREPARED_META} - set(writes) - (
        {TOKENIZER_FILE} if in_place else set())
    partials, marker = out_dir.start_record(writes, self.request)
    with writing(out):
      out_dir.remove(out, existing.leftovers - {PREPARED_MARKER}, tok_path)
    state: dict = {"old_meta_removed": False, "renamed": []}
    workers = None
    try:
      write_json(out / PREPARED_MARKER, marker, out / partials[PREPARED_META])
      self.check_stop()
      if self.workers > 1:  # started before any tokenizer runs, so no library thread is forked
        workers = Workers(self.workers, encode_batch)
      tok, tok_spec = make_tokenizer(self.tokenizer, self.bpe_size, given_tok, in_place,
                                     self.inputs, out, self.opts, self.bpe_train_bytes,
                                     self.progress, self.log, partials, self.check_stop)
      meta = _tokenize(self.inputs, out, tok, tok_spec, dtype_for(tok.vocab_size, self.dtype),
                       self.weights, self.opts, workers, self.progress, self.check_stop,
                       partials)
      if workers is not None:
        workers.close()
        workers = None
      meta["request"] = self.request
      meta["written"] = writes
      meta["seconds"] = time.time() - self.started
      self.check_stop()  # the last moment a stop leaves the directory as it was
      out_dir.finish(out, meta, writes, stale, tok_path, state, partials, marker)
    except BaseException:
      # Cleaning up must not be cut short by a second Ctrl-C (it is delivered when done).
      mask = signal.pthread_sigmask(signal.SIG_BLOCK, set(STOP_SIGNALS))
      try:
        if workers is not None:
          workers.kill()
        out_dir.remove_failed(out, partials, state, existing, stale, tok_path)
      finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
      raise
    self.done = True
    return meta


def _tokenize(inputs: list[str], out: Path, tok: tokenizer_lib.Tokenizer, tok_spec: tuple,
              dtype: str, weights: Optional[list[float]], opts: Options,
              workers: Optional[Workers], progress: bool, check_stop: Callable[[], None],
              partials: dict[str, str]) -> dict:
  """Reads, tokenizes and writes every input into this run's partial ``train.bin`` and
  ``val.bin``; returns their meta.json (`corpus_meta`)."""
  files = {split: TokenFile(out / partials[f"{split}.bin"], out / f"{split}.bin")
           for split in ("train", "val")}
  totals = {"train": 0, "val": 0}
  sources: list[dict] = []
  bar = tqdm(unit="B", unit_scale=True, desc="tokenize", disable=not progress, smoothing=0.1)
  closed = False
  try:
    for entry in inputs:
      counts: collections.Counter[str] = collections.Counter()
      start = dict(totals)
      tasks = document_batches(iter_documents(entry, opts), (tok_spec, opts, np.dtype(dtype)))
      results = (workers.map(tasks, check_stop) if workers is not None
                 else map_in_process(encode_batch, tasks, check_stop))
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
      sources.append(source_record(entry, documents, counts, start, totals))
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
  return corpus_meta(tok, dtype, totals, sources, files, opts)

