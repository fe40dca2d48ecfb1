"""The converted checkpoint: an Orbax PyTree checkpoint written array slice by array slice.

On disk it is exactly what `ocp.StandardCheckpointer().save(path, nnx.state(model))` writes
with `use_ocdbt=False` (Orbax's plain TensorStore/zarr layout): one zarr array per variable in
a folder named by its key path (`moe.experts.w1.value`: nnx Variables flatten to a `value`
leaf), and `_METADATA` describing the tree. So the standard Orbax calls restore it:

    abstract = nnx.state(nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0))))
    state = ocp.StandardCheckpointer().restore(path, abstract)

What differs is how it is written: the arrays are created at their full stacked shapes up
front and filled one HF tensor at a time (`[layer_j]`, `[layer_j, expert_e]`), so nothing
bigger than one tensor is ever held. Chunks follow those slices (one stack entry, split into
row blocks of <= 64 MiB), so every write covers whole chunks and no chunk is read back.
Chunks are stored uncompressed: weights barely compress, and zstd would cost more CPU time
than the disk time it saves.

With `--experts mxfp4` the routed experts are kept as their codes and scales
(`moe.experts.w1_packed` uint8 [n_moe, E, out, in/2] and `moe.experts.w1_scale` uint8
[n_moe, E, out, in/32], the HF orientation) instead of `moe.experts.w1`; `load_checkpoint`
dequantises them (exactly) into the model's expert weights.
"""

from __future__ import annotations

import collections
import json
import math
import os
from typing import Any

import jax
import ml_dtypes
import numpy as np
import tensorstore as ts

from convert.errors import CheckpointError

Path = tuple[str, ...]
CHUNK_BYTES = 64 << 20
INFLIGHT_BYTES = 128 << 20
METADATA = "_METADATA"


def param_name(path: Path) -> str:
  """Orbax's folder name for a k3jax variable path (key path joined by dots, plus `value`)."""
  return ".".join((*path, "value"))


def _zarr_dtype(dtype: np.dtype) -> str:
  dtype = np.dtype(dtype)
  return "bfloat16" if dtype == ml_dtypes.bfloat16 else dtype.str


