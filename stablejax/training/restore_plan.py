"""What a resume restores of a checkpoint when the run's stability stack changed since it was
written, matched by name.

The optimizer state is keyed by name (:mod:`stablejax.transforms.keyed`). A restore compares the
checkpoint's entries (from Orbax's metadata, before reading any array) with this run's:

* an entry in both with the same names, shapes and dtypes is restored;
* a defence switched on since starts from its initial state; one switched off is dropped;
* an entry whose layout changed (``stability.skip_spikes.window``: another window length) starts
  from its initial state too, and the line says so;
* another optimizer (``muon`` <-> ``adamw``), or the same one with another state layout, is
  refused unless ``--reset-optimizer``: then the optimizer's state starts afresh, continuing the
  learning-rate schedule where the run is (its step counters set to the updates applied so far),
  while the parameters, the step, the data position, the monitor and the other defences' states
  are kept.

Hyperparameters that live in the transforms' closures (a learning rate, ``tau``, ``b2``) need
nothing: the rebuilt chain applies them. A checkpoint written before states were keyed (a
positional ``optax.chain``) is read in the layout of the run's recorded config and then matched
the same way (:class:`LegacyLayout`). What the restore did is one line at start
(:meth:`RestorePlan.describe`).
"""

from __future__ import annotations

import optax
import dataclasses
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from stablejax.transforms import defence
from stablejax.transforms.keyed import from_positional, is_keyed


class StateMismatch(ValueError):
  """The checkpoint's state does not fit this run's; the message says what differs and the fix."""


def path_names(path: tuple) -> tuple[str, ...]:
  """A pytree path as names, whether its nodes are dicts, attributes or sequences (a saved
  state's metadata holds dict keys where the state has NamedTuple fields)."""
  return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def leaf_layout(tree: optax.Params) -> dict[tuple[str, ...], tuple]:
  """``{path: (shape, dtype)}`` of the array leaves of a state, an abstract state or Orbax's
  metadata of one."""
  out = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    if hasattr(leaf, "shape"):
      out[path_names(path)] = (tuple(leaf.shape), str(jnp.dtype(leaf.dtype)))
  return out


def describe_difference(saved: Any, current: Any, prefix: str = "") -> str:
  """The first difference of two layouts, in words: an array only one has, or its shapes."""
  a, b = leaf_layout(saved), leaf_layout(current)
  for path in sorted(set(a) | set(b)):
    name = "/".join((prefix,) + path if prefix else path)
    if path not in b:
      return f"{name} {a[path][0]} is in the checkpoint only"
    if path not in a:
      return f"{name} {b[path][0]} is in this run only"
    if a[path] != b[path]:
      return (f"{name} is {a[path][0]} {a[path][1]} in the checkpoint and {b[path][0]} "
              f"{b[path][1]} in this run")
  return "no array differs"


@dataclasses.dataclass(frozen=True)
class LegacyLayout:
  """A positional optimizer state as the run's recorded config built it before states were
  keyed: the abstract positional state (with shardings), the chain's entry names in order (the
  optimizer's as ``"optimizer"``), the wrappers' innermost first, and the optimizer's name."""

  positional: Any
  chain: tuple[str, ...]
  wrappers: tuple[str, ...]
  optimizer_name: str

  def to_keyed(self, positional: Any) -> dict:
    return from_positional(positional, self.chain, self.wrappers, self.optimizer_name)


def _only_key(entry: Any) -> Optional[str]:
  return next(iter(entry)) if isinstance(entry, dict) and len(entry) == 1 else None


