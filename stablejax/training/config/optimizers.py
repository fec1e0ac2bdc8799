"""The optimizer as a declaration: the ``optimizer`` section's class owns its builder.

``optimizer.name`` picks a declared :class:`Optimizer`; its config class (a dataclass subclassing
:class:`OptimizerConfig`, so that every optimizer takes the shared keys and a switch between two
keeps them) is the ``optimizer`` section, and it builds the transform (``build``, as Levanter's
``OptimizerConfig.build``), says each parameter group's peak rate (``learning_rates``) and which
group each of the routing's labels trains in (``group``). The built-ins are ``muon``
(``stablejax.outlier_safe_muon``: Muon for the hidden matrices, AdamW for embeddings, head,
norms) and ``adamw``; a user's optimizer is a module of theirs holding an :class:`Optimizer` at
its top level, named with ``--plugin`` (``tests/plugins/optax_muon.py`` declares optax's own Muon
routed like stablejax's). Its state sits under ``{"optimizer": {name: state}}`` in the trainer's
state, so a run resumes with it, and another optimizer at a resume needs ``--reset-optimizer``.

Example:
  >>> from stablejax.training.config import optimizers
  >>> sorted(o.name for o in optimizers.registered())
  ['adamw', 'muon']
  >>> section = optimizers.section_class("adamw")()
  >>> section.name, section.learning_rates(), section.group("embedding")
  ('adamw', {'adamw': 0.01}, 'adamw')
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Callable, Optional

import optax

from stablejax.muon.lr_check import check_learning_rates
from stablejax.transforms._registry import DeclarationError, Registry, section_fields


@dataclasses.dataclass(frozen=True)
class OptimizerContext:
  """What an optimizer's ``build`` gets from the trainer.

  Attributes:
    schedules: each of its groups' learning-rate schedule (warmup and decay laid over the run,
      ``train.*``), by the names its ``learning_rates`` gave.
    labels: ``params -> tree of labels``: the routing's group of each parameter (``"muon"``,
      ``"adam"``, ``"embedding"``, ``"head"``: ``stablejax.label_params``).
    matrices: ``params -> tree of MuonDimensionNumbers`` (``stablejax.muon_dimension_numbers``):
      the hidden matrices and their axes, as optax's Muon takes them.
    decay_mask: ``params -> tree of bools``: where weight decay may act (never norms, biases).
    num_heads: the model's query heads (``optimizer.per_head``), or None.
  """

  schedules: dict[str, optax.Schedule]
  labels: Callable[[optax.Params], Any]
  matrices: Callable[[optax.Params], Any]
  decay_mask: Callable[[optax.Params], Any]
  num_heads: Optional[int] = None


@dataclasses.dataclass
class OptimizerConfig:
  """The keys every optimizer takes; the defaults are a stable Muon setup: Muon at 0.01
  (Moonlight scale), AdamW groups at 3e-3.

  With name="adamw", learning_rate is the AdamW rate of every parameter (set it to about 3e-4 to
  3e-3: the learning-rate check warns above that) and weight_decay decays the matrices.
  """
  name: str = "muon"              # a declared optimizer: "muon", "adamw", or a plugin's
  learning_rate: float = 0.01     # Muon matrices (muon) or every parameter (adamw)
  # norms, biases, scalars (muon only; null: learning_rate)
  adam_learning_rate: Optional[float] = 3e-3
  # token embedding (muon only; null: adam_learning_rate)
  embedding_learning_rate: Optional[float] = None
  # output head (muon only; null: adam_learning_rate)
  head_learning_rate: Optional[float] = None
  # Muon matrices (muon) or every matrix (adamw); never norms, biases
  weight_decay: float = 0.0
  adam_weight_decay: float = 0.0  # AdamW groups' matrices (muon only); never norms, biases
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  momentum: float = 0.95
  ns_steps: int = 5
  ns_coeffs: str = "standard"
  ns_backend: str = "auto"
  consistent_rms: Optional[float] = 0.2
  outlier_threshold: float = 5.0
  outlier_method: Optional[str] = "zscore"
  ns_method: str = "standard"             # "standard" or "gram" (Gram Newton-Schulz)
  ns_preconditioning: str = "frobenius"   # "frobenius" or "aol" (Turbo-Muon)
  per_head: bool = False                  # attention projections orthogonalised per head
  normuon: bool = False                   # NorMuon's per-neuron normalisation after Muon
  normuon_b2: float = 0.95

  def learning_rates(self) -> dict[str, float]:
    """Each parameter group's peak learning rate, resolved; the first is the run's ``lr``."""
    raise NotImplementedError(f"optimizer {self.name!r} does not say its learning rates")

  def group(self, label: str) -> str:
    """The group (a key of :meth:`learning_rates`) of the parameters the routing labels
    ``label`` (``"muon"``, ``"adam"``, ``"embedding"``, ``"head"``)."""
    rates = self.learning_rates()
    return label if label in rates else next(iter(rates))

  def build(self, ctx: OptimizerContext) -> optax.GradientTransformation:
    """The optimizer's transform."""
    raise NotImplementedError(f"optimizer {self.name!r} has no build(ctx)")

  def warnings(self) -> list[str]:
    """Lines about rates that look set for another optimizer (printed at start)."""
    return []

  def validate(self) -> None:
    """The optimizer's own rules, after every key's range is checked.

    Raises:
      ValueError: one line naming the key and the fix.
    """


