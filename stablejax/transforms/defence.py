"""The defence declaration: one object per defence states what the trainer needs to know of it.

A defence is a transform (its module) plus one :class:`Defence` registered next to it. The
declaration says:

* its config section, ``stability.<name>`` (a dataclass with an ``enabled`` field, defaults that
  are the recommended values, and a ``validate`` method naming the key and the fix);
* how it builds its transform from that section, and where the transform sits in the trainer's
  chain (:class:`Position`, then ``order``);
* which extra arguments the train step must pass to ``update`` (``loss=``, ``max_logits=``), so
  that whether an argument is computed is decided once, from the declarations;
* its metrics: the state type, prefix and monitor rates it registers with
  :func:`stablejax.register_state_metrics`, which the monitor, the stability score, TensorBoard
  and the run report read;
* how the benchmarks call it (``label``).

The trainer's optimizer (``stablejax.training.optim.build_optimizer``), its config
(``stablejax.training.config``), its train step, the monitor and ``bench/stress.py`` read
:func:`registered`; nothing else lists the defences. The shape of a declaration follows optax's
``GradientTransformationExtraArgs`` (extra step arguments by keyword) and config-section
registries such as Levanter's optimizer configs (one dataclass per choice).

Example:
  >>> import dataclasses
  >>> import optax
  >>> from stablejax.transforms import defence
  >>> @dataclasses.dataclass
  ... class ScaleConfig:
  ...   enabled: bool = False
  ...   factor: float = 0.5
  ...   def validate(self, where, ctx):
  ...     if not self.factor > 0:
  ...       raise ValueError(f"{where}.factor={self.factor} must be > 0")
  >>> scale = defence.Defence(
  ...     name="example_scale", config=ScaleConfig, position=defence.Position.UPDATE,
  ...     build=lambda section, ctx: optax.scale(section.factor), label="scale the update")
  >>> _ = defence.register(scale)
  >>> [d.name for d in defence.registered()]  # chain order: by position, then order
  ['clip', 'zclip', 'adagc', 'example_scale', 'clip_update_rms', 'zclip_update_norm', 'qk_clip',
   'compensated_updates', 'skip_spikes', 'skip_nonfinite']
  >>> defence.unregister("example_scale")
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Callable, Optional, Union

import optax

Transform = Union[optax.GradientTransformation, optax.GradientTransformationExtraArgs]
Wrapper = Callable[[Transform], Transform]


class Position(enum.IntEnum):
  """Where a defence's transform sits in the trainer's chain (in this order)."""

  GRADIENT = 1
  """On the gradient, before the optimizer (clipping): ``chain(GRADIENT..., optimizer, ...)``."""
  UPDATE = 2
  """On the optimizer's update, before the trainer's learning-rate scale. The optimizer's own
  learning rate is already in it (``optax.adamw(schedule)``); a defence whose rule is stated on
  the update *before* the learning rate (Adafactor's update clipping) divides it out with
  :attr:`DefenceContext.learning_rates`."""
  FINAL = 3
  """On the final update, after every scaling of it (QK-clip rescales weights by it)."""
  WRAPPER = 4
  """Around the whole chain (skip wrappers); a larger ``order`` wraps outside a smaller one."""


@dataclasses.dataclass(frozen=True)
class DefenceContext:
  """What a builder or a validation may read besides its own section.

  Attributes:
    stability: the whole ``stability`` section (the sections of the other defences, z-loss).
    model: the ``model`` section (``n_heads``, ``qk_norm``, ``scan_layers``...), or None
      outside the trainer.
    learning_rates: the learning rate the optimizer has multiplied each parameter's update by
      when it reaches ``Position.UPDATE``: a function ``params -> pytree of schedules`` (optax
      schedules of the count of applied updates, or numbers), the structure of ``params``. The
      trainer's optimizer carries its schedules inside it (``optax.adamw(schedule)``, Muon's
      per-group rates), so a defence stated before the learning rate divides by these. None: the
      update reaching ``UPDATE`` carries no learning rate (an optimizer given as a direction).
  """

  stability: Any
  model: Any = None
  learning_rates: Optional[Callable[[Any], Any]] = None


@dataclasses.dataclass(frozen=True)
class Defence:
  """One defence, declared once.

  Attributes:
    name: the config section (``stability.<name>``) and the name the benchmarks use.
    config: the section's dataclass. It must have ``enabled: bool``; its defaults are the
      recommended settings; an optional ``validate(self, where, ctx)`` raises ``ValueError``
      naming the key (``where`` is ``"stability.<name>"``) and the fix.
    build: ``(section, ctx) -> transform`` for ``GRADIENT``, ``UPDATE`` and ``FINAL``;
      ``(section, ctx) -> (inner -> wrapped)`` for ``WRAPPER``. A builder returns None when its
      defence has nothing to do for this model (e.g. compensation of low-precision updates with
      float32 parameters): the chain then leaves it out, as if it were disabled.
    position: where the transform sits in the chain.
    order: the order within the position (smaller first; for wrappers, smaller inside).
    step_args: the extra arguments its ``update`` needs from the train step, e.g.
      ``("loss",)`` or ``("max_logits",)``.
    label: one line for tables and the benchmarks, e.g. ``"ZClip (z-score clipping)"``.
  """

  name: str
  config: type
  build: Callable[[Any, DefenceContext], Any]
  position: Position
  order: int = 0
  step_args: tuple[str, ...] = ()
  label: str = ""

  def section(self, stability: Any) -> Any:
    """This defence's section of a ``stability`` config."""
    return getattr(stability, self.name)


