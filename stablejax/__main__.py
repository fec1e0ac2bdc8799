"""``python -m stablejax COMMAND ...``: the ``stablejax`` command (:func:`stablejax.cli.main`)."""

import sys

from stablejax.cli import main

if __name__ == "__main__":
  sys.exit(main())
