"""The run directory is the trainer's alone: a lock against a second writer, a record of what it
wrote, nothing deleted or appended that it did not write, nothing changed before the resume
checks pass, the data identity checked on resume, one-line errors of the environment, and run
directories of stablejax 0.1 that still resume."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from stablejax.training.run_folder.folder import RunDirectory
from stablejax.training.run_folder.record import RECORD, RunDirError
from helpers import ROOT, folder_locked_by, run_inprocess, run_subprocess, sets, slow

OLD_RUN = Path(__file__).parent / "data" / "run_v0_1"


def _tree(root: Path) -> dict[str, bytes]:
  """Every file under ``root`` with its bytes, but the lock file (the trainer's bookkeeping: its
  holder's name, rewritten by each writer that takes the lock)."""
  return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
          if p.is_file() and p.name != ".lock"}


FINGERPRINT = [12.5, 40.25, 0.0]


def _save_step(step_dir: Path, fingerprint=FINGERPRINT) -> None:
  """A step folder as Checkpoints saves it (the files the run-directory checks read)."""
  (step_dir / "state").mkdir(parents=True)
  (step_dir / "state" / "_METADATA").write_text("{}")
  (step_dir / "meta").mkdir()
  (step_dir / "meta" / "metadata").write_text(
      json.dumps({"step": int(step_dir.name), "fingerprint": fingerprint}))
  (step_dir / "_CHECKPOINT_METADATA").write_text("{}")


