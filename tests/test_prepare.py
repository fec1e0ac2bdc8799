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
from stablejax.data import encode, prepared  # noqa: E402
from stablejax.data import inputs as inputs_lib  # noqa: E402
from stablejax.data import prepare as prep  # noqa: E402
from stablejax.data import tokenizer as tokenizer_lib  # noqa: E402
from stablejax.data.config import DataConfig, DataError  # noqa: E402
from stablejax.data.pipeline import build_data  # noqa: E402
from stablejax.data.prepared import read_prepared  # noqa: E402

from helpers import ROOT, run_inprocess, slow  # noqa: E402

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


def test_two_workers_write_the_same_files_as_one(tmp_path, capsys, bpe_dir, monkeypatch):
  inputs = write_inputs(tmp_path, DOCS * 40)  # several batches
  monkeypatch.setattr(encode, "BATCH_BYTES", 20_000)
  for workers in (1, 2):
    code, _, err = run_main(capsys, inputs["parquet"], inputs["text"], "--out",
                            tmp_path / f"w{workers}", "--tokenizer", bpe_dir / "tokenizer.json",
                            "--workers", workers, "--val-fraction", "0.25")
    assert code == 0, err
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


@pytest.mark.parametrize("vocab_size,dtype", [(65_536, "uint16"), (65_537, "uint32")])
def test_uint16_holds_a_vocabulary_of_exactly_65536(tmp_path, capsys, vocab_size, dtype):
  # uint16 holds ids 0..65535: a vocabulary of 65,536 fits, one of 65,537 (largest id 65,536,
  # which uint16 would wrap to 0) does not. The trainer reads each back with its own dtype.
  from tokenizers import Tokenizer, models, pre_tokenizers
  top = vocab_size - 1
  vocab = {"<|endoftext|>": 0, "[UNK]": 1, **{f"w{i}": i for i in range(2, vocab_size)}}
  tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.save(str(tmp_path / "tok.json"))
  (tmp_path / "a.txt").write_text("<|endoftext|>".join(f"w{top} w2 w{top} w{3 + i} w{top}"
                                                       for i in range(60)))
  out = tmp_path / "o"
  code, _, err = run_main(capsys, tmp_path / "a.txt", "--out", out, "--tokenizer",
                          tmp_path / "tok.json", "--val-fraction", "0.3")
  assert code == 0, err
  meta = read_prepared(out)
  assert meta["vocab_size"] == vocab_size and meta["dtype"] == dtype
  train = tokens(out, "train")
  assert train.dtype == np.dtype(dtype)
  assert (os.path.getsize(out / "train.bin") == meta["train_tokens"] * np.dtype(dtype).itemsize)
  assert np.count_nonzero(train == top) == 3 * np.count_nonzero(train == 0)  # nothing wrapped
  data = build_data(DataConfig(train=str(out)), seq_len=4, batch_size=2, seed=0)
  assert data.vocab_size == vocab_size
  hay = train.astype(np.int64)
  for row in next(data.train_iter())["tokens"]:
    assert row.max() <= top
    assert any(np.array_equal(hay[i:i + row.size], row) for i in range(hay.size - row.size + 1))


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
  # The partial files of the first input were removed, and the folder this run created too (a
  # failed prepare leaves no empty --out behind).
  assert not out.exists()
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
  got = [d.decode() for d in inputs_lib._text_documents(path, prep.Options())]
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
  from stablejax.training.trained import sampling as sample_lib
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


# ----------------------------------------------------------------------------- files in --out


def one_error_line(err: str) -> str:
  lines = err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), err
  return lines[0]


def snapshot(folder: Path) -> dict[str, bytes]:
  return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_files_prepare_did_not_write_are_refused_without_force(tmp_path, capsys):
  inputs = write_inputs(tmp_path)
  out = tmp_path / "nanogpt"
  out.mkdir()
  (out / "train.bin").write_bytes(np.arange(100, dtype=np.uint16).tobytes())
  (out / "val.bin").write_bytes(np.arange(10, dtype=np.uint16).tobytes())
  (out / "meta.json").write_text('{"vocab_size": 50257}\n')  # a user's own meta.json
  (out / "notes.txt").write_text("mine")
  before = snapshot(out)
  code, _, err = run_main(capsys, inputs["text"], "--out", out, "--tokenizer", "bytes",
                          "--val-fraction", "0.2")
  line = one_error_line(err)
  assert code == 2 and "--force" in line
  assert all(n in line for n in ("train.bin", "val.bin", "meta.json")) and "notes.txt" not in line
  assert snapshot(out) == before  # nothing touched
  # --force replaces exactly the files in the way; other files stay.
  code, _, err = run_main(capsys, inputs["text"], "--out", out, "--tokenizer", "bytes",
                          "--val-fraction", "0.2", "--force")
  assert code == 0, err
  assert read_prepared(out)["train_documents"] > 0 and (out / "notes.txt").read_text() == "mine"
  assert sorted(p.name for p in out.iterdir()) == ["meta.json", "notes.txt", "train.bin",
                                                    "val.bin"]


