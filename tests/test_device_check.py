"""bench/device_check.py: the dry run CI does (the whole script at tiny shapes), its helpers and
its errors."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from bench import device_check


def test_dry_run_writes_every_section(tmp_path, capsys):
  # In this process: the script's entry point is main(); a process of its own would import the
  # stack and start the backend again for nothing the check reads.
  out = tmp_path / "check.json"
  code = device_check.main(["--dry", "--out", str(out)])
  printed = capsys.readouterr()
  assert code == 0, printed.out[-3000:] + printed.err[-3000:]
  result = json.loads(out.read_text())
  assert result["mode"] == "dry" and result["errors"] == []
  assert result["platform"] == "cpu" and result["peak_source"].startswith("measured")
  ns = result["newton_schulz"]
  # A bfloat16 matrix and a float32 stack, and a Gram row where Gram runs (fewer FLOPs: the 2:1
  # matrix), timed against the standard one
  assert [(r["method"], r["shape"], r["dtype"]) for r in ns] == [
      ("standard", "64x128", "bfloat16"), ("standard", "2x64x64", "float32"),
      ("gram", "64x128", "bfloat16")]
  standard = {(r["shape"], r["dtype"]): r["kernel_ms"] for r in ns if r["method"] == "standard"}
  for r in ns:
    assert r["vs_standard"] == pytest.approx(r["kernel_ms"] / standard[r["shape"], r["dtype"]])
  for r in ns:
    # interpret mode runs the kernel's own tiling in the same arithmetic as the reference
    assert r["kernel"] == "interpret" and r["ok"], r
    assert r["max_rel_diff"] <= (1e-5 if r["dtype"] == "float32" else 0.05), r
    assert r["kernel_ms"] > 0 and r["reference_ms"] > 0
  train = result["train_step"]
  assert [r["stack"] for r in train["rows"]] == ["full", "clip_adamw", "peer"]
  tokens = 2 * 16  # --dry: batch 2 x 16 tokens
  rows = {r["stack"]: r for r in train["rows"]}
  for r in train["rows"]:
    assert r["tokens_per_s"] == pytest.approx(tokens / (r["ms_per_step"] / 1e3), rel=1e-6)
    assert r["mfu"] == pytest.approx(
        r["model_flops_per_token"] * r["tokens_per_s"] / result["peak_flops"], rel=1e-6)
    assert r["tokens_per_s_vs_peer"] == pytest.approx(
        r["tokens_per_s"] / rows["peer"]["tokens_per_s"], rel=1e-6)
    assert r["planned_bytes"] > 0
  assert rows["full"]["model_flops_per_token"] == train["model_flops_per_token"]
  assert [r["variant"] for r in result["qk_clip_telemetry"]["rows"]] == [
      "plain", "qk_clip", "telemetry"]
  assert result["qk_clip_telemetry"]["rows"][0]["ratio_to_plain"] == 1.0
  for header in ("Newton-Schulz, Pallas kernel vs XLA reference", "vs clip+AdamW", "vs peer",
                 "vs plain"):
    assert header in printed.out


def test_ns_flops_counts_the_three_products_of_each_iteration():
  # [768, 3072]: A = X X^T (2 n^2 m), A A (2 n^3), B X (2 n^2 m), five times; a stack counts each
  n, m = 768, 3072
  assert device_check.ns_flops((n, m)) == 5 * (2 * n * n * m + 2 * n**3 + 2 * n * n * m)
  assert device_check.ns_flops((m, n)) == device_check.ns_flops((n, m))  # a tall one transposes
  assert device_check.ns_flops((12, 768, 768)) == 12 * device_check.ns_flops((768, 768))
  # Gram, float32 (no restart): n^2 m for R_0 and for Q X, 17 n^3 products (multiply-adds)
  assert device_check.ns_flops((n, m), method="gram") == 2 * (2 * n * n * m + 17 * n**3)
  assert device_check.gram_runs((n, m), "bfloat16") and not device_check.gram_runs((n, n),
                                                                                    "float32")


@pytest.mark.parametrize("kind, tflops", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H200", 989.0),
    ("NVIDIA A100-SXM4-40GB", 312.0), ("TPU v5 lite", 197.0), ("TPU v5", 459.0),
    ("TPU v4", 275.0)])
def test_peak_comes_from_the_device_kind(monkeypatch, kind, tflops):
  monkeypatch.setattr(device_check.jax, "devices",
                      lambda: [SimpleNamespace(device_kind=kind, platform="gpu")])
  peak, source = device_check.peak_flops(None)
  assert peak == tflops * 1e12 and source.startswith("table")
  assert device_check.peak_flops(500.0) == (500e12, "--peak-tflops")


def test_unknown_accelerator_needs_a_peak(monkeypatch):
  monkeypatch.setattr(device_check.jax, "devices",
                      lambda: [SimpleNamespace(device_kind="NVIDIA Future 9000", platform="gpu",
                                               client=SimpleNamespace(platform_version="cuda"))])
  with pytest.raises(SystemExit, match="--peak-tflops"):
    device_check.peak_flops(None)


def test_bad_arguments_are_one_line_errors(tmp_path, capsys):
  assert device_check.main(["--sections", "newton_schulz,bogus", "--out",
                            str(tmp_path / "x.json")]) == 2
  assert capsys.readouterr().err.startswith("error: unknown section")
  assert device_check.main(["--out", str(tmp_path)]) == 2
  assert "is a directory" in capsys.readouterr().err
  assert not (tmp_path / "x.json").exists()


def test_time_per_call_is_the_median_of_means(monkeypatch):
  clock = iter([0.0, 1.0, 10.0, 13.0, 20.0, 22.0])  # rounds of 1, 3 and 2 s for 2 calls each
  monkeypatch.setattr(device_check.time, "perf_counter", lambda: next(clock))
  calls = []
  assert device_check.time_per_call(lambda: calls.append(1), calls=2, repeats=3) == 1.0
  assert len(calls) == 1 + 3 * 2  # a warm-up call, then 2 per round
