"""Tokenizers: the end-of-text id separates documents and nothing else produces it; decode shows
it as <|endoftext|>; a tokenizer.json's end-of-text token is the documented one."""

import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from stablejax.data import tokenizer as tokenizer_lib

EOT = tokenizer_lib.EOT_TEXT


def _word_level(path, vocab):
  tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.save(str(path))
  return path


def test_bytes_nul_is_dropped_and_decode_shows_end_of_text():
  tok = tokenizer_lib.BytesTokenizer()
  assert tok.encode("a\x00b") == [97, 98]
  assert tok.eot_id == 0 and tok.vocab_size == 256
  assert tok.decode([104, 105, 0, 106]) == f"hi{EOT}j"
  assert tok.decode(tok.encode("héllo") + [0]) == f"héllo{EOT}"


def test_bpe_needs_room_for_the_bytes_and_end_of_text():
  assert tokenizer_lib.parse_bpe_size("bpe:257") == 257
  for spec in ("bpe:256", "bpe:10"):
    with pytest.raises(tokenizer_lib.TokenizerError, match="at least 257"):
      tokenizer_lib.parse_bpe_size(spec)
  assert tokenizer_lib.parse_bpe_size("bytes") is None


def test_trained_bpe_encodes_a_literal_end_of_text_as_text(tmp_path):
  tok = tokenizer_lib.train_bpe(iter(["hello world, the quick brown fox"] * 20), 300,
                                tmp_path / "tokenizer.json")
  assert tok.eot_token == EOT and tok.eot_id == 0
  ids = tok.encode(f"hello {EOT} world")
  assert tok.eot_id not in ids
  assert tok.decode(ids) == f"hello {EOT} world"
  assert tok.decode(tok.encode("ab") + [tok.eot_id] + tok.encode("cd")) == f"ab{EOT}cd"


def test_end_of_text_names_in_order_and_the_chosen_one(tmp_path):
  vocab = {"[UNK]": 0, "</s>": 1, EOT: 2, "a": 3, "b": 4}
  path = _word_level(tmp_path / "tokenizer.json", vocab)
  assert tokenizer_lib.HFTokenizer(path).eot_id == 2          # <|endoftext|> comes first
  chosen = tokenizer_lib.HFTokenizer(path, eot_token="</s>")
  assert chosen.eot_token == "</s>" and chosen.eot_id == 1
  meta = {"tokenizer": {"kind": "hf", "file": "tokenizer.json", "eot_token": "</s>"}}
  assert tokenizer_lib.from_meta(meta, tmp_path).eot_id == 1   # the prepared directory's choice
  with pytest.raises(tokenizer_lib.TokenizerError, match="no end-of-text token"):
    tokenizer_lib.HFTokenizer(path, eot_token="<eos>")


def test_vocab_size_holds_the_largest_id(tmp_path):
  vocab = {"[UNK]": 0, EOT: 1, "a": 2, "z": 7}   # ids with a gap: 7 must fit
  tok = tokenizer_lib.HFTokenizer(_word_level(tmp_path / "t.json", vocab))
  assert tok.vocab_size == 8
  assert json.loads((tmp_path / "t.json").read_text())["model"]["vocab"]["z"] == 7
