"""The run directory and its record: ownership and lock (:mod:`.folder`), what the trainer writes
there and ``run.json`` (:mod:`.record`), the checks of a folder (:mod:`.checks`), ``--fresh``'s
removal (:mod:`.previous`), the one file other programs write (:mod:`.outputs`), errors of the
environment (:mod:`.environment_errors`), the data order (:mod:`.data_order`), the logs
(:mod:`.logger`) and the banner and ``summary.json`` (:mod:`.summary`)."""
