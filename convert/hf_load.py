"""Load an official-layout folder (K3 or Kimi-Linear) straight into a k3jax model, in memory.

For tests, parity and small models. It reads through the same validated list of reads as the
streaming converter (`convert.source`), so both refuse the same bad input; this path simply
keeps every array in host memory.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from convert.source import items_to_read, open_source, read_weight, to_k3jax
from convert.variables import Path, abstract_variables
from k3jax.config import ModelConfig
from k3jax.errors import CheckpointError
from k3jax.execution import Execution
from k3jax.model.transformer import K3Model

__all__ = ["CheckpointError", "build_model", "load_model"]


def build_model(cfg: ModelConfig, ex: Execution, arrays: dict[Path, Any], abstract=None):
  """A K3Model run as `ex` says holding `arrays` (k3jax path -> full stacked array), cast to
  each variable's dtype (ex.param_dtype, or the >= fp32 of the F32 exceptions). `abstract`:
  the (abstract) model to fill instead of K3Model(cfg, ex), e.g. one with packed experts."""
  model = abstract or nnx.eval_shape(lambda: K3Model(cfg, ex, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(model)
  for path, var in nnx.to_flat_state(state):
    key = tuple(str(p) for p in path)
    if key not in arrays:
      raise CheckpointError(f"no weights for k3jax parameter {'.'.join(key)}")
    value = arrays[key]
    if tuple(value.shape) != tuple(var.shape):
      raise CheckpointError(f"k3jax parameter {'.'.join(key)}: shape {tuple(value.shape)}, "
                            f"model wants {tuple(var.shape)}")
    var.set_value(jnp.asarray(value, dtype=var.get_value().dtype))
  return nnx.merge(graphdef, state)


def load_model(folder: str, ex: Execution = Execution(), *, cfg: ModelConfig | None = None,
               **overrides: Any):
  """(model, cfg) with the folder's weights, run as `ex` says (held in ex.param_dtype).
  `overrides` change the folder's config (architecture fields)."""
  source = open_source(folder, **overrides)
  cfg = cfg or source.cfg
  source.cfg = cfg
  variables = abstract_variables(cfg, ex)
  arrays = {path: np.zeros(v.shape, v.get_value().dtype) for path, v in variables.items()}
  for item in items_to_read(source, shapes={p: tuple(v.shape) for p, v in variables.items()}):
    weight = read_weight(source, item)
    for path, arr in zip(item.slot.entry.paths, to_k3jax(item, weight, cfg)):
      arrays[path][item.slot.index] = arr
  source.reader.close()
  return build_model(cfg, ex, arrays), cfg
