"""The one line for a program started without the extra that brings its dependencies."""

from __future__ import annotations

from typing import Optional

# The packages of the "train" extra (pyproject.toml): the library installs without them.
TRAIN_EXTRA = ("orbax", "grain", "tensorboardX", "tqdm", "matplotlib", "tokenizers", "tiktoken")


def missing_extra(error: ModuleNotFoundError, command: str) -> Optional[str]:
  """The error line for ``python -m stablejax COMMAND`` missing ``error.name``, or None when
  that module is not one of the train extra's."""
  top = (error.name or "").split(".")[0]
  if top not in TRAIN_EXTRA:
    return None
  return (f"error: python -m stablejax {command} needs {top}, which comes with the train extra: "
          "pip install 'stablejax[train]'")
