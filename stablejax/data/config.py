"""The settings of the data code and the errors it reports, below every other data module.

The trainer's ``data`` section is a `DataConfig`; a source it cannot use is a `DataError`.
``python -m stablejax prepare`` takes its document options as `Options`; bad input to it is a
`PrepareError`. Both errors carry one line naming the problem and the fix.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional, Sequence, Union

from stablejax.data import tokenizer as tokenizer_lib
from stablejax.data.paths import PathError, checked_path

# The embedded corpus (Python's documentation topics): a source of the trainer and an INPUT of
# prepare, needing no download.
EMBEDDED = "pydoc"
TEXT_FIELD = "text"                  # prepare: the JSON/Parquet field that holds the text
SEPARATOR = tokenizer_lib.EOT_TEXT   # prepare: what separates documents in a text file


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
    >>> from stablejax.data.config import DataConfig
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


def source_entries(value: Union[str, os.PathLike, Sequence[Union[str, os.PathLike]], None],
                   key: str) -> list[str]:
  """The sources ``data.<key>`` names, as a list of strings ([] for None).

  Raises:
    DataError: an empty list, an entry that is not a string or path, or a path no program can
      use (:func:`stablejax.data.paths.checked_path`: empty, a loop of symbolic links, a name
      too long).
  """
  if value is None:
    return []
  items = [value] if isinstance(value, (str, os.PathLike)) else list(value)
  if not items:
    raise DataError(f"data.{key} is an empty list: give at least one source (e.g. \"pydoc\")")
  for item in items:
    if not isinstance(item, (str, os.PathLike)):
      raise DataError(f"data.{key} entry {item!r} is not a string: give a path or \"pydoc\"")
    if item != EMBEDDED:
      try:
        checked_path(item, f"data.{key}")
      except PathError as e:
        raise DataError(str(e)) from None
  return [os.fspath(i) for i in items]


class PrepareError(Exception):
  """Bad input; the message is one line naming the problem and the fix."""


@dataclasses.dataclass
class Options:
  """What ``python -m stablejax prepare`` counts as a document, and which documents it keeps.

  ``text_field`` names the text of a JSON record, Parquet row or dataset record; ``separator``
  splits a text file into documents; ``hf_split`` is the split of an ``hf:`` dataset. A document
  goes to validation by its hash (``val_fraction``) and is dropped by the trainer's filter
  (``filter_max_repeat``, ``filter_max_nontext``).

  Example:
    >>> from stablejax.data.config import Options
    >>> Options(val_fraction=0.05).separator
    '<|endoftext|>'
  """

  text_field: str = TEXT_FIELD
  separator: str = SEPARATOR
  hf_split: str = "train"
  val_fraction: float = 0.005
  filter_max_repeat: int = 256
  filter_max_nontext: float = 0.3
