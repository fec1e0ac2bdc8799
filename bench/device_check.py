"""One prepared command for a GPU or TPU host: the Newton-Schulz kernels and the trainer's step.

Usage:
  python -m bench.device_check                    # GPT-2 shapes: the check to run on a GPU/TPU
  python -m bench.device_check --dry              # tiny shapes, any machine, a minute (CI runs it)
  python -m bench.device_check --peak-tflops 989  # MFU against this peak instead of the table's
  python -m bench.device_check --out check.json   # where the JSON goes (default device_check.json)

Three sections, each timed on the machine's default device, one JSON file and printed tables:

1. Newton-Schulz (`stablejax.newton_schulz`, 5 standard steps) at GPT-2 shapes 768x768,
   768x3072 and 12x768x768, bfloat16 and float32: the Pallas kernel (`backend="pallas"`: Triton
   on CUDA, Mosaic on TPU; Pallas interpret mode on a CPU) against the XLA reference
   (`backend="xla"`; float32 products at `jax.default_matmul_precision("highest")`, the
   arithmetic the kernel does): the largest difference of their outputs, absolute and relative
   to the largest entry, time per call and TFLOP/s, and whether the lowered function holds the
   kernel's custom call (a kernel that silently fell back to XLA would pass every other check).
   Then the same for Gram Newton-Schulz (`method="gram"`) at the shapes where it runs (those
   where it takes fewer FLOPs: 768x3072), with its time over the standard kernel's.
2. The trainer's train step (`stablejax.training.loop.step`, built by `bench._common.trainer_step`)
   for the packaged `gpt2_small` config on random tokens: the full stability stack (the config's
   chain around outlier-safe Muon) and `clip_by_global_norm(1.0)` + AdamW, and the minimal
   nanoGPT-shaped loop of `bench.peer_step` at the same size ("peer": same d_model, layers,
   heads, batch and compute dtype, remat as configured, cuDNN attention on a CUDA GPU), compiled
   and timed in the same run, interleaved: ms per step, tokens/s and its ratio to the peer's, MFU
   (model FLOPs per token, 6 N + 12 L D T, times tokens/s over the device's peak), compile
   seconds, the memory XLA plans for the step and the device's peak memory in use.
3. QK-clip and telemetry: the same model without QK-norm (QK-clip acts only there), the full
   stack without QK-clip, with QK-clip at tau 100, and with the loop's attention-logit telemetry
   pass after every `logging.log_every` steps; each variant's ms per step over the plain one.

4. Start-up (`bench.startup`, full mode only, or named with `--sections`): seconds from
   `python -m stablejax train --config gpt2_small` to its first step's record, cold (an empty
   compilation cache), warm (a second new run) and a resume, with the ratios to cold (target:
   at most 0.4): what the persistent compilation cache saves a restart on this device.

A failing section is recorded in the JSON (`errors`) and the others still run; the JSON is
rewritten after each section, so a run cut short keeps what it measured. Exit code 0 when every
section ran and every kernel row passed, 1 otherwise.

The peak used for MFU is the device kind's dense bf16 peak from `PEAK_TFLOPS` (first matching
name), `--peak-tflops` when given, or, on a CPU, a float32 matmul measured here. docs/kernels.md
says what each figure should be.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

import stablejax
from bench import _common
from stablejax.muon import gram

NS_SHAPES = ((768, 768), (768, 3072), (12, 768, 768))
NS_DTYPES = ("bfloat16", "float32")
NS_CASES = tuple((shape, dtype) for shape in NS_SHAPES for dtype in NS_DTYPES)
# --dry: the script's paths once each: a bfloat16 matrix where Gram runs (both methods) and a
# float32 stack. Each interpret-mode case compiles for seconds on a CPU; the kernels' numbers on
# the other shapes and dtypes are tests/test_newton_schulz.py's.
DRY_NS_CASES = (((64, 128), "bfloat16"), ((2, 64, 64), "float32"))
NS_STEPS = 5
NS_METHODS = ("standard", "gram")
# Largest |kernel - reference| / max|reference| accepted per dtype: one or two bfloat16 roundings
# where tiles sum in another order (measured up to 0.016 in interpret mode at these shapes), and
# float32 rounding (1e-6 measured) with room for a device's own accumulation order.
NS_TOLERANCE = {"bfloat16": 0.05, "float32": 1e-4}

# Dense bfloat16 peak per device (TFLOP/s) by device kind, most specific name first.
PEAK_TFLOPS = (
    ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0),
    ("GH200", 989.0), ("B200", 2250.0), ("A100", 312.0), ("L40S", 362.0), ("L4", 121.0),
    ("A10G", 70.0), ("TPU v6 lite", 918.0), ("TPU v5 lite", 197.0), ("TPU v5p", 459.0),
    ("TPU v5", 459.0), ("TPU v4", 275.0),
)
CUSTOM_CALLS = {"cuda": "__gpu$xla.gpu.triton", "rocm": "__gpu$xla.gpu.triton",
                "tpu": "tpu_custom_call"}

TRAIN_CONFIG = "gpt2_small"
# --dry: a one-layer model and AdamW inside the same stack (the Muon step is the slow one to
# compile on a CPU, and the script's own logic does not depend on the optimizer).
DRY_MODEL = ("model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.vocab_size=256",
             "model.max_seq_len=32", "model.compute_dtype=float32", "model.remat=false",
             "optimizer.name=adamw")
QK_CLIP_TAU = 100.0


# ----------------------------------------------------------------------------- helpers


def platform() -> str:
  """``"cuda"``, ``"rocm"``, ``"tpu"`` or ``"cpu"``: the platform of the default device."""
  dev = jax.devices()[0]
  if dev.platform in ("gpu", "cuda", "rocm"):
    version = str(getattr(dev.client, "platform_version", "")).lower()
    return "rocm" if dev.platform == "rocm" or "rocm" in version else "cuda"
  return dev.platform


def peak_flops(override_tflops: float | None) -> tuple[float, str]:
  """Per-device peak FLOP/s for MFU and where it came from."""
  if override_tflops:
    return override_tflops * 1e12, "--peak-tflops"
  kind = jax.devices()[0].device_kind
  for name, tflops in PEAK_TFLOPS:
    if name.lower() in kind.lower():
      return tflops * 1e12, f"table: {name} dense bf16"
  if platform() == "cpu":
    return _measured_matmul_flops(), "measured float32 1024x1024 matmul"
  raise SystemExit(f"error: no peak FLOP/s known for device kind {kind!r}; pass "
                   "--peak-tflops (the device's dense bf16 TFLOP/s)")


def _measured_matmul_flops() -> float:
  from stablejax.training.loop.components import measured_peak_flops  # the trainer's own measure
  return measured_peak_flops()


def time_per_call(fn: Callable[[], Any], calls: int, repeats: int) -> float:
  """Median over ``repeats`` of the mean seconds per call of ``calls`` calls dispatched back to
  back (one wait each), after one warm-up call."""
  jax.block_until_ready(fn())
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    out = None
    for _ in range(calls):
      out = fn()
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / calls)
  return statistics.median(times)


def peak_bytes_in_use() -> int | None:
  """The default device's peak memory in use so far (None where the backend does not say)."""
  try:
    stats = jax.devices()[0].memory_stats()
  except Exception:  # noqa: BLE001 - backends without memory statistics
    return None
  if not stats:
    return None
  value = stats.get("peak_bytes_in_use", stats.get("bytes_in_use"))
  return None if value is None else int(value)


