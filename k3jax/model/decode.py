"""The model with a cache (docs/inference.md#prefill-and-decode): `extend(model, ids, cache)` runs T
new tokens and returns their logits and the cache after them. Prefill is `extend` on the prompt in
chunks of any size (chunked KDA op); decoding is `extend` on one token per row (the fused
`kda_step`, MLA with k_b / v_b absorbed). Both equal the full-sequence forward at every position.

Two forms of one computation (same `layer_step`: AttnRes blocks, norms, MLPs; a mixer adapter
reads and writes the layer's cache entry):

  extend            the model's stacked parameters and a stacked cache, layers grouped as the
                    training forward groups them (`schedule.runs`: the longest run of identical
                    units under one `lax.scan`). The cache stacks travel in the scan carry and
                    each layer updates its own entry in place. For TPU/GPU, where XLA fuses a
                    slice of a stacked weight into the matmul that reads it, and at K3 depth,
                    where compile time must not grow with layers.
  extend_unstacked  per-layer parameters (`unstack_model`, split once) and a per-layer cache
                    (cache.unstack), every layer unrolled. XLA:CPU copies every slice of a
                    stacked array before a matmul reads it, so the stacked form reads each
                    weight (and each MLA cache) twice per token; here a decode step reads them
                    once, as a weight-bound step must.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import ModelConfig
from k3jax.execution import Execution
from k3jax.model import schedule
from k3jax.model.cache import Cache, MLACache, constrain
from k3jax.model.kda import KDA, KDAState
from k3jax.model.mla import heads_major_kv_b
from k3jax.model.transformer import K3Model, _take, _valid, initial_carry, layer_step


class _Context(NamedTuple):
  length: jax.Array   # [] int32 position of the first new token
  q_pos: jax.Array    # [T] int32 positions of the new tokens
  start: jax.Array    # [B] int32 first real position per row
  mask: jax.Array     # [B, T] bool, False at left padding


class _Layers(NamedTuple):
  kda: KDAState | None
  mla: MLACache | None


class _CachedMixer:
  """A mixer for `layer_step` that continues the layer's cache entry `index` of `layers`
  (a Python int, or a traced int32 inside a scan); the updated stacks end up in `.layers`."""

  def __init__(self, module, layers: _Layers, index, ctx: _Context):
    self.module, self.layers, self.index, self.ctx = module, layers, index, ctx

  def __call__(self, x: jax.Array, *, segment_ids=None) -> tuple[jax.Array, None]:
    del segment_ids  # a cached sequence is one sequence per row; padding is ctx.mask
    i, ctx = self.index, self.ctx
    if isinstance(self.module, KDA):
      state = KDAState(*(jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False)
                         for a in self.layers.kda))
      y, new = self.module(x, state=state, token_mask=ctx.mask)
      kda = KDAState(*(jax.lax.dynamic_update_index_in_dim(a, n.astype(a.dtype), i, 0)
                       for a, n in zip(self.layers.kda, new)))
      self.layers = self.layers._replace(kda=kda)
      return y, None
    c_new, rot_new = self.module.latent(x)
    zero = jnp.zeros((), jnp.int32)
    write = lambda stack, new: jax.lax.dynamic_update_slice(
        stack, new[None].astype(stack.dtype), (jnp.asarray(i, jnp.int32), zero, ctx.length, zero))
    mla = MLACache(write(self.layers.mla.c, c_new), write(self.layers.mla.k_rot, rot_new))
    self.layers = self.layers._replace(mla=mla)
    c, rot = (jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False) for a in mla)
    return self.module.attend_latent(x, c, rot, ctx.q_pos, ctx.start), None


def extend(model: K3Model, input_ids: jax.Array, cache: Cache) -> tuple[jax.Array, Cache]:
  """input_ids [B, T] at positions cache.length .. +T -> (logits [B, T, V], updated cache).

  The caller keeps length + T <= the cache's max_len (positions past it would be clamped).
  """
  cfg, ex = model.cfg, model.ex
  b, t = input_ids.shape
  cache = constrain(cache)
  q_pos = cache.length + jnp.arange(t, dtype=jnp.int32)
  ctx = _Context(cache.length, q_pos, cache.start, q_pos[None, :] >= cache.start[:, None])
  x = model.embed[...][input_ids].astype(ex.jnp_dtype)
  stacks = {name: nnx.split(getattr(model, name))
            for name in schedule.STACKS
            if getattr(model, name) is not None}
  carry = initial_carry(cfg, x)
  layers = _Layers(cache.kda, cache.mla)
  for run in schedule.runs(cfg, scan=ex.scan_layers):
    carry, layers = _run(cfg, run, stacks, carry, layers, ctx)
  if cfg.attn_res_block_size is not None:
    h = model.output_res(carry.blocks, carry.partial, _valid(carry))
  else:
    h = carry.partial
  head = model.embed[...].T if cfg.tie_word_embeddings else model.lm_head[...]
  logits = jnp.einsum("btd,dv->btv", model.final_norm(h), head.astype(ex.jnp_dtype),
                      precision=ex.precision)
  return logits, constrain(Cache(layers.kda, layers.mla, cache.start, cache.length + t))


def _run(cfg, run: schedule.Run, stacks, carry, layers: _Layers, ctx: _Context):
  """One planned run (a single layer, or `run.count` units under lax.scan) with the cache."""
  graphdefs = {k: stacks[k][0] for k in stacks}

  def unit_fn(carry, layers, unit_states, first_layer, mixer_index):
    for q, (kinds, states) in enumerate(zip(run.unit, unit_states)):
      norms, mixer, mlp = (nnx.merge(graphdefs[k], s) for k, s in zip(kinds, states))
      cached = _CachedMixer(mixer, layers, mixer_index[q], ctx)
      carry, _, _ = layer_step(cfg, first_layer + q, norms, cached, mlp, carry, None)
      layers = cached.layers
    return carry, layers

  if not run.scanned:
    unit_states = [tuple(_take(stacks[k][1], i) for k, i in zip(kinds, idx))
                   for kinds, idx in zip(run.unit, run.indices[0])]
    return unit_fn(carry, layers, unit_states, run.start, [idx[1] for idx in run.indices[0]])

  # Every unit position's stack entries per repeat, [count, P, 3]. The body indexes the whole
  # stacks with them instead of scanning over strided slices: a strided slice of the weights
  # is a copy of them on every call, which a decode step (weight-bound) cannot afford.
  entries = jnp.asarray(run.indices, jnp.int32)
  layer_ids = run.start + len(run.unit) * jnp.arange(run.count, dtype=jnp.int32)

  def body(state, x):
    carry, layers = state
    first_layer, entry = x
    unit_states = [tuple(_index(stacks[k][1], entry[q, j]) for j, k in enumerate(kinds))
                   for q, kinds in enumerate(run.unit)]
    return unit_fn(carry, layers, unit_states, first_layer, entry[:, 1]), None

  (carry, layers), _ = jax.lax.scan(body, (carry, layers), (layer_ids, entries))
  return carry, layers


def _index(state, i):
  return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False), state)


# ----------------------------------------------------------------------------------------------
# Per-layer form: weights split once, every layer unrolled, one cache entry per layer.
# ----------------------------------------------------------------------------------------------

STACKS = schedule.STACKS


class Unstacked(NamedTuple):
  """The model's arrays with every layer stack split into one state per layer (a pytree)."""
  embed: jax.Array
  lm_head: jax.Array | None
  final_norm: Any                  # nnx.State
  output_res: Any                  # nnx.State or None
  layers: dict[str, tuple[Any, ...]]
  mla_heads_major: tuple[tuple[jax.Array, jax.Array], ...]  # per MLA layer (mla.heads_major_kv_b)


