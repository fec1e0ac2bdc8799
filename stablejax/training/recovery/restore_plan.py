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
  """What a restore reads and how the state is completed (:func:`plan`).

  The checkpoint is read by name: :attr:`target` mirrors the checkpoint's own tree (its metadata's
  dicts and lists) with the leaves this run reads, each placed as this run's leaf of the same
  path; :meth:`finish` builds this run's state from them, the rest from its initial state.
  """

  target: Any                                   # what Orbax reads: a trimmed copy of the saved tree
  abstract: Any = None                          # this run's abstract state (None: read as it is)
  read: frozenset = frozenset()                 # paths (tuples of names) read from the checkpoint
  saved_keys: tuple[str, ...] = ()              # optimizer-state entries read
  fresh: list[str] = dataclasses.field(default_factory=list)     # switched on: initial state
  dropped: list[str] = dataclasses.field(default_factory=list)   # switched off: not read
  changed: list[str] = dataclasses.field(default_factory=list)   # another layout: initial state
  optimizer_reset: Optional[str] = None        # "muon -> adamw" (--reset-optimizer)
  legacy: Optional[LegacyLayout] = None        # read positionally, then keyed
  fresh_fields: list[str] = dataclasses.field(default_factory=list)  # e.g. loss_scale
  new_params: list[str] = dataclasses.field(default_factory=list)    # model surgery: initialised
  whole_optimizer_reset: bool = False  # a chain of the run's own: no defence's state is read

  @property
  def complete(self) -> bool:
    """Whether the checkpoint holds the whole state (nothing to initialise)."""
    return not (self.fresh or self.changed or self.optimizer_reset or self.fresh_fields
                or self.new_params or self.partial)

  @property
  def partial(self) -> bool:
    """Whether some of this run's leaves are not read (they start from the initial state)."""
    if self.abstract is None:
      return False
    paths = set(leaf_layout(self.abstract))
    if self.legacy is not None:  # the optimizer state is read whole, then keyed
      paths = {p for p in paths if p[0] != "opt_state"}
    return not paths <= set(self.read)

  def describe(self) -> Optional[str]:
    """One line of what changed, or None: ``resumed with qk_clip on: new state; zclip off: its
    state dropped``."""
    parts = []
    if self.new_params:
      parts.append(f"{len(self.new_params)} new parameter tensors initialised ("
                   + ", ".join(self.new_params[:4]) + (", ..." if len(self.new_params) > 4 else "")
                   + "), every other tensor restored")
    parts += [f"{name} on: new state" for name in self.fresh]
    parts += [f"{name} off: its state dropped" for name in self.dropped]
    parts += [f"{name}: its state's layout changed (its settings), started afresh"
              for name in self.changed]
    parts += [f"{name}: not in the checkpoint, started afresh" for name in self.fresh_fields]
    if self.optimizer_reset:
      parts.append(f"optimizer {self.optimizer_reset}: its state started afresh "
                   "(--reset-optimizer), continuing the learning-rate schedule")
    if self.whole_optimizer_reset:  # every defence's state is the configured chain's, new
      parts = [p for p in parts if not p.endswith(" on: new state")]
    return "resumed with " + "; ".join(parts) if parts else None

  def finish(self, restored: Any, fresh: Callable[[Any], Any], init: Callable[[], Any]) -> Any:
    """This run's full state from what was read (``restored``, shaped like :attr:`target`).

    Args:
      restored: what Orbax read (the checkpoint's tree, trimmed to :attr:`read`).
      fresh: ``params -> optimizer state``: this run's initial optimizer state for the restored
        parameters.
      init: ``() -> state``: this run's initial state (for the leaves not in the checkpoint).
    """
    if self.abstract is None:
      return restored
    if self.legacy is not None:  # read whole, then keyed: the entries switched off go
      keyed = self.legacy.to_keyed(restored["opt_state"])
      restored = {**restored, "opt_state": {key: keyed[key] for key in self.saved_keys}}
      read = set(self.read) | {p for p in leaf_layout(self.abstract)
                               if p[0] == "opt_state" and len(p) > 1 and p[1] in self.saved_keys}
    else:
      read = set(self.read)
    missing = [p for p in leaf_layout(self.abstract) if p not in read]
    initial: list[Any] = []  # this run's initial state, computed once if a leaf needs it

    def from_init(name: str) -> Optional[Callable[[], Any]]:
      if not any(p[0] == name for p in missing):
        return None
      def field() -> Any:
        if not initial:
          initial.append(init())
        return getattr(initial[0], name)
      return field

    params = _assemble(self.abstract.params, restored["params"], ("params",), read,
                       from_init("params"))
    opt_missing = any(p[0] == "opt_state" for p in missing)
    initial_opt = fresh(params) if opt_missing else None
    opt_state = _assemble(self.abstract.opt_state, restored.get("opt_state"), ("opt_state",),
                          read, (lambda: initial_opt) if opt_missing else None)
    if self.optimizer_reset is not None and defence.LR_SCALE_KEY in opt_state:
      # the updates applied so far: the kept LR scale's count, else (nothing kept) the step
      applied = (opt_state[defence.LR_SCALE_KEY].count
                 if defence.LR_SCALE_KEY in self.saved_keys else restored["step"])
      opt_state = {key: continue_counts(value, applied)
                   if key == defence.OPTIMIZER_KEY or self.whole_optimizer_reset else value
                   for key, value in opt_state.items()}
    fields = {f.name: _assemble(getattr(self.abstract, f.name), restored.get(f.name), (f.name,),
                                read, from_init(f.name))
              for f in dataclasses.fields(self.abstract) if f.name not in ("params", "opt_state")}
    return self.abstract.replace(params=params, opt_state=opt_state, **fields)


