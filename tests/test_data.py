"""Tests for the Grain data pipeline: determinism, state, sharding, filter, mixing, errors."""

import json
import os

import grain
import numpy as np
import pytest

from stablejax.data import identity, prepared, sources
from stablejax.data import pipeline as data_lib
from stablejax.data.config import DataConfig, DataError
from stablejax.data.pipeline import build_data

SEQ = 32
BS = 4


def _take(it, n):
  return [next(it)["tokens"] for _ in range(n)]


def _words(rng, n_words, alphabet="abcdefghij klmnop"):
  letters = np.array(list(alphabet))
  return "".join(rng.choice(letters, size=n_words * 6)).encode()


def test_pydoc_batches_shape_dtype_and_windows_are_corpus_slices():
  d = build_data(DataConfig(), seq_len=SEQ, batch_size=BS, seed=0)
  assert d.vocab_size == 256
  src = d.stats["sources"][0]
  assert src["name"] == "pydoc" and src["documents"] > 50 and src["kept"] == src["documents"]
  assert d.stats["train_tokens"] + d.stats["val_tokens"] == src["tokens"]
  corpus = bytes(sources._load_pydoc(DataConfig()).tokens)
  batch = next(d.train_iter())["tokens"]
  assert batch.shape == (BS, SEQ + 1) and batch.dtype == np.int32
  for row in batch:
    assert bytes(row.astype(np.uint8)) in corpus


def test_determinism_and_seed_dependence():
  a = _take(build_data(DataConfig(), seq_len=SEQ, batch_size=BS, seed=1).train_iter(), 5)
  b = _take(build_data(DataConfig(), seq_len=SEQ, batch_size=BS, seed=1).train_iter(), 5)
  c = _take(build_data(DataConfig(), seq_len=SEQ, batch_size=BS, seed=2).train_iter(), 5)
  assert all((x == y).all() for x, y in zip(a, b))
  assert not all((x == y).all() for x, y in zip(a, c))


def test_state_round_trip_continues_with_same_batches():
  d = build_data(DataConfig(shuffle_buffer=16), seq_len=SEQ, batch_size=BS, seed=3)
  it = d.train_iter()
  _take(it, 7)
  state = it.get_state()
  expected = _take(it, 5)
  it2 = d.train_iter()
  it2.set_state(state)
  assert all((x == y).all() for x, y in zip(expected, _take(it2, 5)))
  # A freshly built pipeline (a restarted process) restores the same way.
  d3 = build_data(DataConfig(shuffle_buffer=16), seq_len=SEQ, batch_size=BS, seed=3)
  it3 = d3.train_iter()
  it3.set_state(state)
  assert all((x == y).all() for x, y in zip(expected, _take(it3, 5)))


def test_orbax_checkpoint_round_trip(tmp_path):
  import orbax.checkpoint as ocp
  d = build_data(DataConfig(), seq_len=SEQ, batch_size=BS, seed=4)
  it = d.train_iter()
  _take(it, 3)
  mngr = ocp.CheckpointManager(tmp_path / "ckpt")
  mngr.save(3, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
  mngr.wait_until_finished()
  expected = _take(it, 4)
  it2 = d.train_iter()
  restored = mngr.restore(3, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(it2)))
  assert restored["data"] is it2
  assert all((x == y).all() for x, y in zip(expected, _take(it2, 4)))
  mngr.close()


