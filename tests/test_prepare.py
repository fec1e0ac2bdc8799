"""python -m stablejax prepare: tokenizers, inputs, the split, the files, errors, and the trainer
reading a prepared directory; prepare -> train -> sample end to end (slow)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

# datasets must never reach for the network here (set before it is first imported).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from stablejax.cli import prepare as prepare_cli  # noqa: E402
from stablejax.data import prepare as prep  # noqa: E402
from stablejax.data import tokenizer as tokenizer_lib  # noqa: E402
from stablejax.data.pipeline import DataConfig, DataError, build_data, read_prepared  # noqa: E402

from trainer_utils import ROOT, run_inprocess, slow  # noqa: E402

TEXT = "Grüße, naïve café — 数学 and emoji 🙂.\nTabs\tand  spaces\n\nNew paragraph: x = [1, 2, 3]\n"
DOCS = [f"Document {i}: " + ("the quick brown fox jumps over the lazy dog. " * (1 + i % 7))
        + f"Number {i * 37} ends it." for i in range(60)]


def blake_is_val(text: str, fraction: float) -> bool:
  """The documented split rule, re-derived from hashlib."""
  digest = hashlib.blake2b(text.strip().encode("utf-8"), digest_size=8).digest()
  return int.from_bytes(digest, "little") < fraction * 2**64


def write_inputs(tmp: Path, docs=DOCS) -> dict[str, Path]:
  import pyarrow as pa
  import pyarrow.parquet as pq
  text = tmp / "corpus.txt"
  text.write_text("<|endoftext|>".join(docs))
  jsonl = tmp / "corpus.jsonl"
  jsonl.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))
  parquet = tmp / "corpus.parquet"
  pq.write_table(pa.table({"text": docs, "id": list(range(len(docs)))}), parquet)
  return {"text": text, "jsonl": jsonl, "parquet": parquet}


def run_main(capsys, *args) -> tuple[int, str, str]:
  code = prepare_cli.main([*map(str, args), "--no-progress"])
  out = capsys.readouterr()
  return code, out.out, out.err


def tokens(out: Path, split: str) -> np.ndarray:
  meta = json.loads((out / "meta.json").read_text())
  return np.fromfile(out / f"{split}.bin", dtype=meta["dtype"])


def decoded_docs(out: Path, split: str) -> list[str]:
  meta = read_prepared(out)
  tok = tokenizer_lib.from_meta(meta, out)
  ids = tokens(out, split).tolist()
  assert ids and ids[-1] == meta["eot_id"]
  docs, start = [], 0
  for j, i in enumerate(ids):
    if i == meta["eot_id"]:
      docs.append(tok.decode(ids[start:j]))
      start = j + 1
  return docs


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
  """A bpe:300 directory prepared from the JSONL input; its tokenizer.json is reused below."""
  tmp = tmp_path_factory.mktemp("bpe")
  inputs = write_inputs(tmp)
  out = tmp / "out"
  prep.prepare([str(inputs["jsonl"])], out, "bpe:300", opts=prep.Options(val_fraction=0.2),
               progress=False, log=lambda line: None)
  return out


# ----------------------------------------------------------------------------- tokenizers


def test_round_trip_bytes_bpe_and_tokenizer_json(bpe_dir):
  for tok in (tokenizer_lib.get_tokenizer("bytes"),
              tokenizer_lib.get_tokenizer(str(bpe_dir / "tokenizer.json"))):
    for text in (TEXT, DOCS[3], "", " leading and trailing "):
      ids = tok.encode(text)
      assert tok.decode(ids) == text
      assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(tok.encode("a") + [tok.eot_id] + tok.encode("b")) == "a<|endoftext|>b"
  assert tokenizer_lib.get_tokenizer("bytes").encode("é") == [0xC3, 0xA9]


def test_bpe_is_trained_on_the_corpus(bpe_dir):
  meta = read_prepared(bpe_dir)
  assert meta["vocab_size"] == 300 and meta["tokenizer"]["kind"] == "hf"
  assert meta["eot_id"] == 0 and meta["dtype"] == "uint16"
  tok = tokenizer_lib.from_meta(meta, bpe_dir)
  # Merges learnt from the corpus: a frequent phrase takes far fewer tokens than bytes.
  phrase = "the quick brown fox jumps over the lazy dog."
  assert len(tok.encode(phrase)) < len(phrase.encode()) / 2


def test_gpt2_without_download_is_one_line_exit_2(tmp_path):
  env = dict(os.environ, TIKTOKEN_CACHE_DIR=str(tmp_path / "empty_cache"),
             HTTPS_PROXY="http://127.0.0.1:9", HTTP_PROXY="http://127.0.0.1:9",
             https_proxy="http://127.0.0.1:9", http_proxy="http://127.0.0.1:9")
  (tmp_path / "a.txt").write_text("hello")
  r = subprocess.run([sys.executable, "-m", "stablejax", "prepare", str(tmp_path / "a.txt"),
                      "--out", str(tmp_path / "out"), "--tokenizer", "gpt2"], env=env, cwd=ROOT,
                     capture_output=True, text=True, timeout=300)
  assert r.returncode == 2, r.stderr
  lines = r.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: tokenizer 'gpt2'")
  assert "bytes" in lines[0] and "bpe:N" in lines[0] and "tokenizer.json" in lines[0]
  assert not (tmp_path / "out" / "train.bin").exists()


# ----------------------------------------------------------------------------- inputs and output


@pytest.mark.parametrize("kind", ["text", "jsonl", "parquet"])
def test_each_input_format_gives_the_documents_and_split(tmp_path, capsys, kind):
  inputs = write_inputs(tmp_path)
  out = tmp_path / "out"
  code, stdout, _ = run_main(capsys, inputs[kind], "--out", out, "--tokenizer", "bytes",
                             "--val-fraction", "0.25")
  assert code == 0 and "prepared" in stdout
  meta = read_prepared(out)
  want_val = [d for d in DOCS if blake_is_val(d, 0.25)]
  want_train = [d for d in DOCS if not blake_is_val(d, 0.25)]
  assert 0 < len(want_val) < len(DOCS)
  assert decoded_docs(out, "train") == want_train
  assert decoded_docs(out, "val") == want_val
  assert meta["train_documents"] == len(want_train) and meta["val_documents"] == len(want_val)
  assert meta["train_tokens"] == sum(len(d.encode()) + 1 for d in want_train)
  assert meta["vocab_size"] == 256 and meta["eot_id"] == 0 and meta["dtype"] == "uint16"
  assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.bin", "val.bin"]


def test_hf_datasets_local_folder_equals_direct_jsonl(tmp_path, capsys):
  pytest.importorskip("datasets")
  inputs = write_inputs(tmp_path)
  folder = tmp_path / "hf_local"
  folder.mkdir()
  (folder / "train.jsonl").write_text(inputs["jsonl"].read_text())
  code, _, err = run_main(capsys, f"hf:{folder}", "--out", tmp_path / "hf", "--tokenizer", "bytes",
                          "--val-fraction", "0.25")
  assert code == 0, err
  code, _, _ = run_main(capsys, inputs["jsonl"], "--out", tmp_path / "direct", "--tokenizer",
                        "bytes", "--val-fraction", "0.25")
  assert code == 0
  for split in ("train", "val"):
    assert (tmp_path / "hf" / f"{split}.bin").read_bytes() == \
        (tmp_path / "direct" / f"{split}.bin").read_bytes()


def test_two_workers_write_the_same_files_as_one(tmp_path, capsys, bpe_dir):
  inputs = write_inputs(tmp_path, DOCS * 40)  # several batches
  prep.BATCH_BYTES, old = 20_000, prep.BATCH_BYTES
  try:
    for workers in (1, 2):
      code, _, err = run_main(capsys, inputs["parquet"], inputs["text"], "--out",
                              tmp_path / f"w{workers}", "--tokenizer", bpe_dir / "tokenizer.json",
                              "--workers", workers, "--val-fraction", "0.25")
      assert code == 0, err
  finally:
    prep.BATCH_BYTES = old
  for name in ("train.bin", "val.bin", "tokenizer.json"):
    assert (tmp_path / "w1" / name).read_bytes() == (tmp_path / "w2" / name).read_bytes()


def test_weights_and_source_ranges(tmp_path, capsys):
  inputs = write_inputs(tmp_path)
  (tmp_path / "other.txt").write_text("<|endoftext|>".join(f"Other {i} " * 20 for i in range(30)))
  out = tmp_path / "mix"
  code, _, err = run_main(capsys, inputs["text"], tmp_path / "other.txt", "--out", out,
                          "--tokenizer", "bytes", "--weights", "3", "1", "--val-fraction", "0.2")
  assert code == 0, err
  meta = read_prepared(out)
  a, b = meta["sources"]
  assert (a["weight"], b["weight"]) == (0.75, 0.25)
  assert a["train_range"][0] == 0 and a["train_range"][1] == b["train_range"][0]
  assert b["train_range"][1] == meta["train_tokens"]
  data = build_data(DataConfig(train=str(out)), seq_len=16, batch_size=4, seed=0)
  assert [s["weight"] for s in data.stats["sources"]] == [0.75, 0.25]
  assert data.vocab_size == 256 and data.stats["val_tokens"] == meta["val_tokens"]
  # Batches come from train.bin; validation windows from val.bin.
  train_ids = tokens(out, "train")
  row = next(data.train_iter())["tokens"][0]
  hay = train_ids.astype(np.int64)
  assert any(np.array_equal(hay[i:i + row.size], row) for i in range(hay.size - row.size + 1))
  val_row = data.val_batches(1)[0]["tokens"][0]
  assert np.array_equal(tokens(out, "val")[:val_row.size], val_row)


def test_large_vocabulary_is_uint32_and_uint16_is_refused(tmp_path, capsys):
  from tokenizers import Tokenizer, models, pre_tokenizers
  vocab = {"<|endoftext|>": 0, "[UNK]": 1, **{f"w{i}": i + 2 for i in range(70_000)}}
  tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.save(str(tmp_path / "big.json"))
  (tmp_path / "a.txt").write_text("<|endoftext|>".join(f"w1 w69999 w{i}" for i in range(40)))
  code, _, err = run_main(capsys, tmp_path / "a.txt", "--out", tmp_path / "o", "--tokenizer",
                          tmp_path / "big.json", "--val-fraction", "0.3")
  assert code == 0, err
  meta = read_prepared(tmp_path / "o")
  assert meta["dtype"] == "uint32" and meta["vocab_size"] == 70_002
  assert 70_001 in tokens(tmp_path / "o", "train")
  code, _, err = run_main(capsys, tmp_path / "a.txt", "--out", tmp_path / "o16", "--tokenizer",
                          tmp_path / "big.json", "--dtype", "uint16")
  assert code == 2 and len(err.strip().splitlines()) == 1 and "uint16" in err


def test_complete_directory_is_not_redone_and_other_settings_need_force(tmp_path, capsys):
  inputs = write_inputs(tmp_path)
  out = tmp_path / "out"
  args = [inputs["text"], "--out", out, "--tokenizer", "bytes", "--val-fraction", "0.2"]
  assert run_main(capsys, *args)[0] == 0
  stamp = (out / "train.bin").stat().st_mtime_ns
  code, stdout, _ = run_main(capsys, *args)
  assert code == 0 and "already prepared" in stdout
  assert (out / "train.bin").stat().st_mtime_ns == stamp
  code, _, err = run_main(capsys, *args[:-1], "0.3")
  assert code == 2 and "--force" in err
  assert run_main(capsys, *args[:-1], "0.3", "--force")[0] == 0
  assert read_prepared(out)["split"]["val_fraction"] == 0.3


def test_failed_prepare_leaves_nothing_the_trainer_accepts(tmp_path, capsys):
  inputs = write_inputs(tmp_path)
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"text": "fine"}\n{"body": "no text field"}\n')
  out = tmp_path / "out"
  code, _, err = run_main(capsys, inputs["text"], bad, "--out", out, "--tokenizer", "bytes")
  assert code == 2 and "bad.jsonl:2" in err and "'text'" in err
  assert list(out.iterdir()) == []  # the partial files of the first input were removed
  # A directory whose files do not match meta.json (a prepare cut off mid-rename, or a file
  # changed later) is refused by the trainer.
  good = tmp_path / "good"
  assert run_main(capsys, inputs["text"], "--out", good, "--tokenizer", "bytes",
                  "--val-fraction", "0.2")[0] == 0
  with open(good / "train.bin", "r+b") as f:
    f.truncate(100)
  with pytest.raises(DataError, match="did not finish"):
    build_data(DataConfig(train=str(good)), seq_len=16, batch_size=4, seed=0)


@pytest.mark.parametrize("case,needle", [
    ("missing", "does not exist"),
    ("empty", "is empty"),
    ("field", "no field 'body'"),
    ("parquet_field", "no column 'body'"),
    ("bad_parquet", "unreadable Parquet"),
    ("tokenizer", "unknown tokenizer"),
    ("bpe_small", "at least 257"),
    ("hf_offline", "cannot load Hugging Face dataset"),
    ("no_val", "validation split"),
])
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, case, needle):
  inputs = write_inputs(tmp_path)
  (tmp_path / "empty.txt").write_text("")
  (tmp_path / "bad.parquet").write_bytes(b"PAR1 this is not parquet")
  args = {
      "missing": [tmp_path / "nope.txt", "--tokenizer", "bytes"],
      "empty": [tmp_path / "empty.txt", "--tokenizer", "bytes"],
      "field": [inputs["jsonl"], "--tokenizer", "bytes", "--text-field", "body"],
      "parquet_field": [inputs["parquet"], "--tokenizer", "bytes", "--text-field", "body"],
      "bad_parquet": [tmp_path / "bad.parquet", "--tokenizer", "bytes"],
      "tokenizer": [inputs["text"], "--tokenizer", "sentencepiece"],
      "bpe_small": [inputs["text"], "--tokenizer", "bpe:100"],
      "hf_offline": ["hf:no-such-user/no-such-dataset", "--tokenizer", "bytes"],
      "no_val": [inputs["text"], "--tokenizer", "bytes", "--val-fraction", "0.0001"],
  }[case]
  code, _, err = run_main(capsys, *args, "--out", tmp_path / "out")
  lines = err.strip().splitlines()
  assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
  assert needle in lines[0], lines[0]
  assert not (tmp_path / "out" / "meta.json").exists()


def test_text_separator_split_across_read_blocks(tmp_path):
  sep = "<|endoftext|>"
  docs = ["a" * ((1 << 20) - 5), "b" * 10, "c" * (1 << 20)]  # separators straddle 1 MiB blocks
  path = tmp_path / "t.txt"
  path.write_text(sep.join(docs))
  got = [d.decode() for d in prep._text_documents(path, prep.Options())]
  assert got == docs


# ----------------------------------------------------------------------------- the trainer


def test_config_takes_vocab_from_meta_and_rejects_a_smaller_one(tmp_path, bpe_dir):
  from stablejax.training.config import config_from_dict
  cfg = config_from_dict({"data": {"train": str(bpe_dir)}})
  assert cfg.model.vocab_size == 320  # 300 padded to a multiple of 64
  cfg = config_from_dict({"data": {"train": str(bpe_dir)}, "model": {"vocab_size": 384}})
  assert cfg.model.vocab_size == 384
  code = run_inprocess(tmp_path / "run", f"data.train={bpe_dir}", "model.vocab_size=256")
  assert code == 2


@slow
@pytest.mark.parametrize("kind,tokenizer", [("text", "bytes"), ("jsonl", "bpe:300"),
                                            ("parquet", "tokenizer.json")])
def test_prepare_train_sample_end_to_end(tmp_path, capsys, bpe_dir, kind, tokenizer):
  from stablejax.training import sampling as sample_lib
  inputs = write_inputs(tmp_path, DOCS * 3)
  spec = bpe_dir / "tokenizer.json" if tokenizer == "tokenizer.json" else tokenizer
  data_dir = tmp_path / "data"
  code, _, err = run_main(capsys, inputs[kind], "--out", data_dir, "--tokenizer", spec,
                          "--val-fraction", "0.3")
  assert code == 0, err
  run = tmp_path / "run"
  assert run_inprocess(run, f"data.train={data_dir}", "train.steps=12", "train.eval_every=12",
                       "checkpoint.every=12", "logging.sample_every=12",
                       "logging.sample_tokens=8") == 0
  printed = capsys.readouterr().out
  assert "step 12: sample " in printed
  meta = read_prepared(data_dir)
  config = json.loads((run / "config.json").read_text())
  assert config["model"]["vocab_size"] == -(-meta["vocab_size"] // 64) * 64
  kwargs = dict(prompt="Document 1", max_new_tokens=12, temperature=0.8, top_k=20)
  a = sample_lib.sample(run, seed=0, **kwargs)
  b = sample_lib.sample(run, seed=0, **kwargs)
  c = sample_lib.sample(run, seed=1, **kwargs)
  assert a["samples"] == b["samples"] and a["tokens"] == b["tokens"]
  assert a["tokens"] != c["tokens"]
  assert a["samples"][0].startswith("Document 1") and len(a["tokens"][0]) == 12
  assert all(0 <= t < meta["vocab_size"] for t in a["tokens"][0])
  tok = tokenizer_lib.from_meta(meta, data_dir)
  prompt_ids = tok.encode("Document 1")
  assert a["samples"][0] == "Document 1" + tok.decode(prompt_ids + a["tokens"][0])[
      len(tok.decode(prompt_ids)):]
