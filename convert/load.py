"""Build a k3jax model from a converted checkpoint (or, via `load_any`, from an HF folder too).

A converted checkpoint restores through the standard Orbax API into the abstract state of the
model its `k3jax_config.json` describes. Two cases need more than that:
- `--experts mxfp4` checkpoints hold the routed experts as codes + scales: they are restored
  as uint8 and dequantised (exactly) into the model's expert weights, one expert at a time.
  With `keep_packed=True` they stay codes + scales instead: the model's routed experts hold
  them (`RoutedExperts.w1_packed`, `w1_scale`, as `lora.adapt(base_experts="mxfp4")` sets
  them) and its grouped matmuls dequantise a tile at a time (pallas_kernels/mxfp4/ops.py);
  a checkpoint of bf16 experts is packed after loading (exact for MXFP4 values).
- `--layers A-B` checkpoints hold a slice of the model. Only a prefix (A = 0) can run: it is
  loaded as the truncated model of layers 0..B (`allow_partial=True`), whose per-layer outputs
  can be checked against a reference; its head is absent unless B is the last layer.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np
from flax import nnx

import configs
from convert import orbax_io
from convert.hf_load import build_model, load_model
from convert.name_map import PACKED
from convert.source import open_source
from convert.stream import load_folder_sharded
from convert.to_orbax import CONFIG, MANIFEST, packed_paths
from convert.variables import abstract_variables
from k3jax.config import ModelConfig
from k3jax.errors import CheckpointError
from k3jax.execution import Execution, recorded
from k3jax.model import lora
from k3jax.model.schedule import STACKS, stack_sizes
from k3jax.model.transformer import K3Model
from pallas_kernels import mxfp4
from sharding.placement import path_shardings, place_model


def is_checkpoint(path: str) -> bool:
  return os.path.exists(os.path.join(path, CONFIG)) and os.path.exists(
      os.path.join(path, orbax_io.METADATA))


def read_manifest(directory: str) -> dict | None:
  """The conversion manifest, or None for a checkpoint k3jax saved itself (e.g. training)."""
  path = os.path.join(directory, MANIFEST)
  if not os.path.exists(path):
    return None
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise CheckpointError(f"{path}: unreadable manifest ({e})") from None


def checkpoint_config(directory: str, **overrides: Any) -> ModelConfig:
  if not os.path.exists(os.path.join(directory, CONFIG)):
    raise CheckpointError(f"{directory}: no {CONFIG} (not a k3jax checkpoint)")
  return configs.resolve(directory, **overrides)


def checkpoint_execution(directory: str) -> Execution:
  """The execution a checkpoint records for its weights (`k3jax train` outputs: the compute
  and master dtypes they were trained in; k3jax_config.json files written before the split
  hold them in "config"); the defaults (float32) for a converted checkpoint, which records
  none: its arrays keep their own dtypes on disk and are restored into `ex`'s."""
  path = os.path.join(directory, CONFIG)
  try:
    with open(path) as f:
      return recorded(json.load(f))
  except FileNotFoundError:
    raise CheckpointError(f"{directory}: no {CONFIG} (not a k3jax checkpoint)") from None
  except json.JSONDecodeError as e:
    raise CheckpointError(f"{path}: not valid JSON ({e})") from None


def prefix_config(cfg: ModelConfig, n_layers: int) -> ModelConfig:
  """The model made of layers 0..n_layers-1 of `cfg`."""
  return cfg.replace(num_layers=n_layers, mla_layers=tuple(l for l in cfg.mla_layers
                                                          if l < n_layers))


def named_shardings(cfg: ModelConfig, mesh, *, keep_packed: bool = False) -> dict:
  """k3jax path -> NamedSharding on `mesh` from each variable's logical axis names through
  the rules table (sharding/placement.py): the targets of a sharded `load_checkpoint`. Refuses
  (sharding.mesh.MeshError, one line) a mesh that cannot split the model. keep_packed: the
  packed experts' codes and scales too."""
  out = path_shardings(abstract_variables(cfg), mesh)
  if keep_packed:
    out |= path_shardings(packed_variables(cfg, Execution()), mesh)
  return out


