"""The trainer, by room: the run's config (:mod:`.config`); the training run and its step loop
(:mod:`.loop`, ``Trainer``); the optimizer built from the declarations (:mod:`.optim`);
checkpoints (:mod:`.checkpoint`); restoring, rolling back and diagnosing (:mod:`.recovery`); the
run directory and its record (:mod:`.run_folder`); several devices and processes
(:mod:`.launch`); a finished run read back (:mod:`.trained`); and the user's declarations
(:mod:`.plugins`). The data pipeline is :mod:`stablejax.data`."""
