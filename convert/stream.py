"""Per-host streaming load: safetensors tensors straight into sharded jax.Arrays.

Each process builds its part of a global array with `jax.make_array_from_callback`: the
callback gets the index (a box: a slice per axis) of one of the process's addressable device
shards and reads exactly that box from the file (`ShardReader.read_box`, positioned reads of
the box's contiguous runs). So in a multi-process run a process reads only the bytes of the
shards its devices hold, never a whole tensor that it then slices, and its host memory holds
one box at a time on top of what its devices hold. MXFP4 experts kept packed are two tensors
(codes, scales) read the same way: a process reads the codes and scales of its experts only.
"""

from __future__ import annotations

import os

import jax
import numpy as np

from convert.safetensors_io import ShardReader
from k3jax.errors import CheckpointError


def sharded_tensor(reader: ShardReader, path: str, name: str,
                   sharding: jax.sharding.Sharding) -> jax.Array:
  """Tensor `name` of safetensors file `path` as a global jax.Array laid out by `sharding`,
  each addressable shard read as its own box (replicas on one process are read once). Host
  memory: the distinct boxes of this one tensor that the process holds, until it returns."""
  info = reader.header(path).tensors.get(name)
  if info is None:
    raise CheckpointError(f"{os.path.basename(path)}: no tensor {name}")
  shape = info.shape
  cache: dict[tuple, np.ndarray] = {}

  def box(index: tuple[slice, ...]) -> np.ndarray:
    key = tuple(s.indices(d)[:2] for s, d in zip(index, shape))
    if key not in cache:  # devices holding the same block (replication) share one read
      cache[key] = reader.read_box(path, name, index)
    return cache[key]

  return jax.make_array_from_callback(tuple(shape), sharding, box)


def sharded_packed(reader: ShardReader, codes: tuple[str, str], scales: tuple[str, str],
                   codes_sharding: jax.sharding.Sharding,
                   scales_sharding: jax.sharding.Sharding) -> tuple[jax.Array, jax.Array]:
  """MXFP4 (codes, scales), each a (file, tensor name), kept packed: every process reads the
  packed bytes and scales of the experts (and rows) its devices hold, nothing else."""
  return (sharded_tensor(reader, *codes, codes_sharding),
          sharded_tensor(reader, *scales, scales_sharding))


def addressable_boxes(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> dict:
  """device -> the box (slice per axis) of `shape` that this process's device holds."""
  return dict(sharding.addressable_devices_indices_map(tuple(shape)))