def ns_flops(shape: tuple[int, ...], steps: int = NS_STEPS, method: str = "standard",
             dtype: str = "float32") -> float:
  """FLOPs of ``steps`` NS iterations: 4 n^2 m + 2 n^3 per matrix (n <= m; symmetry not used),
  or, for ``method="gram"``, the Gram iteration's count with ``dtype``'s default restarts."""
  *batch, r, c = shape
  n, m = min(r, c), max(r, c)
  if method == "gram":
    restarts = gram.default_restarts(steps, jnp.dtype(dtype))
    return float(math.prod(batch) * gram.flops(n, m, steps, restarts))
  return float(steps * math.prod(batch) * (4 * n * n * m + 2 * n**3))


def gram_runs(shape: tuple[int, ...], dtype: str, steps: int = NS_STEPS) -> bool:
  """Whether ``method="gram"`` runs the Gram iteration at ``shape`` (fewer FLOPs there)."""
  n, m = min(shape[-2:]), max(shape[-2:])
  return gram.uses_gram(n, m, steps, gram.default_restarts(steps, jnp.dtype(dtype)))


def gib(value: int | None) -> str:
  return "n/a" if value is None else f"{value / 2**30:.2f}"


# ----------------------------------------------------------------------------- sections


def check_newton_schulz(cases, repeats: int, calls: int) -> list[dict]:
  """One row per method and ``(shape, dtype)`` case: the Pallas kernel against the XLA reference
  (Gram rows only where Gram runs; ``vs_standard``: its kernel time over the standard
  kernel's)."""
  plat = platform()
  interpret = plat == "cpu"
  rows = []
  standard_ms: dict = {}
  for method, shape, dtype_name in ((m, s, d) for m in NS_METHODS for s, d in cases):
    if method == "gram" and not gram_runs(shape, dtype_name):
      continue
    dtype = jnp.dtype(dtype_name)
    x = jax.random.normal(jax.random.key(1), shape, jnp.float32).astype(dtype)
    precision = "highest" if dtype == jnp.float32 else "default"

    def reference(v, method=method):
      return stablejax.newton_schulz(v, steps=NS_STEPS, backend="xla", method=method)

    def kernel(v, method=method):
      return stablejax.newton_schulz(v, steps=NS_STEPS, backend="pallas", interpret=interpret,
                                     method=method)

    lowered = jax.jit(kernel).lower(x)
    call = CUSTOM_CALLS.get(plat)
    kernel_in_hlo = None if call is None else call in lowered.as_text()
    kernel_fn = lowered.compile()
    with jax.default_matmul_precision(precision):  # read when the products are lowered
      reference_fn = jax.jit(reference).lower(x).compile()
    got = np.asarray(kernel_fn(x), np.float32)
    want = np.asarray(reference_fn(x), np.float32)
    diff = float(np.max(np.abs(got - want)))
    scale = float(np.max(np.abs(want)))
    rel = diff / scale if scale > 0 else diff
    t_kernel = time_per_call(lambda f=kernel_fn, v=x: f(v), calls, repeats)
    t_reference = time_per_call(lambda f=reference_fn, v=x: f(v), calls, repeats)
    flops = ns_flops(shape, method=method, dtype=dtype_name)
    ok = (math.isfinite(rel) and rel <= NS_TOLERANCE[dtype_name]
          and kernel_in_hlo is not False)
    if method == "standard":
      standard_ms[shape, dtype_name] = t_kernel * 1e3
    rows.append({
        "method": method, "shape": "x".join(map(str, shape)), "dtype": dtype_name,
        "kernel": "interpret" if interpret else {"cuda": "triton", "rocm": "triton",
                                                 "tpu": "mosaic"}.get(plat, plat),
        "kernel_in_hlo": kernel_in_hlo, "reference_precision": precision,
        "max_abs_diff": diff, "max_abs_reference": scale, "max_rel_diff": rel,
        "tolerance": NS_TOLERANCE[dtype_name], "ok": bool(ok),
        "kernel_ms": t_kernel * 1e3, "reference_ms": t_reference * 1e3,
        "kernel_tflops": flops / t_kernel / 1e12, "reference_tflops": flops / t_reference / 1e12,
        "speedup": t_reference / t_kernel,
        "vs_standard": t_kernel * 1e3 / standard_ms[shape, dtype_name],
    })
    print(f"  NS {method} {rows[-1]['shape']} {dtype_name}: rel diff {rel:.2e}, kernel "
          f"{t_kernel * 1e3:.3f} ms, reference {t_reference * 1e3:.3f} ms", flush=True)
  return rows


