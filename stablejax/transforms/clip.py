"""Plain global-norm clipping (``optax.clip_by_global_norm``) as a trainer defence.

The library needs no transform of its own for it: optax's is the reference. This module declares
it for the trainer, ``stability.clip``, off by default because ZClip (on by default) clips to its
own ceiling, ``stability.zclip.max_grad_norm``. "Clip 1.0", the baseline of every stablejax
benchmark, is ``stability.clip.enabled=true`` with ZClip off.

References:
  Pascanu et al., `On the difficulty of training recurrent neural networks
  <https://arxiv.org/abs/1211.5063>`_ (arXiv:1211.5063).
"""

from __future__ import annotations

import dataclasses

import optax

from stablejax.transforms import defence


@dataclasses.dataclass
class ClipConfig:
  """``stability.clip``: ``optax.clip_by_global_norm(max_norm)`` on the gradient, first in the
  chain (before ZClip and AdaGC when they run too)."""

  enabled: bool = False
  max_norm: float = 1.0

  def validate(self, where: str, ctx: defence.DefenceContext) -> None:
    defence.check_positive(f"{where}.max_norm", self.max_norm)


CLIP = defence.Defence(
    name="clip", config=ClipConfig, position=defence.Position.GRADIENT, order=10,
    factory=optax.clip_by_global_norm, label="global-norm clip (optax.clip_by_global_norm)")