def test_a_file_of_another_name_or_an_unused_tokenizer_json_is_left_alone(tmp_path, capsys):
  inputs = write_inputs(tmp_path)
  out = tmp_path / "out"
  out.mkdir()
  (out / "tokenizer.json").write_text("not even JSON")  # bytes writes no tokenizer.json
  code, _, err = run_main(capsys, inputs["text"], "--out", out, "--tokenizer", "bytes",
                          "--val-fraction", "0.2")
  assert code == 0, err
  assert (out / "tokenizer.json").read_text() == "not even JSON"
  # prepare's partial files have names of their own (NAME.<process>-<random>.partial), so a
  # train.bin.partial of another program is left alone; a meta.json.partial (the name of
  # prepare's record of a run in progress) that is not prepare's is refused.
  other = tmp_path / "other"
  other.mkdir()
  (other / "train.bin.partial").write_text("someone's download")
  code, _, err = run_main(capsys, inputs["text"], "--out", other, "--tokenizer", "bytes",
                          "--val-fraction", "0.2")
  assert code == 0, err
  assert (other / "train.bin.partial").read_text() == "someone's download"
  assert sorted(p.name for p in other.iterdir()) == ["meta.json", "train.bin",
                                                      "train.bin.partial", "val.bin"]
  third = tmp_path / "third"
  third.mkdir()
  (third / "meta.json.partial").write_text("someone's notes")
  code, _, err = run_main(capsys, inputs["text"], "--out", third, "--tokenizer", "bytes")
  assert code == 2 and "meta.json.partial" in one_error_line(err)
  assert snapshot(third) == {"meta.json.partial": b"someone's notes"}


@pytest.mark.parametrize("spec", ["file", "folder"])
def test_the_tokenizer_in_out_is_used_in_place_and_never_deleted(tmp_path, capsys, bpe_dir, spec):
  """--tokenizer DIR/tokenizer.json --out DIR (a user's tokenizer, then a re-prepare with
  --force and the directory's own tokenizer)."""
  inputs = write_inputs(tmp_path)
  out = tmp_path / "out"
  out.mkdir()
  original = (bpe_dir / "tokenizer.json").read_bytes()
  (out / "tokenizer.json").write_bytes(original)
  inode = (out / "tokenizer.json").stat().st_ino
  given = out / "tokenizer.json" if spec == "file" else out
  code, _, err = run_main(capsys, inputs["text"], "--out", out, "--tokenizer", given,
                          "--val-fraction", "0.25")
  assert code == 0, err
  assert (out / "tokenizer.json").read_bytes() == original
  assert (out / "tokenizer.json").stat().st_ino == inode  # read in place, not rewritten
  assert decoded_docs(out, "train") == [d for d in DOCS if not blake_is_val(d, 0.25)]
  # Re-prepare other inputs with the directory's own tokenizer, --force: it survives again.
  code, _, err = run_main(capsys, inputs["jsonl"], inputs["parquet"], "--out", out,
                          "--tokenizer", given, "--val-fraction", "0.25", "--force")
  assert code == 0, err
  assert (out / "tokenizer.json").read_bytes() == original
  assert read_prepared(out)["documents"] == 2 * len(DOCS)
  # A later prepare with another tokenizer must not take the user's tokenizer.json for its own.
  code, _, err = run_main(capsys, inputs["text"], "--out", out, "--tokenizer", "bpe:280",
                          "--val-fraction", "0.25", "--force")
  assert code == 0, err
  assert (out / "tokenizer.json").read_bytes() != original  # replaced: --force was given


def test_reprepare_with_the_directorys_own_bpe_tokenizer(tmp_path, capsys):
  inputs = write_inputs(tmp_path)
  out = tmp_path / "out"
  assert run_main(capsys, inputs["text"], "--out", out, "--tokenizer", "bpe:300",
                  "--val-fraction", "0.25")[0] == 0
  trained = (out / "tokenizer.json").read_bytes()
  for extra in ([], ["--force"]):
    code, _, err = run_main(capsys, inputs["jsonl"], "--out", out, "--tokenizer",
                            out / "tokenizer.json", "--val-fraction", "0.25", *extra)
    if not extra:  # other settings: refused, nothing touched
      assert code == 2 and "--force" in one_error_line(err)
      assert (out / "tokenizer.json").read_bytes() == trained
      continue
    assert code == 0, err
  assert (out / "tokenizer.json").read_bytes() == trained
  assert decoded_docs(out, "val") == [d for d in DOCS if blake_is_val(d, 0.25)]


def _prepared_text(tmp_path, capsys, val_fraction: str):
  """``(inputs, out)``: the text input prepared with the bytes tokenizer into ``tmp_path/out``."""
  inputs = write_inputs(tmp_path)
  out = tmp_path / "out"
  assert run_main(capsys, inputs["text"], "--out", out, "--tokenizer", "bytes",
                  "--val-fraction", val_fraction)[0] == 0
  return inputs, out


def test_force_keeps_the_old_corpus_until_the_new_one_is_complete(tmp_path, capsys):
  inputs, out = _prepared_text(tmp_path, capsys, "0.2")
  before = snapshot(out)
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"text": "fine"}\n{"body": "no text field"}\n')
  code, _, err = run_main(capsys, inputs["text"], bad, "--out", out, "--tokenizer", "bytes",
                          "--val-fraction", "0.2", "--force")
  assert code == 2 and "bad.jsonl:2" in one_error_line(err)
  assert snapshot(out) == before and read_prepared(out) is not None


def test_interrupted_while_replacing_leaves_none_of_its_files(tmp_path, monkeypatch):
  """Ctrl-C after the old meta.json is gone (--force, renaming the new files into place): the old
  corpus is gone by then, so none of this tool's files stay; a file of the user's stays."""
  inputs = write_inputs(tmp_path)
  out = tmp_path / "out"
  prep.prepare([str(inputs["text"])], out, "bpe:300", opts=prep.Options(val_fraction=0.25),
               progress=False, log=lambda line: None)
  (out / "notes.txt").write_text("mine")
  real = os.replace

  def replace(src, dst):
    if str(dst).endswith("val.bin"):
      raise KeyboardInterrupt
    real(src, dst)

  monkeypatch.setattr(prep.os, "replace", replace)
  with pytest.raises(KeyboardInterrupt):
    prep.prepare([str(inputs["jsonl"])], out, "bytes", opts=prep.Options(val_fraction=0.25),
                 progress=False, log=lambda line: None, force=True)
  assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


