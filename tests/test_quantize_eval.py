"""python -m stablejax quantize-eval on a tiny trained run: restore, losses against independent
numpy evaluations, bit widths, exclusion, a damaged checkpoint, and the exit-2 cases."""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest

from stablejax import merge_emb_proj
from stablejax.cli.quantize_eval import main
from stablejax.data.pipeline import build_data
from stablejax.training.trained.quantized_eval import RESULT_FILE, quantize_eval
from stablejax.training.trained.run import load_run_config
from stablejax.modeling.gpt import GPT
from helpers import (assert_unusable_path_is_one_line, once_per_config, run_inprocess, summary,
                     unusable_path_cases)

STEPS = 60   # fewer leave the weights so close to their initial noise that 2 bits barely matter
EVERY = 10   # checkpoint.every of the tiny config


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """60 steps of the tiny trainer model with SSNorm and EmbProj; the last 3 checkpoints kept.

  AdamW, because the Muon step takes twice as long to compile and the optimizer does not matter
  here; a known peak FLOP rate skips the trainer's matmul benchmark for MFU.
  """
  out = tmp_path_factory.mktemp("qrun")
  code = run_inprocess(out, f"train.steps={STEPS}", "train.eval_every=30", "model.norm=\"ssnorm\"",
                       "model.emb_proj=true", "optimizer.name=\"adamw\"",
                       "train.peak_flops_per_device=1e11", "logging.histogram_every=0",
                       "logging.activation_every=0", "logging.tensorboard=false")
  assert code == 0
  return out


def _val_tokens(cfg, n):
  data = build_data(cfg.data, seq_len=cfg.train.seq_len, batch_size=cfg.train.batch_size,
                    seed=cfg.train.seed)
  return [b["tokens"] for b in data.val_batches(n)]


@once_per_config
def _forward(model_cfg):
  """One jitted forward pass per model config (the numpy evaluations of one config share it)."""
  return jax.jit(lambda p, t: GPT(model_cfg).apply({"params": p}, t))


def _numpy_val_loss(model_cfg, params, batches) -> float:
  """Mean over batches of the mean next-token cross-entropy, log-softmax in float64 numpy."""
  forward = _forward(model_cfg)
  losses = []
  for tokens in batches:
    logits = np.asarray(forward(params, tokens[:, :-1]), np.float64)
    logits -= logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    target = tokens[:, 1:]
    losses.append(-np.take_along_axis(logp, target[..., None], -1).mean())
  return float(np.mean(losses))


def _numpy_rtn(params, bits):
  """Per-channel symmetric RTN re-derived in numpy: kernels [.., in, out] per output column,
  embedding tables per row; norm gains ('scale') and vectors untouched."""
  qmax = 2 ** (bits - 1) - 1

  def quant(path, w):
    names = [str(getattr(k, "key", k)) for k in path]
    w = np.asarray(w, np.float64)
    if w.ndim < 2 or names[-1] == "scale":
      return w.astype(np.float32)
    axis = -1 if any("embed" in n for n in names) else -2
    scale = np.abs(w).max(axis=axis, keepdims=True) / qmax
    scale = np.where(scale > 0, scale, 1.0)
    return (np.clip(np.round(w / scale), -qmax, qmax) * scale).astype(np.float32)

  return jax.tree_util.tree_map_with_path(quant, params)


def _params_of_trainer_restore(run_dir, tmp_path):
  """The final parameters, restored by the trainer's Checkpoints class (on a copy of the run)."""
  from stablejax.training.loop.trainer import Trainer

  copy = tmp_path / "copy"
  shutil.copytree(run_dir, copy)
  trainer = Trainer(load_run_config(copy), copy)
  state, meta = trainer.checkpoints.restore(trainer.components.abstract_state,
                                            trainer.components.data.train_iter())
  trainer.close()
  assert meta["step"] == STEPS
  return state.params


def test_losses_match_independent_evaluations(run, tmp_path):
  result = quantize_eval(run, bits=4)
  assert json.loads((run / RESULT_FILE).read_text()) == result
  cfg = load_run_config(run)
  assert result["checkpoint_step"] == STEPS and result["bits"] == 4
  assert result["batches"] == cfg.train.eval_batches and result["merged_emb_proj"] is True

  # Before: the trainer's own final val loss on the same checkpoint, and a numpy evaluation of the
  # parameters as the trainer restores them.
  params = _params_of_trainer_restore(run, tmp_path)
  val = _val_tokens(cfg, cfg.train.eval_batches)
  np.testing.assert_allclose(result["val_loss_before"], summary(run)["final_val_loss"], rtol=1e-6)
  np.testing.assert_allclose(result["val_loss_before"], _numpy_val_loss(cfg.model, params, val),
                             rtol=2e-5)

  # After: EmbProj merged, then every matrix RTN-quantised (numpy re-derivation).
  merged, merged_cfg = merge_emb_proj(params, cfg.model)
  expected_after = _numpy_val_loss(merged_cfg, _numpy_rtn(merged, 4), val)
  np.testing.assert_allclose(result["val_loss_after"], expected_after, rtol=2e-5)
  np.testing.assert_allclose(result["delta"], result["val_loss_after"] - result["val_loss_before"])

  # Without the merge, the projections themselves are quantised.
  unmerged = quantize_eval(run, bits=4, merge=False, write=False)
  assert unmerged["merged_emb_proj"] is False
  np.testing.assert_allclose(unmerged["val_loss_after"],
                             _numpy_val_loss(cfg.model, _numpy_rtn(params, 4), val), rtol=2e-5)


