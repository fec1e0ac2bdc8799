"""What the example scripts share, none of it about stablejax: the data they train on (the bytes
of the script itself, so nothing is downloaded), the model sizes on the command line, and the
progress line of the README chain's counters."""

import argparse

import jax.numpy as jnp
import numpy as np


def batches(script: str, batch_size: int, seq_len: int, seed: int = 0):
  """Endless ``(inputs, targets)`` int32 batches ``[batch_size, seq_len]`` of byte ids: random
  windows of the file ``script``, the targets one byte on."""
  data = np.frombuffer(open(script, "rb").read(), np.uint8)
  rng = np.random.default_rng(seed)
  while True:
    starts = rng.integers(0, len(data) - seq_len - 1, batch_size)
    chunk = np.stack([data[s:s + seq_len + 1] for s in starts]).astype(np.int32)
    yield jnp.asarray(chunk[:, :-1]), jnp.asarray(chunk[:, 1:])


def size_arguments(description: str, argv=None) -> argparse.Namespace:
  """``--steps``, ``--d-model``, ``--heads``, ``--layers``, ``--batch`` and ``--seq-len``."""
  p = argparse.ArgumentParser(description=description)
  p.add_argument("--steps", type=int, default=300)
  p.add_argument("--d-model", type=int, default=64)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--seq-len", type=int, default=64)
  return p.parse_args(argv)


def print_progress(step: int, losses: list, metrics: dict) -> None:
  """The mean loss of the last 20 steps and the counters of the README chain's defences."""
  print(f"step {step}: loss {np.mean(losses[-20:]):.3f}, "
        f"skipped {int(metrics['skip_nonfinite/total_skips'])}+"
        f"{int(metrics['skip_spikes/total_skips'])}, "
        f"zclip spikes {int(metrics['zclip/spike_count'])}, "
        f"muon fallbacks {int(metrics['muon/fallback_count'])}")
