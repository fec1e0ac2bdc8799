"""Throughput of python -m stablejax prepare: MB of text per second, 1 and 2 worker processes.

    python -m bench.prepare [--mb 24] [--rounds 2] [--quick]

The corpus is the embedded pydoc text repeated into a JSON Lines file of about ``--mb`` MB (one
document per topic). Tokenizers: ``bytes`` and a 4096-token byte-level BPE trained on pydoc by
``prepare`` itself (``bpe:4096``; the corpus is then tokenized through its ``tokenizer.json``
path, so BPE training is timed separately). Each (tokenizer, workers) cell is timed ``--rounds``
times, interleaved, and the median MB/s printed. ``gpt2`` cannot be timed here: tiktoken's files
cannot be downloaded on this machine.

Hugging Face ``tokenizers`` also runs ``encode_batch`` on several threads inside one process,
so even 1 worker may use both cores for BPE.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench._common import print_machine
from stablejax.data import prepare as prep


def make_corpus(path: Path, megabytes: float) -> int:
  from pydoc_data.topics import topics
  docs = [topics[k] for k in sorted(topics)]
  written = 0
  with open(path, "w") as f:
    i = 0
    while written < megabytes * 1e6:
      text = f"[copy {i // len(docs)}] " + docs[i % len(docs)]
      line = json.dumps({"text": text}) + "\n"
      f.write(line)
      written += len(text.encode())
      i += 1
  return written


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--mb", type=float, default=24.0)
  p.add_argument("--rounds", type=int, default=2)
  p.add_argument("--quick", action="store_true", help="4 MB, one round")
  args = p.parse_args()
  if args.quick:
    args.mb, args.rounds = 4.0, 1
  print_machine()
  quiet = lambda line: None  # noqa: E731
  with tempfile.TemporaryDirectory() as tmp:
    tmp = Path(tmp)
    corpus = tmp / "corpus.jsonl"
    text_bytes = make_corpus(corpus, args.mb)
    print(f"corpus: {corpus.stat().st_size / 1e6:.1f} MB JSON Lines, {text_bytes / 1e6:.1f} MB of "
          f"text; TOKENIZERS_PARALLELISM={os.environ.get('TOKENIZERS_PARALLELISM', 'unset')}")
    t0 = time.perf_counter()
    prep.prepare(["pydoc"], tmp / "bpe", "bpe:4096", opts=prep.Options(val_fraction=0.05),
                 progress=False, log=quiet)
    print(f"bpe:4096 training on pydoc (0.46 MB): {time.perf_counter() - t0:.1f} s")
    tokenizers = {"bytes": "bytes",
                  "bpe:4096 (tokenizer.json)": str(tmp / "bpe" / "tokenizer.json")}
    times = {(name, w): [] for name in tokenizers for w in (1, 2)}
    for r in range(args.rounds):
      for (name, workers) in times:
        out = tmp / f"out_{r}_{workers}_{len(times[(name, workers)])}_{name[:3]}"
        t0 = time.perf_counter()
        meta = prep.prepare([str(corpus)], out, tokenizers[name], workers=workers,
                            progress=False, log=quiet)
        times[(name, workers)].append(time.perf_counter() - t0)
        tokens = meta["train_tokens"] + meta["val_tokens"]
        for f in out.iterdir():
          f.unlink()
        times[(name, workers)][-1] = (times[(name, workers)][-1], tokens)
    print(f"\n| tokenizer | workers | MB/s (median of {args.rounds}) | tokens/s | vs 1 worker |")
    print("|---|---|---|---|---|")
    for name in tokenizers:
      base = None
      for workers in (1, 2):
        secs = statistics.median(t for t, _ in times[(name, workers)])
        tokens = times[(name, workers)][0][1]
        mbs = text_bytes / 1e6 / secs
        base = base or mbs
        print(f"| {name} | {workers} | {mbs:.2f} | {tokens / secs:,.0f} | {mbs / base:.2f} |")
  print("\nload average after: %.2f %.2f %.2f" % os.getloadavg())


if __name__ == "__main__":
  main()
