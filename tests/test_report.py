"""Tests for stablejax.monitor.report: lenient metrics reading, the PNG, the summary and the CLI."""

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from helpers import unusable_path_cases
from stablejax.cli import report as report_cli
from stablejax.monitor import report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _write_run(run_dir, n_steps=300, every=5, truncate=True, muon=True):
  """A synthetic run: ZClip keys, a spike, a non-finite skip, a rollback, evals, update RMS."""
  rng = np.random.default_rng(0)
  lines = []
  spikes = clips = skips = 0
  steps = list(range(every, n_steps + 1, every))
  if n_steps >= 200:  # rollback at 200 to the checkpoint of step 150: steps 155..200 run again
    steps = [s for s in steps if s <= 200] + [s for s in steps if s > 150]
  checkpoint = None
  for i, step in enumerate(steps):
    if i and step < steps[i - 1]:
      spikes, clips, skips = checkpoint  # the optimizer state (and its counters) was restored
    rerun = i and step <= 200 and steps.index(step) != i
    loss = 5.0 * math.exp(-step / 150) + 1.0 + 0.02 * rng.standard_normal()
    g = 1.0 + 0.1 * rng.standard_normal()
    spike = step == 100
    skipped = step == 150 and not rerun
    if spike:
      g, spikes, clips = 12.0, spikes + 1, clips + 1
    if skipped:
      g, loss, skips = float("nan"), float("nan"), skips + 1
    rec = {
        "step": step, "loss": loss, "lr": 1e-3 * min(1.0, step / 50), "grad_norm": g,
        "tokens_per_sec": 1000.0, "zclip/grad_norm": g,
        "zclip/clipped_grad_norm": min(g, 2.0) if math.isfinite(g) else g,
        "zclip/threshold": 2.0, "zclip/ema_mean": 1.0, "zclip/ema_std": 0.1,
        "zclip/is_spike": spike, "zclip/was_clipped": spike,
        "zclip/spike_count": spikes, "zclip/clip_count": clips,
        "skip_nonfinite/skipped": skipped, "skip_nonfinite/total_skips": skips,
        "skip_nonfinite/consecutive_skips": int(skipped), "skip_nonfinite/needs_rollback": False,
        "some_future_key": [1, 2, 3],
    }
    if muon:
      rec.update({"muon/outlier_rate": 0.001, "muon/ns_instability_rate": 0.0,
                  "muon/fallback_rate": 0.0, "muon/outlier_count": 3 * step,
                  "muon/fallback_count": 0,
                  "muon/update_rms/muon": 0.2, "muon/update_rms/adam": 1e-3,
                  "muon/update_rms/embedding": 2e-3, "muon/update_rms/head": 1.5e-3})
    lines.append(json.dumps(rec))
    if step == 150:
      checkpoint = (spikes, clips, skips)
    if step % 50 == 0 and not rerun:
      val = loss + 0.1 if math.isfinite(loss) else 9.0
      lines.append(json.dumps({"step": step, "val_loss": val}))
    if step == 200 and not rerun:
      lines.append(json.dumps({"step": 200, "event": "rollback", "cause": "loss spike",
                               "to_step": 150}))
      lines.append(json.dumps({"step": 200, "event": "warning",
                               "cause": "gradient health critical"}))
  text = "\n".join(lines) + "\n"
  if truncate:
    text += '{"step": 305, "loss": 1.2, "grad_'  # a run killed mid-write
  (run_dir / "metrics.jsonl").write_text(text)
  return len(lines)


def test_read_metrics_tolerates_truncated_and_malformed_lines(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 1, "loss": 2.0}\nnot json\n["a list"]\n{"loss": 1}\n\n'
                  '{"step": 2, "loss": NaN, "x": {"nested": 1}}\n{"step": 3, "lo')
  records, bad = report.read_metrics(path)
  assert [r["step"] for r in records] == [1, 2]
  assert math.isnan(records[1]["loss"])
  assert bad == 4  # "not json", the list, the record without a step, the truncated line