def _trainer_files(root: Path) -> None:
  """What a trainer run leaves, with its record (as RunDirectory writes it)."""
  run = RunDirectory.open(root)
  run.record_checkpoint(3, FINGERPRINT)  # before the save, as Checkpoints does
  _save_step(run.path("checkpoints") / "3")
  (run.path("tensorboard")).mkdir()
  (run.path("tensorboard") / "events.out.tfevents.1.host").write_bytes(b"\0")
  run.path("metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
  run.record_written()
  run.close()


# ----------------------------------------------------------------------------- ownership


def test_fresh_refuses_a_users_checkpoints_and_tensorboard_and_deletes_nothing(tmp_path):
  out = tmp_path / "run"
  (out / "checkpoints" / "ckpt-1000").mkdir(parents=True)
  (out / "checkpoints" / "ckpt-1000" / "model.pt").write_bytes(b"weights")
  (out / "tensorboard").mkdir()
  (out / "tensorboard" / "events.out").write_bytes(b"events")
  before = _tree(out)
  for fresh in (True, False):
    with pytest.raises(RunDirError, match="not written by this trainer") as e:
      RunDirectory.open(out, fresh=fresh)
    assert "\n" not in str(e.value) and "checkpoints" in str(e.value)
  assert _tree(out) == before


def test_a_foreign_metrics_file_is_refused_not_appended_to(tmp_path):
  out = tmp_path / "run"
  out.mkdir()
  (out / "metrics.jsonl").write_text("the user's own log\n")
  with pytest.raises(RunDirError, match=r"metrics.jsonl was not written by this trainer"):
    RunDirectory.open(out)
  assert (out / "metrics.jsonl").read_text() == "the user's own log\n"


def test_fresh_removes_only_what_the_record_lists(tmp_path):
  out = tmp_path / "run"
  _trainer_files(out)
  (out / "notes.txt").write_text("mine")
  before = _tree(out)
  run = RunDirectory.open(out, fresh=True)
  assert _tree(out) == before  # nothing is deleted before the new start's checks passed
  run.remove_previous()
  assert sorted(p.name for p in out.iterdir()) == [".lock", "notes.txt", RECORD]
  assert run.recorded == set()
  run.close()


def test_fresh_is_all_or_nothing_when_a_recorded_folder_holds_a_foreign_file(tmp_path):
  out = tmp_path / "run"
  _trainer_files(out)
  (out / "checkpoints" / "best.pt").write_bytes(b"the user's")
  before = _tree(out)
  with pytest.raises(RunDirError, match=r"checkpoints/best.pt: not written by this trainer"):
    RunDirectory.open(out, fresh=True)
  assert _tree(out) == before  # metrics.jsonl and tensorboard/ were not deleted either


def test_a_users_file_beside_or_inside_a_recorded_run_is_refused(tmp_path):
  """A run with its record: a trainer name the record does not list (a summary.json of the
  user's), or a file of the user's inside a step folder, is refused; nothing changes."""
  out = tmp_path / "run"
  _trainer_files(out)
  (out / "summary.json").write_text("the user's")
  before = _tree(out)
  with pytest.raises(RunDirError, match=r"summary.json was not written by this trainer \(no "
                                        r"record of it in .*run.json\)"):
    RunDirectory.open(out)
  (out / "summary.json").unlink()
  (out / "checkpoints" / "3" / "notes.txt").write_text("the user's")
  with pytest.raises(RunDirError, match=r"checkpoints/3/notes.txt: not written by this trainer"):
    RunDirectory.open(out)
  assert _tree(out) == {**{k: v for k, v in before.items() if k != "summary.json"},
                        "checkpoints/3/notes.txt": b"the user's"}


def test_out_naming_a_file_is_one_line(tmp_path):
  out = tmp_path / "run"
  out.write_text("a file")
  with pytest.raises(RunDirError, match="is a file: pass a folder"):
    RunDirectory.open(out)


def test_a_run_directory_of_0_1_is_adopted_by_its_config(tmp_path):
  out = tmp_path / "old"
  shutil.copytree(OLD_RUN, out)
  run = RunDirectory.open(out)
  assert {"checkpoints", "config.json", "metrics.jsonl", "tensorboard", "tokenizer"} <= run.recorded
  run.close()
  # The same folder without a stablejax config.json is somebody else's.
  (out / "config.json").write_text('{"lr": 3e-4}')
  with pytest.raises(RunDirError, match="not written by this trainer"):
    RunDirectory.open(out)


# ----------------------------------------------------------------------------- one writer


def test_a_second_trainer_on_the_same_out_stops_with_one_line(tmp_path, capsys):
  out = tmp_path / "run"
  out.mkdir()
  with folder_locked_by(out, "train") as holder:
    assert run_inprocess(out, fresh=False) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "is in use by train (process " \
        f"{holder.pid}" in err[0]
    assert sorted(p.name for p in out.iterdir()) == [".lock"]  # nothing written but its lock


# ----------------------------------------------------------------------------- check before write


@slow
def test_a_refused_resume_changes_nothing_and_prints_one_line(clean_run, tmp_path):
  out = tmp_path / "run"
  shutil.copytree(clean_run, out)
  before = _tree(out)
  # Another model width: the checkpoint cannot be restored into it.
  result = run_subprocess(out, "model.d_model=64", timeout=300)
  assert result.returncode == 2, result.stderr[-2000:]
  lines = [line for line in result.stderr.splitlines() if not line.startswith("warning")]
  assert len(lines) == 1 and "does not fit this run" in lines[0], result.stderr
  # What differs, not "memory or storage": the array and both shapes.
  assert "(2, 32, 32) float32 in the checkpoint and (2, 64, 64) float32 in this run" in lines[0]
  after = _tree(out)
  assert after["config.json"] == before["config.json"]  # still says d_model 32
  assert after == before


@slow
def test_a_resume_on_other_data_is_refused_unless_said(clean_run, tmp_path, capsys):
  out = tmp_path / "run"
  shutil.copytree(clean_run, out)
  other = tmp_path / "other.txt"
  other.write_text("some other corpus entirely, which is not the Python docs. " * 400)
  before = _tree(out)
  assert run_inprocess(out, f"data.train={other}", fresh=False) == 2
  err = capsys.readouterr().err
  assert "the data is not the data this run trained on" in err and "--data-changed" in err
  assert _tree(out) == before
  # Said on purpose: it resumes (at the end already: the final evaluation only) and records it.
  from stablejax.cli.train import main
  assert main(sets(f"data.train={other}") + ["--out", str(out), "--data-changed"]) == 0
  record = json.loads((out / RECORD).read_text())
  assert record["data"]["train"][0]["path"] == str(other)


# ----------------------------------------------------------------------------- the environment


def _mount_tmpfs(path: Path, options: str) -> bool:
  """A small file system of our own (needs root, which this project's machines and CI have)."""
  path.mkdir(parents=True, exist_ok=True)
  return subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                        capture_output=True).returncode == 0


