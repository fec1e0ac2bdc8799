"""Running on several devices and processes: the device mesh and shardings (:mod:`.mesh`),
joining a job and agreeing (:mod:`.distributed`), stop signals at safe points (:mod:`.signals`),
the persistent compilation cache a process uses (:mod:`.compilation_cache`), and
``python -m stablejax launch`` (:mod:`.launcher`). Nothing heavy is imported here: a program
installs its signal handlers from :mod:`.signals` before it imports JAX."""
