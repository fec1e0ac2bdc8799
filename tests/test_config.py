"""config.validate and config.ineffective_keys at the edges their messages state."""

from __future__ import annotations

import pytest

from stablejax.training.config import Config, ConfigError, ineffective_keys, load_config


def _load(*overrides: str) -> Config:
  return load_config(None, list(overrides))


# (overrides just inside the documented range, the same key just outside it, message)
EDGES = [
    # "train.warmup_steps=... must be below train.steps"
    (["train.steps=10", "train.warmup_steps=9"], ["train.steps=10", "train.warmup_steps=10"],
     "train.warmup_steps=10 must be below train.steps=10"),
    (["train.batch_size=8", "train.grad_accum=4"], ["train.batch_size=8", "train.grad_accum=3"],
     "not divisible by train.grad_accum=3"),
    (["model.max_seq_len=64", "train.seq_len=64"], ["model.max_seq_len=64", "train.seq_len=65"],
     "train.seq_len=65 exceeds model.max_seq_len=64"),
    (["train.min_lr_ratio=1.0"], ["train.min_lr_ratio=1.5"], "must lie in \\[0, 1\\]"),
    (["stability.skip_spikes.window=16", "stability.skip_spikes.min_history=16"],
     ["stability.skip_spikes.window=16", "stability.skip_spikes.min_history=17"],
     "skip_spikes.min_history=17 must lie in \\[1, stability.skip_spikes.window=16\\]"),
    # OLMo-core's rule needs 19 losses before it can skip.
    (["stability.skip_spikes.statistics=\"olmo_core\"", "stability.skip_spikes.window=19",
      "stability.skip_spikes.min_history=null"],
     ["stability.skip_spikes.statistics=\"olmo_core\"", "stability.skip_spikes.window=18",
      "stability.skip_spikes.min_history=null"],
     "skip_spikes.window=18 is below 19"),
    (["stability.recovery.emergency_lr_factor=1.0"], ["stability.recovery.emergency_lr_factor=0.0"],
     "emergency_lr_factor=0.0 must lie in \\(0, 1\\]"),
    (["stability.clip.enabled=true", "stability.clip.max_norm=0.5"],
     ["stability.clip.enabled=true", "stability.clip.max_norm=0"],
     "stability.clip.max_norm=0.0 must be > 0"),
    (["mesh.distributed=true", "mesh.process_id=0"], ["mesh.process_id=0"],
     "mesh.process_id is set but mesh.distributed=false"),
    # Numbers with a range of their own (config/checks.py KEY_BOUNDS), NaN and zero included.
    (["optimizer.b2=0.999"], ["optimizer.b2=2"], "optimizer.b2=2.0 must be below 1 "),
    (["optimizer.b1=0.0"], ["optimizer.b1=NaN"],
     "optimizer.b1=nan is not a finite number: give one in \\[0, 1\\) "),
    (["optimizer.eps=1e-30"], ["optimizer.eps=0"], "optimizer.eps=0.0 must be above 0 "),
    (["optimizer.eps=1e-30"], ["optimizer.eps=NaN"], "optimizer.eps=nan is not a finite number"),
    (["optimizer.ns_steps=1"], ["optimizer.ns_steps=0"],
     "optimizer.ns_steps=0 must be at least 1 "),
    (["optimizer.ns_steps=100"], ["optimizer.ns_steps=101"],
     "optimizer.ns_steps=101 must be at most 100 \\(Newton-Schulz iterations"),
    (["train.seed=4294967295"], ["train.seed=4294967296"],
     "train.seed=4294967296 must be at most 4294967295 \\(the initialisation"),
    # Every other integer is a 32-bit one (the step counters), every other float finite.
    (["train.steps=2147483647"], ["train.steps=2147483648"],
     "train.steps=2147483648 must be at most 2147483647 \\(the trainer counts"),
    (["faults.nan_grad_steps=[2147483647]"], ["faults.nan_grad_steps=[1, 2147483648]"],
     "faults.nan_grad_steps\\[1\\]=2147483648 must be at most 2147483647"),
    (["stability.zclip.z_thresh=1e30"], ["stability.zclip.z_thresh=Infinity"],
     "stability.zclip.z_thresh=inf is not a finite number"),
    # A size whose state would not fit: the skip window's histories.
    (["stability.skip_spikes.window=100000"], ["stability.skip_spikes.window=100001"],
     "stability.skip_spikes.window=100001 must be at most 100000 \\(steps of losses"),
    # A size is positive before it is even.
    (["model.family=\"llama\"", "model.head_dim=2"], ["model.family=\"llama\"",
                                                       "model.head_dim=-4"],
     "model.head_dim=-4 must be a positive integer"),
]


