"""The training run and its step loop: :class:`Trainer` (:mod:`.trainer`, the way from
``python -m stablejax train`` to the step), the jitted step (:mod:`.step`), what a run builds once
(:mod:`.components`), what it does every so many steps (:mod:`.actions`), its data stream
(:mod:`.batches`), the time budget (:mod:`.budget`) and the train state (:mod:`.train_state`)."""

from stablejax.training.loop.trainer import (EXIT_DIVERGED, EXIT_HUNG, EXIT_INTERRUPTED, EXIT_OK,
                                             EXIT_REPLICAS_DIFFER, EXIT_TRANSIENT, RECOVERY_FILE,
                                             Interrupted, Trainer)

__all__ = ["EXIT_DIVERGED", "EXIT_HUNG", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_REPLICAS_DIFFER",
           "EXIT_TRANSIENT", "Interrupted", "RECOVERY_FILE", "Trainer"]
