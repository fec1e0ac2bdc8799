"""The defence declaration: one object per defence states what the trainer needs to know of it.

A defence is a transform (its module) plus one :class:`Defence` declared at the top level of that
module. The declaration says:

* its config section, ``stability.<name>`` (a dataclass with an ``enabled`` field, defaults that
  are the recommended values, and a ``validate`` method naming the key and the fix);
* how it builds its transform from that section: ``factory`` is called with the section's fields
  (``build`` instead, where the section and the factory's arguments differ), and where the
  transform sits in the trainer's chain (:class:`Position`, then ``order``);
* which extra arguments the train step must pass to ``update`` (``loss=``, ``max_logits=``: the
  :class:`StepArgument` registry says how the step computes each), so that whether an argument is
  computed is decided once, from the declarations;
* whether its state changes how updates reach the parameters (``changes_update_application``),
  and which keys have no effect in which setting (``ineffective``);
* how the benchmarks call it (``label``).

Its metrics (the state type, prefix, monitor rates, skip and rollback counters) are registered
with :func:`stablejax.register_state_metrics` next to the transform, so the library's
:func:`stablejax.stability_metrics` reads them without the trainer.

Registration is explicit: :func:`registered` loads the built-in declarations from the modules of
:mod:`stablejax.transforms` the first time it is asked (every ``Defence`` defined at a module's
top level), and :func:`register_module` does the same for a user's module (the trainer's
``--plugin``). A new defence is its module and its test; nothing else lists it. The trainer's
optimizer (``stablejax.training.optim.build_optimizer``), its config, its train step, the monitor
and ``bench/`` read this registry. The shape of a declaration follows optax's
``GradientTransformationExtraArgs`` (extra step arguments by keyword) and config-section
registries such as Levanter's optimizer configs (one dataclass per choice).

The trainer's chain keeps each defence's state under its name (:func:`build_chain`,
:mod:`stablejax.transforms.keyed`), so a run can switch a defence on or off between two starts.

Example:
  >>> import dataclasses
  >>> import optax
  >>> from stablejax.transforms import defence
  >>> @dataclasses.dataclass
  ... class ScaleConfig:
  ...   enabled: bool = False
  ...   step_size: float = 0.5
  ...   def validate(self, where, ctx):
  ...     if not self.step_size > 0:
  ...       raise ValueError(f"{where}.step_size={self.step_size} must be > 0")
  >>> scale = defence.Defence(
  ...     name="example_scale", config=ScaleConfig, position=defence.Position.UPDATE,
  ...     factory=optax.scale, label="scale the update")  # optax.scale(step_size=...)
  >>> _ = defence.register(scale)
  >>> names = [d.name for d in defence.registered()]  # chain order: by position, then order
  >>> names.index("zclip") < names.index("example_scale") < names.index("qk_clip")
  True
  >>> names[-2:]  # the wrappers, innermost first
  ['skip_spikes', 'skip_nonfinite']
  >>> defence.unregister("example_scale")
"""

from __future__ import annotations

import dataclasses
import enum
import types
from typing import Any, Callable, Iterable, Optional, Protocol, Sequence, Union

import jax
import jax.numpy as jnp
import optax

from stablejax.transforms._registry import (Builtins, DeclarationError, Registry,
                                            section_fields)
from stablejax.transforms.keyed import OPTIMIZER_KEY, keyed_chain, nest

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
  """Around the whole chain (skip wrappers); a larger ``order`` wraps outside a smaller one.
  A wrapper's state must be a NamedTuple with an ``inner_state`` field (optax's
  ``apply_if_finite`` shape), so the trainer can keep its own fields under its name."""


# Keys of the trainer's optimizer state that are not defences: OPTIMIZER_KEY ({optimizer name:
# its state}) and the learning-rate scale the recovery backs off.
LR_SCALE_KEY = "lr_scale"
RESERVED_NAMES = (OPTIMIZER_KEY, LR_SCALE_KEY)


class HeadCounts(Protocol):
  """The attention layout a defence may read (``stablejax.modeling.family.AttentionHeads``)."""

  @property
  def num_heads(self) -> int: ...
  @property
  def num_kv_heads(self) -> int: ...
  @property
  def qk_norm(self) -> bool: ...


class TrainedModel(Protocol):
  """What a defence may ask of the model the trainer trains
  (``stablejax.modeling.family.LanguageModel`` offers it; this floor cannot import it)."""

  @property
  def param_dtype(self) -> str: ...
  @property
  def stacked_layers(self) -> bool: ...
  def attention_heads(self) -> HeadCounts: ...
  def require(self, capability: str, needed_by: str) -> None: ...