@dataclasses.dataclass(frozen=True)
class UnstackedDefs:
  """The static half: config, execution and the graph definitions to merge the states with."""
  cfg: ModelConfig
  ex: Execution
  final_norm: Any
  output_res: Any
  kinds: tuple[tuple[str, Any], ...]


def unstack_model(model: K3Model) -> tuple[UnstackedDefs, Unstacked]:
  """Split the model once into per-layer states (new arrays: drop the model to free its
  stacks)."""
  kinds, layers = [], {}
  for name in STACKS:
    module = getattr(model, name)
    if module is None:
      continue
    graphdef, state = nnx.split(module)
    n = jax.tree.leaves(state)[0].shape[0]
    kinds.append((name, graphdef))
    layers[name] = tuple(_take(state, i) for i in range(n))
  norm_def, norm = nnx.split(model.final_norm)
  res_def, res = (nnx.split(model.output_res) if model.cfg.attn_res_block_size is not None
                  else (None, None))
  head = None if model.cfg.tie_word_embeddings else model.lm_head[...]
  graphdefs = dict(kinds)
  heads = tuple(heads_major_kv_b(nnx.merge(graphdefs["mla"], s)) for s in layers.get("mla", ()))
  return (UnstackedDefs(model.cfg, model.ex, norm_def, res_def, tuple(kinds)),
          Unstacked(model.embed[...], head, norm, res, layers, heads))