@pytest.mark.parametrize("inside,outside,message", EDGES)
def test_each_bound_accepts_its_edge_and_rejects_the_next_value(inside: list[str],
                                                                outside: list[str],
                                                                message: str) -> None:
  _load(*inside)
  with pytest.raises(ConfigError, match=message):
    _load(*outside)


def test_keys_left_at_their_defaults_are_never_named_as_ineffective() -> None:
  # AdamW mode leaves every Muon key unused; at their defaults (momentum 0.95, ns_steps 5, ...)
  # none of them was set, so none is named.
  assert ineffective_keys(_load("optimizer.name=\"adamw\"")) == []
  lines = ineffective_keys(_load("optimizer.name=\"adamw\"", "optimizer.momentum=0.9"))
  assert lines == ["optimizer.momentum=0.9 has no effect with optimizer.name=\"adamw\" (AdamW uses "
                   "optimizer.learning_rate and optimizer.weight_decay)"]


def test_outlier_threshold_without_an_outlier_method_is_named_as_ineffective() -> None:
  assert ineffective_keys(_load("optimizer.outlier_method=null")) == []
  lines = ineffective_keys(_load("optimizer.outlier_method=null",
                                 "optimizer.outlier_threshold=3.0"))
  assert lines == ["optimizer.outlier_threshold=3.0 has no effect with "
                   "optimizer.outlier_method=null"]


# ----------------------------------------------------------------------------- keys of 0.1


@pytest.mark.parametrize("old,new", [
    ("stability.z_thresh=3.0", "use stability.zclip.z_thresh"),
    ("stability.zclip=false", "use stability.zclip.enabled"),
    ("stability.spike_window=32", "use stability.skip_spikes.window"),
    ("stability.max_consecutive_skips=3",
     "use stability.skip_spikes.max_consecutive and stability.skip_nonfinite.max_consecutive"),
    ("stability.qk_clip_tau=30", "use stability.qk_clip.enabled and stability.qk_clip.tau"),
    ("stability.max_grad_norm=0.5",
     "use stability.zclip.max_grad_norm and stability.clip.max_norm"),
    ("stability.emergency_lr_factor=0.5", "use stability.recovery.emergency_lr_factor"),
    ("stability.recovery=false", "use stability.recovery.enabled"),
])
def test_an_old_flat_key_is_one_line_naming_its_new_key(old: str, new: str, tmp_path) -> None:
  with pytest.raises(ConfigError, match=new) as e:
    _load(old)
  assert "\n" not in str(e.value) and "stablejax 0.1" in str(e.value)
  # The same key in a config file is refused the same way.
  import json
  dotted, value = old.split("=")
  path = tmp_path / "old.json"
  path.write_text(json.dumps({"stability": {dotted.split(".")[1]: json.loads(value)}}))
  with pytest.raises(ConfigError, match=new):
    load_config(path)


def test_a_config_of_0_1_translates_to_the_same_settings() -> None:
  from stablejax.training.config import config_from_dict, translate_v0_1
  old = {"stability": {"zclip": True, "z_thresh": 3.0, "max_grad_norm": 0.8, "adagc": False,
                       "spike_window": 32, "spike_min_history": 8, "max_consecutive_skips": 4,
                       "qk_clip_tau": 50.0, "loss_scale_init": 256.0, "recovery": True,
                       "max_rollbacks": 5, "z_loss": 0.0},
         "model": {"qk_norm": False}}
  s = config_from_dict(translate_v0_1(old)).stability
  assert (s.zclip.enabled, s.zclip.z_thresh, s.zclip.max_grad_norm) == (True, 3.0, 0.8)
  assert not s.clip.enabled and not s.adagc.enabled
  assert (s.skip_spikes.window, s.skip_spikes.min_history) == (32, 8)
  assert s.skip_spikes.max_consecutive == s.skip_nonfinite.max_consecutive == 4
  assert (s.qk_clip.enabled, s.qk_clip.tau) == (True, 50.0)
  assert (s.loss_scale.init, s.recovery.enabled, s.recovery.max_rollbacks, s.z_loss) == (
      256.0, True, 5, 0.0)
  # 0.1's ceiling applied without ZClip as a plain clip (its default 1.0 when not given).
  no_zclip = config_from_dict(translate_v0_1({"stability": {"zclip": False}})).stability
  assert (no_zclip.zclip.enabled, no_zclip.clip.enabled, no_zclip.clip.max_norm) == (
      False, True, 1.0)
  off = config_from_dict(translate_v0_1(
      {"stability": {"zclip": False, "max_grad_norm": None, "qk_clip_tau": None}})).stability
  assert not off.clip.enabled and not off.qk_clip.enabled