class OptimizerSection(Protocol):
  """What a defence may read of the ``optimizer`` section
  (``stablejax.training.config.optimizers.OptimizerConfig``)."""

  name: str
  learning_rate: float
  weight_decay: float


@dataclasses.dataclass(frozen=True)
class DefenceContext:
  """What a builder, a validation or an ``ineffective`` rule may read besides its own section.

  Attributes:
    stability: the whole ``stability`` section (the sections of the other defences, z-loss).
    model: the model the trainer trains, a :class:`stablejax.modeling.family.LanguageModel`
      (its family's config at ``model.config``; ``model.attention_heads()``,
      ``model.param_dtype``, ``model.stacked_layers``), or None outside the trainer.
    learning_rates: the learning rate the optimizer has multiplied each parameter's update by
      when it reaches ``Position.UPDATE``: a function ``params -> pytree of schedules`` (optax
      schedules of the count of applied updates, or numbers), the structure of ``params``. The
      trainer's optimizer carries its schedules inside it (``optax.adamw(schedule)``, Muon's
      per-group rates), so a defence stated before the learning rate divides by these. None: the
      update reaching ``UPDATE`` carries no learning rate (an optimizer given as a direction).
    matrices: the optimizer's matrices, ``params -> pytree`` of each hidden matrix's dimension
      numbers (None for embeddings, the head, norms, biases): the Muon routing's
      (:func:`stablejax.muon_dimension_numbers`), whichever optimizer runs. None outside the
      trainer.
    optimizer: the ``optimizer`` section of the trainer's config (its weight decay, its name),
      or None.
  """

  stability: Any  # the trainer's StabilitySections, whose defences' sections are registered
  model: Optional[TrainedModel] = None
  learning_rates: Optional[Callable[[optax.Params], Any]] = None
  matrices: Optional[Callable[[optax.Params], Any]] = None
  optimizer: Optional[OptimizerSection] = None


@dataclasses.dataclass(frozen=True)
class Defence:
  """One defence, declared once.

  Attributes:
    name: the config section (``stability.<name>``), the key of its state in the trainer's
      optimizer state, and the name the benchmarks use.
    config: the section's dataclass. It must have ``enabled: bool``; its defaults are the
      recommended settings; an optional ``validate(self, where, ctx)`` raises ``ValueError``
      naming the key (``where`` is ``"stability.<name>"``) and the fix.
    position: where the transform sits in the chain.
    factory: the transform's factory, called with the section's fields but ``enabled`` as
      keyword arguments, and those of ``context(ctx)``; a wrapper's factory takes the inner
      transform first (``skip_spikes(inner, window=...)``).
    build: ``(section, ctx) -> transform`` (a wrapper: ``-> (inner -> wrapped)``) instead of
      ``factory``, where the section's fields are not the factory's arguments. It may return
      None when its defence has nothing to do for this model (e.g. compensation of
      low-precision updates with float32 parameters): the chain then leaves it out, as if it
      were disabled.
    context: ``ctx -> dict`` of keyword arguments ``factory`` takes from the trainer (e.g. the
      learning rates); ignored with ``build``.
    order: the order within the position (smaller first; for wrappers, smaller inside).
    step_args: the extra arguments its ``update`` needs from the train step, e.g.
      ``("loss",)`` or ``("max_logits",)``: names of registered :class:`StepArgument`.
    label: one line for tables and the benchmarks, e.g. ``"ZClip (z-score clipping)"``.
    changes_update_application: its state changes how updates reach the parameters (the
      compensated low-precision update keeps what rounds away), so an update below the
      parameters' resolution is not lost: the "parameters are not moving" check allows for it.
    ineffective: ``(section, ctx) -> [(key, reason), ...]``: keys of its section (full dotted
      names) that are set but have no effect in this setting, besides "every key of a disabled
      defence", which the trainer checks itself. The trainer warns about each at start.
    before_scale: ``(section, ctx) -> transform`` without state (``optax.EmptyState``), run on
      the update just before the learning-rate scale, for a defence at ``FINAL`` whose rule
      starts before that scale: Hyperball normalises each matrix's update there, so that the
      scale (the recovery's backoff) multiplies the step it then takes. It has no entry in the
      optimizer state (it runs inside the scale's entry).
  """

  name: str
  config: type
  position: Position
  factory: Optional[Callable[..., Any]] = None
  build: Optional[Callable[[Any, DefenceContext], Any]] = None
  context: Optional[Callable[[DefenceContext], dict]] = None
  order: int = 0
  step_args: tuple[str, ...] = ()
  label: str = ""
  changes_update_application: bool = False
  ineffective: Optional[Callable[[Any, DefenceContext], Iterable[tuple[str, str]]]] = None
  before_scale: Optional[Callable[[Any, DefenceContext], Any]] = None

  def section(self, stability: Any) -> Any:
    """This defence's section of a ``stability`` config."""
    return getattr(stability, self.name)

  def make(self, section: Any, ctx: DefenceContext) -> Any:
    """The transform (a wrapper: the function wrapping an inner transform) for ``section``."""
    if self.build is not None:
      return self.build(section, ctx)
    assert self.factory is not None, "register() checks that a declaration has one of the two"
    factory = self.factory
    kwargs = {f.name: getattr(section, f.name) for f in dataclasses.fields(section)
              if f.name != "enabled"}
    if self.context is not None:
      kwargs.update(self.context(ctx))
    if self.position is Position.WRAPPER:
      return lambda inner: factory(inner, **kwargs)
    return factory(**kwargs)


