"""Per-device bytes of the serving engine (k3jax/engine, docs/serving.md) on a mesh, counted
from sharded shapes: what `k3jax plan --mode decode --analytic` prices.

  weights        the model's variables in the rules table's shardings; with `mxfp4` experts
                 the routed experts stay packed (convert.load.packed_variables: codes uint8, 2
                 per byte, and an E8M0 scale per 32: 4.25 bits a weight), as the engine serves
                 `generate --experts mxfp4`;
  KDA slots      the recurrent state and conv tails of every KDA layer for max_num_seqs slots
                 + 1 scratch (k3jax/model/paged.py init_cache), KDA heads over `tensor`;
  latent pages   per MLA layer a pool of pool_pages + 1 (scratch) pages of page_size positions
                 holding the latent c and k_rot, whole on every device (the rules table:
                 every device indexes any page) unless split by position over `context`;
  snapshots      the prefix cache's KDA state snapshots (+ 1 scratch), each a slot's size.

With data_shards D > 1 each pool is D shards (each with its own scratch entry), split over the
batch axes (data x fsdp x expert): a device holds D / (those devices) shards. With
context_shards C > 1 each shard's latent pages are C stripes over the mesh's `context` axis
(a request's positions spread over them): a device holds 1 / C of its shards' pages.

The cache's arrays are exactly those `paged.init_cache` builds, placed as `paged.place` places
them (`paged.specs`); the step's temporaries are a hand count (analytic.engine_temp)."""

from __future__ import annotations

import dataclasses
import math

import jax
from flax import nnx
from jax.sharding import NamedSharding

from convert.load import packed_variables
from k3jax.config import ModelConfig
from k3jax.engine.config import EngineConfig
from k3jax.execution import Execution
from k3jax.model import paged
from k3jax.model.transformer import K3Model
from k3jax.plan.analytic import bytes_per_device
from sharding.placement import path_shardings

MXFP4, DEQUANTIZED = "mxfp4", "dequantized"


@dataclasses.dataclass(frozen=True)
class CacheBytes:
  """One device's share of the engine's cache, by part."""
  kda_slots: int
  latent_pages: int
  snapshots: int
  shard_devices: int = 1  # the devices the pools' shards split over (1: one pool, whole)

  @property
  def total(self) -> int:
    return self.kda_slots + self.latent_pages + self.snapshots


def weight_variables(cfg: ModelConfig, ex: Execution, experts: str) -> dict:
  """k3jax path -> abstract variable of the model the engine serves: the routed experts packed
  (`mxfp4`) or in the compute dtype (`dequantized`)."""
  if experts == MXFP4:
    return packed_variables(cfg, ex)
  abstract = nnx.eval_shape(lambda: K3Model(cfg, ex, rngs=nnx.Rngs(0)))
  return {tuple(str(p) for p in path): v for path, v in nnx.to_flat_state(nnx.state(abstract))}


def weight_bytes(variables: dict, mesh) -> int:
  """One device's bytes of `variables` in their rules-table shardings on `mesh` (MeshError: a
  mesh that cannot split them)."""
  shardings = path_shardings(variables, mesh)
  return sum(math.prod(shardings[p].shard_shape(tuple(v.shape))) * v.dtype.itemsize
             for p, v in variables.items())


def fsdp_gather_bytes(variables: dict, mesh) -> int:
  """Bytes one device receives per step gathering the weights split over `fsdp` for use (the
  dense weights, layer by layer: what fsdp costs a serving step); a routed-expert weight whose
  experts split over fsdp does not move (the expert-parallel layer sends tokens to it)."""
  fsdp = dict(mesh.shape).get("fsdp", 1)
  if fsdp == 1:
    return 0
  shardings = path_shardings(variables, mesh)
  total = 0
  for path, v in variables.items():
    names = v.get_metadata().get("out_sharding") or ()
    shape = list(shardings[path].shard_shape(tuple(v.shape)))
    spec = tuple(shardings[path].spec)
    moved = False
    for dim, entry in enumerate(spec):
      axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
      if "fsdp" in axes and (dim >= len(names) or names[dim] != "experts"):
        shape[dim] *= fsdp
        moved = True
    if moved:
      total += math.prod(shape) * v.dtype.itemsize * (fsdp - 1) // fsdp
  return total


def param_count(variables: dict) -> int:
  """The model's parameters in `variables`: a packed expert's codes hold 2 weights a byte, and
  its scales are not weights."""
  total = 0
  for path, v in variables.items():
    name = path[-1]
    if name.endswith("_scale") and (*path[:-1], name.removesuffix("_scale") + "_packed") in (
        variables):
      continue
    total += math.prod(v.shape) * (2 if name.endswith("_packed") else 1)
  return total


def abstract_cache(cfg: ModelConfig, ex: Execution, config: EngineConfig) -> paged.PagedCache:
  """The engine's cache (Runner's `init_cache` call) as ShapeDtypeStructs: nothing allocated."""
  return jax.eval_shape(lambda: paged.init_cache(
      cfg, ex, slots=config.max_num_seqs, pages=config.pool_pages,
      page_size=config.page_size, snapshots=config.snapshots, shards=config.data_shards,
      stripes=config.context_shards))


def cache_bytes(cfg: ModelConfig, ex: Execution, config: EngineConfig, mesh) -> CacheBytes:
  """One device's share of the engine's cache on `mesh`, placed as `paged.place` does."""
  cache = abstract_cache(cfg, ex, config)
  axes = paged.shard_axes(cache, mesh, config.data_shards)  # ValueError: split unevenly
  specs = paged.specs(cache, mesh, config.data_shards, config.context_shards)

  def part(arrays, part_specs) -> int:
    return sum(bytes_per_device(jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                     sharding=NamedSharding(mesh, s)))
               for a, s in zip(jax.tree.leaves(arrays), _spec_leaves(part_specs)))

  return CacheBytes(kda_slots=part(cache.kda, specs.kda),
                    latent_pages=part(cache.pages, specs.pages),
                    snapshots=part(cache.snapshots, specs.snapshots),
                    shard_devices=math.prod(mesh.shape[a] for a in axes))


def _spec_leaves(tree) -> list:
  return jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))


def largest(fits, cap: int = 1 << 20) -> int:
  """The largest n in [1, cap] with fits(n), for a `fits` that holds up to some n and fails
  past it (memory grows with n); 0 when even 1 does not fit."""
  if not fits(1):
    return 0
  lo = 1
  while lo < cap and fits(min(cap, 2 * lo)):
    lo = min(cap, 2 * lo)
  hi = min(cap, 2 * lo)
  if lo == hi:
    return lo
  while hi - lo > 1:  # fits(lo), not fits(hi)
    mid = (lo + hi) // 2
    lo, hi = (mid, hi) if fits(mid) else (lo, mid)
  return lo


def largest_multiple(fits, step: int, cap: int = 1 << 20) -> int:
  """The largest multiple of `step` n <= cap with fits(n) (as `largest`; 0: none)."""
  return step * largest(lambda k: fits(k * step), cap // step)
