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

from k3jax.engine.blocks import Block, PagePool, PrefixCache
from k3jax.engine.config import EngineConfig
from k3jax.engine.request import FinishReason, RequestOutput, SamplingParams
from k3jax.model.paged import FRESH, FROM_SLOT, FROM_SNAPSHOT


@dataclasses.dataclass(eq=False)
class Request:
  id: str
  prompt: list[int]
  params: SamplingParams
  seq: int                       # arrival order
  seed: int                      # 32-bit draw seed
  stop_ids: frozenset[int]
  output: list[int] = dataclasses.field(default_factory=list)
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

  @property
  def tokens(self) -> list[int]:
    return self.prompt + self.output

  @property
  def to_feed(self) -> int:
    return len(self.prompt) + len(self.output) - self.computed

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

  def stale(self, r: Request) -> bool:
    """Whether `r`'s cached state was (partly) computed under weights before the current."""
    return r.epoch != self.epoch

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
    limit = min(len(r.prompt), len(r.tokens) - 1)
    chain = shard.prefix.match(r.tokens, limit)
    while chain and chain[-1].snapshot is None:
      chain.pop()
    return chain

  def _prefix_in_flight(self, r: Request) -> bool:
    """Whether `r` should wait for a prefix another running request is computing: that
    request is still reading a prompt that shares with `r`'s a block where it will save a KDA
    snapshot, past what the prefix cache holds for `r` now. Admitted at once, `r` would
    compute the same blocks again beside it (requests sharing a system prompt, arriving
    together); waiting a few steps, it restores them."""
    if not self._caches(r):
      return False
    size = self.config.page_size
    limit = min(len(r.prompt), len(r.tokens) - 1)
    for q in self.running:
      if (q.computed >= len(q.prompt) or self.stale(q)
          or q.prompt[:size] != r.tokens[:size]):
        continue
      have = len(self.prefix(q).match(r.tokens, limit)) * size  # where r would restore it
      common = 0
      for a, b in zip(q.prompt[:limit], r.tokens[:limit]):
        if a != b:
          break
        common += 1
      if any(max(have, q.computed) < p <= common for p in self._snapshot_positions(q)):
        return True
    return False

  def _restore_prefix(self, r: Request, chain: list[Block]) -> None:
    size = self.config.page_size
    limit = min(len(r.prompt), len(r.tokens) - 1)  # the last token is always computed
    self.prefix(r).record(limit, len(chain) * size)
    if not chain:
      return
    self.prefix(r).acquire(chain)
    r.blocks, r.pages = list(chain), [b.page for b in chain]
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

  def _snapshot_positions(self, r: Request) -> set[int]:
    if not self.config.prefix_cache:
      return set()
    size, every = self.config.page_size, self.config.prefix_state_every
    n = len(r.prompt)
    out = set(range(every * size, n + 1, every * size))
    if n >= size:
      out.add(n // size * size)
    return out

  def _chunk_end(self, r: Request) -> int:
    c = self.config.prefill_chunk
    end = min(len(r.tokens), (r.computed // c + 1) * c)
    later = [p for p in self._snapshot_positions(r) if r.computed < p < end]
    return min(later, default=end)

  def _snapshot_for(self, c: Chunk) -> int | None:
    r = c.request
    if c.end not in self._snapshot_positions(r) or c.end > len(r.prompt) or self.stale(r):
      return None
    block = self._cached_block(r, c.end // self.config.page_size - 1)
    if block is not None and block.snapshot is not None:
      return None
    return self.prefix(r).alloc_snapshot()

  def _cached_block(self, r: Request, index: int) -> Block | None:
    size, parent = self.config.page_size, None
    for i in range(index + 1):
      parent = self.prefix(r).lookup(parent, r.tokens[i * size:(i + 1) * size])
      if parent is None:
        return None
    return parent

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
      r.pages.append(page)
      r.private.add(page)
    return True

  # ---- leaving ---------------------------------------------------------------------------------
  def release(self, r: Request) -> None:
    """Give back everything `r` holds (it ends, or is preempted)."""
    shard = self.shards[r.shard]
    for page in r.private:
      shard.pages.release(page)
    shard.prefix.release(r.blocks)
    r.pages, r.blocks, r.private = [], [], set()
    if r.slot is not None:
      shard.free_slots.append(r.slot)
      r.slot = None
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
    full = min(r.computed, len(r.prompt)) // size
    parent = r.blocks[-1] if r.blocks else None
    for i in range(len(r.blocks), full):
      tokens = r.tokens[i * size:(i + 1) * size]
      block = self.prefix(r).register(parent, tokens, i, r.pages[i])
      if block is None:  # cached already by another request: keep our page, note theirs
        existing = self.prefix(r).lookup(parent, tokens)
        if c.save is not None and i == c.end // size - 1 and existing.snapshot is None:
          existing.snapshot, c.save = c.save, None
        break
      r.private.discard(r.pages[i])
      r.blocks.append(block)
      parent = block
      if c.save is not None and i == c.end // size - 1:
        block.snapshot, c.save = c.save, None
    if c.save is not None:  # its block did not end up cached: the snapshot is free again
      self.prefix(r).release_snapshot(c.save)
      c.save = None