def test_processes_together_equal_single_process_batch():
  cfg = DataConfig(shuffle_buffer=8)
  single = build_data(cfg, seq_len=SEQ, batch_size=BS, seed=5)
  parts = [build_data(cfg, seq_len=SEQ, batch_size=BS, seed=5, process_index=p, process_count=2)
           for p in range(2)]
  want = _take(single.train_iter(), 4)
  got = [_take(p.train_iter(), 4) for p in parts]
  for b in range(4):
    assert got[0][b].shape == (BS // 2, SEQ + 1)
    np.testing.assert_array_equal(np.concatenate([got[0][b], got[1][b]]), want[b])
  v_single = single.val_batches(2)
  v_parts = [p.val_batches(2) for p in parts]
  for b in range(2):
    np.testing.assert_array_equal(
        np.concatenate([v_parts[0][b]["tokens"], v_parts[1][b]["tokens"]]),
        v_single[b]["tokens"])
  with pytest.raises(DataError, match="divisible"):
    build_data(cfg, seq_len=SEQ, batch_size=3, seed=0, process_index=0, process_count=2)


def test_val_batches_fixed_and_from_held_out_tail(tmp_path):
  rng = np.random.default_rng(0)
  head = _words(rng, 2000, "abcdefgh ")
  tail = _words(rng, 200, "XYZ ")
  f = tmp_path / "t.txt"
  f.write_bytes(head + tail)
  frac = len(tail) / (len(head) + len(tail) + 2)   # +2: the "\n\n" appended to a file
  d = build_data(DataConfig(train=str(f), val_fraction=frac), seq_len=SEQ, batch_size=BS, seed=0)
  v1, v2 = d.val_batches(3), d.val_batches(3)
  assert len(v1) == 3
  for a, b in zip(v1, v2):
    np.testing.assert_array_equal(a["tokens"], b["tokens"])
  val_bytes = set(np.concatenate([v["tokens"].ravel() for v in v1]).tolist())
  assert val_bytes <= set(b"XYZ \n")
  train_bytes = set(np.concatenate(_take(d.train_iter(), 50)).ravel().tolist())
  assert not train_bytes & set(b"XYZ")


def test_a_run_of_exactly_filter_max_repeat_bytes_is_kept_and_a_longer_one_dropped(tmp_path):
  rng = np.random.default_rng(4)
  for run, kept in ((256, 2), (257, 1)):
    folder = tmp_path / f"run{run}"
    folder.mkdir()
    (folder / "a.txt").write_bytes(_words(rng, 300))
    (folder / "b.txt").write_bytes(_words(rng, 300) + b"=" * run + _words(rng, 50))
    d = build_data(DataConfig(train=str(folder), filter_max_repeat=256), seq_len=SEQ,
                   batch_size=BS, seed=0)
    st = d.stats["sources"][0]
    assert (st["documents"], st["kept"], st["dropped_repeat"]) == (2, kept, 2 - kept)

def test_nontext_bytes_are_control_bytes_but_the_whitespace_ones():
  # ASCII control bytes other than \t \n \v \f \r are non-text, DEL (127) included.
  assert sources.nontext_fraction(b"\t\n\v\f\r ok") == 0.0
  assert sources.nontext_fraction(b"ab\x7f\x7f") == 0.5
  assert sources.nontext_fraction(b"\x00\x1b\x08\x0e") == 1.0

def test_a_tiny_val_fraction_still_holds_out_one_window(tmp_path):
  # At least one window is held out: the val batch is the file's last SEQ + 1 tokens.
  rng = np.random.default_rng(5)
  f = tmp_path / "t.txt"
  f.write_bytes(_words(rng, 2000))
  d = build_data(DataConfig(train=str(f), val_fraction=1e-9), seq_len=SEQ, batch_size=BS, seed=0)
  (batch,) = d.val_batches(1)
  tail = np.frombuffer(f.read_bytes().rstrip(b"\n") + b"\n\n", np.uint8)[-(SEQ + 1):]
  np.testing.assert_array_equal(batch["tokens"][0], tail)

def test_a_prepared_file_of_another_size_than_meta_json_records_is_an_error(tmp_path):
  # An unfinished prepare (or a file changed since): train.bin one token short of meta.json.
  out = tmp_path / "prepared"
  out.mkdir()
  (out / "train.bin").write_bytes(np.arange(999, dtype=np.uint16).tobytes())
  (out / "val.bin").write_bytes(np.arange(100, dtype=np.uint16).tobytes())
  (out / "meta.json").write_text(json.dumps({
      "format": prepared.PREPARED_FORMAT, "dtype": "uint16", "train_tokens": 1000,
      "val_tokens": 100, "vocab_size": 1000}))
  with pytest.raises(DataError, match="train.bin has 1998 bytes but meta.json records 2000"):
    build_data(DataConfig(train=str(out)), seq_len=SEQ, batch_size=BS, seed=0)

def test_a_bin_token_id_equal_to_the_vocabulary_size_is_an_error(tmp_path):
  f = tmp_path / "train.bin"
  (np.arange(2 * sources.BIN_DOC_TOKENS) % 1001).astype(np.uint16).tofile(f)
  with pytest.raises(DataError, match="holds token id 1000 >= vocab size 1000"):
    build_data(DataConfig(train=str(f), vocab_size=1000), seq_len=SEQ, batch_size=BS, seed=0)
  build_data(DataConfig(train=str(f), vocab_size=1001), seq_len=SEQ, batch_size=BS, seed=0)

def test_a_jittered_window_stays_inside_its_range():
  # Ranges of 100 and 70 tokens, windows of 33: 3 + 2 slots; any jitter keeps a window inside
  # the range its slot belongs to.
  ranges = [(0, 100), (100, 170)]
  reader = data_lib._WindowReader(np.arange(170), ranges, 33)
  assert reader.num_windows == 5
  for slot, (lo, hi) in zip(range(5), [ranges[0]] * 3 + [ranges[1]] * 2):
    for jitter in range(33):
      start = reader.start_of(slot, jitter)
      assert lo <= start and start + 33 <= hi, (slot, jitter, start)

def test_val_rows_are_evenly_spaced_over_the_val_windows(tmp_path):
  rng = np.random.default_rng(6)
  train, val = tmp_path / "train.txt", tmp_path / "val.txt"
  train.write_bytes(_words(rng, 2000))
  val.write_bytes(_words(rng, 1000).rstrip(b"\n") + b"\n\n")
  d = build_data(DataConfig(train=str(train), val=str(val)), seq_len=SEQ, batch_size=BS, seed=0)
  tokens = np.frombuffer(val.read_bytes(), np.uint8)
  n = len(tokens) // (SEQ + 1)
  windows = tokens[:n * (SEQ + 1)].reshape(n, SEQ + 1)
  (batch,) = d.val_batches(1)
  picks = np.linspace(0, n - 1, BS).round().astype(int)  # first and last window included
  np.testing.assert_array_equal(batch["tokens"], windows[picks])

def test_train_windows_are_jittered_off_the_window_grid(tmp_path):
  # Each epoch moves window starts by a random offset, so starts are not all multiples of the
  # window length (the grid of a range starting at 0).
  rng = np.random.default_rng(7)
  f = tmp_path / "t.txt"
  f.write_bytes(_words(rng, 2000, "abcdefghijklmnopqrstuvwxyz "))
  corpus = f.read_bytes()
  d = build_data(DataConfig(train=str(f)), seq_len=SEQ, batch_size=BS, seed=0)
  rows = np.concatenate(_take(d.train_iter(), 10))
  starts = [corpus.find(row.astype(np.uint8).tobytes()) for row in rows]
  assert min(starts) >= 0
  assert any(start % (SEQ + 1) for start in starts)

def test_filter_drops_planted_garbage_documents(tmp_path):
  rng = np.random.default_rng(1)
  folder = tmp_path / "corpus"
  (folder / "sub").mkdir(parents=True)
  good = [_words(rng, 300) for _ in range(3)]
  (folder / "a.txt").write_bytes(good[0])
  (folder / "sub" / "b.md").write_bytes(good[1])
  (folder / "c.rst").write_bytes(good[2])
  (folder / "repeat.txt").write_bytes(_words(rng, 50) + b"=" * 300 + _words(rng, 50))
  (folder / "binary.txt").write_bytes(rng.integers(0, 256, size=3000, dtype=np.uint8).tobytes())
  (folder / "ignored.dat").write_bytes(b"\x00" * 1000)
  d = build_data(DataConfig(train=str(folder)), seq_len=SEQ, batch_size=BS, seed=0)
  st = d.stats["sources"][0]
  assert (st["files"], st["documents"], st["kept"]) == (5, 5, 3)
  assert (st["dropped_repeat"], st["dropped_nontext"]) == (1, 1)
  assert st["tokens"] == sum(len(g) + 2 for g in good)
  # Disabling the filters keeps everything.
  d2 = build_data(DataConfig(train=str(folder), filter_max_repeat=0, filter_max_nontext=1.0),
                  seq_len=SEQ, batch_size=BS, seed=0)
  assert d2.stats["sources"][0]["kept"] == 5
  # A run at the threshold is kept, one above it is dropped.
  assert sources.max_run(np.frombuffer(b"ab" + b"=" * 256 + b"c", np.uint8)) == 256
  # Valid UTF-8 text in other scripts is text, not garbage.
  assert sources.nontext_fraction("Grüße, 世界! ".encode() * 10) == 0.0


def test_large_text_file_splits_into_paragraph_documents():
  para = b"x" * 1000 + b"\n\n"
  raw = para * 200 + b"y" * 70000
  docs = sources._text_documents(raw)
  assert b"".join(docs) == raw
  assert all(len(doc) <= sources.TEXT_DOC_BYTES for doc in docs)
  assert len(docs) >= 4


def test_mixing_proportions_follow_weights(tmp_path):
  rng = np.random.default_rng(2)
  fa, fb = tmp_path / "a.txt", tmp_path / "b.txt"
  fa.write_bytes(_words(rng, 3000, "abcdef "))
  fb.write_bytes(_words(rng, 3000, "012345 "))
  cfg = DataConfig(train=[str(fa), str(fb)], weights=[3.0, 1.0], shuffle_buffer=32)
  d = build_data(cfg, seq_len=SEQ, batch_size=8, seed=0)
  rows = np.concatenate(_take(d.train_iter(), 50))
  from_b = np.mean([bool(set(r.tolist()) & set(b"012345")) for r in rows])
  assert abs(from_b - 0.25) < 0.05
  assert d.stats["weights"] == pytest.approx([0.75, 0.25])
  # Default weights: by train size (here equal sizes -> about half each).
  d2 = build_data(DataConfig(train=[str(fa), str(fb)]), seq_len=SEQ, batch_size=8, seed=0)
  rows2 = np.concatenate(_take(d2.train_iter(), 50))
  assert abs(np.mean([bool(set(r.tolist()) & set(b"012345")) for r in rows2]) - 0.5) < 0.06
  # Three times the text: three times the weight.
  fc = tmp_path / "c.txt"
  fc.write_bytes(_words(rng, 1000, "012345 "))
  d3 = build_data(DataConfig(train=[str(fa), str(fc)]), seq_len=SEQ, batch_size=8, seed=0)
  assert d3.stats["weights"] == pytest.approx([0.75, 0.25], abs=0.02)
  with pytest.raises(DataError, match="one weight per source"):
    build_data(DataConfig(train=[str(fa), str(fb)], weights=[1.0]), seq_len=SEQ, batch_size=8,
               seed=0)
  with pytest.raises(DataError, match="positive"):
    build_data(DataConfig(train=[str(fa), str(fb)], weights=[1.0, 0.0]), seq_len=SEQ,
               batch_size=8, seed=0)


def test_bin_source_memmap_filter_and_val(tmp_path):
  rng = np.random.default_rng(3)
  n = 3 * sources.BIN_DOC_TOKENS
  tokens = rng.integers(0, 50257, size=n).astype(np.uint16)
  tokens[sources.BIN_DOC_TOKENS + 100: sources.BIN_DOC_TOKENS + 1000] = 7   # chunk 1: garbage
  train_f, val_f = tmp_path / "train.bin", tmp_path / "val.bin"
  tokens.tofile(train_f)
  tokens[:5000].tofile(val_f)
  d = build_data(DataConfig(train=str(train_f), val=str(val_f)), seq_len=SEQ, batch_size=BS,
                 seed=0)
  assert d.vocab_size == 50304
  st = d.stats["sources"][0]
  assert (st["documents"], st["kept"], st["dropped_repeat"]) == (3, 2, 1)
  rows = np.concatenate(_take(d.train_iter(), 30))
  windows = np.lib.stride_tricks.sliding_window_view(tokens, SEQ + 1)
  for row in rows[:8]:
    starts = np.flatnonzero((windows[:, 0] == row[0]) & (windows[:, 1] == row[1]))
    assert any((windows[s] == row).all() for s in starts)
    assert not (starts // sources.BIN_DOC_TOKENS == 1).all()   # never from the dropped chunk
  val = d.val_batches(2)
  assert val[0]["tokens"].shape == (BS, SEQ + 1)
  assert all(v["tokens"].max() < 50257 for v in val)
  with pytest.raises(DataError, match="vocab"):
    build_data(DataConfig(train=str(train_f), vocab_size=1000), seq_len=SEQ, batch_size=BS,
               seed=0)


def _err(cfg, seq_len=SEQ):
  with pytest.raises(DataError) as e:
    build_data(cfg, seq_len=seq_len, batch_size=BS, seed=0)
  msg = str(e.value)
  assert "\n" not in msg and ":" in msg
  return msg


def test_data_errors(tmp_path):
  assert "does not exist" in _err(DataConfig(train=str(tmp_path / "nope.txt")))
  assert "does not exist" in _err(DataConfig(val=str(tmp_path / "nope.txt")))
  empty = tmp_path / "empty.txt"
  empty.write_bytes(b"")
  assert "is empty" in _err(DataConfig(train=str(empty)))
  broken = tmp_path / "broken"
  broken.mkdir()
  (broken / "ok.txt").write_bytes(b"hello world " * 100)
  os.symlink(tmp_path / "missing-target", broken / "dangling.txt")
  assert "cannot read" in _err(DataConfig(train=str(broken)))
  no_text = tmp_path / "notext"
  no_text.mkdir()
  (no_text / "x.dat").write_bytes(b"abc")
  assert "no text files" in _err(DataConfig(train=str(no_text)))
  odd = tmp_path / "odd.bin"
  odd.write_bytes(b"\x01\x02\x03")
  assert "odd byte count" in _err(DataConfig(train=str(odd)))
  short = tmp_path / "short.txt"
  short.write_bytes(b"tiny corpus\n")
  assert "seq_len" in _err(DataConfig(train=str(short)))
  assert "seq_len" in _err(DataConfig(train=str(short), val="pydoc"))
  bin_ok = tmp_path / "ok.bin"
  np.arange(1000, dtype=np.uint16).tofile(bin_ok)
  assert "mixes .bin" in _err(DataConfig(train=[str(bin_ok), "pydoc"]))
  assert "val_fraction" in _err(DataConfig(val_fraction=0.0))
  assert "empty list" in _err(DataConfig(train=[]))


@pytest.mark.parametrize("shuffle_buffer", [0, 4])
def test_resume_at_every_batch_across_epoch_boundaries(tmp_path, shuffle_buffer):
  # A corpus of a few windows: an epoch is 3-4 batches, so 4 epochs are read and every resume
  # point (before, at and after each boundary) is tried.
  from stablejax.training.checkpoint import Checkpoints
  rng = np.random.default_rng(11)
  path = tmp_path / "small.txt"
  path.write_bytes(_words(rng, 80))  # one paragraph, 480 bytes
  cfg = DataConfig(train=str(path), shuffle_buffer=shuffle_buffer, val_fraction=0.1)
  build = lambda: build_data(cfg, seq_len=SEQ, batch_size=BS, seed=7)  # noqa: E731
  windows = build().stats["train_tokens"] // (SEQ + 1)
  assert 8 <= windows <= 16
  n = 4 * windows // BS + 2
  want = _take(build().train_iter(), n)
  epoch = windows // BS
  assert not all((a == b).all() for a, b in zip(want[:epoch], want[epoch:2 * epoch]))  # new order
  d = build()
  it = d.train_iter()
  for k in range(n - 1):
    # The state after k batches; the resumed iterator reads on past the next epoch boundary.
    state = it.get_state()
    resumed = d.train_iter()  # (a freshly built pipeline restores below, through Orbax)
    resumed.set_state(state)
    got = _take(resumed, min(n - k, epoch + 2))
    assert all((a == b).all() for a, b in zip(got, want[k:])), k
    next(it)
  # Through the trainer's checkpoints (Orbax + Grain), just after the first boundary.
  it = build().train_iter()
  _take(it, epoch + 1)
  ckpt = Checkpoints(tmp_path / "ckpt", keep=2, async_save=False)
  ckpt.save(epoch + 1, {"x": np.zeros(2, np.float32)}, it, {})
  ckpt.close()
  import jax
  fresh = build().train_iter()
  ckpt = Checkpoints(tmp_path / "ckpt", keep=2, async_save=False)
  _, meta = ckpt.restore({"x": jax.ShapeDtypeStruct((2,), np.float32)}, fresh)
  ckpt.close()
  assert meta["step"] == epoch + 1
  got = _take(fresh, n - epoch - 1)
  assert all((a == b).all() for a, b in zip(got, want[epoch + 1:]))


# ----------------------------------------------------------------------------- prepared folders


def _prepared(tmp_path, name="prepared"):
  """A small prepared folder (bytes tokens, vocabulary 256), written by prepare itself."""
  from stablejax.data.prepare import Options, prepare
  text = tmp_path / f"{name}.txt"
  text.write_text("<|endoftext|>".join(f"Document {i}: the quick brown fox jumps. " * (1 + i % 5)
                                       for i in range(80)))
  out = tmp_path / name
  prepare([str(text)], out, "bytes", opts=Options(val_fraction=0.25), progress=False,
          log=lambda line: None)
  return out


def _sha256(path) -> str:
  import hashlib
  return hashlib.sha256(path.read_bytes()).hexdigest()


def test_token_ids_of_a_prepared_folder_are_checked_against_its_vocabulary(tmp_path):
  out = _prepared(tmp_path)
  build_data(DataConfig(train=str(out)), seq_len=SEQ, batch_size=BS, seed=0)  # as written: fine
  meta = json.loads((out / "meta.json").read_text())
  top = int(np.fromfile(out / "train.bin", np.uint16).max())
  # meta.json edited to a smaller vocabulary: the recorded largest id is above it.
  (out / "meta.json").write_text(json.dumps(dict(meta, vocab_size=top)))
  assert f"train.bin holds token id {top} >= vocab size {top}" in _err(
      DataConfig(train=str(out)))
  # A folder of an earlier release (no record of its files) with an id 5000 in a vocab-256
  # corpus: the ids are read and checked.
  old = {k: v for k, v in meta.items() if k != "files"}
  (out / "meta.json").write_text(json.dumps(old))
  ids = np.fromfile(out / "train.bin", np.uint16)
  ids[len(ids) // 2] = 5000
  ids.tofile(out / "train.bin")
  assert "train.bin holds token id 5000 >= vocab size 256" in _err(DataConfig(train=str(out)))


def test_a_prepared_file_changed_in_place_is_refused_and_a_copied_folder_is_accepted(tmp_path):
  import shutil
  out = _prepared(tmp_path)
  copy = tmp_path / "copy"
  shutil.copytree(out, copy)  # other inodes and times: verified by reading, and the same data
  build_data(DataConfig(train=str(copy)), seq_len=SEQ, batch_size=BS, seed=0)
  assert identity.identity_difference(identity.data_identity(str(out)),
                                      identity.data_identity(str(copy))) is None
  assert identity.data_identity(str(copy))["train"][0]["checked"] == "sha256"
  assert identity.data_identity(str(out))["train"][0]["checked"] == "status"
  ids = np.fromfile(out / "val.bin", np.uint16)
  ids[0] = (int(ids[0]) + 1) % 256  # the same size, another content
  ids.tofile(out / "val.bin")
  msg = _err(DataConfig(train=str(out)))
  assert "val.bin is not the file python -m stablejax prepare wrote" in msg
  with pytest.raises(DataError, match="SHA-256"):
    identity.data_identity(str(out))


def test_data_identity_of_each_kind_of_source(tmp_path):
  out = _prepared(tmp_path)
  ident = identity.data_identity(DataConfig(train=str(out), weights=None))
  assert json.loads(json.dumps(ident)) == ident and ident["format"] == identity.IDENTITY_FORMAT
  (entry,) = ident["train"]
  assert entry["kind"] == "prepared" and entry["path"] == str(out.resolve())
  assert entry["files"] == {n: {"bytes": (out / n).stat().st_size, "sha256": _sha256(out / n)}
                            for n in ("train.bin", "val.bin")}
  assert entry["tokenizer"]["kind"] == "bytes" and entry["vocab_size"] == 256
  assert ident["settings"]["filter_max_repeat"] == 256 and ident["val"] == []
  # An earlier release's folder (no hashes in meta.json): hashed once, the same identity.
  meta = json.loads((out / "meta.json").read_text())
  (out / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "files"}))
  old = identity.data_identity(str(out))
  assert old["train"][0]["files"] == entry["files"] and old["train"][0]["checked"] == "read"
  # Plain files: their SHA-256 (or, beyond hash_limit, their sizes and times, and it says so).
  text = tmp_path / "a.txt"
  text.write_bytes(b"hello world\n" * 100)
  bins = tmp_path / "t.bin"
  np.arange(1000, dtype=np.uint16).tofile(bins)
  for path in (text, bins):
    (got,) = identity.data_identity(str(path))["train"]
    assert got["sha256"] == _sha256(path) and got["bytes"] == path.stat().st_size
    (big,) = identity.data_identity(str(path), hash_limit=10)["train"]
    assert "sha256" not in big and "sizes and mtimes" in big["checked"]
  folder = tmp_path / "texts"
  (folder / "sub").mkdir(parents=True)
  (folder / "b.txt").write_text("bee " * 50)
  (folder / "sub" / "a.md").write_text("ay " * 50)
  before = identity.data_identity(str(folder))
  assert before["train"][0]["files"] == 2
  (folder / "sub" / "a.md").write_text("ay " * 49 + "oh ")
  assert "content (SHA-256)" in identity.identity_difference(before,
                                                            identity.data_identity(str(folder)))
  assert identity.data_identity("pydoc")["train"][0]["kind"] == "pydoc"
  # The config's own settings are part of it.
  a = identity.data_identity(DataConfig(train="pydoc"))
  b = identity.data_identity(DataConfig(train="pydoc", filter_max_repeat=64))
  assert identity.identity_difference(a, b) == "data settings differ: filter_max_repeat"
  with pytest.raises(DataError, match="does not exist"):
    identity.data_identity(str(tmp_path / "missing.bin"))
