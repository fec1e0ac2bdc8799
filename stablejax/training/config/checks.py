"""Checking a config: cross-field validation (:func:`validate`), the keys set away from their
default that have no effect in the chosen mode (:func:`ineffective_keys`), and what changed
between two starts of a run (:func:`changed_keys`)."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import TYPE_CHECKING, Any, Iterator, NamedTuple, Optional

from stablejax.data.config import DataError, source_entries
from stablejax.muon import newton_schulz as _ns
from stablejax.training.config import optimizers
from stablejax.training.config.sections import (Config, ConfigError, MeshConfig, OptimizerConfig,
                                                model_of, to_dict)
from stablejax.transforms import defence

if TYPE_CHECKING:
  import optax


def changed_keys(before: Config, after: Config) -> list[str]:
  """``key old -> new`` for every config key whose value differs between two starts of a run
  (a section that exists on one side only, such as a plugin defence's, counts as its keys).

  Example:
    >>> from stablejax.training.config import changed_keys, load_config
    >>> changed_keys(load_config(None), load_config(None, ["optimizer.learning_rate=0.005",
    ...                                                    "stability.qk_clip.enabled=true",
    ...                                                    "model.qk_norm=false"]))
    ['model.qk_norm true -> false', 'optimizer.learning_rate 0.01 -> 0.005',
     'stability.qk_clip.enabled false -> true']
  """
  def leaves(tree: optax.Params, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
      out: dict[str, Any] = {}
      for key, value in tree.items():
        out.update(leaves(value, f"{prefix}.{key}" if prefix else key))
      return out
    return {prefix: tree}
  old, new = leaves(to_dict(before)), leaves(to_dict(after))
  lines = []
  for key in sorted(set(old) | set(new)):
    a, b = old.get(key, "(none)"), new.get(key, "(none)")
    if a != b:
      lines.append(f"{key} {json.dumps(a)} -> {json.dumps(b)}")
  return lines


def _positive(name: str, value: float, allow_zero: bool = False) -> None:
  ok = value >= 0 if allow_zero else value > 0
  if not ok or (isinstance(value, float) and not math.isfinite(value)):
    bound = ">= 0" if allow_zero else "> 0"
    raise ConfigError(f"{name}={value} must be {bound}")


def validate(cfg: Config) -> None:
  """Cross-field checks; each failure names the key and what to set instead. Every number is
  checked against its range first (:func:`check_numbers`), so no later check meets a NaN or an
  integer beyond what the trainer computes with."""
  check_numbers(cfg)
  _validate_data(cfg)
  _validate_train(cfg)
  _validate_optimizer(cfg.optimizer)
  _validate_stability(cfg)
  _validate_logging_checkpoint_faults(cfg)
  _validate_mesh(cfg.mesh)
  check = getattr(cfg.model, "validate", None)
  try:
    if check is not None:
      check()
  except ValueError as e:
    raise ConfigError(str(e)) from None


# ----------------------------------------------------------------------------- numbers


class Bounds(NamedTuple):
  """The values a numeric setting may take: from ``low`` to ``high``, either end open, and why
  (for the message)."""

  low: float
  high: float
  low_open: bool = False
  high_open: bool = False
  why: str = ""

  def describe(self) -> str:
    """The range in words: ``in [0, 1)``, ``above 0``."""
    if self.high == math.inf:
      return f"{'above' if self.low_open else 'at least'} {self.low}"
    return (f"in {'(' if self.low_open else '['}{self.low}, {self.high}"
            f"{')' if self.high_open else ']'}")

  def problem(self, value: float) -> Optional[str]:
    """What is wrong with ``value`` ("must be at most 5"), or None when it lies within."""
    if isinstance(value, float) and not math.isfinite(value):
      return f"is not a finite number: give one {self.describe()}"
    if value > self.high or (self.high_open and value == self.high):
      return f"must be {'below' if self.high_open else 'at most'} {self.high}"
    if value < self.low or (self.low_open and value == self.low):
      return f"must be {'above' if self.low_open else 'at least'} {self.low}"
    return None


# An integer setting becomes a 32-bit integer of the trainer (its step counters, shapes, indices),
# or is compared with one: beyond these it would wrap, or fail inside a compiled step.
INT32 = Bounds(-2**31, 2**31 - 1, why="the trainer counts steps, sizes and indices in 32-bit "
                                      "integers")
# Newton-Schulz iterations are unrolled into the compiled step: Muon's 5 (or Polar Express's 8)
# compile in seconds, a million took twelve minutes and 18 GB to compile.
MAX_NS_STEPS = 100

# Settings whose meaning bounds them beyond their type. Every other integer is an INT32 and every
# other float finite; the checks below add what depends on other keys.
KEY_BOUNDS = {
    "train.seed": Bounds(0, 2**32 - 1, why="the initialisation and the data order take a 32-bit "
                                           "seed: another one repeats the run of one in range"),
    "optimizer.b1": Bounds(0, 1, high_open=True, why="the AdamW groups' first-moment decay"),
    "optimizer.b2": Bounds(0, 1, high_open=True, why="the AdamW groups' second-moment decay"),
    "optimizer.eps": Bounds(0, math.inf, low_open=True,
                            why="AdamW's term added to the root of the second moment"),
    "optimizer.momentum": Bounds(0, 1, high_open=True, why="Muon's momentum decay"),
    "optimizer.ns_steps": Bounds(1, MAX_NS_STEPS,
                                 why="Newton-Schulz iterations of each Muon update, unrolled into "
                                     "the compiled step; Muon uses 5"),
}


def check_numbers(cfg: Any) -> None:
  """Every number of ``cfg`` (every section, a model family's and each defence's included)
  within its range: a float finite, an integer a 32-bit integer (`INT32`), unless `KEY_BOUNDS`
  says otherwise; before anything is built from them.

  Raises:
    ConfigError: the first number out of its range, one line naming the key and the range.

  Example:
    >>> from stablejax.training.config import Config, ConfigError
    >>> from stablejax.training.config.checks import check_numbers
    >>> cfg = Config()
    >>> cfg.optimizer.b2 = 2.0
    >>> try:
    ...   check_numbers(cfg)
    ... except ConfigError as e:
    ...   print(e)
    optimizer.b2=2.0 must be below 1 (the AdamW groups' second-moment decay)
  """
  for key, shown, value, is_float in _numbers(cfg, ""):
    bounds = KEY_BOUNDS.get(key)
    if bounds is None and is_float:
      if not _finite(value):
        raise ConfigError(f"{shown}={value} is not a finite number: give one")
      continue
    bounds = bounds or INT32
    problem = bounds.problem(value)
    if problem is not None:
      raise ConfigError(f"{shown}={value} {problem} ({bounds.why})")


def _finite(value: float) -> bool:
  try:
    return math.isfinite(value)
  except OverflowError:  # an integer beyond every float
    return False


def _numbers(node: Any, prefix: str) -> Iterator[tuple[str, str, float, bool]]:
  """``(key, key as shown, value, of a float field)`` of every number under a config dataclass
  (a list's entries shown with their index). A float field may hold an integer (a config built
  in Python): its annotation, not the value, says which range applies."""
  for f in dataclasses.fields(node):
    value = getattr(node, f.name)
    key = f"{prefix}.{f.name}" if prefix else f.name
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
      yield from _numbers(value, key)
    is_float = "float" in str(f.type)  # float, Optional[float], list[float], as text or a type
    for i, item in enumerate(value if isinstance(value, list) else [value]):
      if isinstance(item, (int, float)) and not isinstance(item, bool):
        yield key, f"{key}[{i}]" if isinstance(value, list) else key, item, is_float


def _validate_data(cfg: Config) -> None:
  """The sources are paths a program can use (:func:`stablejax.data.config.source_entries`)."""
  try:
    source_entries(cfg.data.train, "train")
    source_entries(cfg.data.val, "val")
  except DataError as e:
    raise ConfigError(str(e)) from None


def _validate_train(cfg: Config) -> None:
  t = cfg.train
  for name in ("batch_size", "seq_len", "eval_every", "log_every", "grad_accum"):
    _positive(f"train.{name}", getattr(t, name))
  _positive("train.warmup_steps", t.warmup_steps, allow_zero=True)
  if t.steps is None:
    if t.time_budget_minutes is None:
      raise ConfigError("train.steps=null needs train.time_budget_minutes (the budget then fixes"
                        " the step count): set train.steps or a budget")
  else:
    _positive("train.steps", t.steps)
    if t.warmup_steps >= t.steps:
      raise ConfigError(f"train.warmup_steps={t.warmup_steps} must be below train.steps={t.steps}")
  if t.batch_size % t.grad_accum:
    raise ConfigError(f"train.batch_size={t.batch_size} is not divisible by "
                      f"train.grad_accum={t.grad_accum}")
  if t.seq_len > cfg.model.max_seq_len:
    raise ConfigError(f"train.seq_len={t.seq_len} exceeds "
                      f"model.max_seq_len={cfg.model.max_seq_len}: raise model.max_seq_len")
  if not 0 <= t.min_lr_ratio <= 1:
    raise ConfigError(f"train.min_lr_ratio={t.min_lr_ratio} must lie in [0, 1]")
  if t.time_budget_minutes is not None:
    _positive("train.time_budget_minutes", t.time_budget_minutes)


def _validate_optimizer(o: OptimizerConfig) -> None:
  if optimizers.get(o.name) is None:
    names = ", ".join(d.name for d in optimizers.registered())
    raise ConfigError(f"optimizer.name={o.name!r} is not a declared optimizer: use one of "
                      f"{names}, or name the module that declares it with --plugin")
  for name in ("learning_rate", "adam_learning_rate", "embedding_learning_rate",
               "head_learning_rate"):
    value = getattr(o, name)
    if value is not None:
      _positive(f"optimizer.{name}", value)
  _positive("optimizer.weight_decay", o.weight_decay, allow_zero=True)
  _positive("optimizer.adam_weight_decay", o.adam_weight_decay, allow_zero=True)
  try:
    o.validate()  # the optimizer's own rules
  except ValueError as e:
    raise ConfigError(str(e)) from None
  for name, allowed in (("ns_method", _ns.METHODS),
                        ("ns_preconditioning", _ns.PRECONDITIONINGS)):
    if getattr(o, name) not in allowed:
      raise ConfigError(f"optimizer.{name}={getattr(o, name)!r} is not known: use one of "
                        + ", ".join(f'"{k}"' for k in allowed))
  if not 0 <= o.normuon_b2 < 1:
    raise ConfigError(f"optimizer.normuon_b2={o.normuon_b2} must lie in [0, 1)")


def _validate_stability(cfg: Config) -> None:
  s = cfg.stability
  _positive("stability.z_loss", s.z_loss, allow_zero=True)
  try:
    defence.validate(s, defence.DefenceContext(stability=s, model=model_of(cfg),
                                               optimizer=cfg.optimizer))
  except ValueError as e:
    raise ConfigError(str(e)) from None
  r = s.recovery
  if not 0 < r.emergency_lr_factor <= 1:
    raise ConfigError(f"stability.recovery.emergency_lr_factor={r.emergency_lr_factor} must lie "
                      "in (0, 1]")
  if r.lr_recovery_steps is not None:
    _positive("stability.recovery.lr_recovery_steps", r.lr_recovery_steps)
  if r.lr_recovery_schedule not in ("linear", "geometric"):
    raise ConfigError(f"stability.recovery.lr_recovery_schedule={r.lr_recovery_schedule!r} is not"
                      " known: use \"linear\" or \"geometric\"")
  _positive("stability.recovery.max_rollbacks", r.max_rollbacks, allow_zero=True)
  _positive("stability.recovery.loss_window", r.loss_window)
  if not r.loss_explosion_factor > 1:
    raise ConfigError(f"stability.recovery.loss_explosion_factor={r.loss_explosion_factor} must be"
                      " > 1 (a multiple of the best loss)")
  _positive("stability.recovery.max_transients", r.max_transients)
  _positive("stability.recovery.transient_window", r.transient_window)
  _positive("stability.recovery.reject_after", r.reject_after, allow_zero=True)
  _validate_run_checks(s)
  _positive("stability.loss_scale.init", s.loss_scale.init)
  _positive("stability.loss_scale.growth_interval", s.loss_scale.growth_interval)
  if not s.loss_scale.growth_factor > 1:
    raise ConfigError(f"stability.loss_scale.growth_factor={s.loss_scale.growth_factor} must be"
                      " > 1")


def _validate_run_checks(s: Any) -> None:
  """``stability.determinism``, ``stability.replicas`` and ``stability.watchdog``."""
  _positive("stability.determinism.check_every", s.determinism.check_every, allow_zero=True)
  _positive("stability.replicas.check_every", s.replicas.check_every, allow_zero=True)
  w = s.watchdog
  if w.timeout_seconds is not None:
    _positive("stability.watchdog.timeout_seconds", w.timeout_seconds)
  for name in ("factor", "floor_seconds", "startup_seconds", "grace_seconds"):
    _positive(f"stability.watchdog.{name}", getattr(w, name))


def _validate_logging_checkpoint_faults(cfg: Config) -> None:
  if cfg.logging.sample_every is not None:
    _positive("logging.sample_every", cfg.logging.sample_every, allow_zero=True)
  _positive("logging.sample_tokens", cfg.logging.sample_tokens)
  _positive("logging.attention_sequences", cfg.logging.attention_sequences)
  _positive("checkpoint.every", cfg.checkpoint.every)
  _positive("checkpoint.keep", cfg.checkpoint.keep)
  for name in ("nan_grad_steps", "nan_grad_batch_indices", "garbage_batch_steps",
               "garbage_batch_indices", "grad_scale_steps", "repeat_batch_steps",
               "transient_nan_steps", "transient_grad_scale_steps", "nondeterministic_steps"):
    if any(i < 0 for i in getattr(cfg.faults, name)):
      raise ConfigError(f"faults.{name}={getattr(cfg.faults, name)} has a negative entry: use "
                        "0-based indices")
  f = cfg.faults
  for name in ("corrupt_replica_step", "corrupt_replica_device", "hang_at_step", "hang_at_batch",
               "transient_device"):
    if getattr(f, name) is not None:
      _positive(f"faults.{name}", getattr(f, name), allow_zero=True)
  _positive("faults.nondeterminism", f.nondeterminism, allow_zero=True)
  _positive("train.rewarmup_steps", cfg.train.rewarmup_steps, allow_zero=True)
  if cfg.faults.garbage_kind not in ("repeat", "random"):
    raise ConfigError(f"faults.garbage_kind={cfg.faults.garbage_kind!r} is not known: use "
                      "\"repeat\" or \"random\"")


def _validate_mesh(mesh: MeshConfig) -> None:
  if mesh.fsdp < 1 or mesh.data == 0 or mesh.data < -1:
    raise ConfigError(f"mesh.data={mesh.data}, mesh.fsdp={mesh.fsdp}: use fsdp >= 1 and "
                      "data >= 1 or -1")
  for name in ("initialization_timeout", "heartbeat_timeout", "shutdown_timeout"):
    _positive(f"mesh.{name}", getattr(mesh, name))
  if not mesh.distributed:
    for name in ("coordinator_address", "num_processes", "process_id", "local_device_ids"):
      if getattr(mesh, name) is not None:
        raise ConfigError(f"mesh.{name} is set but mesh.distributed=false: set "
                          f"mesh.distributed=true to join a multi-process job, or drop "
                          f"mesh.{name}")


# ----------------------------------------------------------------------------- ineffective keys

# (keys, is_ineffective(cfg), "with ..." reason). A key listed here and set away from its default
# while its condition holds gets one warning line at start; add a row for every new mode switch.
_INEFFECTIVE_RULES = (
    (("optimizer.adam_learning_rate", "optimizer.embedding_learning_rate",
      "optimizer.head_learning_rate", "optimizer.adam_weight_decay", "optimizer.momentum",
      "optimizer.ns_steps", "optimizer.ns_coeffs", "optimizer.ns_backend",
      "optimizer.consistent_rms", "optimizer.outlier_threshold", "optimizer.outlier_method",
      "optimizer.ns_method", "optimizer.ns_preconditioning", "optimizer.per_head",
      "optimizer.normuon", "optimizer.normuon_b2"),
     lambda c: c.optimizer.name == "adamw",
     'optimizer.name="adamw" (AdamW uses optimizer.learning_rate and optimizer.weight_decay)'),
    (("optimizer.outlier_threshold",),
     lambda c: c.optimizer.name == "muon" and c.optimizer.outlier_method is None,
     "optimizer.outlier_method=null"),
    (("optimizer.normuon_b2",),
     lambda c: c.optimizer.name == "muon" and not c.optimizer.normuon,
     "optimizer.normuon=false"),
    (("stability.loss_scale.init", "stability.loss_scale.growth_interval",
      "stability.loss_scale.growth_factor"),
     lambda c: model_of(c).compute_dtype != "float16",
     'model.compute_dtype other than "float16" (loss scaling is for fp16 only)'),
    (("stability.recovery.emergency_lr_factor", "stability.recovery.max_rollbacks",
      "stability.recovery.loss_window", "stability.recovery.loss_explosion_factor",
      "stability.recovery.lr_recovery_steps", "stability.recovery.lr_recovery_schedule",
      "stability.recovery.replay", "stability.recovery.max_transients",
      "stability.recovery.transient_window", "stability.recovery.reject_after"),
     lambda c: not c.stability.recovery.enabled, "stability.recovery.enabled=false"),
    (("stability.recovery.max_transients", "stability.recovery.transient_window"),
     lambda c: not c.stability.recovery.replay, "stability.recovery.replay=false"),
    (("stability.watchdog.timeout_seconds", "stability.watchdog.factor",
      "stability.watchdog.floor_seconds", "stability.watchdog.startup_seconds",
      "stability.watchdog.grace_seconds"),
     lambda c: not c.stability.watchdog.enabled, "stability.watchdog.enabled=false"),
    (("stability.watchdog.factor", "stability.watchdog.floor_seconds"),
     lambda c: c.stability.watchdog.timeout_seconds is not None,
     "stability.watchdog.timeout_seconds set (a fixed timeout)"),
    (("faults.nondeterminism",), lambda c: not c.faults.nondeterministic_steps,
     "faults.nondeterministic_steps empty"),
    (("faults.corrupt_replica_device",), lambda c: c.faults.corrupt_replica_step is None,
     "faults.corrupt_replica_step=null"),
    (("faults.transient_device",), lambda c: not c.faults.transient_nan_steps,
     "faults.transient_nan_steps empty"),
    (("logging.attention_per_head", "logging.attention_sequences"),
     lambda c: not c.logging.attention_logits, "logging.attention_logits=false"),
    (("faults.garbage_kind",),
     lambda c: not (c.faults.garbage_batch_steps or c.faults.garbage_batch_indices),
     "faults.garbage_batch_steps and faults.garbage_batch_indices empty"),
    (("faults.grad_scale_factor",),
     lambda c: not (c.faults.grad_scale_steps or c.faults.transient_grad_scale_steps),
     "faults.grad_scale_steps and faults.transient_grad_scale_steps empty"),
)


def _get(cfg: Any, dotted: str) -> tuple[bool, Any, Any]:
  """(found, value, default) of a dotted key: the default is the same key of a fresh section."""
  *path, key = dotted.split(".")
  node = cfg
  for part in path:
    node = getattr(node, part, None)
  if node is None or not hasattr(node, key):
    return False, None, None
  return True, getattr(node, key), getattr(type(node)(), key)


def _declared_rules(cfg: Config) -> list[tuple[tuple[str, ...], bool, str]]:
  """Every key of a disabled defence's section has no effect; then the defences' own rules
  (``Defence.ineffective``) and the model's (``LanguageModel.ineffective_keys``)."""
  model = model_of(cfg)
  ctx = defence.DefenceContext(stability=cfg.stability, model=model)
  rules = []
  for d in defence.registered():
    section = d.section(cfg.stability)
    keys = tuple(f"stability.{d.name}.{f.name}" for f in dataclasses.fields(d.config)
                 if f.name != "enabled")
    rules.append((keys, not section.enabled, f"stability.{d.name}.enabled=false"))
    if section.enabled and d.ineffective is not None:
      rules += [((key,), True, reason) for key, reason in d.ineffective(section, ctx)]
  rules += [((key,), True, reason) for key, reason in model.ineffective_keys(cfg)]
  return rules


def ineffective_keys(cfg: Config) -> list[str]:
  """One line per config key set away from its default that has no effect in the chosen mode.

  Example: `optimizer.adam_weight_decay=0.1 has no effect with optimizer.name="adamw" (...)`.
  The trainer prints each as a warning at start, so no setting is silently ignored. Every key of
  a disabled defence counts (``stability.adagc.beta`` with ``stability.adagc.enabled=false``).
  """
  rules = [(keys, ineffective(cfg), reason) for keys, ineffective, reason in _INEFFECTIVE_RULES]
  lines, seen = [], set()
  for keys, ineffective, reason in rules + _declared_rules(cfg):
    if not ineffective:
      continue
    for dotted in keys:
      found, value, default = _get(cfg, dotted)
      if dotted in seen or not found:
        continue  # named once; or a key this version of the config does not have
      if value != default:
        seen.add(dotted)
        lines.append(f"{dotted}={json.dumps(value)} has no effect with {reason}")
  return lines
