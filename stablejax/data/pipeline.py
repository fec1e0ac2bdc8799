"""The trainer's data pipeline: seeded random windows of the sources, mixed and sharded with Grain.

The sources (the embedded corpus, text files and folders, ``.bin`` token files, a prepared
directory) and the document filter are :mod:`stablejax.data.sources`; the config is
:class:`stablejax.data.config.DataConfig`.

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

import math
import os
from typing import Iterable, Optional

import grain
import numpy as np
from grain.experimental import WindowShuffleMapDataset

from stablejax.data.config import EMBEDDED, DataConfig, DataError, source_entries
from stablejax.data.sources import (BIN_SUFFIX, DEFAULT_BIN_VOCAB, Source, load_prepared,
                                    load_source, prepared_entry)

_Ranges = list[tuple[int, int]]  # usable [start, end) token ranges of a source


def _split_tail(ranges: _Ranges, n_tail: int) -> tuple[_Ranges, _Ranges]:
  """Splits usable ranges into (head, tail) where the tail holds the last n_tail tokens."""
  head, remaining = list(ranges), n_tail
  tail: _Ranges = []
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


def _window_table(ranges: _Ranges, window: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(range starts, range ends, cumulative window counts) for non-overlapping window slots."""
  starts = np.array([s for s, _ in ranges], np.int64)
  ends = np.array([e for _, e in ranges], np.int64)
  counts = (ends - starts) // window
  return starts, ends, np.cumsum(counts)


# ----------------------------------------------------------------------------- pipeline


class _WindowReader:
  """Maps a window slot index (+ jitter) to its token window; picklable for grain workers."""

  def __init__(self, tokens: np.ndarray, ranges: _Ranges, window: int):
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
               val_readers: list[_WindowReader], batch_size: int, process_index: int,
               process_count: int, num_threads: int):
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

    >>> from stablejax.data.config import DataConfig
    >>> from stablejax.data.pipeline import build_data
    >>> data = build_data(DataConfig(), seq_len=64, batch_size=4, seed=0)
    >>> data.vocab_size, data.stats["sources"][0]["name"]
    (256, 'pydoc')
    >>> batch = next(data.train_iter())
    >>> batch["tokens"].shape, batch["tokens"].dtype
    ((4, 65), dtype('int32'))
  """
  _validate(cfg, seq_len, batch_size, process_index, process_count)
  window = seq_len + 1
  train_entries = source_entries(cfg.train, "train")
  if not train_entries:
    raise DataError("data.train is empty: give a path or \"pydoc\"")
  val_entries = source_entries(cfg.val, "val")
  all_entries = train_entries + val_entries
  prepared = prepared_entry(train_entries, val_entries)
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
    train, prepared_val = load_prepared(path, meta)
  else:
    train = [load_source(e, cfg, "train", bin_vocab) for e in train_entries]
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


def _split(train: list[Source], prepared_val: Optional[Source], val_entries: list[str],
           cfg: DataConfig, window: int, bin_vocab: int
           ) -> tuple[list[_Ranges], list[tuple[Source, _Ranges]]]:
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
    val_ranges = [(s, s.ranges)
                  for s in (load_source(e, cfg, "val", bin_vocab) for e in val_entries)]
  return train_ranges, val_ranges


def _readers(sources: Iterable[tuple[Source, _Ranges]], window: int, split: str
             ) -> list[_WindowReader]:
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

