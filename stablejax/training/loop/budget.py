"""Time budget, target loss and peak memory of a training run.

``train.time_budget_minutes``: before the first step, the compiled train step, an evaluation (with
its sample) and a checkpoint save are timed on throw-away copies (the run's own state, data and
checkpoints are untouched), and the total step count is fixed so that the whole run (start-up
already spent, the compilation a resumed segment pays again, the steps, the periodic evals and
saves, the final eval and save) ends within the budget with a safety margin (``SAFETY``). The
warmup + cosine schedule is then laid over that count, so the learning rate reaches its floor on
the last step; the count is an argument of the compiled step, so the steps the probe timed are
the ones the run calls. The count is stored in every checkpoint with the measured timings: a
resumed run keeps it, counts the wall time of every earlier segment (``Budget``) and still stops
early once the budget runs out. Unless ``train.steps`` is given next to the budget
(``config.load_config``), the budget alone fixes the count; a given one is an upper bound, and
``summary.json``'s ``steps_fixed_by`` says which.

``train.target_val_loss``: the first evaluation with a validation loss below it sets
``time_to_target_s`` (wall time since the run started, summed over resumes) and
``step_to_target``; both stay null when it is never reached.

Peak memory: the backend's ``memory_stats()`` (``peak_bytes_in_use`` against ``bytes_limit``,
the largest over this process's devices) where it has them (GPUs, TPUs); otherwise the process's
peak resident memory (``ru_maxrss``) against the machine's physical memory, labelled as such.
"""

from __future__ import annotations

import dataclasses
import math
import os
import resource
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from stablejax.training.launch import distributed
from stablejax.training.config import Config, ConfigError, TrainConfig

if TYPE_CHECKING:  # components.py imports this module
  from stablejax.training.loop.components import Components
  from stablejax.training.loop.step import TrainState

SAFETY = 0.95          # plan for this fraction of the remaining budget
TIMED_STEPS = 5        # steps timed after the compiling one; the slowest counts


class BudgetError(ConfigError):
  """A budget too small for the run; one line naming the fix."""


@dataclasses.dataclass
class Timings:
  step_seconds: float      # one compiled train step, data included
  eval_seconds: float      # one evaluation (all eval batches)
  save_seconds: float      # one checkpoint save, waited for
  compile_seconds: float   # compiling the train and eval steps (paid again by a resumed
                           # segment)
  diagnostics_seconds: float = 0.0  # one run of the periodic diagnostics (activations, grad norms)
  sample_seconds: float = 0.0       # one printed sample (logging.sample_*; 0 when off)


def plan_total_steps(budget_seconds: float, elapsed_seconds: float, t: Timings, *,
                     eval_every: int, checkpoint_every: int, max_steps: Optional[int],
                     diagnostics_every: int = 0, sample_every: int = 0,
                     safety: float = SAFETY) -> int:
  """Total steps that fit: start-up + a resumed segment's compile + N x (step + eval/eval_every
  + save/ckpt_every + diagnostics/diagnostics_every + sample/sample_every) + the final eval,
  sample and save <= safety x budget. Capped at ``max_steps`` (None: no cap); may be <= 0."""
  available = (safety * budget_seconds - elapsed_seconds - t.compile_seconds
               - t.eval_seconds - t.sample_seconds - t.save_seconds)
  per_step = (t.step_seconds + t.eval_seconds / eval_every + t.save_seconds / checkpoint_every
              + (t.diagnostics_seconds / diagnostics_every if diagnostics_every else 0.0)
              + (t.sample_seconds / sample_every if sample_every else 0.0))
  steps = math.floor(available / per_step)
  return int(steps if max_steps is None else min(max_steps, steps))


def _timed(fn: Callable[..., Any], *args: Any) -> float:
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  return time.perf_counter() - t0


PROBE_DIR = "budget_probe"  # scratch checkpoint directory of the measured save, in the run dir