def _one_error_line(stderr: str) -> str:
  lines = [line for line in stderr.splitlines() if not line.startswith("warning")]
  assert len(lines) == 1 and lines[0].startswith("error: "), stderr[-3000:]
  return lines[0]


@slow
def test_a_full_disk_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
  disk = tmp_path / "disk"
  if _mount_tmpfs(disk, "size=200k"):  # the first checkpoint does not fit
    try:
      result = run_subprocess(disk / "run", timeout=300)
    finally:
      subprocess.run(["umount", str(disk)], capture_output=True)
    assert result.returncode == 2, result.stderr[-2000:]
    line = _one_error_line(result.stderr)  # not Orbax's threads' tracebacks
  else:  # no right to mount: the disk fills at the first file the trainer writes
    import errno
    import os

    from stablejax.training import checkpoint

    def full(path, data, indent=1):
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    monkeypatch.setattr(checkpoint, "write_json_atomic", full)
    monkeypatch.setattr("stablejax.training.run_folder.folder.write_json_atomic", full,
                        raising=False)
    assert run_inprocess(disk / "run") == 2
    line = _one_error_line(capsys.readouterr().err)
  assert line.startswith("error: cannot write into the run directory ") and \
      "the disk is full" in line, line


def test_errors_of_the_environment_are_one_line_each():
  """Found through the chain of errors Orbax and tensorstore wrap them in (by errno, whatever the
  words), or by the words of a log message; any other error is none of them."""
  import errno

  from stablejax.training.run_folder.environment_errors import (environment_message,
                                                                is_environment_error)
  out = Path("exp")
  wrapped = ValueError("RESOURCE_EXHAUSTED: writing the checkpoint")
  wrapped.__cause__ = OSError(errno.ENOSPC, "write failed")
  assert environment_message(wrapped, out) == (
      "cannot write into the run directory exp: the disk is full; free space or choose another "
      "--out (the last complete checkpoint resumes the run)")
  assert environment_message(OSError(errno.EROFS, "write failed"), out) == (
      "cannot write into the run directory exp: the file system is read-only; choose another "
      "--out")
  denied = PermissionError(errno.EACCES, "Permission denied", "exp/run.json")
  assert environment_message(denied, out) == (
      "cannot write into the run directory exp/run.json: permission denied; choose another --out")
  oom = RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 2.00GiB")
  assert environment_message(oom, out).startswith("the device ran out of memory: lower ")
  assert is_environment_error("OSError: [Errno 30] Read-only file system: 'exp/run.json'")
  assert is_environment_error(wrapped)
  for other in (KeyError("model"), RuntimeError("RESOURCE_EXHAUSTED: received message larger "
                                                "than max (4194304)")):
    assert environment_message(other, out) is None and not is_environment_error(other)


def test_a_read_only_out_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
  disk = tmp_path / "ro"
  if _mount_tmpfs(disk, "ro,size=64k"):
    try:
      assert run_inprocess(disk / "run", fresh=False) == 2
    finally:
      subprocess.run(["umount", str(disk)], capture_output=True)
  else:  # no right to mount: the folder cannot be created
    import errno
    import os

    def read_only(self, *args, **kwargs):
      raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
    monkeypatch.setattr(Path, "mkdir", read_only)
    assert run_inprocess(disk / "run", fresh=False) == 2
  line = _one_error_line(capsys.readouterr().err)
  assert "the file system is read-only; choose another --out" in line, line


# ----------------------------------------------------------------------------- runs of 0.1