def _lookup(tree: Any, names: tuple[str, ...]) -> Any:
  """The node of ``tree`` (a restored checkpoint's dicts, lists or NamedTuples) at ``names``."""
  for name in names:
    if isinstance(tree, dict):
      tree = tree[name]
    elif hasattr(tree, "_fields") and not name.isdigit():
      tree = getattr(tree, name)
    else:
      tree = tree[int(name)]
  return tree


def _assemble(abstract: Any, restored: Any, prefix: tuple[str, ...], read: set,
              initial: Optional[Callable[[], Any]]) -> Any:
  """``abstract``'s tree with each leaf from ``restored`` (by path) when its path was read, else
  from ``initial()`` (the same field of the initial state)."""
  start = initial() if initial is not None else None
  start_leaves = (dict(jax.tree_util.tree_leaves_with_path(start)) if start is not None else {})

  def leaf(path: tuple, spec: Any) -> Any:
    names = prefix + path_names(path)
    if names in read:
      return _lookup(restored, names[len(prefix):])
    return start_leaves[path]
  return jax.tree_util.tree_map_with_path(leaf, abstract)


def _trimmed(stored: Any, current: dict[tuple[str, ...], Any], read: set,
             prefix: tuple[str, ...] = ()) -> Any:
  """The saved tree (Orbax's metadata: dicts, lists, leaves) with only the leaves in ``read``,
  each replaced by this run's abstract leaf of the same path (its sharding); None where nothing
  is read."""
  if isinstance(stored, dict):
    out = {}
    for key, value in stored.items():
      sub = _trimmed(value, current, read, prefix + (str(key),))
      if sub is not None:
        out[key] = sub
    return out or None
  if isinstance(stored, (list, tuple)):
    items = [_trimmed(value, current, read, prefix + (str(i),)) for i, value in enumerate(stored)]
    return items if any(item is not None for item in items) else None
  if stored is None or not hasattr(stored, "shape"):
    return None
  return current[prefix] if prefix in read else None


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


def _subset(saved: dict, current: dict) -> bool:
  """Whether every saved leaf is one of this run's, with the same shape and dtype."""
  return all(path in current and current[path] == layout for path, layout in saved.items())