def check_positive(key: str, value: float, allow_zero: bool = False) -> None:
  """Raises ``ValueError("<key>=<value> must be > 0")`` (or ``>= 0``) for a bad number."""
  ok = value >= 0 if allow_zero else value > 0
  if not ok or value != value or value in (float("inf"), float("-inf")):
    raise ValueError(f"{key}={value} must be {'>= 0' if allow_zero else '> 0'}")


# ----------------------------------------------------------------------------- the registry


def register(declaration: Defence, origin: Optional[str] = None) -> Defence:
  """Registers a defence; returns it. The same declaration registered again changes nothing;
  another one under a registered name is refused (``unregister`` the first to replace it).

  Args:
    declaration: the defence.
    origin: the module that declares it, for the messages (default: its config's module).

  Raises:
    DeclarationError: (a ``ValueError``) the name is declared already by another module, is not
      an identifier or is reserved, the section is not a dataclass with a default for every
      field and an ``enabled`` field, the declaration has neither ``factory`` nor ``build`` (or
      both), or it has a ``before_scale`` half with a position other than ``FINAL``.
  """
  owner = f"defence {declaration.name!r}"
  if not declaration.name.isidentifier() or declaration.name in RESERVED_NAMES:
    raise DeclarationError(f"defence name {declaration.name!r} must be an identifier other than "
                           f"{', '.join(RESERVED_NAMES)} (it is a config section, "
                           "stability.<name>, and the key of its state)")
  if "enabled" not in section_fields(declaration.config, owner):
    raise DeclarationError(f"the config of {owner} has no 'enabled' field; add "
                           "`enabled: bool = False` (or True for a default-on defence)")
  if declaration.before_scale is not None and declaration.position is not Position.FINAL:
    raise DeclarationError(f"{owner} has a before_scale half, so its own transform goes after "
                           "the learning-rate scale: position=Position.FINAL")
  if (declaration.factory is None) == (declaration.build is None):
    raise DeclarationError(f"{owner} needs exactly one of factory= (called with its section's "
                           "fields) and build= (section, ctx) -> transform")
  _REGISTRY.add(declaration.name, declaration,
                origin or str(getattr(declaration.config, "__module__", "?")))
  return declaration


def register_module(module: types.ModuleType, origin: Optional[str] = None) -> list[Defence]:
  """Registers every :class:`Defence` (and :class:`StepArgument`) defined at the top level of
  ``module``; returns the defences. The built-in modules and the trainer's plugins are
  registered this way.

  Args:
    module: the module.
    origin: how the messages name it (default: its name; a plugin: as it was given).

  Raises:
    DeclarationError: a declaration :func:`register` refuses.
  """
  _load_builtins()  # first: a declaration of the user's is the second of its name, not the first
  origin = origin or module.__name__
  found = []
  for value in vars(module).values():
    if isinstance(value, Defence):
      found.append(register(value, origin))
    elif isinstance(value, StepArgument):
      register_step_argument(value, origin)
  return found


# The declarations of stablejax/transforms/'s modules, registered when first asked for.
_BUILTINS = Builtins(__name__.rsplit(".", 1)[0],
                     lambda module: register_module(module))
_load_builtins = _BUILTINS.load
_REGISTRY: Registry[Defence] = Registry(
    "defence", "its config section, stability.<name>, and the key of its state", _load_builtins)


def unregister(name: str) -> None:
  """Forgets a defence (a no-op for an unknown name)."""
  _REGISTRY.remove(name)


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


def in_state(opt_state: optax.OptState) -> tuple[Defence, ...]:
  """The registered defences whose state a keyed optimizer state holds (:func:`build_chain`'s),
  in chain order; () for any other state."""
  if not isinstance(opt_state, dict):
    return ()
  return tuple(d for d in registered() if d.name in opt_state)