# The command that trained tests/data/run_v0_1 with stablejax 0.1, in this version's keys.
OLD_COMMAND = [
    "model.d_model=16", "model.n_layers=1", "model.n_heads=2", "model.max_seq_len=16",
    "model.qk_norm=false", "train.seq_len=16", "train.batch_size=4", "train.warmup_steps=2",
    "train.eval_every=4", "train.eval_batches=1", "train.log_every=2",
    "stability.qk_clip.enabled=true", "stability.qk_clip.tau=30", "stability.zclip.warmup_steps=5",
    "stability.skip_spikes.window=8", "stability.skip_spikes.min_history=4",
    "checkpoint.every=4", "checkpoint.keep=1", "checkpoint.async_save=false",
    "logging.sample_every=0", "logging.progress=false", "train.peak_flops_per_device=1e12",
    "logging.histogram_every=0", "logging.activation_every=0",
]


def test_a_run_of_0_1_reads_back_in_the_new_keys():
  from stablejax.training.trained.run import load_run_config
  cfg = load_run_config(OLD_RUN)
  s = cfg.stability
  assert (s.qk_clip.enabled, s.qk_clip.tau) == (True, 30.0)
  assert (s.zclip.warmup_steps, s.skip_spikes.window, s.skip_spikes.min_history) == (5, 8, 4)
  assert s.skip_nonfinite.max_consecutive == s.skip_spikes.max_consecutive == 16


