"""An official-layout folder (K3 or Kimi-Linear) checked against its config, before any weight
is read, and listed as the reads of its tensors in file order.

`open_source` reads config.json and the index (or the lone model.safetensors) and refuses shard
paths that leave the folder. `items_to_read` matches every tensor the config implies (through the
name map, in every spelling it knows) against the index: missing, extra, misplaced (index vs.
shard header), mistyped and misshapen tensors are refused here, by name, with the file. Vision
tensors are skipped without opening their shards. The list is sorted by (shard, offset), so a
converter reads each shard front to back.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable

import numpy as np

from convert.name_map import (
  DIALECTS,
  PACKED,
  SCALE,
  Dialect,
  Entry,
  Slot,
  full_name,
  hf_shape,
  slots,
)
from convert.safetensors_io import Header, ShardReader, TensorInfo
from convert.variables import param_shapes
from k3jax.config import ModelConfig
from k3jax.errors import CheckpointError, ConfigError
from k3jax.hf_config import from_hf_config
from pallas_kernels import mxfp4

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
VISION_PREFIXES = ("vision_tower.", "mm_projector.")
# Dtypes a tensor may have on disk. The official K3 release is exact about them; Kimi-Linear
# folders come in whatever float dtype the writer used (transformers saves the model's dtype).
_K3_DTYPES = {"bf16": ("BF16",), "f32": ("F32",)}
_FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")


@dataclasses.dataclass(frozen=True)
class Part:
  path: str            # shard file
  info: TensorInfo


@dataclasses.dataclass(frozen=True)
class Item:
  """One tensor of the model as stored: a plain weight, or an MXFP4 (codes, scales) pair."""
  slot: Slot
  name: str                      # the `.weight` name as this checkpoint spells it
  parts: tuple[Part, ...]        # (weight,) or (codes, scales)

  @property
  def mxfp4(self) -> bool:
    return len(self.parts) == 2

  @property
  def nbytes(self) -> int:
    return sum(p.info.nbytes for p in self.parts)


@dataclasses.dataclass
class Source:
  folder: str
  cfg: ModelConfig
  dialect: Dialect
  config_raw: bytes                      # config.json exactly as found
  index: dict[str, str]                  # tensor name -> shard path (vision excluded)
  index_metadata: dict | None            # the index's "metadata" (None for a single file)
  shard_files: tuple[str, ...]           # shard file names in index order (vision included)
  reader: ShardReader = dataclasses.field(default_factory=ShardReader)

  def header(self, path: str) -> Header:
    return self.reader.header(path)


def _inside(folder: str, rel: str) -> str:
  """The path of shard `rel` if it stays inside `folder`; refuses anything else."""
  if not isinstance(rel, str) or not rel or "\\" in rel:
    raise CheckpointError(f"{INDEX}: shard path {rel!r} is not a file name")
  if os.path.isabs(rel):
    raise CheckpointError(f"{INDEX}: shard path {rel!r} points outside the checkpoint folder")
  root = os.path.realpath(folder)
  path = os.path.realpath(os.path.join(root, rel))
  if os.path.dirname(path) != root and not path.startswith(root + os.sep):
    raise CheckpointError(f"{INDEX}: shard path {rel!r} points outside the checkpoint folder")
  return path


def _read_index(folder: str, reader: ShardReader):
  index_path = os.path.join(folder, INDEX)
  if os.path.exists(index_path):
    try:
      with open(index_path) as f:
        raw = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
      raise CheckpointError(f"{INDEX}: not valid JSON ({e})") from None
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict):
      raise CheckpointError(f"{INDEX}: no weight_map object")
    files: dict[str, str] = {}
    index = {}
    for name, rel in weight_map.items():
      if rel not in files:
        files[rel] = _inside(folder, rel)
      index[name] = files[rel]
    return index, raw.get("metadata"), tuple(files)
  single = os.path.join(folder, SINGLE)
  if not os.path.exists(single):
    raise CheckpointError(f"{folder}: no {INDEX} and no {SINGLE}")
  names = reader.header(single).tensors
  return dict.fromkeys(names, single), None, (SINGLE,)


def open_source(folder: str, **overrides) -> Source:
  """Config, dialect and index of an official-layout folder (no weight is read)."""
  if not os.path.isdir(folder):
    raise CheckpointError(f"{folder}: not a folder")
  config_path = os.path.join(folder, "config.json")
  try:
    with open(config_path, "rb") as f:
      config_raw = f.read()
  except OSError:
    raise CheckpointError(f"{folder}: no config.json") from None
  try:
    cfg = from_hf_config(config_path, **overrides)
  except ConfigError as e:
    msg = str(e)
    raise ConfigError(msg if msg.startswith(config_path) else f"config.json: {msg}") from None
  reader = ShardReader()
  index, metadata, files = _read_index(folder, reader)
  index = {k: v for k, v in index.items() if not k.startswith(VISION_PREFIXES)}
  for dialect in DIALECTS.values():
    if full_name("embed_tokens.weight", dialect) in index:
      break
  else:
    names = " or ".join(full_name("embed_tokens.weight", d) for d in DIALECTS.values())
    raise CheckpointError(f"{folder}: no embedding tensor (looked for {names})")
  return Source(os.path.abspath(folder), cfg, dialect, config_raw, index, metadata, files, reader)


def layer_range(spec: str | None, cfg: ModelConfig) -> range | None:
  """'A-B' (inclusive) or 'A' -> range; None -> every layer."""
  if spec is None:
    return None
  try:
    a, _, b = spec.partition("-")
    lo, hi = int(a), int(b or a)
  except ValueError:
    raise CheckpointError(f"--layers {spec!r}: expected A-B, e.g. 0-3") from None
  if not 0 <= lo <= hi < cfg.num_layers:
    raise CheckpointError(f"--layers {spec!r}: the model has layers 0-{cfg.num_layers - 1}")
  return range(lo, hi + 1)


def _expected_dtypes(source: Source, item_slot: Slot) -> tuple[str, ...]:
  if source.dialect.name == "k3":
    return _K3_DTYPES[item_slot.entry.hf_dtype]
  return _FLOAT_DTYPES


def items_to_read(source: Source, layers: range | None = None, shapes: dict | None = None,
                  keep: Callable[[Slot], bool] | None = None) -> list[Item]:
  """Every tensor to read for `layers` (and the global ones `keep` accepts), validated, in
  (shard, offset) order. Only the shards holding them need to exist (a partial download).

  Also checks the whole index for tensors the config does not explain (extra tensors), so a
  partial list still refuses a folder that is not the model its config describes.
  """
  cfg, dialect = source.cfg, source.dialect
  if shapes is None:
    shapes = param_shapes(cfg)
  expected: dict[Entry, tuple[int, ...]] = {}
  known: set[str] = set()
  for slot in slots(cfg):
    for stem in slot.names:
      name = full_name(stem, dialect)
      known.add(name)
      if slot.entry.mxfp4:
        known.update((name.removesuffix(".weight") + PACKED, name.removesuffix(".weight") + SCALE))
  extra = sorted(set(source.index) - known)
  if extra:
    more = f" and {len(extra) - 1} more" if len(extra) > 1 else ""
    raise CheckpointError(f"unexpected tensor {extra[0]} in "
                          f"{os.path.basename(source.index[extra[0]])}{more}: the config "
                          "does not have it")

  items = []
  for slot in slots(cfg, layers):
    if keep is not None and not keep(slot):
      continue
    entry = slot.entry
    if entry not in expected:
      expected[entry] = hf_shape(entry, cfg, shapes)
    items.append(_item(source, slot, expected[entry]))
  _check_files(source, items)
  items.sort(key=lambda it: (it.parts[0].path, it.parts[0].info.begin))  # shards are numbered
  return items


def _item(source: Source, slot: Slot, shape: tuple[int, ...]) -> Item:
  dialect = source.dialect
  present = [full_name(s, dialect) for s in slot.names if full_name(s, dialect) in source.index]
  base = full_name(slot.hf_name, dialect).removesuffix(".weight")
  packed = slot.entry.mxfp4 and base + PACKED in source.index
  if len(present) > 1 or (present and packed):
    raise CheckpointError(f"tensor {full_name(slot.hf_name, dialect)} is stored twice "
                          f"({', '.join(present + ([base + PACKED] if packed else []))})")
  if packed:
    if base + SCALE not in source.index:
      raise CheckpointError(f"tensor {base + SCALE} is missing (its codes {base + PACKED} "
                            "are present)")
    out, fan_in = shape
    parts = (_part(source, base + PACKED, ("U8",), (out, fan_in // 2)),
             _part(source, base + SCALE, ("U8",), (out, fan_in // mxfp4.GROUP)))
    return Item(slot, base + ".weight", parts)
  if not present:
    raise CheckpointError(f"tensor {full_name(slot.hf_name, dialect)} is missing from the "
                          "checkpoint")
  return Item(slot, present[0], (_part(source, present[0], _expected_dtypes(source, slot), shape),))


def _part(source: Source, name: str, dtypes: tuple[str, ...], shape: tuple[int, ...]) -> Part:
  path = source.index[name]
  file = os.path.basename(path)
  if not os.path.exists(path):
    raise CheckpointError(f"{file}: shard file is missing (index entry for {name})")
  header = source.header(path)
  info = header.tensors.get(name)
  if info is None:
    raise CheckpointError(f"{file}: the index puts {name} here, but the file does not hold it")
  if info.dtype not in dtypes:
    raise CheckpointError(f"{file}: tensor {name} has dtype {info.dtype}, expected "
                          f"{' or '.join(dtypes)}")
  if info.shape != tuple(shape):
    raise CheckpointError(f"{file}: tensor {name} has shape {list(info.shape)}, expected "
                          f"{list(shape)}")
  return Part(path, info)


def _check_files(source: Source, items: list[Item]) -> None:
  """Each shard read holds only indexed tensors: what we would not convert, export can't
  write back."""
  indexed = set(source.index)
  for path in sorted({p.path for it in items for p in it.parts}):
    stray = sorted(n for n in set(source.header(path).tensors) - indexed
                   if not n.startswith(VISION_PREFIXES))
    if stray:
      raise CheckpointError(f"{os.path.basename(path)}: tensor {stray[0]} is in the file but "
                            "not in the index")


def read_weight(source: Source, item: Item, rows: slice | None = None) -> np.ndarray:
  """The item's HF-layout weight (MXFP4 dequantised exactly to bf16); only `rows` if given."""
  if item.mxfp4:
    codes, scales = (source.reader.read(p.path, p.info.name, rows) for p in item.parts)
    return mxfp4.dequantize_np(codes, scales, dtype=np.dtype("bfloat16"))
  p = item.parts[0]
  return source.reader.read(p.path, p.info.name, rows)


def to_k3jax(item: Item, weight: np.ndarray, cfg: ModelConfig) -> tuple[np.ndarray, ...]:
  """The entry's layout transform; its complaints (e.g. non-zero A_log padding) name the tensor."""
  try:
    return item.slot.entry.to_k3jax(weight, cfg)
  except ValueError as e:
    raise CheckpointError(f"tensor {item.name}: {e}") from None
