"""The trainer: config, model, step, checkpoints, recovery, logging and the run loop; starting a
run on several processes (:mod:`.launch`); and reading a finished run back (:mod:`.runs`, with
:mod:`.sampling` and :mod:`.quantized_eval` on top). The data pipeline is :mod:`stablejax.data`."""
