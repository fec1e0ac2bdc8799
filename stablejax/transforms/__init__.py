"""Gradient-side stability transforms (optax ``GradientTransformation``s).

Importing the package imports the transforms' modules in chain order, so their metrics are
registered (and listed by the monitor) in it. Their public names are ``stablejax``'s (its
``_EXPORTS``); the trainer reads their declarations through
:func:`stablejax.transforms.defence.registered`, not through this import.
"""

from stablejax.transforms import clip, zclip, adagc, update_clip, hybrid  # noqa: F401
from stablejax.transforms import loss_scaling, metrics, qk_clip  # noqa: F401
from stablejax.transforms import finite_skip, spike_skip  # noqa: F401
from stablejax.transforms import compensated  # noqa: F401
