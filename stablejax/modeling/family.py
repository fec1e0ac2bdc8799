"""The model-family declaration: what the trainer needs of a model, declared once per family.

A model family is a module holding a :class:`ModelFamily` at its top level: its name (the value of
``model.family``), its config section (a dataclass: the ``model`` section's other keys) and a
builder that returns a :class:`LanguageModel`, the model behind the calls the trainer makes. The
built-in families are ``gpt`` (:mod:`stablejax.modeling.gpt`) and ``llama``
(:mod:`stablejax.modeling.llama`); a user's family is a module of theirs named with the trainer's
``--plugin`` (docs/own_model.md shows one around a public Flax NNX model).

What a :class:`LanguageModel` offers beyond its forward pass is optional. Each capability is a
method a family overrides; the trainer asks :meth:`LanguageModel.supports` before it relies on
one, and a capability a family lacks is a one-line error (:class:`MissingCapability`) where it is
asked for: QK-clip needs ``attention logits``. Without ``decoding`` (a KV cache), ``python -m
stablejax sample`` and the samples at evals re-run the model on the growing context.
Where the trainer only reports something (the attention-logit telemetry, MFU), a missing
capability turns the report off with a warning line at start.

Registration is explicit: :func:`registered` loads the built-in declarations from the modules of
:mod:`stablejax.modeling` the first time it is asked; :func:`register_module` registers the
declarations of a user's module (``--plugin``). After nanodo's ``get_model_and_loss`` (one model
seam) and torchtune's per-family builders.

Example:
  >>> from stablejax.modeling import family
  >>> sorted(f.name for f in family.registered())
  ['gpt', 'llama']
  >>> gpt = family.get("gpt")
  >>> section = gpt.config(d_model=32, n_layers=1, n_heads=2, max_seq_len=16)
  >>> model = gpt.build(section, None)
  >>> model.supports("decoding"), model.attention_heads()
  (True, AttentionHeads(num_heads=2, num_kv_heads=2, qk_norm=True))
"""

from __future__ import annotations

import optax
import dataclasses
import re
import types
from typing import Any, Callable, NamedTuple, Optional, cast

import jax
import jax.numpy as jnp
import numpy as np

from stablejax.modeling.attention import collect_attention_logits
from stablejax.transforms._registry import Builtins, DeclarationError, Registry, section_fields

DEFAULT_FAMILY = "gpt"


# The state a model carries between decoding calls (keys and values so far, the position): a pytree
# of arrays, whose structure is the model's own.
DecodingCache = optax.Params


def linen_variables(params: optax.Params, **collections: optax.Params) -> dict[str, Any]:
  """The variables a Flax Linen module's ``apply`` takes: ``params`` and other collections
  (``cache=...``)."""
  return {"params": params, **collections}


class MissingCapability(ValueError):
  """A model family lacks what was asked of it; the message names the family, the capability,
  what needed it and the fix."""


class AttentionHeads(NamedTuple):
  """The attention layout QK-clip needs: query heads, key/value heads (GQA: fewer), and whether
  queries and keys are normalised (QK-norm removes the scale QK-clip would cut)."""

  num_heads: int
  num_kv_heads: int
  qk_norm: bool = False


# The capabilities a family may offer: the method that provides each, and what it is for.
CAPABILITIES = {
    "attention logits": ("logits_and_attention",
                         "each attention layer's per-head max pre-softmax logit (QK-clip, the "
                         "attention telemetry)"),
    "attention layout": ("attention_heads", "the number of query and key/value heads (QK-clip)"),
    "decoding": ("decode_start", "decoding with a KV cache (python -m stablejax sample and the "
                                 "samples at evals re-run the model on the growing context "
                                 "without it)"),
    "residual stream": ("residual_stream", "the residual stream after each layer (activation "
                                           "statistics)"),
    "FLOPs": ("flops_per_token", "training FLOPs per token (MFU)"),
}


