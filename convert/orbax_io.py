"""The converted checkpoint: an Orbax PyTree checkpoint (OCDBT), written one tensor at a time
through Orbax's own save path.

On disk it is what `ocp.StandardCheckpointer().save(path, tree)` writes for a tree of numpy
arrays: `_CHECKPOINT_METADATA`, `_METADATA` (every leaf an `np.ndarray` at its key path, nnx
Variables ending in `value`), and one OCDBT database (`manifest.ocdbt`, `d/`,
`ocdbt.process_0/`) holding a zarr array per variable. So Orbax's standard calls read it:

    ocp.StandardCheckpointer().metadata(path)           # the tree, shapes, dtypes, chunks
    ocp.StandardCheckpointer().restore(path, abstract)   # leaves may carry NamedShardings:
                                                         # each device reads only its chunks

How it is written: Orbax's `PyTreeCheckpointHandler` saves a tree whose leaves are
`StreamedArray`s (a shape and a dtype, no data). Their TypeHandler is Orbax's `NumpyHandler`
with a different `serialize`: it builds each array's TensorStore spec with Orbax's public
`get_json_tspec_write` (so Orbax's metadata, OCDBT layout and chunking rules apply), opens them
all, and then fills them from one stream of (array, stack index, tensor) slices in source-file
order. Nothing bigger than one tensor plus the writes in flight is ever held.

- Transactions: slices are staged in a TensorStore transaction that commits every
  `TXN_BYTES`; a commit writes about one OCDBT data file, so a 1.5 TB conversion writes a
  few thousand files, not one per expert matrix. The next batch is read while the last one
  commits, within two batches in memory (`Stream`).
- Chunks: each array's write shape is one stack entry (one layer, or one layer's expert);
  Orbax's `chunk_byte_size` splits it into chunks of <= `CHUNK_BYTES` (largest dimensions
  first: a K3 expert matrix [3584, 3072] bf16 in 8 chunks [896, 1536]). Every write covers
  whole chunks (nothing is read back), no chunk mixes two layers or two experts, and a
  restore onto a mesh reads only the chunks its shards touch, so the smaller the chunks the
  less a process reads beyond its shards (benchmarks/convert.py --chunk-mib measures the
  speed across chunk sizes).
- B-tree nodes of <= `NODE_BYTES`: every commit rewrites the B-tree nodes it touches whole,
  so Orbax's default 100 MB nodes make a commit's cost grow with the number of chunks
  already written (docs/benchmarks.md#conversion).
- Resume: `on_commit(keys)` is called with the stream keys of every batch once its commit
  (and TensorStore's fsync) has finished; `convert` journals them and skips them on
  `--resume`. A batch interrupted mid-commit leaves an orphaned data file at most; the
  OCDBT manifest only ever names complete commits.
- No compression: weights barely compress, and zstd costs more CPU time than the disk time
  it saves.

With `--experts mxfp4` the routed experts are kept as their codes and scales
(`moe.experts.w1_packed` uint8 [n_moe, E, out, in/2] and `moe.experts.w1_scale` uint8
[n_moe, E, out, in/32], the HF orientation) instead of `moe.experts.w1`; `load_checkpoint`
dequantises them (exactly) into the model's expert weights.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from etils import epath

from k3jax.errors import CheckpointError, K3jaxError

Path = tuple[str, ...]
CHUNK_BYTES = 4 << 20
TXN_BYTES = 256 << 20
NODE_BYTES = 1 << 20  # OCDBT B-tree node size while converting (the merged tree keeps Orbax's)
METADATA = "_METADATA"
STEP_METADATA = "_CHECKPOINT_METADATA"  # Orbax's per-checkpoint metadata file (Checkpointer)
# A stream item: (journal key, bytes as stored, () -> [(array path, stack index, tensor)]).
Item = tuple[str, int, Callable[[], list[tuple[Path, tuple[int, ...], np.ndarray]]]]


def _orbax_path(directory: str) -> epath.Path:
  """`directory` as Orbax takes it: absolute (Orbax refuses relative checkpoint paths)."""
  return epath.Path(os.path.abspath(directory))


def param_name(path: Path) -> str:
  """Orbax's name for a k3jax variable path (key path joined by dots, plus `value`)."""
  return ".".join((*path, "value"))


class Interrupted(Exception):
  """The stream was asked to stop (Ctrl-C in the main thread); committed batches are kept."""