KILL_IN_FINISH = r"""
import os, sys
from stablejax.data import prepare as prep
real = os.replace
def replace(src, dst):
  if str(dst).endswith(sys.argv[3]):
    os._exit(9)  # as if SIGKILLed here
  real(src, dst)
prep.os.replace = replace
prep.prepare([sys.argv[1]], sys.argv[2], "bpe:300", opts=prep.Options(val_fraction=0.25),
             progress=False, force=True)
"""


@pytest.mark.parametrize("killed_before,again", [("val.bin", "bpe:300"), ("meta.json", "bpe:300"),
                                                 ("meta.json", "bytes")])
def test_a_killed_prepare_is_incomplete_for_the_trainer_and_redone_without_force(
    tmp_path, capsys, killed_before, again):
  inputs = write_inputs(tmp_path)
  out = tmp_path / "out"
  script = tmp_path / "kill.py"
  script.write_text(KILL_IN_FINISH)
  r = subprocess.run([sys.executable, str(script), str(inputs["text"]), str(out), killed_before],
                     cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert r.returncode == 9, r.stderr
  assert (out / "train.bin").exists() and not (out / "meta.json").exists()
  with pytest.raises(DataError) as e:
    build_data(DataConfig(train=str(out)), seq_len=16, batch_size=4, seed=0)
  assert "incomplete" in str(e.value) and "run the same prepare command again" in str(e.value)
  assert "name a .bin" not in str(e.value)
  # The command again (no --force): the leftovers are this tool's, so they are replaced, or
  # removed when the new corpus has no such file (bytes: no tokenizer.json).
  code, _, err = run_main(capsys, inputs["text"], "--out", out, "--tokenizer", again,
                          "--val-fraction", "0.25")
  assert code == 0, err
  reference = tmp_path / "reference"
  assert run_main(capsys, inputs["text"], "--out", reference, "--tokenizer", again,
                  "--val-fraction", "0.25")[0] == 0
  names = sorted(p.name for p in reference.iterdir())
  assert sorted(p.name for p in out.iterdir()) == names
  for name in names:
    if name != "meta.json":  # (meta.json records the seconds taken)
      assert (out / name).read_bytes() == (reference / name).read_bytes()


def test_bins_without_meta_json_are_called_incomplete(tmp_path):
  out = tmp_path / "half"
  out.mkdir()
  (out / "train.bin").write_bytes(np.arange(1000, dtype=np.uint16).tobytes())
  with pytest.raises(DataError) as e:
    build_data(DataConfig(train=str(out)), seq_len=16, batch_size=4, seed=0)
  message = str(e.value)
  assert "no meta.json" in message and "run python -m stablejax prepare again" in message
  assert "name a .bin file directly" not in message


# ----------------------------------------------------------------------------- Ctrl-C


def test_stop_signals_with_workers_exit_130_and_clean_up_every_time(tmp_path, bpe_dir):
  """SIGINT, SIGTERM or SIGHUP to the whole process group (a terminal's Ctrl-C, `kill -- -PGID`,
  a scheduler stopping a job, a closed terminal) at several points of a 2-worker run: exit 130
  with one line naming the signal, no worker traceback, nothing left (the folder it created
  goes too), never a hang."""
  import random
  import signal
  import time
  rng = random.Random(0)
  words = "alpha beta gamma delta the quick brown fox jumps over a lazy dog".split()
  docs = [" ".join(rng.choice(words) for _ in range(150)) for _ in range(16_000)]
  corpus = tmp_path / "corpus.txt"
  corpus.write_text("<|endoftext|>".join(docs))  # about 13 MB: seconds of tokenizing
  # When to send it: as soon as the directory is claimed (the workers starting), or a little
  # after the first token file appears (the workers busy).
  plans = [("meta.json.partial", 0.0, signal.SIGINT),
           ("train.bin.*.partial", 0.0, signal.SIGTERM),
           ("train.bin.*.partial", 0.1, signal.SIGINT),
           ("train.bin.*.partial", 0.3, signal.SIGHUP),
           ("train.bin.*.partial", 0.6, signal.SIGTERM),
           ("meta.json.partial", 0.05, signal.SIGINT)]
  for i, (wait_for, delay, signum) in enumerate(plans):
    out = tmp_path / f"out{i}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "stablejax", "prepare", str(corpus), "--out", str(out),
         "--tokenizer", str(bpe_dir / "tokenizer.json"), "--workers", "2", "--no-progress"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, env=dict(os.environ, PYTHONFAULTHANDLER="1"))
    try:
      deadline = time.monotonic() + 120
      while not list(out.glob(wait_for)):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"no {wait_for} within 120 s"
        time.sleep(0.005)
      time.sleep(delay)
      os.killpg(proc.pid, signum)
      try:
        stdout, stderr = proc.communicate(timeout=60)
      except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGABRT)  # the faulthandler prints every thread's stack
        stderr = proc.communicate(timeout=30)[1]
        raise AssertionError(f"plan {i}: prepare still running 60 s after {signum.name} (a "
                             f"hang): {stderr[-6000:]}") from None
    finally:
      if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == 130, (i, proc.returncode, stderr[-2000:])
    assert stderr.strip().splitlines() == [
        f"interrupted by {signum.name}: this run's files in {out} removed; run the same command "
        f"again"], (i, stderr)
    assert not out.exists(), (i, sorted(p.name for p in out.iterdir()))
    time.sleep(0.2)
    orphans = [p for p in _children_of(proc.pid)]
    assert not orphans, (i, orphans)


