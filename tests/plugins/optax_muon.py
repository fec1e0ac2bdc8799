"""A user's optimizer as one file: optax's own Muon (``optax.contrib.muon``), routed to the same
groups as stablejax's (Muon for the hidden matrices, Adam for embeddings, head, norms, biases).

    python -m stablejax train --plugin tests/plugins/optax_muon.py --set optimizer.name=optax_muon

The config class subclasses ``OptimizerConfig`` (every optimizer takes the shared keys, so a
switch between two keeps them), adds its own key, and owns its builder: ``learning_rates`` names
its groups' peak rates (each gets the run's warmup and decay, ``ctx.schedules``), ``group`` maps
the routing's labels to them, ``build`` returns the transform.
"""

import dataclasses

import optax

from stablejax.training.config.optimizers import Optimizer, OptimizerConfig, OptimizerContext


@dataclasses.dataclass
class OptaxMuonConfig(OptimizerConfig):
  name: str = "optax_muon"
  nesterov: bool = True     # its own key: optax's Nesterov momentum

  def learning_rates(self) -> dict[str, float]:
    adam = self.learning_rate if self.adam_learning_rate is None else self.adam_learning_rate
    return {"muon": self.learning_rate, "adam": adam}

  def group(self, label: str) -> str:
    return "muon" if label == "muon" else "adam"  # embedding and head train with Adam's rate

  def build(self, ctx: OptimizerContext) -> optax.GradientTransformation:
    return optax.contrib.muon(
        learning_rate=ctx.schedules["muon"], adam_learning_rate=ctx.schedules["adam"],
        ns_steps=self.ns_steps, beta=self.momentum, nesterov=self.nesterov,
        weight_decay=self.weight_decay, adam_b1=self.b1, adam_b2=self.b2,
        adam_weight_decay=self.adam_weight_decay, consistent_rms=self.consistent_rms,
        muon_weight_dimension_numbers=ctx.matrices)


OPTAX_MUON = Optimizer("optax_muon", OptaxMuonConfig, "optax.contrib.muon, routed like Muon")
