"""The model over a serving engine's batch: rows of tokens from many requests in one call, each
row continuing its request's KDA state (per slot) and MLA latent cache (in fixed-size pages).

A step's tokens come as one or more `Rows` parts of fixed shape [R, T] (the engine's decode
rows [R, 1] and prefill rows [R, C]); every token carries its absolute position. Per-token
work (norms, projections, MLPs and routed experts, AttnRes) runs on all parts' tokens at once as
one [1, N, d] batch; the mixers split it back into rows:

  KDA  a row starts from its slot's state (or zeros, for a new sequence, or a prefix-cache
       snapshot), runs its tokens through the KDA layer with `token_mask` = the row's valid
       tokens (padding passes the state through unchanged: k3jax/model/kda.py) and writes the
       state back to its slot, and to a snapshot when asked.
  MLA  each valid token's latent (c, k_rot) is written to the page of its position
       (`page_table[slot, pos // page_size]`, offset pos % page_size); padding writes to the
       scratch page 0. Each row then attends over its slot's first `ctx_pages` pages, gathered
       in position order, with keys after the query masked (`attend_latent`).

Nothing else carries between tokens (AttnRes mixes over depth per token), so a request's
numbers do not depend on which rows run beside it: every product a row computes reads only its
own tokens, state and pages.

Scratch entries keep every shape fixed and every write unconditional: slot `slots` (the last)
takes the rows that carry no request, snapshot `snapshots` (the last) the rows that save none,
and page 0 the padding.

The layers run unrolled on per-layer weights (k3jax/model/decode.py's `Unstacked` form).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import ModelConfig
from k3jax.execution import Execution
from k3jax.model import schedule
from k3jax.model.cache import MLACache
from k3jax.model.decode import Unstacked, UnstackedDefs
from k3jax.model.kda import KDA, KDAState
from k3jax.model.kda import initial_state as kda_initial_state
from k3jax.model.transformer import _valid, initial_carry, layer_step
from sharding.activations import activation_spec

FROM_SLOT, FRESH, FROM_SNAPSHOT = 0, 1, 2  # where a row's KDA state comes from


class PagedCache(NamedTuple):
  """An engine's device state, one entry per layer of each kind.

  kda        KDAState per KDA layer, leading axis slots + 1 (the last: scratch)
  snapshots  KDAState per KDA layer, leading axis snapshots + 1 (the last: scratch)
  pages      MLACache per MLA layer: c [pages, page_size, kv_lora], k_rot [pages, page_size,
             rope] (page 0: scratch)
  """
  kda: tuple[KDAState, ...]
  snapshots: tuple[KDAState, ...]
  pages: tuple[MLACache, ...]


class Rows(NamedTuple):
  """One part of a step's tokens: R rows of T positions."""
  ids: jax.Array        # [R, T] int32
  positions: jax.Array  # [R, T] int32 absolute position of each token in its sequence
  valid: jax.Array      # [R, T] bool, False at padding
  slot: jax.Array       # [R] int32 the slot the row continues (scratch slot: no request)
  source: jax.Array     # [R] int32 FROM_SLOT, FRESH or FROM_SNAPSHOT
  restore: jax.Array    # [R] int32 snapshot to start from (FROM_SNAPSHOT)
  save: jax.Array       # [R] int32 snapshot to save the row's final state to (scratch: none)


def init_cache(cfg: ModelConfig, ex: Execution, *, slots: int, pages: int, page_size: int,
               snapshots: int) -> PagedCache:
  """An empty engine cache: `slots` request slots, `pages` latent pages (page 0 is scratch,
  so pages - 1 hold tokens) and `snapshots` KDA state snapshots, in `ex`'s compute dtype."""
  def one(n):  # distinct buffers per field (the cache is donated: no two leaves may alias)
    return KDAState(*(jnp.zeros(a.shape, a.dtype) for a in kda_initial_state(cfg, ex, n)))
  kda = tuple(one(slots + 1) for _ in cfg.kda_layers)
  snaps = tuple(one(snapshots + 1) for _ in cfg.kda_layers)
  shape = (pages, page_size)
  dt = ex.jnp_dtype
  mla = tuple(MLACache(jnp.zeros((*shape, cfg.kv_lora_rank), dt),
                       jnp.zeros((*shape, cfg.qk_rope_head_dim), dt)) for _ in cfg.mla_layers)
  return PagedCache(kda, snaps, mla)


