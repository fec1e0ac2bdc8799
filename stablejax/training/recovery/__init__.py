"""Restoring, rolling back and diagnosing: when to roll back (:mod:`.policy`), what a restore
reads of a checkpoint (:mod:`.restore_plan`) and doing it (:mod:`.restorer`), a resume's checks
(:mod:`.resume`), the replay of a failing window (:mod:`.replay`) and the answer to a failure
(:mod:`.healing`), rejected batches (:mod:`.rejected`), replica fingerprints (:mod:`.replicas`)
and the progress watchdog (:mod:`.watchdog`)."""
