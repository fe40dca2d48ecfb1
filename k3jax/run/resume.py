"""The run file OUT/run.json (options, model config and execution of a run) and the checks a
resume passes before anything is loaded or compiled: the same model, the same execution, the
options that fix what a checkpoint and its data position mean unchanged, the base folder of a
fine-tuning run still there.
"""

from __future__ import annotations

import dataclasses
import json
import os

from k3jax.config import ModelConfig
from k3jax.errors import UserError
from k3jax.execution import Execution, recorded
from k3jax.folders import RUN_FILE


def read_run_file(out: str) -> dict | None:
  """OUT/run.json as saved, or None for a new run."""
  path = os.path.join(out, RUN_FILE)
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def check_resume(out: str, opts, cfg: ModelConfig, ex: Execution, keys: tuple[str, ...],
                 paths: dict) -> None:
  """Refuse to continue the run in `out` with another model, execution or any of the option
  `keys` changed (`opts`: RunOptions, or another options dataclass: its class defaults stand
  for options older runs did not record; `paths`: options recorded absolute)."""
  saved = read_run_file(out)
  if saved is None:
    return
  if _normalised(saved.get("model")) != cfg.to_dict() or _saved_execution(saved) != ex:
    raise UserError(f"{out} holds a run of another model config; use a new --out")
  for key in keys:
    was, now = saved_option(saved, opts, key, paths), getattr(opts, key)
    if was != (list(now) if isinstance(now, tuple) else now):  # JSON keeps tuples as lists
      raise UserError(f"{out} holds a run with --{key.replace('_', '-')} "
                      f"{was!r} (now {now!r}); resuming must keep it, or use a new --out")


def saved_option(saved: dict, opts, key: str, paths: dict):
  """Option `key` as the run file records it (the class default for runs before the option;
  a path option made absolute as runs record it now)."""
  was = saved["options"].get(key, getattr(type(opts), key, None))
  if key in paths and was is not None:  # older runs recorded them as typed
    was = paths[key](was)
  return was


def _normalised(model: dict | None) -> dict | None:
  """A saved model config as this version writes it (older runs saved the execution fields
  in it too)."""
  try:
    return ModelConfig.from_dict(model).to_dict()
  except Exception:  # noqa: BLE001 - not a config this version reads: a mismatch
    return model


def _saved_execution(saved: dict) -> Execution | None:
  """The execution a run file records ("execution"; older runs: inside "model", with remat
  as a bool)."""
  try:
    return recorded({"config": saved.get("model"), **saved})
  except Exception:  # noqa: BLE001 - not one this version reads: a mismatch
    return None


def write_run_file(out: str, opts, cfg: ModelConfig, ex: Execution, **extra) -> None:
  """OUT/run.json: the options, model config and execution (and `extra` keys)."""
  with open(os.path.join(out, RUN_FILE), "w") as f:
    json.dump({"options": dataclasses.asdict(opts), "model": cfg.to_dict(),
               "execution": ex.to_dict(), **extra}, f, indent=1)


def check_base_present(out: str, init_from: str | None) -> None:
  """A run in `out` to resume whose --init-from folder is gone: say so first (its
  checkpoints cannot stand without it)."""
  if init_from and not os.path.isdir(init_from) and os.path.exists(os.path.join(out, RUN_FILE)):
    raise UserError(f"{init_from}: the base of the run in {out} is missing (its --init-from); "
                    "put it back to resume, or use a new --out")


def checkpoint_sizes(step: int, checkpoint_bytes: int, base_bytes: int | None,
                     base: dict | None) -> str:
  """The log line on what the last checkpoint holds next to the base (train and rl)."""
  line = f"checkpoint {step} holds {checkpoint_bytes / 1e6:.3f} MB"
  if base is not None and base["folder"]:
    return line + f", the frozen base it refers to ({base['folder']}) {base_bytes / 1e6:.3f} MB"
  if base is not None:
    return line + " (the frozen base is rebuilt from --seed)"
  return line + (f", --init-from {base_bytes / 1e6:.3f} MB" if base_bytes else "")