def test_the_default_config_file_is_the_dataclass_defaults() -> None:
  import dataclasses

  assert load_config("default") == Config() == load_config(None)
  assert dataclasses.asdict(Config().model)["qk_norm"] is True
  # The file itself is written by tools/generate.py (tests/test_generated.py checks it).


def test_a_wrong_type_names_the_expected_json_types() -> None:
  with pytest.raises(ConfigError, match=r"logging.sample_every=1.5 has the wrong type: expected "
                                        r"an integer or null"):
    _load("logging.sample_every=1.5")


@pytest.mark.parametrize("override,message", [
    ("train.seed=99999999999999999999", "train.seed=99999999999999999999 must be at most "
                                        "4294967295"),
    ("train.steps=99999999999999999999", "train.steps=99999999999999999999 must be at most "
                                         "2147483647"),
    ("optimizer.learning_rate=1" + "0" * 400, "is beyond every floating-point number"),
    ("optimizer.learning_rate=1e400", "optimizer.learning_rate=inf is not a finite number"),
    ("model.d_model=1" + "0" * 5000, "cannot be read: Exceeds the limit"),
])
def test_numbers_beyond_64_bits_or_every_float_are_one_line(override: str, message: str) -> None:
  with pytest.raises(ConfigError, match=message) as e:
    _load(override)
  assert "\n" not in str(e.value) and len(str(e.value)) < 300


# ----------------------------------------------------------------------------- model.family=X

SMALL_FAMILY = '''
import dataclasses
from stablejax.modeling.family import ModelFamily


@dataclasses.dataclass
class SmallSection:
  vocab_size: int = 512
  d_model: int = 48
  n_layers: int = 1
  max_seq_len: int = 256
  qk_norm: bool = False


SMALL = ModelFamily(name="small_defaults", config=SmallSection, build=lambda section, run: None)
'''


def test_a_family_switched_to_starts_from_its_own_defaults(tmp_path) -> None:
  import dataclasses
  import json
  from stablejax.modeling import family
  plugin = tmp_path / "small_defaults_family.py"
  plugin.write_text(SMALL_FAMILY)
  try:
    # The packaged default config restates GPT's defaults (qk_norm true, d_model 192, ...):
    # none of them reaches the family switched to.
    cfg = load_config("default", ["model.family=small_defaults"], plugins=[str(plugin)])
    declared = dataclasses.asdict(family.get("small_defaults").config())
    assert {k: v for k, v in dataclasses.asdict(cfg.model).items() if k != "family"} == declared
    assert cfg.model.qk_norm is False and cfg.model.d_model == 48
    # An explicit --set still overrides the family's default, whatever the order.
    cfg = load_config("default", ["model.qk_norm=true", "model.family=small_defaults"],
                      plugins=[str(plugin)])
    assert cfg.model.qk_norm is True and cfg.model.d_model == 48
  finally:
    family.unregister("small_defaults")
  # gpt -> llama: keys a file gives away from GPT's defaults are kept, restated ones dropped.
  path = tmp_path / "tiny.json"
  path.write_text(json.dumps({"model": {"family": "gpt", "d_model": 64, "n_heads": 2,
                                        "qk_norm": True, "norm": "rmsnorm"}}))
  cfg = load_config(path, ["model.family=llama"])
  assert (cfg.model.family, cfg.model.d_model, cfg.model.n_heads) == ("llama", 64, 2)
  # A key given away from GPT's default that llama lacks is refused, naming it.
  path.write_text(json.dumps({"model": {"d_model": 64, "norm": "layernorm"}}))
  with pytest.raises(ConfigError, match="model.norm=\"layernorm\" of the config file is not a "
                                        "key of model.family='llama'"):
    load_config(path, ["model.family=llama"])