_KDA_NAMES = KDAState(*(("slots", None, "heads", "head_dim"),) * 3,
                      ("slots", "heads", "head_dim", None))
_PAGE_NAMES = MLACache(("pages", "page", "kv_lora"), ("pages", "page", None))


def specs(cache: PagedCache, mesh) -> PagedCache:
  """The PartitionSpec of every array of `cache` (concrete or abstract) on `mesh`, by the rules
  table (KDA heads over `tensor`, slots and pages whole on every device): where `place` puts
  them, and what `k3jax plan --mode decode` counts per device."""
  def spec(x, names):
    return activation_spec(names, x.shape, mesh)
  return PagedCache(tuple(KDAState(*map(spec, e, _KDA_NAMES)) for e in cache.kda),
                    tuple(KDAState(*map(spec, e, _KDA_NAMES)) for e in cache.snapshots),
                    tuple(MLACache(*map(spec, e, _PAGE_NAMES)) for e in cache.pages))


def place(cache: PagedCache, mesh) -> PagedCache:
  """`cache` on `mesh`, placed by the rules table (`specs`)."""
  return jax.tree.map(lambda x, s: jax.device_put(x, jax.sharding.NamedSharding(mesh, s)),
                      cache, specs(cache, mesh))


def _start_state(entry: KDAState, snaps: KDAState, rows: Rows) -> KDAState:
  def pick(slot_a, snap_a):
    from_slot = slot_a[rows.slot]
    from_snap = snap_a[rows.restore]
    shape = (-1,) + (1,) * (from_slot.ndim - 1)
    src = rows.source.reshape(shape)
    zero = jnp.zeros((), from_slot.dtype)
    return jnp.where(src == FRESH, zero, jnp.where(src == FROM_SNAPSHOT, from_snap, from_slot))
  return KDAState(*(pick(a, s) for a, s in zip(entry, snaps)))