@dataclasses.dataclass
class MuonConfig(OptimizerConfig):
  """``optimizer.name="muon"``: ``stablejax.outlier_safe_muon``."""

  def learning_rates(self) -> dict[str, float]:
    # adam_learning_rate=None falls back to learning_rate (as outlier_safe_muon does with
    # consistent_rms set); the embedding and head rates to the AdamW groups' rate.
    adam = self.learning_rate if self.adam_learning_rate is None else self.adam_learning_rate
    return {"muon": self.learning_rate, "adam": adam,
            "embedding": adam if self.embedding_learning_rate is None
            else self.embedding_learning_rate,
            "head": adam if self.head_learning_rate is None else self.head_learning_rate}

  def build(self, ctx: OptimizerContext) -> optax.GradientTransformation:
    from stablejax.muon.muon import outlier_safe_muon
    rates = ctx.schedules
    return outlier_safe_muon(
        learning_rate=rates["muon"], momentum=self.momentum, ns_steps=self.ns_steps,
        ns_coeffs=self.ns_coeffs, weight_decay=self.weight_decay,
        consistent_rms=self.consistent_rms, adam_learning_rate=rates["adam"],
        embedding_learning_rate=rates["embedding"], head_learning_rate=rates["head"],
        adam_b1=self.b1, adam_b2=self.b2, adam_eps=self.eps,
        adam_weight_decay=self.adam_weight_decay, outlier_threshold=self.outlier_threshold,
        outlier_method=self.outlier_method, ns_backend=self.ns_backend, ns_method=self.ns_method,
        ns_preconditioning=self.ns_preconditioning, per_head=self.per_head,
        num_heads=ctx.num_heads, normuon=self.normuon, normuon_b2=self.normuon_b2)

  def validate(self) -> None:
    if self.adam_learning_rate is None and self.consistent_rms is None:
      raise ValueError("optimizer.adam_learning_rate=null needs optimizer.consistent_rms: Muon's "
                       "width scaling runs at ~0.02, far too high for AdamW; set "
                       "adam_learning_rate (e.g. 3e-3)")

  def warnings(self) -> list[str]:
    rates = self.learning_rates()
    return check_learning_rates(muon_lr=rates["muon"], adam_lr=rates["adam"],
                                embedding_lr=rates["embedding"], head_lr=rates["head"],
                                consistent_rms=self.consistent_rms)


