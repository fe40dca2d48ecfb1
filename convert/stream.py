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
from convert.source import Item, Source, items_to_read, read_weight, to_k3jax
from convert.variables import abstract_variables
from k3jax.config import ModelConfig
from k3jax.errors import CheckpointError
from k3jax.execution import Execution
from pallas_kernels import mxfp4


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


# ---- a whole model from an official-layout folder ------------------------------------------

def load_folder_sharded(source: Source, cfg: ModelConfig, ex: Execution, shardings: dict,
                        variables: dict | None = None) -> dict:
  """k3jax path -> global jax.Array in `shardings[path]` of every variable, read from the
  folder box by box: each device block of a stacked array is made from the HF tensors of its
  layers / experts only, each read as the box of it that the block needs (see `_hf_block`),
  cast to the variable's dtype. `variables` (path -> abstract variable; default the model's):
  a packed model's (`convert.load.packed_variables`) takes the `w1_packed` / `w1_scale` blocks
  of MXFP4 experts straight from the boxes of their codes and scales."""
  variables = abstract_variables(cfg, ex) if variables is None else variables
  by_path: dict[tuple, dict[tuple, tuple[Item, int]]] = {}
  shapes = {p: tuple(v.shape) for p, v in abstract_variables(cfg, ex).items()}
  for item in items_to_read(source, shapes=shapes):
    for n, path in enumerate(item.slot.entry.paths):
      by_path.setdefault(path, {})[item.slot.index] = (item, n)
      if item.mxfp4:  # the packed model's codes and scales: parts 0 and 1, as stored
        for k, suffix in enumerate(("_packed", "_scale")):
          by_path.setdefault((*path[:-1], path[-1] + suffix), {})[item.slot.index] = (item, -1 - k)
  out = {}
  for path, var in variables.items():
    shape, dtype = tuple(var.shape), np.dtype(var.get_value().dtype)
    slots = by_path.get(path, {})
    lead = len(next(iter(slots))) if slots else 0
    done: dict = {}  # blocks already made: a block on several local devices is read once

    def block(index, shape=shape, dtype=dtype, slots=slots, lead=lead, done=done):
      bounds = [s.indices(d)[:2] for s, d in zip(index, shape)]
      if tuple(bounds) in done:
        return done[tuple(bounds)]
      # zeros: the parts of a variable that no tensor fills, as load_model leaves them
      out = done[tuple(bounds)] = np.zeros([b - a for a, b in bounds], dtype)
      for combo in np.ndindex(*out.shape[:lead]):
        at = tuple(bounds[j][0] + i for j, i in enumerate(combo))
        if at in slots:
          item, n = slots[at]
          out[combo] = _hf_block(source, cfg, item, n, bounds[lead:], shape[lead:])
      return out

    out[path] = jax.make_array_from_callback(shape, shardings[path], block)
  return out


def _hf_block(source: Source, cfg: ModelConfig, item: Item, n: int, bounds,
              inner_shape) -> np.ndarray:
  """Box `bounds` of the n-th k3jax array the HF tensor `item` becomes. A whole array
  (replicated or unsplit): the whole tensor through the entry's own transform (its checks
  included). A part: the entry's transforms only move elements, so transforming the HF
  coordinates (`_coordinates`) says which HF elements the part holds; their bounding box is
  read and gathered (a box on the k3jax axes is a box on the HF axes for transposes and head
  splits; an interleaved layout, kv_b's per-head [nope | v] rows, reads the rows between)."""
  box = tuple(slice(a, b) for a, b in bounds)
  if n < 0:  # kept packed: the codes (-1) or scales (-2) as stored, [out, in/2 or in/32]
    part = item.parts[-1 - n]
    return source.reader.read_box(part.path, part.info.name, box)
  whole = all((a, b) == (0, d) for (a, b), d in zip(bounds, inner_shape))
  where = None if whole else _coordinates(item, n, box, cfg)
  if where is None:  # whole, or A_log, whose transform checks values (a vector)
    return to_k3jax(item, read_weight(source, item), cfg)[n][box]
  lo = [int(w.min()) for w in where]
  hi = [int(w.max()) + 1 for w in where]
  part = _read_hf_box(source, item, lo, hi)
  return part[tuple(w - l for w, l in zip(where, lo))]


def _coordinates(item: Item, n: int, box: tuple[slice, ...], cfg: ModelConfig):
  """For each HF axis, the HF coordinate along it of every element of box `box` of the k3jax
  array: the entry's transform applied to a zero-stride view holding each element's
  coordinate. The transforms are transposes and reshapes that numpy does as views here, so
  only the box's coordinates are materialised, not an index array of the tensor. None for a
  transform that checks the values (A_log's zero padding)."""
  info = item.parts[0].info
  hf = info.shape if not item.mxfp4 else (info.shape[0], info.shape[1] * 2)
  out = []
  for axis, dim in enumerate(hf):
    along = np.arange(dim).reshape([dim if j == axis else 1 for j in range(len(hf))])
    try:
      moved = item.slot.entry.to_k3jax(np.broadcast_to(along, hf), cfg)[n]
    except ValueError:
      return None
    out.append(np.ascontiguousarray(moved[box]))
  return tuple(out)


def _read_hf_box(source: Source, item: Item, lo, hi) -> np.ndarray:
  """Rows lo[0]:hi[0], columns lo[1]:hi[1] (every axis for a plain tensor) of the item's HF
  weight; MXFP4: the codes and scales of the whole groups of 32 covering the columns,
  dequantised exactly (bf16), then trimmed."""
  if not item.mxfp4:
    p = item.parts[0]
    return source.reader.read_box(p.path, p.info.name,
                                  tuple(slice(a, b) for a, b in zip(lo, hi)))
  (r0, c0), (r1, c1) = lo, hi
  g0, g1 = c0 // mxfp4.GROUP, -(-c1 // mxfp4.GROUP)
  half = mxfp4.GROUP // 2
  codes, scales = item.parts
  c = source.reader.read_box(codes.path, codes.info.name,
                             (slice(r0, r1), slice(g0 * half, g1 * half)))
  s = source.reader.read_box(scales.path, scales.info.name, (slice(r0, r1), slice(g0, g1)))
  w = mxfp4.dequantize_np(c, s, dtype=np.dtype("bfloat16"))
  return w[:, c0 - g0 * mxfp4.GROUP:c1 - g0 * mxfp4.GROUP]
