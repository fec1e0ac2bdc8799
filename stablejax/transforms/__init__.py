"""Gradient-side stability transforms (optax ``GradientTransformation``s).

Each module declares what it offers: its transform and state (their public names are
``stablejax``'s, its ``_EXPORTS``), its config section and chain position
(:mod:`stablejax.transforms.defence`), its metrics (:mod:`stablejax.transforms.metrics`). Nothing
lists the modules: the trainer's registry and the monitor import every module of this folder
(:func:`stablejax.transforms._registry.package_modules`), so a defence added here is a module
and nothing else.
"""