@slow
def test_a_run_of_0_1_resumes(tmp_path, capsys):
  from stablejax.cli.train import main
  out = tmp_path / "old"
  shutil.copytree(OLD_RUN, out)
  # Its positional optimizer state is read in the layout of its config, then matched by name:
  # switched off at this resume, ZClip's state is dropped.
  argv = [a for item in OLD_COMMAND + ["train.steps=10", "stability.zclip.enabled=false"]
          for a in ("--set", item)]
  assert main(argv + ["--out", str(out)]) == 0
  printed = capsys.readouterr().out
  assert "(resuming at step 8)" in printed
  assert "resumed with zclip off: its state dropped" in printed
  records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
  assert max(r["step"] for r in records) == 10 and any("qk_clip/max_logit" in r for r in records)
  assert not any("zclip/z" in r for r in records if r["step"] > 8)
  config = json.loads((out / "config.json").read_text())
  assert config["stability"]["qk_clip"] == {"enabled": True, "tau": 30.0}
  assert json.loads((out / RECORD).read_text())["adopted"] == "a run directory of stablejax 0.1"
  # A flat key of 0.1 in the command is one line naming its new key.
  assert main(["--set", "stability.qk_clip_tau=30", "--out", str(out)]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "use stability.qk_clip.enabled and stability.qk_clip.tau" in err[0]


def test_the_test_data_was_written_by_0_1():
  config = json.loads((OLD_RUN / "config.json").read_text())
  assert "qk_clip_tau" in config["stability"] and not (OLD_RUN / RECORD).exists()
  assert sorted(p.name for p in (OLD_RUN / "checkpoints").iterdir()) == ["8"]
  assert ROOT in OLD_RUN.parents


def test_a_start_that_fails_early_leaves_no_empty_out(tmp_path, capsys):
  out = tmp_path / "new_run"
  assert run_inprocess(out, "data.train=/no/such/corpus") == 2
  assert "does not exist" in capsys.readouterr().err
  assert not out.exists()


# ------------------------------------------------------------------------ what is the trainer's


def _users_experiment(root: Path, config: dict) -> None:
  """A folder of someone else's training: a config.json the trainer can read, a log, a
  checkpoint and TensorBoard events, and no run.json."""
  root.mkdir(parents=True)
  (root / "config.json").write_text(json.dumps(config))
  (root / "metrics.jsonl").write_text('{"step": 1000, "loss": 2.5}\n')
  (root / "checkpoints" / "1000").mkdir(parents=True)
  (root / "checkpoints" / "1000" / "model.pt").write_bytes(b"weights")
  (root / "tensorboard").mkdir()
  (root / "tensorboard" / "events.out.tfevents.1.host").write_bytes(b"events")


@pytest.mark.parametrize("config", ["empty", "full"])
def test_a_config_json_alone_does_not_make_a_folder_the_trainers(tmp_path, config):
  """Not a run directory of 0.1: its checkpoints are not the trainer's, whatever its
  config.json (even one with every section). Refused with one line naming the files, with and
  without --fresh; nothing deleted, appended to or rewritten."""
  full = json.loads((OLD_RUN / "config.json").read_text())
  out = tmp_path / "exp"
  _users_experiment(out, {} if config == "empty" else full)
  before = _tree(out)
  for fresh in (True, False):
    with pytest.raises(RunDirError) as e:
      RunDirectory.open(out, fresh=fresh)
    message = str(e.value)
    assert "\n" not in message and "not written by this trainer" in message
    assert all(name in message for name in ("checkpoints", "config.json", "metrics.jsonl"))
  assert _tree(out) == before


def test_a_users_config_given_as_config_in_out_stays_as_it_was(tmp_path, capsys):
  """train --config exp/config.json --out exp, on a folder the trainer never wrote: one line,
  exit 2, and the user's 4-section file as it was (no full config with the overrides baked in)."""
  from stablejax.cli.train import main
  out = tmp_path / "exp"
  out.mkdir()
  users = {"model": {"d_model": 32, "n_layers": 2, "n_heads": 2, "max_seq_len": 32},
           "train": {"steps": 1000, "seq_len": 32, "batch_size": 8, "warmup_steps": 4},
           "optimizer": {"learning_rate": 0.01}, "logging": {"progress": False}}
  text = json.dumps(users, indent=2)
  (out / "config.json").write_text(text)
  assert main(["--config", str(out / "config.json"), "--out", str(out),
               "--set", "train.steps=10"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "--config" in err[0] and "did not write that file" in err[0], err
  assert (out / "config.json").read_text() == text
  assert sorted(p.name for p in out.iterdir()) == ["config.json"]


def test_a_removed_lock_file_does_not_let_a_second_trainer_in(tmp_path):
  out = tmp_path / "run"
  out.mkdir()
  with folder_locked_by(out, "train") as holder:
    (out / ".lock").unlink()  # a "stale lock" clean-up under a live trainer
    with pytest.raises(RunDirError, match=f"in use by process {holder.pid} "):
      RunDirectory.open(out, fresh=True)
    assert list(out.iterdir()) == []


def test_fresh_through_a_symbolic_link_is_one_line_and_deletes_nothing(tmp_path):
  """checkpoints/ moved to another disk and linked back: --fresh deletes nothing (none of
  config.json, metrics.jsonl, ... either) and says so in one line; a resume still reads through
  the link."""
  out = tmp_path / "run"
  _trainer_files(out)
  run = RunDirectory.open(out)
  run.path("config.json")
  run.record_written()
  (out / "config.json").write_text("{}")  # recorded first, as the trainer does
  run.close()
  elsewhere = tmp_path / "big_disk" / "checkpoints"
  elsewhere.parent.mkdir()
  shutil.move(str(out / "checkpoints"), str(elsewhere))
  (out / "checkpoints").symlink_to(elsewhere)
  before, target = _tree(out), _tree(elsewhere)
  for _ in range(2):  # the same every time
    with pytest.raises(RunDirError, match="symbolic link") as e:
      RunDirectory.open(out, fresh=True)
    assert "\n" not in str(e.value) and "nothing was deleted" in str(e.value)
  assert _tree(out) == before and _tree(elsewhere) == target
  RunDirectory.open(out).close()  # resuming through the link is fine


def test_fresh_is_all_or_nothing_when_a_name_cannot_be_moved(tmp_path, monkeypatch):
  out = tmp_path / "run"
  _trainer_files(out)
  before = _tree(out)
  import os
  real = os.rename

  def rename(src, dst):
    if Path(src).name == "tensorboard":
      raise PermissionError(13, "Permission denied", str(src))
    return real(src, dst)

  run = RunDirectory.open(out, fresh=True)
  monkeypatch.setattr(os, "rename", rename)
  with pytest.raises(RunDirError, match="nothing was deleted"):
    run.remove_previous()
  run.close()
  assert _tree(out) == before


def test_fresh_deletes_nothing_before_the_new_starts_checks_pass(tmp_path, capsys):
  """--fresh with a data path that does not exist: exit 2, the previous run as it was."""
  out = tmp_path / "run"
  _trainer_files(out)
  before = _tree(out)
  assert run_inprocess(out, 'data.train="typo"', fresh=True) == 2
  assert "typo" in capsys.readouterr().err
  assert _tree(out) == before


def _copy_run(source: Path, out: Path) -> None:
  shutil.copytree(source, out, ignore=shutil.ignore_patterns(".lock"))


def test_a_step_copied_in_from_another_run_is_refused(clean_run, tmp_path):
  """A step folder of another run put into the recorded checkpoints/, under a new step or over
  one the run saved, is not resumed from: the record holds each saved step's fingerprint."""
  out = tmp_path / "run"
  _copy_run(clean_run, out)
  other = tmp_path / "other_run_step"
  shutil.copytree(out / "checkpoints" / "30", other)
  meta = json.loads((other / "meta" / "metadata").read_text())
  meta["step"] = 40
  (other / "meta" / "metadata").write_text(json.dumps(meta))
  before = _tree(out)
  shutil.copytree(other, out / "checkpoints" / "60")  # a step this run never saved
  with pytest.raises(RunDirError, match=r"checkpoints/60 is not a checkpoint this run saved"):
    RunDirectory.open(out)
  shutil.rmtree(out / "checkpoints" / "60")
  assert _tree(out) == before
  shutil.rmtree(out / "checkpoints" / "40")
  shutil.copytree(other, out / "checkpoints" / "40")  # over a step it saved
  for fresh in (False, True):
    with pytest.raises(RunDirError, match=r"checkpoints/40 is not the checkpoint this run saved "
                                          r"at step 40"):
      RunDirectory.open(out, fresh=fresh)


@slow
def test_a_resume_that_set_a_damaged_checkpoint_aside_resumes_again(clean_run, tmp_path):
  """The trainer records damaged_checkpoints/ before it moves a damaged step there, so the next
  start (a requeue) resumes instead of refusing its own folder."""
  out = tmp_path / "run"
  _copy_run(clean_run, out)
  (out / "checkpoints" / "40" / "state" / "_METADATA").unlink()  # damaged: falls back to 30
  assert run_inprocess(out, fresh=False) == 0
  assert sorted(p.name for p in (out / "damaged_checkpoints").iterdir()) == ["40"]
  assert "damaged_checkpoints" in json.loads((out / RECORD).read_text())["written"]
  RunDirectory.open(out).close()  # the next start is not refused


def _small_vocabulary_corpus(folder: Path) -> Path:
  """A corpus prepared with a Hugging Face BPE of 120 tokens (fits the byte-level model's 256)."""
  from tokenizers import Tokenizer, models, pre_tokenizers, trainers

  from stablejax.data.prepare import Options, prepare
  folder.mkdir()
  texts = [f"document {i} about the quick brown fox and the lazy dog number {i * 7}"
           for i in range(200)]
  tok = Tokenizer(models.BPE(unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=120,
                                                     special_tokens=["<|endoftext|>", "[UNK]"]))
  tok.save(str(folder / "bpe.json"))
  (folder / "corpus.txt").write_text("<|endoftext|>".join(texts))
  prepare([str(folder / "corpus.txt")], folder / "prepared", str(folder / "bpe.json"),
          opts=Options(val_fraction=0.2), progress=False, log=lambda line: None)
  return folder / "prepared"


def test_data_changed_never_resumes_on_another_tokenizer(clean_run, tmp_path, capsys):
  """tokenizer/record.json deleted, then --data-changed onto BPE data: refused, since the
  tokenizer is recorded in run.json and in every checkpoint too."""
  from stablejax.cli.train import main
  corpus = _small_vocabulary_corpus(tmp_path / "bpe")
  out = tmp_path / "run"
  _copy_run(clean_run, out)
  (out / "tokenizer" / "record.json").unlink()
  before = _tree(out)
  assert main(sets(f"data.train={corpus}", "model.vocab_size=256")
              + ["--out", str(out), "--data-changed"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "is not the one this run was trained with" in err[0], err
  assert "byte-level" in err[0] and "never another tokenizer" in err[0]
  assert _tree(out) == before


def test_a_start_that_fails_on_a_full_disk_leaves_no_out(tmp_path, monkeypatch):
  """The first write of a new run fails (ENOSPC): the folder it created goes again."""
  import errno
  import os

  def full(path, data, indent=1):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
  monkeypatch.setattr("stablejax.training.run_folder.folder.write_json_atomic", full)
  out = tmp_path / "new"
  run = RunDirectory.open(out)
  run.path("checkpoints")
  with pytest.raises(OSError):
    run.record_written()
  run.close()
  assert not out.exists()


@slow
def test_a_resume_with_another_data_order_says_so_in_one_line(clean_run, tmp_path, capsys):
  out = tmp_path / "run"
  _copy_run(clean_run, out)
  assert run_inprocess(out, "train.seed=1", "data.shuffle_buffer=64", fresh=False) == 0
  warnings = [line for line in capsys.readouterr().err.splitlines() if "order" in line]
  assert warnings == ["warning: train.seed 0 -> 1, data.shuffle_buffer 256 -> 64 since the last "
                      "start of this run: the batches from here on come in another order than "
                      "the run's own (the data is the same)"], warnings
  assert json.loads((out / RECORD).read_text())["data_order"]["train.seed"] == 1


# ----------------------------------------------------------------------------- more attacks


def test_a_recorded_file_replaced_by_a_link_is_never_written_through(tmp_path):
  out = tmp_path / "run"
  _trainer_files(out)
  important = tmp_path / "important.log"
  important.write_text("the user's log\n")
  (out / "metrics.jsonl").unlink()
  (out / "metrics.jsonl").symlink_to(important)
  with pytest.raises(RunDirError, match="metrics.jsonl is a symbolic link"):
    RunDirectory.open(out)
  (out / "metrics.jsonl").unlink()
  import os
  os.link(important, out / "metrics.jsonl")  # appended to, it would grow the user's log too
  with pytest.raises(RunDirError, match="has other names"):
    RunDirectory.open(out)
  assert important.read_text() == "the user's log\n"


def test_out_inside_another_runs_folder_is_refused(tmp_path):
  run = tmp_path / "run"
  _trainer_files(run)
  before = _tree(run)
  for inside in (run / "checkpoints" / "sweep", run / "tensorboard", run / "checkpoints"):
    with pytest.raises(RunDirError, match="which the trainer keeps for the run in"):
      RunDirectory.open(inside)
  assert _tree(run) == before
  RunDirectory.open(run / "sweep").close()  # beside its records is a folder like any other


def test_a_fresh_killed_while_deleting_is_finished_by_the_next_start(tmp_path, monkeypatch):
  out = tmp_path / "run"
  _trainer_files(out)
  run = RunDirectory.open(out, fresh=True)

  def killed(path, *args, **kwargs):
    raise KeyboardInterrupt  # as if killed in the deletion
  monkeypatch.setattr("stablejax.training.run_folder.previous.shutil.rmtree", killed)
  with pytest.raises(KeyboardInterrupt):
    run.remove_previous()
  monkeypatch.undo()
  run.close()
  assert sorted(p.name for p in out.iterdir()) == [".fresh-removing", RECORD]
  run = RunDirectory.open(out)  # the record lists the folder: its own
  run.record_written()
  assert sorted(p.name for p in out.iterdir()) == [".lock", RECORD]
  run.close()


def test_a_file_put_into_the_folder_of_a_killed_fresh_is_not_deleted(tmp_path, monkeypatch):
  out = tmp_path / "run"
  _trainer_files(out)
  run = RunDirectory.open(out, fresh=True)

  def killed(path, *args, **kwargs):
    raise KeyboardInterrupt
  monkeypatch.setattr("stablejax.training.run_folder.previous.shutil.rmtree", killed)
  with pytest.raises(KeyboardInterrupt):
    run.remove_previous()
  monkeypatch.undo()
  run.close()
  (out / ".fresh-removing" / "keep.txt").write_text("mine")
  with pytest.raises(RunDirError, match=r"keep.txt: not written by this trainer"):
    RunDirectory.open(out)
  assert (out / ".fresh-removing" / "keep.txt").read_text() == "mine"


def test_a_record_of_the_previous_release_adopts_its_checkpoints(clean_run, tmp_path):
  """run.json without fingerprints (written before they were recorded): the steps there are the
  run's, recorded as found at the next start; a step copied in after that is refused."""
  out = tmp_path / "run"
  _copy_run(clean_run, out)
  record = json.loads((out / RECORD).read_text())
  for key in ("checkpoints", "tokenizer", "data_order"):
    record.pop(key)
  (out / RECORD).write_text(json.dumps(record))
  run = RunDirectory.open(out)
  run.record_written()
  run.close()
  saved = json.loads((out / RECORD).read_text())["checkpoints"]
  assert sorted(saved, key=int) == sorted((p.name for p in (out / "checkpoints").iterdir()),
                                          key=int)
  shutil.copytree(out / "checkpoints" / "30", out / "checkpoints" / "50")
  with pytest.raises(RunDirError, match="checkpoints/50 is not a checkpoint this run saved"):
    RunDirectory.open(out)


# ----------------------------------------------------------------------------- unusable paths


# (arguments of train, what its one line says): each path checked before anything is read or
# written (tests/test_prepare.py, test_sample.py, test_report.py and test_quantize_eval.py check
# the other programs' paths).
UNUSABLE_PATHS = [
    (["--out", ""], "argument --out: the path is empty"),
    (["--out", "loop/run"], "argument --out: loop/run leads through a loop of symbolic links"),
    (["--out", "r" * 300], "argument --out: the name rrrr"),
    (["--set", 'data.train="loop/corpus.txt"', "--out", "run"],
     "data.train: loop/corpus.txt leads through a loop of symbolic links"),
    (["--plugin", "loop/mine.py", "--out", "run"],
     "plugin 'loop/mine.py' (from --plugin): loop/mine.py leads through a loop"),
]


@pytest.mark.parametrize("args,line", UNUSABLE_PATHS)
def test_an_unusable_path_is_one_line_and_nothing_is_written(args, line, tmp_path, monkeypatch,
                                                             capsys):
  from stablejax.cli.train import main
  monkeypatch.chdir(tmp_path)
  (tmp_path / "loop").symlink_to("loop")  # a link to itself
  try:  # a tiny run of a few steps (what an unchecked "" would have started, in runs/<config>)
    code = main(sets("train.steps=5") + args)
  except SystemExit as e:  # the parser's refusals exit as argparse's do
    code = e.code
  assert code == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith(f"error: {line}"), err
  assert sorted(p.name for p in tmp_path.iterdir()) == ["loop"]


def test_the_trainer_never_takes_an_empty_out_for_the_current_folder(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  with pytest.raises(RunDirError, match="--out: the path is empty"):
    RunDirectory.open("")
  assert list(tmp_path.iterdir()) == []


def test_an_unreadable_recorded_config_is_said_not_passed_over(tmp_path, capsys):
  import types

  from stablejax.training.loop.trainer import Trainer
  (tmp_path / "config.json").write_text('{"train": {"steps": 4')  # cut short
  run_dir = types.SimpleNamespace(root=tmp_path, recorded={"config.json"})
  recorded = Trainer._recorded_config(types.SimpleNamespace(run_dir=run_dir, is_main=True))
  assert recorded is None  # (only a keyed checkpoint resumes then)
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("warning: the config of the run's last start "
                                             "cannot be read"), err
  assert "not valid JSON" in err[0] and "what changed since then is not listed" in err[0]
