"""The stability score and the troubleshooting table against docs/monitoring.md: the budgets and
limits are read from the guide's tables (and a few written out here), never from the code's."""

import math
import re
from pathlib import Path

import pytest

from stablejax import stability_score
from stablejax.monitor.score import troubleshooting_advice

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "monitoring.md"


def _guide_section(title: str) -> str:
  text = GUIDE.read_text()
  start = text.index(f"## {title}\n")
  end = text.find("\n## ", start + 1)
  return text[start:end if end > 0 else None]


def _budgets() -> dict[str, float]:
  """{key: budget} from the guide's stability-score table (| signal | `key` | budget |)."""
  rows = re.findall(r"^\|[^|]+\| `(\w+)` \| ([0-9.]+) \|$", _guide_section("Stability score"),
                    re.M)
  return {key: float(budget) for key, budget in rows}


def _limits() -> dict[str, float]:
  """{key: limit} from the guide's troubleshooting table (`key > limit`)."""
  rows = re.findall(r"`(\w+) > ([0-9.]+)`", _guide_section("Troubleshooting table"))
  return {key: float(limit) for key, limit in rows}


def test_the_guide_tables_are_read():
  assert _budgets() == {"zclip_spike_rate": 0.2, "muon_outlier_rate": 0.05,
                        "muon_ns_instability_rate": 0.05, "muon_fallback_rate": 0.01,
                        "skip_rate": 0.05, "rollbacks": 1.0}
  assert _limits() == {"zclip_spike_rate": 0.2, "muon_ns_instability_rate": 0.05,
                       "muon_outlier_rate": 0.05, "muon_fallback_rate": 0.01, "skip_rate": 0.05}


@pytest.mark.parametrize("key", sorted(_budgets()))
def test_each_signal_at_its_budget_gives_the_target(key):
  # score = clamp(1 - 0.2 * sum(r / b), 0, 1): one signal at its budget is exactly 0.8, at half
  # of it 0.9, at twice 0.6, and at six times the budget 0 (clamped).
  budget = _budgets()[key]
  assert stability_score({key: budget}) == pytest.approx(0.8)
  assert stability_score({key: budget / 2}) == pytest.approx(0.9)
  assert stability_score({key: 2 * budget}) == pytest.approx(0.6)
  assert stability_score({key: 6 * budget}) == 0.0


def test_rollbacks_count_one_per_window():
  # The guide: a rollback in the window is a budget's worth (1 per window) by itself.
  assert stability_score({"rollbacks": 1}) == pytest.approx(0.8)
  assert stability_score({"rollbacks": 2}) == pytest.approx(0.6)
  assert stability_score({"rollbacks": 1, "skip_rate": 0.05}) == pytest.approx(0.6)
  assert stability_score({"rollbacks": 0}) == 1.0


def test_signals_add_up_and_routine_clipping_is_not_scored():
  assert stability_score({"zclip_spike_rate": 0.1, "skip_rate": 0.025,
                          "muon_fallback_rate": 0.005}) == pytest.approx(0.7)
  # ZClip's warmup/ceiling clipping and AdaGC's clipped tensors are reported, not scored.
  assert stability_score({"zclip_clip_rate": 1.0, "adagc_clip_rate": 0.9}) == 1.0


def test_missing_nan_negative_and_infinite_rates():
  assert stability_score({}) == 1.0
  assert stability_score({"skip_rate": None, "muon_outlier_rate": -0.3}) == 1.0
  # A NaN rate counts as 0 and leaves the other signals' penalty alone.
  assert stability_score({"zclip_spike_rate": math.nan, "skip_rate": 0.05}) == pytest.approx(0.8)
  assert stability_score({"skip_rate": "NaN", "rollbacks": 1}) == pytest.approx(0.8)
  assert stability_score({"skip_rate": math.inf}) == 0.0
  assert stability_score({"skip_rate": 1.0, "rollbacks": 3}) == 0.0  # never below 0


@pytest.mark.parametrize("key", sorted(_limits()))
def test_a_row_fires_only_above_its_limit(key):
  limit = _limits()[key]
  assert troubleshooting_advice({key: limit}) == []
  (line,) = troubleshooting_advice({key: limit * 1.01})
  assert f"> {limit:g}" in line


def test_advice_rows_in_table_order_and_the_plateau_row():
  lines = troubleshooting_advice({"skip_rate": 0.5, "zclip_spike_rate": 0.5}, loss_plateau=True)
  assert len(lines) == 3
  assert lines[0].startswith("ZClip spike rate") and lines[1].startswith("skipped-step rate")
  assert "lengthen warmup" in lines[2]
  assert troubleshooting_advice({}, loss_plateau=False) == []