def plan(stored: Any, abstract: Any, *, reset_optimizer: bool = False, switched: bool = False,
         legacy: Optional[Callable[[], Optional[LegacyLayout]]] = None,
         explain: Callable[[], str] = lambda: "") -> RestorePlan:
  """Matches a checkpoint's state (``stored``: Orbax's metadata tree) with this run's abstract
  state, by name.

  Args:
    stored: the checkpoint's state metadata (nested dicts of array metadata).
    abstract: this run's abstract train state (``ShapeDtypeStruct`` leaves with shardings).
    reset_optimizer: a change of optimizer is allowed: its state starts afresh
      (``--reset-optimizer``). The same optimizer with the same layout is always restored: a
      reset applies only to a checkpoint whose optimizer state is not the configured one's.
    switched: the run already switched to this optimizer at an earlier start (its recorded
      config has these optimizer settings): a checkpoint of the other optimizer (from before
      the switch) is reset without ``reset_optimizer``.
    legacy: ``() -> LegacyLayout`` of the run's recorded config, for a checkpoint written before
      states were keyed (None, or returning None: such a checkpoint is refused).
    explain: ``() -> text`` naming the settings that changed the model's parameters (appended to
      the refusal of a checkpoint whose parameters this run cannot take).

  Returns:
    The :class:`RestorePlan`. Parameters this run has and the checkpoint lacks (a model change
    that adds tensors, such as ``model.qk_norm`` switched on) are initialised, with their
    optimizer state; every other tensor is read.

  Raises:
    StateMismatch: a parameter of the checkpoint that this run lacks or shapes otherwise
      (another model), another optimizer without ``reset_optimizer``, or a state that cannot be
      matched; the message names the difference.
  """
  if not isinstance(stored, dict) or "params" not in stored:  # any other state: as it is
    if leaf_layout(stored) != leaf_layout(abstract):
      raise StateMismatch(describe_difference(stored, abstract))
    return RestorePlan(target=abstract)
  saved_params, current_params = leaf_layout(stored["params"]), leaf_layout(abstract.params)
  if not _subset(saved_params, current_params):
    path = next(p for p in sorted(saved_params) if current_params.get(p) != saved_params[p])
    name, (shape, dtype) = "/".join(("params",) + path), saved_params[path]
    what = (f"{name} {shape} is in the checkpoint only" if path not in current_params else
            f"{name} is {shape} {dtype} in the checkpoint and {current_params[path][0]} "
            f"{current_params[path][1]} in this run")
    why = explain()
    raise StateMismatch(f"its parameters do not fit this run's model: {what}"
                        + (f" ({why})" if why else ""))
  result = RestorePlan(target=None, abstract=abstract)
  result.new_params = ["/".join(p) for p in sorted(set(current_params) - set(saved_params))]
  current = {("params",) + p: None for p in saved_params}  # read: every saved parameter
  for f in dataclasses.fields(abstract):
    if f.name in ("params", "opt_state"):
      continue
    saved = leaf_layout(stored.get(f.name, {}))
    now = leaf_layout(getattr(abstract, f.name))
    if saved == now or (saved and _subset(saved, now)):  # the same, or leaves added since
      current.update({(f.name,) + p: None for p in saved})
      continue
    if f.name == "step":
      raise StateMismatch("its step counter is "
                          f"{describe_difference(stored['step'], abstract.step)}")
    if now:
      result.fresh_fields.append(f.name)
  saved_opt: Any = stored.get("opt_state")
  current_opt = abstract.opt_state
  if not is_keyed(current_opt):  # a chain given by the caller: restored as it is, or not at all
    if leaf_layout(saved_opt) != leaf_layout(current_opt):
      raise StateMismatch("its optimizer state does not fit this run's chain: "
                          f"{describe_difference(saved_opt, current_opt, 'opt_state')}")
    current.update({("opt_state",) + p: None for p in leaf_layout(saved_opt)})
    return _finish_plan(result, stored, abstract, current)
  if is_keyed(saved_opt):
    layouts = {key: leaf_layout(value) for key, value in saved_opt.items()}
  else:
    layout = legacy() if legacy is not None else None
    if layout is None or leaf_layout(layout.positional) != leaf_layout(saved_opt):
      if reset_optimizer:  # nothing of it is read: the configured chain starts afresh
        result.optimizer_reset = "of the run's own chain -> this run's"
        result.whole_optimizer_reset = True
        return _finish_plan(result, stored, abstract, current)
      raise StateMismatch(
          "its optimizer state is not keyed by defence: a chain given through the Python API "
          "(Trainer(cfg, out, tx=...)), or the positional layout of an earlier stablejax, which "
          "the run's config.json does not reproduce (" + describe_difference(
              saved_opt, layout.positional if layout else {}, "opt_state")
          + "): resume it with that chain or with the config the run was started with, or pass "
          "--reset-optimizer to start the configured optimizer afresh (the parameters, step, "
          "data position and monitor are kept)")
    result.legacy = layout
    keyed = layout.to_keyed(layout.positional)
    layouts = {key: leaf_layout(value) for key, value in keyed.items()}
  saved_name, current_name = (_only_key(saved_opt_entry) for saved_opt_entry in (
      _keyed_optimizer(saved_opt, result.legacy), current_opt[defence.OPTIMIZER_KEY]))
  now_optimizer = leaf_layout(current_opt[defence.OPTIMIZER_KEY])
  saved_optimizer = layouts.get(defence.OPTIMIZER_KEY, {})
  same_optimizer = saved_name == current_name and (
      saved_optimizer == now_optimizer
      or (bool(result.new_params) and _subset(saved_optimizer, now_optimizer)))
  if not same_optimizer:
    if not (reset_optimizer or (switched and saved_name != current_name)):
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
    now = leaf_layout(current_opt[key])
    if key == defence.OPTIMIZER_KEY:
      if result.optimizer_reset is None:
        keep.append(key)
    elif key not in layouts:
      result.fresh.append(key)
    elif layouts[key] == now or (result.new_params and _subset(layouts[key], now)):
      keep.append(key)
    else:
      result.changed.append(key)
  result.dropped = sorted(k for k in layouts if k not in current_opt)
  result.saved_keys = tuple(keep)
  if result.legacy is None:
    current.update({("opt_state", key) + p: None for key in keep for p in layouts[key]})
  return _finish_plan(result, stored, abstract, current)


def _finish_plan(result: RestorePlan, stored: Any, abstract: Any,
                 read: dict[tuple[str, ...], None]) -> RestorePlan:
  """Sets what Orbax reads: the saved tree trimmed to ``read`` (this run's shardings), with the
  positional optimizer state read whole for a legacy checkpoint."""
  by_path = {path_names(p): leaf
             for p, leaf in jax.tree_util.tree_leaves_with_path(abstract)}
  result.read = frozenset(read)
  target = _trimmed(stored, by_path, set(read)) or {}
  if result.legacy is not None:
    target["opt_state"] = result.legacy.positional
  result.target = target
  return result


def _keyed_optimizer(saved_opt: Any, layout: Optional[LegacyLayout]) -> Any:
  """The checkpoint's ``{name: optimizer state}`` entry, keyed or (legacy) by position."""
  if layout is None:
    return saved_opt[defence.OPTIMIZER_KEY]
  return layout.to_keyed(layout.positional)[defence.OPTIMIZER_KEY]
