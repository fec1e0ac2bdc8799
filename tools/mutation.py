"""Mutation check: break each guarantee of the recovery, the checkpoints and the skip wrappers on
purpose and make sure the fast tests notice.

    python tools/mutation.py              # every mutant; prints killed/SURVIVED and the kill rate
    python tools/mutation.py --only R3 C9 # some of them
    python tools/mutation.py --check      # only check that every mutant applies to the source

Each mutant replaces one exact snippet of stablejax/training/recovery.py,
stablejax/training/checkpoint.py or stablejax/transforms/skipping.py (the snippet must occur once)
in a scratch copy of the repository, then runs the tests named for it there (`pytest -x`, with a
timeout; the copy is first on sys.path, so the tests import the mutated package). A mutant is
killed when those tests fail. The unmutated copy must pass the same tests first. Exit code: 0 when
every mutant is killed, 1 otherwise, 2 when a mutant does not apply or the baseline fails.

Not mutated: the fsyncs of write_json_atomic (only a power cut shows them) and the multi-process
agreement calls (one process cannot tell `agree_any(x)` from `x`; test_multiprocess runs them).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent

RECOVERY = "stablejax/training/recovery.py"
CHECKPOINT = "stablejax/training/checkpoint.py"
SKIPPING = "stablejax/transforms/skipping.py"

_CHECKPOINT_K = ("damaged or transient or another_model or infinities or at_most or "
                 "damage_evidence or write_json or fingerprint or leftover or keep_and_delete")
RECOVERY_TESTS = ("tests/test_recovery_policy.py", "-k", f"not ({_CHECKPOINT_K} or config_errors)")
CHECKPOINT_TESTS = ("tests/test_recovery_policy.py", "-k", _CHECKPOINT_K)
SKIPPING_TESTS = ("tests/test_skipping.py",)


class Mutant(NamedTuple):
  id: str
  path: str
  find: str
  replace: str
  what: str
  tests: tuple = ()


def _m(id, path, find, replace, what, tests=None):
  default = {RECOVERY: RECOVERY_TESTS, CHECKPOINT: CHECKPOINT_TESTS, SKIPPING: SKIPPING_TESTS}
  return Mutant(id, path, find, replace, what, tests or default[path])


MUTANTS = [
    # ---------------------------------------------------------------- recovery.py
    _m("R1", RECOVERY, "if count > self.acknowledged.get(key, 0):",
       "if count > self.acknowledged.get(key, 0) + 1:", "a first rollback request is missed"),
    _m("R2", RECOVERY, "if count > self.acknowledged.get(key, 0):", "if count > 0:",
       "requests the restored state already had trigger again"),
    _m("R3", RECOVERY, 'if not bool(record.get("params_finite", True)):', "if False:",
       "a non-finite parameter does not trigger"),
    _m("R4", RECOVERY, "return not math.isfinite(loss) or loss > ",
       "return loss > ", "a non-finite loss is not elevated"),
    _m("R5", RECOVERY, "or loss > self.cfg.loss_explosion_factor * self.best_loss_median",
       "or loss >= self.cfg.loss_explosion_factor * self.best_loss_median",
       "a loss exactly at the line counts as elevated"),
    _m("R6", RECOVERY, "    else:\n      self.elevated_run = 0\n      self.recent.append(loss)",
       "    else:\n      self.recent.append(loss)",
       "a normal loss does not reset the run of elevated losses"),
    _m("R7", RECOVERY, "if self.elevated_run >= self.window:",
       "if self.elevated_run > self.window:",
       "divergence triggers one logged loss late"),
    _m("R8", RECOVERY, "if self.elevated_run >= self.window:",
       "if self.elevated_run >= self.window - 1:",
       "divergence triggers one logged loss early (a recovering bump rolls back)"),
    _m("R9", RECOVERY, "      self.elevated_run += 1\n",
       "      self.elevated_run += 1\n      self.recent.append(loss)\n",
       "elevated losses enter the window of the best median"),
    _m("R10", RECOVERY,
       "self.best_loss_median = min(self.best_loss_median, statistics.median(self.recent))",
       "self.best_loss_median = statistics.median(self.recent)",
       "the line follows the latest median instead of the best"),
    _m("R11", RECOVERY, '      return "validation loss is non-finite"', "      return None",
       "a non-finite validation loss does not trigger"),
    _m("R12", RECOVERY, "    return self.elevated_run == 0", "    return True",
       "an elevated state counts as healthy (would be saved as a rollback target)"),
    _m("R13", RECOVERY, "if self.events and self.events[-1].restored_step == newest:", "if False:",
       "a repeated failure retries the same checkpoint instead of going further back"),
    _m("R14", RECOVERY, "        return max(older)", "        return min(older)",
       "going further back jumps to the oldest checkpoint"),
    _m("R15", RECOVERY, "    self.acknowledge(restored_metrics)\n", "",
       "a rollback does not take the restored state's requests as handled"),
    _m("R16", RECOVERY,
       "    self.recent.clear()  # the window described the abandoned trajectory\n", "",
       "the loss window of the abandoned trajectory is kept after a rollback"),
    _m("R17", RECOVERY, '            "events": [dataclasses.asdict(e) for e in self.events]}',
       '            "events": []}', "rollback events are not saved (lost on resume)"),
    _m("R18", RECOVERY, 'self.best_loss_median = float(d.get("best_loss_median", math.inf))',
       "self.best_loss_median = math.inf", "the best median is not restored on resume"),
    _m("R19", RECOVERY, "return optax.linear_schedule(backoff.scale, 1.0, recovery_steps)(count)",
       "return optax.linear_schedule(backoff.scale, 1.0, 2 * recovery_steps)(count)",
       "the LR scale returns to 1.0 over the wrong number of steps"),
    _m("R20", RECOVERY,
       "jnp.exp(optax.linear_schedule(jnp.log(backoff.scale), 0.0, recovery_steps)(count))",
       "optax.linear_schedule(backoff.scale, 1.0, recovery_steps)(count)",
       "the geometric schedule is linear"),
    _m("R21", RECOVERY, "  if recovery_steps is None:\n    return backoff.scale",
       "  if recovery_steps is None:\n    return jnp.ones_like(backoff.scale)",
       "lr_recovery_steps=null drops the backoff instead of keeping it"),
    _m("R22", RECOVERY, "return self.rollbacks < self.cfg.max_rollbacks",
       "return self.rollbacks <= self.cfg.max_rollbacks", "one rollback more than max_rollbacks"),
    _m("R23", RECOVERY, 'if k.endswith("/rollback_requests")}', 'if k.endswith("/total_skips")}',
       "skipped steps are read as rollback requests"),
    _m("R24", RECOVERY, "    self.elevated_run = 0\n\n  def state_dict", "\n  def state_dict",
       "the elevated run of the abandoned trajectory survives a rollback"),

    # ---------------------------------------------------------------- checkpoint.py
    _m("C1", CHECKPOINT, "    if isinstance(error, CheckpointDamaged):\n      return text",
       "    if isinstance(error, CheckpointDamaged):\n      return None",
       "a fingerprint mismatch is not damage"),
    _m("C2", CHECKPOINT, '      return f"missing file: {text}"', "      return None",
       "a missing file is not damage"),
    _m("C3", CHECKPOINT, '      return f"corrupt metadata file: {type(error).__name__}: {text}"',
       "      return None", "an undecodable metadata file is not damage"),
    _m("C4", CHECKPOINT, '      return f"missing item: {text}"', "      return None",
       "a missing checkpoint item is not damage"),
    _m("C5", CHECKPOINT, '_DAMAGE_STATUS = ("NOT_FOUND:", "OUT_OF_RANGE:", "DATA_LOSS:")',
       '_DAMAGE_STATUS = ("NOT_FOUND:", "DATA_LOSS:")', "a truncated file is not damage"),
    _m("C6", CHECKPOINT, "any(phrase in text for phrase in _DECODE_FAILURES)",
       "False", "bytes that do not decode are not damage"),
    _m("C7", CHECKPOINT, "    error = error.__cause__\n  return None",
       "    error = None\n  return None",
       "damage reported as the cause of a wrapping error is not seen"),
    _m("C8", CHECKPOINT, 'if type(error) is ValueError and', "if isinstance(error, Exception) and",
       "any error type with a damage-like message counts as damage"),
    _m("C9", CHECKPOINT,
       "  not_finite = sum((jnp.sum(~jnp.isfinite(x)).astype(jnp.float32) for x in leaves), "
       "jnp.float32(0))",
       "  not_finite = jnp.float32(0)", "the fingerprint does not count non-finite entries"),
    _m("C10", CHECKPOINT, "abs(a - e) > 1e-4 * max(1.0, abs(e))",
       "abs(a - e) > 1e-1 * max(1.0, abs(e))",
       "the fingerprint tolerance lets real damage through"),
    _m("C11", CHECKPOINT, "  if len(expected) != len(actual):\n    return False\n", "",
       "a checkpoint without a fingerprint passes"),
    _m("C12", CHECKPOINT, "if not (math.isfinite(a) and math.isfinite(e)) or ", "if ",
       "a non-finite fingerprint passes"),
    _m("C13", CHECKPOINT, "if distributed.agree_any(error is not None and why is None):",
       "if False:", "a read error that proves nothing falls through instead of stopping"),
    _m("C14", CHECKPOINT, "      for bad in damaged:\n        self._set_aside(bad)\n", "",
       "damaged checkpoints stay where Orbax finds them"),
    _m("C15", CHECKPOINT, "      shutil.move(str(source), str(target))",
       "      shutil.rmtree(source)",
       "damaged checkpoints are deleted instead of set aside"),
    _m("C16", CHECKPOINT, "    raise CheckpointError(\n        f\"all {len(steps)} checkpoints",
       "    return None\n    raise CheckpointError(\n        f\"all {len(steps)} checkpoints",
       "every checkpoint damaged silently starts over"),
    _m("C17", CHECKPOINT, "if at_most is None or s <= at_most]",
       "if at_most is None or s < at_most]",
       "restore(at_most=N) skips checkpoint N"),
    _m("C18", CHECKPOINT, "    for step in reversed(steps):", "    for step in steps:",
       "restore starts from the oldest checkpoint"),
    _m("C19", CHECKPOINT, "      if s > step:\n        self.manager.delete(s)",
       "      if s >= step:\n        self.manager.delete(s)",
       "deleting the abandoned branch deletes the restored checkpoint too"),
    _m("C20", CHECKPOINT, '  tmp = path.with_name(f".{path.name}.tmp")', "  tmp = path",
       "the decision file is overwritten in place (a crash leaves it half written)"),
    _m("C21", CHECKPOINT, "  if not path.exists():\n    return None",
       "  if not path.exists():\n    return {}",
       "an absent decision file reads as an empty decision"),
    _m("C22", CHECKPOINT, "  except (OSError, ValueError) as e:\n    raise CheckpointError(",
       "  except (OSError, ValueError) as e:\n    return None\n    raise CheckpointError(",
       "an unreadable decision file is silently ignored"),
    _m("C23", CHECKPOINT, "fingerprint=[float(v) for v in np.asarray(fingerprint(state))])",
       "fingerprint=[0.0, 0.0, 0.0])", "the saved fingerprint does not describe the state"),
    _m("C24", CHECKPOINT, "        cleanup_tmp_directories=True,",
       "        cleanup_tmp_directories=False,",
       "leftovers of a killed save are not cleaned up"),
    _m("C25", CHECKPOINT, "        max_to_keep=keep,", "        max_to_keep=None,",
       "checkpoint.keep is not applied"),
    _m("C26", CHECKPOINT, "  total = sum((jnp.sum(x) for x in finite), jnp.float32(0))",
       "  total = jnp.float32(0)", "the fingerprint ignores the sum of the entries"),

    # ---------------------------------------------------------------- skipping.py
    _m("S1", SKIPPING, "      ok = jnp.logical_and(ok, _loss_all_finite(loss))", "      pass",
       "skip_nonfinite ignores a non-finite loss"),
    _m("S2", SKIPPING, "    ok = jnp.logical_and(ok, _common.all_finite(inner_updates))\n", "",
       "skip_nonfinite lets a non-finite inner update through"),
    _m("S3", SKIPPING, "inner_state = _common.select_tree(skip, inner_old_state, inner_new_state)",
       "inner_state = inner_new_state", "a skipped step still changes the inner state"),
    _m("S4", SKIPPING, "lambda u: jnp.where(skip, jnp.zeros_like(u), u), inner_updates)",
       "lambda u: jnp.where(skip, 0.5 * u, u), inner_updates)",
       "a skipped step still applies updates"),
    _m("S5", SKIPPING, "  total = jnp.where(skip, _common.safe_increment(state.total_skips),",
       "  total = jnp.where(False, _common.safe_increment(state.total_skips),",
       "skips are not counted"),
    _m("S6", SKIPPING, "                          jnp.zeros([], jnp.int32))",
       "                          state.consecutive_skips)",
       "a good step does not reset the consecutive count"),
    _m("S7", SKIPPING, "    rollback = consecutive >= limit", "    rollback = consecutive > limit",
       "needs_rollback is raised one skip late"),
    _m("S8", SKIPPING, "    requests = jnp.where(consecutive == limit,",
       "    requests = jnp.where(consecutive >= limit,",
       "a long run of skips counts many rollback requests"),
    _m("S9", SKIPPING, "  active = count >= jnp.asarray(min_history, jnp.int32)",
       "  active = count > jnp.asarray(min_history, jnp.int32)", "skipping starts one value late"),
    _m("S10", SKIPPING, "  outlier = jnp.logical_and(active, value > threshold)",
       "  outlier = jnp.logical_and(active, value >= threshold)",
       "a value at the threshold is skipped"),
    _m("S11", SKIPPING,
       "  entry = value if olmo else jnp.where(active, jnp.minimum(value, threshold),",
       "  entry = value if olmo else jnp.where(active, value,",
       "winsorizing does not clip the outlier"),
    _m("S12", SKIPPING, "  new_history = jnp.where(finite, history.at[nxt].set(entry), history)",
       "  new_history = history.at[nxt].set(entry)", "a non-finite value enters the window"),
    _m("S13", SKIPPING, "mean, std = window_stats(history, count, ddof=1 if olmo else 0)",
       "mean, std = window_stats(history, count, ddof=0)",
       "olmo_core statistics use the biased std"),
    _m("S14", SKIPPING, "    threshold = jnp.minimum(threshold, _common.f32(factor) * mean)",
       "    threshold = jnp.minimum(threshold, 2 * _common.f32(factor) * mean)",
       "the factor rule is off"),
    _m("S15", SKIPPING, "    threshold = jnp.minimum(threshold, mean + _common.f32(sigma) * std)",
       "    threshold = jnp.minimum(threshold, mean + 2 * _common.f32(sigma) * std)",
       "the sigma rule is off"),
    _m("S16", SKIPPING, "  bad = jnp.logical_or(~finite, outlier)", "  bad = outlier",
       "a non-finite watched value is not skipped"),
    _m("S17", SKIPPING, "  new_count = jnp.where(finite, jnp.minimum(count + 1, window), count)",
       "  new_count = jnp.where(finite, count + 1, count)",
       "the window count grows past the window"),
    _m("S18", SKIPPING, "  new_next = jnp.where(finite, (nxt + 1) % window, nxt)",
       "  new_next = jnp.where(finite, jnp.minimum(nxt + 1, window - 1), nxt)",
       "the ring buffer stops wrapping (the window freezes)"),
    _m("S19", SKIPPING, '    if "grad_norm" in watch:\n      bad, norm_hist',
       '    if False:\n      bad, norm_hist', "the gradient norm is not watched"),
    _m("S20", SKIPPING, '    if "loss" in watch:\n      loss = extra_args.get("loss")',
       '    if "loss" in watch and False:\n      loss = extra_args.get("loss")',
       "the loss is not watched"),
    _m("S21", SKIPPING, "  n = jnp.maximum(count, 1).astype(_common.STAT_DTYPE)",
       "  n = jnp.asarray(history.shape[0], _common.STAT_DTYPE)",
       "the mean of a partly filled window counts empty slots"),
]

COPIED = ("stablejax", "tests", "train.py", "configs", "pyproject.toml", "README.md", "examples",
          "bench")


def apply(source: str, mutant: Mutant) -> str:
  count = source.count(mutant.find)
  if count != 1:
    raise ValueError(f"mutant {mutant.id}: its snippet occurs {count} times in {mutant.path} "
                     f"(must be once): {mutant.find!r}")
  return source.replace(mutant.find, mutant.replace)


def check(mutants=MUTANTS) -> list[str]:
  """Problems: snippets not occurring exactly once, duplicate ids, mutants that change nothing."""
  problems, seen = [], set()
  for m in mutants:
    if m.id in seen:
      problems.append(f"duplicate mutant id {m.id}")
    seen.add(m.id)
    if m.find == m.replace:
      problems.append(f"mutant {m.id} changes nothing")
    try:
      apply((ROOT / m.path).read_text(), m)
    except ValueError as e:
      problems.append(str(e))
  return problems


def _pytest(copy: Path, tests: tuple, timeout: float) -> tuple[str, float]:
  env = dict(os.environ, PYTHONPATH=str(copy), PYTHONDONTWRITEBYTECODE="1")
  t0 = time.monotonic()
  try:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                           "-p", "no:randomly", *tests], cwd=copy, env=env, capture_output=True,
                          text=True, timeout=timeout)
  except subprocess.TimeoutExpired:
    return "timeout", time.monotonic() - t0
  # 0: all passed; 1: a test failed; anything else (collection error, interrupted) also counts
  # as a failure of the suite, but is reported apart.
  status = {0: "passed", 1: "failed"}.get(proc.returncode, f"error {proc.returncode}")
  return status, time.monotonic() - t0


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--only", nargs="*", help="mutant ids to run")
  parser.add_argument("--check", action="store_true", help="only check the mutants apply")
  parser.add_argument("--timeout", type=float, default=900, help="seconds per mutant")
  args = parser.parse_args(argv)
  problems = check()
  if problems:
    for p in problems:
      print(f"error: {p}", file=sys.stderr)
    return 2
  mutants = [m for m in MUTANTS if not args.only or m.id in args.only]
  if args.check:
    print(f"{len(mutants)} mutants apply cleanly")
    return 0
  with tempfile.TemporaryDirectory(prefix="stablejax-mutation-") as tmp:
    copy = Path(tmp) / "repo"
    copy.mkdir()
    for name in COPIED:
      src = ROOT / name
      if src.is_dir():
        shutil.copytree(src, copy / name, ignore=shutil.ignore_patterns("__pycache__"))
      elif src.exists():
        shutil.copy2(src, copy / name)
    probe = subprocess.run([sys.executable, "-c", "import stablejax; print(stablejax.__file__)"],
                           cwd=copy, env=dict(os.environ, PYTHONPATH=str(copy)),
                           capture_output=True, text=True, timeout=120)
    if not probe.stdout.strip().startswith(str(copy)):
      print(f"error: the copy's stablejax is not the one imported ({probe.stdout.strip()})",
            file=sys.stderr)
      return 2
    groups = sorted({m.tests for m in mutants})
    for tests in groups:  # the unmutated code passes every selection used
      status, seconds = _pytest(copy, tests, args.timeout)
      print(f"baseline {' '.join(tests)[:70]}: {status} ({seconds:.0f}s)", flush=True)
      if status != "passed":
        print("error: the unmutated code fails these tests; fix that first", file=sys.stderr)
        return 2
    killed = 0
    for m in mutants:
      target = copy / m.path
      original = target.read_text()
      target.write_text(apply(original, m))
      try:
        status, seconds = _pytest(copy, m.tests, args.timeout)
      finally:
        target.write_text(original)
      ok = status != "passed"
      killed += ok
      print(f"{m.id:4} {'killed' if ok else 'SURVIVED':8} {status:9} {seconds:5.0f}s  "
            f"{m.path.rsplit('/', 1)[1]}: {m.what}", flush=True)
  print(f"kill rate: {killed}/{len(mutants)} = {killed / len(mutants):.0%}")
  return 0 if killed == len(mutants) else 1


if __name__ == "__main__":
  sys.exit(main())
