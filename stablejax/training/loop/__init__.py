"""The training run and its step loop: :class:`Trainer` (:mod:`.trainer`, the way from
``python -m stablejax train`` to the step), the jitted step (:mod:`.step`), what a run builds once
(:mod:`.components`), what it does every so many steps (:mod:`.actions`), its data stream
(:mod:`.batches`), the time budget (:mod:`.budget`) and the train state (:mod:`.train_state`).

The trainer's names load on first use: ``stablejax.apply_gradients`` lives in
:mod:`.train_state`, and importing it must not pull in the data pipeline, Orbax or Grain (the
library installs without the train extra)."""

import importlib as _importlib
from typing import Any as _Any

__all__ = ["EXIT_DIVERGED", "EXIT_HUNG", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_REPLICAS_DIFFER",
           "EXIT_TRANSIENT", "Interrupted", "RECOVERY_FILE", "Trainer"]


def __getattr__(name: str) -> _Any:
  if name in __all__:
    return getattr(_importlib.import_module("stablejax.training.loop.trainer"), name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(__all__))
