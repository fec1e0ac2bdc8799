"""A Mistral-style model family as a plugin: Llama (:mod:`stablejax.modeling.llama`) with
sliding-window attention (Jiang et al., `Mistral 7B <https://arxiv.org/abs/2310.06825>`_, arXiv
2310.06825, section 2): the query at position i attends to the keys at positions
``i - sliding_window .. i`` of the layer below, in training, in the attention-logit telemetry and
in the KV cache alike (the shared attention takes the pattern). The parameters are Llama's, same
names and shapes.

  python -m stablejax train --plugin tests/plugins/mistral.py --set model.family=mistral \\
      --set model.sliding_window=32
"""

import dataclasses
from typing import Any

from stablejax.modeling.attention import AttentionPattern
from stablejax.modeling.family import LanguageModel, ModelFamily
from stablejax.modeling.llama import LlamaConfig, LlamaModel


@dataclasses.dataclass
class MistralConfig(LlamaConfig):
  """``model.*`` of ``model.family="mistral"``: Llama's keys and the window."""

  sliding_window: int = 64   # earlier positions each query attends to (Mistral 7B: 4096)

  def validate(self) -> None:
    super().validate()
    if isinstance(self.sliding_window, bool) or not isinstance(self.sliding_window, int) \
        or self.sliding_window < 1:
      raise ValueError(f"model.sliding_window={self.sliding_window!r} must be a positive "
                       "integer (the earlier positions each query attends to)")


class MistralModel(LlamaModel):
  def describe(self) -> str:
    return super().describe().replace("Llama", "Mistral", 1) + \
        f", sliding window {self.config.sliding_window}"


def build(section: MistralConfig, run_config: Any) -> LanguageModel:
  # The window counts the query's own position too: sliding_window earlier keys and itself.
  pattern = AttentionPattern(window=section.sliding_window + 1)
  return MistralModel(section, run_config, pattern=pattern, family="mistral")


FAMILY = ModelFamily(name="mistral", config=MistralConfig, build=build,
                     label="Mistral-style: Llama with sliding-window attention")