def check_positive(key: str, value: float, allow_zero: bool = False) -> None:
  """Raises ``ValueError("<key>=<value> must be > 0")`` (or ``>= 0``) for a bad number."""
  ok = value >= 0 if allow_zero else value > 0
  if not ok or value != value or value in (float("inf"), float("-inf")):
    raise ValueError(f"{key}={value} must be {'>= 0' if allow_zero else '> 0'}")


_REGISTRY: dict[str, Defence] = {}


def register(declaration: Defence) -> Defence:
  """Registers a defence (again under the same name: replaces it); returns it.

  Raises:
    ValueError: the name is not an identifier, or the section has no ``enabled`` field.
  """
  if not declaration.name.isidentifier():
    raise ValueError(f"defence name {declaration.name!r} must be an identifier (it is a config "
                     "section, stability.<name>)")
  fields = {f.name for f in dataclasses.fields(declaration.config)}
  if "enabled" not in fields:
    raise ValueError(f"the config of defence {declaration.name!r} has no 'enabled' field; add "
                     "`enabled: bool = False` (or True for a default-on defence)")
  _REGISTRY[declaration.name] = declaration
  return declaration


def unregister(name: str) -> None:
  """Forgets a defence (a no-op for an unknown name)."""
  _REGISTRY.pop(name, None)


def registered() -> tuple[Defence, ...]:
  """Every registered defence, in chain order: by position, then order, then name."""
  return tuple(sorted(_REGISTRY.values(), key=lambda d: (d.position, d.order, d.name)))


def get(name: str) -> Optional[Defence]:
  """The defence registered under ``name``, or None."""
  return _REGISTRY.get(name)


def enabled(stability: Any) -> tuple[Defence, ...]:
  """The registered defences whose section in ``stability`` is enabled, in chain order."""
  return tuple(d for d in registered() if d.section(stability).enabled)


def validate(stability: Any, ctx: DefenceContext) -> None:
  """Runs the ``validate`` of every enabled section (a disabled one's keys have no effect; the
  trainer names those that are set anyway).

  Raises:
    ValueError: the first problem, one line naming the key and the fix.
  """
  for d in enabled(stability):
    check = getattr(d.section(stability), "validate", None)
    if check is not None:
      check(f"stability.{d.name}", ctx)


def step_args(stability: Any) -> frozenset[str]:
  """The extra ``update`` arguments the enabled defences need from the train step."""
  return frozenset(arg for d in enabled(stability) for arg in d.step_args)


def build_chain(stability: Any, optimizer: Transform, *,
                update_scale: Optional[Transform] = None,
                ctx: Optional[DefenceContext] = None) -> optax.GradientTransformationExtraArgs:
  """The enabled defences of ``stability`` around ``optimizer``, in their positions::

      WRAPPER(... chain(GRADIENT..., optimizer, UPDATE..., update_scale, FINAL...))

  Args:
    stability: a ``stability`` config holding a section per registered defence.
    optimizer: the optimizer (its learning rate included).
    update_scale: a transform between the ``UPDATE`` and ``FINAL`` defences (the trainer's
      learning-rate scale that its recovery backs off), or None.
    ctx: what builders may read; default: ``DefenceContext(stability)``.

  Returns:
    The chain, with extra-argument support (``update(..., loss=..., max_logits=...)``).
  """
  ctx = ctx or DefenceContext(stability)
  on = enabled(stability)

  def built(position: Position) -> list:
    made = [d.build(d.section(stability), ctx) for d in on if d.position is position]
    return [t for t in made if t is not None]  # None: nothing to do for this model

  tx: Transform = optax.chain(*built(Position.GRADIENT), optimizer, *built(Position.UPDATE),
                              *([update_scale] if update_scale is not None else []),
                              *built(Position.FINAL))
  for wrap in built(Position.WRAPPER):
    tx = wrap(tx)
  return optax.with_extra_args_support(tx)