def _children_of(pid: int) -> list[int]:
  """Live processes whose parent is `pid` (workers a dead parent left behind are re-parented, so
  also look for processes of its session)."""
  found = []
  for stat in Path("/proc").glob("[0-9]*/stat"):
    try:
      fields = stat.read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
      continue
    state, ppid, sid = fields[0], int(fields[1]), int(fields[3])
    if state != "Z" and (ppid == pid or sid == pid):
      found.append(int(stat.parent.name))
  return found


# ----------------------------------------------------------------------------- inputs


def _lonely_val_document(fraction: float) -> str:
  """A document the hash rule puts in validation (found by the documented rule)."""
  return next(d for d in (f"A lonely document number {i}." for i in range(10_000))
              if blake_is_val(d, fraction))


@pytest.mark.parametrize("weights", [[], ["--weights", "1", "1"]])
def test_an_input_entirely_in_validation_is_an_error(tmp_path, capsys, weights):
  inputs = write_inputs(tmp_path)
  lonely = tmp_path / "lonely.txt"
  lonely.write_text(_lonely_val_document(0.2))
  out = tmp_path / "out"
  code, _, err = run_main(capsys, inputs["text"], lonely, "--out", out, "--tokenizer", "bytes",
                          "--val-fraction", "0.2", *weights)
  line = one_error_line(err)
  assert code == 2 and "lonely.txt" in line and "validation split" in line
  assert "--val-fraction" in line and "split it into more documents" in line
  assert not out.exists() or list(out.iterdir()) == []


ORDINARY_EOT_DOCS = ["Code that prints <|endoftext|> as text.", "plain", "<|endoftext|>",
                     "a<|endoftext|>b<|endoftext|>"]


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe:300", "tokenizer.json"])
def test_literal_endoftext_in_a_document_is_ordinary_text(tmp_path, capsys, bpe_dir, tokenizer):
  docs = DOCS + ORDINARY_EOT_DOCS
  jsonl = tmp_path / "docs.jsonl"
  jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
  spec = bpe_dir / "tokenizer.json" if tokenizer == "tokenizer.json" else tokenizer
  out = tmp_path / "out"
  code, _, err = run_main(capsys, jsonl, "--out", out, "--tokenizer", spec, "--val-fraction",
                          "0.25")
  assert code == 0, err
  meta = read_prepared(out)
  for split in ("train", "val"):
    ids = tokens(out, split)
    # one end-of-text per document, the one prepare appends, and nothing else
    assert np.count_nonzero(ids == meta["eot_id"]) == meta[f"{split}_documents"]
  want = [d for d in docs if not blake_is_val(d, 0.25)], [d for d in docs if blake_is_val(d, 0.25)]
  assert (decoded_docs(out, "train"), decoded_docs(out, "val")) == want
  assert any("<|endoftext|>" in d for d in want[0] + want[1])
  tok = tokenizer_lib.from_meta(meta, out)  # what sample encodes prompts with
  assert meta["eot_id"] not in tok.encode("<|endoftext|>")
  assert tok.decode(tok.encode("x<|endoftext|>y")) == "x<|endoftext|>y"


def test_tiktoken_encodes_literal_endoftext_as_text_in_prepare():
  """tiktoken (no download here: a byte-level encoding built in place of gpt2's files)."""
  import tiktoken
  enc = tiktoken.Encoding("bytes_eot", pat_str=r"\S+|\s+",
                          mergeable_ranks={bytes([i]): i for i in range(256)},
                          special_tokens={"<|endoftext|>": 256})
  tok = tokenizer_lib.TiktokenTokenizer.__new__(tokenizer_lib.TiktokenTokenizer)
  tok._enc, tok.name, tok.vocab_size, tok.eot_id = enc, "bytes_eot", enc.n_vocab, enc.eot_token
  spec = ("name", "bytes_eot", None)
  encode._WORKER_TOKENIZER.clear()
  encode._WORKER_TOKENIZER[spec] = tok
  try:
    result = encode.encode_batch((ORDINARY_EOT_DOCS, spec, prep.Options(val_fraction=1e-9),
                                np.dtype("uint16")))
  finally:
    encode._WORKER_TOKENIZER.clear()
  ids = result["train"]
  assert np.count_nonzero(ids == 256) == len(ORDINARY_EOT_DOCS)
  assert tok.decode(ids.tolist()) == "<|endoftext|>".join(ORDINARY_EOT_DOCS) + "<|endoftext|>"


def test_an_end_of_text_token_that_text_can_produce_is_refused(tmp_path, capsys):
  from tokenizers import Tokenizer, models, pre_tokenizers
  vocab = {"[UNK]": 0, "</s>": 1, "hello": 2, "world": 3}
  tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))  # "</s>" is an ordinary word
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.save(str(tmp_path / "words.json"))
  (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in
                                            ["hello world", "hello </s> world"] * 20))
  code, _, err = run_main(capsys, tmp_path / "a.jsonl", "--out", tmp_path / "out", "--tokenizer",
                          tmp_path / "words.json", "--eot-token", "</s>", "--val-fraction", "0.3")
  line = one_error_line(err)
  assert code == 2 and "'</s>' is an ordinary token" in line and "--eot-token" in line
  assert not (tmp_path / "out" / "meta.json").exists()


