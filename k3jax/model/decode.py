"""The model with a cache (SPEC §7): `extend(model, ids, cache)` runs T new tokens and returns
their logits and the cache after them. Prefill is `extend` on the prompt in chunks of any size
(chunked KDA op); decoding is `extend` on one token per row (the fused `kda_step`, MLA with
k_b / v_b absorbed). Both equal the full-sequence forward at every position.

The layer loop is the training forward's: the same `schedule.plan` (the longest run of
identical units under one `lax.scan`, the rest unrolled) and the same `layer_step` (AttnRes
blocks, norms, MLPs), with a mixer adapter that reads and writes the layer's cache entry. The
per-kind cache stacks travel in the scan carry and each layer updates its own entry in place
(`dynamic_update_slice` at its stack index): a decode step writes the new token's latents and
the KDA states, never a copy of the whole MLA cache.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.model import schedule
from k3jax.model.cache import Cache, MLACache, constrain
from k3jax.model.kda import KDA, KDAState
from k3jax.model.transformer import K3Model, _take, _take_strided, _valid, initial_carry, layer_step


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
    write = lambda stack, new: jax.lax.dynamic_update_slice(  # noqa: E731
        stack, new[None].astype(stack.dtype), (jnp.asarray(i, jnp.int32), zero, ctx.length, zero))
    mla = MLACache(write(self.layers.mla.c, c_new), write(self.layers.mla.k_rot, rot_new))
    self.layers = self.layers._replace(mla=mla)
    c, rot = (jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False) for a in mla)
    return self.module.attend_latent(x, c, rot, ctx.q_pos, ctx.start), None


def extend(model: K3Model, input_ids: jax.Array, cache: Cache) -> tuple[jax.Array, Cache]:
  """input_ids [B, T] at positions cache.length .. +T -> (logits [B, T, V], updated cache).

  The caller keeps length + T <= the cache's max_len (positions past it would be clamped).
  """
  cfg = model.cfg
  b, t = input_ids.shape
  cache = constrain(cache)
  q_pos = cache.length + jnp.arange(t, dtype=jnp.int32)
  ctx = _Context(cache.length, q_pos, cache.start, q_pos[None, :] >= cache.start[:, None])
  x = model.embed[...][input_ids].astype(cfg.jnp_dtype)
  stacks = {name: nnx.split(getattr(model, name))
            for name in ("kda", "mla", "dense_mlp", "moe", "layers")
            if getattr(model, name) is not None}
  carry = initial_carry(cfg, x)
  layers = _Layers(cache.kda, cache.mla)
  for run in schedule.plan(cfg, scan=cfg.scan_layers):
    carry, layers = _run(cfg, run, stacks, carry, layers, ctx)
  if cfg.attn_res_block_size is not None:
    h = model.output_res(carry.blocks, carry.partial, _valid(carry))
  else:
    h = carry.partial
  head = model.embed[...].T if cfg.tie_word_embeddings else model.lm_head[...]
  logits = jnp.einsum("btd,dv->btv", model.final_norm(h), head.astype(cfg.jnp_dtype),
                      precision=cfg.precision)
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

  xs = [tuple(_take_strided(stacks[k][1], i, stride, run.count)
              for k, i, stride in zip(kinds, idx, strides))
        for kinds, idx, strides in zip(run.unit, run.indices[0], run.strides)]
  layer_ids = run.start + len(run.unit) * jnp.arange(run.count, dtype=jnp.int32)
  mixer_ids = jnp.asarray([[idx[1] for idx in unit] for unit in run.indices], jnp.int32)

  def body(state, x):
    carry, layers = state
    unit_states, first_layer, mixer_index = x
    return unit_fn(carry, layers, unit_states, first_layer, mixer_index), None

  (carry, layers), _ = jax.lax.scan(body, (carry, layers), (xs, layer_ids, mixer_ids))
  return carry, layers
