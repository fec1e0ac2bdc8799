"""The trainer: config, model, data, step, checkpoints, recovery, logging and the run loop."""
