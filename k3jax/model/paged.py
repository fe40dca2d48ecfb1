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

Scratch entries keep every shape fixed and every write unconditional: the last slot takes the
rows that carry no request, the last snapshot the rows that save none, and page 0 the padding.
With pool shards (`init_cache(shards=D)`) every pool is D blocks, each with its own scratch
entries, and each part's rows are D blocks, row block s using pool block s with local ids
(`_RowsMixer`; docs/serving.md, "Pools split over the batch axes").

The layers run unrolled on per-layer weights (k3jax/model/decode.py's `Unstacked` form).
"""

from __future__ import annotations

import math
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
from k3jax.model.layers import head_logits
from k3jax.model.transformer import _valid, initial_carry, layer_step
from sharding.activations import activation_spec
from sharding.rules import CONTEXT_AXIS

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
  source: jax.Array | None   # [R] int32 FROM_SLOT, FRESH or FROM_SNAPSHOT (None: all FROM_SLOT)
  restore: jax.Array | None  # [R] int32 snapshot to start from (FROM_SNAPSHOT)
  save: jax.Array | None     # [R] int32 snapshot to save the row's final state to (scratch:
                             #   none; None: the part saves none, as decode rows never do)


def init_cache(cfg: ModelConfig, ex: Execution, *, slots: int, pages: int, page_size: int,
               snapshots: int, shards: int = 1, stripes: int = 1) -> PagedCache:
  """An empty engine cache of `slots` request slots, `pages` latent pages and `snapshots` KDA
  state snapshots, in `ex`'s compute dtype, split into `shards` equal shards (each count
  divides by it), each shard with one more of each for scratch: shard s holds slots
  s * (slots / shards + 1) + [0, slots / shards] (the last: scratch), likewise the snapshots,
  and pages s * (pages / shards + 1) + [0, pages / shards] (the first, local page 0:
  scratch). With `stripes` k > 1 each shard's pages are k stripes of pages / (shards k), each
  with its own scratch page first (engine.blocks.PagePool's ids), one stripe per device of the
  `context` axis."""
  def one(n):  # distinct buffers per field (the cache is donated: no two leaves may alias)
    return KDAState(*(jnp.zeros(a.shape, a.dtype) for a in kda_initial_state(cfg, ex, n)))
  per = lambda n, k=1: shards * k * (n // (shards * k) + 1)
  kda = tuple(one(per(slots)) for _ in cfg.kda_layers)
  snaps = tuple(one(per(snapshots)) for _ in cfg.kda_layers)
  shape = (per(pages, stripes), page_size)
  dt = ex.jnp_dtype
  mla = tuple(MLACache(jnp.zeros((*shape, cfg.kv_lora_rank), dt),
                       jnp.zeros((*shape, cfg.qk_rope_head_dim), dt)) for _ in cfg.mla_layers)
  return PagedCache(kda, snaps, mla)


def _names(shards: int, stripes: int = 1):
  """Logical names of the cache's arrays: the pools' leading axis is `slots` / `pages` (whole
  on every device) for one shard, `pool_shards` (over the batch axes) for more; the pages'
  stripes add `context` (`page_stripes`, `pool_shard_stripes`)."""
  slots = "slots" if shards == 1 else "pool_shards"
  pages = {(False, False): "pages", (True, False): "pool_shards",
           (False, True): "page_stripes", (True, True): "pool_shard_stripes"}[
               (shards > 1, stripes > 1)]
  return (KDAState(*((slots, None, "heads", "head_dim"),) * 3, (slots, "heads", "head_dim", None)),
          MLACache((pages, "page", "kv_lora"), (pages, "page", None)))


def specs(cache: PagedCache, mesh, shards: int = 1, stripes: int = 1) -> PagedCache:
  """The PartitionSpec of every array of `cache` (concrete or abstract, of `shards` shards and
  `stripes` page stripes) on `mesh`, by the rules table (KDA heads over `tensor`; one shard:
  slots and pages whole on every device; more: the shards over the batch axes; the pages'
  stripes over `context`): where `place` puts them, and what `k3jax plan --mode decode` counts
  per device."""
  kda_names, page_names = _names(shards, stripes)

  def spec(x, names):
    return activation_spec(names, x.shape, mesh)
  return PagedCache(tuple(KDAState(*map(spec, e, kda_names)) for e in cache.kda),
                    tuple(KDAState(*map(spec, e, kda_names)) for e in cache.snapshots),
                    tuple(MLACache(*map(spec, e, page_names)) for e in cache.pages))


def place(cache: PagedCache, mesh, shards: int = 1, stripes: int = 1) -> PagedCache:
  """`cache` on `mesh`, placed by the rules table (`specs`)."""
  return jax.tree.map(lambda x, s: jax.device_put(x, jax.sharding.NamedSharding(mesh, s)),
                      cache, specs(cache, mesh, shards, stripes))


def shard_axes(cache: PagedCache, mesh, shards: int) -> tuple[str, ...]:
  """The mesh axes the pools' shards are split over (the leading axis of every slot and
  snapshot pool, as `specs` places it); () for one shard or a mesh with no batch axis.
  ValueError when the devices along them do not divide the shards (each device must hold
  whole shards)."""
  if shards == 1:
    return ()
  slot_pools = PagedCache(cache.kda, cache.snapshots, ())
  leading = {s[0] if len(s) else None for s in jax.tree.leaves(
      specs(slot_pools, mesh, shards), is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))}
  if len(leading) != 1:
    raise ValueError(f"the pools' shards split unevenly over the mesh: {sorted(map(str, leading))}")
  axes = leading.pop()
  axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
  ways = math.prod(mesh.shape[a] for a in axes)
  if shards % ways:
    raise ValueError(f"data_shards {shards} do not divide over the mesh's batch axes "
                     f"{ {a: mesh.shape[a] for a in axes} } ({ways} ways)")
  return axes


def _start_state(entry: KDAState, snaps: KDAState, rows: Rows) -> KDAState:
  """Each row's KDA state before its tokens: its slot's, zeros (FRESH) or a snapshot's; its
  slot's alone when `rows.source` is None (rows that all continue their slots)."""
  if rows.source is None:
    return KDAState(*(a[rows.slot] for a in entry))

  def pick(slot_a, snap_a):
    from_slot = slot_a[rows.slot]
    from_snap = snap_a[rows.restore]
    shape = (-1,) + (1,) * (from_slot.ndim - 1)
    src = rows.source.reshape(shape)
    zero = jnp.zeros((), from_slot.dtype)
    return jnp.where(src == FRESH, zero, jnp.where(src == FROM_SNAPSHOT, from_snap, from_slot))
  return KDAState(*(pick(a, s) for a, s in zip(entry, snaps)))


