"""The parameter trees a run works on (train, rl): a built (and possibly adapted) model split
into plain dicts, and under LoRA the trainable / frozen partition of them
(docs/training.md#fine-tuning).

  params        nested dict of the model's nnx.Params, LoRA adapters included, and of its
                frozen MXFP4-packed experts (`PackedExperts`: never trained)
  router_bias   nested dict of its RouterBias
  trainable     a mask of the same tree: True where the optimizer updates the leaf (every
                Param without LoRA; the adapters alone with it)

Under LoRA the frozen base is held in the compute dtype (bf16 on TPU/GPU), with no master
copy: `split_for_training`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.config import ModelConfig
from k3jax.execution import Execution
from k3jax.model.lora import AdaptSpec, PackedExperts, adapt
from k3jax.model.moe import RouterBias
from k3jax.model.transformer import K3Model


def plain(tree: Any) -> Any:
  """nnx.State (or any nested mapping) -> nested dicts with the same leaves."""
  if isinstance(tree, Mapping):
    return {k: plain(v) for k, v in tree.items()}
  return tree


# what `params` holds: the Params (LoRA adapters included) and frozen MXFP4-packed experts
WEIGHTS = nnx.Any(nnx.Param, PackedExperts)


def split_model(model: nnx.Module) -> tuple[Any, dict, dict]:
  """(graphdef, params, router_bias) as plain dicts; refuses any other state (it would not
  be trained nor checkpointed)."""
  graphdef, params, bias, rest = nnx.split(model, WEIGHTS, RouterBias, ...)
  if jax.tree.leaves(rest):
    raise ValueError(f"model state outside Params and RouterBias: {rest}")
  return graphdef, plain(nnx.as_pure(params)), plain(nnx.as_pure(bias))


def make_model(cfg: ModelConfig, ex: Execution, seed: int, spec: AdaptSpec | None = None
               ) -> nnx.Module:
  """The model `cfg` describes, run as `ex` says, adapted for fine-tuning as `spec` asks
  (LoRA, packed experts, QAT; model/lora.py)."""
  model = K3Model(cfg, ex, rngs=nnx.Rngs(seed))
  return model if spec is None else adapt(model, spec, nnx.Rngs(seed + 1))


def trainable_mask(abstract_params: Any, spec: AdaptSpec | None) -> Any:
  """True for the leaves the optimizer updates: the LoRA adapters under LoRA, else every
  Param; never the packed MXFP4 experts."""
  kind = nnx.LoRAParam if spec is not None and spec.lora else nnx.Param
  return plain(jax.tree.map(lambda v: isinstance(v, kind), abstract_params,
                            is_leaf=lambda x: isinstance(x, nnx.Variable)))


def count_params(params: Any) -> int:
  """Model parameters in a params tree: a packed MXFP4 expert array counts the two weights of
  each code byte, its scales count nothing."""
  total = 0
  for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    name = str(getattr(path[-1], "key", path[-1]))
    if name.endswith("_scale") and x.dtype == jnp.uint8:
      continue
    total += int(np.prod(x.shape)) * (2 if name.endswith("_packed") else 1)
  return total


def partition(tree: Any, mask: Any) -> tuple[dict, dict]:
  """(trainable, frozen) nested dicts holding only the leaves the mask marks True / False."""
  if not isinstance(mask, Mapping):
    return (tree, None) if mask else (None, tree)
  train, frozen = {}, {}
  for k, m in mask.items():
    t, f = partition(tree[k], m)
    if t is not None and (not isinstance(t, dict) or t):
      train[k] = t
    if f is not None and (not isinstance(f, dict) or f):
      frozen[k] = f
  return train, frozen


def combine(a: Any, b: Any) -> Any:
  """The union of two partitions."""
  if not isinstance(a, Mapping) or not isinstance(b, Mapping):
    return a if b is None or (isinstance(b, Mapping) and not b) else b
  out = dict(a)
  for k, v in b.items():
    out[k] = combine(out[k], v) if k in out else v
  return out


def split_for_training(model: nnx.Module, spec: AdaptSpec | None) -> tuple[dict, dict]:
  """(params, router_bias) of a built (adapted) model. Under LoRA the frozen base needs no
  master copy: its float leaves are held in the compute dtype (bf16 on TPU/GPU: 2 bytes per
  base parameter, not 4; the released weights are bf16, so nothing is lost), the adapters keep
  the master dtype. Nothing changes when compute is as wide as the master (CPU, float64)."""
  _, params, bias = split_model(model)
  ex = model.ex
  if spec is None or not spec.lora or ex.jnp_dtype == ex.jnp_param_dtype:
    return params, bias
  mask = trainable_mask(nnx.state(model, WEIGHTS), spec)
  cast = lambda x, m: (x if m or not jnp.issubdtype(x.dtype, jnp.floating)
                       else x.astype(ex.jnp_dtype))
  return jax.tree.map(cast, params, mask), bias


@functools.partial(jax.jit, static_argnums=(0, 1, 4, 5))
def adapt_params(cfg: ModelConfig, ex: Execution, params: dict, bias: dict, spec: AdaptSpec,
                 seed: int) -> dict:
  """A pre-trained model's params adapted as `spec` asks (fresh adapters from `seed`, experts
  packed), under jit for the same reason as init_params."""
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: K3Model(cfg, ex, rngs=nnx.Rngs(0))))
  model = nnx.merge(graphdef, nnx.State(params), nnx.State(bias))
  return split_for_training(adapt(model, spec, nnx.Rngs(seed + 1)), spec)[0]
