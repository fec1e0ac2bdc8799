"""Learning-rate sanity check: catches a Muon rate and an AdamW rate set for the wrong optimizer.

Muon's orthogonalised update has a fixed RMS set by its shape scaling, so its learning rate lives
in a different range from AdamW's: about 0.02 with Jordan's ``sqrt(max(1, fan_out / fan_in))``
scaling (modded-nanogpt), and about 1e-3 to 1e-2 with the Moonlight ``0.2 * sqrt(max(A, B))``
scaling (arXiv 2502.16982, which matches AdamW's RMS). AdamW for LLM pre-training uses about
3e-4 to 3e-3. A Muon rate below 1e-3 or an AdamW rate above 3e-3 usually means the two were
swapped or copied from the other optimizer's recipe.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Optional

import jax
import numpy as np
import optax

MUON_MIN_LR = 1e-3
ADAM_MAX_LR = 3e-3
# Schedules are probed at every step up to 4096 (warmups end exactly there) and geometrically
# beyond, up to 10 million steps.
_PROBES = np.unique(np.concatenate([np.arange(4097),
                                    np.geomspace(4096, 1e7, 256).astype(np.int64)]))

_MUON_NAMES = ("muon", "outlier_safe_muon")
_ADAM_NAMES = ("adam", "adamw")


def schedule_values(schedule: optax.Schedule) -> np.ndarray:
  """Values of an optax schedule at every step up to 4096 and geometrically up to 1e7."""
  try:
    # One compiled program for all probes: evaluated eagerly, each of the schedule's operations
    # is a program of its own to compile (or load from the compilation cache) at every start.
    values = np.asarray(jax.jit(schedule)(_PROBES.astype(np.int32)), np.float64)
    if values.shape == _PROBES.shape:
      return values
  except (TypeError, ValueError):  # a schedule that does not take an array of steps
    pass
  return np.array([float(np.asarray(schedule(int(step)))) for step in _PROBES[::16]])


def _peak(lr: Any) -> Optional[float]:
  """Peak value of a float or an optax schedule."""
  if lr is None:
    return None
  if callable(lr):
    return float(np.max(schedule_values(lr)))
  return float(lr)


def _muon_suggestion(consistent_rms: Optional[float]) -> str:
  if consistent_rms is None:
    return "Muon with consistent_rms=None usually runs at about 0.02"
  return f"Muon with consistent_rms={consistent_rms} usually runs at about 2e-3 to 1e-2"


def check_learning_rates(optimizer: Optional[str] = None,
                         learning_rate: Optional[optax.ScalarOrSchedule] = None, *,
                         muon_lr: Optional[optax.ScalarOrSchedule] = None,
                         adam_lr: Optional[optax.ScalarOrSchedule] = None,
                         embedding_lr: Optional[optax.ScalarOrSchedule] = None,
                         head_lr: Optional[optax.ScalarOrSchedule] = None,
                         consistent_rms: Optional[float] = 0.2,
                         warn: bool = False) -> list[str]:
  """Warnings for learning rates that look set for the other optimizer.

  Either name the optimizer and give its ``learning_rate`` (``"adamw"``/``"adam"`` or
  ``"muon"``/``"outlier_safe_muon"``; for Muon ``learning_rate`` is the Muon rate), or pass the
  rates by keyword. Schedules are judged by their peak (every step up to 4096, then geometrically).

  Rules: a Muon rate below 1e-3 (looks like an AdamW rate), an AdamW rate above 3e-3 (looks like
  a Muon rate), both at once (probably swapped), and any non-positive or non-finite rate.
  Embedding and head rates are only checked for being positive and finite, since AdamW on
  embeddings often runs far above 3e-3 on purpose.

  Args:
    optimizer: optional optimizer name, see above.
    learning_rate: the rate of ``optimizer`` (float or schedule).
    muon_lr: Muon rate.
    adam_lr: AdamW rate (norms, biases; or the only rate of an AdamW run).
    embedding_lr: AdamW rate for embeddings.
    head_lr: AdamW rate for the output head.
    consistent_rms: the Muon shape scaling in use (changes only the suggested values).
    warn: also emit each message with ``warnings.warn``.

  Returns:
    A list of human-readable warning strings (empty when everything looks plausible).

  Example:
    >>> from stablejax import check_learning_rates
    >>> check_learning_rates(muon_lr=3e-4, adam_lr=0.02)[0][:40]
    'Muon learning rate 0.0003 and AdamW lear'
  """
  if optimizer is not None:
    name = optimizer.lower()
    if name in _MUON_NAMES:
      muon_lr = learning_rate if muon_lr is None else muon_lr
    elif name in _ADAM_NAMES:
      adam_lr = learning_rate if adam_lr is None else adam_lr
    else:
      raise ValueError(f"unknown optimizer {optimizer!r}; use one of {_MUON_NAMES + _ADAM_NAMES} "
                       "or pass muon_lr=/adam_lr=")
  elif learning_rate is not None:
    raise ValueError("learning_rate needs optimizer='muon' or 'adamw'; or pass muon_lr=/adam_lr=")

  rates = {"Muon": _peak(muon_lr), "AdamW": _peak(adam_lr), "embedding": _peak(embedding_lr),
           "head": _peak(head_lr)}
  messages = []
  for what, value in rates.items():
    if value is not None and (not math.isfinite(value) or value <= 0):
      messages.append(f"{what} learning rate {value:g} is not a positive finite number")
  muon, adam = rates["Muon"], rates["AdamW"]
  muon_low = muon is not None and 0 < muon < MUON_MIN_LR
  adam_high = adam is not None and math.isfinite(adam) and adam > ADAM_MAX_LR
  if muon_low and adam_high:
    messages.append(
        f"Muon learning rate {muon:g} and AdamW learning rate {adam:g} look swapped: Muon is "
        f"below {MUON_MIN_LR:g} and AdamW above {ADAM_MAX_LR:g}; did you mean muon_lr={adam:g}, "
        f"adam_lr={muon:g}? ({_muon_suggestion(consistent_rms)}; AdamW about 3e-4 to 3e-3)")
  elif muon_low:
    messages.append(
        f"Muon learning rate {muon:g} is below {MUON_MIN_LR:g}, which looks like an AdamW rate; "
        f"{_muon_suggestion(consistent_rms)}")
  elif adam_high:
    messages.append(
        f"AdamW learning rate {adam:g} is above {ADAM_MAX_LR:g}, which looks like a Muon rate; "
        "AdamW usually runs at about 3e-4 to 3e-3")
  if warn:
    for message in messages:
      warnings.warn(message, stacklevel=2)
  return messages