def step_args(stability: Any) -> frozenset[str]:
  """The extra ``update`` arguments the enabled defences need from the train step."""
  return frozenset(arg for d in enabled(stability) for arg in d.step_args)


# ----------------------------------------------------------------------------- step arguments


ForwardPass = dict
"""What one micro-batch's forward pass gives a :class:`StepArgument`, a dict: ``loss`` (its mean
loss), ``logits`` (float32 ``[B, T, V]``), ``targets`` (``[B, T]``) and, when an argument asked
for them (``needs``), ``attention_logits`` (``{layer name: [*stack, H]}``, each attention layer's
per-head max pre-softmax logit). A plain dict (a pytree), so a model may add outputs of its own
for an argument of a plugin."""


@dataclasses.dataclass(frozen=True)
class StepArgument:
  """An extra ``update`` argument the train step can compute (``tx.update(..., name=value)``).

  The step computes it from each micro-batch's forward pass and combines the micro-batches with
  ``reduce``; a defence asks for it by name (:attr:`Defence.step_args`). Registered like a
  defence (:func:`register_step_argument`, or by defining it in a module the trainer loads).

  Attributes:
    name: the keyword of ``update``.
    description: one line for the docs.
    compute: ``ForwardPass -> pytree of arrays``, traced inside the step.
    reduce: how micro-batches combine: ``"mean"``, ``"sum"``, ``"max"`` or ``"min"``.
    needs: model outputs the forward pass must produce for it (``"attention_logits"``); a model
      family that cannot is refused at start, naming the defence that asked.
  """

  name: str
  description: str
  compute: Callable[[ForwardPass], Any]
  reduce: str = "mean"
  needs: frozenset[str] = frozenset()

  def identity(self, like: Any) -> Any:
    """The value combining starts from, for values shaped ``like`` (``jax.ShapeDtypeStruct``)."""
    fill = {"mean": 0.0, "sum": 0.0, "max": -jnp.inf, "min": jnp.inf}[self.reduce]
    return jax.tree.map(lambda s: jnp.full(s.shape, fill, jnp.float32), like)

  def combine(self, total: Any, value: Any) -> Any:
    op = {"mean": jnp.add, "sum": jnp.add, "max": jnp.maximum, "min": jnp.minimum}[self.reduce]
    return jax.tree.map(lambda a, b: op(a, b.astype(jnp.float32)), total, value)

  def finish(self, total: Any, micro_batches: int) -> Any:
    return jax.tree.map(lambda a: a / micro_batches, total) if self.reduce == "mean" else total


_REDUCTIONS = ("mean", "sum", "max", "min")
# Registered at this module's import (the built-in ones below), so it does not load the
# built-in modules itself: register_module and step_argument do.
_STEP_ARGUMENTS: Registry[StepArgument] = Registry(
    "step argument", "the keyword the train step passes to update", load_builtins=None)


def register_step_argument(argument: StepArgument, origin: Optional[str] = None) -> StepArgument:
  """Registers an extra step argument; returns it. The same declaration registered again changes
  nothing; another one under a registered name is refused.

  Raises:
    DeclarationError: (a ``ValueError``) the name is declared already by another module or is
      not an identifier, or ``reduce`` is not known.
  """
  if not argument.name.isidentifier():
    raise DeclarationError(f"step argument name {argument.name!r} must be an identifier (a "
                           "keyword of update)")
  if argument.reduce not in _REDUCTIONS:
    raise DeclarationError(f"step argument {argument.name!r}: reduce={argument.reduce!r} is not "
                           f"one of {', '.join(_REDUCTIONS)}")
  _STEP_ARGUMENTS.add(argument.name, argument,
                      origin or getattr(argument.compute, "__module__", None) or "?")
  return argument


def step_argument(name: str) -> StepArgument:
  """The registered step argument ``name``.

  Raises:
    ValueError: none is registered under that name (the message lists the registered ones).
  """
  _load_builtins()
  argument = _STEP_ARGUMENTS.get(name)
  if argument is None:
    raise ValueError(f"no step argument {name!r} is registered (the train step computes "
                     f"{', '.join(_STEP_ARGUMENTS.names())}): register a StepArgument for it")
  return argument


LOSS = register_step_argument(StepArgument(
    "loss", "the step's mean loss over its micro-batches", compute=lambda f: f["loss"],
    reduce="mean"))