def pack_experts(model):
  """The model with its routed experts held as MXFP4 codes + scales (in place)."""
  return lora.adapt(model, lora.AdaptSpec(base_experts="mxfp4"), nnx.Rngs(0))



def packed_variables(cfg: ModelConfig, ex: Execution) -> dict:
  """k3jax path -> abstract variable of the model (run as `ex`) with packed routed experts."""
  abstract = nnx.eval_shape(lambda: pack_experts(_model(cfg, ex)))
  return {tuple(str(p) for p in path): v for path, v in nnx.to_flat_state(nnx.state(abstract))}


def load_checkpoint(directory: str, ex: Execution | None = None, *, allow_partial: bool = False,
                    shardings=None, keep_packed: bool = False, **overrides: Any):
  """(model, cfg) from a converted checkpoint, run as `ex` says and held in ex.param_dtype
  (None: the execution the checkpoint records, `checkpoint_execution`). `shardings` (k3jax
  path -> jax.sharding.Sharding, e.g. `named_shardings(cfg, mesh)`) places each array as
  Orbax restores it: each process reads only the chunks of its own shards. keep_packed: the
  routed experts held as MXFP4 codes + scales (see the module docstring)."""
  cfg = checkpoint_config(directory, **overrides)
  ex = checkpoint_execution(directory) if ex is None else ex
  manifest = read_manifest(directory) or {}
  layers = manifest.get("layers")
  if layers is not None and not allow_partial:
    raise CheckpointError(f"{directory} holds layers {layers[0]}-{layers[1]} only "
                          f"(converted with --layers); the model has {cfg.num_layers}")
  if layers is not None and layers[0] != 0:
    raise CheckpointError(f"{directory} holds layers {layers[0]}-{layers[1]}: only a prefix "
                          "(0-B) can be run")
  codes = manifest.get("experts") == "mxfp4"
  if keep_packed and not codes:  # bf16 experts: loaded, then packed
    model, cfg = load_checkpoint(directory, ex, allow_partial=allow_partial,
                                 shardings=shardings, **overrides)
    return pack_experts(model), cfg
  if keep_packed:  # the codes and scales are the packed model's own variables
    return _load_packed(directory, cfg, ex, layers, shardings)
  variables = abstract_variables(cfg, ex)
  saved = orbax_io.saved_paths(directory)
  target = {}
  for path, var in variables.items():
    dtype = np.dtype(var.get_value().dtype)
    sharding = (shardings or {}).get(path)
    if codes and path[:2] == ("moe", "experts"):
      for p in packed_paths(path):
        target[p] = orbax_io.shape_dtype(saved.get(p, ()), np.uint8)
    else:
      target[path] = orbax_io.shape_dtype(var.shape, dtype, sharding)
  for path, leaf in target.items():
    if path not in saved:
      raise CheckpointError(f"{directory}: no array {'.'.join(path)} (checkpoint of another "
                            "config?)")
    if tuple(saved[path]) != tuple(leaf.shape):
      raise CheckpointError(f"{directory}: array {'.'.join(path)} has shape "
                            f"{list(saved[path])}, the config needs {list(leaf.shape)}")
  extra = sorted(".".join(p) for p in set(saved) - set(target))
  if extra:
    raise CheckpointError(f"{directory}: unexpected array {extra[0]}")

  if layers is not None:
    return _load_prefix(directory, cfg, ex, layers[1] + 1, target, codes)
  if codes and shardings:  # the experts straight into their shardings, block by block
    arrays = orbax_io.restore(directory, {p: t for p, t in target.items()
                                          if not p[-1].endswith(("_packed", "_scale"))})
    arrays.update(_dequantized_sharded(directory, variables, shardings))
    return build_model(cfg, ex, arrays), cfg
  arrays = orbax_io.restore(directory, target)
  if codes:
    _dequantize_experts(arrays, variables)
  return build_model(cfg, ex, arrays), cfg