def measure(components: Components, state: TrainState, out_dir: Path,
            check: Callable[[str], None] = lambda phase: None) -> Timings:
  """Times the compiled step, an eval, a sample and a save of the run's ``components`` (a
  :class:`stablejax.training.loop.components.Components`) without changing the run.

  Steps run on a copy of ``state`` with batches from a fresh data iterator; the save goes to a
  scratch checkpoint directory (``out_dir/PROBE_DIR``) that is deleted afterwards.
  ``check(phase)`` is called between the measurements (the trainer stops there when
  interrupted: it raises).

  Multi-process: the save is collective, so every process writes its shards into the one scratch
  directory; process 0 alone clears it before (what a killed probe left) and removes it after,
  each time behind a barrier, so no process deletes files another is writing.
  """
  from stablejax.training.checkpoint import Checkpoints

  state = jax.tree.map(jnp.copy, state)
  batches = components.data.train_iter()

  def one_step(state: TrainState, step: int) -> TrainState:
    # The probe's own steps 0, 1, ...: the first reads its metrics, the timed ones mostly not, as
    # most of the run's steps
    batch = components.step_batch(np.asarray(next(batches)["tokens"], np.int32), step=step)
    state, metrics = components.train_step(state, batch)
    jax.block_until_ready(metrics)
    return state

  phase = "measuring the time budget"
  t0 = time.perf_counter()
  state = one_step(state, 0)
  compile_seconds = time.perf_counter() - t0
  check(phase)
  times = []
  for step in range(1, TIMED_STEPS + 1):
    t0 = time.perf_counter()
    state = one_step(state, step)
    times.append(time.perf_counter() - t0)

  params = state.params
  val = components.val_batches()
  evaluate = lambda: [components.eval_step(params, b, jnp.int32(0)) for b in val]  # noqa: E731
  eval_compile = _timed(evaluate)  # compiles; a resumed segment compiles it again
  eval_seconds = _timed(evaluate)
  compile_seconds += max(0.0, eval_compile - eval_seconds)
  sample_seconds = 0.0
  if components.sampler is not None:
    components.sampler(params, 0)  # compiles
    t0 = time.perf_counter()
    components.sampler(params, 0)
    sample_seconds = time.perf_counter() - t0
  check(phase)

  scratch = Path(out_dir) / PROBE_DIR
  if distributed.is_main():
    shutil.rmtree(scratch, ignore_errors=True)
  distributed.barrier("budget_probe_clear")  # cleared before any process writes into it
  probe = Checkpoints(scratch, keep=1, async_save=components.cfg.checkpoint.async_save)
  try:
    t0 = time.perf_counter()
    probe.save(0, state, components.data.train_iter(), {"probe": True})
    probe.wait()
    save_seconds = time.perf_counter() - t0
  finally:
    probe.close()
    distributed.barrier("budget_probe")  # every process is done with the scratch directory
    if distributed.is_main():
      shutil.rmtree(scratch, ignore_errors=True)
  check(phase)
  diagnostics_seconds = 0.0
  if _diagnostics_every(components.cfg) and val:
    tokens = val[0]
    diagnose = lambda: (components.activation_stats(params, tokens, jnp.int32(0)),  # noqa: E731
                        components.grad_norms(params, tokens))
    first = _timed(diagnose)  # compiles; a resumed segment compiles them again
    diagnostics_seconds = _timed(diagnose)
    compile_seconds += max(0.0, first - diagnostics_seconds)
    check(phase)
  return Timings(max(times), eval_seconds, save_seconds, compile_seconds, diagnostics_seconds,
                 sample_seconds)


def _diagnostics_every(cfg: Config) -> int:
  """Steps between diagnostics runs (the more frequent of the two kinds; 0 when off)."""
  every = [n for n in (cfg.logging.activation_every, cfg.logging.histogram_every) if n]
  return min(every) if every else 0


def _sample_every(cfg: Config) -> int:
  """Steps between printed samples (logging.sample_every; None: every eval; 0 when off)."""
  every = cfg.logging.sample_every
  return cfg.train.eval_every if every is None else every


