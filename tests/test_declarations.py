"""A new defence or model family is its module (and its test), nothing else: added to a copy of
the package with no other file touched, it has its config section, its place in the chain and
in the optimizer state, its rows in the generated config and docs, and the explicit registries
list it (registered by the registries themselves, not as a side effect of importing a
package)."""

import os
import shutil
import subprocess
import sys
import textwrap

from helpers import ROOT

DEFENCE_MODULE = '''
"""Halves every update (the example of docs/development.md)."""
import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from stablejax.transforms import defence, metrics


class HalveUpdatesState(NamedTuple):
  steps: jax.Array


def halve_updates() -> optax.GradientTransformation:
  def init(params):
    return HalveUpdatesState(jnp.zeros([], jnp.int32))

  def update(updates, state, params=None):
    return jax.tree.map(lambda u: u / 2, updates), HalveUpdatesState(state.steps + 1)
  return optax.GradientTransformation(init, update)


metrics.register_state_metrics(HalveUpdatesState, "halve_updates",
                               lambda s: {"steps": s.steps})


@dataclasses.dataclass
class HalveUpdatesConfig:
  enabled: bool = False


HALVE_UPDATES = defence.Defence(name="halve_updates", config=HalveUpdatesConfig,
                                position=defence.Position.UPDATE, factory=halve_updates,
                                label="halve every update")
'''

FAMILY_MODULE = '''
"""A bigram model: the next token from the current one alone."""
import dataclasses

import flax.linen as nn

from stablejax.modeling.family import LinenLanguageModel, ModelFamily


class Bigram(nn.Module):
  vocab_size: int

  @nn.compact
  def __call__(self, tokens):
    return nn.Embed(self.vocab_size, self.vocab_size, name="table")(tokens)


@dataclasses.dataclass
class BigramConfig:
  vocab_size: int = 256
  max_seq_len: int = 128


BIGRAM = ModelFamily(name="bigram", config=BigramConfig,
                     build=lambda c, run: LinenLanguageModel("bigram", c, Bigram(c.vocab_size)),
                     label="a bigram table")
'''

CHECK = '''
import jax, jax.numpy as jnp, sys
sys.path.insert(0, ".")
# Registered by the registries when first asked, not as a side effect of an import.
import stablejax.transforms.zclip, stablejax.modeling.gpt
from stablejax.transforms import defence
from stablejax.modeling import family
assert "zclip" not in defence._REGISTRY and "gpt" not in family._REGISTRY
from stablejax.training.config import load_config, model_of, to_dict
from stablejax.training.optim import build_optimizer
from tools import generate

cfg = load_config(None, ["stability.halve_updates.enabled=true", "model.family=bigram",
                         "optimizer.name=adamw", "optimizer.learning_rate=1e-3"])
assert to_dict(cfg)["stability"]["halve_updates"] == {"enabled": True}
model = model_of(cfg)
params = model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
assert model.logits(params, jnp.zeros((1, 4), jnp.int32), 0).shape == (1, 4, 256)
tx = build_optimizer(cfg)
state = tx.init(params)
assert "halve_updates" in state, sorted(state)
texts = {path.name: text for path, text in generate.generated().items()}
assert '"halve_updates": {' in texts["default.json"]
assert "| `stability.halve_updates` | no |" in texts["trainer.md"]
assert "| `bigram` |" in texts["trainer.md"]
print("ok")
'''


def test_a_new_defence_and_model_family_are_their_modules_alone(tmp_path):
  copy = tmp_path / "repo"
  ignore = shutil.ignore_patterns("__pycache__", "_build")
  for folder in ("stablejax", "tools", "docs"):
    shutil.copytree(ROOT / folder, copy / folder, ignore=ignore)
  (copy / "stablejax" / "transforms" / "halve_updates.py").write_text(DEFENCE_MODULE)
  (copy / "stablejax" / "modeling" / "bigram.py").write_text(FAMILY_MODULE)
  env = dict(os.environ, PYTHONPATH=str(copy))
  result = subprocess.run([sys.executable, "-c", textwrap.dedent(CHECK)], cwd=copy, env=env,
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
  # Nothing else of the copy names them: the two modules are the whole change.
  naming = sorted(str(p.relative_to(copy)) for p in copy.rglob("*.*") if p.is_file()
                  and ("halve_updates" in p.read_text(errors="ignore")
                       or "BigramConfig" in p.read_text(errors="ignore")))
  assert naming == ["stablejax/modeling/bigram.py", "stablejax/transforms/halve_updates.py"]
