"""Load an official-layout folder (K3 or Kimi-Linear) straight into a k3jax model, in memory.

For tests, parity and small models. The streaming Orbax converter uses the same name map and
tensor reader; this path simply keeps everything in host memory.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open

from convert import mxfp4
from convert.name_map import slots
from k3jax.config import ModelConfig, from_hf_config

K3_PREFIX = "language_model.model."
K3_HEAD = "language_model.lm_head.weight"


class CheckpointError(ValueError):
  """The checkpoint folder does not hold what its config promises."""


def weight_index(folder: str) -> dict[str, str]:
  """tensor name -> shard file path, from model.safetensors.index.json or a single file."""
  index_path = os.path.join(folder, "model.safetensors.index.json")
  if os.path.exists(index_path):
    with open(index_path) as f:
      weight_map = json.load(f)["weight_map"]
    return {k: os.path.join(folder, v) for k, v in weight_map.items()}
  single = os.path.join(folder, "model.safetensors")
  if not os.path.exists(single):
    raise CheckpointError(f"{folder}: no model.safetensors.index.json or model.safetensors")
  with safe_open(single, "flax") as f:
    return {k: single for k in f.keys()}


def hf_name(stem: str, names: dict[str, str]) -> str:
  """Full tensor name of `stem` (e.g. "layers.3.mlp.up_proj.weight") in this checkpoint."""
  if stem == "lm_head.weight":
    candidates = (K3_HEAD, "lm_head.weight")
  else:
    candidates = (K3_PREFIX + stem, "model." + stem)
  for c in candidates:
    if c in names:
      return c
  return candidates[0]


class TensorReader:
  """Reads tensors by name, keeping shard handles open; resolves MXFP4 pairs."""

  def __init__(self, folder: str):
    self.index = weight_index(folder)
    self._open: dict[str, Any] = {}

  def _get(self, name: str) -> np.ndarray:
    path = self.index[name]
    if path not in self._open:
      self._open[path] = safe_open(path, "flax")
    return np.asarray(self._open[path].get_tensor(name))

  def read(self, name: str) -> np.ndarray:
    """A weight by its `.weight` name; MXFP4 (`.weight_packed` + `.weight_scale`) is
    dequantised (exactly) to float32."""
    if name in self.index:
      return self._get(name)
    base = name.removesuffix(".weight")
    if base + ".weight_packed" in self.index:
      return mxfp4.dequantize(self._get(base + ".weight_packed"),
                              self._get(base + ".weight_scale"))
    raise CheckpointError(f"tensor {name} is missing from the checkpoint")


def load_hf_arrays(folder: str, cfg: ModelConfig) -> dict[tuple[str, ...], np.ndarray]:
  """k3jax path -> full (stacked) float array, read from `folder`."""
  reader = TensorReader(folder)
  shapes = abstract_param_shapes(cfg)
  out: dict[tuple[str, ...], np.ndarray] = {}
  for slot in slots(cfg):
    name = hf_name(slot.hf_name, reader.index)
    arrays = slot.entry.to_k3jax(reader.read(name).astype(np.float64), cfg)
    for path, arr in zip(slot.entry.paths, arrays):
      if path not in shapes:
        raise CheckpointError(f"{name}: no k3jax parameter {'.'.join(path)}")
      if path not in out:
        out[path] = np.zeros(shapes[path], np.float64)
      target = out[path][slot.index] if slot.index else out[path]
      if target.shape != arr.shape:
        raise CheckpointError(f"{name}: shape {arr.shape} does not fit {'.'.join(path)} "
                              f"{target.shape}")
      if slot.index:
        out[path][slot.index] = arr
      else:
        out[path][...] = arr
  missing = sorted(".".join(p) for p in set(shapes) - set(out))
  if missing:
    raise CheckpointError(f"no checkpoint tensor fills: {', '.join(missing)}")
  return out


def abstract_param_shapes(cfg: ModelConfig) -> dict[tuple[str, ...], tuple[int, ...]]:
  from k3jax.model.transformer import K3Model  # noqa: PLC0415  (model import is heavy)
  abstract = nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0)))
  flat = nnx.to_flat_state(nnx.state(abstract))
  return {tuple(str(p) for p in path): tuple(v.shape) for path, v in flat}


def load_model(folder: str, cfg: ModelConfig | None = None, **overrides: Any):
  """(model, cfg) with the folder's weights, in cfg.param_dtype."""
  from k3jax.model.transformer import K3Model  # noqa: PLC0415
  cfg = cfg or from_hf_config(folder, **overrides)
  arrays = load_hf_arrays(folder, cfg)
  model = nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(model)
  for path, var in nnx.to_flat_state(state):
    key = tuple(str(p) for p in path)
    dtype = var.get_value().dtype
    var.set_value(jnp.asarray(arrays[key].astype(np.dtype(dtype))))
  return nnx.merge(graphdef, state), cfg