@dataclasses.dataclass
class RestorePlan:
  """What a restore reads and how the state is completed (:func:`plan`)."""

  target: Any                                   # the abstract state to read (trimmed)
  saved_keys: tuple[str, ...] = ()              # optimizer-state entries read
  fresh: list[str] = dataclasses.field(default_factory=list)     # switched on: initial state
  dropped: list[str] = dataclasses.field(default_factory=list)   # switched off: not read
  changed: list[str] = dataclasses.field(default_factory=list)   # another layout: initial state
  optimizer_reset: Optional[str] = None        # "muon -> adamw" (--reset-optimizer)
  legacy: Optional[LegacyLayout] = None        # read positionally, then keyed
  fresh_fields: list[str] = dataclasses.field(default_factory=list)  # e.g. loss_scale

  @property
  def complete(self) -> bool:
    """Whether the checkpoint holds the whole state (nothing to initialise)."""
    return not (self.fresh or self.changed or self.optimizer_reset or self.fresh_fields)

  def describe(self) -> Optional[str]:
    """One line of what changed, or None: ``resumed with qk_clip on: new state; zclip off: its
    state dropped``."""
    parts = [f"{name} on: new state" for name in self.fresh]
    parts += [f"{name} off: its state dropped" for name in self.dropped]
    parts += [f"{name}: its state's layout changed (its settings), started afresh"
              for name in self.changed]
    parts += [f"{name}: not in the checkpoint, started afresh" for name in self.fresh_fields]
    if self.optimizer_reset:
      parts.append(f"optimizer {self.optimizer_reset}: its state started afresh "
                   "(--reset-optimizer), continuing the learning-rate schedule")
    return "resumed with " + "; ".join(parts) if parts else None

  def finish(self, restored: Any, fresh: Callable[[Any], Any], init: Callable[[], Any]) -> Any:
    """The full state from what was read (``restored``, shaped like :attr:`target`).

    Args:
      restored: the restored state.
      fresh: ``params -> optimizer state``: this run's initial optimizer state for the restored
        parameters.
      init: ``() -> state``: this run's initial state (for whole fields not in the checkpoint).
    """
    if self.complete and self.legacy is None:
      return restored
    opt_state = restored.opt_state
    if self.legacy is not None:  # read whole, then keyed: the entries switched off go
      keyed = self.legacy.to_keyed(opt_state)
      opt_state = {key: keyed[key] for key in self.saved_keys}
    if self.complete:
      return restored.replace(opt_state=opt_state)
    initial = fresh(restored.params)
    merged = {key: opt_state[key] if key in self.saved_keys else initial[key] for key in initial}
    if self.optimizer_reset is not None and defence.LR_SCALE_KEY in merged:
      applied = merged[defence.LR_SCALE_KEY].count
      merged[defence.OPTIMIZER_KEY] = continue_counts(merged[defence.OPTIMIZER_KEY], applied)
    state = restored.replace(opt_state=merged)
    if self.fresh_fields:
      start = init()
      state = state.replace(**{name: getattr(start, name) for name in self.fresh_fields})
    return state


def continue_counts(opt_state: optax.OptState, applied: jax.Array) -> Any:
  """``opt_state`` with every scalar int ``count`` leaf (optax's schedule, Adam's and Muon's
  step counters) set to ``applied``: a fresh optimizer continues the learning-rate schedule
  where the run is. Its moments start at zero without bias correction then, so its first
  ``~1 / (1 - b2)`` updates come out smaller: a short warmup of its own."""
  def visit(path: tuple, leaf: Any) -> Any:
    if (path and path_names(path)[-1] == "count" and hasattr(leaf, "dtype")
        and jnp.issubdtype(leaf.dtype, jnp.integer) and jnp.shape(leaf) == ()):
      return jnp.array(applied, leaf.dtype, copy=True)  # its own buffer: states are donated
    return leaf
  return jax.tree_util.tree_map_with_path(visit, opt_state)


