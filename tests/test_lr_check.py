"""The learning-rate sanity check against the thresholds of its documentation: a Muon rate below
1e-3 or an AdamW rate above 3e-3 warns, both at once read as swapped; schedules by their peak."""

import optax
import pytest

from stablejax import check_learning_rates


@pytest.mark.parametrize("muon_lr,warns", [(1e-3, False), (9.9e-4, True), (5e-4, True),
                                           (2e-4, True), (0.02, False)])
def test_muon_rate_below_1e_3_warns(muon_lr, warns):
  messages = check_learning_rates(muon_lr=muon_lr)
  assert bool(messages) == warns, messages
  if warns:
    assert messages[0].startswith(f"Muon learning rate {muon_lr:g} is below 0.001")


@pytest.mark.parametrize("adam_lr,warns", [(3e-3, False), (3.1e-3, True), (1e-2, True),
                                           (2.9e-2, True), (3e-4, False)])
def test_adam_rate_above_3e_3_warns(adam_lr, warns):
  messages = check_learning_rates(adam_lr=adam_lr)
  assert bool(messages) == warns, messages
  if warns:
    assert messages[0].startswith(f"AdamW learning rate {adam_lr:g} is above 0.003")


def test_both_at_once_read_as_swapped():
  (message,) = check_learning_rates(muon_lr=3e-4, adam_lr=0.02)
  assert "look swapped" in message and "muon_lr=0.02, adam_lr=0.0003" in message


def test_named_optimizer_checks_its_own_rate():
  (message,) = check_learning_rates("muon", 5e-4)
  assert message.startswith("Muon learning rate 0.0005 is below")
  (message,) = check_learning_rates("adamw", 0.02)
  assert message.startswith("AdamW learning rate 0.02 is above")
  assert check_learning_rates("outlier_safe_muon", 0.02) == []


def test_schedules_are_judged_by_their_peak():
  # Warmups start at 0: the first value says nothing.
  muon = optax.warmup_cosine_decay_schedule(0.0, 0.02, warmup_steps=100, decay_steps=1000)
  adam = optax.warmup_cosine_decay_schedule(0.0, 0.01, warmup_steps=100, decay_steps=1000)
  assert check_learning_rates(muon_lr=muon) == []
  (message,) = check_learning_rates(adam_lr=adam)
  assert message.startswith("AdamW learning rate 0.01 is above")


def test_a_peak_at_any_step_up_to_4096_is_seen():
  # Above 3e-3 only at step 1001 (warmup end) and just after: 2.99e-3 at step 992, 0 from 1004.
  spike = optax.warmup_cosine_decay_schedule(0.0, 3.02e-3, warmup_steps=1001, decay_steps=1003,
                                             end_value=0.0)
  (message,) = check_learning_rates(adam_lr=spike)
  assert message.startswith("AdamW learning rate 0.00302 is above")


@pytest.mark.parametrize("key", ["muon_lr", "adam_lr", "embedding_lr", "head_lr"])
@pytest.mark.parametrize("value", [0.0, -1e-3, float("inf"), float("nan")])
def test_non_positive_or_non_finite_rates(key, value):
  name = {"muon_lr": "Muon", "adam_lr": "AdamW", "embedding_lr": "embedding",
          "head_lr": "head"}[key]
  messages = check_learning_rates(**{key: value})
  assert messages and messages[0].startswith(f"{name} learning rate {value:g} is not a positive")


def test_embedding_and_head_rates_may_be_high():
  assert check_learning_rates(embedding_lr=0.05, head_lr=0.02) == []


def test_warn_emits_each_message():
  with pytest.warns(UserWarning, match="look swapped"):
    check_learning_rates(muon_lr=3e-4, adam_lr=0.02, warn=True)
