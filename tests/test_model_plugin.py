"""A Flax NNX model from public code stablejax was not written for (the JAX AI Stack tutorial's
MiniGPT, tests/plugins/minigpt_nnx.py) trains through a plugin that declares its family: the
checkpoints, the monitor and a rollback work; what the family does not offer (attention logits)
is one line where it is asked for, and without decoding it samples by re-running the model."""

from pathlib import Path

import pytest

from helpers import read_metrics, slow, summary

PLUGIN = Path(__file__).parent / "plugins" / "minigpt_nnx.py"
MINIGPT = ("model.family=minigpt", "model.max_seq_len=32", "model.embed_dim=32",
           "model.num_heads=2", "model.feed_forward_dim=64", "model.num_transformer_blocks=2",
           "logging.attention_logits=false")


@pytest.fixture
def minigpt():
  from stablejax.modeling import family
  from stablejax.training import plugins
  plugins.load([str(PLUGIN)])
  yield
  family.unregister("minigpt")


def _run(out, *overrides, fresh=True):
  """The tiny test run (tests/helpers.py) with MiniGPT in place of its model section."""
  from stablejax.cli.train import main
  from helpers import TINY
  items = [item for item in TINY if not item.startswith("model.")] + [*MINIGPT, *overrides]
  return main([a for item in items for a in ("--set", item)]
              + ["--plugin", str(PLUGIN), "--out", str(out)] + (["--fresh"] if fresh else []))


@slow
def test_a_public_nnx_model_trains_through_a_plugin_with_rollback_and_checkpoints(
    minigpt, tmp_path, capsys):
  out = tmp_path / "minigpt"
  # NaN gradients from data batches 13 to 16: four skipped steps in a row ask for a rollback,
  # which restores step 10 and skips those batches.
  assert _run(out, "train.steps=20", "checkpoint.every=10", "train.eval_every=10",
              "faults.nan_grad_batch_indices=[13,14,15,16]",
              "stability.skip_nonfinite.max_consecutive=4") == 0
  printed = capsys.readouterr()
  assert "(model family minigpt)" in printed.out
  assert "warning: rollback 1/3" in printed.err and "restored step 10" in printed.err
  records = read_metrics(out)
  train = [r for r in records if "loss" in r and "event" not in r]
  assert train[-1]["step"] == 20 and train[-1]["loss"] < train[0]["loss"] - 0.3
  assert any(r.get("event") == "rollback" for r in records)
  assert all("health" in r and "stability_score" in r for r in train)  # the monitor's record
  assert summary(out)["rollbacks"] == 1 and summary(out)["mfu"] is None  # no FLOPs declared
  # A resume restores its checkpoint (the NNX parameters as a plain dict) and goes on (with the
  # same stack: the first start's programs, reused in this process).
  assert _run(out, "train.steps=24", "checkpoint.every=10", "train.eval_every=10",
              "stability.skip_nonfinite.max_consecutive=4", fresh=False) == 0
  assert "(resuming at step 20)" in capsys.readouterr().out
  assert max(r["step"] for r in read_metrics(out) if "loss" in r) == 24
  # What the family does not offer is one line where it is asked for.
  assert _run(out, "train.steps=24", "stability.qk_clip.enabled=true", fresh=False) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "model family 'minigpt' does not offer attention logits" in err[0]
  # Nothing but its forward pass: sample re-runs the model on the growing context.
  from stablejax.training.trained.decoding import RECOMPUTE
  from stablejax.training.trained.sampling import sample
  result = sample(out, "x", max_new_tokens=2)
  assert result["decoding"] == RECOMPUTE and len(result["tokens"][0]) == 2