@dataclasses.dataclass(eq=False)
class StreamedArray:
  """A checkpoint leaf that is never in memory: shape, dtype, and how many leading stack axes
  one write addresses. Its data comes from the `Stream` all leaves of a save share."""
  path: Path
  shape: tuple[int, ...]
  dtype: np.dtype
  n_lead: int
  stream: Stream

  @property
  def write_shape(self) -> tuple[int, ...]:
    return (1,) * self.n_lead + tuple(self.shape[self.n_lead:])


class Stream:
  """The tensors to write, in order, and where to report committed batches.

  Each item is (key, nbytes, read): `read()` returns the item's slices [(array path, stack
  index, tensor)], `nbytes` their size as stored. Items are staged in a transaction that
  commits once it holds `txn_bytes`, and the next batch is read while the last one commits;
  but the bytes staged and committing stay within `2 * txn_bytes` where a single item allows
  it: an item that does not fit waits for the commit in flight, and an item bigger than a
  batch goes alone. So memory holds at most two batches, or one big tensor and its copy.
  """

  def __init__(self, items: Iterable[Item], on_commit: Callable[[list[str]], None],
               txn_bytes: int | None = None):
    self.items, self.on_commit = items, on_commit
    self.txn_bytes = TXN_BYTES if txn_bytes is None else txn_bytes
    self.stop = threading.Event()
    self.error: BaseException | None = None  # why the stream stopped early (bad input, stop)

  async def run(self, stores: dict[Path, ts.TensorStore]) -> None:
    """Write every item. Bad input met on the way (a `K3jaxError` from `read`, e.g. a
    tensor its layout transform refuses) or a stop request ends the save as a cancellation:
    Orbax logs any other exception of its save threads with a traceback, and the error is
    the caller's to report (`write_checkpoint` raises `self.error`)."""
    try:
      await self._run(stores)
    except (K3jaxError, Interrupted) as e:
      self.error = e
      raise asyncio.CancelledError() from None

  async def _run(self, stores: dict[Path, ts.TensorStore]) -> None:
    txn, keys, staged = ts.Transaction(), [], 0
    committing: tuple[Any, list[str], int] | None = None
    try:
      for key, nbytes, read in self.items:
        if self.stop.is_set():
          raise Interrupted()
        if nbytes >= self.txn_bytes and keys:  # a big item goes alone: send the batch first
          if committing is not None:
            await self._finish(committing)
          committing, (txn, keys, staged) = (txn.commit_async(), keys, staged), self._new()
        if committing is not None and committing[2] + staged + nbytes > 2 * self.txn_bytes:
          await self._finish(committing)
          committing = None
        await self._stage(stores, txn, read)
        keys.append(key)
        staged += nbytes
        if staged >= self.txn_bytes:
          if committing is not None:
            await self._finish(committing)
          committing, (txn, keys, staged) = (txn.commit_async(), keys, staged), self._new()
      if committing is not None:
        await self._finish(committing)
        committing = None
      if keys:
        await self._finish((txn.commit_async(), keys, staged))
    finally:
      if committing is not None:  # keep what was already on its way to disk
        try:
          await self._finish(committing)
        except Exception:  # noqa: BLE001 - the first error is the one to report
          pass

  @staticmethod
  def _new():
    return ts.Transaction(), [], 0

  @staticmethod
  async def _stage(stores, txn, read) -> None:
    """Stage one item's slices; they live only in this frame, so nothing but the
    transaction holds them once it returns."""
    for path, index, array in read():
      store = stores[path]
      expect = tuple(store.shape[len(index):])
      if tuple(array.shape) != expect:
        raise CheckpointError(f"{'.'.join(path)}: got shape {tuple(array.shape)}, the "
                              f"checkpoint array takes {expect}")
      # No contiguous copy: TensorStore lays the chunks out itself, and may keep `array`
      # (nobody modifies it) until the commit instead of copying it now.
      data = np.asarray(array, dtype=store.dtype.numpy_dtype)
      await store.with_transaction(txn)[index].write(
          data, can_reference_source_data_indefinitely=True)

  async def _finish(self, committing: tuple[Any, list[str], int]) -> None:
    commit, keys, _ = committing
    await commit
    self.on_commit(keys)


