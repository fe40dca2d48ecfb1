"""The k3jax model's variables as the converter sees them: a flat map from key path to the
abstract variable (shape, dtype) of the model a config describes, computed with
`nnx.eval_shape` (nothing allocated).

Every converter module (the folder's reads, the Orbax writer, the loaders, export) takes its
shapes from here, so none of them needs another to know what the model holds.
"""

from __future__ import annotations

from typing import Any

from flax import nnx

from k3jax.config import ModelConfig
from k3jax.execution import Execution
from k3jax.model.transformer import K3Model

Path = tuple[str, ...]


def abstract_variables(cfg: ModelConfig, ex: Execution = Execution()) -> dict[Path, Any]:
  """k3jax path -> abstract nnx Variable of the model `cfg` describes, in `ex`'s parameter
  dtype (the shapes and logical axes do not depend on it)."""
  abstract = nnx.eval_shape(lambda: K3Model(cfg, ex, rngs=nnx.Rngs(0)))
  return {tuple(str(p) for p in path): v for path, v in nnx.to_flat_state(nnx.state(abstract))}


def param_shapes(cfg: ModelConfig) -> dict[Path, tuple[int, ...]]:
  return {path: tuple(v.shape) for path, v in abstract_variables(cfg).items()}