def chunk_shape(shape: tuple[int, ...], n_lead: int, itemsize: int) -> list[int]:
  """One stack entry per chunk, its first axis split into blocks of <= CHUNK_BYTES."""
  rest = shape[n_lead:]
  if not rest:
    return [1] * n_lead
  row = math.prod(rest[1:]) * itemsize
  rows = max(1, min(rest[0], CHUNK_BYTES // max(row, 1)))
  return [1] * n_lead + [rows, *rest[1:]]


class CheckpointWriter:
  """Creates the arrays of an Orbax checkpoint and fills them slice by slice, asynchronously,
  with a bounded amount of data in flight."""

  def __init__(self, directory: str):
    self.directory = directory
    self.arrays: dict[Path, ts.TensorStore] = {}
    self._rows: dict[Path, int] = {}
    self._lead: dict[Path, int] = {}
    self._inflight: collections.deque = collections.deque()
    self._inflight_bytes = 0
    # No cache: written chunks are never read back. No fsync per chunk either (it serialises
    # the writes on the disk); `finish` syncs every file once, before the folder is renamed.
    self._context = ts.Context({"cache_pool": {"total_bytes_limit": 0},
                                "file_io_concurrency": {"limit": 8}, "file_io_sync": False})

  def create(self, path: Path, shape: tuple[int, ...], dtype, n_lead: int) -> None:
    dtype = np.dtype(dtype)
    chunks = chunk_shape(tuple(shape), n_lead, dtype.itemsize)
    spec = {
        "driver": "zarr",
        "kvstore": {"driver": "file", "path": os.path.join(self.directory, param_name(path))},
        "metadata": {"shape": list(shape), "chunks": chunks, "dtype": _zarr_dtype(dtype),
                     "compressor": None, "fill_value": None},
        "create": True,
    }
    self.arrays[path] = ts.open(spec, context=self._context).result()
    self._rows[path] = chunks[n_lead] if len(shape) > n_lead else 1
    self._lead[path] = n_lead

  def write(self, path: Path, index: tuple[int, ...], array: np.ndarray) -> None:
    """arrays[path][index] = array, in chunk-aligned slabs along the first non-stack axis."""
    store = self.arrays[path]
    target = store.dtype.numpy_dtype
    if len(index) != self._lead[path]:
      raise ValueError(f"{'.'.join(path)}: index {index} does not address one stack entry")
    expect = tuple(store.shape[len(index):])
    if tuple(array.shape) != expect:
      raise CheckpointError(f"{'.'.join(path)}: got shape {tuple(array.shape)}, the checkpoint "
                            f"array takes {expect}")
    if array.ndim == 0:
      self._submit(store[index], np.asarray(array, target))
      return
    rows = self._rows[path]
    for r in range(0, array.shape[0], rows):
      slab = np.ascontiguousarray(array[r:r + rows], dtype=target)
      self._submit(store[(*index, slice(r, r + slab.shape[0]))], slab)
    if array.nbytes > INFLIGHT_BYTES:
      # the slabs in flight are views that keep this whole array alive: let them land before
      # the caller reads the next big tensor, or two of them would be in memory at once
      self.flush()

  def _submit(self, view: ts.TensorStore, data: np.ndarray) -> None:
    while self._inflight and self._inflight_bytes + data.nbytes > INFLIGHT_BYTES:
      self._retire()
    # `data` is a private copy nobody modifies: TensorStore may keep it instead of copying.
    future = view.write(data, can_reference_source_data_indefinitely=True)
    self._inflight.append((future, data.nbytes))
    self._inflight_bytes += data.nbytes

  def _retire(self) -> None:
    future, nbytes = self._inflight.popleft()
    future.result()
    self._inflight_bytes -= nbytes

  def flush(self) -> None:
    while self._inflight:
      self._retire()

  def finish(self) -> None:
    """Wait for every write, then write Orbax's `_METADATA` (the tree it restores)."""
    self.flush()
    tree = {}
    for path, store in sorted(self.arrays.items()):
      keys = (*path, "value")
      tree[str(keys)] = {
          "key_metadata": [{"key": k, "key_type": 2} for k in keys],  # 2: a dict key
          "value_metadata": {"value_type": "jax.Array", "skip_deserialize": False,
                             "write_shape": list(store.shape)},
      }
    meta = {"tree_metadata": tree, "use_ocdbt": False, "use_zarr3": False,
            "store_array_data_equal_to_fill_value": True, "custom_metadata": None}
    with open(os.path.join(self.directory, METADATA), "w") as f:
      json.dump(meta, f)
    sync_tree(self.directory)


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

def saved_paths(directory: str) -> dict[Path, tuple[int, ...]]:
  """k3jax path -> shape of every array in an Orbax checkpoint (from its `_METADATA`)."""
  try:
    with open(os.path.join(directory, METADATA)) as f:
      meta = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise CheckpointError(f"{directory}: not an Orbax checkpoint ({METADATA}: {e})") from None
  out = {}
  for info in meta["tree_metadata"].values():
    keys = tuple(k["key"] for k in info["key_metadata"])
    if keys[-1] == "value":
      keys = keys[:-1]
    out[keys] = tuple(info["value_metadata"].get("write_shape") or ())
  return out


def open_array(directory: str, path: Path) -> ts.TensorStore:
  """One array of a checkpoint, for slice reads: ours (plain zarr) or one Orbax itself saved
  (OCDBT by default), so `export` also takes a checkpoint written by training."""
  with open(os.path.join(directory, METADATA)) as f:
    use_ocdbt = json.load(f).get("use_ocdbt", True)
  name = param_name(path)
  if use_ocdbt:
    kvstore = {"driver": "ocdbt", "base": f"file://{os.path.abspath(directory)}", "path": name}
  else:
    kvstore = {"driver": "file", "path": os.path.join(directory, name)}
  try:
    return ts.open({"driver": "zarr", "kvstore": kvstore, "open": True}).result()
  except ValueError as e:
    raise CheckpointError(f"{directory}: cannot open array {name} ({e})") from None


def restore(directory: str, target: dict[Path, Any]) -> dict[Path, Any]:
  """Restore `target` (k3jax path -> jax.ShapeDtypeStruct, with a sharding if wanted) through
  the standard Orbax API; returns path -> array."""
  import orbax.checkpoint as ocp  # noqa: PLC0415  (slow import, only needed here)
  tree: dict[str, Any] = {}
  for path, leaf in target.items():
    node = tree
    for k in path:
      node = node.setdefault(k, {})
    node["value"] = leaf
  restored = ocp.StandardCheckpointer().restore(directory, tree)
  out = {}
  for path in target:
    node = restored
    for k in path:
      node = node[k]
    out[path] = node["value"]
  return out


def shape_dtype(shape, dtype, sharding=None) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype), sharding=sharding)