@pytest.mark.parametrize("case", ["out_is_file", "truncated_gz", "not_gzip", "empty_separator",
                                  "val_fraction_0", "truncated_gz_bpe", "truncated_jsonl_gz",
                                  "out_inside_input", "out_inside_a_run"])
def test_more_bad_input_is_one_line_and_leaves_nothing(tmp_path, capsys, case):
  import gzip
  text = "<|endoftext|>".join(DOCS * 300).encode()
  whole = gzip.compress(text)
  (tmp_path / "cut.txt.gz").write_bytes(whole[:len(whole) // 2])
  (tmp_path / "plain.txt.gz").write_bytes(text[:5000])
  lines = "".join(json.dumps({"text": d}) + "\n" for d in DOCS * 300).encode()
  (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(lines)[:len(gzip.compress(lines)) // 2])
  (tmp_path / "a.txt").write_text("<|endoftext|>".join(DOCS))
  (tmp_path / "file").write_text("a file")
  (tmp_path / "corpus").mkdir()
  (tmp_path / "corpus" / "a.txt").write_text("<|endoftext|>".join(DOCS))
  out = tmp_path / "out"
  # A run folder of the trainer (its record): its checkpoints folder is the run's alone.
  from stablejax.training.run_folder.record import PROGRAM, RECORD
  (tmp_path / "run").mkdir()
  (tmp_path / "run" / RECORD).write_text(json.dumps({"program": PROGRAM, "written": []}))
  args, needle = {
      "out_is_file": ([tmp_path / "a.txt", "--out", tmp_path / "file"], "is a file"),
      "truncated_gz": ([tmp_path / "cut.txt.gz", "--out", out], "not a complete gzip file"),
      "truncated_gz_bpe": ([tmp_path / "cut.txt.gz", "--out", out, "--tokenizer", "bpe:300"],
                           "not a complete gzip file"),
      "truncated_jsonl_gz": ([tmp_path / "cut.jsonl.gz", "--out", out],
                             "not a complete gzip file"),
      "not_gzip": ([tmp_path / "plain.txt.gz", "--out", out], "not a complete gzip file"),
      "empty_separator": ([tmp_path / "a.txt", "--out", out, "--separator", ""],
                          "--separator is empty"),
      "val_fraction_0": ([tmp_path / "a.txt", "--out", out, "--val-fraction", "0"],
                         "validation split"),
      "out_inside_input": ([tmp_path / "corpus", "--out", tmp_path / "corpus" / "prepared"],
                           "inside the input folder"),
      "out_inside_a_run": ([tmp_path / "a.txt", "--out", tmp_path / "run" / "checkpoints" / "d"],
                           "inside the checkpoints of the training run"),
  }[case]
  # defaults first: an option the case gives again wins
  code, _, err = run_main(capsys, "--tokenizer", "bytes", "--val-fraction", "0.2", *args)
  assert code == 2 and needle in one_error_line(err), err
  assert (tmp_path / "file").read_text() == "a file"
  leftovers = [p for p in tmp_path.rglob("*") if p.name in ("meta.json", "meta.json.partial")
               or p.suffix in (".bin", ".partial")]
  assert leftovers == []
  assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["run.json"]


def test_filters_drop_beyond_their_bounds_not_at_them():
  # data.md / DataConfig: a document is dropped for a run of one byte LONGER than
  # --filter-max-repeat (0 disables the filter) or a non-text share ABOVE --filter-max-nontext.
  opts = prep.Options(val_fraction=0.5, filter_max_repeat=8, filter_max_nontext=0.25)
  text = b"plain words "
  assert encode.classify(b"a" * 8 + text, opts) in ("train", "val")         # a run of exactly 8
  assert encode.classify(b"a" * 9 + text, opts) == "repeat"
  no_repeat_filter = prep.Options(val_fraction=0.5, filter_max_repeat=0)
  assert encode.classify(b"a" * 5000, no_repeat_filter) in ("train", "val")
  at_limit = b"\x01" * 3 + b"abcdefghi"                                     # 3 of 12 = 0.25
  assert encode.classify(at_limit, opts) in ("train", "val")
  assert encode.classify(b"\x01" * 4 + b"abcdefghi", opts) == "nontext"     # 4 of 13 > 0.25


def test_default_weights_are_token_shares(tmp_path, capsys):
  # Without --weights each input is mixed by its share of the training tokens: an input of few
  # long documents against one of many short ones (document counts would invert the weights).
  (tmp_path / "long.txt").write_text("<|endoftext|>".join(f"Long {i} " * 400 for i in range(12)))
  (tmp_path / "short.txt").write_text("<|endoftext|>".join(f"S{i} x" for i in range(300)))
  out = tmp_path / "mix"
  code, _, err = run_main(capsys, tmp_path / "long.txt", tmp_path / "short.txt", "--out", out,
                          "--tokenizer", "bytes", "--val-fraction", "0.2")
  assert code == 0, err
  a, b = read_prepared(out)["sources"]
  tokens_a = a["train_range"][1] - a["train_range"][0]
  tokens_b = b["train_range"][1] - b["train_range"][0]
  assert a["weight"] == pytest.approx(tokens_a / (tokens_a + tokens_b))
  assert b["weight"] == pytest.approx(tokens_b / (tokens_a + tokens_b))
  assert a["weight"] > 0.5


@pytest.mark.parametrize("fraction", ["1", "1.5", "0", "-0.1"])
def test_val_fraction_outside_the_open_unit_interval_is_one_error_line(tmp_path, capsys, fraction):
  inputs = write_inputs(tmp_path)
  code, _, err = run_main(capsys, inputs["text"], "--out", tmp_path / "out", "--tokenizer",
                          "bytes", "--val-fraction", fraction)
  # Refused up front for what it is (docs/data.md: in (0, 1)), not later for its consequence.
  assert code == 2 and len(err.strip().splitlines()) == 1, err
  assert f"--val-fraction {float(fraction)} is outside (0, 1)" in err, err
  assert not (tmp_path / "out" / "meta.json").exists()


# ----------------------------------------------------------------------------- one writer


def test_a_second_prepare_into_the_same_out_is_refused_while_the_first_finishes(tmp_path, capsys):
  """The same command twice at once (as `srun` runs it on two nodes): the second is one line
  naming the first, exit 2, and touches nothing; the first finishes with a complete corpus."""
  from process_hooks import hooked_env
  (tmp_path / "a.txt").write_text("<|endoftext|>".join(DOCS))
  out = tmp_path / "out"
  args = [str(tmp_path / "a.txt"), "--out", str(out), "--tokenizer", "bytes", "--val-fraction",
          "0.25", "--no-progress"]
  paused, resume = tmp_path / "paused", tmp_path / "resume"
  env = hooked_env(tmp_path, HOOK_PAUSE_AT_OPEN="train.bin", HOOK_PAUSED_FLAG=str(paused),
                   HOOK_RESUME_FILE=str(resume))
  first = subprocess.Popen([sys.executable, "-m", "stablejax", "prepare", *args], cwd=ROOT,
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    import time
    deadline = time.monotonic() + 120
    while not paused.exists():  # the first is writing its train.bin partial file
      assert first.poll() is None, first.communicate()
      assert time.monotonic() < deadline
      time.sleep(0.01)
    before = snapshot(out)
    assert [n for n in before if n.startswith("train.bin.")] == [
        n for n in before if n.startswith(f"train.bin.{first.pid}-") and n.endswith(".partial")]
    code, _, err = run_main(capsys, *args)
    line = one_error_line(err)
    assert code == 2 and f"in use by prepare (process {first.pid} on " in line, line
    assert snapshot(out) == before  # nothing of the first run touched
  finally:
    resume.touch()
    stdout, stderr = first.communicate(timeout=120)
  assert first.returncode == 0, stderr
  assert "prepared" in stdout
  assert decoded_docs(out, "train") == [d for d in DOCS if not blake_is_val(d, 0.25)]
  assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.bin", "val.bin"]


# ----------------------------------------------------------------------------- the environment

_UNSHARE = ["unshare", "--user", "--map-root-user", "--mount"]


def _namespaces_available() -> bool:
  """Whether this process may mount a tmpfs of its own (user and mount namespaces)."""
  try:
    return subprocess.run([*_UNSHARE, "true"], capture_output=True, timeout=30).returncode == 0
  except (OSError, subprocess.TimeoutExpired):
    return False


needs_namespaces = pytest.mark.skipif(
    not _namespaces_available(),
    reason="needs unshare with user and mount namespaces for a small tmpfs; the patched tests "
           "below cover the same paths")


def _in_namespace(script: str, tmp_path: Path) -> subprocess.CompletedProcess:
  path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
  env = dict(os.environ, PY=sys.executable, T=str(tmp_path), PYTHONPATH=path)  # (cwd is T)
  return subprocess.run([*_UNSHARE, "bash", "-c", "set -u; cd \"$T\"; " + script], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=300)


@needs_namespaces
def test_a_full_disk_is_one_line_and_keeps_the_old_corpus(tmp_path):
  """A real full disk: a 512 KiB tmpfs. A small corpus fits; a bigger one (--force) does not:
  one line, exit 2, the old corpus untouched, no partial file left."""
  (tmp_path / "small.txt").write_text("<|endoftext|>".join(DOCS))
  (tmp_path / "big.txt").write_text("<|endoftext|>".join(DOCS * 100))  # ~1.7 MB of tokens
  proc = _in_namespace(
      'mkdir -p mnt && mount -t tmpfs -o size=512k tmpfs mnt && '
      'P="$PY -m stablejax prepare --out mnt/out --tokenizer bytes --val-fraction 0.25 '
      '--no-progress"; '
      '$P small.txt > /dev/null && sha256sum mnt/out/* > before; '
      '$P big.txt --force 2> err; echo "rc=$?"; sha256sum mnt/out/* > after; '
      'cmp before after && echo same; ls -A mnt/out; cat err', tmp_path)
  lines = proc.stdout.splitlines()
  assert "rc=2" in lines and "same" in lines, proc.stdout + proc.stderr
  assert lines[lines.index("same") + 1:-1] == ["meta.json", "train.bin", "val.bin"]
  assert lines[-1].startswith("error: cannot write ") and "no space left on the device" in \
      lines[-1] and "free some space" in lines[-1], lines[-1]


@needs_namespaces
def test_a_read_only_folder_is_one_line(tmp_path):
  proc = _in_namespace(
      'mkdir -p mnt && mount -t tmpfs tmpfs mnt && mkdir mnt/out && mount -o remount,ro mnt && '
      '$PY -m stablejax prepare pydoc --out mnt/out --tokenizer bytes 2> err1; echo "rc=$?"; '
      '$PY -m stablejax prepare pydoc --out mnt/new --tokenizer bytes 2> err2; echo "rc=$?"; '
      'ls -A mnt; cat err1 err2', tmp_path)
  lines = proc.stdout.splitlines()
  assert lines[:3] == ["rc=2", "rc=2", "out"], proc.stdout + proc.stderr
  assert lines[3].startswith("error: cannot write mnt/out (read-only file system): choose a "
                             "writable --out"), lines[3]
  assert lines[4].startswith("error: cannot create --out 'mnt/new' (Read-only file system)"), \
      lines[4]


class _FullDisk:
  """A file opened for writing whose disk fills after `room` bytes (ENOSPC, as the kernel)."""

  def __init__(self, file, room: int):
    self._file, self._room = file, room

  def write(self, data) -> int:
    n = memoryview(data).nbytes
    if n > self._room:
      raise OSError(28, "No space left on device")
    self._room -= n
    return self._file.write(data)

  def __getattr__(self, name):
    return getattr(self._file, name)


def test_a_full_disk_while_writing_tokens_is_one_line_and_leaves_nothing(tmp_path, capsys,
                                                                         monkeypatch):
  """The write path raising ENOSPC (patched: the tmpfs test above needs namespaces)."""
  import builtins
  (tmp_path / "a.txt").write_text("<|endoftext|>".join(DOCS * 20))
  real_open = builtins.open

  def open_on_a_small_disk(path, mode="r", *args, **kwargs):
    f = real_open(path, mode, *args, **kwargs)
    return _FullDisk(f, 4096) if "w" in mode and ".bin." in str(path) else f

  monkeypatch.setattr(prepared, "open", open_on_a_small_disk, raising=False)
  out = tmp_path / "out"
  code, _, err = run_main(capsys, tmp_path / "a.txt", "--out", out, "--tokenizer", "bytes",
                          "--val-fraction", "0.25")
  line = one_error_line(err)
  assert code == 2 and f"cannot write {out / 'train.bin'} (no space left on the device)" in line
  assert not out.exists()


def test_a_read_only_out_is_one_line(tmp_path, capsys, monkeypatch):
  """EROFS when prepare takes --out (patched os.open: as root, chmod cannot refuse a write)."""
  from stablejax.data import folder
  out = tmp_path / "out"
  out.mkdir()
  real_open = os.open

  def read_only(path, flags, *args, **kwargs):
    if str(path).startswith(str(out)) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
      raise OSError(30, "Read-only file system", str(path))
    return real_open(path, flags, *args, **kwargs)

  monkeypatch.setattr(folder.os, "open", read_only)
  code, _, err = run_main(capsys, "pydoc", "--out", out, "--tokenizer", "bytes")
  assert code == 2 and one_error_line(err).startswith(
      f"error: cannot write {out} (read-only file system): choose a writable --out")
  monkeypatch.undo()
  assert list(out.iterdir()) == []


# ----------------------------------------------------------------------------- what it recorded


def test_meta_json_records_the_size_hash_and_largest_id_of_each_file(tmp_path, capsys):
  _, out = _prepared_text(tmp_path, capsys, "0.25")
  meta = read_prepared(out)
  for split in ("train", "val"):
    data = (out / f"{split}.bin").read_bytes()
    record = meta["files"][f"{split}.bin"]
    assert record["bytes"] == len(data) and record["tokens"] == meta[f"{split}_tokens"]
    assert record["sha256"] == hashlib.sha256(data).hexdigest()
    assert record["max_token"] == int(np.frombuffer(data, np.uint16).max())


@pytest.mark.parametrize("same_size", [True, False])
def test_a_train_bin_replaced_by_the_user_is_not_prepared_over_without_force(
    tmp_path, capsys, same_size):
  inputs = write_inputs(tmp_path)
  out = tmp_path / "out"
  args = [inputs["text"], "--out", out, "--tokenizer", "bytes", "--val-fraction", "0.25"]
  assert run_main(capsys, *args)[0] == 0
  size = (out / "train.bin").stat().st_size
  mine = np.random.default_rng(0).integers(0, 50000, size // 2 + (0 if same_size else 7),
                                           dtype=np.uint16).tobytes()
  (out / "train.bin").write_bytes(mine)  # the user's own token file, under prepare's name
  code, _, err = run_main(capsys, *args)
  line = one_error_line(err)
  assert code == 2 and "train.bin" in line and "changed since" in line and "--force" in line
  assert (out / "train.bin").read_bytes() == mine
  with pytest.raises(DataError):  # nor does the trainer take it for the prepared corpus
    build_data(DataConfig(train=str(out)), seq_len=16, batch_size=4, seed=0)
  assert run_main(capsys, *args, "--force")[0] == 0
  assert decoded_docs(out, "train") == [d for d in DOCS if not blake_is_val(d, 0.25)]


def test_invalid_utf8_is_counted_in_meta_json_and_said(tmp_path, capsys, bpe_dir):
  docs = [d.encode() for d in DOCS]
  docs[3] = b"broken \xff\xfe bytes and " + docs[3]  # two invalid bytes
  docs[7] = docs[7] + b" cut \xe2\x82"                # a cut 3-byte sequence: two bytes
  (tmp_path / "a.txt").write_bytes(b"<|endoftext|>".join(docs))
  out = tmp_path / "out"
  code, stdout, err = run_main(capsys, tmp_path / "a.txt", "--out", out, "--tokenizer",
                               bpe_dir / "tokenizer.json", "--val-fraction", "0.25")
  assert code == 0, err
  meta = read_prepared(out)
  assert meta["invalid_utf8"] == {"documents": 2, "bytes": 4, "written_as": "U+FFFD"}
  assert sum(s["invalid_utf8_documents"] for s in meta["sources"]) == 2
  assert "2 document(s) held 4 byte(s) of invalid UTF-8" in stdout
  texts = decoded_docs(out, "train") + decoded_docs(out, "val")
  assert sum("\ufffd" in t for t in texts) == 2
  # A lone surrogate in a JSON string (an escape no UTF-8 can hold) is counted the same way.
  jsonl = tmp_path / "a.jsonl"
  jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in [*DOCS, "half \ud83d pair"]))
  code, stdout, err = run_main(capsys, jsonl, "--out", tmp_path / "json", "--tokenizer", "bytes",
                               "--val-fraction", "0.25")
  assert code == 0, err
  assert read_prepared(tmp_path / "json")["invalid_utf8"]["documents"] == 1
  texts = decoded_docs(tmp_path / "json", "train") + decoded_docs(tmp_path / "json", "val")
  assert "half \ufffd pair" in texts


@pytest.mark.parametrize("case", ["file_twice", "file_and_its_folder", "another_path",
                                  "pydoc_twice"])
def test_an_input_given_twice_is_refused(tmp_path, capsys, case):
  inputs = write_inputs(tmp_path)
  (tmp_path / "folder").mkdir()
  (tmp_path / "folder" / "a.txt").write_text("<|endoftext|>".join(DOCS))
  twice = {"file_twice": [inputs["text"], inputs["text"]],
           "file_and_its_folder": [tmp_path / "folder", tmp_path / "folder" / "a.txt"],
           "another_path": [inputs["jsonl"], tmp_path / "folder" / ".." / "corpus.jsonl"],
           "pydoc_twice": ["pydoc", "pydoc"]}[case]
  out = tmp_path / "out"
  code, _, err = run_main(capsys, *twice, "--out", out, "--tokenizer", "bytes")
  line = one_error_line(err)
  assert code == 2 and "repeats" in line and "give each input once" in line
  assert not out.exists()


KILL_BEFORE_FINISH = r"""
import os, sys
from stablejax.data import out_dir
from stablejax.data import prepare as prep
out_dir.finish = lambda *args: os._exit(9)  # as if SIGKILLed with every partial file written
prep.prepare([sys.argv[1]], sys.argv[2], "bpe:300", opts=prep.Options(val_fraction=0.25),
             progress=False)
"""


def test_a_killed_prepares_marker_claims_none_of_the_users_files(tmp_path, capsys):
  """After a SIGKILLed prepare, files of the user's put into --out under the names prepare writes
  are refused without --force, not deleted or replaced: the dead run's marker claims only what
  it wrote (its partial files, and files it renamed into place, by their identity)."""
  inputs = write_inputs(tmp_path)
  out = tmp_path / "out"
  script = tmp_path / "kill.py"
  script.write_text(KILL_BEFORE_FINISH)
  r = subprocess.run([sys.executable, str(script), str(inputs["text"]), str(out)],
                     cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert r.returncode == 9, r.stderr
  assert (out / "meta.json.partial").exists() and any(out.glob("*.partial"))
  mine = {"tokenizer.json": b'{"mine": true}', "train.bin": b"\x01\x02" * 50,
          "val.bin": b"\x03\x04" * 20}
  for name, data in mine.items():
    (out / name).write_bytes(data)
  code, _, err = run_main(capsys, inputs["text"], "--out", out, "--tokenizer", "bpe:300",
                          "--val-fraction", "0.25")
  assert code == 2 and "not written by python -m stablejax prepare" in err, err
  assert all((out / name).read_bytes() == data for name, data in mine.items())
  # With --force they are replaced, and the dead run's partial files are gone.
  code, _, err = run_main(capsys, inputs["text"], "--out", out, "--tokenizer", "bpe:300",
                          "--val-fraction", "0.25", "--force")
  assert code == 0, err
  assert not list(out.glob("*.partial")) and read_prepared(out) is not None


def test_a_one_document_corpus_is_told_to_split_it_not_to_raise_val_fraction(tmp_path, capsys):
  text = "one long document without any separator in it. " * 200
  assert not blake_is_val(text, 0.005)  # it goes to training, and validation stays empty
  (tmp_path / "one.txt").write_text(text)
  code, _, err = run_main(capsys, tmp_path / "one.txt", "--out", tmp_path / "out", "--tokenizer",
                          "bytes")
  assert code == 2 and "one document" in err and "--separator" in err, err
  assert "raise --val-fraction" not in err


@pytest.mark.parametrize("args,line", [
    (["corpus.txt", "--out", ""], "argument --out: the path is empty"),
    (["corpus.txt", "--out", "loop"], "argument --out: loop leads through a loop of symbolic "
                                      "links"),
    (["corpus.txt", "--out", "p" * 300], "argument --out: the name pppp"),
    (["q" * 300, "--out", "data"], "argument INPUT: the name qqqq"),
])
def test_an_unusable_path_is_one_line_and_nothing_is_written(args, line, tmp_path, monkeypatch,
                                                             capsys):
  monkeypatch.chdir(tmp_path)
  (tmp_path / "corpus.txt").write_text("<|endoftext|>".join(DOCS))
  (tmp_path / "loop").symlink_to("loop")  # a link to itself
  code, _, err = run_main(capsys, *args, "--tokenizer", "bytes", "--val-fraction", "0.2")
  lines = err.strip().splitlines()
  assert code == 2 and len(lines) == 1 and lines[0].startswith(f"error: {line}"), err
  assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "loop"]
  # The library's prepare takes no empty --out for the current folder either.
  with pytest.raises(prep.PrepareError, match="--out: the path is empty"):
    prep.prepare(["corpus.txt"], "", "bytes", opts=prep.Options(val_fraction=0.2))
  assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "loop"]