def test_fewer_bits_hurt_more(run):
  eight = quantize_eval(run, bits=8, write=False)
  two = quantize_eval(run, bits=2, write=False)
  assert eight["val_loss_before"] == two["val_loss_before"]
  # This early in training, rounding that zeroes leftover initial noise can also lower the loss a
  # little, so the size of the change is compared, not its sign.
  assert abs(eight["delta"]) < 0.005 * eight["val_loss_before"], eight
  assert abs(two["delta"]) > 0.02 and abs(two["delta"]) > 10 * abs(eight["delta"]), (eight, two)


def test_excluding_every_matrix_changes_nothing(run):
  result = quantize_eval(run, bits=2, batches=1, exclude=("blocks", "lm_head", "tok_embed"),
                         write=False)
  assert result["batches"] == 1
  np.testing.assert_allclose(result["val_loss_after"], result["val_loss_before"], rtol=1e-6)


def test_damaged_newest_checkpoint_falls_back(run, tmp_path, capsys):
  copy = tmp_path / "damaged"
  shutil.copytree(run, copy)
  for f in (copy / "checkpoints" / str(STEPS) / "state").rglob("*"):
    if f.is_file() and f.stat().st_size > 64 and "json" not in f.name:
      data = bytearray(f.read_bytes())
      for i in range(16, len(data), 97):
        data[i] ^= 0xFF
      f.write_bytes(bytes(data))
  assert main([str(copy), "--bits", "4"]) == 0
  captured = capsys.readouterr()
  assert f"checkpoint {STEPS} is unusable" in captured.err
  assert json.loads((copy / RESULT_FILE).read_text())["checkpoint_step"] == STEPS - EVERY
  assert "4-bit RTN" in captured.out and "difference" in captured.out


def _exit_2(argv, capsys) -> str:
  assert main(argv) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
  return err


def test_exit_2_cases(run, tmp_path, capsys):
  assert "does not exist" in _exit_2([str(tmp_path / "missing")], capsys)
  empty = tmp_path / "empty"
  empty.mkdir()
  assert "config.json" in _exit_2([str(empty)], capsys)
  no_ckpt = tmp_path / "no_ckpt"
  no_ckpt.mkdir()
  shutil.copy(run / "config.json", no_ckpt / "config.json")
  assert "no checkpoint" in _exit_2([str(no_ckpt)], capsys)
  (no_ckpt / "checkpoints").mkdir()
  assert "no checkpoint" in _exit_2([str(no_ckpt)], capsys)
  assert "bits" in _exit_2([str(run), "--bits", "9"], capsys)
  assert "--bits" in _exit_2([str(run), "--bits", "four"], capsys)
  assert not (no_ckpt / RESULT_FILE).exists()


def test_what_it_writes(run, tmp_path, capsys):
  """Its result and nothing else: never the run's records (even with --force), a file of the
  user's only with --force, and a read-only run directory is one line naming --out."""
  copy = tmp_path / "run"
  shutil.copytree(run, copy, ignore=shutil.ignore_patterns(".lock", RESULT_FILE))
  before = {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()}
  for target in ("config.json", "run.json", "metrics.jsonl", f"checkpoints/{STEPS}/x.json"):
    for force in ([], ["--force"]):
      assert "the run's own" in _exit_2([str(copy), "--out", str(copy / target), *force], capsys)
  (copy / RESULT_FILE).write_text('{"my": "own results"}')
  assert "not written by quantize-eval" in _exit_2([str(copy)], capsys)
  assert {p: p.read_bytes() for p in copy.rglob("*") if p.is_file() and p.name != RESULT_FILE} \
      == before
  disk = tmp_path / "ro"
  disk.mkdir()
  if __import__("subprocess").run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(disk)],
                                  capture_output=True).returncode != 0:
    pytest.skip("needs a file system of its own (mount)")
  import subprocess
  try:
    shutil.copytree(copy, disk / "run", ignore=shutil.ignore_patterns(RESULT_FILE))
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    err = _exit_2([str(disk / "run")], capsys)
    assert "read-only" in err and "--out" in err and "free some space" not in err, err
    assert main([str(disk / "run"), "--out", str(tmp_path / "q.json")]) == 0
  finally:
    subprocess.run(["umount", str(disk)], capture_output=True)
  capsys.readouterr()
  result = json.loads((tmp_path / "q.json").read_text())
  assert result["program"] == "stablejax quantize-eval" and result["checkpoint_step"] == STEPS
  assert main([str(copy), "--out", str(tmp_path / "q.json")]) == 0  # its own file: replaced


@pytest.mark.parametrize("args,line", unusable_path_cases("result.json", "q"))
def test_an_unusable_path_is_one_line(args, line, tmp_path, monkeypatch, capsys):
  assert_unusable_path_is_one_line(main, args, line, tmp_path, monkeypatch, capsys)
