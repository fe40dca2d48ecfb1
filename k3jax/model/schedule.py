"""The layer schedule: which stack entries a layer uses, and which layers run under a scan.

K3's 93 layers are [KDA, KDA, KDA, MLA] x 23 + a trailing MLA, and layer 0 differs only by its
dense MLP. `runs` finds the longest stretch of identical repeating units and runs it as one
`lax.scan` (compile time then no longer grows with depth); the rest is unrolled.
Within a scanned stretch, consecutive units use stack entries a fixed stride apart, so a unit's
parameters are strided slices of the stacks, with no re-layout of the parameter tree.
"""

from __future__ import annotations

import dataclasses

from k3jax.config import ModelConfig

# The model's parameter stacks, each with a leading layer-entry axis: per-layer norms and AttnRes
# queries ("layers"), the two token mixers, the two MLP kinds. Everything that walks the stacks
# (forward, decode, converter, info) reads these names from here.
STACKS = ("kda", "mla", "dense_mlp", "moe", "layers")

Kinds = tuple[str, str, str]    # (norm stack, mixer stack, mlp stack) of one layer
Indices = tuple[int, int, int]  # entries of those stacks


@dataclasses.dataclass(frozen=True)
class Run:
  start: int                          # first layer
  unit: tuple[Kinds, ...]             # stack kinds of each layer of the unit
  count: int                          # repeats of the unit
  scanned: bool
  indices: tuple[tuple[Indices, ...], ...]  # stack entries of each unit position, per repeat
  strides: tuple[Indices, ...]        # per unit position: entry step from one repeat to the next


def layer_kinds(cfg: ModelConfig, l: int) -> Kinds:
  return ("layers", "mla" if cfg.is_mla(l) else "kda", "moe" if cfg.is_moe(l) else "dense_mlp")


def stack_sizes(cfg: ModelConfig) -> dict[str, int]:
  """Entries of each stack in `cfg` (a stack of size 0 is absent from the model)."""
  return {"kda": len(cfg.kda_layers), "mla": len(cfg.mla_layers),
          "dense_mlp": len(cfg.dense_layers), "moe": len(cfg.moe_layers),
          "layers": cfg.num_layers}


def layer_indices(cfg: ModelConfig, l: int) -> Indices:
  mixer, mlp = cfg.stack_index(l)
  return (l, mixer, mlp)


def num_seals(cfg: ModelConfig) -> int:
  """AttnRes blocks sealed over the whole stack (layers 0, S, 2S, ...)."""
  return (cfg.num_layers - 1) // cfg.attn_res_block_size + 1


def _single(cfg: ModelConfig, l: int) -> Run:
  return Run(l, (layer_kinds(cfg, l),), 1, False, ((layer_indices(cfg, l),),), ((0, 0, 0),))


def _best_stretch(cfg: ModelConfig) -> tuple[int, int, int]:
  """(start, unit length, repeats) covering the most layers with >= 2 identical units."""
  kinds = [layer_kinds(cfg, l) for l in range(cfg.num_layers)]
  best = (0, 1, 0)
  for p in range(1, 9):
    for s in range(cfg.num_layers - 2 * p + 1):
      n = 1
      while (s + (n + 1) * p <= cfg.num_layers
             and kinds[s + n * p: s + (n + 1) * p] == kinds[s: s + p]):
        n += 1
      if n >= 2 and n * p > best[1] * best[2]:
        best = (s, p, n)
  return best


def runs(cfg: ModelConfig, scan: bool) -> list[Run]:
  """Runs covering layers 0..L-1 in order."""
  if not scan:
    return [_single(cfg, l) for l in range(cfg.num_layers)]
  s, p, n = _best_stretch(cfg)
  if n < 2:
    return [_single(cfg, l) for l in range(cfg.num_layers)]
  unit = tuple(layer_kinds(cfg, s + q) for q in range(p))
  indices = tuple(tuple(layer_indices(cfg, s + u * p + q) for q in range(p)) for u in range(n))
  strides = tuple(tuple(b - a for a, b in zip(indices[0][q], indices[1][q])) for q in range(p))
  for u in range(1, n):  # strided slicing needs a constant step between repeats
    for q in range(p):
      expect = tuple(a + u * d for a, d in zip(indices[0][q], strides[q]))
      assert indices[u][q] == expect, (u, q, indices[u][q], expect)
  return ([_single(cfg, l) for l in range(s)]
          + [Run(s, unit, n, True, indices, strides)]
          + [_single(cfg, l) for l in range(s + n * p, cfg.num_layers)])