def _load_packed(directory: str, cfg: ModelConfig, ex: Execution, layers, shardings):
  """The model with packed experts from a `--experts mxfp4` checkpoint: every array restored
  as saved (a prefix of the layers for `--layers 0-B`, see _load_prefix)."""
  if layers is not None:
    cfg = prefix_config(cfg, layers[1] + 1)
  variables = packed_variables(cfg, ex)
  saved = orbax_io.saved_paths(directory)
  for path, var in variables.items():
    if path not in saved:
      raise CheckpointError(f"{directory}: no array {'.'.join(path)} (checkpoint of another "
                            "config?)")
    if layers is None and tuple(saved[path]) != tuple(var.shape):
      raise CheckpointError(f"{directory}: array {'.'.join(path)} has shape "
                            f"{list(saved[path])}, the config needs {list(var.shape)}")
  if layers is not None:
    counts = stack_sizes(cfg)
    arrays = {}
    for path in variables:
      if path[0] in STACKS and counts[path[0]] == 0:
        continue
      store = orbax_io.open_array(directory, path)
      arrays[path] = (store[: counts[path[0]]] if path[0] in STACKS else store).read().result()
  else:
    arrays = orbax_io.restore(directory, {
        path: orbax_io.shape_dtype(var.shape, np.dtype(var.get_value().dtype),
                                   (shardings or {}).get(path))
        for path, var in variables.items()})
  abstract = nnx.eval_shape(lambda: pack_experts(_model(cfg, ex)))
  return build_model(cfg, ex, arrays, abstract=abstract), cfg


def _model(cfg, ex):
  return K3Model(cfg, ex, rngs=nnx.Rngs(0))


def _dequantized_sharded(directory: str, variables: dict, shardings: dict) -> dict:
  """Each kept-MXFP4 expert stack as a jax.Array in its sharding: every device's block is
  made from the codes and scales of that block only (read through Orbax's read spec), so a
  process reads and holds nothing but its own shards."""
  out = {}
  for path, var in variables.items():
    if path[:2] != ("moe", "experts"):
      continue
    dtype = np.dtype(var.get_value().dtype)
    codes, scales = (orbax_io.open_array(directory, p) for p in packed_paths(path))
    out[path] = jax.make_array_from_callback(
        tuple(var.shape), shardings[path],
        lambda index, codes=codes, scales=scales, shape=tuple(var.shape), dtype=dtype:
            _dequantized_block(codes, scales, index, shape, dtype))
  return out


def _dequantized_block(codes, scales, index, shape, dtype) -> np.ndarray:
  """Block `index` of weights [n, E, in, out] from codes [n, E, out, in/2] and scales
  [n, E, out, in/32]: whole groups of 32 are read and dequantised, then trimmed."""
  layers, experts, cols = (slice(*index[i].indices(shape[i])[:2]) for i in (0, 1, 3))
  a, b = index[2].indices(shape[2])[:2]
  g0, g1 = a // mxfp4.GROUP, -(-b // mxfp4.GROUP)
  half = mxfp4.GROUP // 2
  c = codes[layers, experts, cols, g0 * half:g1 * half].read().result()
  s = scales[layers, experts, cols, g0:g1].read().result()
  w = np.empty((*c.shape[:2], b - a, c.shape[2]), dtype)
  for j in range(w.shape[0]):
    for e in range(w.shape[1]):
      m = mxfp4.dequantize_np(c[j, e], s[j, e], dtype)  # [out block, whole groups]
      w[j, e] = m[:, a - g0 * mxfp4.GROUP:b - g0 * mxfp4.GROUP].T
  return w


def _dequantize_experts(arrays: dict, variables: dict) -> None:
  for path, var in variables.items():
    if path[:2] != ("moe", "experts"):
      continue
    c, s = packed_paths(path)
    codes, scales = np.asarray(arrays.pop(c)), np.asarray(arrays.pop(s))
    w = np.empty(var.shape, np.dtype(var.get_value().dtype))
    for j in range(w.shape[0]):
      for e in range(w.shape[1]):
        w[j, e] = mxfp4.dequantize_np(codes[j, e], scales[j, e]).T  # [out, in] -> [in, out]
    arrays[path] = w


