"""Checkpoints of a run: one Orbax `CheckpointManager`, async, keeping the last N
(docs/training.md#checkpoints-and-outputs).

A checkpoint `OUT/checkpoints/<step>/` holds three items:
  state  the TrainState (params, router biases, optimizer state, step, RNG key), Orbax
         StandardSave (TensorStore arrays). On a mesh every process writes and reads only its
         own shards, and a restore target of ShapeDtypeStructs carrying NamedShardings puts
         each array straight into its shards (another mesh than the one saved works too)
  data   the grain iterator state of each data shard, `data/shard_<s>.json`: the exact data
         position. Each shard's state is written by the lowest process that reads that shard,
         and read by every process that reads it (data.py: shards are a property of the run)
  meta   small JSON (tokens seen, wall time so far), written by process 0
  base   (runs with a frozen base: LoRA, packed MXFP4 experts) the JSON reference to the base
         (its folder and fingerprint, frozen_base.py), written by process 0; `state` then
         holds only the trainable params (and their optimizer state), not the base
Orbax writes a checkpoint into a temporary folder and renames it only once every item is
committed, so a run killed mid-save leaves no checkpoint for that step: `latest_step()` is the
last complete one. The next run names the leftover temporary folder on stderr and removes it
(`half_written`).

The async save copies the arrays to host memory before `save()` returns and writes them in a
background thread while training continues; the next save (and `close()`) waits for it.

Test hook: with K3JAX_TEST_SAVE_DELAY=<seconds> in the environment every save carries one more
small item whose background commit appends a line (the temporary folder) to
OUT/save_events.log when it starts and then holds the commit open that long, so a test can kill
the process while a save is provably in flight.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import threading
import time
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx

SAVE_DELAY_ENV = "K3JAX_TEST_SAVE_DELAY"
SAVE_EVENTS = "save_events.log"
# what Orbax appends to the folder of a save until it is committed (orbax path/atomicity_types)
TMP_SUFFIX = ".orbax-checkpoint-tmp"


class _DelayedCommit:
  """An Orbax commit future (a `result()` that waits) that sleeps in its own thread."""

  def __init__(self, directory: str, seconds: float, log_path: str):
    def run():
      # Orbax may create the folders in the background: announce the save only once its
      # temporary folder exists, so whoever reads the log finds the save really in flight
      while not os.path.isdir(directory):
        time.sleep(0.01)
      with open(log_path, "a") as f:
        f.write(f"{directory}\n")
      time.sleep(seconds)
    self._thread = threading.Thread(target=run, daemon=True)
    self._thread.start()

  def result(self, timeout: float | None = None) -> None:
    self._thread.join(timeout)


class _HeldCommitHandler(ocp.JsonCheckpointHandler):
  """Writes a small JSON item whose commit is held open (test hook, see module docstring).
  A separate item with its own args type, so the standard handlers stay untouched and a
  checkpoint saved this way restores like any other."""

  def __init__(self, seconds: float, log_path: str):
    super().__init__()
    self._seconds, self._log_path = seconds, log_path

  async def async_save(self, directory, *args, **kwargs):
    futures = list(await super().async_save(directory, *args, **kwargs) or [])
    return futures + [_DelayedCommit(str(directory), self._seconds, self._log_path)]


@ocp.args.register_with_handler(_HeldCommitHandler, for_save=True)
@dataclasses.dataclass
class _HoldSave(ocp.args.JsonSave):
  """Save args of the held item (Orbax pairs args types with handler types)."""


@ocp.args.register_with_handler(_HeldCommitHandler, for_restore=True)
@dataclasses.dataclass
class _HoldRestore(ocp.args.JsonRestore):
  """Restore args of the held item (never restored; Orbax wants the pair registered)."""


class _ShardStatesHandler(ocp.JsonCheckpointHandler):
  """The data item: {shard: its position (a grain state, or a prepared dataset's)} -> one
  `shard_<s>.json` per shard, written by whichever process is handed it (not only the primary
  host, unlike plain JSON items)."""

  async def _save_fn(self, x, directory):
    # awaited by Orbax's commit future once the (temporary) item folder exists
    for shard, state in x.items():
      (directory / f"shard_{shard}.json").write_text(json.dumps(state))

  def restore(self, directory, item=None, args=None):
    out = {}
    for shard in args.item:
      path = directory / f"shard_{shard}.json"
      if not path.exists():
        raise FileNotFoundError(f"{path} not found (a checkpoint of another --data-shards?)")
      out[str(shard)] = json.loads(path.read_text())
    return out


@ocp.args.register_with_handler(_ShardStatesHandler, for_save=True)
@dataclasses.dataclass
class _DataSave(ocp.args.JsonSave):
  """item: {shard: grain state} of the shards this process writes."""


@ocp.args.register_with_handler(_ShardStatesHandler, for_restore=True)
@dataclasses.dataclass
class _DataRestore(ocp.args.JsonRestore):
  """item: the shards to read."""


def half_written(directory: str) -> list[str]:
  """The temporary folders of saves that never finished in `directory` (Orbax names them
  `<step>.orbax-checkpoint-tmp`, some versions with `-<time>` after it, until every item is
  committed, and renames them then; a later save of the same step reuses the name). Orbax's
  steps never include them, but its manager left them in place when it opened."""
  if not os.path.isdir(directory):
    return []
  return sorted(os.path.join(directory, name) for name in os.listdir(directory)
                if TMP_SUFFIX in name)


class Checkpointer:
  """Save / find / restore the checkpoints of one run directory."""

  def __init__(self, directory: str, *, keep: int, async_save: bool = True):
    directory = os.path.abspath(directory)
    handlers = {"state": ocp.StandardCheckpointHandler(), "data": _ShardStatesHandler(),
                "meta": ocp.JsonCheckpointHandler(), "base": ocp.JsonCheckpointHandler()}
    delay = os.environ.get(SAVE_DELAY_ENV)
    self._hold = bool(delay)
    if self._hold:
      handlers["hold"] = _HeldCommitHandler(
          float(delay), os.path.join(os.path.dirname(directory), SAVE_EVENTS))
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=True, enable_async_checkpointing=async_save,
        cleanup_tmp_directories=True)
    self.directory = directory
    self.half_written = half_written(directory)
    if jax.process_index() == 0:  # the others only skip them
      for path in self.half_written:
        print(f"k3jax: {path}: a checkpoint left half-written (its save never finished): "
              "skipped and removed", file=sys.stderr)
        shutil.rmtree(path, ignore_errors=True)
    self.manager = ocp.CheckpointManager(directory, options=options, item_handlers=handlers)

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self.manager.all_steps())

  def save(self, step: int, state: Any, data_states: dict, meta: dict,
           base: dict | None = None) -> None:
    """data_states: {shard: grain state} of the data shards this process writes; base: the
    reference to a frozen base `state` leaves out (frozen_base.py), or None."""
    items = {"state": ocp.args.StandardSave(state), "data": _DataSave(data_states),
             "meta": ocp.args.JsonSave(meta)}
    if base is not None:
      items["base"] = ocp.args.JsonSave(base)
    if self._hold:
      items["hold"] = _HoldSave({"step": step})
    self.manager.save(step, args=ocp.args.Composite(**items), force=True)

  def restore(self, step: int, abstract_state: Any, shards=(0,)) -> tuple[Any, dict, dict]:
    """(state, {shard: grain state} of `shards`, meta)."""
    out = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), data=_DataRestore(list(shards)),
        meta=ocp.args.JsonRestore()))
    return out.state, out.data, out.meta

  def base_reference(self, step: int) -> dict | None:
    """The base reference checkpoint `step` holds, or None (a checkpoint of the whole state:
    plain training, or a LoRA run saved before checkpoints left the base out)."""
    if not os.path.isdir(os.path.join(self.directory, str(step), "base")):
      return None
    return self.manager.restore(step, args=ocp.args.Composite(base=ocp.args.JsonRestore())).base

  def step_bytes(self, step: int) -> int:
    """Bytes on disk of checkpoint `step` (every file of its folder)."""
    root = os.path.join(self.directory, str(step))
    return sum(os.path.getsize(os.path.join(d, name))
               for d, _, files in os.walk(root) for name in files)

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


MODEL_CONFIG = "k3jax_config.json"  # the name `k3jax convert` gives it (convert.to_orbax.CONFIG)


ADAPTERS = "adapters.json"  # LoRA / packed-expert / QAT options of a fine-tuned model


def save_model(directory: str, graphdef: Any, params: Any, router_bias: Any, cfg,
               adapters: dict | None = None) -> None:
  """The trained weights as a k3jax model checkpoint: `nnx.state(model)` saved by Orbax plus
  `k3jax_config.json`, the layout `k3jax export` turns into the official format and
  `--init-from` fine-tunes from. The config file holds the architecture ("config") and the
  dtypes the weights were trained in ("execution": compute and master dtype, what a load
  without an explicit execution runs them in; convert.load.checkpoint_execution). Written
  synchronously, replacing an older one. Every process saves its shards of the arrays;
  process 0 alone writes the config file."""
  model = nnx.merge(graphdef, nnx.State(params), nnx.State(router_bias))
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(os.path.abspath(directory), nnx.state(model), force=True)
  checkpointer.wait_until_finished()
  if jax.process_index() == 0:
    with open(os.path.join(directory, MODEL_CONFIG), "w") as f:
      trained = {"dtype": model.ex.dtype, "param_dtype": model.ex.param_dtype}
      json.dump({"format": "k3jax", "config": cfg.to_dict(), "execution": trained}, f, indent=2)
    adapters_file = os.path.join(directory, ADAPTERS)
    if adapters is not None:  # `k3jax export --merge-lora | --adapter-only` reads it
      with open(adapters_file, "w") as f:
        json.dump(adapters, f, indent=2)
    elif os.path.exists(adapters_file):
      os.remove(adapters_file)
