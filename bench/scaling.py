"""FSDP on 1, 2 and 4 simulated devices: the same losses, and per-device memory falling as 1/N.

Usage:
  python -m bench.scaling             # the default config (Muon + stack), 6 steps per N
  python -m bench.scaling --quick       # a smaller model, 3 steps
  python -m bench.scaling --devices 1,2,4,8
  python -m bench.scaling --no-multiprocess   # skip the 2-process row

For each N a subprocess runs with ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` and the
trainer (`stablejax.training.loop.Trainer`, i.e. train.py) with ``mesh.fsdp=N, mesh.data=1``: the
global batch is split over the N devices and every parameter and optimizer-state array is sharded
over the fsdp axis (its largest axis that N divides; arrays with no such axis stay replicated).
After training, it sums ``shard.data.nbytes`` over the ``addressable_shards`` that live on each
device, for the parameters and the optimizer state, and reports the largest device. The train
losses of every step are compared with N=1 (same seed, same data; only the reduction order of
the sharded sums differs). The simulated devices share this machine's cores, so step times say
nothing about real scaling and are not reported for the rows above.

The multi-process rows run the largest N as 2 processes x N/2 devices (`stablejax launch`,
`mesh.distributed=true`, gloo collectives over loopback) and as 1 process x N devices, both with
the mesh a multi-host job would use, ``{data: 2, fsdp: N/2}`` (parameters sharded inside a process,
data parallel across processes), and compare losses, per-device memory and tokens/s (median of
the logged intervals after the first two, which include compilation). Both use the same cores, so
the tokens/s ratio is the cost of cross-process collectives against in-process ones on one
machine, not a speed-up.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

DEFAULT_CONFIG = ROOT / "stablejax" / "configs" / "default.json"
QUICK_MODEL = {"model": {"d_model": 128, "n_layers": 2, "n_heads": 4, "max_seq_len": 64},
               "train": {"seq_len": 64, "batch_size": 8}}


def per_device_bytes(tree) -> dict:
  """Bytes held on each device by the shards of the arrays in `tree`."""
  import jax
  out: dict = {}
  for leaf in jax.tree.leaves(tree):
    if not isinstance(leaf, jax.Array):
      continue
    for shard in leaf.addressable_shards:
      out[shard.device.id] = out.get(shard.device.id, 0) + shard.data.nbytes
  return out


def child(n: int, steps: int, quick: bool, out: str, procs: int = 1, data: int = 1) -> None:
  from bench import _common
  from stablejax.training.loop.trainer import Trainer

  base = json.loads(DEFAULT_CONFIG.read_text())
  if quick:
    base = _common.deep_merge(base, QUICK_MODEL)
  cfg = _common.make_config(base, {
      "mesh": {"fsdp": n // data, "data": data, "distributed": procs > 1},
      "train": {"steps": steps, "warmup_steps": 1, "log_every": 1, "eval_every": steps,
                "eval_batches": 2, "peak_flops_per_device": 1e12},
      "checkpoint": {"every": steps, "async_save": False},
      "logging": {"progress": False, "tensorboard": False, "histogram_every": 0,
                  "activation_every": 0}})
  with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    run = Trainer(cfg, Path(out), fresh=True)  # joins the job first when procs > 1
    code = run.train()
  import jax
  assert (jax.device_count(), jax.process_count()) == (n, procs)
  if jax.process_index() != 0:
    return
  records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
  losses = [r["loss"] for r in records if "loss" in r]
  tokens_per_sec = [r["tokens_per_sec"] for r in records if "tokens_per_sec" in r]
  params = per_device_bytes(run.state.params)
  opt = per_device_bytes(run.state.opt_state)
  total_params = sum(x.nbytes for x in jax.tree.leaves(run.state.params))
  total_opt = sum(x.nbytes for x in jax.tree.leaves(run.state.opt_state)
                  if isinstance(x, jax.Array))
  print(json.dumps({
      "n": n, "procs": procs, "exit_code": code, "losses": losses,
      "val_loss": run.evaluation.last_val_loss,
      "tokens_per_sec": tokens_per_sec,
      "mesh": dict(run.components.mesh.shape), "params_bytes": params, "opt_bytes": opt,
      "global_params_bytes": total_params, "global_opt_bytes": total_opt,
      "optimizer": cfg.optimizer.name}))


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--quick", action="store_true")
  p.add_argument("--devices", default="1,2,4")
  p.add_argument("--steps", type=int, default=None)
  p.add_argument("--no-multiprocess", action="store_true", help="skip the 2-process row")
  p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
  p.add_argument("--child-procs", type=int, default=1, help=argparse.SUPPRESS)
  p.add_argument("--child-data", type=int, default=1, help=argparse.SUPPRESS)
  p.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  steps = args.steps or (3 if args.quick else 6)
  if args.child is not None:
    child(args.child, steps, args.quick, args.child_out, args.child_procs, args.child_data)
    return 0

  from bench import _common
  _common.print_machine()
  counts = [int(x) for x in args.devices.split(",")]
  results = {}
  with tempfile.TemporaryDirectory(prefix="stablejax_scaling_") as tmp:
    for n in counts:
      env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={n}")
      cmd = [sys.executable, __file__, "--child", str(n), "--steps", str(steps),
             "--child-out", os.path.join(tmp, f"n{n}")] + (["--quick"] if args.quick else [])
      proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
      if proc.returncode != 0:
        print(f"N={n} failed:\n{proc.stderr[-3000:]}")
        return 1
      results[n] = json.loads(proc.stdout.strip().splitlines()[-1])
    n_max = counts[-1]
    multi = {}
    if not args.no_multiprocess and n_max % 2 == 0:
      for procs in (1, 2):
        cmd = [__file__, "--child", str(n_max), "--child-procs", str(procs), "--child-data", "2",
               "--steps", str(steps), "--child-out", os.path.join(tmp, f"multi{procs}")]
        cmd += ["--quick"] if args.quick else []
        if procs == 1:
          env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={n_max}")
          proc = subprocess.run([sys.executable, *cmd], env=env, capture_output=True, text=True,
                                cwd=ROOT)
          lines = proc.stdout.strip().splitlines()[-1:]
        else:
          proc = subprocess.run([sys.executable, "-m", "stablejax", "launch", "--nproc", "2",
                                 "--devices-per-proc", str(n_max // 2), "--", *cmd],
                                capture_output=True, text=True, cwd=ROOT)
          lines = [line[4:] for line in proc.stdout.splitlines() if line.startswith("[0] {")]
        if proc.returncode != 0 or not lines:
          print(f"{procs} process(es) x {n_max // procs} devices failed:\n{proc.stderr[-3000:]}")
          return 1
        multi[procs] = json.loads(lines[-1])

  first = results[counts[0]]
  base = json.loads(DEFAULT_CONFIG.read_text())
  m = _common.deep_merge(base, QUICK_MODEL if args.quick else {})["model"]
  print(f"model: GPT d_model {m['d_model']}, {m['n_layers']} layers, optimizer "
        f"{first['optimizer']} with the stability stack; {steps} steps; global params "
        f"{first['global_params_bytes'] / 2**20:.2f} MiB, optimizer state "
        f"{first['global_opt_bytes'] / 2**20:.2f} MiB")
  print()
  rows = []
  ref_loss = first["losses"]
  ref_total = max(first["params_bytes"].values()) + max(first["opt_bytes"].values())
  for n in counts:
    r = results[n]
    pmax, omax = max(r["params_bytes"].values()), max(r["opt_bytes"].values())
    diff = max(abs(a - b) for a, b in zip(r["losses"], ref_loss))
    rows.append([n, str(r["mesh"]), r["exit_code"], f"{r['losses'][-1]:.6f}", f"{diff:.2e}",
                 f"{pmax / 2**20:.3f}", f"{omax / 2**20:.3f}", f"{(pmax + omax) / 2**20:.3f}",
                 f"{(pmax + omax) / ref_total:.3f}", f"{counts[0] / n:.3f}"])
  print(_common.table(rows, ["N", "mesh", "exit", f"loss step {steps}", "max |dloss| vs N=1",
                             "params MiB/dev", "opt MiB/dev", "total MiB/dev", "total vs N=1",
                             "ideal 1/N"]))
  print()
  print("losses per step: " + "; ".join(
      f"N={n}: " + ", ".join(f"{x:.5f}" for x in results[n]["losses"]) for n in counts))
  if multi:
    print()
    single = multi[1]
    print(f"multi-process: 2 processes x {n_max // 2} devices against 1 process x {n_max}, "
          f"both with mesh {single['mesh']} on the same cores")
    rows = []
    for label, r in ((f"1 x {n_max}", single), (f"2 x {n_max // 2}", multi[2])):
      pmax, omax = max(r["params_bytes"].values()), max(r["opt_bytes"].values())
      rel = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], single["losses"]))
      tps = _common.median(r["tokens_per_sec"][2:] or r["tokens_per_sec"])
      ref_tps = _common.median(single["tokens_per_sec"][2:] or single["tokens_per_sec"])
      rows.append([label, r["exit_code"], f"{r['losses'][-1]:.6f}", f"{rel:.2e}",
                   f"{(pmax + omax) / 2**20:.3f}", f"{tps:,.0f}", f"{tps / ref_tps:.3f}"])
    print(_common.table(rows, ["processes x devices", "exit", f"loss step {steps}",
                               f"max rel |dloss| vs 1 x {n_max}", "total MiB/dev", "tokens/s",
                               f"tokens/s vs 1 x {n_max}"]))
    print("losses per step: " + "; ".join(
        f"{p} process(es): " + ", ".join(f"{x:.5f}" for x in multi[p]["losses"]) for p in (1, 2)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
