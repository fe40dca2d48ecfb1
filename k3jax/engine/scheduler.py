"""Which tokens run in the next step, and where their state lives (host side).

Every step: admit waiting requests to free slots (oldest first; a prefix-cache hit restores a
snapshot and shares the cached pages; a request whose prompt shares a prefix that a running
request is still computing waits for it, then hits), then take one token of every request
that is decoding and a chunk of up to `prefill_chunk` tokens of the oldest `prefill_rows`
requests still reading their prompt (or starting from a snapshot or from zeros with one
token left: decode rows only continue their slots), and make sure every position taken has a
page. When no page is free the prefix cache gives up its least recently used idle block; when
it has none, the newest running request is preempted (its pages and slot freed, its tokens so
far kept) and recomputed later, so a full pool never fails a request or changes a token.

Chunk boundaries depend on the request alone (multiples of `prefill_chunk`, the prefix-cache
snapshot positions, the end of its tokens), never on what else runs: a request computes the
same chunks alone or in any company.

With `data_shards` D > 1 the slots, pages and snapshots are D pools, each with its own free
lists and prefix cache (a shard's pages live on its devices only). A request is pinned to one
shard when admitted: the one whose prefix cache holds the longest restorable prefix of its
prompt, else the one with the most free slots (then pages); it takes pages there, is preempted
for its shard's sake only, and its full blocks are cached there. Up to `prefill_rows` prompts
are read per shard per step.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, deque
from typing import Any

import numpy as np

from k3jax.engine.blocks import Block, BlockKeys, PagePool, PrefixCache
from k3jax.engine.config import EngineConfig
from k3jax.engine.request import FinishReason, RequestOutput, SamplingParams
from k3jax.model.paged import FRESH, FROM_SLOT, FROM_SNAPSHOT


@dataclasses.dataclass(eq=False)
class Request:
  id: str
  tokens: list[int]              # the prompt, then the output: appended in place, never copied
  prompt_len: int
  params: SamplingParams
  seq: int                       # arrival order
  seed: int                      # 32-bit draw seed
  stop_ids: frozenset[int]
  slot: int | None = None        # in [0, max_num_seqs), within its shard's range
  shard: int = 0
  pages: list[int] = dataclasses.field(default_factory=list)  # page of each block (its shard's)
  blocks: list[Block] = dataclasses.field(default_factory=list)  # held cached blocks (prefix)
  private: set[int] = dataclasses.field(default_factory=set)  # pages it owns (not cached)
  computed: int = 0              # tokens whose latents and KDA state are in the cache
  source: int = FRESH            # where the next chunk's KDA state comes from
  restore: int = 0               # snapshot to restore (source FROM_SNAPSHOT)
  pending: RequestOutput | None = None
  prompt_logprobs: list | None = None
  finish: FinishReason | None = None
  text: str = ""
  preemptions: int = 0
  epoch: int = 0                 # the weights epoch its cached state was computed in
  hold: bool = False             # on finishing, pause (keep its state) instead of releasing
  paused: bool = False           # out of the schedule (Engine.pause / hold), its state kept
  keys: BlockKeys | None = None  # its prompt blocks' chain digests (the scheduler's)
  drafter_state: Any = None      # speculative decoding's per-request state (prompt lookup)
  state: Any = None              # the engine's per-request sampling state (constraints)

  @property
  def prompt(self) -> list[int]:
    return self.tokens[:self.prompt_len]

  @property
  def output(self) -> list[int]:
    return self.tokens[self.prompt_len:]

  @property
  def output_len(self) -> int:
    return len(self.tokens) - self.prompt_len

  @property
  def to_feed(self) -> int:
    return len(self.tokens) - self.computed

  @property
  def decodes(self) -> bool:
    """Its next step is a decode row: one token left, continuing its slot's KDA state (one
    starting from a snapshot or from zeros is read in a prefill row instead)."""
    return self.to_feed == 1 and self.source == FROM_SLOT

  def out(self) -> RequestOutput:
    if self.pending is None:
      self.pending = RequestOutput(self.id)
    return self.pending


@dataclasses.dataclass
class Chunk:
  request: Request
  start: int
  end: int
  save: int | None = None  # snapshot written after the chunk (its block: end // size - 1)

  @property
  def samples(self) -> bool:
    """The chunk reaches the request's last token: its logits draw the next one."""
    return self.end == len(self.request.tokens)