def test_report_png_and_summary_on_truncated_run(tmp_path):
  n = _write_run(tmp_path)
  out, text = report.make_report(tmp_path)
  assert out == tmp_path / "report.png"
  data = out.read_bytes()
  assert data[:8] == PNG_SIGNATURE
  import matplotlib.image
  pixels = matplotlib.image.imread(out)
  assert pixels.ndim == 3 and min(pixels.shape[:2]) > 300 and pixels[..., :3].std() > 0.05  # drawn
  lines = text.splitlines()
  assert lines[2].startswith("skipped 1 unreadable line(s) (truncated or malformed")
  assert lines[lines.index("rollbacks: 1") + 1] == "  step 200: loss spike"
  assert ("skipped steps: 1 by the last logged counters; flagged at logged steps or skip events: "
          "150") in lines
  # the run's last records: train at step 300 (the truncated line at 305 is not one), val at 300
  last = [json.loads(s) for s in (tmp_path / "metrics.jsonl").read_text().splitlines()[:-1]]
  final_train = [r for r in last if "loss" in r][-1]
  assert f"final train loss: {final_train['loss']:.4g} at step 300" in lines
  assert any(line.startswith(f"final val loss: {last[-1]['val_loss']:.4g} at step 300; best ")
             for line in lines)
  assert lines[lines.index("logged warnings: 1") + 1] == "  step 200: gradient health critical"
  records, _ = report.read_metrics(tmp_path / "metrics.jsonl")
  assert len(records) == n


def test_analyse_replays_monitor_over_records(tmp_path):
  _write_run(tmp_path, truncate=False)
  records, _ = report.read_metrics(tmp_path / "metrics.jsonl")
  analysis = report.analyse(records, window=100)
  assert len(analysis["score"]) == len(analysis["train"]) == 70  # 60 + 10 re-run steps
  assert analysis["rollbacks"] == [(200, "loss spike")]
  assert analysis["skip_steps"] == [150]
  # the spike at step 100 was counted by difference of spike_count over the 5-step interval
  i100 = [r["step"] for r in analysis["train"]].index(100)
  assert analysis["rates"][i100]["zclip_spike_rate"] == pytest.approx(1 / 96)  # 1 + 19*5 steps
  levels = [line for _, line in analysis["monitor_warnings"] if "gradient health" in line]
  # the spike at step 100 (ZClip clipped it) and the non-finite step 150 (skipped) were over at
  # the next record: a handled excursion is no warning; the rollback's score drop is
  assert levels == []
  assert [line for _, line in analysis["monitor_warnings"]] == [
      "step 155: stability score 0.76 < target 0.80 (largest contribution: rollbacks 1)"]
  assert all(0.0 <= s <= 1.0 for s in analysis["score"])


