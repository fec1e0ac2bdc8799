"""The checks of a resumed run (its tokenizer, its data), the lines saying what changed, and
what a start records once its checks passed."""

from __future__ import annotations

from typing import Callable, Optional

from stablejax.data.identity import data_identity, identity_difference
from stablejax.training.trained import run as trained_run
from stablejax.training.checkpoint import write_json_atomic
from stablejax.training.config import Config, ConfigError, changed_keys, to_dict
from stablejax.training.run_folder.data_order import data_order, order_difference
from stablejax.training.run_folder.folder import RunDirectory


def check_resume(cfg: Config, run_dir: RunDirectory, meta: dict, data_changed: bool,
                 say: Callable[[str], None]) -> dict:
  """A resumed run (``meta``: its checkpoint's) must train on its tokenizer, whatever the data,
  and on its data unless told the data changed (``data_changed``); another data order is said.
  Returns this run's tokenizer record.

  Raises:
    ConfigError: another tokenizer, or other data without ``data_changed``.
  """
  try:
    tokenizer = trained_run.tokenizer_record(cfg.data)[0]
    problem = trained_run.resume_tokenizer_problem(meta, run_dir.tokenizer, run_dir.root,
                                                   tokenizer) if meta else None
  except trained_run.RunError as e:
    raise ConfigError(str(e)) from None
  if problem:
    raise ConfigError(problem)
  if not meta:
    return tokenizer
  order = run_dir.data_order
  if order is not None and order != data_order(cfg):
    say(f"warning: {order_difference(order, data_order(cfg))} since the last start of this run: "
        "the batches from here on come in another order than the run's own (the data is the "
        "same)")
  recorded, current = run_dir.data_identity, data_identity(cfg.data)
  difference = identity_difference(recorded, current) if recorded is not None else None
  if difference and not data_changed:
    raise ConfigError(
        f"the data is not the data this run trained on ({difference}; recorded in "
        f"{run_dir.root / 'run.json'}): point data.train at the run's data, pass --fresh to start "
        "over, or --data-changed to resume on the new data on purpose (its validation set and "
        "order change)")
  return tokenizer


def changes(recorded: Optional[Config], cfg: Config, meta: dict) -> list[str]:
  """What changed since the run's last start, one line each: the settings (``recorded``: the
  config of that start), and what the restore did with the state (``meta["changes"]``: a
  defence switched on or off, parameters added, ...)."""
  lines = []
  if recorded is not None:
    changed = [line for line in changed_keys(recorded, cfg)
               if not (line.startswith("train.steps ") and cfg.train.time_budget_minutes)]
    if changed:
      lines.append("changed since the last start: " + "; ".join(changed))
  if meta.get("changes"):
    lines.append(str(meta["changes"]))
  return lines


def record_start(run_dir: RunDirectory, cfg: Config, tokenizer: dict, names: tuple[str, ...]
                 ) -> None:
  """The checks of a start passed (process 0): the names it writes, the run's data identity,
  tokenizer and data order in run.json, the tokenizer's files and config.json."""
  for name in names:
    run_dir.path(name)
  run_dir.set_data_identity(data_identity(cfg.data))
  run_dir.set_tokenizer(tokenizer)
  run_dir.set_data_order(data_order(cfg))
  run_dir.record_written()
  try:
    trained_run.write_tokenizer_record(run_dir.root, cfg.data)
  except trained_run.RunError as e:
    raise ConfigError(str(e)) from None
  write_json_atomic(run_dir.root / "config.json", to_dict(cfg), indent=2)