def _load_prefix(directory, cfg, ex, n_layers, target, codes):
  """The truncated model of the layers a partial checkpoint holds, read with TensorStore: the
  arrays have the full model's shapes, and the entries never converted read as zeros."""
  small = prefix_config(cfg, n_layers)
  counts = stack_sizes(small)
  arrays = {}
  for path in target:
    store = orbax_io.open_array(directory, path)
    if path[0] in STACKS:
      if counts[path[0]] == 0:
        continue
      store = store[: counts[path[0]]]
    arrays[path] = store.read().result()
  if codes:
    _dequantize_experts(arrays, abstract_variables(small, ex))
  return build_model(small, ex, arrays), small


def stores_packed_experts(path: str) -> bool:
  """Whether the folder stores the routed experts as MXFP4 codes + scales: a checkpoint
  converted with `--experts mxfp4`, or an official-layout folder with `.weight_packed` tensors
  (the released K3). Only the manifest or the index is read."""
  if is_checkpoint(path):
    return (read_manifest(path) or {}).get("experts") == "mxfp4"
  return any(name.endswith(PACKED) for name in open_source(path).index)


def load_any(path: str, ex: Execution | None = None, *, mesh=None, keep_packed: bool = False,
             **overrides: Any):
  """(model, cfg) from a converted checkpoint or an official-layout folder, run as `ex` says
  (None: what a checkpoint records, `checkpoint_execution`; the defaults for a folder). With
  `mesh`, every array in its sharding from the rules table (a mesh that cannot split the model
  is refused before anything is read): a checkpoint is restored by Orbax straight into its
  shards; from an official-layout folder each process reads the byte ranges of its devices'
  blocks only (convert/stream.py), so no host holds a whole tensor it does not keep.
  keep_packed: the routed experts held as MXFP4 codes + scales (an official-layout folder's
  are read dequantised, then packed again: exact)."""
  if mesh is None:
    if is_checkpoint(path):
      return load_checkpoint(path, ex, allow_partial=True, keep_packed=keep_packed, **overrides)
    model, cfg = load_model(path, ex or Execution(), **overrides)
    return (pack_experts(model) if keep_packed else model), cfg
  model, cfg = load_sharded(path, ex, mesh, keep_packed=keep_packed, allow_partial=True,
                            **overrides)
  place_model(model, mesh)  # a no-op for arrays already in their shardings
  return model, cfg


def load_sharded(path: str, ex: Execution | None, mesh, *, keep_packed: bool = False,
                 allow_partial: bool = False, **overrides: Any):
  """(model, cfg) with every array read straight into its sharding on `mesh` from the rules
  table (a mesh that cannot split the model is refused before anything is read): a checkpoint
  by Orbax's sharded restore, an official-layout folder by each process reading the byte
  ranges of its own devices' blocks (convert/stream.py). No host holds a tensor it does not
  keep. keep_packed: as `load_any`'s (a folder's float experts are packed after loading)."""
  shardings = named_shardings(configs.resolve(path, **overrides), mesh, keep_packed=keep_packed)
  if is_checkpoint(path):
    return load_checkpoint(path, ex, allow_partial=allow_partial, shardings=shardings,
                           keep_packed=keep_packed, **overrides)
  source, ex = open_source(path, **overrides), ex or Execution()
  cfg = source.cfg
  try:
    if keep_packed and stores_packed_experts(path):  # the codes and scales as released
      arrays = load_folder_sharded(source, cfg, ex, shardings, packed_variables(cfg, ex))
      abstract = nnx.eval_shape(lambda: pack_experts(_model(cfg, ex)))
      model = build_model(cfg, ex, arrays, abstract=abstract)
    else:
      model = build_model(cfg, ex, load_folder_sharded(source, cfg, ex, shardings))
      if keep_packed:
        model = pack_experts(model)
  finally:
    source.reader.close()
  return model, cfg