def _interleaved_ms(runners: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
  times = _common.interleaved(runners, rounds, warmup=1)
  return {name: _common.median(ts) * 1e3 for name, ts in times.items()}


def check_train_step(overrides: list[str], steps: int, rounds: int, peak: float) -> dict:
  """The gpt2_small step with the full stack and with clip + AdamW, and the minimal loop of
  `bench.peer_step` at the same size, interleaved."""
  from bench import peer_step
  from stablejax.modeling.gpt import count_params, model_flops_per_token
  cfg = _common.trainer_config(TRAIN_CONFIG, overrides)
  batch = _common.random_batch(cfg)
  runs: dict[str, Any] = {}
  memory = {}
  for stack in (*_common.STACKS, "peer"):
    t0 = time.perf_counter()
    if stack == "peer":
      runs[stack] = peer_step.peer_for(cfg, count_params(runs["full"].state.params), batch)
    else:
      runs[stack] = _common.trainer_step(cfg, stack, batch)
    runs[stack].run(1)  # the first call allocates what the step needs
    memory[stack] = (runs[stack].planned_bytes(), peak_bytes_in_use())
    print(f"  {stack}: compiled in {runs[stack].compile_seconds:.1f} s "
          f"({time.perf_counter() - t0:.1f} s with the first step)", flush=True)
  ms = _interleaved_ms({stack: (lambda r=run: r.run(steps)) for stack, run in runs.items()},
                       rounds)
  tokens = cfg.train.batch_size * cfg.train.seq_len
  flops_per_token = model_flops_per_token(cfg.model, cfg.train.seq_len)
  peer_flops = peer_step.peer_flops_per_token(cfg, runs["peer"].model.mlp_width)
  rows = []
  for stack, run in runs.items():
    tps = tokens / (ms[stack] / 1e3)
    flops = peer_flops if stack == "peer" else flops_per_token
    rows.append({"stack": stack, "ms_per_step": ms[stack], "tokens_per_s": tps,
                 "model_flops_per_token": flops, "mfu": flops * tps / peak,
                 "compile_s": run.compile_seconds,
                 "planned_bytes": memory[stack][0], "peak_bytes_in_use": memory[stack][1],
                 "ratio_to_clip_adamw": ms[stack] / ms["clip_adamw"],
                 "tokens_per_s_vs_peer": ms["peer"] / ms[stack]})
  m = cfg.model
  return {"config": TRAIN_CONFIG, "overrides": overrides,
          "params": count_params(runs["full"].state.params),
          "model": f"d_model {m.d_model}, {m.n_layers} layers, {m.n_heads} heads, vocab "
                   f"{m.vocab_size}, {m.compute_dtype}, qk_norm {m.qk_norm}, remat {m.remat}",
          "batch": f"{cfg.train.batch_size} x {cfg.train.seq_len} tokens, grad_accum "
                   f"{cfg.train.grad_accum}",
          "model_flops_per_token": flops_per_token, "steps_per_round": steps, "rounds": rounds,
          "rows": rows}


def check_qk_clip_telemetry(overrides: list[str], steps: int, rounds: int) -> dict:
  """Plain / QK-clip / telemetry on the model without QK-norm, interleaved."""
  plain_cfg = _common.trainer_config(TRAIN_CONFIG, overrides, qk_norm=False)
  clip_cfg = _common.trainer_config(TRAIN_CONFIG, overrides, qk_norm=False,
                                    qk_clip_tau=QK_CLIP_TAU)
  batch = _common.random_batch(plain_cfg)
  plain = _common.trainer_step(plain_cfg, "full", batch)
  with_telemetry = plain.fork()
  clipped = _common.trainer_step(clip_cfg, "full", batch)
  telemetry = _common.logit_telemetry(plain_cfg)
  jax.block_until_ready(telemetry(plain.state.params, batch["tokens"], 0))

  def telemetry_interval() -> float:
    # As the loop does it: the steps, then the telemetry pass dispatched after the last one.
    t0 = time.perf_counter()
    state, metrics = with_telemetry.state, None
    for _ in range(steps):
      state, metrics = with_telemetry.compiled(state, batch)
    extra = telemetry(state.params, batch["tokens"], 0)
    jax.block_until_ready((state, metrics, extra))
    with_telemetry.state = state
    return (time.perf_counter() - t0) / steps

  times = _common.interleaved({"plain": lambda: plain.run(steps), "qk_clip": lambda: clipped.run(
      steps), "telemetry": telemetry_interval}, rounds, warmup=1)
  rows = []
  for name, ts in times.items():
    ratio, q1, q3 = _common.paired_ratio(ts, times["plain"])
    rows.append({"variant": name, "ms_per_step": _common.median(ts) * 1e3,
                 "ratio_to_plain": ratio, "ratio_iqr": [q1, q3]})
  return {"qk_clip_tau": QK_CLIP_TAU, "telemetry_every": steps, "rows": rows}


# ----------------------------------------------------------------------------- output


def check_startup(model: str) -> dict:
  """One round of ``bench.startup`` for ``model``: cold, warm, resume and no-cache seconds."""
  from bench import startup
  times = startup.measure([model], rounds=1)
  row = {k: v[0] for k, v in times[model].items()}
  return {"rows": [{"model": model, **row}]}


def print_tables(result: dict) -> None:
  ns = result.get("newton_schulz") or []
  if ns:
    print("\nNewton-Schulz, Pallas kernel vs XLA reference (5 steps)")
    print(_common.table(
        [(r["method"], r["shape"], r["dtype"], r["kernel"], {True: "yes", False: "NO", None: "-"}[
            r["kernel_in_hlo"]], f"{r['max_abs_diff']:.2e}", f"{r['max_rel_diff']:.2e}",
          f"{r['kernel_ms']:.3f}", f"{r['reference_ms']:.3f}", f"{r['speedup']:.2f}x",
          f"{r['vs_standard']:.2f}x", f"{r['kernel_tflops']:.2f}", "ok" if r["ok"] else "FAIL")
         for r in ns],
        ("method", "shape", "dtype", "kernel", "in HLO", "max |diff|", "rel diff", "kernel ms",
         "ref ms", "speedup", "vs standard", "kernel TFLOP/s", "check")))
  train = result.get("train_step")
  if train:
    print(f"\n{train['config']}: {train['params'] / 1e6:.1f}M params, {train['model']}; "
          f"batch {train['batch']}")
    print(_common.table(
        [(r["stack"], f"{r['ms_per_step']:.1f}", f"{r['tokens_per_s']:,.0f}",
          f"{100 * r['mfu']:.1f}%", f"{r['compile_s']:.1f}", gib(r["planned_bytes"]),
          gib(r["peak_bytes_in_use"]), f"{r['ratio_to_clip_adamw']:.3f}x",
          f"{r['tokens_per_s_vs_peer']:.3f}x")
         for r in train["rows"]],
        ("stack", "ms/step", "tokens/s", "MFU", "compile s", "planned GiB", "peak GiB",
         "time vs clip+AdamW", "tokens/s vs peer")))
  qk = result.get("qk_clip_telemetry")
  if qk:
    print(f"\nQK-clip (tau {qk['qk_clip_tau']:g}) and telemetry (every {qk['telemetry_every']} "
          "steps), model without QK-norm")
    print(_common.table(
        [(r["variant"], f"{r['ms_per_step']:.1f}", f"{r['ratio_to_plain']:.3f}x",
          f"{r['ratio_iqr'][0]:.3f}-{r['ratio_iqr'][1]:.3f}") for r in qk["rows"]],
        ("variant", "ms/step", "vs plain", "IQR")))
  startup = result.get("startup")
  if startup:
    print("\nStart-up, seconds from the command to the first step (bench.startup)")
    print(_common.table(
        [(r["model"], f"{r['cold']:.1f}", f"{r['warm']:.1f}", f"{r['resume']:.1f}",
          f"{r['no cache']:.1f}", f"{r['warm'] / r['cold']:.2f}",
          f"{r['resume'] / r['cold']:.2f}") for r in startup["rows"]],
        ("model", "cold s", "warm s", "resume s", "resume, no cache s", "warm / cold",
         "resume / cold")))
  for err in result.get("errors", []):
    print(f"\nerror in {err['section']}: {err['error']}")


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--dry", action="store_true",
                 help="tiny shapes and model: checks that the script runs, on any machine")
  p.add_argument("--out", default="device_check.json", help="the JSON file to write")
  p.add_argument("--peak-tflops", type=float, default=None,
                 help="the device's dense bf16 peak for MFU (default: from its device kind)")
  p.add_argument("--batch", type=int, default=None,
                 help="sequences per train step (default 16 on an accelerator, 2 on a CPU)")
  p.add_argument("--seq-len", type=int, default=None,
                 help="tokens per sequence (default 1024 on an accelerator, 256 on a CPU)")
  p.add_argument("--steps", type=int, default=None, help="train steps per timed round")
  p.add_argument("--rounds", type=int, default=None, help="interleaved timed rounds")
  p.add_argument("--sections", default=None,
                 help="comma-separated sections to run (default: all; the dry run leaves out "
                      "startup, three train processes)")
  a = p.parse_args(argv)
  known = ("newton_schulz", "train_step", "qk_clip_telemetry", "startup")
  chosen = a.sections if a.sections is not None else ",".join(
      k for k in known if not (a.dry and k == "startup"))
  sections = [s for s in chosen.split(",") if s]
  if any(s not in known for s in sections):
    print(f"error: unknown section in --sections {chosen!r}; use some of {', '.join(known)}",
          file=sys.stderr)
    return 2
  out = Path(a.out)
  if out.exists() and out.is_dir():
    print(f"error: --out {out} is a directory; name a file", file=sys.stderr)
    return 2

  plat = platform()
  accelerator = plat != "cpu"
  mode = "dry" if a.dry else "full"
  if a.dry:
    batch, seq, steps, rounds = a.batch or 2, a.seq_len or 16, a.steps or 2, a.rounds or 1
    cases, ns_repeats, ns_calls = DRY_NS_CASES, 1, 1
    overrides = list(DRY_MODEL)
  else:
    batch = a.batch or (16 if accelerator else 2)
    seq = a.seq_len or (1024 if accelerator else 256)
    steps = a.steps or (10 if accelerator else 1)
    rounds = a.rounds or (3 if accelerator else 1)
    cases = NS_CASES
    ns_repeats, ns_calls = (5, 10) if accelerator else (1, 1)
    overrides = []
  overrides += [f"train.batch_size={batch}", f"train.seq_len={seq}", "train.grad_accum=1",
                f"train.log_every={steps}"]
  peak, peak_source = peak_flops(a.peak_tflops)
  dev = jax.devices()[0]
  result: dict = {
      "mode": mode, "platform": plat, "device_kind": dev.device_kind,
      "device_count": jax.device_count(), "jax": jax.__version__,
      "machine": _common.machine_lines(), "peak_flops": peak, "peak_source": peak_source,
      "errors": [],
  }
  _common.print_machine()
  print(f"mode {mode}; peak {peak / 1e12:.3g} TFLOP/s per device ({peak_source})", flush=True)
  start = time.perf_counter()

  def write() -> None:
    result["seconds"] = time.perf_counter() - start
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")

  runs = {
      "newton_schulz": lambda: check_newton_schulz(cases, ns_repeats, ns_calls),
      "train_step": lambda: check_train_step(overrides, steps, rounds, peak),
      "qk_clip_telemetry": lambda: check_qk_clip_telemetry(overrides, steps, rounds),
      "startup": lambda: check_startup("default" if a.dry else "gpt2_small"),
  }
  for name in sections:
    print(f"\n[{time.perf_counter() - start:.0f} s] {name}", flush=True)
    try:
      result[name] = runs[name]()
    except Exception as e:  # noqa: BLE001 - one failing section must not lose the others
      result["errors"].append({"section": name, "error": f"{type(e).__name__}: {e}",
                               "traceback": traceback.format_exc()})
      print(f"  {name} failed: {type(e).__name__}: {e}", flush=True)
    write()
  print_tables(result)
  print(f"\n{result['seconds']:.0f} s in all; wrote {out}")
  failed = result["errors"] or not all(r["ok"] for r in result.get("newton_schulz", []))
  return 1 if failed else 0


if __name__ == "__main__":
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  raise SystemExit(main())