def _handler_class():
  class StreamingHandler(ocp.type_handlers.NumpyHandler):
    """Orbax's numpy TypeHandler, but the values arrive as a stream of slices."""

    async def serialize(self, values, infos, args=None):
      args = args or [ocp.SaveArgs()] * len(values)
      streams = {id(v.stream) for v in values}
      if len(streams) != 1:
        raise ValueError("every StreamedArray of a save must share one Stream")

      async def fill():
        opens = []
        for value, info, arg in zip(values, infos, args):
          await info.await_path_creation()
          spec = ocp.type_handlers.get_json_tspec_write(
              info, use_ocdbt=info.is_ocdbt_checkpoint, global_shape=value.shape,
              local_shape=value.write_shape, dtype=value.dtype,
              process_index=jax.process_index(), arg=arg)
          if "config" in spec["kvstore"]:
            # Orbax's 100 MB nodes suit its one commit per save; here every batch commits and
            # rewrites the nodes it touches, so small ones keep a commit's cost flat
            spec["kvstore"]["config"]["max_decoded_node_bytes"] = NODE_BYTES
          # open=True too: on --resume the arrays exist with the committed batches in them
          opens.append(ts.open(ts.Spec(spec), create=True, open=True, context=info.ts_context))
        stores = dict(zip((v.path for v in values), await asyncio.gather(*opens)))
        await values[0].stream.run(stores)

      return [ocp.future.CommitFutureAwaitingContractedSignals(fill(), name="k3jax_convert")]

  return StreamingHandler


def write_checkpoint(directory: str, arrays: dict[Path, tuple[tuple[int, ...], Any, int]],
                     stream: Stream, *, every_array_written: bool = True,
                     finish: bool = True) -> int:
  """Write the Orbax checkpoint of `arrays` (path -> (shape, dtype, leading stack axes)) into
  the existing folder `directory`, filled from `stream`. Blocks until every byte and Orbax's
  metadata are on disk; on Ctrl-C the stream stops after the batch being committed. Returns
  when the save started (ns), for `finish_checkpoint`.

  In a multi-process run every process calls it with the same `arrays` and its own stream:
  its slices go to its own OCDBT database (`ocdbt.process_<i>/`), process 0 writes the tree
  metadata, and `finish=False` leaves `finish_checkpoint` to process 0 once all are written.

  Orbax checks after the save that every array holds data; `every_array_written=False` (a
  `--layers` slice, whose other arrays stay at their fill value) skips that check."""
  tree: dict[str, Any] = {}
  for path, (shape, dtype, n_lead) in sorted(arrays.items()):
    node = tree
    for k in path:
      node = node.setdefault(k, {})
    node["value"] = StreamedArray(path, tuple(shape), np.dtype(dtype), n_lead, stream)
  registry = ocp.type_handlers.create_type_handler_registry(
      (StreamedArray, _handler_class()()),
      (jax.Array, ocp.type_handlers.ArrayHandler()))  # unused; Orbax warns without one
  handler = ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=False, use_compression=False,
                                        type_handler_registry=registry)
  save_args = jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=CHUNK_BYTES), tree)
  started = time.time_ns()
  path = _orbax_path(directory)
  done = threading.Event()
  errors: list[BaseException] = []

  def save():
    try:
      handler.save(path, args=ocp.args.PyTreeSave(tree, save_args=save_args))
      if finish:
        _merge(path, every_array_written)
    except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
      errors.append(e)
    finally:
      done.set()

  # The save runs in its own thread so that Ctrl-C reaches this one, which then asks the
  # stream to stop and waits for the batch in flight to land (journalled, resumable).
  worker = threading.Thread(target=save, name="k3jax-convert-save", daemon=True)
  worker.start()
  try:
    while not done.wait(0.2):
      pass
  except KeyboardInterrupt:
    stream.stop.set()
    done.wait()
    raise
  if stream.error is not None:
    raise stream.error
  if errors:
    raise errors[0]
  if finish:
    _step_metadata(path, started)
  return started


def finish_checkpoint(directory: str, started: int, *, every_array_written: bool = True) -> None:
  """What `write_checkpoint(finish=True)` ends with, run once for all processes (process 0,
  after every process's part is on disk): merge every `ocdbt.process_<i>/` database into the
  root manifest, check the arrays, and write Orbax's step metadata."""
  path = _orbax_path(directory)
  _merge(path, every_array_written)
  _step_metadata(path, started)


def _merge(path: epath.Path, every_array_written: bool) -> None:
  """What handler.finalize does for numpy leaves: merge the `ocdbt.process_<i>` databases into
  the root manifest, then check that every array holds data (not so for a --layers slice)."""
  asyncio.run(ocp.type_handlers.merge_ocdbt_per_process_files(
      path, ts_context=ocp.type_handlers.get_ts_context(use_ocdbt=True), use_zarr3=False,
      enable_validation=every_array_written))


