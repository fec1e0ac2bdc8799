"""Loading a config: a JSON file or a packaged config, ``section.key=value`` overrides and
plugins, checked into the dataclasses of :mod:`stablejax.training.config.sections`.

Unknown keys and values of the wrong type are errors (`ConfigError`, one line naming the key and
the fix), never silently ignored: a typo in a learning-rate key must not train with the default.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from stablejax.data.prepared import prepared_vocab_size
from stablejax.modeling import family as family_lib
from stablejax.training.config import optimizers
from stablejax.training import plugins as plugins_lib
from stablejax.training.config.checks import validate
from stablejax.training.config.legacy import _old_key_message, translate_v0_1
from stablejax.training.config.sections import (Config, ConfigError, model_section_class,
                                                stability_config_class, to_dict)


def _type_name(tp: Any) -> str:
  """How a value of annotation ``tp`` is written in JSON: "an integer or null", "a number"..."""
  if typing.get_origin(tp) in (Union, types.UnionType):
    return " or ".join(_type_name(arm) for arm in typing.get_args(tp))
  names = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
           type(None): "null"}
  if tp in names:
    return names[tp]
  if typing.get_origin(tp) is list:
    return "a JSON list"
  return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
  """Checks `value` against the annotation `tp`; returns it (ints widen to floats)."""
  origin = typing.get_origin(tp)
  if origin in (Union, types.UnionType):
    for arm in typing.get_args(tp):
      try:
        return _coerce(value, arm, key)
      except ConfigError:
        continue
    raise ConfigError(f"{key}={json.dumps(value)} has the wrong type: expected {_type_name(tp)}")
  if tp is type(None):
    if value is None:
      return None
    raise ConfigError(f"{key} must be null")
  if origin is list:
    (item_tp,) = typing.get_args(tp)
    if not isinstance(value, list):
      raise ConfigError(f"{key}={json.dumps(value)} has the wrong type: expected a JSON list")
    return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
  if tp is float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise ConfigError(f"{key}={json.dumps(value)} has the wrong type: expected a number")
    try:
      return float(value)
    except OverflowError:  # an integer beyond every float
      raise ConfigError(f"{key}={str(value)[:20]}... ({len(str(value))} digits) is beyond every "
                        "floating-point number: give a finite one") from None
  if tp is int:
    if isinstance(value, bool) or not isinstance(value, int):
      raise ConfigError(f"{key}={json.dumps(value)} has the wrong type: expected an integer")
    return value
  if tp is bool:
    if not isinstance(value, bool):
      raise ConfigError(f"{key}={json.dumps(value)} has the wrong type: expected true or false")
    return value
  if tp is str:
    if not isinstance(value, str):
      raise ConfigError(f"{key}={json.dumps(value)} has the wrong type: expected a string")
    return value
  if isinstance(tp, type) and dataclasses.is_dataclass(tp):
    if not isinstance(value, dict):
      raise ConfigError(f"{key} must be a JSON object of {tp.__name__} fields")
    return _build(tp, value, key)
  raise ConfigError(f"{key}: unsupported annotation {tp}")


def _build(cls: type, raw: dict, prefix: str = "") -> Any:
  if cls is Config:
    built = {}
    if isinstance(raw.get("stability"), dict):
      built["stability"] = _build(stability_config_class(), raw["stability"], "stability")
    if isinstance(raw.get("model"), dict):
      section = model_section_class(_family_name(raw))
      built["model"] = _build(section, raw["model"], "model")
    if isinstance(raw.get("optimizer"), dict):
      built["optimizer"] = _build(_optimizer_class(raw), raw["optimizer"], "optimizer")
    raw = dict(raw, **built)
  hints = typing.get_type_hints(cls)
  names = [f.name for f in dataclasses.fields(cls)]
  for key, value in raw.items():
    where = f"{prefix}.{key}" if prefix else key
    old = _old_key_message(where, value)
    if old:
      raise ConfigError(old)
    if key not in hints:
      raise ConfigError(f"unknown config key '{where}': valid keys here are {', '.join(names)}")
  kwargs = {k: v if k in ("stability", "model", "optimizer") and dataclasses.is_dataclass(v) else
            _coerce(v, hints[k], f"{prefix}.{k}" if prefix else k) for k, v in raw.items()}
  return cls(**kwargs)


def config_from_dict(raw: dict, layers: Optional[list[set[str]]] = None) -> Config:
  """Builds and validates a `Config` from a (possibly partial) nested dict.

  The plugins it names (``raw["plugins"]``) are imported first, so their defences and model
  families exist when the rest is read.

  Args:
    raw: the config values, e.g. ``{"train": {"steps": 100}}``.
    layers: the dotted keys each source gave, in the order they were applied (a config file,
      then ``--set`` overrides); None: ``raw`` is one source. They tell a ``train.steps`` given
      next to (or after) ``train.time_budget_minutes`` from one that only came with the file.
  """
  if not isinstance(raw, dict):
    raise ConfigError("the config must be a JSON object with sections like 'model' and 'train'")
  load_plugins(raw.get("plugins", []), "the config's plugins")
  _sections_are_objects(raw)
  _vocab_from_prepared_data(raw)
  _budget_fixes_steps(raw, [flat_keys(raw)] if layers is None else layers)
  cfg = _build(Config, raw)
  validate(cfg)
  return cfg


def load_plugins(names: Any, where: str) -> None:
  """Imports the plugins ``names`` (:mod:`stablejax.training.plugins`).

  Raises:
    ConfigError: ``names`` is not a list of strings, or a plugin cannot be imported.
  """
  if not isinstance(names, list):
    raise ConfigError(f"plugins={json.dumps(names)} has the wrong type: expected a JSON list of "
                      "module names or .py paths")
  try:
    plugins_lib.load(names, where)
  except plugins_lib.PluginError as e:
    raise ConfigError(str(e)) from None


def _optimizer_class(raw: dict) -> type:
  """The ``optimizer`` section's class of ``optimizer.name`` (a declared optimizer's)."""
  name = raw["optimizer"].get("name", "muon")
  if not isinstance(name, str):
    raise ConfigError(f"optimizer.name={json.dumps(name)} has the wrong type: expected a string")
  try:
    return optimizers.section_class(name)
  except ValueError as e:
    raise ConfigError(str(e)) from None


def _family_name(raw: dict) -> str:
  model = raw.get("model")
  name = model.get("family", family_lib.DEFAULT_FAMILY) if isinstance(model, dict) else \
      family_lib.DEFAULT_FAMILY
  if not isinstance(name, str):
    raise ConfigError(f"model.family={json.dumps(name)} has the wrong type: expected a string")
  return name


def _sections_are_objects(raw: dict) -> None:
  """Every section of ``raw`` but ``plugins`` must be a JSON object."""
  for f in dataclasses.fields(Config):
    value = raw.get(f.name)
    if f.name != "plugins" and value is not None and not isinstance(value, dict):
      raise ConfigError(f"{f.name} must be a JSON object of its keys, not {json.dumps(value)}")


def flat_keys(raw: Any, prefix: str = "") -> set[str]:
  """The dotted keys of a nested dict: ``{"train": {"steps": 1}}`` -> ``{"train",
  "train.steps"}``."""
  keys: set[str] = set()
  if isinstance(raw, dict):
    for key, value in raw.items():
      dotted = f"{prefix}.{key}" if prefix else str(key)
      keys |= {dotted} | flat_keys(value, dotted)
  return keys


def _budget_fixes_steps(raw: dict, layers: list[set[str]]) -> None:
  """With a time budget, the budget owns the step count (train.steps=null) unless train.steps
  was given in the same source as the budget or a later one; that one is then a cap.

  So ``--set train.time_budget_minutes=2`` on a config file with ``"steps": 250`` trains as
  long as two minutes allow, and a file (or ``--set``) giving both caps the budget at its steps.
  """
  train = raw.get("train")
  if not isinstance(train, dict) or train.get("time_budget_minutes") is None:
    return
  given = [i for i, keys in enumerate(layers) if "train.time_budget_minutes" in keys]
  if given and any("train.steps" in keys for keys in layers[given[-1]:]):
    return
  raw["train"] = dict(train, steps=None)


def _vocab_from_prepared_data(raw: dict) -> None:
  """Without model.vocab_size, a prepared data directory's vocabulary (padded to a multiple of
  64) sets it; a given one is checked against the data when the run starts."""
  model, data = raw.get("model", {}), raw.get("data", {})
  if not isinstance(model, dict) or not isinstance(data, dict) or "vocab_size" in model:
    return
  vocab = prepared_vocab_size(data.get("train"))
  if vocab is not None:
    raw["model"] = dict(model, vocab_size=-(-vocab // 64) * 64)


def _maybe_json(text: str) -> Any:
  try:
    return json.loads(text)
  except json.JSONDecodeError:
    return text
  except ValueError as e:  # a number of more digits than Python reads (sys.get_int_max_str_digits)
    raise ConfigError(f"--set value {text[:20]}... ({len(text)} characters) cannot be read: "
                      f"{str(e).split(':')[0]}") from None


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
  """Applies `section.key=value` overrides (value parsed as JSON, else taken as a string).

  The keys are checked against the sections of the config they make: ``model.*`` against the
  family ``model.family`` names (set in the file or by an override), ``stability.*`` against the
  registered defences (import a plugin's first: :func:`load_plugins`).
  """
  parsed = []
  for item in overrides:
    if "=" not in item:
      raise ConfigError(f"--set {item!r} is not of the form section.key=value (e.g. "
                        "train.steps=100)")
    dotted, text = item.split("=", 1)
    dotted = dotted.strip()
    old = _old_key_message(dotted, _maybe_json(text))
    if old:
      raise ConfigError(old)
    parsed.append((dotted, _maybe_json(text)))
  for dotted, value in parsed:
    if dotted == "model.family":
      raw.setdefault("model", {})
      if not isinstance(raw["model"], dict):
        raise ConfigError("model must be a JSON object of its keys, not "
                          f"{json.dumps(raw['model'])}")
      raw["model"] = _switch_family(raw["model"], value)
  defaults = to_dict(Config(model=model_section_class(_family_name(raw))()))
  for dotted, value in parsed:
    parts = dotted.split(".")
    node_default: Any = defaults
    for part in parts:
      if not isinstance(node_default, dict) or part not in node_default:
        raise ConfigError(f"--set {dotted}: no such config key; see "
                          "stablejax/configs/default.json for the keys"
                          + (" (model.* keys depend on model.family)"
                             if parts[0] == "model" else ""))
      node_default = node_default[part]
    node = raw
    for i, part in enumerate(parts[:-1]):
      child = node.setdefault(part, {})
      if not isinstance(child, dict):
        where = ".".join(parts[:i + 1])
        raise ConfigError(f"--set {dotted}: {where} is {json.dumps(child)} in the config, not a "
                          f"JSON object of its keys: make {where} an object (or leave it out)")
      node = child
    node[parts[-1]] = value
  return raw


def _switch_family(model: dict, family: Any) -> dict:
  """A ``model`` section of a config file under ``--set model.family=...``: the new family
  starts from its own defaults (its config's), so a key that only restates the old family's
  default (the packaged default config's ``qk_norm``, ``d_model``...) is dropped, whether the new
  family has it or not; a key given away from that default is kept if the new family has it and
  refused otherwise."""
  old = _family_name({"model": model})
  if not isinstance(family, str) or family == old:
    return dict(model, family=family)
  new_fields = {f.name for f in dataclasses.fields(model_section_class(family))}
  old_defaults = dataclasses.asdict(model_section_class(old)())
  kept = {"family": family}
  for key, value in model.items():
    if key == "family" or old_defaults.get(key, object()) == value:
      continue
    if key not in new_fields:
      raise ConfigError(f"model.{key}={json.dumps(value)} of the config file is not a key of "
                        f"model.family={family!r}: remove it, or set the family in the file")
    kept[key] = value
  return kept


def _check_sections(raw: Any, path: Path) -> dict:
  """A config file's content: a JSON object whose sections are objects (one line otherwise)."""
  if not isinstance(raw, dict):
    raise ConfigError(f"config file {path} is {type(raw).__name__} JSON, not an object with "
                      "sections like 'model' and 'train'")
  for section, value in raw.items():
    if section in _SECTIONS and section != "plugins" and not isinstance(value, dict):
      raise ConfigError(f"config file {path}: section {section!r} is {json.dumps(value)}, not a "
                        f"JSON object of its keys: make it an object (or leave it out)")
  return raw


_SECTIONS = tuple(f.name for f in dataclasses.fields(Config))


def packaged_configs() -> dict[str, Path]:
  """The configs that ship with the package (``stablejax/configs/*.json``), by name."""
  folder = Path(__file__).resolve().parents[2] / "configs"
  return {p.stem: p for p in sorted(folder.glob("*.json"))}


def config_path(name_or_path: str | Path) -> Path:
  """The JSON file of ``--config``: an existing file, else a packaged config's name.

  Raises:
    ConfigError: neither a file nor a packaged config (the message lists the names).
  """
  path = Path(name_or_path)
  if path.is_file():
    return path
  packaged = packaged_configs()
  name = path.stem if path.suffix == ".json" and path.parent == Path("configs") else str(path)
  if name in packaged:
    return packaged[name]
  raise ConfigError(f"config {str(name_or_path)!r} is neither a file nor a packaged config: pass "
                    f"a JSON file or one of {', '.join(packaged)}")


def config_name(name_or_path: str | Path) -> str:
  """The name a run directory takes by default (``runs/<name>``): the file name without .json."""
  return Path(name_or_path).stem


def load_config(path: str | Path | None, overrides: Sequence[str] = (),
                plugins: Sequence[str] = ()) -> Config:
  """The config of a JSON file or packaged config (None: the defaults) with ``section.key=value``
  overrides and plugins.

  ``path`` is a JSON file, or the name of a config that ships with the package (``"default"``,
  ``"gpt2_small"``, ...; `packaged_configs`). ``plugins`` (the trainer's ``--plugin``) join the
  file's ``plugins`` and a ``--set plugins=[...]``; all are imported before the keys are checked,
  and the config lists them all.

  A time budget in the file or the overrides owns the step count unless ``train.steps`` is given
  in the same place or later (`config_from_dict`).

  Raises:
    ConfigError: a missing or invalid file, an unknown key or a bad value, a plugin that cannot
      be imported (one line naming it).

  Example:
    >>> import json, pathlib, tempfile
    >>> from stablejax.training.config import ConfigError, load_config
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "tiny.json"
    >>> _ = path.write_text(json.dumps({"model": {"d_model": 64, "n_layers": 2}}))
    >>> cfg = load_config(path, ["model.n_layers=3"])  # overrides win over the file
    >>> cfg.model.d_model, cfg.model.n_layers
    (64, 3)
    >>> try:
    ...   load_config(path, ["model.n_layer=3"])
    ... except ConfigError as e:
    ...   print(e)
    --set model.n_layer: no such config key; see stablejax/configs/default.json for the keys
    (model.* keys depend on model.family)
  """
  raw: dict = {}
  if path is not None:
    path = config_path(path)
    try:
      raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
      raise ConfigError(f"config file {path} is not valid JSON (line {e.lineno}: {e.msg})") \
          from None
    except UnicodeDecodeError as e:
      raise ConfigError(f"config file {path} is not UTF-8 text ({e.reason} at byte {e.start}): "
                        "pass a JSON file") from None
    except ValueError as e:  # a number of more digits than Python reads
      raise ConfigError(f"config file {path} cannot be read: {str(e).split(':')[0]}") from None
    except OSError as e:
      raise ConfigError(f"cannot read config file {path}: {e.strerror or e}") from None
    raw = _check_sections(raw, path)
  return _with_overrides(raw, overrides, plugins, str(path) if path else "the config")


def _with_overrides(raw: dict, overrides: Sequence[str], plugins: Sequence[str],
                    where: str) -> Config:
  """``raw`` with the plugins imported, then the overrides applied, then checked."""
  overrides = list(overrides)
  named = [_maybe_json(item.split("=", 1)[1]) for item in overrides
           if item.split("=", 1)[0].strip() == "plugins" and "=" in item]
  listed = raw.get("plugins", [])
  load_plugins(listed, where)
  for value in named:
    load_plugins(value, "--set plugins")
  load_plugins(list(plugins), "--plugin")
  layers = [flat_keys(raw), _override_keys(overrides)]
  raw = apply_overrides(raw, overrides)
  every = [plugins_lib.normalise(name) for group in [listed, *named, list(plugins)]
           for name in group]
  raw["plugins"] = list(dict.fromkeys(every))
  return config_from_dict(raw, layers)


def _override_keys(overrides: Sequence[str]) -> set[str]:
  """The dotted keys (and their sections) ``section.key=value`` overrides give."""
  keys = set()
  for item in overrides:
    parts = item.split("=", 1)[0].strip().split(".")
    keys |= {".".join(parts[:i + 1]) for i in range(len(parts))}
  return keys


def load_run_file(path: str | Path, overrides: Sequence[str] = (),
                  plugins: Sequence[str] = ()) -> Config:
  """The config a run wrote (``RUN_DIR/config.json``), in this version's form, with
  ``section.key=value`` overrides: its plugins are imported again first, and a run directory of
  stablejax 0.1 (flat stability keys) is translated (`translate_v0_1`), so it still resumes.

  Raises:
    ConfigError: a missing or invalid file (one line naming it), a plugin that cannot be
      imported, or a bad override.
  """
  path = Path(path)
  try:
    raw = json.loads(path.read_text())
  except OSError as e:
    raise ConfigError(f"cannot read {path}: {e.strerror or e}") from None
  except json.JSONDecodeError as e:
    raise ConfigError(f"{path} is not valid JSON (line {e.lineno}: {e.msg})") from None
  except UnicodeDecodeError as e:
    raise ConfigError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
  raw = translate_v0_1(_check_sections(raw, path))
  return _with_overrides(raw, overrides, plugins, str(path))


def recorded_plugins(path: str | Path) -> list[str]:
  """The plugins a run's ``config.json`` lists ([] when it lists none or cannot be read: the
  reader that needs the file says what is wrong with it)."""
  try:
    raw = json.loads(Path(path).read_text())
  except (OSError, ValueError):
    return []
  names = raw.get("plugins", []) if isinstance(raw, dict) else []
  return [n for n in names if isinstance(n, str)] if isinstance(names, list) else []
