"""Tokenizers for prepared corpora, the trainer's samples and ``python -m stablejax sample``.

Four kinds, each with an end-of-text id that separates documents:

  * ``bytes``: UTF-8 bytes, vocabulary 256. The NUL byte (id 0) is the end-of-text token, so
    ``encode`` drops NUL characters from the text (the trainer's text filter treats them as
    garbage anyway).
  * ``gpt2``: tiktoken's GPT-2 encoding (vocabulary 50257, end-of-text 50256). tiktoken downloads
    its files once into a cache (``TIKTOKEN_CACHE_DIR``); without network and cache this is a
    ``TokenizerError`` naming the alternatives.
  * a path to a Hugging Face ``tokenizer.json`` (``tokenizers.Tokenizer.from_file``); its
    end-of-text token is the first of ``EOT_NAMES`` in its vocabulary.
  * ``bpe:N``: a byte-level BPE of vocabulary N trained with Hugging Face ``tokenizers`` on the
    corpus (``train_bpe``), saved as ``tokenizer.json`` and from then on loaded as a path.

``encode`` treats its text as ordinary text with every kind: a literal ``<|endoftext|>`` (or
another special token's string) in it never becomes the end-of-text id (tiktoken's
``encode_ordinary``; ``encode_special_tokens`` for Hugging Face tokenizers), so only the id a
caller appends separates documents. ``decode`` renders the end-of-text id as ``<|endoftext|>`` for
every kind, so ``decode(encode(text)) == text`` for any text (without NUL characters for
``bytes``).

Example::

    tok = get_tokenizer("bytes")
    ids = tok.encode("héllo")          # [104, 195, 169, 108, 108, 111]
    tok.decode(ids + [tok.eot_id])     # "héllo<|endoftext|>"
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence, Union

EOT_TEXT = "<|endoftext|>"
# End-of-text names looked up in a tokenizer.json, in this order.
EOT_NAMES = (EOT_TEXT, "</s>", "<eos>", "<|end_of_text|>", "[SEP]", "<|im_end|>")
KINDS_HELP = "bytes, gpt2, a path to a tokenizer.json, or bpe:N (e.g. bpe:32000)"


class TokenizerError(ValueError):
  """A tokenizer that cannot be loaded; one line naming the problem and the alternatives."""


class BytesTokenizer:
  """UTF-8 bytes as tokens; NUL (id 0) is the end-of-text token."""

  kind = "bytes"
  # The prompt of an empty sample; set by whoever loads the tokenizer for a run.
  start_ids: list[int]
  vocab_size = 256
  eot_id = 0

  def encode(self, text: str) -> list[int]:
    return list(text.replace("\x00", "").encode("utf-8", "replace"))

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return [self.encode(t) for t in texts]

  def decode(self, ids: Iterable[int]) -> str:
    parts, run = [], bytearray()
    for i in ids:
      if i == self.eot_id:
        parts.append(run.decode("utf-8", "replace") + EOT_TEXT)
        run = bytearray()
      else:
        run.append(int(i))
    return "".join(parts) + run.decode("utf-8", "replace")

  def describe(self) -> dict:
    return {"kind": "bytes"}


class TiktokenTokenizer:
  """A tiktoken encoding (``gpt2``); special tokens in the text are encoded as plain text."""

  kind = "tiktoken"
  # The prompt of an empty sample; set by whoever loads the tokenizer for a run.
  start_ids: list[int]

  def __init__(self, name: str):
    import tiktoken
    try:
      self._enc = tiktoken.get_encoding(name)
    except Exception as e:  # noqa: BLE001 - any download or cache failure is the same error
      raise TokenizerError(
          f"tokenizer {name!r} needs tiktoken's {name} files, which are not cached and could not "
          f"be downloaded ({type(e).__name__}): use --tokenizer bytes, bpe:N (trained "
          f"here, offline) or a local tokenizer.json, or copy tiktoken's cache into "
          f"TIKTOKEN_CACHE_DIR") from None
    self.name = name
    self.vocab_size = self._enc.n_vocab
    self.eot_id = self._enc.eot_token

  def encode(self, text: str) -> list[int]:
    return self._enc.encode_ordinary(text)

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return self._enc.encode_ordinary_batch(list(texts), num_threads=1)

  def decode(self, ids: Iterable[int]) -> str:
    return self._enc.decode([int(i) for i in ids], errors="replace")

  def describe(self) -> dict:
    return {"kind": "tiktoken", "name": self.name}


class HFTokenizer:
  """A Hugging Face ``tokenizers`` tokenizer loaded from a ``tokenizer.json``."""

  kind = "hf"
  # The prompt of an empty sample; set by whoever loads the tokenizer for a run.
  start_ids: list[int]

  def __init__(self, path: str | os.PathLike, eot_token: Optional[str] = None):
    from tokenizers import Tokenizer
    path = Path(path)
    if not path.is_file():
      raise TokenizerError(f"tokenizer file {str(path)!r} does not exist: give a tokenizer.json "
                           f"path, or one of {KINDS_HELP}")
    try:
      self._tok = Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - the library raises a plain Exception
      raise TokenizerError(f"{str(path)!r} is not a Hugging Face tokenizer.json ({e}): give the "
                           f"tokenizer.json file of a tokenizers/transformers tokenizer") from None
    # Text is text: a literal "<|endoftext|>" (or any special token's string) in a document is
    # encoded as ordinary characters, like tiktoken's encode_ordinary; only the id a caller
    # appends is end-of-text.
    self._tok.encode_special_tokens = True
    self.path = path
    self.sha256 = hashlib.sha256(path.read_bytes()).hexdigest()
    vocab = self._tok.get_vocab(with_added_tokens=True)
    names = [eot_token] if eot_token else list(EOT_NAMES)
    found = [n for n in names if n in vocab]
    if not found:
      raise TokenizerError(f"{str(path)!r} has no end-of-text token ({', '.join(names)}): pass "
                           f"--eot-token NAME with the token that ends a document")
    self.eot_token = found[0]
    self.eot_id = vocab[self.eot_token]
    self.vocab_size = max(self._tok.get_vocab_size(with_added_tokens=True), max(vocab.values()) + 1)

  # A document longer than two pieces is encoded a piece at a time, so that memory follows the
  # piece (the library's encoding keeps strings and offsets for every token: about 1.5 GB for a
  # 12 MB line), cut where the tokenizer's own cut lies (`_cut_near`): the ids are the same.
  PIECE_CHARS = 1 << 20

  def encode(self, text: str) -> list[int]:
    return self.encode_batch([text])[0]

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    texts = list(texts)
    out: list[list[int]] = [[] for _ in texts]
    short = [i for i, t in enumerate(texts) if len(t) <= 2 * self.PIECE_CHARS]
    for i, ids in zip(short, self._ids([texts[i] for i in short])):
      out[i] = ids
    for i in sorted(set(range(len(texts))) - set(short)):
      out[i] = self._encode_long(texts[i])
    return out

  def _ids(self, texts: list[str]) -> list[list[int]]:
    # encode_batch_fast: the same ids without the offsets (tokenizers >= 0.20)
    encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
    return [e.ids for e in encode(texts, add_special_tokens=False)] if texts else []

  def _encode_long(self, text: str) -> list[int]:
    ids: list[int] = []
    start = 0
    while len(text) - start > 2 * self.PIECE_CHARS:
      cut = self._cut_near(text, start + self.PIECE_CHARS)
      if cut is None:
        break  # no place found where a cut changes nothing: the rest in one go
      ids += self._ids([text[start:cut]])[0]
      start = cut
    return ids + self._ids([text[start:]])[0]

  def _cut_near(self, text: str, position: int, window: int = 256, tries: int = 16,
                reach: int = 1 << 16) -> Optional[int]:
    """A position at or after ``position`` where cutting the text changes no id: the start of a
    whitespace run after a non-space character, where the text around it (``window`` characters
    each side) encodes the same cut and whole. (Normalisers and pre-tokenizers are local, so
    that test holds for the whole text.) None when none of the first ``tries`` candidates within
    ``reach`` characters passes."""
    tried = 0
    for i in range(max(position, 1), min(position + reach, len(text) - 1)):
      if not (text[i].isspace() and not text[i - 1].isspace()):
        continue
      left, right = text[max(0, i - window):i], text[i:i + window]
      pieces = self._ids([left, right, left + right])
      if pieces[0] + pieces[1] == pieces[2]:
        return i
      tried += 1
      if tried == tries:
        return None
    return None

  def decode(self, ids: Iterable[int]) -> str:
    ids = [int(i) for i in ids]
    # Decode document by document so the end-of-text token shows as text whatever its name.
    parts, start = [], 0
    for j, i in enumerate(ids + [self.eot_id]):
      if i == self.eot_id:
        parts.append(self._tok.decode(ids[start:j], skip_special_tokens=False))
        start = j + 1
    return EOT_TEXT.join(parts)

  def describe(self) -> dict:
    return {"kind": "hf", "file": self.path.name, "eot_token": self.eot_token,
            "sha256": self.sha256}


# Any of the tokenizers above: they share encode, encode_batch, decode, describe and eot_id.
Tokenizer = Union[BytesTokenizer, TiktokenTokenizer, HFTokenizer]


def get_tokenizer(spec: str, eot_token: Optional[str] = None) -> Tokenizer:
  """Loads ``bytes``, ``gpt2`` (or another tiktoken encoding name) or a tokenizer.json path.

  ``bpe:N`` is not loadable: it is trained on a corpus (``train_bpe``).

  Args:
    spec: ``"bytes"``, a tiktoken encoding name (``"gpt2"``, ``"cl100k_base"``, ...), or the path
      of a Hugging Face ``tokenizer.json`` (or of a directory holding one).
    eot_token: the end-of-text token of a ``tokenizer.json`` (default: the first known name,
      such as ``<|endoftext|>`` or ``</s>``).

  Returns:
    A tokenizer with ``encode``, ``decode``, ``vocab_size`` and ``eot_id``.

  Raises:
    TokenizerError: unknown spec, missing file, no end-of-text token, or an encoding that needs
      a download that failed.

  Example:
    >>> from stablejax.data.tokenizer import get_tokenizer
    >>> tok = get_tokenizer("bytes")
    >>> tok.encode("hi"), tok.decode([104, 105]), tok.vocab_size, tok.eot_id
    ([104, 105], 'hi', 256, 0)
  """
  if spec == "bytes":
    return BytesTokenizer()
  if spec in ("gpt2", "r50k_base", "p50k_base", "cl100k_base", "o200k_base"):
    return TiktokenTokenizer(spec)
  if spec.startswith("bpe:"):
    raise TokenizerError(f"{spec!r} is trained on a corpus by python -m stablejax prepare, not "
                         f"loaded: use the prepared directory's tokenizer.json")
  if spec.endswith(".json") or os.path.sep in spec or os.path.exists(spec):
    path = Path(spec)
    if path.is_dir():
      path = path / "tokenizer.json"
    return HFTokenizer(path, eot_token)
  raise TokenizerError(f"unknown tokenizer {spec!r}: use {KINDS_HELP}")


def parse_bpe_size(spec: str) -> Optional[int]:
  """N for ``bpe:N``, None for other specs; raises TokenizerError for a malformed N."""
  if not spec.startswith("bpe:"):
    return None
  try:
    n = int(spec[4:])
  except ValueError:
    raise TokenizerError(f"{spec!r}: N in bpe:N must be an integer, e.g. bpe:32000") from None
  if n < 257:
    raise TokenizerError(f"{spec!r}: a byte-level BPE needs a vocabulary of at least 257 (256 "
                         f"bytes + end-of-text): use e.g. bpe:4096")
  return n


def train_bpe(texts: Iterator[str], vocab_size: int, path: str | os.PathLike,
              show_progress: bool = False) -> HFTokenizer:
  """Trains a GPT-2-style byte-level BPE with Hugging Face ``tokenizers`` and saves it.

  Args:
    texts: the training documents (streamed; only the BPE's pair counts are held in memory).
    vocab_size: final vocabulary size, end-of-text (id 0) and the 256 byte symbols included.
    path: where to write the ``tokenizer.json``.
    show_progress: the library's own progress bar.

  Returns:
    The trained tokenizer, loaded back from ``path``.
  """
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT_TEXT],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=show_progress)
  tok.train_from_iterator(texts, trainer=trainer)
  tok.save(str(path))
  return HFTokenizer(path)


def from_meta(meta: dict, directory: str | os.PathLike) -> Tokenizer:
  """The tokenizer a prepared directory's ``meta.json`` names."""
  info = meta.get("tokenizer", {})
  kind = info.get("kind")
  if kind == "bytes":
    return BytesTokenizer()
  if kind == "tiktoken":
    return TiktokenTokenizer(info.get("name", "gpt2"))
  if kind == "hf":
    return HFTokenizer(Path(directory) / info.get("file", "tokenizer.json"), info.get("eot_token"))
  raise TokenizerError(f"{Path(directory) / 'meta.json'} names an unknown tokenizer "
                       f"{json.dumps(info)}: prepare the directory again")