def plan(stored: Any, abstract: Any, *, reset_optimizer: bool = False,
         legacy: Optional[Callable[[], Optional[LegacyLayout]]] = None) -> RestorePlan:
  """Matches a checkpoint's state (``stored``: Orbax's metadata tree) with this run's abstract
  state, by name.

  Args:
    stored: the checkpoint's state metadata (nested dicts of array metadata).
    abstract: this run's abstract train state (``ShapeDtypeStruct`` leaves with shardings).
    reset_optimizer: start the optimizer's state afresh (``--reset-optimizer``).
    legacy: ``() -> LegacyLayout`` of the run's recorded config, for a checkpoint written before
      states were keyed (None, or returning None: such a checkpoint is refused).

  Returns:
    The :class:`RestorePlan`.

  Raises:
    StateMismatch: the parameters differ (another model), another optimizer without
      ``reset_optimizer``, or a state that cannot be matched; the message names the difference.
  """
  if not isinstance(stored, dict) or "params" not in stored:  # any other state: as it is
    if leaf_layout(stored) != leaf_layout(abstract):
      raise StateMismatch(describe_difference(stored, abstract))
    return RestorePlan(target=abstract)
  if leaf_layout(stored["params"]) != leaf_layout(abstract.params):
    raise StateMismatch(f"its parameters do not fit this run's model: "
                        f"{describe_difference(stored['params'], abstract.params, 'params')}")
  result = RestorePlan(target=abstract)
  fields: dict[str, Any] = {}
  for f in dataclasses.fields(abstract):
    if f.name in ("params", "opt_state") or f.name not in stored:
      continue
    if leaf_layout(stored[f.name]) != leaf_layout(getattr(abstract, f.name)):
      if f.name == "step":
        raise StateMismatch("its step counter is "
                            f"{describe_difference(stored['step'], abstract.step)}")
      result.fresh_fields.append(f.name)
      fields[f.name] = None
  saved_opt: Any = stored.get("opt_state")
  current_opt = abstract.opt_state
  if not is_keyed(current_opt):  # a chain given by the caller: restored as it is, or not at all
    if leaf_layout(saved_opt) != leaf_layout(current_opt):
      raise StateMismatch("its optimizer state does not fit this run's chain: "
                          f"{describe_difference(saved_opt, current_opt, 'opt_state')}")
    result.target = abstract.replace(**fields)
    return result
  if is_keyed(saved_opt):
    layouts = {key: leaf_layout(value) for key, value in saved_opt.items()}
  else:
    layout = legacy() if legacy is not None else None
    if layout is None or leaf_layout(layout.positional) != leaf_layout(saved_opt):
      raise StateMismatch(
          "its optimizer state is in the positional layout of an earlier stablejax, which the "
          "run's config.json does not reproduce (" + describe_difference(
              saved_opt, layout.positional if layout else {}, "opt_state")
          + "): resume with the config the run was started with")
    result.legacy = layout
    fields["opt_state"] = layout.positional
    keyed = layout.to_keyed(layout.positional)
    layouts = {key: leaf_layout(value) for key, value in keyed.items()}
  saved_name, current_name = (_only_key(saved_opt_entry) for saved_opt_entry in (
      _keyed_optimizer(saved_opt, result.legacy), current_opt[defence.OPTIMIZER_KEY]))
  same_optimizer = (saved_name == current_name and layouts.get(defence.OPTIMIZER_KEY)
                    == leaf_layout(current_opt[defence.OPTIMIZER_KEY]))
  if not same_optimizer or reset_optimizer:
    if not reset_optimizer:
      what = (f"{saved_name}'s and this run's optimizer is {current_name}"
              if saved_name != current_name else
              f"{saved_name}'s with another layout (" + describe_difference(
                  _keyed_optimizer(saved_opt, result.legacy), current_opt[defence.OPTIMIZER_KEY],
                  "opt_state/optimizer") + ")")
      raise StateMismatch(f"its optimizer state is {what}: pass --reset-optimizer to start the "
                          "optimizer's state afresh (the parameters, step, data position and "
                          "monitor are kept), or resume with the run's optimizer settings")
    result.optimizer_reset = (f"{saved_name} -> {current_name}" if saved_name != current_name
                              else f"{current_name} (reset)")
  keep = []
  for key in current_opt:
    if key == defence.OPTIMIZER_KEY:
      if result.optimizer_reset is None:
        keep.append(key)
    elif key not in layouts:
      result.fresh.append(key)
    elif layouts[key] != leaf_layout(current_opt[key]):
      result.changed.append(key)
    else:
      keep.append(key)
  result.dropped = sorted(k for k in layouts if k not in current_opt)
  result.saved_keys = tuple(keep)
  if result.legacy is None:
    fields["opt_state"] = {key: current_opt[key] for key in keep}
  result.target = abstract.replace(**fields)
  return result


def _keyed_optimizer(saved_opt: Any, layout: Optional[LegacyLayout]) -> Any:
  """The checkpoint's ``{name: optimizer state}`` entry, keyed or (legacy) by position."""
  if layout is None:
    return saved_opt[defence.OPTIMIZER_KEY]
  return layout.to_keyed(layout.positional)[defence.OPTIMIZER_KEY]
