"""Train a Pre-LN GPT with the stablejax stability stack: ``python -m stablejax train``.

    python train.py [--config NAME_OR_FILE] [--set SECTION.KEY=VALUE ...] [--out DIR] [--fresh]

Kept at the repository root for nanoGPT-style use; the program is :mod:`stablejax.cli.train`.
"""

import sys

from stablejax.cli.train import main

if __name__ == "__main__":
  sys.exit(main())