class LanguageModel:
  """A causal language model as the trainer uses it: parameters in, float32 logits out.

  Subclass it (or use :class:`LinenLanguageModel` / :class:`NNXLanguageModel`) and override
  :meth:`init` and :meth:`logits`; the other methods are capabilities (:data:`CAPABILITIES`),
  offered by overriding them. ``step`` is the training step (an int32, may be traced), for
  models whose forward pass follows a schedule (BitNet's quantisation strength).

  Attributes:
    family: the family's name.
    config: the family's config section.
  """

  def __init__(self, family: str, config: Any):
    self.family = family
    self.config = config

  # --------------------------------------------------------------------------- the protocol

  @property
  def vocab_size(self) -> int:
    """Rows of the output (``config.vocab_size``)."""
    return int(self.config.vocab_size)

  @property
  def max_seq_len(self) -> int:
    """The longest sequence the model takes (``config.max_seq_len``)."""
    return int(self.config.max_seq_len)

  @property
  def compute_dtype(self) -> str:
    """The activations' dtype (``config.compute_dtype``, default ``"float32"``): ``"float16"``
    turns on the trainer's dynamic loss scaling."""
    return str(getattr(self.config, "compute_dtype", "float32"))

  @property
  def param_dtype(self) -> str:
    """The parameters' dtype (``config.param_dtype``, default ``"float32"``): a low-precision
    one turns on the compensated update."""
    return str(getattr(self.config, "param_dtype", "float32"))

  @property
  def stacked_layers(self) -> bool:
    """Whether the blocks' parameters are stacked along a leading layer axis (``nn.scan``)."""
    return bool(getattr(self.config, "scan_layers", False))

  def init(self, rng: jax.Array, tokens: jax.Array) -> optax.Params:
    """The parameters (a pytree of arrays) for token batches shaped like ``tokens``."""
    raise NotImplementedError(f"model family {self.family!r}: its LanguageModel must define init")

  def logits(self, params: optax.Params, tokens: jax.Array, step: jax.typing.ArrayLike
             ) -> jax.Array:
    """Float32 logits ``[B, T, V]`` of int32 ``tokens`` ``[B, T]``."""
    raise NotImplementedError(f"model family {self.family!r}: its LanguageModel must define "
                              "logits")

  def describe(self) -> str:
    """One line for the trainer's banner (layers, widths)."""
    return f"model family {self.family}"

  def step_metrics(self, step: jax.typing.ArrayLike) -> dict[str, jax.Array]:
    """Values the train step logs besides its own (BitNet's ``lambda``); traced."""
    return {}

  def ineffective_keys(self, run_config: Any) -> list[tuple[str, str]]:
    """``(key, reason)`` of config keys set but without effect for this model (the trainer warns
    about those set away from their default)."""
    return []

  def for_deployment(self, params: optax.Params) -> tuple[Any, "LanguageModel"]:
    """The parameters and model as they would be deployed (EmbProj merged, ...): the same by
    default. ``quantize-eval`` quantises these."""
    return params, self

  # --------------------------------------------------------------------------- capabilities

  def logits_and_attention(self, params: optax.Params, tokens: jax.Array, step: jax.typing.ArrayLike
                           ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``(logits, {layer name: [*stack, H]})``: each attention layer's per-head max pre-softmax
    logit of this forward pass (:func:`stablejax.collect_attention_logits`'s keys)."""
    raise self.missing("attention logits", "this call")

  def attention_heads(self) -> AttentionHeads:
    """Query heads, key/value heads and QK-norm (:class:`AttentionHeads`)."""
    raise self.missing("attention layout", "this call")

  def decode_start(self, params: optax.Params, prompt: jax.Array, step: jax.typing.ArrayLike
                   ) -> tuple[jax.Array, DecodingCache]:
    """Processes ``prompt`` ``[B, P]`` into a fresh cache: ``(logits [B, P, V], cache)``."""
    raise self.missing("decoding", "this call")

  def decode_next(self, params: optax.Params, cache: DecodingCache, token: jax.Array,
                  step: jax.typing.ArrayLike
                  ) -> tuple[jax.Array, DecodingCache]:
    """One more position ``token`` ``[B, 1]`` against ``cache``: ``(logits [B, 1, V], cache)``."""
    raise self.missing("decoding", "this call")

  def residual_stream(self, params: optax.Params, tokens: jax.Array, step: jax.typing.ArrayLike
                      ) -> tuple[jax.Array, jax.Array]:
    """``(logits, residual)``: the residual stream, float32 ``[L + 1, B, T, D]``, after the
    embedding and after each block."""
    raise self.missing("residual stream", "this call")

  def flops_per_token(self, seq_len: int) -> float:
    """Training FLOPs per token (forward and backward) at sequence length ``seq_len``."""
    raise self.missing("FLOPs", "this call")

  # --------------------------------------------------------------------------- derived

  def supports(self, capability: str) -> bool:
    """Whether the family offers ``capability`` (a key of :data:`CAPABILITIES`)."""
    method = CAPABILITIES[capability][0]
    return getattr(type(self), method) is not getattr(LanguageModel, method)

  def missing(self, capability: str, needed_by: str) -> MissingCapability:
    """The error for a capability this family lacks, asked for by ``needed_by``."""
    method, what = CAPABILITIES[capability]
    return MissingCapability(
        f"model family {self.family!r} does not offer {capability} ({what}), which {needed_by} "
        f"needs: define {method} in its LanguageModel, or turn that off")

  def require(self, capability: str, needed_by: str) -> None:
    """Raises :class:`MissingCapability` unless the family offers ``capability``."""
    if not self.supports(capability):
      raise self.missing(capability, needed_by)

  def layer_max_logits(self, collected: dict[str, jax.Array]) -> jax.Array:
    """``[n_layers, H]`` per-head max logits in layer order from
    :meth:`logits_and_attention`'s dict: each entry's leading (stacked) axes become layers, the
    entries ordered by name with numbers compared as numbers (``block_2`` before ``block_10``)."""
    def natural(name: str) -> list:
      return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]
    rows = [jnp.reshape(collected[name], (-1, collected[name].shape[-1]))
            for name in sorted(collected, key=natural)]
    return jnp.concatenate(rows, axis=0)

  def count_params(self, params: optax.Params) -> int:
    """Total number of parameter entries."""
    return int(sum(np.prod(np.shape(p)) for p in jax.tree_util.tree_leaves(params)))


# The capabilities a Linen module can offer through keyword arguments of its ``__call__``:
# ``attention_logits=True`` sows each attention layer's max logit (``MAX_LOGIT``) into
# ``"intermediates"``; ``decode=True`` reads and appends to a ``"cache"`` collection (the first
# call, without one, processes a prompt); ``return_activations=True`` returns ``(logits,
# {"residual": [L + 1, B, T, D]})``.
LINEN_CAPABILITIES = ("attention logits", "decoding", "residual stream")


class LinenLanguageModel(LanguageModel):
  """A :class:`LanguageModel` over a Flax Linen module ``module(tokens) -> logits``.

  A module that takes the keyword arguments of :data:`LINEN_CAPABILITIES` names those
  capabilities in ``offers``, and this class provides them (the built-in families do); a
  subclass adds the rest (``attention_heads``, ``flops_per_token``) and the extra keyword
  arguments of each call (:meth:`call_kwargs`).

  Args:
    family: the family's name.
    config: its config section.
    module: the Linen module.
    offers: the capabilities of :data:`LINEN_CAPABILITIES` the module implements.
  """

  def __init__(self, family: str, config: Any, module: Any, offers: tuple[str, ...] = ()):
    super().__init__(family, config)
    self.module = module
    unknown = set(offers) - set(LINEN_CAPABILITIES)
    if unknown:
      raise ValueError(f"LinenLanguageModel offers {sorted(unknown)}: a Linen module offers "
                       f"only {list(LINEN_CAPABILITIES)} through its keyword arguments")
    self.offers = tuple(offers)

  def call_kwargs(self, step: jax.typing.ArrayLike) -> dict[str, Any]:
    """Keyword arguments every call of the module takes at training step ``step`` (none)."""
    return {}

  def supports(self, capability: str) -> bool:
    method = CAPABILITIES[capability][0]
    if capability in LINEN_CAPABILITIES and \
        getattr(type(self), method) is getattr(LinenLanguageModel, method):
      return capability in self.offers
    return super().supports(capability)

  def _apply(self, capability: Optional[str], params: optax.Params, tokens: jax.Array,
             step: jax.typing.ArrayLike, **kwargs: Any) -> Any:
    """The module applied to ``tokens``; ``capability`` (None: the forward pass) must be
    offered."""
    if capability is not None and capability not in self.offers:
      raise self.missing(capability, "this call")
    return self.module.apply(linen_variables(params, **kwargs.pop("collections", {})), tokens,
                             **kwargs, **self.call_kwargs(step))

  def init(self, rng: jax.Array, tokens: jax.Array) -> optax.Params:
    return self.module.init(rng, tokens)["params"]

  def logits(self, params: optax.Params, tokens: jax.Array, step: jax.typing.ArrayLike
             ) -> jax.Array:
    return jnp.asarray(self._apply(None, params, tokens, step), jnp.float32)

  def logits_and_attention(self, params: optax.Params, tokens: jax.Array, step: jax.typing.ArrayLike
                           ) -> tuple[jax.Array, dict[str, jax.Array]]:
    logits, sown = self._apply("attention logits", params, tokens, step, attention_logits=True,
                               mutable=["intermediates"])
    return logits, collect_attention_logits(sown)

  def decode_start(self, params: optax.Params, prompt: jax.Array, step: jax.typing.ArrayLike
                   ) -> tuple[jax.Array, DecodingCache]:
    logits, variables = self._apply("decoding", params, prompt, step, decode=True,
                                    mutable=["cache"])
    return logits, variables["cache"]

  def decode_next(self, params: optax.Params, cache: DecodingCache, token: jax.Array,
                  step: jax.typing.ArrayLike
                  ) -> tuple[jax.Array, DecodingCache]:
    logits, variables = self._apply("decoding", params, token, step, decode=True,
                                    mutable=["cache"], collections={"cache": cache})
    return logits, variables["cache"]

  def residual_stream(self, params: optax.Params, tokens: jax.Array, step: jax.typing.ArrayLike
                      ) -> tuple[jax.Array, jax.Array]:
    logits, acts = self._apply("residual stream", params, tokens, step, return_activations=True)
    return logits, acts["residual"]


class NNXLanguageModel(LanguageModel):
  """A :class:`LanguageModel` over a Flax NNX module: ``make(rngs) -> module`` builds it, and
  ``module(tokens) -> logits``. The parameters are the module's ``nnx.Param`` state as a plain
  nested dict (``nnx.State.to_pure_dict``), so they checkpoint, shard and route like Linen's. The
  module runs as it does by default (dropout off unless its ``__call__`` turns it on); its RNG
  streams get fixed keys. Other non-parameter state (batch statistics, caches) is not trained: a
  module holding some is refused at its first call, naming it (override :meth:`bind`).

  Args:
    family: the family's name.
    config: its config section.
    make: ``rngs -> nnx.Module``.
  """

  def __init__(self, family: str, config: Any, make: Callable[[Any], Any]):
    super().__init__(family, config)
    self.make = make

  def init(self, rng: jax.Array, tokens: jax.Array) -> optax.Params:
    from flax import nnx
    module = self.make(nnx.Rngs(params=rng, dropout=rng, default=rng))
    params = nnx.split(module, nnx.Param, ...)[1]
    return nnx.to_pure_dict(params)

  def bind(self, params: optax.Params) -> Any:
    """The module with ``params`` (a pure dict from :meth:`init`) in it."""
    from flax import nnx
    abstract = nnx.eval_shape(lambda: self.make(nnx.Rngs(0)))
    split: tuple[Any, ...] = nnx.split(abstract, nnx.Param, nnx.RngState, ...)
    graphdef, state, rngs, rest = split
    nnx.replace_by_pure_dict(state, cast(dict[str, Any], params))  # init's pure dict
    other = jax.tree_util.tree_leaves_with_path(rest)
    if other:
      path, leaf = other[0]
      name = "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
      raise MissingCapability(
          f"model family {self.family!r}: its NNX module holds the non-parameter state {name} "
          f"{tuple(leaf.shape)}, which NNXLanguageModel does not carry from step to step: "
          "override bind, or keep only nnx.Param and RNG streams in the module")

    def fixed(leaf: Any) -> Any:  # RNG streams: a fixed key, a zero counter
      if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        return jax.random.split(jax.random.key(0), leaf.shape) if leaf.shape else \
            jax.random.key(0)
      return jnp.zeros(leaf.shape, leaf.dtype)
    return nnx.merge(graphdef, state, jax.tree.map(fixed, rngs))

  def logits(self, params: optax.Params, tokens: jax.Array, step: jax.typing.ArrayLike
             ) -> jax.Array:
    return jnp.asarray(self.bind(params)(tokens), jnp.float32)


@dataclasses.dataclass(frozen=True)
class ModelFamily:
  """One model family, declared once.

  Attributes:
    name: the value of ``model.family``.
    config: the ``model`` section's dataclass (without ``family``, which the trainer adds). Its
      defaults are the family's default model; it must have ``vocab_size`` and ``max_seq_len``
      and may have ``compute_dtype`` and ``param_dtype`` (``"float32"``, ``"bfloat16"``,
      ``"float16"``); an optional ``validate(self)`` raises ``ValueError`` naming the key
      (``model.<key>``) and the fix.
    build: ``(section, run_config) -> LanguageModel``; ``run_config`` is the whole trainer
      config, or None outside the trainer. The trainer builds its programs from the config with
      the settings only the host reads (when to log and save, faults, the recovery's policy:
      ``stablejax.training.loop.components.HOST_ONLY``) at their defaults.
    label: one line for the docs.
  """

  name: str
  config: type
  build: Callable[[Any, Any], LanguageModel]
  label: str = ""


def register(declaration: ModelFamily, origin: Optional[str] = None) -> ModelFamily:
  """Registers a model family; returns it. The same declaration registered again changes
  nothing; another one under a registered name is refused (``unregister`` the first to replace
  it).

  Args:
    declaration: the family.
    origin: the module that declares it, for the messages (default: its config's module).

  Raises:
    DeclarationError: (a ``ValueError``) the name is declared already by another module or is
      not an identifier, or the section is not a dataclass with a default for every field,
      lacks ``vocab_size`` or ``max_seq_len`` or has a field ``family``.
  """
  if not declaration.name.isidentifier():
    raise DeclarationError(f"model family name {declaration.name!r} must be an identifier (it "
                           "is the value of model.family)")
  fields = section_fields(declaration.config, f"model family {declaration.name!r}")
  missing = [name for name in ("vocab_size", "max_seq_len") if name not in fields]
  if missing or "family" in fields:
    raise DeclarationError(f"the config of model family {declaration.name!r} must have the "
                           "fields vocab_size and max_seq_len (the trainer checks its data and "
                           "sequences against them) and no field 'family' (the trainer adds it)")
  _REGISTRY.add(declaration.name, declaration,
                origin or str(getattr(declaration.config, "__module__", "?")))
  return declaration


def register_module(module: types.ModuleType, origin: Optional[str] = None
                    ) -> list[ModelFamily]:
  """Registers every :class:`ModelFamily` defined at the top level of ``module``; returns them.

  Args:
    module: the module.
    origin: how the messages name it (default: its name; a plugin: as it was given).

  Raises:
    DeclarationError: a declaration :func:`register` refuses.
  """
  origin = origin or module.__name__
  return [register(value, origin) for value in vars(module).values()
          if isinstance(value, ModelFamily)]


# The declarations of stablejax/modeling/'s modules, registered when first asked for.
_BUILTINS = Builtins(__name__.rsplit(".", 1)[0],
                     lambda module: register_module(module), skip=("family",))
_load_builtins = _BUILTINS.load
_REGISTRY: Registry[ModelFamily] = Registry("model family", "the value of model.family",
                                            _load_builtins)


def registered() -> tuple[ModelFamily, ...]:
  """Every registered family, by name."""
  return _REGISTRY.by_name()


def get(name: str) -> Optional[ModelFamily]:
  """The family registered under ``name``, or None."""
  return _REGISTRY.get(name)


def unregister(name: str) -> None:
  """Forgets a family (a no-op for an unknown name)."""
  _REGISTRY.remove(name)


_SECTION_CLASSES: dict[tuple, type] = {}


def section_class(declaration: ModelFamily) -> type:
  """The ``model`` section's dataclass for a family: its config with ``family`` first (reused
  while the declaration is the same)."""
  key = (declaration.name, declaration.config)
  cls = _SECTION_CLASSES.get(key)
  if cls is None:
    cls = dataclasses.make_dataclass(
        declaration.config.__name__,
        [("family", str, dataclasses.field(default=declaration.name))],
        bases=(declaration.config,))
    cls.__module__ = declaration.config.__module__
    cls.__doc__ = declaration.config.__doc__
    _SECTION_CLASSES[key] = cls
  return cls


def section_dict(section: Any) -> dict:
  """A ``model`` section as JSON: ``family`` first, then the family's fields."""
  values = dataclasses.asdict(section)
  return {"family": values.pop("family", DEFAULT_FAMILY), **values}


def build(section: Any, run_config: Any = None) -> LanguageModel:
  """The :class:`LanguageModel` of a ``model`` section (its ``family`` names the family).

  Raises:
    ValueError: the family is not registered.
  """
  name = getattr(section, "family", DEFAULT_FAMILY)
  declaration = get(name)
  if declaration is None:
    raise ValueError(f"model.family={name!r} is not a registered model family: use one of "
                     f"{', '.join(f.name for f in registered())}, or name the module that "
                     "declares it with --plugin")
  return declaration.build(section, run_config)