CLOCK_FILE = "budget_clock.json"  # the run's wall time so far, in the run directory
CLOCK_INTERVAL = 5.0               # seconds between two writes of it (at log steps)


class Budget:
  """The time budget's step count, the target-loss record and the run's wall time over resumes.

  The wall time of a run is the sum over its segments (a resumed run is a new segment): the
  checkpoint stores it, and so does ``CLOCK_FILE`` (written atomically at log steps, at most
  every ``CLOCK_INTERVAL`` seconds, and by a heartbeat every ``CLOCK_INTERVAL`` seconds in a
  budgeted run, `start_heartbeat`), so the time a killed segment spent after its last
  checkpoint counts too, up to its last write: a SIGKILL in the start-up's probe or a
  compilation included. The plan (step count, measured timings, what fixed the length) is
  stored in every checkpoint, so a resumed run keeps it and still stops early when the budget
  runs out (``out_of_time``).
  """

  def __init__(self, train_cfg: TrainConfig, t_start: float, clock_file: Optional[Path] = None):
    self.budget_minutes = train_cfg.time_budget_minutes
    self.max_steps: Optional[int] = train_cfg.steps  # None: the budget alone fixes the count
    self.target = train_cfg.target_val_loss
    self.t_start = t_start
    self.clock_file = clock_file
    self.prior_seconds = 0.0      # wall time of earlier segments of a resumed run
    self.segments = 1             # this segment and the earlier ones
    self.steps: Optional[int] = None
    self.fixed_by = "train.steps"  # what fixed the step count: "train.steps" or "time_budget"
    self.timings: Optional[Timings] = None
    self.time_to_target: Optional[float] = None
    self.step_to_target: Optional[int] = None
    self.stopped_at: Optional[int] = None  # step at which out_of_time() ended the run early
    self._clock_written = -math.inf
    self._clock_lock = threading.Lock()  # the heartbeat's thread and the loop both write it
    self._heartbeat: Optional[tuple[threading.Thread, threading.Event]] = None

  @property
  def active(self) -> bool:
    return self.budget_minutes is not None

  @property
  def budget_seconds(self) -> float:
    """The budget in seconds (infinite without one)."""
    return math.inf if self.budget_minutes is None else self.budget_minutes * 60.0

  def elapsed(self) -> float:
    return self.prior_seconds + time.time() - self.t_start

  def load_state_dict(self, meta: dict, owns_clock: bool = False) -> None:
    """Restores what a checkpoint's metadata holds (``{}`` for a fresh run: nothing to restore).

    The earlier segments' wall time is the larger of the checkpoint's and the clock file's. The
    clock counts without a checkpoint too when it is this run's (``owns_clock``: the run
    directory's record lists it), so a start killed before its first checkpoint is a segment.
    """
    if not meta:
      clock = _read_clock(self.clock_file) if owns_clock else None
      if clock is not None:
        self.prior_seconds, self.segments = clock["elapsed_seconds"], clock["segments"] + 1
      return
    prior = float(meta.get("elapsed_seconds", 0.0))
    segments = int(meta.get("budget_segments", 1))
    clock = _read_clock(self.clock_file)
    if clock is not None and clock["elapsed_seconds"] >= prior:
      prior, segments = clock["elapsed_seconds"], max(segments, int(clock["segments"]))
    self.prior_seconds, self.segments = prior, segments + 1
    self.steps = meta.get("budget_steps", self.steps)
    self.fixed_by = meta.get("steps_fixed_by", self.fixed_by)
    if meta.get("budget_timings"):
      self.timings = Timings(**meta["budget_timings"])
    self.time_to_target = meta.get("time_to_target_s")
    self.step_to_target = meta.get("step_to_target")

  def state_dict(self) -> dict:
    return {"elapsed_seconds": self.elapsed(), "budget_segments": self.segments,
            "budget_steps": self.steps, "steps_fixed_by": self.fixed_by,
            "budget_timings": dataclasses.asdict(self.timings) if self.timings else None,
            "time_to_target_s": self.time_to_target, "step_to_target": self.step_to_target}

  def tick(self, force: bool = False) -> None:
    """Writes the wall time so far to the clock file (process 0; throttled unless `force`)."""
    now = time.time()
    if self.clock_file is None or not distributed.is_main() or (
        not force and now - self._clock_written < CLOCK_INTERVAL):
      return
    from stablejax.training.checkpoint import write_json_atomic
    with self._clock_lock:
      write_json_atomic(self.clock_file, {"elapsed_seconds": self.elapsed(),
                                          "segments": self.segments})
      self._clock_written = now

  def start_heartbeat(self, interval: float = CLOCK_INTERVAL) -> None:
    """Writes the clock file every ``interval`` seconds from a background thread until
    `stop_heartbeat` (a budgeted run, process 0; call it once the run's record lists the clock):
    a segment killed at any moment, even in the start-up's probe or a long compilation, counts
    up to its last beat."""
    if (not self.active or self.clock_file is None or not distributed.is_main()
        or self._heartbeat is not None):
      return
    stop = threading.Event()

    def beat() -> None:
      while not stop.wait(interval):
        try:
          self.tick(force=True)
        except Exception:  # noqa: BLE001 - a full disk: the loop meets it at its next write
          pass

    thread = threading.Thread(target=beat, name="budget-clock", daemon=True)
    self._heartbeat = (thread, stop)
    thread.start()

  def stop_heartbeat(self) -> None:
    if self._heartbeat is not None:
      thread, stop = self._heartbeat
      self._heartbeat = None
      stop.set()
      thread.join(timeout=30)

  def plan(self, components: Components, state: TrainState, out_dir: Path,
           check: Callable[[str], None] = lambda phase: None) -> Optional[int]:
    """The total step count (measured now, or the one a checkpoint stored); None without budget.

    Without a cap (``train.steps`` null) the count is what fits in the budget; with one, the
    smaller of the two, and ``fixed_by`` says which.
    """
    if not self.active:
      return None
    if self.steps is not None:
      if self.timings is None:  # a checkpoint of a version that did not store them: re-measure
        self.timings = measure(components, state, out_dir, check)
      return self.steps
    cfg = components.cfg
    self.timings = measure(components, state, out_dir, check)
    fits = plan_total_steps(self.budget_seconds, self.elapsed(), self.timings,
                            eval_every=cfg.train.eval_every,
                            checkpoint_every=cfg.checkpoint.every, max_steps=None,
                            diagnostics_every=_diagnostics_every(cfg),
                            sample_every=(_sample_every(cfg) if components.sampler is not None
                                          else 0))
    # Every process measured its own timings: all take the smallest count, or they would part.
    fits = -int(distributed.agree_max(np.array(-fits)))
    steps = fits if self.max_steps is None else min(self.max_steps, fits)
    if steps <= cfg.train.warmup_steps:
      raise BudgetError(
          f"train.time_budget_minutes={self.budget_minutes} leaves time for {max(steps, 0)} steps "
          f"({self.timings.step_seconds:.3f} s each, evals {self.timings.eval_seconds:.1f} s, "
          f"saves {self.timings.save_seconds:.1f} s, compile {self.timings.compile_seconds:.1f} "
          f"s, {self.elapsed():.0f} s already spent), not more than train.warmup_steps="
          f"{cfg.train.warmup_steps}: raise the budget or lower the warmup")
    self.steps = steps
    self.fixed_by = "train.steps" if steps < fits else "time_budget"
    return steps

  def out_of_time(self, recent_step_seconds: Optional[float] = None) -> bool:
    """Whether another step, the final eval and sample and the final save would end past the
    budget (the plan was made for a faster or quieter machine, or earlier segments of a resumed
    run used part of it): the run then stops early, with a warning, and its learning rate does
    not reach the floor. A step takes the measured time, or `recent_step_seconds` (the steps
    since the previous check) when that is longer."""
    if not self.active or self.timings is None:
      return False
    t = self.timings
    step = max(t.step_seconds, recent_step_seconds or 0.0)
    return (self.elapsed() + step + t.eval_seconds + t.sample_seconds + t.save_seconds
            > self.budget_seconds)

  def describe_length(self, steps: int) -> str:
    """What fixed the step count, for the banner."""
    if not self.active:
      return "train.steps"
    if self.fixed_by == "time_budget":
      return f"fixed by train.time_budget_minutes={self.budget_minutes:g}"
    return (f"train.steps={steps}, below what train.time_budget_minutes={self.budget_minutes:g}"
            f" allows")

  def describe(self) -> str:
    t = self.timings
    if self.segments > 1:
      return (f"time budget {self.budget_minutes} min: {self.steps} steps (from the checkpoint; "
              f"{self.prior_seconds:.0f} s spent in {self.segments - 1} earlier segment(s), "
              f"{self.elapsed():.0f} s in all)")
    assert t is not None
    return (f"time budget {self.budget_minutes} min: {self.steps} steps (step {t.step_seconds:.3f} "
            f"s, eval {t.eval_seconds:.2f} s, save {t.save_seconds:.2f} s, compile "
            f"{t.compile_seconds:.1f} s, {self.elapsed():.0f} s spent before training)")

  def check_target(self, step: int, val_loss: float) -> bool:
    """Records the first eval below the target; True when that happened now."""
    if self.target is None or self.step_to_target is not None or not val_loss < self.target:
      return False
    self.time_to_target, self.step_to_target = self.elapsed(), int(step)
    return True

  def summary(self) -> dict[str, Any]:
    elapsed = self.elapsed()
    out: dict[str, Any] = {"time_budget_minutes": self.budget_minutes, "planned_steps": self.steps,
           "steps_fixed_by": self.fixed_by,
           "stopped_early_at": self.stopped_at, "segments": self.segments,
           "within_time_budget": (elapsed <= self.budget_seconds) if self.active else None,
           "target_val_loss": self.target, "time_to_target_s": self.time_to_target,
           "step_to_target": self.step_to_target}
    if self.timings is not None:
      out["budget_timings"] = dataclasses.asdict(self.timings)
    return out