def _per_shard(fn, args: tuple, shards: int, axes: tuple[str, ...], stripe_axis=None,
               striped_state: bool = False):
  """`fn(xs, parts, table, state)` on each shard's equal blocks of every array of `args` (leading
  axes laid out shard by shard), the outputs' blocks concatenated back; under `axes` inside
  shard_map, each device on its own shards, so no device reads another's pool. `stripe_axis`
  (the pages split by position over `context`): the shard_map is manual over it too, every
  device of it running the rows whole, with `state` split over it as well when
  `striped_state` (an MLA layer's page stripes; a KDA layer's state stays whole)."""
  def blocks(*a, n: int):
    if n == 1:
      return fn(*a)
    block = lambda x, s: x.reshape(n, -1, *x.shape[1:])[s]
    outs = [fn(*jax.tree.map(lambda x, s=s: block(x, s), a)) for s in range(n)]
    return jax.tree.map(lambda *o: jnp.concatenate(o, axis=0), *outs)

  if not axes and stripe_axis is None:
    return blocks(*args, n=shards)
  ways = math.prod(jax.sharding.get_abstract_mesh().shape[a] for a in axes)
  rows = jax.sharding.PartitionSpec(axes or None)
  state = rows
  if striped_state and stripe_axis is not None:
    state = jax.sharding.PartitionSpec(axes + (stripe_axis,))
  names = frozenset(axes) | ({stripe_axis} if stripe_axis else set())
  return jax.shard_map(lambda *a: blocks(*a, n=shards // ways), in_specs=(rows,) * 3 + (state,),
                       out_specs=(rows, state), axis_names=names, check_vma=False)(*args)


class _RowsMixer:
  """A mixer for `layer_step` over the step's flat tokens [1, N, d]: runs each part's rows
  against the layer's cache entry; the updated entries end up in `.entry`, `.snaps`.

  With `shards` > 1 every array it indexes (the parts' rows, the page table, the pools) is
  laid out shard by shard in equal blocks, and row block s reads and writes only pool block s
  with ids local to it: the mixer runs once per shard on its blocks. Under `axes` (mesh axes
  the blocks are split over) that runs inside shard_map, each device on its own blocks, so no
  device gathers another's pages (a gather from a split pool outside it would be partitioned
  into a masked gather and an all-reduce of every row's context)."""

  def __init__(self, module, parts: tuple[Rows, ...], entry, snaps, page_table, ctx_pages: int,
               page_size: int, heads_major=None, shards: int = 1, axes: tuple[str, ...] = (),
               stripes: int = 1, deferred: bool = False):
    self.module, self.parts, self.entry, self.snaps = module, parts, entry, snaps
    self.page_table, self.ctx_pages, self.page_size = page_table, ctx_pages, page_size
    self.heads_major, self.shards, self.axes = heads_major, shards, axes
    self.stripes = stripes
    # KDA: the first part's rows keep their slots' states; the part's input and start states
    # wait in `pending` for `commit` (speculative verification: which of its tokens stay is
    # known only once the step has drawn)
    self.deferred, self.pending = deferred, None

  def __call__(self, x_bnd: jax.Array, *, segment_ids=None) -> tuple[jax.Array, None]:
    """x_bnd [shards, N / shards, d]: shard s's tokens, part by part, row-major (`forward`)."""
    del segment_ids
    xs, offset = [], 0
    for rows in self.parts:
      r, t = rows.ids.shape
      n = r // self.shards * t  # a shard's tokens of this part
      xs.append(x_bnd[:, offset:offset + n].reshape(r, t, -1))
      offset += n
    state = (self.entry, self.snaps) if self.snaps is not None else (self.entry,)
    stripe_axis = CONTEXT_AXIS if self.stripes > 1 else None
    ys, state = _per_shard(self._shard, (tuple(xs), self.parts, self.page_table, state),
                           self.shards, self.axes, stripe_axis,
                           striped_state=not isinstance(self.module, KDA))
    self.entry = state[0]
    if self.snaps is not None:
      self.snaps = state[1]
    return jnp.concatenate([y.reshape(self.shards, -1, y.shape[-1]) for y in ys], axis=1), None

  def _shard(self, xs, parts, table, state):
    """One shard: every part's rows against its pools (ids local to them)."""
    ys = []
    for x, rows in zip(xs, parts):
      if isinstance(self.module, KDA):
        y, state = self._kda(x, rows, *state)
      else:
        y, state = self._mla(x, rows, table, *state)
      ys.append(y)
    return tuple(ys), state

  def _kda(self, x, rows: Rows, entry, snaps):
    state = _start_state(entry, snaps, rows)
    y, new = self.module(x, state=state, token_mask=rows.valid)
    if self.deferred and rows is self.parts[0]:
      self.pending = (x, state)
      return y, (entry, snaps)
    new = KDAState(*(n.astype(a.dtype) for n, a in zip(new, entry)))
    entry = KDAState(*(a.at[rows.slot].set(n) for a, n in zip(entry, new)))
    if rows.save is not None:  # None: the part saves no snapshot (decode rows never do)
      snaps = KDAState(*(a.at[rows.save].set(n) for a, n in zip(snaps, new)))
    return y, (entry, snaps)

  def _mla(self, x, rows: Rows, table, entry):
    ps = self.page_size
    c_new, rot_new = self.module.latent(x)                              # [R, T, kv], [R, T, rope]
    page = jnp.take_along_axis(table[rows.slot], rows.positions // ps, axis=1)
    page = jnp.where(rows.valid, page, 0)                               # padding: scratch page
    offset = rows.positions % ps
    c_pool, rot_pool = entry
    stripe, ctx, key_pos = 0, table[rows.slot, :self.ctx_pages], None   # ctx [R, P]
    if self.stripes > 1:  # this device's stripe: pages j = stripe, stripe + k, ... of a request
      stripe, n, local = jax.lax.axis_index(CONTEXT_AXIS), self.stripes, c_pool.shape[0]
      page = page - stripe * local                # other stripes' pages: out of range, dropped
      page = jnp.where((page >= 0) & (page < local), page, local)
      ctx = jnp.pad(ctx, ((0, 0), (0, -ctx.shape[1] % n)))
      ctx = jax.lax.dynamic_index_in_dim(ctx.reshape(ctx.shape[0], -1, n), stripe, 2, False)
      ctx = jnp.clip(ctx - stripe * local, 0, local - 1)  # unused pages: masked by position
      blocks = (jnp.arange(ctx.shape[1]) * n + stripe)[:, None] * ps + jnp.arange(ps)
      key_pos = blocks.reshape(-1)
    c_pool = c_pool.at[page, offset].set(c_new.astype(c_pool.dtype), mode="drop")
    rot_pool = rot_pool.at[page, offset].set(rot_new.astype(rot_pool.dtype), mode="drop")
    r, p = ctx.shape
    c_ctx = c_pool[ctx].reshape(r, p * ps, -1)
    rot_ctx = rot_pool[ctx].reshape(r, p * ps, -1)
    start = jnp.zeros((r,), jnp.int32)
    y = self.module.attend_latent(x, c_ctx, rot_ctx, rows.positions, start,
                                  heads_major=self.heads_major, key_positions=key_pos,
                                  merge_axis=CONTEXT_AXIS if self.stripes > 1 else None)
    return y, (MLACache(c_pool, rot_pool),)


def forward(defs: UnstackedDefs, params: Unstacked, parts: tuple[Rows, ...], cache: PagedCache,
            page_table: jax.Array, *, ctx_pages: int, shards: int = 1,
            axes: tuple[str, ...] = (), stripes: int = 1, deferred: bool = False):
  """The final-norm features [N, d] of every token of `parts` and the cache after them: shard
  by shard, within a shard part by part, within a part row-major (`token_index`; with one
  shard: the parts' tokens in order). page_table [slot entries, max_pages] int32;
  `ctx_pages` (static): how many of each row's pages its attention reads (the engine rounds
  the step's longest context up to a bucket, so few shapes compile). `shards` (static): the
  pools' shards (init_cache), each part's rows and the page table laid out shard by shard in
  equal blocks with shard-local ids; the per-token work runs on [shards, N / shards, d], its
  rows (the shards) placed as the batch (over the batch axes under a mesh); `axes`: the mesh
  axes the shards are split over (shard_axes), () on one device. `stripes` (static): the
  pages split by position over the mesh's `context` axis (init_cache).

  `deferred` (static, one shard): the first part's KDA states are not written; a third value,
  the `Pending` work of each KDA layer, lets `commit` write them for a prefix of each row's
  tokens once it is known (speculative decoding's verification rolls back rejected tokens by
  replaying the kept ones from the start state: docs/serving.md)."""
  cfg = defs.cfg
  page_size = cache.pages[0].c.shape[1] if cache.pages else 1
  ids = jnp.concatenate([rows.ids.reshape(shards, -1) for rows in parts], axis=1)
  carry = initial_carry(cfg, params.embed[ids].astype(defs.ex.jnp_dtype))
  graphdefs = dict(defs.kinds)
  kda, snaps, pages = list(cache.kda), list(cache.snapshots), list(cache.pages)
  pending = []
  for l in range(cfg.num_layers):
    kinds, idx = schedule.layer_kinds(cfg, l), schedule.layer_indices(cfg, l)
    norms, mixer, mlp = (nnx.merge(graphdefs[k], params.layers[k][i]) for k, i in zip(kinds, idx))
    i = idx[1]
    if kinds[1] == "kda":
      rows_mixer = _RowsMixer(mixer, parts, kda[i], snaps[i], page_table, ctx_pages, page_size,
                              shards=shards, axes=axes, stripes=stripes, deferred=deferred)
    else:
      rows_mixer = _RowsMixer(mixer, parts, pages[i], None, page_table, ctx_pages, page_size,
                              params.mla_heads_major[i], shards=shards, axes=axes,
                              stripes=stripes)
    carry, _, _ = layer_step(cfg, l, norms, rows_mixer, mlp, carry, None)
    if kinds[1] == "kda":
      kda[i], snaps[i] = rows_mixer.entry, rows_mixer.snaps
      if deferred:
        pending.append(Pending(i, mixer, *rows_mixer.pending))
    else:
      pages[i] = rows_mixer.entry
  h = carry.partial
  if cfg.attn_res_block_size is not None:
    h = nnx.merge(defs.output_res, params.output_res)(carry.blocks, carry.partial, _valid(carry))
  features = nnx.merge(defs.final_norm, params.final_norm)(h)
  out = (features.reshape(-1, features.shape[-1]),
         PagedCache(tuple(kda), tuple(snaps), tuple(pages)))
  return (*out, pending) if deferred else out


class Pending(NamedTuple):
  """One KDA layer's deferred state update: its module, the part's input and start states."""
  layer: int
  module: object
  x: jax.Array
  start: KDAState


def commit(pending: list[Pending], rows: Rows, keep: jax.Array, cache: PagedCache
           ) -> PagedCache:
  """Write each row's KDA state after its first tokens (`keep` [R, T] bool, a prefix of the
  row's valid tokens) into its slot: the layer run again from its start state with the other
  tokens masked, which leaves the state exactly as if they had never been read."""
  kda = list(cache.kda)
  for p in pending:
    _, new = p.module(p.x, state=p.start, token_mask=keep)
    entry = kda[p.layer]
    kda[p.layer] = KDAState(*(a.at[rows.slot].set(n.astype(a.dtype))
                              for a, n in zip(entry, new)))
  return cache._replace(kda=tuple(kda))


def token_index(widths: tuple[tuple[int, int], ...], shards: int, part: int, row: int,
                position: int) -> int:
  """Where `forward`'s features hold the token at `position` of row `row` of part `part`,
  for parts of (rows, width) `widths` laid out in `shards` equal blocks of rows."""
  per_shard = [r // shards * t for r, t in widths]
  rows_per_shard, width = widths[part][0] // shards, widths[part][1]
  shard, local = divmod(row, rows_per_shard)
  return shard * sum(per_shard) + sum(per_shard[:part]) + local * width + position


def logits(defs: UnstackedDefs, params: Unstacked, features_md: jax.Array) -> jax.Array:
  """[M, V] logits of M tokens' final-norm features, in the wide dtype (`head_logits`: what
  the trainer's head produces from the same operands)."""
  cfg, ex = defs.cfg, defs.ex
  head = params.embed.T if cfg.tie_word_embeddings else params.lm_head
  return head_logits("md,dv->mv", features_md.astype(ex.jnp_dtype), head, ex.precision)
