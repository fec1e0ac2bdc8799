"""The examples in examples/ run, print the routing, and their loss falls (small sizes)."""

import pathlib
import re

import numpy as np
import pytest

from helpers import load_example, run_python

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
SMALL = ["--steps", "30", "--d-model", "32", "--layers", "1", "--batch", "8", "--seq-len", "32"]


def run_example(script: str) -> str:
  """The example's output at the small sizes."""
  return run_python(EXAMPLES / script, *SMALL, timeout=900, check=True).stdout


def _row(stdout: str, path: str) -> list:
  line = next(text for text in stdout.splitlines() if text.startswith(path + " "))
  return re.split(r"\s{2,}", line)  # path, shape, group, muon matrix, learning rate


def _loss_fell(stdout: str) -> None:
  first, last = map(float, re.search(r"^loss (\S+) -> (\S+)$", stdout, re.M).groups())
  assert last < first - 1.5, (first, last)  # about 6.1 -> 3.9 at these sizes
  assert re.search(r"^step 30: .*skipped 0\+0, .*muon fallbacks 0$", stdout, re.M), stdout


@pytest.mark.slow
def test_nnx_example():
  stdout = run_example("nnx_lm.py")
  assert _row(stdout, "out/kernel")[2] == "head"
  assert _row(stdout, "out/bias")[2] == "adam"
  assert _row(stdout, "embed/embedding")[2] == "embedding"
  assert _row(stdout, "pos_embed")[2] == "embedding"
  assert _row(stdout, "blocks/0/attn/query/kernel")[2:4] == ["muon", "32x32"]
  assert _row(stdout, "blocks/0/attn/query/bias")[2] == "adam"
  assert _row(stdout, "blocks/0/fc/kernel")[2:4] == ["muon", "32x128"]
  assert "muon: 6 tensors" in stdout
  _loss_fell(stdout)


@pytest.mark.slow
def test_linen_example(capsys):
  # Its main() in this process (the interpreter's start-up and imports are the NNX example's
  # subprocess's to check): the same script, loaded by path as Python runs it.
  load_example("linen_lm").main(SMALL)
  stdout = capsys.readouterr().out
  assert _row(stdout, "Dense_0/kernel")[2] == "head"  # the unnamed last Dense, found by shape
  assert "note: Dense_0/kernel (32, 256) is routed to 'head'" in stdout
  assert _row(stdout, "Embed_0/embedding")[2] == "embedding"
  assert _row(stdout, "Block_0/MultiHeadDotProductAttention_0/out/kernel")[2:4] == ["muon", "32x32"]
  assert _row(stdout, "Block_0/LayerNorm_0/scale")[2] == "adam"
  assert "muon: 6 tensors" in stdout
  _loss_fell(stdout)


@pytest.mark.slow
def test_hf_flax_example_trains_gpt2_with_qk_clip(capsys):
  hf_flax_lm = load_example("hf_flax_lm")
  losses = hf_flax_lm.train("gpt2", steps=12, d_model=32, layers=1, seq_len=16)
  out = capsys.readouterr().out
  assert _row(out, "transformer/h/0/attn/c_attn/kernel")[2:5] == ["muon", "3 x 32x32",
                                                                   "names and shapes"]
  assert "orthogonalised per projection" in out
  assert all(np.isfinite(losses)) and losses[-1] < losses[0] - 1.0, losses
