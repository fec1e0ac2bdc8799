"""A long document is tokenized a piece at a time (memory follows the piece, not the document),
with exactly the ids of encoding it whole, for tokenizers of several kinds."""

from __future__ import annotations

import random

import pytest

from stablejax.data import tokenizer as tokenizer_lib


def _text(n_words: int, seed: int = 0) -> str:
  rng = random.Random(seed)
  words = ["alpha", "Beta", "gamma's", "delta,", "über", "数学", "x=3.14", "  spaced", "\t", "\n",
           "\n\n", "don't", "  ", "end.", "1234567", "🙂", "naïve"]
  return "".join(rng.choice(words) + rng.choice(["", " ", " ", "  "]) for _ in range(n_words))


def _byte_level_bpe(tmp_path):
  return tokenizer_lib.train_bpe(iter([_text(3000, seed=1)]), 400, tmp_path / "byte.json")


def _hf(tmp_path, name, model, trainer, pre_tokenizer, normalizer=None, decoder=None):
  from tokenizers import Tokenizer
  tok = Tokenizer(model)
  tok.pre_tokenizer = pre_tokenizer
  if normalizer is not None:
    tok.normalizer = normalizer
  tok.train_from_iterator([_text(3000, seed=1)], trainer)
  path = tmp_path / f"{name}.json"
  tok.save(str(path))
  return tokenizer_lib.HFTokenizer(path, "<|endoftext|>")


def _whitespace_bpe(tmp_path):
  from tokenizers import models, pre_tokenizers, trainers
  return _hf(tmp_path, "whitespace", models.BPE(unk_token="[UNK]"),
             trainers.BpeTrainer(vocab_size=200, special_tokens=["<|endoftext|>", "[UNK]"]),
             pre_tokenizers.Whitespace())


def _metaspace_unigram(tmp_path):
  from tokenizers import models, normalizers, pre_tokenizers, trainers
  return _hf(tmp_path, "metaspace", models.Unigram(),
             trainers.UnigramTrainer(vocab_size=150, special_tokens=["<|endoftext|>", "<unk>"],
                                     unk_token="<unk>"),
             pre_tokenizers.Metaspace(prepend_scheme="always"),
             normalizers.Sequence([normalizers.NFKC(), normalizers.Strip()]))


@pytest.mark.parametrize("make", [_byte_level_bpe, _whitespace_bpe, _metaspace_unigram])
def test_a_long_document_in_pieces_has_the_ids_of_the_whole(tmp_path, make):
  tok = make(tmp_path)
  text = _text(6000, seed=2)
  whole = tok._ids([text])[0]
  tok.PIECE_CHARS = 700  # dozens of cuts in this text
  assert tok.encode(text) == whole
  assert tok.encode_batch(["short one", text, ""]) == [tok._ids(["short one"])[0], whole, []]
  cuts, start = 0, 0
  while len(text) - start > 2 * tok.PIECE_CHARS:
    cut = tok._cut_near(text, start + tok.PIECE_CHARS)
    if cut is None:
      break
    cuts, start = cuts + 1, cut
  assert cuts > 10  # it was cut, not encoded whole after all