class _LayerMixer:
  """A mixer for `layer_step` continuing one layer's own cache entry (per-layer form)."""

  def __init__(self, module, entry, ctx: _Context, heads_major=None):
    self.module, self.entry, self.ctx, self.heads_major = module, entry, ctx, heads_major

  def __call__(self, x: jax.Array, *, segment_ids=None) -> tuple[jax.Array, None]:
    del segment_ids
    ctx = self.ctx
    if isinstance(self.module, KDA):
      y, self.entry = self.module(x, state=self.entry, token_mask=ctx.mask)
      return y, None
    c_new, rot_new = self.module.latent(x)
    zero = jnp.zeros((), jnp.int32)
    c, rot = (jax.lax.dynamic_update_slice(a, n.astype(a.dtype), (zero, ctx.length, zero))
              for a, n in zip(self.entry, (c_new, rot_new)))
    # One materialisation of the updated cache, in place in the donated buffer: without the
    # barrier XLA fuses the update into each of its two readers (the attention and the
    # returned cache), which copies the whole cache for one of them on every token.
    c, rot = jax.lax.optimization_barrier((c, rot))
    self.entry = MLACache(c, rot)
    return self.module.attend_latent(x, c, rot, ctx.q_pos, ctx.start,
                                     heads_major=self.heads_major), None


def extend_unstacked(defs: UnstackedDefs, params: Unstacked, input_ids: jax.Array,
                     cache: Cache) -> tuple[jax.Array, Cache]:
  """`extend` on per-layer weights and a per-layer cache (cache.unstack); same numbers."""
  cfg, ex = defs.cfg, defs.ex
  t = input_ids.shape[1]
  cache = constrain(cache)
  q_pos = cache.length + jnp.arange(t, dtype=jnp.int32)
  ctx = _Context(cache.length, q_pos, cache.start, q_pos[None, :] >= cache.start[:, None])
  graphdefs = dict(defs.kinds)
  entries = {"kda": list(cache.kda or ()), "mla": list(cache.mla or ())}
  carry = initial_carry(cfg, params.embed[input_ids].astype(ex.jnp_dtype))
  for l in range(cfg.num_layers):
    kinds, idx = schedule.layer_kinds(cfg, l), schedule.layer_indices(cfg, l)
    norms, mixer, mlp = (nnx.merge(graphdefs[k], params.layers[k][i]) for k, i in zip(kinds, idx))
    heads = params.mla_heads_major[idx[1]] if kinds[1] == "mla" else None
    cached = _LayerMixer(mixer, entries[kinds[1]][idx[1]], ctx, heads)
    carry, _, _ = layer_step(cfg, l, norms, cached, mlp, carry, None)
    entries[kinds[1]][idx[1]] = cached.entry
  h = carry.partial
  if cfg.attn_res_block_size is not None:
    h = nnx.merge(defs.output_res, params.output_res)(carry.blocks, carry.partial, _valid(carry))
  head = params.embed.T if cfg.tie_word_embeddings else params.lm_head
  logits = jnp.einsum("btd,dv->btv", nnx.merge(defs.final_norm, params.final_norm)(h),
                      head.astype(ex.jnp_dtype), precision=ex.precision)
  new = Cache(tuple(entries["kda"]) or None, tuple(entries["mla"]) or None, cache.start,
              cache.length + t)
  return logits, constrain(new)