class _RowsMixer:
  """A mixer for `layer_step` over the step's flat tokens [1, N, d]: runs each part's rows
  against the layer's cache entry; the updated entries end up in `.kda`, `.snaps`, `.pages`."""

  def __init__(self, module, parts: tuple[Rows, ...], entry, snaps, page_table, ctx_pages: int,
               page_size: int, heads_major=None):
    self.module, self.parts, self.entry, self.snaps = module, parts, entry, snaps
    self.page_table, self.ctx_pages, self.page_size = page_table, ctx_pages, page_size
    self.heads_major = heads_major

  def __call__(self, x_1nd: jax.Array, *, segment_ids=None) -> tuple[jax.Array, None]:
    del segment_ids
    outs, offset = [], 0
    for rows in self.parts:
      r, t = rows.ids.shape
      x = x_1nd[0, offset:offset + r * t].reshape(r, t, -1)
      offset += r * t
      y = self._kda(x, rows) if isinstance(self.module, KDA) else self._mla(x, rows)
      outs.append(y.reshape(1, r * t, -1))
    return jnp.concatenate(outs, axis=1), None

  def _kda(self, x, rows: Rows):
    state = _start_state(self.entry, self.snaps, rows)
    y, new = self.module(x, state=state, token_mask=rows.valid)
    new = KDAState(*(n.astype(a.dtype) for n, a in zip(new, self.entry)))
    self.entry = KDAState(*(a.at[rows.slot].set(n) for a, n in zip(self.entry, new)))
    self.snaps = KDAState(*(a.at[rows.save].set(n) for a, n in zip(self.snaps, new)))
    return y

  def _mla(self, x, rows: Rows):
    ps = self.page_size
    c_new, rot_new = self.module.latent(x)                              # [R, T, kv], [R, T, rope]
    page = jnp.take_along_axis(self.page_table[rows.slot], rows.positions // ps, axis=1)
    page = jnp.where(rows.valid, page, 0)                               # padding: scratch page
    offset = rows.positions % ps
    c_pool, rot_pool = self.entry
    c_pool = c_pool.at[page, offset].set(c_new.astype(c_pool.dtype))
    rot_pool = rot_pool.at[page, offset].set(rot_new.astype(rot_pool.dtype))
    self.entry = MLACache(c_pool, rot_pool)
    ctx = self.page_table[rows.slot, :self.ctx_pages]                   # [R, P]
    r = ctx.shape[0]
    c_ctx = c_pool[ctx].reshape(r, self.ctx_pages * ps, -1)
    rot_ctx = rot_pool[ctx].reshape(r, self.ctx_pages * ps, -1)
    start = jnp.zeros((r,), jnp.int32)
    return self.module.attend_latent(x, c_ctx, rot_ctx, rows.positions, start,
                                     heads_major=self.heads_major)


def forward(defs: UnstackedDefs, params: Unstacked, parts: tuple[Rows, ...], cache: PagedCache,
            page_table: jax.Array, *, ctx_pages: int) -> tuple[jax.Array, PagedCache]:
  """The final-norm features [N, d] of every token of `parts` (in order, row-major) and the
  cache after them. page_table [slots + 1, max_pages] int32; `ctx_pages` (static): how many of
  each row's pages its attention reads (the engine rounds the step's longest context up to a
  bucket, so few shapes compile)."""
  cfg = defs.cfg
  page_size = cache.pages[0].c.shape[1] if cache.pages else 1
  ids = jnp.concatenate([rows.ids.reshape(-1) for rows in parts])
  carry = initial_carry(cfg, params.embed[ids][None].astype(defs.ex.jnp_dtype))
  graphdefs = dict(defs.kinds)
  kda, snaps, pages = list(cache.kda), list(cache.snapshots), list(cache.pages)
  for l in range(cfg.num_layers):
    kinds, idx = schedule.layer_kinds(cfg, l), schedule.layer_indices(cfg, l)
    norms, mixer, mlp = (nnx.merge(graphdefs[k], params.layers[k][i]) for k, i in zip(kinds, idx))
    i = idx[1]
    if kinds[1] == "kda":
      rows_mixer = _RowsMixer(mixer, parts, kda[i], snaps[i], page_table, ctx_pages, page_size)
    else:
      rows_mixer = _RowsMixer(mixer, parts, pages[i], None, page_table, ctx_pages, page_size,
                              params.mla_heads_major[i])
    carry, _, _ = layer_step(cfg, l, norms, rows_mixer, mlp, carry, None)
    if kinds[1] == "kda":
      kda[i], snaps[i] = rows_mixer.entry, rows_mixer.snaps
    else:
      pages[i] = rows_mixer.entry
  h = carry.partial
  if cfg.attn_res_block_size is not None:
    h = nnx.merge(defs.output_res, params.output_res)(carry.blocks, carry.partial, _valid(carry))
  features = nnx.merge(defs.final_norm, params.final_norm)(h)[0]
  return features, PagedCache(tuple(kda), tuple(snaps), tuple(pages))


def logits(defs: UnstackedDefs, params: Unstacked, features_md: jax.Array) -> jax.Array:
  """[M, V] logits of M tokens' final-norm features."""
  cfg, ex = defs.cfg, defs.ex
  head = params.embed.T if cfg.tie_word_embeddings else params.lm_head
  return jnp.einsum("md,dv->mv", features_md, head.astype(ex.jnp_dtype), precision=ex.precision)