@dataclasses.dataclass
class AdamWConfig(OptimizerConfig):
  """``optimizer.name="adamw"``: ``optax.adamw`` on every parameter, weight decay on all but
  norm gains, biases and scalars."""

  name: str = "adamw"

  def learning_rates(self) -> dict[str, float]:
    return {"adamw": self.learning_rate}

  def build(self, ctx: OptimizerContext) -> optax.GradientTransformation:
    return optax.adamw(ctx.schedules["adamw"], b1=self.b1, b2=self.b2, eps=self.eps,
                       weight_decay=self.weight_decay, mask=ctx.decay_mask)

  def warnings(self) -> list[str]:
    return check_learning_rates(adam_lr=self.learning_rate)


@dataclasses.dataclass(frozen=True)
class Optimizer:
  """An optimizer the trainer can build, declared at a module's top level.

  Attributes:
    name: the value of ``optimizer.name``, and the key of its state (``{"optimizer": {name:
      ...}}``).
    config: its section: a dataclass subclassing :class:`OptimizerConfig`, with a default for
      every field (its own keys beside the shared ones), ``learning_rates`` and ``build``.
    label: one line for tables and banners.
  """

  name: str
  config: type
  label: str = ""


MUON = Optimizer("muon", MuonConfig,
                 "outlier-safe Muon for the hidden matrices, AdamW for the rest")
ADAMW = Optimizer("adamw", AdamWConfig, "AdamW for every parameter")


def register(declaration: Optimizer, origin: Optional[str] = None) -> Optimizer:
  """Registers an optimizer; returns it.

  Raises:
    DeclarationError: its name is declared by another module or is not an identifier, or its
      config is not a dataclass subclassing OptimizerConfig with a default for every field.
  """
  owner = f"optimizer {declaration.name!r}"
  if not declaration.name.isidentifier():
    raise DeclarationError(f"{owner}: the name must be an identifier (it is the key of its state)")
  section_fields(declaration.config, owner)
  if not issubclass(declaration.config, OptimizerConfig):
    raise DeclarationError(f"the config of {owner} must subclass "
                           "stablejax.training.config.optimizers.OptimizerConfig (the keys every "
                           "optimizer takes), with learning_rates() and build(ctx)")
  if declaration.config().name != declaration.name:
    raise DeclarationError(f"the config of {owner} must default name to {declaration.name!r}")
  _REGISTRY.add(declaration.name, declaration,
                origin or str(getattr(declaration.config, "__module__", "?")))
  return declaration


def register_module(module: types.ModuleType, origin: Optional[str] = None) -> list[Optimizer]:
  """Registers every :class:`Optimizer` at ``module``'s top level."""
  found = [value for value in vars(module).values() if isinstance(value, Optimizer)]
  return [register(d, origin or module.__name__) for d in found]


# The built-ins are declared above, in this module: registered when it is imported, before any
# plugin can be.
_REGISTRY: Registry[Optimizer] = Registry("optimizer", "the value of optimizer.name", None)
for _builtin in (MUON, ADAMW):
  _REGISTRY.add(_builtin.name, _builtin, __name__)


def registered() -> tuple[Optimizer, ...]:
  """Every registered optimizer, by name."""
  return _REGISTRY.by_name()


# The optimizer of a name (or None), and forgetting one (a no-op for an unknown name).
get = _REGISTRY.get
unregister = _REGISTRY.remove


def section_class(name: str) -> type:
  """The ``optimizer`` section's class for ``optimizer.name=name``.

  Raises:
    DeclarationError: no optimizer of that name is registered.
  """
  declaration = get(name)
  if declaration is None:
    known = ", ".join(o.name for o in registered())
    raise DeclarationError(f"optimizer.name={name!r} is not a declared optimizer: use one of "
                           f"{known}, or name the module that declares it with --plugin")
  return declaration.config
