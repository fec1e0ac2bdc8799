"""Mutation check: break the documented promises of the package on purpose, one line at a time,
and make sure the fast tests of each area notice.

    python tools/mutation.py                     # every mutant; a kill rate per module and in all
    python tools/mutation.py --module zclip adagc  # the mutants of some modules
    python tools/mutation.py --only R3 C9        # some mutants
    python tools/mutation.py --list              # the mutants, what each breaks, no run
    python tools/mutation.py --check             # only check that every mutant applies

Each mutant replaces one exact snippet of one module of stablejax/ (the snippet must occur once)
in a scratch copy of the repository, then runs the tests named for it there (`pytest -x`, with a
timeout; the copy is first on sys.path, so the tests import the mutated package; a module path
in the selection runs its doctests). A mutant is killed when those tests fail. The unmutated copy
must pass every selection used first. Mutants are chosen from the docstrings and docs/*.md (a
comparison flipped, a bound dropped, an axis changed, a state not kept, an argument not passed
on), grouped by module.

An equivalent mutant (one that cannot change behaviour) stays in the list with the reason: it is
run, expected to survive, and counted in the kill rate's denominator. Exit code: 0 when every
other mutant is killed (and every equivalent one survives), 1 otherwise, 2 when a mutant does not
apply or the baseline fails.

Not mutated: the fsyncs of write_json_atomic (only a power cut shows them); the agreement calls
inside checkpoint.py (one process cannot tell `agree_any(x)` from `x`; the collective itself is
mutated in distributed.py, where tests/test_distributed.py runs it across two processes); the
modules of MODULES_NOT_COVERED, each with the reason.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent

RECOVERY = "stablejax/training/recovery/policy.py"
CHECKPOINT = "stablejax/training/checkpoint.py"
SKIPPING = "stablejax/transforms/skipping.py"
FINITE_SKIP = "stablejax/transforms/finite_skip.py"
SPIKE_SKIP = "stablejax/transforms/spike_skip.py"
ZCLIP = "stablejax/transforms/zclip.py"
ADAGC = "stablejax/transforms/adagc.py"
HYBRID = "stablejax/transforms/hybrid.py"
LOSS_SCALING = "stablejax/transforms/loss_scaling.py"
STACKED = "stablejax/transforms/stacked.py"
COMMON = "stablejax/transforms/_common.py"
METRICS = "stablejax/transforms/metrics.py"
LOSSES = "stablejax/modeling/losses.py"
MODEL_UTILS = "stablejax/modeling/utils.py"
SCORE = "stablejax/monitor/score.py"
MOVEMENT = "stablejax/monitor/movement.py"
LAYERS = "stablejax/monitor/layers.py"
MONITOR_REPORT = "stablejax/monitor/report.py"
CLI_REPORT = "stablejax/cli/report.py"
LR_CHECK = "stablejax/muon/lr_check.py"
NEWTON_SCHULZ = "stablejax/muon/newton_schulz.py"
PREPARE = "stablejax/data/prepare.py"
PREPARED = "stablejax/data/prepared.py"
ENCODE = "stablejax/data/encode.py"
INPUTS = "stablejax/data/inputs.py"
OUT_DIR = "stablejax/data/out_dir.py"
TOKENIZER = "stablejax/data/tokenizer.py"
SOURCES = "stablejax/data/sources.py"
PIPELINE = "stablejax/data/pipeline.py"
IDENTITY = "stablejax/data/identity.py"
FOLDER = "stablejax/data/folder.py"
DISTRIBUTED = "stablejax/training/launch/distributed.py"
MESH = "stablejax/training/launch/mesh.py"
LAUNCH = "stablejax/training/launch/launcher.py"
MUON = "stablejax/muon/muon.py"
OUTLIERS = "stablejax/muon/outliers.py"
DIRECTION = "stablejax/muon/direction.py"
NONFINITE_TENSORS = "stablejax/transforms/nonfinite_tensors.py"
BUDGET = "stablejax/training/loop/budget.py"
CONFIG = "stablejax/training/config/checks.py"
OPTIM = "stablejax/training/optim.py"
OPTIMIZERS = "stablejax/training/config/optimizers.py"
STEP = "stablejax/training/loop/step.py"
COMPONENTS = "stablejax/training/loop/components.py"
DECODING = "stablejax/training/trained/decoding.py"
LOOP = "stablejax/training/loop/trainer.py"
BATCHES = "stablejax/training/loop/batches.py"
ACTIONS = "stablejax/training/loop/actions.py"
HEALTH = "stablejax/monitor/health.py"
STABILITY_MONITOR = "stablejax/monitor/stability_monitor.py"
ROUTING = "stablejax/muon/routing.py"
LABELS = "stablejax/muon/labels.py"
MATRICES = "stablejax/muon/matrices.py"
NOTES = "stablejax/muon/notes.py"
LAYOUT = "stablejax/layout/analysis.py"
LEAVES = "stablejax/layout/leaves.py"
NAMES = "stablejax/layout/names.py"
ORIENTATION = "stablejax/layout/orientation.py"
ATTENTION = "stablejax/layout/attention.py"
QK_CLIP = "stablejax/transforms/qk_clip.py"
CLIP = "stablejax/transforms/clip.py"
SPECS = "stablejax/monitor/specs.py"
DEFENCE = "stablejax/transforms/defence.py"
RESTORE_PLAN = "stablejax/training/recovery/restore_plan.py"
UPDATE_CLIP = "stablejax/transforms/update_clip.py"
COMPENSATED = "stablejax/transforms/compensated.py"
HYPERBALL = "stablejax/transforms/hyperball.py"
UPDATE_NORM = "stablejax/monitor/update_norm.py"
GRAM = "stablejax/muon/gram.py"
NORMUON = "stablejax/muon/normuon.py"
HEADS = "stablejax/layout/heads.py"
RUN_DIR_CHECKS = "stablejax/training/run_folder/checks.py"
PREVIOUS_RUN = "stablejax/training/run_folder/previous.py"
ENVIRONMENT_ERRORS = "stablejax/training/run_folder/environment_errors.py"

_CHECKPOINT_K = ("damaged or transient or another_model or infinities or at_most or "
                 "damage_evidence or write_json or fingerprint or leftover or keep_and_delete")
RECOVERY_TESTS = ("tests/test_recovery_policy.py", "-k", f"not ({_CHECKPOINT_K} or config_errors)")
CHECKPOINT_TESTS = ("tests/test_recovery_policy.py", "-k", _CHECKPOINT_K)
# python -m stablejax prepare without its end-to-end runs and its stop-signal processes.
_PREPARE_TESTS = ("tests/test_prepare.py", "-k", "not end_to_end and not stop_signals")
# A prepared directory as build_data reads it (tests/test_prepare.py writes them).
_PREPARED_TESTS = ("tests/test_prepare.py", "tests/test_data.py", "-k",
                   "config_takes_vocab or large_vocabulary or uint16_holds or incomplete or "
                   "bin_source or data_errors")

# The routing of the model layouts the tests write (without the learning-rate check's runs).
_LAYOUT_TESTS = ("tests/test_routing.py", "tests/test_model_layouts.py", "-k",
                 "not check_learning_rates and not describe_routing_finds")

# The fast tests of each module's area (a mutant may name its own, smaller selection).
AREA_TESTS: dict[str, tuple[str, ...]] = {
    RECOVERY: RECOVERY_TESTS,
    CHECKPOINT: CHECKPOINT_TESTS,
    SKIPPING: ("tests/test_skipping.py",),
    FINITE_SKIP: ("tests/test_skipping.py",),
    SPIKE_SKIP: ("tests/test_skipping.py",),
    ZCLIP: ("tests/test_zclip.py", ZCLIP),
    ADAGC: ("tests/test_adagc.py", ADAGC, "-k", "not hybrid_clip_forwards"),
    HYBRID: ("tests/test_adagc.py", HYBRID, "-k", "hybrid"),
    LOSS_SCALING: ("tests/test_loss_scaling.py", LOSS_SCALING),
    STACKED: ("tests/test_adagc.py", "tests/test_layers.py", STACKED, "-k",
              "stacked or per_layer or stacked_component"),
    COMMON: ("tests/test_zclip.py", "tests/test_common.py", COMMON),
    METRICS: ("tests/test_metrics.py", METRICS),
    LOSSES: ("tests/test_losses.py", LOSSES),
    MODEL_UTILS: ("tests/test_model_utils.py", MODEL_UTILS, "-k", "not kurtosis"),
    SCORE: ("tests/test_score.py", SCORE),
    MOVEMENT: ("tests/test_movement.py", MOVEMENT),
    LAYERS: ("tests/test_layers.py", LAYERS),
    MONITOR_REPORT: ("tests/test_report.py", MONITOR_REPORT, "-k", "not module_entry_point"),
    CLI_REPORT: ("tests/test_report.py", CLI_REPORT, "-k", "main or exit or window"),
    LR_CHECK: ("tests/test_lr_check.py", LR_CHECK),
    NEWTON_SCHULZ: ("tests/test_newton_schulz.py", NEWTON_SCHULZ, "-k",
                    "not export and not kernel_interpret and not public_pallas"),
    PREPARE: _PREPARE_TESTS,
    PREPARED: _PREPARE_TESTS,
    ENCODE: _PREPARE_TESTS,
    INPUTS: _PREPARE_TESTS,
    OUT_DIR: _PREPARE_TESTS,
    TOKENIZER: ("tests/test_prepare.py", "tests/test_tokenizer.py", "-k",
                "tokenizer or round_trip or endoftext or eot"),
    SOURCES: ("tests/test_data.py", "-k", "not resume_at_every_batch"),
    PIPELINE: ("tests/test_data.py", "-k", "not resume_at_every_batch"),
    IDENTITY: ("tests/test_data.py", "-k", "data_identity"),
    FOLDER: ("tests/test_folder.py", FOLDER),

    DISTRIBUTED: ("tests/test_distributed.py", DISTRIBUTED),
    MESH: ("tests/test_mesh.py",),
    # test_multiprocess.py without its trainer runs (minutes each): the launcher's own tests.
    LAUNCH: ("tests/test_launch.py", "tests/test_multiprocess.py", "-k",
             "not (one_device or sigterm_kill or sighup or disjoint or join or announced)"),
    MUON: ("tests/test_muon.py", "-k", "not (export or pallas or converges or flax_attention)"),
    OUTLIERS: ("tests/test_muon.py", "-k", "outlier"),
    DIRECTION: ("tests/test_muon.py", "-k",
                "not (export or pallas or converges or flax_attention)"),
    NONFINITE_TENSORS: ("tests/test_muon.py", "-k", "nonfinite"),
    # Without the trainer runs (@slow, minutes each): the budget's own logic.
    BUDGET: ("tests/test_budget.py", "-m", "not slow"),
    CONFIG: ("tests/test_config.py", "tests/test_optim.py", "-k", "config or ineffective"),
    OPTIM: ("tests/test_optim.py", "-m", "not slow"),
    OPTIMIZERS: ("tests/test_optim.py", "-m", "not slow"),
    STEP: ("tests/test_train_step.py", "tests/test_optim.py", "-k",
           "micro_batches or fp16 or logged_lr_is or update_norms"),
    DECODING: ("tests/test_sample.py", "-k", "not cli and not carries"),
    # What the programs are built from and which are shared, and the step's batch; the tiny
    # config's programs, no trainer run.
    COMPONENTS: ("tests/test_loop_decisions.py", "tests/test_train_step.py", "tests/test_optim.py",
                 "-k", "update_norms or reuses_its_jitted or host_only or has_no_length"),
    # The loop's decisions on a bare Run (its trainer runs take minutes each).
    BATCHES: ("tests/test_loop_decisions.py",),
    ACTIONS: ("tests/test_loop_decisions.py",),
    HEALTH: ("tests/test_monitor.py", "-k", "health or level or exploded"),
    STABILITY_MONITOR: ("tests/test_monitor.py", "-k", "not movement and not tensorboard"),
    ROUTING: ("tests/test_routing.py", "tests/test_model_layouts.py", "-k",
              "not check_learning_rates and not describe_routing_finds"),
    LABELS: ("tests/test_routing.py", "tests/test_model_layouts.py", "-k",
             "not check_learning_rates and not describe_routing_finds"),
    MATRICES: ("tests/test_routing.py", "tests/test_model_layouts.py", "-k",
               "not check_learning_rates and not describe_routing_finds"),
    NOTES: ("tests/test_routing.py", "tests/test_model_layouts.py", "-k",
            "not check_learning_rates and not describe_routing_finds"),
    LAYOUT: _LAYOUT_TESTS,
    LEAVES: _LAYOUT_TESTS,
    NAMES: _LAYOUT_TESTS,
    ORIENTATION: _LAYOUT_TESTS,
    ATTENTION: ("tests/test_heads.py", "tests/test_per_head.py", "-k", "not hugging_face"),
    QK_CLIP: ("tests/test_qk_clip.py", QK_CLIP),
    CLIP: ("tests/test_optim.py", "tests/test_config.py", "-m", "not slow"),
    UPDATE_CLIP: ("tests/test_update_clip.py", UPDATE_CLIP),
    COMPENSATED: ("tests/test_compensated.py", COMPENSATED),
    HYPERBALL: ("tests/test_hyperball.py", HYPERBALL),
    SPECS: ("tests/test_loop_decisions.py", "tests/test_recovery_policy.py", SPECS),
    DEFENCE: ("tests/test_optim.py", "tests/test_adding_a_defence.py", DEFENCE, "-m", "not slow"),
    RESTORE_PLAN: ("tests/test_stack_changes.py", "tests/test_recovery_policy.py", RESTORE_PLAN,
                   "-m", "not slow"),
    UPDATE_NORM: ("tests/test_early_warnings.py", UPDATE_NORM, "-k", "not log_norm"),
    GRAM: ("tests/test_newton_schulz.py", GRAM, "-k", "gram and not kernels_interpret"),
    NORMUON: ("tests/test_normuon.py", NORMUON),
    HEADS: ("tests/test_per_head.py", "-k", "not hugging_face"),
    # The run directory's checks on folders the tests write, without the trainer runs (@slow)
    # and the session's trained run (the fingerprint mutant names its test).
    RUN_DIR_CHECKS: ("tests/test_run_dir.py", RUN_DIR_CHECKS, "-m", "not slow", "-k",
                     "not (step_copied or previous_release or another_tokenizer)"),
    PREVIOUS_RUN: ("tests/test_run_dir.py", PREVIOUS_RUN, "-k", "fresh or previous_run"),
    ENVIRONMENT_ERRORS: ("tests/test_run_dir.py", ENVIRONMENT_ERRORS, "-k", "environment"),
}

# Modules of stablejax/ without mutants, and why.
MODULES_NOT_COVERED = {
    "muon/describe.py, modeling/attention.py, layout/heads.py: find_attention_layers": "not "
        "yet: the layout analysis under it is mutated in layout/ (leaves, names, orientation, "
        "attention, analysis; heads.py's per-head layouts are)",
    "monitor/tensorboard.py, modeling/gpt.py, runs.py, sampling.py, cli/sample.py":
        "not yet: their tests are end-to-end runs (tests/test_sample.py, tests/test_trainer.py) "
        "that take minutes per mutant",
    "training/loop.py, rollback.py, run_summary.py": "their promises are kept by "
        "trainer runs (tests/test_trainer.py, test_recovery.py, test_run_dir.py: minutes per "
        "mutant); the loop's decisions are mutated where they live (training/batches.py, "
        "training/actions.py, and components.py's step batch and program memo)",
    "training/run_dir.py, run_record.py, data_order.py": "not yet: what RunDirectory decides "
        "is mutated where it lives (training/run_dir_checks.py, training/previous_run.py); its "
        "record, the names it lists and the data order are read back by resumes "
        "(tests/test_run_dir.py, most of them trainer runs)",
    "transforms/metrics.py: QK-clip entry": "comes with the QK-clip transform",
    "monitor/attention_rule.py": "not yet: moved out of the monitor unchanged; its tests are "
        "tests/test_monitor.py's and tests/test_early_warnings.py's attention cases",
    "data/workers.py, data/tokenizer_choice.py, data/config.py": "not yet (they had no "
        "mutants inside data/prepare.py either): the pool's task order is checked by "
        "tests/test_prepare.py's two-worker test and its stopping by the stop-signal test "
        "(processes, tens of seconds per mutant); config.py holds the settings' dataclasses and "
        "one check of data.train's entries",
    "cli/_process.py": "not yet: its tests start the programs (tests/test_signals.py, a second "
        "or two each); the launcher's use of it is mutated in training/launch.py (LA12)",
}


class Mutant(NamedTuple):
  id: str
  path: str
  find: str
  replace: str
  what: str
  tests: tuple = ()
  equivalent: str = ""  # why it cannot change behaviour; empty for a mutant that must be killed

  @property
  def module(self) -> str:
    """``transforms/zclip`` for ``stablejax/transforms/zclip.py``."""
    return self.path.removeprefix("stablejax/").removesuffix(".py")


def _muon_tests(k: str) -> tuple[str, ...]:
  """tests/test_muon.py is minutes long on 2 cores: each Muon mutant runs the tests of its part."""
  return ("tests/test_muon.py", "-k", k)


def _m(id: str, path: str, find: str, replace: str, what: str,
       tests: Optional[tuple[str, ...]] = None, equivalent: str = "") -> Mutant:
  return Mutant(id, path, find, replace, what, tuple(tests or AREA_TESTS[path]), equivalent)


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
    _m("R16", RECOVERY, "    self.acknowledge(restored_metrics)\n    self.recent.clear()\n",
       "    self.acknowledge(restored_metrics)\n",
       "the loss window of the abandoned trajectory is kept after a rollback or a replay"),
    _m("R17", RECOVERY, '            "events": [dataclasses.asdict(e) for e in self.events],',
       '            "events": [],', "rollback events are not saved (lost on resume)"),
    _m("R18", RECOVERY, 'self.best_loss_median = float(d.get("best_loss_median", math.inf))',
       "self.best_loss_median = math.inf", "the best median is not restored on resume"),
    _m("R19", RECOVERY, "optax.linear_schedule(backoff.scale, 1.0, recovery_steps)(count)",
       "optax.linear_schedule(backoff.scale, 1.0, 2 * recovery_steps)(count)",
       "the LR scale returns to 1.0 over the wrong number of steps"),
    _m("R20", RECOVERY,
       "jnp.exp(optax.linear_schedule(jnp.log(backoff.scale), 0.0, recovery_steps)(count))",
       "optax.linear_schedule(backoff.scale, 1.0, recovery_steps)(count)",
       "the geometric schedule is linear"),
    _m("R21", RECOVERY, "  if recovery_steps is None:\n    configured = backoff.scale",
       "  if recovery_steps is None:\n    configured = jnp.ones_like(backoff.scale)",
       "lr_recovery_steps=null drops the backoff instead of keeping it"),
    _m("R22", RECOVERY, "return self.rollbacks < self.cfg.max_rollbacks",
       "return self.rollbacks <= self.cfg.max_rollbacks", "one rollback more than max_rollbacks"),
    _m("R23", SPECS, 'for key in counter_keys(record, "rollback")}',
       'for key in counter_keys(record, "skips")}', "skipped steps are read as rollback requests",
       RECOVERY_TESTS),
    _m("R24", RECOVERY, "    self.recent.clear()\n    self.elevated_run = 0\n",
       "    self.recent.clear()\n",
       "the elevated run of the abandoned trajectory survives a rollback or a replay"),

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
    _m("C6", CHECKPOINT, "any(phrase in text for phrase in _DECODE_FAILURES)", "False",
       "bytes that do not decode are not damage"),
    _m("C7", CHECKPOINT, "    error = error.__cause__\n  return None",
       "    error = None\n  return None",
       "damage reported as the cause of a wrapping error is not seen"),
    _m("C8", CHECKPOINT, 'if type(error) is ValueError and', "if isinstance(error, Exception) and",
       "any error type with a damage-like message counts as damage"),
    _m("C9", CHECKPOINT, "                           jnp.sum(~finite).astype(jnp.float32)]))",
       "                           jnp.float32(0)]))",
       "the fingerprint does not count non-finite entries"),
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
    _m("C23", CHECKPOINT, "    meta = dict(meta, step=int(step), fingerprints=parts,",
       "    meta = dict(meta, step=int(step), fingerprints={k: [0.0] * 3 for k in parts},",
       "the saved fingerprints do not describe the state"),
    _m("C24", CHECKPOINT, "        cleanup_tmp_directories=True,",
       "        cleanup_tmp_directories=False,",
       "leftovers of a killed save are not cleaned up"),
    _m("C25", CHECKPOINT, "        max_to_keep=keep,", "        max_to_keep=None,",
       "checkpoint.keep is not applied"),
    _m("C26", CHECKPOINT, "    rows.append(jnp.stack([jnp.sum(kept), ",
       "    rows.append(jnp.stack([jnp.float32(0), ",
       "the fingerprint ignores the sum of the entries"),
    _m("C28", CHECKPOINT, "                   float(np.sum(~finite))])", "                   0.0])",
       "the fingerprint of a checkpoint read as numpy does not count non-finite entries"),
    _m("C29", CHECKPOINT, "      host.append([np.sum(kept, dtype=np.float64), ",
       "      host.append([0.0, ",
       "the fingerprint of a checkpoint read as numpy ignores the sum of the entries"),
    _m("C30", CHECKPOINT, "  rows[order] = sums", "  rows[:] = sums",
       "the leaves' fingerprints are given to the parts in the program's order, not the tree's"),

    # ---------------------------------------------------------------- skipping.py, finite_skip.py,
    # spike_skip.py
    _m("S1", FINITE_SKIP, "      ok = jnp.logical_and(ok, _loss_all_finite(loss))", "      pass",
       "skip_nonfinite ignores a non-finite loss"),
    _m("S2", FINITE_SKIP, "    ok = _common.all_finite_pairs(updates, inner_updates)\n",
       "    ok = _common.all_finite(updates)\n",
       "skip_nonfinite lets a non-finite inner update through"),
    _m("S3", SKIPPING, "    return jax.tree.map(jnp.zeros_like, updates), old\n",
       "    return jax.tree.map(jnp.zeros_like, updates), new\n",
       "a skipped step still changes the inner state"),
    _m("S4", SKIPPING, "    return jax.tree.map(jnp.zeros_like, updates), old\n",
       "    return jax.tree.map(lambda u: 0.5 * u, updates), old\n",
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
    _m("S9", SPIKE_SKIP, "  active = count >= jnp.asarray(min_history, jnp.int32)",
       "  active = count > jnp.asarray(min_history, jnp.int32)", "skipping starts one value late"),
    _m("S10", SPIKE_SKIP, "  outlier = jnp.logical_and(active, value > threshold)",
       "  outlier = jnp.logical_and(active, value >= threshold)",
       "a value at the threshold is skipped"),
    _m("S11", SPIKE_SKIP,
       "  entry = value if olmo else jnp.where(active, jnp.minimum(value, threshold),",
       "  entry = value if olmo else jnp.where(active, value,",
       "winsorizing does not clip the outlier"),
    _m("S12", SPIKE_SKIP, "  new_history = jnp.where(finite, history.at[nxt].set(entry), history)",
       "  new_history = history.at[nxt].set(entry)", "a non-finite value enters the window"),
    _m("S13", SPIKE_SKIP, "mean, std = window_stats(history, count, ddof=1 if olmo else 0)",
       "mean, std = window_stats(history, count, ddof=0)",
       "olmo_core statistics use the biased std"),
    _m("S14", SPIKE_SKIP, "    threshold = jnp.minimum(threshold, _common.f32(factor) * mean)",
       "    threshold = jnp.minimum(threshold, 2 * _common.f32(factor) * mean)",
       "the factor rule is off"),
    _m("S15", SPIKE_SKIP, "    threshold = jnp.minimum(threshold, mean + _common.f32(sigma) * std)",
       "    threshold = jnp.minimum(threshold, mean + 2 * _common.f32(sigma) * std)",
       "the sigma rule is off"),
    _m("S16", SPIKE_SKIP, "  bad = jnp.logical_or(~finite, outlier)", "  bad = outlier",
       "a non-finite watched value is not skipped"),
    _m("S17", SPIKE_SKIP, "  new_count = jnp.where(finite, jnp.minimum(count + 1, window), count)",
       "  new_count = jnp.where(finite, count + 1, count)",
       "the window count grows past the window"),
    _m("S18", SPIKE_SKIP, "  new_next = jnp.where(finite, (nxt + 1) % window, nxt)",
       "  new_next = jnp.where(finite, jnp.minimum(nxt + 1, window - 1), nxt)",
       "the ring buffer stops wrapping (the window freezes)"),
    _m("S19", SPIKE_SKIP, '  if "grad_norm" in watch:\n    bad, norm_hist',
       '  if False:\n    bad, norm_hist', "the gradient norm is not watched"),
    _m("S20", SPIKE_SKIP,
       '  if "loss" in watch and not (loss is None and loss_optional):',
       '  if "loss" in watch and False:',
       "the loss is not watched"),
    _m("S21", SPIKE_SKIP, "  n = jnp.maximum(count, 1).astype(_common.STAT_DTYPE)",
       "  n = jnp.asarray(history.shape[0], _common.STAT_DTYPE)",
       "the mean of a partly filled window counts empty slots"),
    _m("S22", SPIKE_SKIP, "      min_history = max(20, window // 2) - 1",
       "      min_history = max(20, window // 2)",
       "statistics='olmo_core' starts skipping one value late (63 at window 128)"),
    _m("S23", SPIKE_SKIP, "      min_history = max(1, window // 2)",
       "      min_history = max(1, window // 2) + 1",
       "the winsorized window starts skipping one value late (64 at window 128)"),
    _m("S24", SPIKE_SKIP, "entry = value if olmo else",
       "entry = jnp.minimum(value, threshold) if olmo else",
       "statistics='olmo_core' winsorizes (its values must enter raw)"),
    _m("S25", SPIKE_SKIP, "    loss = jnp.mean(_common.f32(loss))",
       "    loss = jnp.max(_common.f32(loss))", "a non-scalar loss is not averaged"),
    _m("S26", SKIPPING, "    rollback = jnp.array(False)", "    rollback = consecutive >= 1",
       "max_consecutive=None still raises needs_rollback"),
    _m("S27", FINITE_SKIP, "    ok = _common.all_finite_pairs(updates, inner_updates)\n",
       "    ok = _common.all_finite(inner_updates)\n",
       "skip_nonfinite does not look at the gradients (only at what the inner transform made "
       "of them)"),
    _m("S28", SPIKE_SKIP,
       "  loss_optional = watch is None  # the default: the loss when update() is given one",
       "  loss_optional = False",
       "the default watch=None needs loss= (TrainState.apply_gradients fails at its first step)",
       ("tests/test_skipping.py", "-k", "default_watches")),

    # ---------------------------------------------------------------- zclip.py
    _m("Z1", ZCLIP, "    warm_scale = jnp.minimum(1.0, ceiling / (g + _NORM_EPS))",
       "    warm_scale = jnp.ones([], _common.STAT_DTYPE)",
       "warmup steps are not clipped to max_grad_norm"),
    _m("Z2", ZCLIP, "in_warmup = state.count < jnp.asarray(warmup_steps, jnp.int32)",
       "in_warmup = state.count <= jnp.asarray(warmup_steps, jnp.int32)",
       "the warmup lasts one step too long"),
    _m("Z3", ZCLIP, "  warm_var = var + ((g - mean) * (g - warm_mean) - var) / n_new",
       "  warm_var = var + ((g - mean) * (g - warm_mean) - var) / jnp.maximum(n_new - 1, 1)",
       "the warmup variance is not the population variance of the warmup norms"),
    _m("Z4", ZCLIP, "  z = (g - mean) / (std + eps)",
       "  z = (g - mean) / (jnp.square(std) + eps)", "the z-score divides by the variance"),
    _m("Z5", ZCLIP, "    spike = z > zt", "    spike = z >= zt",
       "a z-score exactly at z_thresh is a spike"),
    _m("Z6", ZCLIP, "      clip_value = (mean + zt * std / (z / zt)) * cf",
       "      clip_value = (mean + zt * std) * cf",
       "adaptive_scaling clips to mean + z_thresh * std (drops the z_thresh / z factor)"),
    _m("Z7", ZCLIP, "      clip_value = (mean + zt * std / (z / zt)) * cf",
       "      clip_value = (mean + zt * std / (z / zt))", "clip_factor is ignored"),
    _m("Z8", ZCLIP, "      clip_value = mean\n", "      clip_value = mean + zt * std\n",
       "clip_option='mean' does not clip to the EMA mean"),
    _m("Z9", ZCLIP, "    clip_value = mean + zt * std\n", "    clip_value = mean + std\n",
       "percentile mode clips at mean + std instead of mean + z_thresh * std"),
    _m("Z10", ZCLIP, "    effective = jnp.minimum(adaptive, ceiling)",
       "    effective = adaptive", "max_grad_norm is not applied after the warmup"),
    _m("Z11", ZCLIP, "  ema_mean = alpha * mean + (1.0 - alpha) * adaptive",
       "  ema_mean = alpha * mean + (1.0 - alpha) * g",
       "the EMA mean absorbs the raw spike instead of its clip value"),
    _m("Z12", ZCLIP, "jnp.square(adaptive - ema_mean)", "jnp.square(adaptive - mean)",
       "the EMA variance uses the old mean (the reference updates the mean first)"),
    _m("Z13", ZCLIP, "  keep_stats = jnp.logical_and(spike, jnp.asarray(skip_update_on_spike))",
       "  keep_stats = jnp.asarray(False)", "skip_update_on_spike=True still updates the EMA"),
    _m("Z14", ZCLIP, "        ema_mean=jnp.where(finite, new_mean, state.ema_mean),",
       "        ema_mean=new_mean,", "a non-finite norm enters the EMA mean"),
    _m("Z15", ZCLIP, "        count=jnp.where(finite, _common.safe_increment(state.count),",
       "        count=jnp.where(True, _common.safe_increment(state.count),",
       "a non-finite step counts toward the warmup"),
    _m("Z16", ZCLIP,
       "    is_spike = jnp.logical_and(jnp.logical_and(~in_warmup, spike), finite)",
       "    is_spike = jnp.logical_and(spike, finite)", "a warmup step can count as a spike"),
    _m("Z17", ZCLIP, "        clip_count=jnp.where(was_clipped,",
       "        clip_count=jnp.where(is_spike,", "clip_count counts spikes, not clipped steps"),
    _m("Z18", ZCLIP, "    idle_threshold = jnp.minimum(detect_level, ceiling)",
       "    idle_threshold = detect_level",
       "the reported idle threshold is not capped by max_grad_norm"),
    _m("Z19", ZCLIP, "  _common.check(\"alpha\", alpha, lambda v: 0.0 < v < 1.0,",
       "  _common.check(\"alpha\", alpha, lambda v: 0.0 < v <= 1.0,",
       "alpha=1 (an EMA that never moves) is accepted"),

    # ---------------------------------------------------------------- adagc.py
    _m("A1", ADAGC, "      h = jnp.where(in_warmup, h_global, h_local)", "      h = h_local",
       "no global clip to lambda_abs during the warmup"),
    _m("A2", ADAGC, "in_warmup = state.count < jnp.asarray(warmup_steps, jnp.int32)",
       "in_warmup = state.count <= jnp.asarray(warmup_steps, jnp.int32)",
       "the warmup lasts one step too long"),
    _m("A3", ADAGC, "jnp.where(measured, jnp.minimum(gamma, clipped_norm), gamma)",
       "jnp.where(measured, jnp.minimum(gamma, n), gamma)",
       "gamma starts from the raw norm instead of the clipped one"),
    _m("A4", ADAGC, "      measured = n > 0", "      measured = n >= 0",
       "a zero norm initialises gamma (and freezes the tensor after warmup)"),
    _m("A5", ADAGC, "b * gamma + (1.0 - b) * clipped_norm)", "b * gamma + (1.0 - b) * n)",
       "the EMA absorbs raw norms instead of clipped ones"),
    _m("A6", ADAGC, "jnp.minimum(1.0, l_rel * gamma / n)", "jnp.minimum(1.0, gamma / n)",
       "lambda_rel is ignored"),
    _m("A7", ADAGC, "      new_gammas.append(jnp.where(finite, gamma_new, gamma))",
       "      new_gammas.append(gamma_new)", "a non-finite step enters gamma"),
    _m("A8", ADAGC, "    shape = leaf.shape[:1] if is_stacked(path, leaf, stacked_names) else ()",
       "    shape = ()", "a scan-stacked leaf gets one threshold instead of one per layer"),
    _m("A9", ADAGC, "clipped_fraction = jnp.mean((h_all < 1.0).astype(_common.STAT_DTYPE))",
       "clipped_fraction = jnp.mean((h_all <= 1.0).astype(_common.STAT_DTYPE))",
       "clipped_fraction counts tensors that were not scaled down"),
    _m("A10", ADAGC, "                            jnp.where(measured, clipped_norm, gamma),",
       "                            gamma,",
       "a gamma still at +inf after warmup never starts (the tensor is never clipped)"),
    _m("A11", ADAGC, "    h_global = jnp.minimum(1.0, l_abs / g)",
       "    h_global = jnp.minimum(1.0, 1.0 / g)", "lambda_abs is ignored (1.0 used)"),

    # ---------------------------------------------------------------- hybrid.py
    _m("H1", HYBRID, "clip_factor=zclip_clip_factor,", "clip_factor=1.0,",
       "zclip_clip_factor is not passed on"),
    _m("H2", HYBRID, "skip_update_on_spike=zclip_skip_update_on_spike)",
       "skip_update_on_spike=False)", "zclip_skip_update_on_spike is not passed on"),
    _m("H3", HYBRID, "lambda_abs=adagc_lambda_abs,", "lambda_abs=1.0,",
       "adagc_lambda_abs is not passed on"),
    _m("H4", HYBRID, "            stacked_names=adagc_stacked_names)",
       "            stacked_names=STACKED_NAMES)", "adagc_stacked_names is not passed on"),
    _m("H5", HYBRID,
       "    updates, z_state = z.update(updates, state.zclip, params)\n"
       "    updates, a_state = a.update(updates, state.adagc, params)",
       "    updates, a_state = a.update(updates, state.adagc, params)\n"
       "    updates, z_state = z.update(updates, state.zclip, params)",
       "AdaGC runs before ZClip"),
    _m("H6", HYBRID, "max_grad_norm=zclip_max_grad_norm, eps=zclip_eps,",
       "max_grad_norm=zclip_max_grad_norm, eps=1e-6,", "zclip_eps is not passed on"),
    _m("H7", HYBRID, "warmup_steps=zclip_warmup_steps, mode=zclip_mode,",
       "warmup_steps=zclip_warmup_steps, mode=\"zscore\",", "zclip_mode is not passed on"),

    # ---------------------------------------------------------------- loss_scaling.py
    _m("L1", LOSS_SCALING, "    grow = counter >= self.growth_interval",
       "    grow = counter > self.growth_interval", "the scale grows one finite step late"),
    _m("L2", LOSS_SCALING, "    finite_counter = jnp.where(grow, 0, counter)",
       "    finite_counter = counter", "the counter does not restart after growing"),
    _m("L3", LOSS_SCALING,
       "    backoff_scale = jnp.maximum(self.loss_scale * self.backoff_factor,\n"
       "                                self.min_scale)",
       "    backoff_scale = self.loss_scale * self.backoff_factor",
       "a backoff goes below min_scale"),
    _m("L4", LOSS_SCALING, "    counter = jnp.where(grads_finite, finite_counter, 0)",
       "    counter = jnp.where(grads_finite, finite_counter, self.counter)",
       "an overflow does not restart the counter"),
    _m("L5", LOSS_SCALING,
       "               growth_factor: float = 1.5, backoff_factor: float = 0.5, min_scale",
       "               growth_factor: float = 2.0, backoff_factor: float = 0.5, min_scale",
       "the default growth factor is 2 instead of 1.5"),
    _m("L6", LOSS_SCALING,
       "  def create(cls, initial_scale: float = 2.0**10, *, growth_interval: int = 200,",
       "  def create(cls, initial_scale: float = 2.0**10, *, growth_interval: int = 2000,",
       "create() grows after 2000 finite steps instead of 200"),
    _m("L7", LOSS_SCALING, "    inv = 1.0 / self.loss_scale",
       "    inv = 1.0 / jnp.maximum(self.loss_scale, 2.0**10)",
       "unscale divides by the initial scale, not the current one"),
    _m("L8", LOSS_SCALING,
       "    aux = (self.growth_interval, self.growth_factor, self.backoff_factor,\n"
       "           self.min_scale)",
       "    aux = (self.growth_interval, self.growth_factor, 0.5,\n           self.min_scale)",
       "the backoff factor is lost through jit (pytree metadata)"),

    # ---------------------------------------------------------------- stacked.py
    _m("ST1", STACKED, "    if part.lower() in names and not following.isdigit():",
       "    if part in names and not following.isdigit():",
       "the stacked names match case-sensitively"),
    _m("ST2", STACKED, "    if part.lower() in names and not following.isdigit():",
       "    if part.lower() in names:",
       "an unrolled list of layers (h/0/...) counts as scan-stacked"),
    _m("ST3", STACKED, 'STACKED_NAMES = ("layers", "blocks", "scan", "h")',
       'STACKED_NAMES = ("layers", "blocks", "scan")', "'h' is not a default stacked name"),
    _m("ST4", STACKED, '  if len(getattr(leaf, "shape", ())) < 1:',
       '  if len(getattr(leaf, "shape", ())) < 0:', "a scalar leaf counts as scan-stacked"),

    # ---------------------------------------------------------------- _common.py
    _m("CM1", COMMON, "  return optax.tree.norm(jnp.asarray(x, STAT_DTYPE))",
       "  return optax.tree.norm(x)", "bf16 gradient norms are computed in bf16"),
    _m("CM2", COMMON, "    zero = xf - xf\n",
       "    zero = jnp.where(jnp.isnan(x), jnp.nan, 0.0).astype(STAT_DTYPE)\n",
       "an Inf counts as finite"),
    _m("CM3", COMMON, "  return (jnp.asarray(x, STAT_DTYPE) * scale).astype(jnp.asarray(x).dtype)",
       "  return jnp.asarray(x, STAT_DTYPE) * scale", "scaled updates lose their dtype"),
    _m("CM4", COMMON, "  return jnp.asarray(optax.safe_increment(count))",
       "  return count + 1", "counters overflow instead of saturating"),
    _m("CM5", COMMON, "  if not ok(value):\n    raise ValueError",
       "  if False:\n    raise ValueError",
       "invalid hyperparameters are accepted"),
    _m("CM6", COMMON, "  if not probes:\n    return jnp.zeros((), STAT_DTYPE)",
       "  if not probes:\n    return jnp.full((), jnp.nan, STAT_DTYPE)",
       "an empty tree is not finite (a stateless step would always be skipped)"),

    # ---------------------------------------------------------------- metrics.py
    _m("MT1", ZCLIP, '      "ema_std": jnp.sqrt(s.ema_var),', '      "ema_std": s.ema_var,',
       "zclip/ema_std reports the variance", AREA_TESTS[METRICS]),
    _m("MT2", METRICS, '    name = spec.prefix if n == 0 else f"{spec.prefix}_{n}"',
       '    name = spec.prefix if n == 0 else f"{spec.prefix}_{n + 1}"',
       "the second ZClip is zclip_2 instead of zclip_1"),
    _m("MT3", METRICS, "      if _is_registered(field):\n        _walk(field, out)",
       "      if _is_registered(field):\n        pass",
       "states inside a registered wrapper (inner_state) are not found"),
    _m("MT4", SPIKE_SKIP, '  out["loss_mean"] = window_stats(s.loss_history, s.loss_count)[0]',
       '  out["loss_mean"] = window_stats(s.loss_history, s.loss_count)[1]',
       "skip_spikes/loss_mean is the window's std", AREA_TESTS[METRICS]),
    _m("MT5", SPIKE_SKIP,
       '  out["grad_norm_mean"] = window_stats(s.grad_norm_history, s.grad_norm_count)[0]',
       '  out["grad_norm_mean"] = window_stats(s.grad_norm_history, s.loss_count)[0]',
       "the grad-norm mean is taken over the loss window's count", AREA_TESTS[METRICS]),
    _m("MT8", METRICS,
       "  _REGISTRY[state_type] = MetricsSpec(state_type, prefix, fn, tuple(rates), "
       "tuple(series),",
       "  _REGISTRY[state_type] = MetricsSpec(state_type, prefix, fn, (), tuple(series),",
       "the rates a state registers never reach the monitor"),
    _m("MT6", METRICS, "  for klass in type(node).__mro__:", "  for klass in (type(node),):",
       "a subclass of a registered state is not found"),
    _m("MT7", ZCLIP, '      "clip_count": s.clip_count,', '      "clip_count": s.spike_count,',
       "zclip/clip_count reports the spike count", AREA_TESTS[METRICS]),

    # ---------------------------------------------------------------- modeling/losses.py
    _m("LS1", LOSSES, "  z_term = jnp.asarray(z_loss, jnp.float32) * jnp.square(log_z)",
       "  z_term = jnp.asarray(z_loss, jnp.float32) * jnp.abs(log_z)",
       "the z-loss term is not squared"),
    _m("LS2", LOSSES, "  logits = logits.astype(jnp.float32)\n", "",
       "bf16 logits are not upcast to float32"),
    _m("LS3", LOSSES, "    return jnp.sum(jnp.where(weights > 0, x * weights, 0.0)) / denom",
       "    return jnp.sum(x * weights) / denom",
       "a NaN/Inf at a masked position leaks into the mean"),
    _m("LS4", LOSSES, "  denom = jnp.where(total > 0, total, 1.0)",
       "  denom = jnp.asarray(labels.size, jnp.float32)",
       "the means divide by every position, not by the mask's weight"),
    _m("LS5", LOSSES, "  return ce + zl, {", "  return ce, {", "the loss leaves out the z-loss"),
    _m("LS6", LOSSES, "  log_z = jax.nn.logsumexp(logits, axis=-1)",
       "  log_z = jnp.max(logits, axis=-1)",
       "the normaliser is the max logit instead of log-sum-exp"),

    # ---------------------------------------------------------------- modeling/utils.py
    _m("U1", MODEL_UTILS, "  keep[ids] = False\n", "",
       "the mean embedding includes the new tokens' own rows"),
    _m("U2", MODEL_UTILS,
       '                      "kernel": kernel.at[:, ids].set(mean_col[:, None])}',
       '                      "kernel": kernel}',
       "the untied head's columns of the new tokens are not set"),
    _m("U3", MODEL_UTILS,
       "    inner = optax.linear_schedule(init_value=0.0, end_value=1.0, "
       "transition_steps=int(steps))",
       "    inner = optax.linear_schedule(init_value=0.0, end_value=1.0, "
       "transition_steps=2 * int(steps))",
       "the linear lambda ramp takes twice the steps"),
    _m("U4", MODEL_UTILS, "    return lambda step: jnp.ones((), jnp.float32)",
       "    return lambda step: jnp.zeros((), jnp.float32)",
       "lambda_warmup(0) never quantises (lambda 0 instead of 1)"),
    _m("U5", MODEL_UTILS, "  qmax = float(2 ** (bits - 1) - 1)", "  qmax = float(2 ** bits - 1)",
       "RTN uses the unsigned level count (twice the levels)"),
    _m("U6", MODEL_UTILS, '    axis = -1 if "embed" in name else -2', "    axis = -2",
       "an embedding table is quantised per column instead of per token row"),
    _m("U7", MODEL_UTILS, 'leaf == "scale" or', 'leaf == "scales" or',
       "norm gains (leaves named scale) are quantised"),
    _m("U8", MODEL_UTILS, " or any(e in name for e in exclude):", ":",
       "exclude= is ignored"),
    _m("U9", MODEL_UTILS, "    q = jnp.clip(jnp.round(w32 / safe), -qmax, qmax) * safe",
       "    q = jnp.clip(jnp.floor(w32 / safe), -qmax, qmax) * safe",
       "RTN truncates instead of rounding to nearest"),
    _m("U10", MODEL_UTILS,
       "  return rewrap(new), dataclasses.replace(cfg, emb_proj=False, tie_embeddings=False)",
       "  return rewrap(new), dataclasses.replace(cfg, emb_proj=False)",
       "a tied model stays tied after merging (its head would be the merged input table)"),
    _m("U11", MODEL_UTILS,
       "  if isinstance(params, dict) and \"tok_embed\" not in params and \"params\" in params:",
       "  if False:", "a tree wrapped as {'params': ...} is not accepted"),

    # ---------------------------------------------------------------- monitor/score.py
    _m("SC1", SCORE, "    budgets[specs.ROLLBACKS] = specs.ROLLBACKS_BUDGET\n", "",
       "the stability score no longer counts rollbacks"),
    _m("SC2", SCORE, "    budgets[specs.SKIP_RATE] = specs.SKIP_RATE_BUDGET\n",
       "    budgets[specs.SKIP_RATE] = 10 * specs.SKIP_RATE_BUDGET\n",
       "the skipped-step budget is 0.5 instead of 0.05"),
    _m("SC3", SCORE, "SCORE_PENALTY_AT_BUDGET = 0.2", "SCORE_PENALTY_AT_BUDGET = 0.1",
       "a signal at its budget scores 0.9 instead of the target 0.8"),
    _m("SC4", SCORE, "    if r is None or math.isnan(r) or r <= 0:", "    if r is None or r <= 0:",
       "a NaN rate is not counted as 0 (it erases the other signals)"),
    _m("SC5", SCORE, "    if r is not None and r > limit:", "    if r is not None and r >= limit:",
       "a rate exactly at its limit fires the advice"),
    _m("SC6", SCORE, "  return float(min(1.0, max(0.0, 1.0 - penalty)))",
       "  return float(min(1.0, 1.0 - penalty))", "the score goes below 0"),
    _m("SC7", SCORE, "    rows = [(rate.name, rate.budget, rate.advice)",
       "    rows = [(rate.name, 10 * rate.budget, rate.advice)",
       "the advice rows fire at ten times their budget (fallbacks at 0.1 per step)"),
    _m("SC8", ZCLIP, '                label="ZClip clip rate")),',
       '                label="ZClip clip rate", budget=0.2)),',
       "routine ZClip clipping is scored", AREA_TESTS[SCORE]),
    _m("SC9", MUON, '                label="Muon fallbacks / step", budget=0.01, tensors=True,',
       '                label="Muon fallbacks / step", budget=0.05, tensors=True,',
       "the fallback budget is 0.05 instead of 0.01 per step", AREA_TESTS[SCORE]),
    _m("SC10", SCORE, "  if loss_plateau:\n    lines.append(PLATEAU_ADVICE)", "",
       "a loss plateau gives no warmup advice"),

    # ---------------------------------------------------------------- monitor/movement.py
    _m("MV1", MOVEMENT, '"rel_change": jnp.sqrt(a["dd"]) / jnp.maximum(jnp.sqrt(a["qq"]), tiny),',
       '"rel_change": jnp.sqrt(a["dd"]) / jnp.maximum(jnp.sqrt(a["pp"]), tiny),',
       "the relative change is taken against the new parameters, not the previous ones"),
    _m("MV2", MOVEMENT, '    a["eps"] = max(a["eps"], float(jnp.finfo(p.dtype).eps))',
       '    a["eps"] = float(jnp.finfo(jnp.float32).eps)',
       "the resolution ratio ignores the group's own dtype (bf16 judged as float32)"),
    _m("MV3", MOVEMENT, '    a["frozen"] = a["frozen"] + jnp.sum((d == 0).astype(jnp.float32))',
       '    a["frozen"] = a["frozen"] + jnp.sum((d != 0).astype(jnp.float32))',
       "the frozen fraction counts the entries that moved"),
    _m("MV4", MOVEMENT, "(ratio is not None and ratio < min_resolution_ratio):",
       "(ratio is not None and ratio < 0.1 * min_resolution_ratio):",
       "updates below the dtype's resolution are not flagged"),
    _m("MV5", MOVEMENT, '      if dtype in ("bfloat16", "float16"):',
       '      if dtype in ("bfloat16",):',
       "stuck float16 parameters are not blamed on low precision"),
    _m("MV6", MOVEMENT, "abs(rms - 1.0) < 1e-3:", "abs(rms) < 1e-3:",
       "norm scales stuck at 1.0 are not called out"),
    _m("MV7", MOVEMENT,
       "    if not math.isfinite(rel) or (ratio is not None and math.isnan(ratio)):",
       "    if math.isnan(rel) or (ratio is not None and math.isnan(ratio)):",
       "an infinite relative change is reported as stuck, not as non-finite"),
    _m("MV8", MOVEMENT, "jnp.finfo(dt).eps > jnp.finfo(old).eps:",
       "jnp.finfo(dt).eps < jnp.finfo(old).eps:",
       "param_dtypes reports the highest precision of a mixed group"),
    _m("MV9", MOVEMENT, '    for key in ("resolution_ratio", "resolution_ratio_bf16"):',
       '    for key in ("resolution_ratio",):', "movement_record drops resolution_ratio_bf16"),
    _m("MV10", MOVEMENT,
       '    ("norm", re.compile(r"(norm|^ln(_|\\d|$)|^layer_?norm|^rms)")),\n'
       '    ("attention", re.compile(r"(attn|attention|^q_?proj|^k_?proj|^v_?proj|^o_?proj|^qkv|'
       '^query"\n                             r"|^key$|^value)")),',
       '    ("attention", re.compile(r"(attn|attention|^q_?proj|^k_?proj|^v_?proj|^o_?proj|^qkv|'
       '^query"\n                             r"|^key$|^value)")),\n'
       '    ("norm", re.compile(r"(norm|^ln(_|\\d|$)|^layer_?norm|^rms)")),',
       "attention is matched before norm (the documented order is norm first)"),
    _m("MV11", MOVEMENT, "    elif low_precision:", "    elif False:",
       "stuck bf16 parameters are blamed on the learning rate"),

    # ---------------------------------------------------------------- monitor/layers.py
    _m("LY1", LAYERS,
       '        out["/".join(parts[:idx + 1] + [str(layer)] + parts[idx + 1:])] = norms[layer]',
       '        out["/".join(parts + [str(layer)])] = norms[layer]',
       "the layer index is appended instead of inserted after the stacked component"),
    _m("LY2", LAYERS, "(x.shape[0], -1)), axis=1)", "(x.shape[0], -1)), axis=None)",
       "a stacked leaf's norms are not per layer slice"),
    _m("LY3", LAYERS, "    if not jnp.issubdtype(x.dtype, jnp.inexact):\n      continue\n", "",
       "integer leaves get norms"),
    _m("LY4", LAYERS, "    idx = stacked_component(parts, stacked_names)",
       "    idx = stacked_component(parts)", "stacked_names=() does not disable the split"),
    _m("LY5", LAYERS, "    if layer_index is not None:\n      per_layer.setdefault(layer_index",
       "    if False:\n      per_layer.setdefault(layer_index",
       "an unrolled layer (block_<i>) gets no update norm of its own"),
    _m("LY6", LAYERS,
       "    if part.lower() in names and i + 1 < len(parts) and parts[i + 1].isdigit():",
       "    if False:", "a listed layer (h/<i>) is no layer"),

    # ---------------------------------------------------------------- monitor/report.py
    _m("RP1", MONITOR_REPORT, "          or isinstance(rec.get(\"step\"), bool):",
       "          or False:", "a record whose step is true/false is read as a step"),
    _m("RP2", MONITOR_REPORT,
       "  for s, cause in rbs[:max_lines]:\n    out.append(f\"  step {s}: {cause}\")\n", "",
       "the summary does not list each rollback's step and cause"),
    _m("RP3", MONITOR_REPORT,
       "      v = _num(train[-1].get(spec.key(rate.counter))) if rate.skip and rate.counter "
       "else None", "      v = _num(train[-1].get(spec.key(rate.counter))) if rate.skip and "
       "rate.counter and spec.prefix == \"skip_nonfinite\" else None",
       "skip_spikes' skipped steps are left out of the total"),
    _m("RP4", MONITOR_REPORT, '    if r.get("event") == "skip":',
       '    if r.get("event") == "skipped":',
       "skip events are not flagged as skipped steps"),
    _m("RP5", MONITOR_REPORT,
       '  score = logged_scores[-1] if logged_scores else summ["score"]',
       '  score = summ["score"]', "the printed score ignores the score the run logged"),
    _m("RP6", MONITOR_REPORT, "    best = min(finite, key=lambda v: v[1]) if finite else None",
       "    best = max(finite, key=lambda v: v[1]) if finite else None",
       "the best validation loss is the highest"),
    _m("RP7", MONITOR_REPORT, '  if not logged_warnings and analysis["monitor_warnings"]:',
       '  if analysis["monitor_warnings"]:',
       "replayed warnings are printed although the run logged its own"),
    _m("RP8", MONITOR_REPORT,
       "      mon.record_rollback(r[\"step\"], str(r.get(\"cause\", \"\")))\n",
       "", "the replayed score does not see the rollbacks"),
    _m("RP9", MONITOR_REPORT, "  shown = {k: v for k, v in rates.items() if k != \"rollbacks\"}",
       "  shown = {}", "the last window's rates are not printed"),
    _m("RP10", MONITOR_REPORT,
       '    out.append(f"non-finite loss at {len(nonfinite)} logged step(s): '
       '{_list(nonfinite, max_lines)}")',
       "    pass", "non-finite logged losses are not listed"),

    # ---------------------------------------------------------------- cli/report.py
    _m("CR1", CLI_REPORT, "  if args.window < 1:", "  if args.window < 0:",
       "--window 0 is accepted"),
    _m("CR2", CLI_REPORT, "  return ReportError, outputs.OutputError",
       "  return (outputs.OutputError,)",
       "an unusable run directory is a traceback and exit 1 instead of one line and 2"),
    _m("CR3", CLI_REPORT,
       "  given = Path(args.out) if args.out is not None else run_dir / REPORT_FILE",
       "  given = run_dir / REPORT_FILE", "--out is ignored"),
    _m("CR4", CLI_REPORT, "    text = make_report(run_dir, tmp, args.window)[1]",
       "    text = make_report(run_dir, tmp)[1]", "--window is not passed on"),

    # ---------------------------------------------------------------- muon/lr_check.py
    _m("LR1", LR_CHECK, "MUON_MIN_LR = 1e-3", "MUON_MIN_LR = 1e-4",
       "a Muon rate between 1e-4 and 1e-3 passes"),
    _m("LR2", LR_CHECK, "ADAM_MAX_LR = 3e-3", "ADAM_MAX_LR = 3e-2",
       "an AdamW rate between 3e-3 and 3e-2 passes"),
    _m("LR3", LR_CHECK, "  muon_low = muon is not None and 0 < muon < MUON_MIN_LR",
       "  muon_low = muon is not None and 0 < muon <= MUON_MIN_LR",
       "a Muon rate of exactly 1e-3 warns"),
    _m("LR4", LR_CHECK, "math.isfinite(adam) and adam > ADAM_MAX_LR",
       "math.isfinite(adam) and adam >= ADAM_MAX_LR", "an AdamW rate of exactly 3e-3 warns"),
    _m("LR5", LR_CHECK, "    return float(np.max(schedule_values(lr)))", "    return float(lr(0))",
       "a schedule is judged by its first value, not its peak"),
    _m("LR6", LR_CHECK, "np.concatenate([np.arange(4097),",
       "np.concatenate([np.arange(0, 4097, 16),",
       "a warmup peak between probed steps is missed"),
    _m("LR7", LR_CHECK, "(not math.isfinite(value) or value <= 0):",
       "(not math.isfinite(value) or value < 0):", "a zero learning rate passes"),
    _m("LR8", LR_CHECK, "  if muon_low and adam_high:", "  if False:",
       "swapped rates are reported as two separate problems, not as a swap"),
    _m("LR9", LR_CHECK, "      muon_lr = learning_rate if muon_lr is None else muon_lr",
       "      adam_lr = learning_rate if adam_lr is None else adam_lr",
       "optimizer='muon' checks its learning_rate as an AdamW rate"),
    _m("LR10", LR_CHECK, "  if warn:\n    for message in messages:",
       "  if False:\n    for message in messages:", "warn=True emits no warnings"),
    _m("LR11", LR_CHECK, '        "head": _peak(head_lr)}', '        "head": None}',
       "a non-positive head rate passes"),

    # ---------------------------------------------------------------- muon/newton_schulz.py
    _m("NS12", NEWTON_SCHULZ, "  if from_end and 0 < steps < len(table):",
       "  if False and 0 < steps < len(table):",
       "AOL with a longer coefficient list uses its first triples, not its last (Turbo-Muon)",
       ("tests/test_newton_schulz.py", "-k", "turbo")),
    _m("NS13", NEWTON_SCHULZ, "  rows = jnp.sum(jnp.abs(gram.astype(jnp.float32)), axis=-1)",
       "  rows = jnp.sum(gram.astype(jnp.float32), axis=-1)",
       "AOL sums the Gram rows without their absolute values",
       ("tests/test_newton_schulz.py", "-k", "aol")),
    _m("NS14", NEWTON_SCHULZ, "    if i == 0 and precondition is not None:\n      x, gram = "
       "precondition(x, gram)\n    poly", "    if precondition is not None:\n      x, gram = "
       "precondition(x, gram)\n    poly", "AOL rescales every step, not only the first",
       ("tests/test_newton_schulz.py", "-k", "aol_matches_optax")),
    _m("NS15", NEWTON_SCHULZ, "    (4.0848, -6.8946, 2.9270),", "    (4.0848, -6.8946, 2.9),",
       "the dion preset's first triple is not optax's", ("tests/test_newton_schulz.py", "-k",
                                                         "dion")),
    _m("NS1", NEWTON_SCHULZ, "STANDARD_COEFFS = (3.4445, -4.7750, 2.0315)",
       "STANDARD_COEFFS = (3.4445, -4.7750, 2.3)", "the standard quintic's c is not 2.0315"),
    _m("NS2", NEWTON_SCHULZ, "_PE_SAFETY = 1.01", "_PE_SAFETY = 1.0",
       "Polar Express drops the paper's safety factor"),
    _m("NS3", NEWTON_SCHULZ, "(a / _PE_SAFETY, b / _PE_SAFETY**3, c / _PE_SAFETY**5)",
       "(a / _PE_SAFETY, b / _PE_SAFETY**3, c / _PE_SAFETY**3)",
       "the safety factor divides c by 1.01^3 instead of 1.01^5"),
    _m("NS4", NEWTON_SCHULZ,
       "  per_step = tuple(_triple(table[min(i, len(table) - 1)]) for i in range(steps))",
       "  per_step = tuple(_triple(table[i % len(table)]) for i in range(steps))",
       "steps past the list cycle through it instead of repeating its last triple"),
    _m("NS5", NEWTON_SCHULZ, "  return jnp.sqrt(jnp.sum(xf * xf, axis=(-2, -1)))",
       "  return jnp.sqrt(jnp.sum(xf * xf)) * jnp.ones(xf.shape[:-2])",
       "a stacked input is normalised as a whole, not per slice"),
    _m("NS6", NEWTON_SCHULZ,
       "  return (xf / (norm[..., None, None] * norm_factor + eps)).astype(x.dtype)",
       "  return (xf / (norm[..., None, None] + eps)).astype(x.dtype)",
       "the Polar Express input is not divided by 1.01 ||X||"),
    _m("NS7", NEWTON_SCHULZ,
       "  return (xf / (norm[..., None, None] * norm_factor + eps)).astype(x.dtype)",
       "  return (xf / (norm[..., None, None] * norm_factor)).astype(x.dtype)",
       "a zero input becomes NaN"),
    _m("NS8", NEWTON_SCHULZ,
       "    poly = (b * gram.astype(jnp.float32) + c * _mm(gram, gram, True)).astype(dtype)",
       "    poly = (b * gram.astype(jnp.float32) + c * gram.astype(jnp.float32)).astype(dtype)",
       "the A A term of the quintic is dropped"),
    _m("NS9", NEWTON_SCHULZ, "  transposed = x.shape[-2] > x.shape[-1]", "  transposed = False",
       "a tall matrix is not transposed (the Gram matrix is built on the large side; AOL's "
       "preconditioning scales the other side)"),
    _m("NS10", NEWTON_SCHULZ, "**kernels, default=ref)",
       "**kernels, default=functools.partial(kernel_or_ref, \"triton\"))",
       "on CPU the dispatcher picks the Triton kernel instead of the XLA reference"),
    _m("NS11", NEWTON_SCHULZ, "    elif backend == \"pallas\":\n"
       "      warnings.warn(f\"newton_schulz: backend='pallas' has no kernel",
       "    elif False:\n      warnings.warn(f\"newton_schulz: backend='pallas' has no kernel",
       "backend='pallas' on CPU falls back without a warning"),

    # ---------------------------------------------------------------- data/prepare.py
    _m("P8", PREPARE, '    weights = [float(s["train_tokens"]) for s in sources]',
       '    weights = [float(s["train_documents"]) for s in sources]',
       "default weights are document counts, not token counts"),
    _m("P10", PREPARE, "  if not 0.0 < opts.val_fraction < 1.0:",
       "  if not 0.0 < opts.val_fraction <= 1.0:", "--val-fraction 1 is accepted"),
    _m("P11", PREPARE, '      if counts["train"] == 0:  # it would be in val.bin only',
       '      if False:  # it would be in val.bin only',
       "an input entirely in validation is accepted"),
    _m("P12", PREPARE, "    if existing.complete and same:", "    if False:",
       "a complete directory prepared with the same request is prepared again"),
    _m("P13", PREPARE, "    if not same and not force:", "    if False:",
       "a directory prepared with other settings is replaced without --force"),
    _m("P15", PREPARE, "    s[\"weight\"] = w / total_w", "    s[\"weight\"] = w",
       "the weights in meta.json are not normalised"),
    _m("P16", PREPARE, "    try:\n      lock.acquire()\n", "    try:\n      pass\n",
       "a second prepare into the same --out is not refused",
       ("tests/test_prepare.py", "-k", "second_prepare")),
    _m("P17", PREPARE, "    if existing.changed and not force:", "    if False:",
       "a train.bin the user put in place of prepare's is prepared over without --force",
       ("tests/test_prepare.py", "-k", "replaced_by_the_user")),
    _m("P20", PREPARE,
       "    if created and not (out / PREPARED_META).exists():\n"
       "      out_dir.remove_created(created)\n",
       "", "a failed prepare leaves the --out folder it created",
       ("tests/test_prepare.py", "-k", "failed_prepare or given_twice or full_disk")),

    # ---------------------------------------------------------------- data/prepared.py
    _m("P1", PREPARED, "  fits16 = vocab_size <= 1 << 16", "  fits16 = vocab_size < 1 << 16",
       "a vocabulary of exactly 65,536 (ids up to 65,535) is written as uint32"),
    _m("P2", PREPARED, "  fits16 = vocab_size <= 1 << 16", "  fits16 = vocab_size <= (1 << 16) + 1",
       "a vocabulary of 65,537 is written as uint16 (id 65,536 wraps to 0)"),
    _m("P9", PREPARED, '      "train_range": [start["train"], end["train"]],',
       '      "train_range": [0, end["train"]],',
       "a source's token range starts at 0, not where it starts in train.bin"),
    _m("P21", PREPARED, "  except OSError as e:\n    raise write_error(path, e) from None",
       "  except OSError:\n    raise", "a full disk is a traceback, not one error line",
       ("tests/test_prepare.py", "-k", "full_disk or read_only")),
    _m("P22", PREPARED, "    self.sha256.update(data)\n", "",
       "meta.json records the SHA-256 of nothing, not of the file",
       ("tests/test_prepare.py", "-k", "records_the")),
    _m("D11", PREPARED, "    if actual != expected:", "    if actual is None:",
       "a train.bin/val.bin whose size differs from meta.json is accepted",
       ("tests/test_data.py", "-k", "meta_json")),
    _m("D16", PREPARED, '    if facts["sha256"] != record["sha256"]:', "    if False:",
       "a prepared file changed in place (same size) is accepted",
       ("tests/test_data.py", "-k", "changed_in_place")),
    _m("D17", PREPARED, '  if (record.get("stat") == stat_record(st)', "  if (False",
       "a prepared file untouched since prepare wrote it is read again at every start",
       ("tests/test_data.py", "-k", "changed_in_place")),

    # ---------------------------------------------------------------- data/encode.py
    _m("P3", ENCODE,
       '  h = int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")',
       '  h = int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "big")',
       "the split hash is read big-endian"),
    _m("P4", ENCODE, "  return h < val_fraction * 2.0**64",
       "  return h >= (1.0 - val_fraction) * 2.0**64",
       "validation takes the top of the hash range instead of the bottom"),
    _m("P5", ENCODE,
       " max_run(np.frombuffer(raw, np.uint8)) > opts.filter_max_repeat:",
       " max_run(np.frombuffer(raw, np.uint8)) >= opts.filter_max_repeat:",
       "a run of exactly --filter-max-repeat bytes drops the document"),
    _m("P6", ENCODE, "  if opts.filter_max_repeat > 0 and max_run",
       "  if opts.filter_max_repeat >= 0 and max_run",
       "--filter-max-repeat 0 does not disable the repeat filter"),
    _m("P7", ENCODE, " nontext_fraction(raw) > opts.filter_max_nontext:",
       " nontext_fraction(raw) >= opts.filter_max_nontext:",
       "a document exactly at --filter-max-nontext is dropped"),
    _m("P14", ENCODE, "      arr[pos + n - 1] = tok.eot_id\n", "",
       "documents are not followed by the end-of-text id"),
    _m("P19", ENCODE, '        counts["invalid_utf8_bytes"] += invalid',
       '        counts["invalid_utf8_bytes"] += 1',
       "invalid UTF-8 is counted per document, not per byte",
       ("tests/test_prepare.py", "-k", "invalid_utf8")),

    # ---------------------------------------------------------------- data/inputs.py
    _m("P18", INPUTS, "      if key in seen:", "      if False:",
       "an input given twice is read twice", ("tests/test_prepare.py", "-k", "given_twice")),
    _m("P23", INPUTS, '  return gzip.open(path, "rb") if path.name.endswith(".gz") else',
       '  return open(path, "rb") if path.name.endswith(".gz") else',
       "a .gz input is read as it is on disk, not decompressed",
       ("tests/test_prepare.py", "-k", "gz")),
    _m("P24", INPUTS, "  if opts.text_field not in record:", "  if False:",
       "a JSON record without the text field is a traceback, not one error line",
       ("tests/test_prepare.py", "-k", "bad_input")),
    _m("P25", INPUTS, '  if name.endswith(JSON_SUFFIXES):\n    return "json"',
       '  if name.endswith(JSON_SUFFIXES):\n    return "text"',
       "a .jsonl input is read as plain text",
       ("tests/test_prepare.py", "-k", "each_input_format")),
    _m("P26", INPUTS, "  if opts.text_field not in names:", "  if False:",
       "a Parquet file without the text column is called unreadable, not told to pass "
       "--text-field", ("tests/test_prepare.py", "-k", "bad_input")),

    # ---------------------------------------------------------------- data/out_dir.py
    _m("P27", OUT_DIR, "    if path.is_dir() and (path == where or path in where.parents):",
       "    if False:", "an --out inside an input folder is accepted (its files read as input)",
       ("tests/test_prepare.py", "-k", "more_bad_input")),
    _m("P28", OUT_DIR, "  if in_the_way and not force:", "  if False:",
       "files under prepare's names that it did not write are replaced without --force",
       ("tests/test_prepare.py", "-k", "did_not_write")),
    _m("P29", OUT_DIR, "    try:\n      os.rmdir(folder)\n", "    try:\n      pass\n",
       "a failed prepare leaves the --out folder it created",
       ("tests/test_prepare.py", "-k", "failed_prepare or given_twice or full_disk")),
    _m("P30", OUT_DIR, '  state["old_meta_removed"] = True\n', "",
       "a run stopped while it puts its corpus in place leaves files of the old corpus",
       ("tests/test_prepare.py", "-k", "interrupted_while_replacing")),

    # ---------------------------------------------------------------- data/tokenizer.py
    _m("T1", TOKENIZER, '    return list(text.replace("\\x00", "").encode("utf-8", "replace"))',
       '    return list(text.encode("utf-8", "replace"))',
       "bytes: a NUL character in the text encodes to the end-of-text id"),
    _m("T2", TOKENIZER, '        parts.append(run.decode("utf-8", "replace") + EOT_TEXT)',
       '        parts.append(run.decode("utf-8", "replace"))',
       "bytes: decode drops the end-of-text marker"),
    _m("T3", TOKENIZER, "    self._tok.encode_special_tokens = True\n", "",
       "a literal <|endoftext|> in a document becomes the end-of-text id"),
    _m("T4", TOKENIZER, "    names = [eot_token] if eot_token else list(EOT_NAMES)",
       "    names = list(EOT_NAMES)", "--eot-token is ignored"),
    _m("T5", TOKENIZER, "max(vocab.values()) + 1)", "max(vocab.values()))",
       "vocab_size leaves out the largest id"),
    _m("T6", TOKENIZER, "  if n < 257:", "  if n < 256:",
       "bpe:256 is accepted (no room for the end-of-text token)"),
    _m("T7", TOKENIZER, "    return EOT_TEXT.join(parts)", '    return "".join(parts)',
       "a tokenizer.json's decode drops the end-of-text marker"),
    _m("T8", TOKENIZER,
       '    return HFTokenizer(Path(directory) / info.get("file", "tokenizer.json"), '
       'info.get("eot_token"))',
       '    return HFTokenizer(Path(directory) / info.get("file", "tokenizer.json"))',
       "a prepared directory's end-of-text token name is not used"),
    _m("T9", TOKENIZER, "    found = [n for n in names if n in vocab]",
       "    found = [n for n in reversed(names) if n in vocab]",
       "the end-of-text names are looked up in the wrong order"),

    # ---------------------------------------------------------------- data/sources.py
    _m("D1", SOURCES,
       "      if cfg.filter_max_repeat > 0 and max_run(a) > cfg.filter_max_repeat:",
       "      if cfg.filter_max_repeat > 0 and max_run(a) >= cfg.filter_max_repeat:",
       "a run of exactly filter_max_repeat bytes drops the document",
       ("tests/test_data.py", "-k", "filter")),
    _m("D2", SOURCES, "_CONTROL[list(range(0, 9)) + list(range(14, 32)) + [127]] = True",
       "_CONTROL[list(range(0, 9)) + list(range(14, 32))] = True", "DEL counts as text",
       ("tests/test_data.py", "-k", "filter or nontext")),
    _m("D3", SOURCES, "  if len(raw) <= TEXT_DOC_BYTES:\n    return [raw]",
       "  if len(raw) < TEXT_DOC_BYTES:\n    return [raw]",
       "a file of exactly 64 KiB is split into paragraph documents",
       equivalent="paragraphs are packed losslessly into documents of up to 64 KiB, so a file of "
                  "at most 64 KiB packs into the one document the early return gives"),
    _m("D10", SOURCES, '  dtype = np.dtype(meta["dtype"])\n  train_tokens',
       '  dtype = np.dtype("uint16")\n  train_tokens',
       "a prepared uint32 corpus is read as uint16",
       _PREPARED_TESTS),
    _m("D12", SOURCES, "    if max_token >= vocab_size:", "    if max_token > vocab_size:",
       "a .bin token id equal to the vocabulary size is accepted",
       ("tests/test_data.py", "-k", "vocabulary_size")),
    _m("D14", SOURCES, "    if size + len(para) > TEXT_DOC_BYTES and current:",
       "    if size + len(para) > 2 * TEXT_DOC_BYTES and current:",
       "paragraphs are packed into documents of up to 128 KiB"),
    _m("D15", SOURCES, "    if top >= vocab_size:", "    if top > vocab_size:",
       "a prepared token id equal to the vocabulary size is accepted",
       ("tests/test_data.py", "-k", "checked_against_its_vocabulary")),

    # ---------------------------------------------------------------- data/pipeline.py
    _m("D4", PIPELINE, "      n_val = max(window, math.ceil(src.usable * cfg.val_fraction))",
       "      n_val = math.ceil(src.usable * cfg.val_fraction)",
       "a small source holds out less than one validation window",
       ("tests/test_data.py", "-k", "val")),
    _m("D5", PIPELINE, "    ds = ds[process_index::process_count]", "    ds = ds[0::process_count]",
       "every process reads process 0's rows"),
    _m("D6", PIPELINE,
       "      start = reader.start_of(int(slot), int(rng.integers(0, reader.window)))",
       "      start = reader.start_of(int(slot), 0)",
       "window starts never move between epochs (no jitter)",
       ("tests/test_data.py", "-k", "jitter")),
    _m("D7", PIPELINE, "    return min(start, int(self.ends[r]) - self.window)", "    return start",
       "a jittered window runs past the end of its range",
       ("tests/test_data.py", "-k", "jittered")),
    _m("D8", PIPELINE, "    weights = [float(s) for s in sizes]",
       "    weights = [1.0 for s in sizes]",
       "sources are mixed equally instead of by their token counts",
       ("tests/test_data.py", "-k", "mixing")),
    _m("D9", PIPELINE,
       "      picks = np.linspace(0, len(slots) - 1, needed).round().astype(np.int64)",
       "      picks = np.arange(needed)",
       "validation takes the first windows instead of evenly spaced ones",
       ("tests/test_data.py", "-k", "val")),
    _m("D13", PIPELINE, '    vocab_size = int(meta["vocab_size"])', "    vocab_size = vocab_size",
       "a prepared directory's vocabulary size is not used",
       _PREPARED_TESTS),

    # ---------------------------------------------------------------- data/identity.py
    _m("D18", IDENTITY, "        if x.get(key) != y.get(key):", "        if False:",
       "two identities of different data compare equal",
       ("tests/test_data.py", "-k", "data_identity")),
    _m("D19", IDENTITY, "  if sum(sizes) <= hash_limit:", "  if True:",
       "data_identity hashes plain files of any size at every start",
       ("tests/test_data.py", "-k", "data_identity")),
    _m("D20", IDENTITY, '  if recorded.get("settings") != current.get("settings"):',
       "  if False:", "a change of the data settings (a filter, the weights) is not noticed",
       ("tests/test_data.py", "-k", "data_identity")),
    _m("D21", IDENTITY, '"".join(f"{n}\\0{_file_sha256(f)}\\n" for n, f',
       '"".join(f"{n}\\0\\n" for n, f',
       "a folder's identity is its file names only: a file's new content is the same data",
       ("tests/test_data.py", "-k", "data_identity")),

    # ---------------------------------------------------------------- data/folder.py
    _m("FO1", FOLDER, "      if not same:", "      if False:",
       "a lock taken on a file its holder removed meanwhile is kept (two holders)"),
    _m("FO2", FOLDER, "      if content.strip() and not _is_holder_record(content):",
       "      if False:", "a user's own .lock is overwritten"),
    _m("FO3", FOLDER, "os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)", "os.O_CLOEXEC, 0o644)",
       "a symbolic link named .lock is followed and its target overwritten"),
    _m("FO4", FOLDER, "        os.unlink(self.path)\n", "        pass\n",
       "release leaves the lock file behind"),
    _m("FO5", FOLDER, "      try:\n        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)",
       "      try:\n        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)",
       "two writers both take a shared lock on the lock file"),

    # ---------------------------------------------------------------- training/distributed.py
    _m("DI1", DISTRIBUTED,
       "  address = cfg.coordinator_address or os.environ.get(ENV_ADDRESS, \"\").strip() or None",
       "  address = os.environ.get(ENV_ADDRESS, \"\").strip() or cfg.coordinator_address or None",
       "the environment's coordinator address wins over the config's"),
    _m("DI2", DISTRIBUTED,
       "  count = cfg.num_processes if cfg.num_processes is not None else _env_int(ENV_COUNT)",
       "  count = _env_int(ENV_COUNT) or cfg.num_processes",
       "the environment's process count wins over the config's"),
    _m("DI3", DISTRIBUTED, "  if count is not None and pid is not None and not 0 <= pid < count:",
       "  if count is not None and pid is not None and not 0 <= pid <= count:",
       "a process id equal to the process count is accepted"),
    _m("DI4", DISTRIBUTED, "    if count is not None and count > 1:",
       "    if count is not None and count > 2:",
       "JAX_NUM_PROCESSES=2 without mesh.distributed trains two processes alone"),
    _m("DI5", DISTRIBUTED, '  if text is None or text.strip() == "":', "  if text is None:",
       "a blank variable is an error instead of unset"),
    _m("DI6", DISTRIBUTED, "    return array.item() if array.ndim == 0 else array",
       "    return array", "agree_max of a scalar returns a 0-d array, not a Python number"),
    _m("DI7", DISTRIBUTED, "  if count is not None and count < 1:",
       "  if count is not None and count < 0:",
       "a process count of 0 is accepted"),
    _m("DI8", DISTRIBUTED,
       '  pid = cfg.process_id if cfg.process_id is not None else _env_int(ENV_ID)',
       '  pid = _env_int(ENV_ID) if _env_int(ENV_ID) is not None else cfg.process_id',
       "the environment's process id wins over the config's"),

    _m("DI9", DISTRIBUTED,
       "  reduce = jax.jit(lambda x: jnp.max(x, axis=0), out_shardings=replicated)",
       "  reduce = jax.jit(lambda x: jnp.min(x, axis=0), out_shardings=replicated)",
       "processes agree on the minimum (a flag seen by one process is lost)"),
    _m("DI10", DISTRIBUTED, "  if array.dtype == np.bool_:\n    out = out.astype(bool)\n", "",
       "agree_max of a flag across processes returns 1/0 instead of True/False"),

    # ---------------------------------------------------------------- training/mesh.py
    _m("ME1", MESH, "  order = sorted(range(len(shape)), key=lambda i: -shape[i])",
       "  order = list(range(len(shape)))",
       "fsdp shards the first divisible axis instead of the largest"),
    _m("ME2", MESH, "  data = n // cfg.fsdp if cfg.data == -1 else cfg.data",
       "  data = n // cfg.fsdp",
       "mesh.data is ignored (a wrong data x fsdp product is not an error)"),
    _m("ME3", MESH, "  return Mesh(np.asarray(devices).reshape(data, cfg.fsdp), BATCH_AXES)",
       "  return Mesh(np.asarray(devices).reshape(cfg.fsdp, data), BATCH_AXES)",
       "the mesh's data and fsdp sizes are swapped"),
    _m("ME4", MESH, "  return NamedSharding(mesh, P(BATCH_AXES))",
       "  return NamedSharding(mesh, P(\"data\"))",
       "the batch is not split over the fsdp devices"),
    _m("ME5", MESH, "  if per_micro % mesh.size:", "  if per_micro % mesh.shape[\"data\"]:",
       "a micro-batch that does not divide over every device is accepted"),
    _m("ME6", MESH, "    if shape[axis] % fsdp_size == 0 and shape[axis] >= fsdp_size:",
       "    if shape[axis] % fsdp_size == 0 and shape[axis] > fsdp_size:",
       "an axis exactly the fsdp size is not sharded"),
    _m("ME7", MESH, "  fsdp = mesh.shape[\"fsdp\"]", "  fsdp = 1",
       "parameters and optimizer state are replicated instead of sharded over fsdp"),

    # ---------------------------------------------------------------- training/launch.py
    _m("LA1", LAUNCH, "  return 128 - returncode if returncode < 0 else returncode",
       "  return -returncode if returncode < 0 else returncode",
       "a process killed by signal N is reported as N, not 128 + N"),
    _m("LA2", LAUNCH,
       "  kept = [f for f in xla_flags.split() if not f.startswith(DEVICE_COUNT_FLAG)]",
       "  kept = xla_flags.split()", "an existing device count in XLA_FLAGS is kept as well"),
    _m("LA3", LAUNCH,
       "  ids = list(range(rank * devices_per_proc, (rank + 1) * devices_per_proc))",
       "  ids = list(range(rank, rank + devices_per_proc))",
       "ranks' GPUs / TPU chips overlap"),
    _m("LA4", LAUNCH, "    devices_per_proc = available // nproc",
       "    devices_per_proc = available", "each process is given every device of the host"),
    _m("LA5", LAUNCH, "  if available and nproc * devices_per_proc > available:",
       "  if available and nproc * devices_per_proc > available + 1:",
       "one device more than the host has is accepted"),
    _m("LA6", LAUNCH, "             JAX_PROCESS_ID=str(rank), PYTHONUNBUFFERED=\"1\")",
       "             JAX_PROCESS_ID=str(0), PYTHONUNBUFFERED=\"1\")", "every process gets id 0"),
    _m("LA7", LAUNCH, '  if command[0].endswith(".py") or command[0] == "-m":',
       '  if command[0].endswith(".py"):', "-m module does not run with this Python"),
    _m("LA8", LAUNCH, '  if wanted == "cpu":\n    return "cpu", 0\n', "",
       "JAX_PLATFORMS=cpu still looks for accelerators",
       equivalent="the TPU and GPU probes after it are guarded by `wanted in (...)` lists "
                  "without 'cpu', so JAX_PLATFORMS=cpu probes nothing either way"),
    _m("LA9", LAUNCH, "    (4, 1): (\"2,2,1\", \"1,1,1\"),", "    (4, 1): (\"4,1,1\", \"1,1,1\"),",
       "4 TPU processes get a process grid JAX does not set up"),
    _m("LA10", LAUNCH, "  return first_failure[1] if first_failure else 0", "  return 0",
       "a failed process's exit code is lost"),
    _m("LA11", LAUNCH,
       "        first_failure = (rank, exit_code(p.returncode))\n"
       "        deadline = time.monotonic() + grace",
       "        first_failure = (rank, exit_code(p.returncode))",
       "after a failure the other processes are not stopped after --grace"),
    _m("LA12", LAUNCH, "  if early is not None:\n    received.append(early)\n", "",
       "a stop signal before the launch starts its processes is lost; they start anyway",
       ("tests/test_signals.py", "-k", "launch")),

    # ---------------------------------------------------------------- recovery.py, checkpoint.py
    _m("R25", RECOVERY, "      if len(self.recent) == self.window:", "      if self.recent:",
       "the best median is taken before loss_window losses were logged"),
    _m("R26", RECOVERY, 'skipped data batches {a}..{b - 1}")', 'skipped data batches {a}..{b}")',
       "a rollback's logged line names one batch past the skipped range"),
    _m("C27", CHECKPOINT,
       "      while target.exists():\n        target, n = self.damaged_directory / "
       "f\"{step}.{n}\", n + 1\n", "",
       "a second damaged copy of a step is moved into the first one's directory"),

    # ---------------------------------------------------------------- muon/muon.py
    _m("MU1", OUTLIERS, "  clamped = jnp.where(active, jnp.clip(xf, lo, hi), xf)",
       "  clamped = jnp.where(active, jnp.minimum(xf, hi), xf)",
       "the outlier clamp loses its lower bound (a negative outlier is kept)",
       _muon_tests("outlier")),
    _m("MU2", NONFINITE_TENSORS,
       "      return treedef.unflatten([jnp.where(k, n, o) for k, n, o in",
       "      return treedef.unflatten([n for k, n, o in",
       "a non-finite tensor's momentum and Adam moments are not kept",
       _muon_tests("nonfinite")),
    _m("NF1", NONFINITE_TENSORS, "    per_leaf = [[g, u] for g, u in zip(leaves, new_leaves)]",
       "    per_leaf = [[u] for g, u in zip(leaves, new_leaves)]",
       "a tensor whose gradient is not finite is updated (only its update and state are checked)",
       _muon_tests("nonfinite")),
    _m("NF2", NONFINITE_TENSORS,
       "    new_updates = treedef.unflatten([jnp.where(k, u, jnp.zeros_like(u))",
       "    new_updates = treedef.unflatten([jnp.where(True, u, jnp.zeros_like(u))",
       "a skipped tensor still gets its update", _muon_tests("nonfinite")),
    _m("NF3", NONFINITE_TENSORS,
       "    skipped = probe_total([(~k).astype(jnp.float32) for k in ok])",
       "    skipped = probe_total([k.astype(jnp.float32) for k in ok])",
       "the finite tensors are counted as skipped, not the others", _muon_tests("nonfinite")),
    _m("NF4", NONFINITE_TENSORS,
       "    safe = treedef.unflatten([jnp.where(jnp.isfinite(g), g, jnp.zeros_like(g))",
       "    safe = treedef.unflatten([g",
       "the inner transform sees the non-finite gradient entries",
       _muon_tests("nonfinite")),
    _m("MU3", OUTLIERS, "    lo, hi = mean - threshold * std, mean + threshold * std",
       "    lo, hi = mean - 2 * threshold * std, mean + 2 * threshold * std",
       "the z-score clamp uses twice the threshold",
       _muon_tests("outlier")),
    _m("MU4", OUTLIERS, "    k = threshold / 2.0", "    k = threshold",
       "the IQR clamp uses k = threshold instead of threshold / 2",
       _muon_tests("outlier")),
    _m("MU5", OUTLIERS, "  active = (spread > 0) & jnp.isfinite(lo) & jnp.isfinite(hi)",
       "  active = jnp.isfinite(lo) & jnp.isfinite(hi)",
       "a zero-spread matrix (mostly zero momentum) is clamped",
       _muon_tests("zero_spread or outlier")),
    _m("MU6", DIRECTION, "      fro >= _HEALTH_MIN_FRO * normalised)", "      fro >= 0.0)",
       "the NS health check loses its lower bound",
       _muon_tests("fall_back or nan_in_ns or health or near_zero")),
    _m("MU7", DIRECTION,
       "  return jnp.where(mom_finite[..., None, None], xf / (norm[..., None, None] + eps),"
       "\n                   0.0)",
       "  return (xf / (norm[..., None, None] + eps))",
       "the fallback of a non-finite momentum is not zero",
       _muon_tests("nan_in_ns or nonfinite or fall_back")),
    _m("MU8", DIRECTION, "  return consistent_rms * math.sqrt(max(fan_in, fan_out))",
       "  return consistent_rms * math.sqrt(min(fan_in, fan_out))",
       "the Moonlight scale uses the smaller dimension",
       _muon_tests("matches_optax")),
    _m("MU9", MUON,
       "    return node._replace(nonfinite_count=_saturating_add(node.nonfinite_count, "
       "skipped),", "    return node._replace(nonfinite_count=node.nonfinite_count,",
       "skipped non-finite tensors are not counted",
       _muon_tests("nonfinite")),
    _m("MU10", MUON,
       "        \"adam\": optax.adam(rates[\"adam\"], b1=adam_b1, b2=adam_b2, eps=adam_eps),",
       "        \"adam\": adamw(rates[\"adam\"], adam_weight_decay),",
       "norm gains, biases and scalars are weight decayed",
       _muon_tests("adam_groups or metrics_keys")),
    _m("MU11", MUON, "    embedding = adam\n", "    embedding = learning_rate\n",
       "the embedding rate defaults to the Muon rate instead of the AdamW rate",
       _muon_tests("adam_groups or metrics_keys")),
    _m("MU12", MUON, "    counts[label] += u.size", "    counts[label] += 1",
       "a group's update RMS divides by the number of tensors, not of entries",
       _muon_tests("metrics_keys")),
    _m("MU13", COMMON, "  return jnp.where(total > _INT32_MAX - inc, _INT32_MAX, total + inc)"
       ".astype(jnp.int32)", "  return (total + inc).astype(jnp.int32)",
       "the counters wrap around instead of saturating at int32 max",
       _muon_tests("saturate")),
    _m("MU14", DIRECTION, "      corr_now = 1 - beta ** count_inc.astype(dtype)",
       "      corr_now = 1 - beta ** (count_inc + 1).astype(dtype)",
       "Nesterov's gradient term is bias-corrected for the wrong step",
       _muon_tests("matches_optax")),
    _m("RT13", MATRICES, "  if not isinstance(dims, FusedDimensionNumbers):\n"
       "    return [(x, dims)], lambda outs: outs[0]",
       "  if True:\n    return [(x, dims)], lambda outs: outs[0]",
       "a fused kernel is orthogonalised as one matrix, not per projection",
       _muon_tests("fused_kernel")),
    _m("RT14", MATRICES, "  cuts = list(np.cumsum(sizes)[:-1])", "  cuts = list(sizes[:-1])",
       "parts of different sizes are cut at the wrong places",
       _muon_tests("fused_kernel")),

    # ---------------------------------------------------------------- training/budget.py
    _m("BU1", BUDGET, "  return Timings(max(times), eval_seconds,",
       "  return Timings(min(times), eval_seconds,",
       "the plan takes the fastest timed step instead of the slowest"),
    _m("BU2", BUDGET, "    prior = float(meta.get(\"elapsed_seconds\", 0.0))", "    prior = 0.0",
       "a resumed run's clock starts from zero (earlier segments not counted)"),
    _m("BU3", BUDGET, "    if clock is not None and clock[\"elapsed_seconds\"] >= prior:",
       "    if False:", "the clock file's later time is not read on resume"),
    _m("BU4", BUDGET, "    self.prior_seconds, self.segments = prior, segments + 1",
       "    self.prior_seconds, self.segments = prior, segments",
       "a resumed run is not counted as a new segment"),
    _m("BU5", BUDGET, "    step = max(t.step_seconds, recent_step_seconds or 0.0)",
       "    step = t.step_seconds", "out_of_time ignores steps slower than measured"),
    _m("BU6", BUDGET, "    return (self.elapsed() + step + t.eval_seconds + t.sample_seconds + "
       "t.save_seconds", "    return (self.elapsed() + step + t.eval_seconds + t.sample_seconds",
       "out_of_time leaves out the final save"),
    _m("BU7", BUDGET,
       "  available = (safety * budget_seconds - elapsed_seconds - t.compile_seconds",
       "  available = (budget_seconds - elapsed_seconds - t.compile_seconds",
       "the plan has no safety margin"),
    _m("BU8", BUDGET, "    if steps <= cfg.train.warmup_steps:",
       "    if steps < cfg.train.warmup_steps:",
       "a budget with room for exactly warmup_steps steps is accepted"),
    _m("BU9", BUDGET, "    self.fixed_by = \"train.steps\" if steps < fits else \"time_budget\"",
       "    self.fixed_by = \"train.steps\" if steps <= fits else \"time_budget\"",
       "a count fixed by the budget is reported as fixed by train.steps"),
    _m("BU10", BUDGET, "  compile_seconds += max(0.0, eval_compile - eval_seconds)\n", "",
       "the eval step's compilation is left out of the plan"),
    _m("BU11", BUDGET, "  return min(every) if every else 0", "  return max(every) if every else 0",
       "diagnostics are planned at the rarer of the two intervals"),
    _m("BU12", BUDGET, "    if self.target is None or self.step_to_target is not None or "
       "not val_loss < self.target:", "    if self.target is None or not val_loss < self.target:",
       "a later eval below the target overwrites the first one"),

    # ---------------------------------------------------------------- training/config.py
    _m("CF1", CONFIG, "    if t.warmup_steps >= t.steps:", "    if t.warmup_steps > t.steps:",
       "train.warmup_steps equal to train.steps is accepted"),
    _m("CF2", CONFIG, "  if t.batch_size % t.grad_accum:", "  if False:",
       "a batch size not divisible by grad_accum is accepted"),
    _m("CF3", CONFIG, "  if t.seq_len > cfg.model.max_seq_len:",
       "  if t.seq_len > cfg.model.max_seq_len + 1:",
       "train.seq_len one past model.max_seq_len is accepted"),
    _m("CF4", CONFIG, "  if not 0 <= t.min_lr_ratio <= 1:", "  if not 0 <= t.min_lr_ratio:",
       "train.min_lr_ratio above 1 is accepted"),
    _m("CF5", SPIKE_SKIP, "    if self.min_history is not None and not 1 <= self.min_history "
       "<= self.window:", "    if self.min_history is not None and not 1 <= self.min_history:",
       "skip_spikes.min_history above skip_spikes.window is accepted", AREA_TESTS[CONFIG]),
    _m("CF6", SPIKE_SKIP, "self.min_history is None and self.window < 19:",
       "self.min_history is None and self.window < 18:",
       "an OLMo-core window of 18 (which never skips) is accepted", AREA_TESTS[CONFIG]),
    _m("CF7", CONFIG, "  if not 0 < r.emergency_lr_factor <= 1:",
       "  if not 0 <= r.emergency_lr_factor <= 1:",
       "stability.recovery.emergency_lr_factor=0 is accepted"),
    _m("CF8", CONFIG, "  if not mesh.distributed:\n", "  if False:\n",
       "mesh.process_id without mesh.distributed is accepted"),
    _m("CF9", CONFIG, "      if value != default:", "      if value:",
       "a key left at a non-zero default is named as ineffective"),
    _m("CF10", CONFIG, "     lambda c: c.optimizer.name == \"muon\" and c.optimizer.outlier_method "
       "is None,", "     lambda c: False,",
       "optimizer.outlier_threshold with outlier_method=null is not named as ineffective"),

    # ---------------------------------------------------------------- training/optim.py
    _m("OP1", DEFENCE,
       'for f in dataclasses.fields(section)\n              if f.name != "enabled"}',
       'for f in dataclasses.fields(section)\n              if f.name not in ("enabled", '
       '"statistics")}', "stability.skip_spikes.statistics does not reach skip_spikes",
       AREA_TESTS[OPTIM]),
    _m("OP2", DEFENCE,
       'for f in dataclasses.fields(section)\n              if f.name != "enabled"}',
       'for f in dataclasses.fields(section)\n              if f.name not in ("enabled", '
       '"max_consecutive")}', "stability.<skip wrapper>.max_consecutive does not reach it",
       AREA_TESTS[OPTIM]),
    _m("OP3", OPTIM, "      decay_steps=t.steps, end_value=peak * t.min_lr_ratio)",
       "      decay_steps=t.steps, end_value=0.0)", "train.min_lr_ratio is ignored (decay to 0)"),
    _m("OP16", OPTIM, "  decay = optax.cosine_decay_schedule(peak, decay_steps=1, alpha=alpha)",
       "  decay = optax.cosine_decay_schedule(peak, decay_steps=1, alpha=0.0)",
       "in a train step (the run's length given) the schedule decays to 0, not to the floor"),
    _m("OP17", OPTIM, "    done = (count - t.warmup_steps) / jnp.maximum(jnp.asarray(steps) - "
       "t.warmup_steps, 1)",
       "    done = (count - t.warmup_steps) / jnp.maximum(jnp.asarray(steps), 1)",
       "in a train step the decay is laid over the whole run, warmup included"),
    _m("OP4", OPTIM, "  return jax.tree.map(lambda label: label != \"adam\", "
       "label_params(params))", "  return jax.tree.map(lambda label: True, "
       "label_params(params))", "AdamW mode decays norm gains and biases"),
    _m("OP5", OPTIMIZERS, "        adam_weight_decay=self.adam_weight_decay, outlier_threshold=",
       "        outlier_threshold=",
       "optimizer.adam_weight_decay does not reach Muon mode's AdamW groups"),
    _m("CL2", CLIP, "    defence.check_positive(f\"{where}.max_norm\", self.max_norm)", "    pass",
       "stability.clip.max_norm=0 is accepted"),
    _m("CL3", CLIP, "position=defence.Position.GRADIENT, order=10,",
       "position=defence.Position.GRADIENT, order=40,",
       "the plain clip runs after AdaGC instead of before it"),
    _m("CL4", CLIP, "position=defence.Position.GRADIENT, order=10,",
       "position=defence.Position.UPDATE, order=10,",
       "the plain clip clips the optimizer's update instead of the gradient"),
    _m("OP6", CLIP, "    factory=optax.clip_by_global_norm, label=",
       "    factory=lambda max_norm: optax.identity(), label=",
       "stability.clip does not clip", AREA_TESTS[OPTIM]),
    _m("OP15", OPTIM, "lambda label: by_group[cfg.optimizer.group(label)]",
       "lambda label: by_group[next(iter(by_group))]",
       "update-clipping defences divide every parameter by the first group's rate",
       ("tests/test_update_clip.py", "-k", "divides_by_the_rate_of_each_parameter_group")),
    _m("OP12", OPTIMIZERS, "    return label if label in rates else next(iter(rates))",
       "    return next(iter(rates))",
       "every routing group trains at the optimizer's first rate (Muon's, for embeddings too)",
       ("tests/test_update_clip.py", "-k", "divides_by_the_rate_of_each_parameter_group")),
    _m("OP13", OPTIMIZERS, "weight_decay=self.weight_decay, mask=ctx.decay_mask)",
       "weight_decay=self.weight_decay, mask=None)", "AdamW decays norm gains and biases"),
    _m("OP14", OPTIMIZERS,
       "    if self.adam_learning_rate is None and self.consistent_rms is None:", "    if False:",
       "Muon accepts AdamW groups at the width-scaled Muon rate"),
    _m("OP7", OPTIMIZERS, "\"head\": adam if self.head_learning_rate is None else "
       "self.head_learning_rate}", "\"head\": self.learning_rate if self.head_learning_rate is "
       "None else self.head_learning_rate}", "an unset head rate resolves to the Muon rate"),
    _m("OP8", FINITE_SKIP, "    order=20, factory=skip_nonfinite,",
       "    order=20, factory=lambda inner, max_consecutive: skip_nonfinite(inner),",
       "stability.skip_nonfinite.max_consecutive does not reach skip_nonfinite",
       AREA_TESTS[OPTIM]),

    # ---------------------------------------------------------------- training/step.py
    _m("TS1", STEP, "    loss, z_loss = loss / n, z_loss / n",
       "    loss, z_loss = loss, z_loss / n",
       "the logged loss is the sum over micro-batches, not the mean"),
    _m("TS2", STEP, "    grads = jax.tree.map(lambda g, p: (g / n).astype(p.dtype), grads, "
       "state.params)", "    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, "
       "state.params)", "accumulated gradients are summed, not averaged"),
    _m("TS3", STEP, "    lr = lr_schedule(applied_updates(opt_state)) * get_lr_scale(opt_state)",
       "    lr = lr_schedule(state.step) * get_lr_scale(opt_state)",
       "the logged lr counts skipped steps (not the rate applied)"),
    _m("TS4", STEP, "      loss_scale = loss_scale.adjust(all_finite(grads))",
       "      loss_scale = loss_scale.adjust(jnp.bool_(True))",
       "the fp16 loss scale does not back off on overflow"),
    _m("TS5", STEP, "      grads = state.loss_scale.unscale(grads)\n", "",
       "fp16 gradients are not unscaled"),
    _m("TS6", STEP, "    lr = lr_schedule(applied_updates(opt_state)) * get_lr_scale(opt_state)",
       "    lr = lr_schedule(applied_updates(opt_state))",
       "the logged lr leaves out the recovery's backoff"),
    _m("TS7", STEP, "step % t.log_every == 0 or step % cfg.checkpoint.every == 0",
       "step % t.log_every == 0",
       "a checkpoint step's update norms are not computed (the save reads its record)"),
    _m("TS8", STEP, "jnp.full(s.shape, jnp.nan, s.dtype)", "jnp.zeros(s.shape, s.dtype)",
       "an update norm the step did not compute reads as 0 (a skipped step's value)"),
    _m("TS9", STEP, '    read = batch["read_metrics"]', "    read = jnp.bool_(True)",
       "the step ignores the batch's read_metrics: update norms on every step"),

    # ---------------------------------------------------------------- training/loop/components.py
    _m("CO1", COMPONENTS, "metrics_read(self.cfg, step + 1, steps)",
       "metrics_read(self.cfg, step, steps)",
       "a batch's read_metrics is that of the step before (the loop reads the step after)"),
    _m("CO2", COMPONENTS, "    _BUILT.move_to_end(key)\n", "",
       "the programs a process keeps coming back to are dropped first (not least recently used)"),
    _m("CO3", COMPONENTS, "    while len(_BUILT) > _BUILT_KEPT:",
       "    while len(_BUILT) > _BUILT_KEPT + 1:", "the memo keeps one config more than it says"),
    _m("CO4", COMPONENTS,
       '  sections["train"] = dataclasses.replace(sections["train"], steps=None)\n', "",
       "a program config keeps a default length, so a schedule outside a step decays over it"),

    # ---------------------------------------------------------------- training/decoding.py
    _m("GE1", DECODING, "    logits = jnp.where(jnp.arange(vocab) < valid_vocab, logits, -jnp.inf)",
       "    logits = jnp.where(jnp.arange(vocab) <= valid_vocab, logits, -jnp.inf)",
       "the first padding id of the embedding can be drawn"),
    _m("GE2", DECODING, "    logits = jnp.where(logits < kth, -jnp.inf, logits)",
       "    logits = jnp.where(logits <= kth, -jnp.inf, logits)",
       "top_k keeps k - 1 ids"),
    _m("GE3", DECODING, "      n = min(remaining, window - context.shape[1] + 1)",
       "      n = min(remaining, window - context.shape[1])",
       "the last token of a window is not drawn from all W cached positions"),
    _m("GE4", DECODING,
       "      context = np.concatenate([context, new], axis=1)[:, -(window // 2):]",
       "      context = np.concatenate([context, new], axis=1)[:, -(window // 4):]",
       "past the window, a quarter of the window is prefilled instead of half"),
    _m("GE5", DECODING, "    context = np.asarray(list(prompt_ids)[-window:], np.int32)",
       "    context = np.asarray(list(prompt_ids)[:window], np.int32)",
       "a long prompt keeps its first W tokens instead of its last"),
    _m("GE6", DECODING, "  drawn = jax.random.categorical(rng, logits / jnp.maximum(temperature, "
       "1e-6), axis=-1)", "  drawn = jax.random.categorical(rng, logits, axis=-1)",
       "the temperature is ignored"),

    # ---------------------------------------------------------------- transforms/qk_clip.py
    _m("QK1", QK_CLIP, "over = jnp.logical_and(jnp.isfinite(logits), logits > tau32)",
       "over = jnp.logical_and(jnp.isfinite(logits), logits >= 0.5 * tau32)",
       "heads below tau are clipped too"),
    _m("QK2", QK_CLIP, "    query_factor = key_factor = jnp.sqrt(gamma)",
       "    query_factor, key_factor = gamma, jnp.ones_like(gamma)",
       "the factor is not split as sqrt(tau / max) between W_q and W_k"),
    _m("QK3", QK_CLIP, "    query_factor = gamma\n",
       "    query_factor = jnp.sqrt(gamma)\n",
       "with shared key heads (GQA) the query head does not take the whole factor"),
    _m("QK4", QK_CLIP, "_common.f32(u) * f + _common.f32(p) * (f - 1.0)",
       "_common.f32(u) * f",
       "the clip scales the update only, not the weights it is applied to"),
    _m("QK5", QK_CLIP, "over = jnp.logical_and(jnp.isfinite(logits), logits > tau32)",
       "over = logits > tau32",
       "a non-finite logit is used as a scale (NaN weights) instead of being left alone"),
    _m("QK6", QK_CLIP, "total_clipped=jnp.where(heads > room, jnp.iinfo(jnp.int32).max,\n"
       "                              state.total_clipped + heads))",
       "total_clipped=heads)",
       "total_clipped counts the last step only"),
    _m("QK7", QK_CLIP, "  return query_factor, key_factor, jnp.sum(over, dtype=jnp.int32)",
       "  return query_factor, key_factor, jnp.any(over).astype(jnp.int32)",
       "heads_clipped counts layers, not heads"),
    _m("QK8", QK_CLIP, "    _check_layers(params, find_layers(params))\n", "    pass\n",
       "a layout whose heads cannot be located fails at the first update, not at init"),
    _m("QK9", QK_CLIP, "    factor = jnp.concatenate([jnp.repeat(ones, start, axis=-1), factor,",
       "    factor = jnp.concatenate([factor, jnp.repeat(ones, start, axis=-1),",
       "the heads of a fused 2-D kernel's key part are looked for in its query part"),

    # ---------------------------------------------------------------- modeling/utils.py: kurtosis
    _m("KU1", MODEL_UTILS, "  return jnp.maximum(kurt - 3.0, 0.0)", "  return kurt - 3.0",
       "a flatter-than-Gaussian layer gives a negative excess kurtosis instead of 0",
       ("tests/test_model_utils.py", "-k", "kurtosis")),
    _m("KU2", MODEL_UTILS, "  return jnp.maximum(kurt - 3.0, 0.0)",
       "  return jnp.maximum(kurt, 0.0)", "the kurtosis is not the excess over a Gaussian's 3",
       ("tests/test_model_utils.py", "-k", "kurtosis")),
    _m("KU3", MODEL_UTILS, "  centred = y - jnp.mean(y)\n", "  centred = y\n",
       "the moments are not centred on the layer mean",
       ("tests/test_model_utils.py", "-k", "kurtosis")),

    # ---------------------------------------------------------------- muon/routing.py
    _m("RT1", LABELS, 'if rest == [layout.VOCAB, layout.MODEL]:\n    return "embedding"',
       'if rest == [layout.VOCAB, layout.MODEL]:\n    return "head"',
       "a ('vocab', 'embed') table by metadata is routed as the head",
       ("tests/test_model_layouts.py", "-k", "lm1b or nnx_logical")),
    _m("RT2", LABELS, "  if by_metadata is not None:\n    return by_metadata",
       "  if by_metadata is not None and False:\n    return by_metadata",
       "logical axis metadata is not read before shapes and names",
       ("tests/test_routing.py", "tests/test_model_layouts.py", "-k",
        "logical_axis_names or lm1b or nnx_logical")),
    _m("RT3", MATRICES, "  return 1 if a.stacked[i] else 0", "  return 0",
       "a scan-stacked axis counts as a matrix axis, not a batch axis",
       ("tests/test_routing.py", "tests/test_model_layouts.py", "-k",
        "scan_stacked or stacked_on_axis or rules_by_path")),
    _m("RT4", LABELS,
       'for shape, kind in (((dim, vocab), "info"), ((vocab, dim), "unsure")):',
       'for shape, kind in (((vocab, dim), "unsure"),):',
       "a [D, V] matrix outside the blocks is not found as the head",
       ("tests/test_routing.py", "tests/test_model_layouts.py", "-k",
        "head_found_by_shape or nanodo or lm1b")),
    _m("RT5", LABELS, "and not a.in_block[i] and leaf.shape == shape]",
       "and leaf.shape == shape]",
       "a [D, V] matrix inside the repeated blocks can be taken as the head",
       ("tests/test_routing.py", "tests/test_model_layouts.py", "-k",
        "head_found_by_shape or wide_as_the_vocabulary")),
    _m("RT6", LABELS, "      unmatched.append(pattern)", "      pass",
       "a param_labels pattern that matches nothing neither warns nor raises",
       ("tests/test_routing.py", "-k", "overrides")),
    _m("RT7", LABELS, "  if strict:\n    raise ValueError(text)",
       "  if False:\n    raise ValueError(text)",
       "strict=True does not raise on a pattern that matches nothing",
       ("tests/test_routing.py", "-k", "overrides")),
    _m("RT8", LABELS, ' or path.startswith(pattern.rstrip("/") + "/")', "",
       "a path-prefix pattern (not a glob) matches nothing",
       ("tests/test_routing.py", "-k", "overrides or override_routes")),
    _m("RT9", NOTES, '    if note.kind == "warning":', '    if note.kind == "info":',
       "warning notes are not emitted as UserWarnings (info notes are)",
       ("tests/test_routing.py", "tests/test_model_layouts.py", "-k",
        "overrides or one_summary_warning")),
    _m("RT10", LABELS,
       "  return jax.tree.map(layout.value_of, tree, is_leaf=layout.is_param_leaf)",
       "  return tree",
       "a callable param_labels gets the boxed tree instead of its arrays",
       ("tests/test_routing.py", "-k", "same_labels or callable")),
    _m("RT11", ROUTING, "  notes += _notes.fused_notes(leaves, a, labels, layouts, sources)\n",
       "", "describe_routing and init say nothing of fused kernels (split or left whole)",
       ("tests/test_routing.py", "-k", "describe_routing_table or fused_parts")),

    _m("RT15", ROUTING, '    if label == "muon" and len(leaf.shape) < 2:', "    if False:",
       "a vector labelled 'muon' is not refused",
       ("tests/test_routing.py", "-k", "not_a_muon_matrix")),
    _m("RT16", ROUTING, '      if p.labels[i] != "muon":', "      if False:",
       "muon_dimension_numbers' overrides give a layout to a leaf AdamW trains",
       ("tests/test_routing.py", "-k", "not_a_muon_matrix")),
    _m("RT17", ROUTING, '      dims, source = given[i], "given"',
       '      dims, source = given[i], None',
       "given dimension numbers are reported as the default layout",
       ("tests/test_routing.py", "-k", "not_a_muon_matrix")),
    _m("MX1", MATRICES, "  perm = tuple(batch) + red + out", "  perm = tuple(batch) + out + red",
       "a leaf's matrix is cut out transposed (fan-out against fan-in)",
       ("tests/test_model_layouts.py", "-k", "nanodo or gemma")),
    _m("NT1", NOTES, "    if len(leaf.shape) - batch_ndim(a, i) < 3:",
       "    if len(leaf.shape) - batch_ndim(a, i) < 2:",
       "plain 2-D kernels are reported as matching no layout rule",
       ("tests/test_model_layouts.py", "-k", "nanodo or minigpt")),
    _m("NT2", NOTES, '    parts.append(f"{len(paths)} x {shape} as {name} ({shown})")',
       '    parts.append(f"{shape} as {name} ({shown})")',
       "the warning for unrecognised kernels does not say how many of each layout",
       ("tests/test_model_layouts.py", "-k", "one_summary_warning")),
    _m("NT3", NOTES, '  return f"param_labels={{{path!r}: {group!r}}}"',
       '  return f"param_labels={{{path!r}: \'head\'}}"',
       "the override a note suggests names the wrong group",
       ("tests/test_routing.py", "-k", "head_found_by_shape")),
    _m("NT4", NOTES, "  if whole:\n", "  if False:\n",
       "a kernel named like a fused projection but left whole is not reported",
       ("tests/test_routing.py", "-k", "fused_parts")),

    _m("RT12", ROUTING, '      if sources[i] != "given":\n', '      if True:\n',
       "per_head overrides dimension numbers the user gave",
       ("tests/test_per_head.py", "-k", "given")),

    # ---------------------------------------------------------------- layout/heads.py (per head)
    _m("HD1", HEADS, '      side = red if p.role == "out" else outs', "      side = outs",
       "the output projection is split along its model axis, not its heads",
       ("tests/test_per_head.py", "-k", "stablejax_gpt or plain_tree")),
    _m("HD2", HEADS, "red2, out2 = tuple(a for a in red if a != head), tuple(a for a in outs "
       "if a != head)", "red2, out2 = tuple(a for a in red if a != head), outs",
       "a [D, H, hd] kernel's heads axis stays a matrix axis",
       ("tests/test_per_head.py", "-k", "dense_general or gemma or scanned")),
    _m("HD3", HEADS, "  if group.qk_norm_dim is not None:\n    return group.qk_norm_dim\n", "",
       "the head size is not read from the query/key norm",
       ("tests/test_per_head.py", "-k", "stablejax_gpt")),
    _m("HD4", HEADS, '    width = p.parts[0] if p.role == "qkv" and p.parts else p.width',
       "    width = p.width",
       "a fused query/key/value kernel's whole width is taken as the query's",
       ("tests/test_per_head.py", "-k", "plain_tree")),

    # ---------------------------------------------------------------- muon/gram.py
    _m("GR1", GRAM, "      r = _symmetrise(matmul(z, rz, rz, alpha=a, beta=1.0, "
       "trans_rhs=False))", "      r = matmul(z, rz, rz, alpha=a, beta=1.0, trans_rhs=False)",
       "R is not symmetrised after its update"),
    _m("GR2", GRAM, "_symmetrise(matmul(z, rz, rz, alpha=a, beta=1.0, trans_rhs=False))",
       "_symmetrise(matmul(z, rz, rz, alpha=a, beta=1.0, trans_rhs=True))",
       "R's update uses RZ transposed (its rounding asymmetry compounds)"),
    _m("GR3", GRAM, "  if jnp.dtype(dtype).itemsize > 2:", "  if jnp.dtype(dtype).itemsize > 1:",
       "bfloat16 runs without a restart"),
    _m("GR4", GRAM, "      q = matmul(q, z, q, alpha=a, beta=1.0, trans_rhs=True)",
       "      q = matmul(q, z, q, alpha=0.0, beta=1.0, trans_rhs=True)",
       "Q accumulates Z instead of a I + Z after its first step"),
    _m("GR5", GRAM, "      r = matmul(x, x, None, alpha=0.0, beta=1.0, trans_rhs=True)\n"
       "      q = None", "      q = None",
       "a restart keeps the old R instead of recomputing it from X"),
    _m("GR6", GRAM, "      macs += 2 * n**3  # R (a I + Z), then (a I + Z) RZ",
       "      macs += n**3", "the FLOP count misses one of the two products of R's update"),
    _m("GR7", GRAM, "  return steps > 0 and flops(n, m, steps, restarts) < flops(n, m, steps, "
       "method=\"standard\")", "  return steps > 0",
       "Gram runs on every shape, square ones too, where it takes more FLOPs"),

    # ---------------------------------------------------------------- muon/normuon.py
    _m("NM1", NORMUON, "jnp.mean(of * of, axis=-2)", "jnp.mean(of * of, axis=-1)",
       "the second moment is taken per input row, not per output neuron"),
    _m("NM2", NORMUON, "  return (scaled * (norm / jnp.maximum(new_norm, 1e-8))).astype(o.dtype), "
       "nu", "  return scaled.astype(o.dtype), nu",
       "the normalised update does not get the Frobenius norm of Muon's back"),
    _m("NM3", NORMUON, "      new_nu.append(jnp.concatenate(nus) if len(nus) > 1 else nus[0])",
       "      new_nu.append(nu)", "the per-neuron statistics are never updated"),
    _m("NM4", NORMUON, "      pieces, join = matrices.split_fused(u, dims)",
       "      pieces, join = [(u, dims)], (lambda outs: outs[0])",
       "per-head (fused) matrices are normalised as one matrix"),
    _m("NM5", MUON, "      muon_parts.append(_normuon.with_layouts(normuon_b2, 1e-8, layouts_of))",
       "      muon_parts.append(_normuon.with_layouts(0.0, 1e-8, layouts_of))",
       "normuon_b2 is not passed on (no averaging over steps)",
       ("tests/test_normuon.py", "-k", "outlier_safe_muon_normuon")),

    # ---------------------------------------------------------------- layout/ (the analysis)
    _m("LT1", LEAVES, "return _is_variable(x) or _is_box(x) or isinstance(x, optax.MaskedNode)",
       "return _is_variable(x) or isinstance(x, optax.MaskedNode)",
       "a Linen metadata box is not one parameter (boxed and unboxed trees differ)",
       ("tests/test_model_layouts.py", "-k", "lm1b or stacked_on_axis")),
    _m("LT2", ORIENTATION, " or (d_model is not None and leaf.shape[model[0]] != d_model)", "",
       "a metadata model axis whose size disagrees with the model width is trusted",
       ("tests/test_routing.py", "tests/test_model_layouts.py", "-k",
        "wrong_size or lm1b or nnx_logical")),
    _m("LT3", ORIENTATION, "if m == rest[-1]:  # [..., D]: the model axis is the output",
       "if m != rest[-1]:", "metadata: the model axis's side of the matrix is swapped",
       ("tests/test_model_layouts.py", "-k", "lm1b or nnx_logical")),
    _m("LT4", LAYOUT, "return max(tables, key=lambda leaf: leaf.shape[0]).shape[1]",
       "return max(tables, key=lambda leaf: leaf.shape[0]).shape[0]",
       "the model width is read as the vocabulary size",
       ("tests/test_model_layouts.py", "-k", "nanodo or gemma")),
    _m("LT5", ORIENTATION, "    for a in (0, 1):", "    for a in (0,):",
       "layers stacked on axis 1 are not recognised as a stack",
       ("tests/test_model_layouts.py", "-k", "stacked_on_axis")),
    _m("LT6", ORIENTATION,
       "      out.append(OUT_IN if v.get(OUT_IN) and not v.get(\"in_out\") else None)",
       "      out.append(None)",
       "[out, in] storage (Hugging Face's Conv1D) is never read from the model's own kernels",
       ("tests/test_routing.py", "-k", "out_in_storage")),
    _m("LT7", ORIENTATION, "      in_out = (side == \"in\") == (first == d_model)",
       "      in_out = (side == \"in\") != (first == d_model)",
       "the storage votes of input and output projections are read the wrong way round",
       ("tests/test_routing.py", "-k", "out_in_storage")),
    _m("LT8", LEAVES, "      found.add(tuple(_key_name(k) for k in path) + (\"weight\",))",
       "      pass",
       "eqx.nn.Linear weights are read [in, out]",
       ("tests/test_routing.py", "-k", "equinox")),
    _m("LT9", ORIENTATION, "    parts = (out_width, rest, rest)", "    parts = 3",
       "a grouped-query fused kernel is cut into three equal parts",
       ("tests/test_routing.py", "-k", "fused_parts")),
    _m("LT10", ORIENTATION, "    return None\n  return FusedDimensionNumbers(red, out, out, parts)",
       "    return None\n  return None",
       "a fused kernel is orthogonalised as one matrix",
       ("tests/test_routing.py", "-k", "fused_parts or out_in_storage")),
    _m("LT11", NAMES,
       "    if k == FUSED and len(leaf.shape) == 2 and leaf.shape[i] not in (2, 3):",
       "    if False:",
       "a 2-D kernel with a 'qkv' axis name is taken for a vector (routed to Adam)",
       ("tests/test_routing.py", "-k", "fused_parts")),
    _m("LT12", LEAVES, '    for key in ("out_sharding", "sharding_names", "sharding"):',
       '    for key in ("sharding",):', "an NNX Variable's logical axis names are not read",
       ("tests/test_model_layouts.py", "-k", "nnx_logical")),
    _m("LT13", LEAVES, "    masked = isinstance(leaf, optax.MaskedNode)", "    masked = False",
       "a masked-out parameter is taken for a parameter of shape ()"),
    _m("LT14", NAMES, '    stripped = _PROJ_AFFIX.sub("", name)', "    stripped = name",
       "q_proj, wq, c_attn... are not read as the query (only bare names are)",
       ("tests/test_heads.py", "tests/test_routing.py", "-k", "gpt or fused_parts")),
    _m("LT15", NAMES, "  return lower[-2] if len(lower) >= 2 and lower[-1] in WEIGHT_NAMES else "
       "lower[-1]", "  return lower[-1]",
       "a kernel's module is read as 'kernel' (no side of the model width, no storage vote)",
       ("tests/test_routing.py", "-k", "out_in_storage")),
    _m("LT16", NAMES, "  return bool(_QK_NORM.match(name))", "  return False",
       "a query/key norm's gain does not give the head size",
       ("tests/test_heads.py", "-k", "trainer_gpt")),
    _m("LT17", LAYOUT, "      return leaf.shape[k.index(MODEL)]", "      break",
       "the model width is not read from the metadata's model axis",
       ("tests/test_routing.py", "tests/test_model_layouts.py", "-k",
        "embedding_table or lm1b or nnx_logical")),
    _m("LT18", LAYOUT, "  return gains.most_common(1)[0][0] if gains else None", "  return None",
       "without an embedding table the model width is not read from the norm gains",
       ("tests/test_routing.py", "-k", "embedding_table")),
    _m("LT19", LAYOUT, "kernels.readings, roles or {}, kernels.orientation)",
       "kernels.readings, {}, kernels.orientation)",
       "the roles find_attention_layers' overrides give are not passed on",
       ("tests/test_heads.py", "-k", "overrides")),

    # ---------------------------------------------------------------- layout/attention.py
    _m("AT1", ATTENTION, '    singles[0].role = "query"  # q_einsum next to a fused kv_einsum',
       "    pass", "an unnamed einsum kernel next to a fused key/value one is not the query",
       ("tests/test_heads.py", "-k", "gemma or whatever_its_name")),
    _m("AT2", ATTENTION, "    if len(singles) == 3 and len(by_heads) == 1:  # GQA: only the "
       "query has all heads", "    if False:",
       "grouped-query attention: the query is not told by its larger head count",
       ("tests/test_heads.py", "-k", "grouped_query")),
    _m("AT3", ATTENTION, "    j = by_path.get(proj + (name,))", "    j = None",
       "a projection's bias is not found (QK-clip leaves it unscaled)"),
    _m("AT4", ATTENTION, "  return dims.pop() if len(dims) == 1 else None", "  return None",
       "a layer of 2-D kernels does not read its head size from its query/key norm"),
    _m("AT5", ATTENTION, "    out_in = orient[i] == OUT_IN if i < len(orient) else False",
       "    out_in = False", "[out, in] kernels (Equinox) have their heads looked for on the "
       "input side", ("tests/test_heads.py", "-k", "out_in")),

    # ---------------------------------------------------------------- training/run_dir_checks.py
    _m("RC1", RUN_DIR_CHECKS, "    if name not in recorded:\n      raise RunDirError(",
       "    if False:\n      raise RunDirError(",
       "a trainer name the record does not list is taken for the run's (and overwritten)"),
    _m("RC2", RUN_DIR_CHECKS, "    if WRITES[name] is None and path.is_symlink():",
       "    if False:", "a recorded file replaced by a symbolic link is written through"),
    _m("RC3", RUN_DIR_CHECKS, "path.stat().st_nlink > 1", "path.stat().st_nlink > 2",
       "a metrics.jsonl with another name (a hard link) is appended to"),
    _m("RC4", RUN_DIR_CHECKS, "    if fresh and path.is_symlink():", "    if False:",
       "--fresh deletes through a symbolic link"),
    _m("RC5", RUN_DIR_CHECKS,
       "      foreign += [step_dir / f for f in sorted(os.listdir(step_dir)) if f not in "
       "STEP_ENTRIES]", "      pass",
       "a file of the user's inside a checkpoint step folder is not found"),
    _m("RC6", RUN_DIR_CHECKS, 'if meta.get("fingerprint") != saved[step_dir.name] or ', "if ",
       "another run's step saved over one of this run's (same step number) is resumed from",
       ("tests/test_run_dir.py", "-k", "step_copied")),
    _m("RC7", RUN_DIR_CHECKS,
       '  if not any(m is not None and "fingerprint" in m and "step" in m for m in metas):',
       "  if False:",
       "a folder with a full config.json is taken for a run of 0.1, whatever its checkpoints"),
    _m("RC8", RUN_DIR_CHECKS, ' and "config.json" in recorded:', ":",
       "a user's config.json in --out, given as --config, is taken for the run's own"),
    _m("RC9", RUN_DIR_CHECKS, "foreign += [trash / n for n in (os.listdir(trash) if not foreign "
       "else []) if n not in WRITES]", "pass",
       "a file put into the folder of a killed --fresh is deleted with it"),

    # ---------------------------------------------------------------- training/previous_run.py
    _m("PR1", PREVIOUS_RUN, "          os.rename(trash / name, self.root / name)",
       "          pass", "a --fresh that cannot move a name leaves the others moved aside"),
    _m("PR2", PREVIOUS_RUN, "        write_record(self.record)  # the record as it was",
       "        pass", "a --fresh that cannot move a name leaves the record changed"),
    _m("PR3", PREVIOUS_RUN, "          moved.append(name)\n", "",
       "a --fresh that cannot move a name does not put back those it moved"),
    _m("PR4", PREVIOUS_RUN, "      if os.path.lexists(trash):\n        shutil.rmtree(trash)",
       "      if False:\n        shutil.rmtree(trash)",
       "--fresh leaves the previous run in its folder .fresh-removing"),

    # --------------------------------------------------------------- training/environment_errors.py
    _m("EE1", ENVIRONMENT_ERRORS, "    node = node.__cause__ or node.__context__",
       "    node = None", "a full disk wrapped in Orbax's error (its cause) is not recognised"),
    _m("EE2", ENVIRONMENT_ERRORS,
       "  return _chain_has(error, _DISK_FULL) or _chain_has(error, _READ_ONLY)",
       "  return _chain_has(error, _DISK_FULL)",
       "a read-only file system is not recognised in a log message"),
    _m("EE3", ENVIRONMENT_ERRORS,
       "if (isinstance(node, OSError) and node.errno in errnos) or _chain_has(str(node), kind):",
       "if _chain_has(str(node), kind):",
       "an OSError is recognised by its words only, not its errno"),
    _m("EE4", ENVIRONMENT_ERRORS,
       "  if isinstance(e, OSError) and e.errno in (errno.EACCES, errno.EPERM):", "  if False:",
       "no permission to write is not one line"),
    _m("EE5", ENVIRONMENT_ERRORS,
       '  if "RESOURCE_EXHAUSTED" in str(e) and "memory" in str(e).lower():',
       '  if "RESOURCE_EXHAUSTED" in str(e):',
       "any RESOURCE_EXHAUSTED is reported as the device's memory"),

    # ---------------------------------------------------------------- training/loop.py
    _m("LO1", SPECS,
       '  return sum(int(record[key]) for key in counter_keys(record, "skips"))',
       '  return max([int(record[key]) for key in counter_keys(record, "skips")], default=0)',
       "skipped steps of two skip wrappers are not added up", AREA_TESTS[BATCHES]),
    _m("LO2", BATCHES, "    if (step in f.nan_grad_steps or index in f.nan_grad_batch_indices",
       "    if (step in f.nan_grad_steps or step in f.nan_grad_batch_indices",
       "faults.nan_grad_batch_indices counts steps instead of data positions"),
    _m("LO3", BATCHES, "      scale = f.grad_scale_factor", "      scale = 1.0",
       "faults.grad_scale_factor is not applied"),
    _m("LO4", BATCHES, "    if self.consumed >= first:\n      self.skip(",
       "    if self.consumed > first:\n      self.skip(",
       "a rollback's skip starting at the current data position is deferred",
       equivalent="the stream is then at `first`, so the next Batches.next takes the deferred skip "
                  "before it draws a batch, and a checkpoint in between records it in "
                  "pending_skips, which a resume takes the same way"),
    _m("LO5", ACTIONS,
       "    if self.components.sampler is None or step >= self.components.total_steps:",
       "    if self.components.sampler is None or step > self.components.total_steps:",
       "the last step samples twice (periodic and final)"),
    _m("AC1", ACTIONS,
       "    return step % self.components.cfg.train.eval_every == 0 and step < "
       "self.components.total_steps",
       "    return step % self.components.cfg.train.eval_every == 0",
       "the last step is evaluated twice (periodic and final)"),
    _m("AC2", ACTIONS, "        self.deferred and step % cfg.train.log_every == 0)",
       "        self.deferred)",
       "a deferred checkpoint is retried at every step, not at log steps"),
    _m("LO6", ACTIONS, "        recent = (now - then) / (step - previous)",
       "        recent = now - then", "the early stop takes a whole interval as one step"),
    _m("LO7", BATCHES, "    while self.pending and self.consumed >= self.pending[0][0]:",
       "    while self.pending and self.consumed > self.pending[0][0]:",
       "a deferred skip is one batch late"),

    # ---------------------------------------------------------------- monitor/health.py
    _m("HE1", HEALTH, "  if g > thresholds.critical:", "  if g >= thresholds.critical:",
       "a norm exactly at the critical threshold is critical"),
    _m("HE2", HEALTH, "  if g > thresholds.high:", "  if g >= thresholds.high:",
       "a norm exactly at the high threshold is high"),
    _m("HE3", HEALTH, "  if thresholds.low is not None and g < thresholds.low:",
       "  if thresholds.low is not None and g <= thresholds.low:",
       "a norm exactly at the low threshold is low"),
    _m("HE4", HEALTH, "    if not self.high < self.critical:",
       "    if not self.high <= self.critical:",
       "high equal to critical is accepted"),
    _m("HE5", HEALTH, "  if g is None or not math.isfinite(g):", "  if g is None:",
       "a non-finite norm is not exploded"),
    _m("HE6", HEALTH, "    g = g / ref\n", "    pass\n",
       "a reference does not scale the boundaries"),

    # ---------------------------------------------------------------- monitor/stability_monitor.py
    _m("SM1", STABILITY_MONITOR, "    if prev is not None and steps > 0 and c >= prev:",
       "    if prev is not None and steps > 0 and c > prev:",
       "an unchanged counter falls back to the one-step flag"),
    _m("SM2", STABILITY_MONITOR, "    f = 1.0 if f > 0 else 0.0  # fraction",
       "    f = f  # fraction",
       "a Muon fallback flag counts the fraction of tensors, not one event"),
    _m("SM3", STABILITY_MONITOR, "    while self._entries and self._entries[0][0] <= start:",
       "    while self._entries and self._entries[0][0] < start:",
       "the window keeps one interval too many"),
    _m("SM4", STABILITY_MONITOR, "      out[specs.SKIP_RATE] = min(skip, 1.0)",
       "      out[specs.SKIP_RATE] = skip", "the combined skip rate can exceed 1"),
    _m("SM5", STABILITY_MONITOR,
       "    out[specs.ROLLBACKS] = float(sum(1 for c, _, _ in self._rollbacks "
       "if c > start))", "    out[specs.ROLLBACKS] = float(len(self._rollbacks))",
       "rollbacks older than the window still count"),
    _m("SM6", HEALTH, "    if level == old or (old is None and level == \"healthy\"):",
       "    if level == old:", "the first healthy record prints a line",
       tests=AREA_TESTS[STABILITY_MONITOR]),
    _m("SM7", STABILITY_MONITOR, "    exploded = skipped_nonfinite or (loss is not None and not "
       "math.isfinite(loss))", "    exploded = loss is not None and not math.isfinite(loss)",
       "a non-finite skip with a finite state norm is not exploded"),
    _m("SM8", STABILITY_MONITOR, "    if (not below and not advice) or self._clock < self.window:",
       "    if not below and not advice:", "advice is given before a full window was seen"),
    _m("SM9", STABILITY_MONITOR,
       "        and self._clock - self._last_advice_clock < self.advice_every):",
       "        and self._clock - self._last_advice_clock < 1):", "advice is not rate-limited"),
    _m("SM10", STABILITY_MONITOR, "    return sum(recent) / len(recent) >= sum(older) / len(older)",
       "    return sum(recent) / len(recent) > sum(older) / len(older)",
       "a flat loss is not a plateau"),
    _m("SM11", STABILITY_MONITOR,
       "          out[rate.name] = r if rate.tensors else min(r, 1.0)",
       "          out[rate.name] = r", "an event rate can exceed one per step"),
    _m("SM12", STABILITY_MONITOR, "    self._rollbacks = [[int(c), int(s), str(m)] for c, s, m in "
       "state[\"rollbacks\"]]", "    self._rollbacks = []",
       "rollbacks are lost over a save and restore"),
    _m("SM13", STABILITY_MONITOR,
       "    handled = any((_as_float(metrics.get(key)) or 0.0) > 0 for key in specs.acted_keys())",
       "    handled = False", "a transition a defence handled is warned about at once",
       tests=("tests/test_early_warnings.py", "-k", "handled")),
    _m("SM14", STABILITY_MONITOR,
       "    self._transitions.load_state_dict(state.get(\"held_transition\"))", "    pass",
       "a held transition is lost over a save and restore",
       tests=("tests/test_early_warnings.py", "-k", "checkpoint")),

    # ---------------------------------------------------------------- monitor/update_norm.py
    _m("UN1", UPDATE_NORM, "    if not self.active or was_active:\n      return []",
       "    if not self.active:\n      return []", "every record of an update-norm episode warns"),
    _m("UN2", UPDATE_NORM, "  if not (math.isfinite(norm) and norm > 0):\n    return None, {}",
       "  if not math.isfinite(norm):\n    return None, {}",
       "a skipped step's zero update enters the history"),
    _m("UN3", UPDATE_NORM, "    if len(past) < t.min_records:", "    if len(past) < 1:",
       "the rule warns before min_records values"),
    _m("UN4", UPDATE_NORM,
       "        self.held, self.length = None, 0\n        return []  # a short excursion",
       "        held, self.held, self.length = self.held, None, 0\n"
       "        return held + lines  # a short excursion",
       "a short excursion the stack handled still warns"),
    _m("UN7", UPDATE_NORM, "      if handled and self.length < self.max_records:",
       "      if handled and self.length < 1:", "a two-step handled excursion warns"),
    _m("UN5", UPDATE_NORM,
       "    if lines and handled and old_level in (None, \"healthy\") and level != \"healthy\":",
       "    if lines and old_level in (None, \"healthy\") and level != \"healthy\":",
       "a transition no defence acted on is held back too"),
    _m("UN6", UPDATE_NORM,
       "  if norm is None or lr is None or not (math.isfinite(lr) and lr > 0):",
       "  if norm is None or lr is None:", "a learning rate of 0 is divided by"),

    # ---------------------------------------------------------------- transforms/update_clip.py
    _m("UC1", UPDATE_CLIP,
       "      over = jnp.logical_and(jnp.isfinite(rms), rms > limit)  # a non-finite update passes",
       "      over = rms > limit  # a non-finite update passes",
       "a non-finite update is clipped (its finite entries zeroed)"),
    _m("UC2", UPDATE_CLIP, "  return jnp.where(rate > 0, x / jnp.where(rate > 0, rate, 1.0), 0.0)",
       "  return x", "the learning rate is not divided out"),
    _m("UC3", UPDATE_CLIP,
       "    return jnp.sqrt(jnp.mean(jnp.reshape(x, (x.shape[0], -1)), axis=1))",
       "    return jnp.sqrt(jnp.mean(x))", "a stacked leaf gets one RMS, not one per layer slice"),
    _m("UC4", UPDATE_CLIP, "    clipped_change = jnp.where(spike, mean + zt * std, change)",
       "    clipped_change = change", "a spike of the update norm is not clipped"),
    _m("UC5", UPDATE_CLIP, "        last_norm=jnp.where(usable, norm * scale, state.last_norm),",
       "        last_norm=jnp.where(usable, norm, state.last_norm),",
       "the next change is measured from the unclipped norm (a jump passes after one step)"),
    _m("UC6", UPDATE_CLIP,
       "    measured = jnp.logical_and(usable, state.last_norm > 0)  # a change exists",
       "    measured = state.last_norm > 0  # a change exists",
       "a NaN or zero update norm enters the statistics"),
    _m("UC7", UPDATE_CLIP,
       "        count=_common.safe_increment(state.count), max_rms=largest,",
       "        count=state.count, max_rms=largest,",
       "the learning-rate schedule is always read at count 0"),

    # ---------------------------------------------------------------- transforms/compensated.py
    _m("CU1", COMPENSATED,
       "  new_compensation = ((t.astype(jnp.float32) - p32) - y).astype(jnp.asarray(compensation)"
       ".dtype)", "  new_compensation = jnp.zeros_like(jnp.asarray(compensation))",
       "the buffer never keeps what rounding lost (plain bf16 addition)"),
    _m("CU2", COMPENSATED,
       "  y = jnp.asarray(update).astype(jnp.float32) - jnp.asarray(compensation)"
       ".astype(jnp.float32)",
       "  y = jnp.asarray(update).astype(jnp.float32) + jnp.asarray(compensation)"
       ".astype(jnp.float32)", "the buffer is added with the wrong sign"),
    _m("CU3", COMPENSATED,
       "  noise = jax.random.bits(key, x.shape, jnp.uint32) & jnp.uint32(0xFFFF)",
       "  noise = jnp.full(x.shape, 0x8000, jnp.uint32)",
       "stochastic rounding rounds to nearest"),
    _m("CU4", COMPENSATED, "    step_key = jax.random.fold_in(base_key, state.count)",
       "    step_key = base_key", "every step draws the same random bits"),
    _m("CU5", COMPENSATED,
       "  if ctx.model is not None and ctx.model.param_dtype not in _LOW_PRECISION_DTYPES:",
       "  if ctx.model is not None and ctx.model.param_dtype in _LOW_PRECISION_DTYPES:",
       "the trainer compensates float32 parameters and not bfloat16 ones"),

    # ---------------------------------------------------------------- transforms/hyperball.py
    _m("HB1", HYPERBALL,
       "  scale = jnp.where(new_sq > 0, r * jax.lax.rsqrt(jnp.where(new_sq > 0, new_sq, 1.0)), "
       "0.0)", "  scale = jnp.ones_like(new_sq)",
       "the moved matrix is not projected back to the sphere of its initial norm"),
    _m("HB2", HYPERBALL, "    c = rate * r\n", "    c = rate\n",
       "the step after a learning-rate scale is not relative to ||W0||"),
    _m("HB3", HYPERBALL,
       "  reduce = tuple(lead + a for a in layout.axes if a != layout.fused)",
       "  reduce = tuple(range(lead, x.ndim))",
       "the matrices of a scan-stacked leaf (and the parts of a fused one) share one norm"),
    _m("HB4", HYPERBALL, "  if layout.fused is None:\n    return sums",
       "  if True:\n    return sums",
       "each column of a fused kernel is kept at its own norm, not each part"),
    _m("HB5", HYPERBALL, "        count=_common.safe_increment(state.count), norms=state.norms,",
       "        count=state.count, norms=state.norms,",
       "the learning-rate schedule is always read at count 0"),
    _m("HB6", HYPERBALL, "    if decay:\n", "    if False:\n",
       "weight decay on the Hyperball matrices is accepted"),
    _m("HB7", HYPERBALL,
       "    before_scale=lambda c, ctx: normalize_matrix_updates(_matrices(ctx)),",
       "    before_scale=None,",
       "the trainer's Hyperball step takes the update's own size (the optimizer's rate times the "
       "direction's norm) instead of the rate"),
    _m("DF6", DEFENCE, "    update_scale = stateless_prefix(before, update_scale)",
       "    update_scale = update_scale",
       "a defence's half before the learning-rate scale is left out of the chain",
       tests=("tests/test_hyperball.py", "-k", "trainer")),

    # ---------------------------------------------------------- declarations and their counters
    _m("SP3", SPECS,
       r'pattern = re.compile(rf"{re.escape(spec.prefix)}(_\d+)?/{re.escape(name)}")',
       r'pattern = re.compile(rf"{re.escape(spec.prefix)}/{re.escape(name)}")',
       "the counters of a repeated prefix (skip_spikes_1/...) are left out"),
    _m("SP4", SPECS, '  return sum(int(record[key]) for key in counter_keys(record, "skips"))',
       '  return sum(int(record[key]) for key in counter_keys(record, "rollback"))',
       "rollback requests are counted as skipped steps"),
    _m("DF3", DEFENCE,
       "  if not declaration.name.isidentifier() or declaration.name in RESERVED_NAMES:",
       "  if not declaration.name.isidentifier():", "a defence may take the optimizer's key"),
    _m("DF4", DEFENCE, "key=lambda d: (d.position, d.order, d.name)",
       "key=lambda d: (d.order, d.name)", "the chain is ordered without the positions"),
    _m("DF5", DEFENCE, "  if (declaration.factory is None) == (declaration.build is None):",
       "  if False:", "a declaration with neither a factory nor a builder is accepted"),

    # ---------------------------------------------------------------- restoring by name
    _m("RB1", RESTORE_PLAN, "    elif key not in layouts:\n      result.fresh.append(key)",
       "    elif key not in layouts:\n      result.dropped.append(key)",
       "a defence switched on is said to be dropped"),
    _m("RB2", RESTORE_PLAN,
       "    elif layouts[key] == now or (result.new_params and _subset(layouts[key], now)):",
       "    elif True:", "an entry whose layout changed is read into the new layout"),
    _m("RB3", RESTORE_PLAN, "  if not same_optimizer:\n    if not (reset_optimizer",
       "  if False:\n    if not (reset_optimizer",
       "another optimizer's state is read into this one"),
    _m("RB4", RESTORE_PLAN, "  result.dropped = sorted(k for k in layouts if k not in current_opt)",
       "  result.dropped = []", "a defence switched off is not said"),
    _m("RB5", RESTORE_PLAN,
       "      return jnp.array(applied, leaf.dtype, copy=True)  # its own buffer: states are "
       "donated",
       "      return leaf", "a reset optimizer starts the learning-rate schedule over"),

    # ---------------------------------------------------------------- the log-norm spike rule
    _m("S31", SPIKE_SKIP,
       "    threshold = jnp.minimum(threshold, log_sigma_threshold(history, count, sigma))",
       "    threshold = jnp.minimum(threshold, mean + _common.f32(sigma) * std)",
       "statistics='log_norm' uses the linear sigma rule",
       tests=("tests/test_early_warnings.py", "-k", "log_norm")),
    _m("S32", SPIKE_SKIP, "log_scale=rule.statistics == \"log_norm\")",
       "log_scale=False)", "the gradient norm's window is not read on the log scale",
       tests=("tests/test_early_warnings.py", "-k", "log_norm")),
    _m("S33", SPIKE_SKIP, "  mean, std = window_stats(logs, count)\n",
       "  mean, std = window_stats(logs, count, ddof=1)\n",
       "the log rule uses the unbiased std",
       tests=("tests/test_early_warnings.py", "-k", "log_norm")),

    # ---------------------------------------------------------------- step 1, repeated batches
    _m("LO8", ACTIONS, "    return step == 1 or step % self.components.cfg.train.log_every == 0",
       "    return step % self.components.cfg.train.log_every == 0", "step 1 is not logged"),
    _m("LO9", BATCHES,
       "      if self.repeated is None:\n        self.repeated = np.asarray(tokens)",
       "      if True:\n        self.repeated = np.asarray(tokens)",
       "faults.repeat_batch_steps serves fresh batches"),
    _m("OP9", OPTIM, "learning_rates=parameter_learning_rates(cfg, schedules),",
       "learning_rates=None,",
       "the trainer's update clips do not divide out the optimizer's learning rates",
       tests=("tests/test_update_clip.py", "-k", "trainer")),
    # The gradient health level's history (monitor/health.py's GradientHealth) is read through
    # the monitor: the monitor's tests kill these.
    _m("SM15", HEALTH, "    if len(recent) < t.min_history:",
       "    if len(recent) < 1:", "relative levels start before min_history norms were logged",
       tests=AREA_TESTS[STABILITY_MONITOR]),
    _m("SM16", HEALTH,
       "    while self._grad_norms and self._grad_norms[0][0] <= clock - t.window:",
       "    while False:", "norms older than the window stay in the reference",
       tests=AREA_TESTS[STABILITY_MONITOR]),
    _m("SM17", HEALTH, "    reference = statistics.median(recent)",
       "    reference = sum(recent) / len(recent)",
       "the reference is the mean (one spike moves it)", tests=AREA_TESTS[STABILITY_MONITOR]),
    _m("SM18", HEALTH,
       "        level = \"exploded\" if not math.isfinite(g) else \"healthy\"",
       "        level = grad_health_level(g, t)",
       "before the reference exists, norms are judged as absolute",
       tests=AREA_TESTS[STABILITY_MONITOR]),
    _m("SM19", HEALTH,
       "            \"grad_norms\": [list(x) for x in self._grad_norms]}", "            }",
       "the relative reference is lost over a save and restore",
       tests=AREA_TESTS[STABILITY_MONITOR]),
]

COPIED = ("stablejax", "tests", "train.py", "pyproject.toml", "README.md", "examples",
          "bench", "docs")


def apply(source: str, mutant: Mutant) -> str:
  count = source.count(mutant.find)
  if count != 1:
    raise ValueError(f"mutant {mutant.id}: its snippet occurs {count} times in {mutant.path} "
                     f"(must be once): {mutant.find!r}")
  return source.replace(mutant.find, mutant.replace)


def check(mutants: Sequence[Mutant] = MUTANTS) -> list[str]:
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


def select(mutants: Sequence[Mutant], only: Optional[Sequence[str]] = None,
           modules: Optional[Sequence[str]] = None) -> list[Mutant]:
  """The mutants named by id (`only`) or by module (`modules`: "zclip" or "transforms/zclip")."""
  def in_module(m: Mutant) -> bool:
    return any(m.module == name or m.module.endswith("/" + name)
               for name in (n.removesuffix(".py") for n in modules or ()))
  return [m for m in mutants if (not only or m.id in only) and (not modules or in_module(m))]


def _pytest(copy: Path, tests: tuple, timeout: float) -> tuple[str, float]:
  env = dict(os.environ, PYTHONPATH=str(copy), PYTHONDONTWRITEBYTECODE="1")
  t0 = time.monotonic()
  try:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                           "-p", "no:randomly", *tests], cwd=copy, env=env, capture_output=True,
                          text=True, timeout=timeout)
  except subprocess.TimeoutExpired:
    return "timeout", time.monotonic() - t0
  # 0: all passed; 1: a test failed; anything else (collection error, interrupted, 5: no test
  # selected) also counts as a failure of the suite, but is reported apart.
  status = {0: "passed", 1: "failed"}.get(proc.returncode, f"error {proc.returncode}")
  return status, time.monotonic() - t0


def rate_table(results: list[tuple[Mutant, bool]]) -> list[str]:
  """Lines of the per-module table: mutants, killed, equivalent, kill rate; then the total."""
  per: collections.defaultdict[str, list[int]] = collections.defaultdict(lambda: [0, 0, 0])
  for m, killed in results:
    row = per[m.module]
    row[0] += 1
    row[1] += killed
    row[2] += bool(m.equivalent)
  lines = [f"{'module':28} {'mutants':>7} {'killed':>6} {'equiv.':>6}  kill rate"]
  for module, (n, k, e) in sorted(per.items()):
    lines.append(f"{module:28} {n:7d} {k:6d} {e:6d}  {k / n:.0%}")
  n = len(results)
  k = sum(killed for _, killed in results)
  e = sum(bool(m.equivalent) for m, _ in results)
  lines.append(f"{'all':28} {n:7d} {k:6d} {e:6d}  {k / max(n, 1):.0%}")
  return lines


def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--only", nargs="*", help="mutant ids to run")
  parser.add_argument("--module", nargs="*", help="modules to run (zclip, transforms/zclip, ...)")
  parser.add_argument("--check", action="store_true", help="only check the mutants apply")
  parser.add_argument("--list", action="store_true", help="list the mutants, do not run them")
  parser.add_argument("--timeout", type=float, default=900, help="seconds per mutant")
  args = parser.parse_args(argv)
  problems = check()
  if problems:
    for p in problems:
      print(f"error: {p}", file=sys.stderr)
    return 2
  mutants = select(MUTANTS, args.only, args.module)
  if not mutants:
    print("error: no mutant matches --only/--module: see --list", file=sys.stderr)
    return 2
  if args.check:
    print(f"{len(mutants)} mutants apply cleanly")
    return 0
  if args.list:
    for m in mutants:
      note = f"  [equivalent: {m.equivalent}]" if m.equivalent else ""
      print(f"{m.id:5} {m.module:24} {m.what}{note}")
    print(f"{len(mutants)} mutants in {len({m.module for m in mutants})} modules")
    return 0
  results: list[tuple[Mutant, bool]] = []
  with tempfile.TemporaryDirectory(prefix="stablejax-mutation-") as tmp:
    copy = Path(tmp) / "repo"
    copy.mkdir()
    for name in COPIED:
      src = ROOT / name
      if src.is_dir():
        shutil.copytree(src, copy / name, ignore=shutil.ignore_patterns("__pycache__", "_build"))
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
      print(f"baseline {' '.join(tests)[:90]}: {status} ({seconds:.0f}s)", flush=True)
      if status != "passed":
        print("error: the unmutated code fails these tests; fix that first", file=sys.stderr)
        return 2
    for m in mutants:
      target = copy / m.path
      original = target.read_text()
      target.write_text(apply(original, m))
      try:
        status, seconds = _pytest(copy, m.tests, args.timeout)
      finally:
        target.write_text(original)
      killed = status != "passed"
      results.append((m, killed))
      verdict = "killed" if killed else ("equivalent" if m.equivalent else "SURVIVED")
      print(f"{m.id:5} {verdict:10} {status:9} {seconds:5.0f}s  {m.module}: {m.what}", flush=True)
  print()
  for line in rate_table(results):
    print(line)
  n_killed = sum(k for _, k in results)
  print(f"kill rate: {n_killed}/{len(results)} = {n_killed / len(results):.0%}")
  survivors = [m for m, k in results if not k]
  for m in survivors:
    why = f"equivalent: {m.equivalent}" if m.equivalent else "NOT EQUIVALENT: add a test"
    print(f"survivor {m.id} ({m.module}: {m.what}): {why}")
  wrong = [m for m, k in results if (k and m.equivalent) or (not k and not m.equivalent)]
  for m in wrong:
    if m.equivalent:
      print(f"error: {m.id} is listed as equivalent but was killed: fix its entry",
            file=sys.stderr)
  return 1 if wrong else 0


if __name__ == "__main__":
  sys.exit(main())