def test_report_without_optional_keys(tmp_path):
  lines = [json.dumps({"step": s, "loss": 3.0 - 0.01 * s}) for s in range(1, 30)]
  (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
  out, text = report.make_report(tmp_path)
  assert out.read_bytes()[:8] == PNG_SIGNATURE
  assert "rollbacks: 0" in text


def test_main_exit_codes(tmp_path, capsys):
  assert report_cli.main([str(tmp_path / "nope")]) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("error:") and "does not exist" in err and "\n" not in err
  assert report_cli.main([str(tmp_path)]) == 2
  assert "not found" in capsys.readouterr().err
  (tmp_path / "metrics.jsonl").write_text("")
  assert report_cli.main([str(tmp_path)]) == 2
  assert "no readable records" in capsys.readouterr().err
  _write_run(tmp_path, n_steps=60, muon=False)
  out_png = tmp_path / "custom.png"
  assert report_cli.main([str(tmp_path), "--out", str(out_png)]) == 0
  assert out_png.read_bytes()[:8] == PNG_SIGNATURE
  assert "report written to" in capsys.readouterr().out


def test_module_entry_point(tmp_path):
  _write_run(tmp_path, n_steps=40)
  proc = subprocess.run([sys.executable, "-m", "stablejax", "report", str(tmp_path)],
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr
  assert (tmp_path / "report.png").read_bytes()[:8] == PNG_SIGNATURE
  assert "report written to" in proc.stdout


# ----------------------------------------------------------------------------- the printed events


def _summary(tmp_path, records, window=100):
  """The summary make_report prints for these records (read back from metrics.jsonl), without
  drawing its PNG: the tests above and the CLI's draw it."""
  path = tmp_path / "metrics.jsonl"
  path.write_text("\n".join(map(json.dumps, records)) + "\n")
  read, bad = report.read_metrics(path)
  return report.format_summary(report.analyse(read, window=window), bad_lines=bad).splitlines()


def _clean(steps):
  return [{"step": s, "loss": 3.0 - 0.001 * s, "grad_norm": 1.0} for s in steps]


def test_a_step_that_is_true_or_false_is_a_bad_line(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": true, "loss": 1.0}\n{"step": 4, "loss": 1.0}\n')
  records, bad = report.read_metrics(path)
  assert [r["step"] for r in records] == [4] and bad == 1


def test_skips_are_counted_from_both_wrappers_and_skip_events(tmp_path):
  records = _clean(range(1, 11))
  records[-1].update({"skip_nonfinite/total_skips": 2, "skip_spikes/total_skips": 3,
                      "skip_spikes/skipped": True})
  records.insert(4, {"step": 4, "event": "skip", "cause": "non-finite gradients"})
  lines = _summary(tmp_path, records)
  assert ("skipped steps: 5 by the last logged counters; flagged at logged steps or skip events: "
          "4, 10") in lines


def test_rollbacks_are_listed_and_lower_the_replayed_score(tmp_path):
  # One rollback in the window is the rollback budget (1 per window): score 0.8
  # (docs/monitoring.md).
  records = _clean(range(1, 201))
  records.insert(150, {"step": 150, "event": "rollback", "cause": "train loss diverged"})
  lines = _summary(tmp_path, records)
  assert lines[lines.index("rollbacks: 1") + 1] == "  step 150: train loss diverged"
  assert "stability score (last window): 0.800 (target 0.80)" in lines
  # With a 20-step window the rollback at 150 is out of the last window at step 200.
  lines = _summary(tmp_path, records, window=20)
  assert "stability score (last window): 1.000 (target 0.80)" in lines


def test_window_option_reaches_the_report(tmp_path, capsys):
  records = _clean(range(1, 201))
  records.insert(150, {"step": 150, "event": "rollback", "cause": "x"})
  (tmp_path / "metrics.jsonl").write_text("\n".join(map(json.dumps, records)) + "\n")
  assert report_cli.main([str(tmp_path), "--window", "20"]) == 0
  assert "stability score (last window): 1.000" in capsys.readouterr().out
  assert report_cli.main([str(tmp_path)]) == 0
  assert "stability score (last window): 0.800" in capsys.readouterr().out
  for bad in ("0", "-5"):
    assert report_cli.main([str(tmp_path), "--window", bad]) == 2
    assert capsys.readouterr().err.startswith("error: --window must be a positive")


def test_the_logged_score_wins_over_the_replayed_one(tmp_path):
  records = _clean(range(1, 11))
  records[-1]["stability_score"] = 0.42
  assert "stability score (last window): 0.420 (target 0.80)" in _summary(tmp_path, records)


def test_final_and_best_validation_loss(tmp_path):
  records = _clean(range(1, 31)) + [{"step": 10, "val_loss": 3.0}, {"step": 20, "val_loss": 2.0},
                                     {"step": 30, "val_loss": 2.5}]
  assert "final val loss: 2.5 at step 30; best 2 at step 20" in _summary(tmp_path, records)


def test_non_finite_losses_are_listed(tmp_path):
  records = _clean(range(1, 11))
  records[4]["loss"] = float("nan")
  records[6]["loss"] = float("inf")
  assert "non-finite loss at 2 logged step(s): 5, 7" in _summary(tmp_path, records)


def test_replayed_warnings_only_when_the_run_logged_none(tmp_path):
  records = _clean(range(1, 21))
  records[9]["grad_norm"] = 1e6  # exploded: the replayed monitor warns
  lines = _summary(tmp_path, records)
  assert "logged warnings: 0" in lines
  assert any(line.startswith("monitor warnings (replayed): ") for line in lines)
  records.append({"step": 20, "event": "warning", "cause": "step 10: gradient health exploded"})
  lines = _summary(tmp_path, records)
  assert lines[lines.index("logged warnings: 1") + 1] == "  step 10: gradient health exploded"
  assert not any(line.startswith("monitor warnings (replayed)") for line in lines)


def test_the_last_windows_rates_are_printed(tmp_path):
  records = _clean(range(1, 21))
  for r in records:
    r["skip_nonfinite/total_skips"] = r["step"] // 10  # one skip in steps 1..10, one in 11..20
  rates = [line for line in _summary(tmp_path, records) if line.startswith("rates (last window)")]
  assert len(rates) == 1 and "skip_rate" in rates[0]


def test_report_draws_attention_telemetry_and_replays_its_warning(tmp_path):
  recs = []
  for i, step in enumerate(range(10, 310, 10)):
    top = 20.0 * 1.3 ** i                            # x13.8 per 100 steps: the rule's trend
    recs.append({"step": step, "loss": 3.0, "grad_norm": 1.0, "attn_logit_max": top,
                 "attn_logit_max/layer_0": top, "attn_logit_max/layer_1": top / 3,
                 "qk_clip/max_logit": top * 1.1, "output_logit_max": 9.0,
                 "output_log_z_mean": 5.0, "output_log_z_max": 6.5})
  (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
  out, text = report.make_report(tmp_path)
  assert out.read_bytes()[:8] == PNG_SIGNATURE
  warned = [line for _, line in report.analyse(recs)["monitor_warnings"]
            if "attention logits growing" in line]
  assert warned and "layer_0" in warned[0]
  assert "attention logits growing" in text


# ----------------------------------------------------------------------------- what it writes


def _run_with_records(root):
  """A run directory with the trainer's records beside its metrics, and data outside it."""
  root.mkdir()
  _write_run(root, n_steps=60, truncate=False)
  corpus = root.parent / "corpus.txt"
  corpus.write_text("the run's training text\n")
  (root / "config.json").write_text(json.dumps({"data": {"train": str(corpus)}}))
  (root / "run.json").write_text('{"program": "stablejax train", "written": []}')
  (root / "checkpoints" / "40" / "state").mkdir(parents=True)
  (root / "checkpoints" / "40" / "state" / "_METADATA").write_text("{}")
  (root / "notes.png").write_bytes(PNG_SIGNATURE + b"the user's own picture")
  return corpus


def _snapshot(root):
  return {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _one_error(capsys) -> str:
  captured = capsys.readouterr()
  lines = captured.err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
  return lines[0]


def test_report_out_never_writes_the_runs_records_or_inputs(tmp_path, capsys):
  run = tmp_path / "run"
  corpus = _run_with_records(run)
  before, corpus_bytes = _snapshot(run), corpus.read_bytes()
  for target in ("metrics.jsonl", "run.json", "config.json", "checkpoints/40/state/_METADATA",
                 "checkpoints/new.png", "tensorboard/x.png"):
    for force in ([], ["--force"]):
      assert report_cli.main([str(run), "--out", str(run / target), *force]) == 2
      assert "the run's own" in _one_error(capsys)
  for force in ([], ["--force"]):
    assert report_cli.main([str(run), "--out", str(corpus), *force]) == 2
    assert "what report reads" in _one_error(capsys)
  assert _snapshot(run) == before and corpus.read_bytes() == corpus_bytes
  assert not any(p.name.endswith(".tmp") for p in run.rglob("*"))
  # A file of the user's is replaced only with --force; the report's own PNG is replaced again.
  assert report_cli.main([str(run), "--out", str(run / "notes.png")]) == 2
  assert "was not written by report: pass --force" in _one_error(capsys)
  assert report_cli.main([str(run), "--out", str(run / "notes.png"), "--force"]) == 0
  assert report_cli.main([str(run)]) == 0 and report_cli.main([str(run)]) == 0
  capsys.readouterr()
  from stablejax.training.run_folder.outputs import png_software
  assert png_software(run / "report.png") == "stablejax report"


def test_report_out_a_directory_a_missing_folder_or_a_read_only_run_is_one_line(tmp_path,
                                                                                 capsys):
  run = tmp_path / "run"
  run.mkdir()
  _write_run(run, n_steps=60, truncate=False)
  assert report_cli.main([str(run), "--out", str(run)]) == 2
  assert "is a directory" in _one_error(capsys)
  assert report_cli.main([str(run), "--out", str(tmp_path / "missing" / "r.png")]) == 2
  assert "does not exist" in _one_error(capsys)
  disk = tmp_path / "ro"
  disk.mkdir()
  if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)],
                    capture_output=True).returncode != 0:
    pytest.skip("needs a file system of its own (mount)")
  try:
    _write_run(disk, n_steps=60, truncate=False)
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    assert report_cli.main([str(disk)]) == 2
    line = _one_error(capsys)
  finally:
    subprocess.run(["umount", str(disk)], capture_output=True)
  assert "read-only" in line and "--out" in line, line


def test_report_out_never_replaces_a_device_or_another_runs_records(tmp_path, capsys):
  run = tmp_path / "run"
  run.mkdir()
  _write_run(run, n_steps=60, truncate=False)
  other = tmp_path / "other"
  _run_with_records(other)
  before = _snapshot(other)
  assert report_cli.main([str(run), "--out", "/dev/null", "--force"]) == 2
  assert "not a regular file" in _one_error(capsys)
  for target in ("metrics.jsonl", "run.json", "checkpoints/40/r.png"):
    assert report_cli.main([str(run), "--out", str(other / target), "--force"]) == 2
    assert "the run's own" in _one_error(capsys)
  assert _snapshot(other) == before


@pytest.mark.parametrize("args,line", unusable_path_cases("report.png", "r"))
def test_an_unusable_path_is_one_line_and_nothing_is_written(args, line, tmp_path, monkeypatch,
                                                             capsys):
  monkeypatch.chdir(tmp_path)
  _run_with_records(tmp_path / "run")
  (tmp_path / "loop").symlink_to("loop")  # a link to itself
  before = _snapshot(tmp_path / "run")
  assert report_cli.main(args) == 2
  assert _one_error(capsys).startswith(f"error: {line}")
  assert _snapshot(tmp_path / "run") == before  # (an empty --out was RUN/report.png)