MAX_LOGITS = register_step_argument(StepArgument(
    "max_logits", "each attention layer's per-head max pre-softmax logit of the step's forward "
    "pass ({layer name: [*stack, H]}, the max over micro-batches)",
    compute=lambda f: f["attention_logits"], reduce="max",
    needs=frozenset({"attention_logits"})))


# ----------------------------------------------------------------------------- the chain


def built(stability: Any, ctx: DefenceContext) -> list[tuple[Defence, Any]]:
  """The enabled defences of ``stability`` with their transforms (wrappers: their wrapping
  functions), in chain order, leaving out those whose builder had nothing to do (None)."""
  made = [(d, d.make(d.section(stability), ctx)) for d in enabled(stability)]
  return [(d, t) for d, t in made if t is not None]


def build_chain(stability: Any, optimizer: Transform, *, optimizer_name: str = "optimizer",
                update_scale: Optional[Transform] = None,
                ctx: Optional[DefenceContext] = None) -> optax.GradientTransformationExtraArgs:
  """The enabled defences of ``stability`` around ``optimizer``, in their positions::

      WRAPPER(... chain(GRADIENT..., optimizer, UPDATE..., update_scale, FINAL...))

  with its state keyed by name (:func:`stablejax.transforms.keyed.keyed_chain`): a dict with one
  entry per defence (``"zclip"``, ``"skip_spikes"``...), ``"optimizer"`` holding
  ``{optimizer_name: its state}`` and ``"lr_scale"`` the ``update_scale``'s state.

  Args:
    stability: a ``stability`` config holding a section per registered defence.
    optimizer: the optimizer (its learning rate included).
    optimizer_name: the optimizer's name in the state (``"muon"``, ``"adamw"``): another name at
      resume means another optimizer, whose state cannot be restored into this one.
    update_scale: a transform between the ``UPDATE`` and ``FINAL`` defences (the trainer's
      learning-rate scale that its recovery backs off), or None.
    ctx: what builders may read; default: ``DefenceContext(stability)``.

  Returns:
    The chain, with extra-argument support (``update(..., loss=..., max_logits=...)``).
  """
  ctx = ctx or DefenceContext(stability)
  made = built(stability, ctx)

  def at(position: Position) -> list[tuple[str, Any]]:
    return [(d.name, t) for d, t in made if d.position is position]

  before = [d.before_scale(d.section(stability), ctx) for d, _ in made
            if d.before_scale is not None]
  final = at(Position.FINAL)
  if before and update_scale is not None:
    update_scale = stateless_prefix(before, update_scale)
  elif before:  # nothing scales in between: first in the FINAL position (register() checks
    # that a defence with a before_scale half is there)
    final[0] = (final[0][0], stateless_prefix(before, final[0][1]))
  entries = [*at(Position.GRADIENT), (OPTIMIZER_KEY, nest(optimizer_name, optimizer)),
             *at(Position.UPDATE),
             *([(LR_SCALE_KEY, update_scale)] if update_scale is not None else []),
             *final]
  return keyed_chain(entries, at(Position.WRAPPER))


def stateless_prefix(prefix: Sequence[Transform], tx: Transform
                     ) -> optax.GradientTransformationExtraArgs:
  """``tx`` after the transforms of ``prefix``, which hold no state: the result's state is
  ``tx``'s alone, so adding or removing a prefix leaves the state's layout as it was.

  Raises:
    ValueError: (at ``init``) a transform of ``prefix`` has state.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> tx = stateless_prefix([optax.scale(2.0)], optax.trace(decay=0.5))
    >>> state = tx.init({"w": jnp.ones(2)})
    >>> type(state).__name__  # the trace's own state: the scale by 2 holds none
    'TraceState'
    >>> updates, state = tx.update({"w": jnp.ones(2)}, state)
    >>> updates["w"].tolist(), state.trace["w"].tolist()
    ([2.0, 2.0], [2.0, 2.0])
  """
  prefix = [optax.with_extra_args_support(t) for t in prefix]
  inner = optax.with_extra_args_support(tx)

  def init(params: optax.Params) -> optax.OptState:
    for t in prefix:
      if jax.tree.leaves(t.init(params)):
        raise ValueError("stateless_prefix: a transform before the learning-rate scale holds "
                         "state; give it an entry of its own (Position.UPDATE)")
    return inner.init(params)

  def update(updates: optax.Updates, state: optax.OptState,
             params: Optional[optax.Params] = None, **extra: Any
             ) -> tuple[optax.Updates, optax.OptState]:
    for t in prefix:
      updates, _ = t.update(updates, optax.EmptyState(), params, **extra)
    return inner.update(updates, state, params, **extra)

  return optax.GradientTransformationExtraArgs(init, update)