def _read_clock(path: Optional[Path]) -> Optional[dict]:
  """The clock file's contents; None when there is none or it is unreadable (then the
  checkpoint's own time counts: the clock only refines it)."""
  import json
  if path is None:
    return None
  try:
    clock = json.loads(Path(path).read_text())
    return {"elapsed_seconds": float(clock["elapsed_seconds"]),
            "segments": int(clock.get("segments", 1))}
  except (OSError, ValueError, KeyError, TypeError):
    return None


def peak_memory() -> dict:
  """``peak_memory_bytes``, ``peak_memory_fraction`` and ``peak_memory_source``."""
  stats = []
  for device in jax.local_devices():
    try:
      s = device.memory_stats()
    except Exception:  # noqa: BLE001 - backends without statistics raise or return None
      s = None
    if s and "peak_bytes_in_use" in s:
      stats.append(s)
  if stats:
    top = max(stats, key=lambda s: s["peak_bytes_in_use"])
    limit = top.get("bytes_limit")
    return {"peak_memory_bytes": int(top["peak_bytes_in_use"]),
            "peak_memory_fraction": top["peak_bytes_in_use"] / limit if limit else None,
            "peak_memory_source": "device memory_stats peak_bytes_in_use / bytes_limit "
                                  "(largest over this process's devices)"}
  rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  rss *= 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
  try:
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (ValueError, OSError, AttributeError):
    total = None
  return {"peak_memory_bytes": int(rss), "peak_memory_fraction": rss / total if total else None,
          "peak_memory_source": "process peak resident memory (ru_maxrss) / physical memory; "
                                "the backend has no device memory statistics"}
