"""Where a run's parameters start, and in which shardings (docs/sharding.md#placement).

The shardings come from the model alone: each variable of the (adapted) model's abstract state
through `sharding.placement` and the rules table, never from a compiled step, so train, rl and
a serving command place the same model the same way and a train step built later finds its
arguments where its own shardings (the same table) put them.

  param_shardings   (params, router_bias) trees of NamedShardings of an adapted model
  init_params       a fresh model's (params, router_bias) under jit (one device)
  fresh_on_mesh     the same created in their shardings by one jitted init (nothing whole)
  initial_params    what a run starts from: a fresh model, or a weights folder loaded and
                    adapted, placed on the mesh
"""

from __future__ import annotations

import functools
from typing import Any

import jax
from flax import nnx

from k3jax.config import ModelConfig
from k3jax.execution import Execution
from k3jax.model.lora import AdaptSpec
from k3jax.model.moe import RouterBias
from k3jax.run.model import load_init
from k3jax.run.params import WEIGHTS, adapt_params, make_model, split_for_training, split_model
from sharding.placement import variable_shardings


class OnMesh:
  """A jitted function that is traced and run under `jax.set_mesh(mesh)` (the context mesh the
  layers' activation constraints read); `lower` too, for compiled-program checks."""

  def __init__(self, jitted, mesh: jax.sharding.Mesh):
    self.jitted, self.mesh = jitted, mesh

  def __call__(self, *args):
    with jax.set_mesh(self.mesh):
      return self.jitted(*args)

  def lower(self, *args):
    with jax.set_mesh(self.mesh):
      return self.jitted.lower(*args)


def abstract_weights(cfg: ModelConfig, ex: Execution, spec: AdaptSpec | None
                     ) -> tuple[nnx.State, nnx.State]:
  """(params, router_bias) abstract Variables of the model adapted as `spec` asks."""
  abstract = nnx.eval_shape(lambda: make_model(cfg, ex, 0, spec))
  _, params, bias, _ = nnx.split(abstract, WEIGHTS, RouterBias, ...)
  return params, bias


@functools.lru_cache(maxsize=16)
def param_shardings(cfg: ModelConfig, ex: Execution, spec: AdaptSpec | None,
                    mesh: jax.sharding.Mesh) -> tuple[dict, dict]:
  """(params, router_bias) nested dicts of NamedShardings on `mesh` by the rules table."""
  params, bias = abstract_weights(cfg, ex, spec)
  return variable_shardings(params, mesh), variable_shardings(bias, mesh)


def by_path(tree: dict) -> dict:
  """Nested dict -> {k3jax variable path (tuple of str): leaf}, e.g. convert.load's restore
  targets."""
  return {tuple(str(k.key) for k in path): leaf
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _init_params(cfg: ModelConfig, ex: Execution, seed: int, spec: AdaptSpec | None = None
                 ) -> tuple[dict, dict]:
  return split_for_training(make_model(cfg, ex, seed, spec), spec)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def init_params(cfg: ModelConfig, ex: Execution, seed: int, spec: AdaptSpec | None = None
                ) -> tuple[dict, dict]:
  """(params, router_bias) of a freshly initialised model, built under jit: creating the
  stacked modules eagerly runs thousands of tiny ops one by one (a minute on a CPU). On a mesh
  use `fresh_on_mesh(...)(seed)`: the same values, created in their shardings."""
  return _init_params(cfg, ex, seed, spec)


class InitParamsOnMesh:
  """seed -> (params, router_bias) created in their shardings by one jitted init per seed;
  `lower(seed)` gives its compiled program (e.g. for the per-device memory plan)."""

  def __init__(self, cfg: ModelConfig, ex: Execution, mesh: jax.sharding.Mesh, shardings,
               spec: AdaptSpec | None = None):
    self.cfg, self.ex, self.mesh, self.shardings, self.spec = cfg, ex, mesh, shardings, spec

  @functools.cache  # noqa: B019 - one per model and mesh: its programs live as long as it does
  def _jitted(self, seed: int) -> OnMesh:
    return OnMesh(jax.jit(functools.partial(_init_params, self.cfg, self.ex, seed, self.spec),
                          out_shardings=self.shardings), self.mesh)

  def __call__(self, seed: int):
    return self._jitted(seed)()

  def lower(self, seed: int):
    return self._jitted(seed).lower()


@functools.lru_cache(maxsize=8)
def fresh_on_mesh(cfg: ModelConfig, ex: Execution, spec: AdaptSpec | None,
                  mesh: jax.sharding.Mesh) -> InitParamsOnMesh:
  """The jitted init of `cfg`'s (adapted) model on `mesh` (one per model and mesh: the train
  step's `init_params` is this same object, so a run compiles it once)."""
  return InitParamsOnMesh(cfg, ex, mesh, param_shardings(cfg, ex, spec, mesh), spec)


def initial_params(cfg: ModelConfig, ex: Execution, spec: AdaptSpec | None, init: str | None,
                   seed: int, mesh: jax.sharding.Mesh | None) -> tuple[Any, Any]:
  """(params, router_bias) a run starts from, placed: the weights folder `init` loaded and
  adapted as `spec` asks (MXFP4 packing, fresh adapters from `seed`), else a fresh model from
  `seed`. A resume rebuilds a frozen base with it, bit for bit (train and rl)."""
  if init is None:
    return init_params(cfg, ex, seed, spec) if mesh is None else fresh_on_mesh(
        cfg, ex, spec, mesh)(seed)
  shardings = None if mesh is None else param_shardings(cfg, ex, spec, mesh)
  restore_into = (by_path(shardings[0]) | by_path(shardings[1])
                  if shardings and spec is None else None)
  _, params, bias = split_model(load_init(init, ex, restore_into)[0])
  if spec is not None:
    params = adapt_params(cfg, ex, params, bias, spec, seed)
  if mesh is not None:  # an official-layout folder (or an adapted model) arrives whole
    params = jax.device_put(params, shardings[0])
    bias = jax.device_put(bias, shardings[1])
  return params, bias