def _step_metadata(path: epath.Path, started: int) -> None:
  """What `ocp.Checkpointer.save` records around its handler's save (this save is resumable,
  so it runs the handler itself): the handler to read it with, and when it was written."""
  ocp.metadata.metadata_store(enable_write=True, blocking_write=True).write(
      path / STEP_METADATA,
      {"item_handlers": ocp.StandardCheckpointHandler().typestr(), "metrics": {},
       "performance_metrics": {}, "init_timestamp_nsecs": started,
       "commit_timestamp_nsecs": time.time_ns(), "custom_metadata": {}})


def sync_tree(directory: str) -> None:
  """fsync every file and folder below `directory`: on disk before anyone renames it."""
  for root, dirs, files in os.walk(directory):
    for name in files + dirs:
      fd = os.open(os.path.join(root, name), os.O_RDONLY)
      try:
        os.fsync(fd)
      finally:
        os.close(fd)


# ---- reading ---------------------------------------------------------------------------------

def _tree_metadata(directory: str):
  if not os.path.exists(os.path.join(directory, METADATA)):
    raise CheckpointError(f"{directory}: not an Orbax checkpoint (no {METADATA})")
  try:
    return ocp.PyTreeCheckpointHandler().metadata(_orbax_path(directory))
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise CheckpointError(f"{directory}: unreadable Orbax metadata ({e})") from None


def saved_arrays(directory: str) -> dict[Path, Any]:
  """k3jax path -> Orbax's ArrayMetadata (shape, dtype, chunks) of every array in a
  checkpoint, converted or saved by Orbax itself (training)."""
  out = {}
  for keys, meta in jax.tree_util.tree_flatten_with_path(
      _tree_metadata(directory).tree, is_leaf=lambda x: hasattr(x, "shape"))[0]:
    path = tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in keys)
    out[path[:-1] if path[-1] == "value" else path] = meta
  return out


def saved_paths(directory: str) -> dict[Path, tuple[int, ...]]:
  """k3jax path -> shape of every array in a checkpoint."""
  return {path: tuple(meta.shape) for path, meta in saved_arrays(directory).items()}


@functools.cache
def _read_context(use_ocdbt: bool) -> ts.Context:
  """One TensorStore context for every slice read, so the OCDBT caches are shared."""
  return ocp.type_handlers.get_ts_context(use_ocdbt=use_ocdbt)


def open_array(directory: str, path: Path) -> ts.TensorStore:
  """One array of a checkpoint, for slice reads, through Orbax's own read spec (OCDBT, or
  the one-folder-per-array layout of checkpoints converted before OCDBT). Chunks never
  written (the layers a `--layers` slice does not hold) read as zeros."""
  parent = _orbax_path(directory)
  use_ocdbt = ocp.type_handlers.is_ocdbt_checkpoint(parent)
  context = _read_context(use_ocdbt)
  info = ocp.type_handlers.ParamInfo(name=param_name(path), parent_dir=parent,
                                     is_ocdbt_checkpoint=use_ocdbt, use_zarr3=False,
                                     ts_context=context)
  spec = ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=use_ocdbt,
                                               raise_array_data_missing_error=False)
  try:
    return ts.open(ts.Spec(spec), open=True, context=context).result()
  except ValueError as e:
    raise CheckpointError(f"{directory}: cannot open array {info.name} ({e})") from None


def restore(directory: str, target: dict[Path, Any]) -> dict[Path, Any]:
  """Restore the arrays of `target` (k3jax path -> jax.ShapeDtypeStruct, with a sharding if
  wanted), and only those, through Orbax's PyTree restore; returns path -> array (numpy, or a
  jax.Array where a sharding was given: each process reads the chunks of its shards)."""
  tree: dict[str, Any] = {}
  for path, leaf in target.items():
    node = tree
    for k in path:
      node = node.setdefault(k, {})
    node["value"] = leaf
  restored = ocp.Checkpointer(ocp.PyTreeCheckpointHandler()).restore(
      _orbax_path(directory), args=ocp.args.PyTreeRestore(
          tree, restore_args=ocp.checkpoint_utils.construct_restore_args(tree),
          partial_restore=True))
  out = {}
  for path in target:
    node = restored
    for k in path:
      node = node[k]
    out[path] = node["value"]
  return out


def shape_dtype(shape, dtype, sharding=None) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype), sharding=sharding)