class Shard:
  """One pool shard's host side: its page free list, prefix cache (and snapshot free list)
  and free slots (ids in [0, max_num_seqs), this shard's range)."""

  def __init__(self, config: EngineConfig, index: int):
    n = config.shard_slots
    self.pages = PagePool(config.shard_pages, config.context_shards)
    self.prefix = PrefixCache(self.pages, config.page_size, config.shard_snapshots)
    self.free_slots = list(range((index + 1) * n - 1, index * n - 1, -1))


class Scheduler:

  def __init__(self, config: EngineConfig):
    self.config = config
    self.shards = [Shard(config, i) for i in range(config.data_shards)]
    self.waiting: deque[Request] = deque()
    self.running: list[Request] = []   # admission order
    self.paused: list[Request] = []    # paused requests holding a slot, oldest pause first
    self.preemptions = 0
    self.epoch = 0                     # the weights epoch (clear_prefix starts the next)
    # the page table the device reads, kept up to date as pages are taken and given back:
    # shard by shard, shard_slots rows of its slots' pages (ids in its pool), then its scratch
    self.table = np.zeros((config.data_shards * (config.shard_slots + 1),
                           config.pages_per_seq), np.int32)

  def prefix(self, r: Request) -> PrefixCache:
    return self.shards[r.shard].prefix

  # ---- totals over the shards (stats, tests) -------------------------------------------------
  @property
  def free_slots(self) -> list[int]:
    return [slot for sh in self.shards for slot in sh.free_slots]

  @property
  def pages_used(self) -> int:
    return sum(sh.pages.used for sh in self.shards)

  @property
  def pages_total(self) -> int:
    return sum(sh.pages.size for sh in self.shards)

  @property
  def cached_blocks(self) -> list[Block]:
    return [b for sh in self.shards for b in sh.prefix.blocks.values()]

  @property
  def hit_tokens(self) -> int:
    return sum(sh.prefix.hit_tokens for sh in self.shards)

  @property
  def hit_rate(self) -> float:
    queried = sum(sh.prefix.queried_tokens for sh in self.shards)
    return self.hit_tokens / queried if queried else 0.0

  def clear_prefix(self) -> None:
    """New weights: forget the prefix cache and start the next weights epoch. A request
    running (or paused) across the switch computed its state so far under the old weights:
    it registers no block and saves no snapshot from now on (`stale`), and the chains of the
    new epoch start from another root (blocks.root), so nothing it computes is ever reused."""
    self.epoch += 1
    for sh in self.shards:
      sh.prefix.clear()

  def drop_device_state(self) -> None:
    """The device cache was rebuilt empty: every request holding state there recomputes it
    (preempted: running ones first in line again, in their order; paused ones on resume) and
    the prefix cache forgets its blocks (their pages and snapshots are zeros now)."""
    for r in reversed(self.running):
      self.preempt(r)
    for r in list(self.paused):
      if r.slot is not None:
        self.preempt(r)
    for sh in self.shards:
      sh.prefix.clear()

  def stale(self, r: Request) -> bool:
    """Whether `r`'s cached state was (partly) computed under weights before the current."""
    return r.epoch != self.epoch

  # ---- block keys ------------------------------------------------------------------------------
  def _limit(self, r: Request) -> int:
    """The prompt tokens `r` may take from the cache (the last token is always computed)."""
    return min(r.prompt_len, len(r.tokens) - 1)

  def keys(self, r: Request, n: int) -> list[bytes]:
    """The chain digests of `r`'s first `n` blocks under the current root (every shard's
    prefix cache starts the epoch's chains from the same root), each computed once."""
    if r.keys is None:
      r.keys = BlockKeys(self.config.page_size)
    return r.keys.upto(r.tokens, n, self.shards[0].prefix.root)

  # ---- admission -----------------------------------------------------------------------------
  def admit(self) -> None:
    deferred = []
    while self.waiting and (self.paused or any(sh.free_slots for sh in self.shards)):
      r = self.waiting.popleft()
      if self._prefix_in_flight(r):
        deferred.append(r)
        continue
      self._free_a_slot()
      hits = [self._hit(sh, r) if sh.free_slots else None for sh in self.shards]
      r.shard = max((i for i, h in enumerate(hits) if h is not None), key=lambda i: (
          len(hits[i]), len(self.shards[i].free_slots), self.shards[i].pages.free, -i))
      r.slot = self.shards[r.shard].free_slots.pop()
      r.computed, r.source, r.restore, r.epoch = 0, FRESH, 0, self.epoch
      if self._caches(r):
        self._restore_prefix(r, hits[r.shard])
      self.running.append(r)

    self.waiting.extendleft(reversed(deferred))

  def _free_a_slot(self) -> None:
    """A free slot, preempting the longest-paused request for one when only paused requests
    hold them (a paused request never blocks a waiting one)."""
    if not any(sh.free_slots for sh in self.shards):
      self.preempt(self.paused[0])

  def _caches(self, r: Request) -> bool:
    """Whether `r` may take (and need not recompute) cached prompt blocks."""
    return self.config.prefix_cache and not r.params.prompt_logprobs

  def _hit(self, shard: Shard, r: Request) -> list[Block]:
    """The longest chain of `shard`'s cached blocks of `r`'s prompt that ends in a snapshot
    (what `r` restores there); the last token is always computed."""
    if not self._caches(r):
      return []
    n = self._limit(r) // self.config.page_size
    return shard.prefix.restorable(self.keys(r, n), n)

  def _prefix_in_flight(self, r: Request) -> bool:
    """Whether `r` should wait for a prefix another running request is computing: that
    request is still reading a prompt that shares with `r`'s a block where it will save a KDA
    snapshot, past what the prefix cache holds for `r` now. Admitted at once, `r` would
    compute the same blocks again beside it (requests sharing a system prompt, arriving
    together); waiting a few steps, it restores them. Prefixes compare by block keys
    (bisection: equal keys at block i mean equal prompts up to it), not token by token."""
    if not self._caches(r):
      return False
    size = self.config.page_size
    n = self._limit(r) // size
    if n == 0:
      return False
    mine = self.keys(r, n)
    for q in self.running:
      shared = min(n, q.prompt_len // size)
      if q.computed >= q.prompt_len or self.stale(q) or shared == 0:
        continue
      theirs = self.keys(q, shared)
      if theirs[0] != mine[0]:
        continue
      lo, hi = 1, shared  # the common blocks: in [lo, hi]
      while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if theirs[mid - 1] == mine[mid - 1] else (lo, mid - 1)
      have = self.prefix(q).match(mine, n) * size  # where r would restore it
      if self._snapshot_between(q, max(have, q.computed), lo * size):
        return True
    return False

  def _restore_prefix(self, r: Request, chain: list[Block]) -> None:
    size = self.config.page_size
    self.prefix(r).record(self._limit(r), len(chain) * size)
    if not chain:
      return
    self.prefix(r).acquire(chain)
    r.blocks, r.pages = list(chain), [b.page for b in chain]
    self.table[self._table_row(r), :len(r.pages)] = r.pages
    r.computed = len(chain) * size
    r.source, r.restore = FROM_SNAPSHOT, chain[-1].snapshot

  # ---- one step's work -----------------------------------------------------------------------
  def schedule(self) -> tuple[list[Chunk], list[Chunk]]:
    """(decode chunks, prefill chunks) of the next step, pages allocated. A decode chunk is
    the one token left of a request that continues its slot's KDA state; one that starts from
    a snapshot or from zeros (a prompt cached up to its last token, a one-token prompt) is
    read in a prefill row instead, so decode rows only ever read and write their slots."""
    self.admit()
    while True:
      decode = [Chunk(r, r.computed, r.computed + 1) for r in self.running if r.decodes]
      prefill, reading = [], Counter()  # the oldest prompts still being read, per shard
      for r in self.running:
        if r.to_feed and not r.decodes and reading[r.shard] < self.config.prefill_rows:
          reading[r.shard] += 1
          prefill.append(Chunk(r, r.computed, self._chunk_end(r)))
      victim = self._allocate(decode + prefill)
      if victim is None:
        break
      self.preempt(victim)
    for c in prefill:
      c.save = self._snapshot_for(c)
    return decode, prefill

  def _next_snapshot(self, r: Request, after: int) -> int | None:
    """The first position after `after` where `r`'s prompt saves a KDA snapshot (at a stride
    of prefix_state_every blocks, and at its last full block), or None."""
    if not self.config.prefix_cache:
      return None
    size, n = self.config.page_size, r.prompt_len
    every = self.config.prefix_state_every * size
    found = [p for p in ((after // every + 1) * every, n // size * size)
             if after < p <= n and p >= size]
    return min(found, default=None)

  def _snapshot_between(self, r: Request, lo: int, hi: int) -> bool:
    """Whether `r` saves a snapshot at a position p with lo < p <= hi."""
    p = self._next_snapshot(r, lo)
    return p is not None and p <= hi

  def _chunk_end(self, r: Request) -> int:
    c = self.config.prefill_chunk
    end = min(len(r.tokens), (r.computed // c + 1) * c)
    later = self._next_snapshot(r, r.computed)
    return later if later is not None and later < end else end

  def _snapshot_for(self, c: Chunk) -> int | None:
    r = c.request
    if (self._next_snapshot(r, c.end - 1) != c.end or c.end > r.prompt_len or self.stale(r)):
      return None
    index = c.end // self.config.page_size - 1
    block = self.prefix(r).blocks.get(self.keys(r, index + 1)[index])
    if block is not None and block.snapshot is not None:
      return None
    return self.prefix(r).alloc_snapshot()

  def _allocate(self, chunks: list[Chunk]) -> Request | None:
    """Pages for every position of `chunks`; the request to preempt when they cannot be had
    (the newest on the shard that ran out)."""
    for c in chunks:
      if not self._grow(c.request, c.end):
        shard = c.request.shard
        paused = [q for q in self.paused if q.shard == shard]
        if paused:  # what a paused request holds goes first (it recomputes on resume)
          return paused[0]
        return max((q for q in self.running if q.shard == shard), key=lambda q: q.seq)
    return None

  def reserve(self, decode: list[Chunk], steps: int) -> bool:
    """Pages for `steps` decode tokens of each of `decode`'s requests, from free pages or idle
    prefix-cache blocks only; False (nothing preempted) when they cannot all be had. Pages
    taken stay with their request, which fills them in its next steps."""
    return all(self._grow(c.request, c.end + steps - 1) for c in decode)

  def _table_row(self, r: Request) -> int:
    n = self.config.shard_slots
    return r.shard * (n + 1) + r.slot % n

  def _grow(self, r: Request, positions: int) -> bool:
    """Pages for `r`'s first `positions` positions, from free pages or idle prefix-cache
    blocks; False when there are none left."""
    size, shard = self.config.page_size, self.shards[r.shard]
    while len(r.pages) * size < positions:
      page = shard.pages.alloc(len(r.pages))
      while page is None and shard.prefix.evict_one():
        page = shard.pages.alloc(len(r.pages))
      if page is None:
        return False
      self.table[self._table_row(r), len(r.pages)] = page
      r.pages.append(page)
      r.private.add(page)
    return True

  def trim(self, r: Request) -> None:
    """Give back the pages past `r`'s tokens (a verification took pages for drafts it did not
    keep); its pages then cover its positions up to the next token's."""
    size, shard = self.config.page_size, self.shards[r.shard]
    while len(r.pages) * size >= len(r.tokens) + size and r.pages[-1] in r.private:
      page = r.pages.pop()
      r.private.discard(page)
      shard.pages.release(page)
      self.table[self._table_row(r), len(r.pages)] = 0

  # ---- leaving ---------------------------------------------------------------------------------
  def release(self, r: Request) -> None:
    """Give back everything `r` holds (it ends, or is preempted)."""
    shard = self.shards[r.shard]
    for page in r.private:
      shard.pages.release(page)
    shard.prefix.release(r.blocks)
    if r.slot is not None:
      self.table[self._table_row(r), :len(r.pages)] = 0
      shard.free_slots.append(r.slot)
      r.slot = None
    r.pages, r.blocks, r.private = [], [], set()
    if r in self.running:
      self.running.remove(r)
    if r in self.paused:
      self.paused.remove(r)

  def preempt(self, r: Request) -> None:
    """Free what `r` holds; it recomputes its tokens when admitted again. A running request is
    first in line again (it was admitted before everything still waiting); a paused one
    waits for its resume."""
    paused = r.paused
    self.release(r)
    r.computed, r.source, r.preemptions = 0, FRESH, r.preemptions + 1
    self.preemptions += 1
    if not paused:
      self.waiting.appendleft(r)

  # ---- pausing ---------------------------------------------------------------------------------
  def pause(self, r: Request) -> None:
    """Take `r` out of the schedule; a running request keeps its slot, pages and KDA state."""
    r.paused = True
    if r in self.waiting:
      self.waiting.remove(r)
    if r in self.running:
      self.running.remove(r)
      self.paused.append(r)

  def resume(self, r: Request, recompute: bool = False) -> None:
    """Put a paused `r` back: continuing from the state it kept, or (`recompute`, or when its
    state was given up) read again from its first token under the current weights."""
    if recompute and r.slot is not None:
      self.release(r)
      r.computed, r.source = 0, FRESH
    r.paused = False
    if r in self.paused:
      self.paused.remove(r)
      self.running.append(r)
    else:  # in arrival order among the waiting
      at = next((i for i, q in enumerate(self.waiting) if q.seq > r.seq), len(self.waiting))
      self.waiting.insert(at, r)

  # ---- after a step ----------------------------------------------------------------------------
  def advance(self, c: Chunk) -> None:
    """`c` ran: its tokens are in the cache; cache its full prompt blocks."""
    r = c.request
    r.computed, r.source = c.end, FROM_SLOT
    if self.config.prefix_cache:
      self._register(r, c)

  def _register(self, r: Request, c: Chunk) -> None:
    if self.stale(r):  # computed partly under other weights: never reused (clear_prefix)
      return
    size = self.config.page_size
    full = min(r.computed, r.prompt_len) // size
    prefix = self.prefix(r)
    keys = self.keys(r, full)
    parent = r.blocks[-1] if r.blocks else None
    for i in range(len(r.blocks), full):
      block = prefix.register(parent, keys[i], i, r.pages[i])
      if block is None:  # cached already by another request: keep our page, note theirs
        existing = prefix.blocks[keys[i]]
        if c.save is not None and i == c.end // size - 1 and existing.snapshot is None:
          prefix.set_snapshot(existing, c.save)
          c.save = None
        break
      r.private.discard(r.pages[i])
      r.blocks.append(block)
      parent = block
      if c.save is not None and i == c.end // size - 1:
        prefix.set_snapshot(block, c.save)
        c.save = None
    if c.save is not None:  # its block did not end up cached: the snapshot is free again
      prefix.release_snapshot(c.save)
      c.save = None
