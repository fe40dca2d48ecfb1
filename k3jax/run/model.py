"""Opening the model a command names (k3jax/folders.py: an official-layout folder, a k3jax
checkpoint, or a `k3jax train` output): its architecture, and its weights loaded for a run
(train, rl) or for serving (generate, serve, eval).
"""

from __future__ import annotations

import enum
import os

import configs
from convert import load as convert_load
from convert.hf_load import load_model
from k3jax.config import ModelConfig
from k3jax.errors import CheckpointError, UserError
from k3jax.execution import NUMERICS, Execution
from k3jax.folders import ModelFolder, model_folder


class Experts(enum.StrEnum):
  """The routed experts of a served model (`--experts`)."""
  DEQUANTIZED = "dequantized"  # MXFP4 experts expanded to the run dtype as they load
  MXFP4 = "mxfp4"              # kept packed, run by the MXFP4 grouped matmul


def existing_folder(path: str) -> ModelFolder:
  """The model folder MODEL of a serving command; one line when there is none."""
  if not os.path.exists(path):
    raise UserError(f"{path}: no such model folder")
  return model_folder(path)


def model_config(init_from: str | None, config: str | None = None) -> ModelConfig:
  """The architecture of `--init-from` (a model folder of any kind; folders.py), else of the
  preset or config file `config` (default tiny)."""
  if init_from and not os.path.isdir(init_from):
    raise UserError(f"--init-from {init_from}: no such folder")
  if not init_from:
    return configs.resolve(config or "tiny")
  weights = model_folder(init_from).weights
  if convert_load.is_checkpoint(weights):
    return convert_load.checkpoint_config(weights)
  return configs.resolve(weights)


def load_init(path: str, ex: Execution, shardings: dict | None = None):
  """(model, cfg) from a converted checkpoint or an official-layout folder, run as `ex` says.
  `shardings` (k3jax path -> NamedSharding) makes Orbax restore a checkpoint's arrays into
  their shards; an official-layout folder is read into host memory (convert it first for big
  models)."""
  if not os.path.isdir(path):
    raise UserError(f"--init-from {path}: no such folder")
  if convert_load.is_checkpoint(path):
    return convert_load.load_checkpoint(path, ex, shardings=shardings)
  if os.path.exists(os.path.join(path, "config.json")):
    return load_model(path, ex)
  raise UserError(f"--init-from {path}: neither a k3jax checkpoint (k3jax_config.json) nor an "
                  "official-layout model folder (config.json)")


def keep_packed(experts: str | None, weights: str) -> bool:
  """--experts: mxfp4 keeps the routed experts as codes + scales (dequantised a tile at a time
  inside the grouped matmul), dequantized holds them in the run's dtype; by default, as the
  folder stores them."""
  if experts is None:
    return convert_load.stores_packed_experts(weights)
  return experts == Experts.MXFP4


def load_for_serving(folder: ModelFolder, dtype: str, mesh=None, experts: str | None = None):
  """(model, cfg) of a serving command (generate, serve, eval) in `dtype`'s numerics, placed on
  `mesh` as it loads (a checkpoint straight into its shards, an official folder by per-host
  byte ranges: convert.load.load_any)."""
  try:
    return convert_load.load_any(folder.weights, NUMERICS[dtype], mesh=mesh,
                                 keep_packed=keep_packed(experts, folder.weights))
  except CheckpointError as e:
    raise UserError(str(e)) from None
