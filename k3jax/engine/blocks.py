"""Host-side bookkeeping of the engine's device memory: the latent page pool and the prefix cache.

Pages: page 0 of the device pool is scratch (padding writes there); pages 1..n hold tokens. A
running request owns the pages of its positions, in order (its page table row).

Prefix cache: a full block of a prompt (page_size tokens at a page-aligned position) is keyed by
a hash chain, digest(block i) = sha256(digest(block i-1) + its token ids), so a key names the
whole prefix up to that block, not just the block's own tokens. The chain starts from the
weights epoch (`root(epoch)`; the engine counts `set_params`), so a block computed under other
weights never matches, whoever registers it. A cached block holds the page
with those tokens' latents and, at some blocks, a snapshot of the KDA state (recurrent state
and conv tails) after its last token: KDA is recurrent, so a latent page alone cannot resume a
request; it restarts from the nearest snapshot at or before the match and recomputes the rest.
A block is held (`refs`) by every running request that uses its page; blocks no request holds
are evicted least recently used first, children before parents (a child is only reachable
through its parent's key, and a request holding a child holds its parents too).

Host work does not grow with the context: a request's block keys are computed once each
(`BlockKeys`), the cached blocks of a chain are found by bisection over its keys (the cache is
closed under parents: a child is only registered under a cached parent and evicted before
it), and eviction and snapshot reuse pop heaps of idle blocks instead of scanning the cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import itertools
from collections.abc import Sequence

import numpy as np


class PagePool:
  """Free lists of the token pages: page 0 is scratch, pages 1..n hold tokens.

  With `stripes` k > 1 (the pool split by position over k devices of the `context` axis:
  docs/serving.md, "Long requests"), the pool is k stripes of n / k pages, each with its own
  scratch page: stripe s holds ids s (n / k + 1) + [1, n / k], and a request's page of block
  j comes from stripe j mod k (`alloc(j)`), so its positions spread over the k devices and a
  cached block's page sits where every request using it expects it."""

  def __init__(self, n: int, stripes: int = 1):
    if n % stripes:
      raise ValueError(f"{n} pages do not split into {stripes} stripes")
    self.size, self.stripes, per = n, stripes, n // stripes
    self._free = [list(range(s * (per + 1) + per, s * (per + 1), -1)) for s in range(stripes)]

  def alloc(self, block: int = 0) -> int | None:
    """A free page for block `block` of a request (its stripe's), or None."""
    free = self._free[block % self.stripes]
    return free.pop() if free else None

  def release(self, page: int) -> None:
    self._free[page // (self.size // self.stripes + 1)].append(page)

  @property
  def free(self) -> int:
    return sum(map(len, self._free))

  @property
  def used(self) -> int:
    return self.size - self.free


@dataclasses.dataclass(eq=False)
class Block:
  digest: bytes
  page: int
  parent: Block | None
  index: int                  # block index in its prompt: tokens [index * size, (index + 1) * size)
  refs: int = 0
  snapshot: int | None = None
  last_used: int = 0
  children: int = 0
  detached: bool = False      # dropped from the cache (set_params) while requests held it
  order: int = 0              # creation order: ties of the LRU order go to the older block

  @property
  def lru(self) -> tuple[int, int, int]:
    """Eviction order: least recently used first, then deeper blocks (children) first."""
    return (self.last_used, -self.index, self.order)


def root(epoch: int) -> bytes:
  """The digest a chain of the weights epoch `epoch` starts from."""
  return hashlib.sha256(b"root:%d" % epoch).digest()


def chain_digest(parent: bytes, tokens: Sequence[int]) -> bytes:
  h = hashlib.sha256(parent)
  h.update(np.asarray(tokens, np.int64).tobytes())
  return h.digest()


class BlockKeys:
  """The chain digests of a token list's full blocks from one root, each computed once and
  extended as the list grows (tokens are only ever appended to a request)."""

  def __init__(self, block_size: int):
    self.block_size = block_size
    self.root: bytes | None = None
    self.keys: list[bytes] = []

  def upto(self, tokens: Sequence[int], n: int, root_digest: bytes) -> list[bytes]:
    """The keys of the first `n` blocks of `tokens` (a list of at least n keys)."""
    if root_digest != self.root:
      self.root, self.keys = root_digest, []
    size, keys = self.block_size, self.keys
    while len(keys) < n:
      i = len(keys)
      keys.append(chain_digest(keys[-1] if keys else root_digest, tokens[i * size:(i + 1) * size]))
    return keys


class _IdleHeap:
  """Blocks by LRU order, pushed whenever one may have become a candidate and checked when
  popped (a block's order only changes while it is held, so a stale entry shows as an order
  that differs or a block that no longer qualifies); compacted when stale entries dominate."""

  def __init__(self, qualifies):
    self._heap: list[tuple[tuple[int, int, int], int, Block]] = []
    self._qualifies = qualifies
    self._pushes = itertools.count()  # a block pushed twice: its entries never compare blocks

  def push(self, block: Block) -> None:
    if self._qualifies(block):
      heapq.heappush(self._heap, (block.lru, next(self._pushes), block))

  def pop(self) -> Block | None:
    while self._heap:
      key, _, block = heapq.heappop(self._heap)
      if key == block.lru and self._qualifies(block):
        return block
    return None

  def compact(self, live: int) -> None:
    if len(self._heap) > 2 * live + 64:
      seen, kept = set(), []
      for key, n, block in self._heap:
        if key == block.lru and self._qualifies(block) and id(block) not in seen:
          seen.add(id(block))
          kept.append((key, n, block))
      heapq.heapify(kept)
      self._heap = kept

  def clear(self) -> None:
    self._heap = []


class PrefixCache:
  """Blocks by digest, the snapshot free list, LRU eviction, hit statistics."""

  def __init__(self, pages: PagePool, block_size: int, snapshots: int):
    self.pages, self.block_size = pages, block_size
    self.blocks: dict[bytes, Block] = {}
    self.snapshots = snapshots
    self._snap_free = list(range(snapshots - 1, -1, -1))
    self._clock = 0
    self._order = itertools.count()
    self.queried_tokens = 0
    self.hit_tokens = 0
    self.epoch, self.root = 0, root(0)
    cached = lambda b: not b.detached and b.refs == 0
    self._leaves = _IdleHeap(lambda b: cached(b) and b.children == 0)   # evictable
    self._snapped = _IdleHeap(lambda b: cached(b) and b.snapshot is not None)  # reusable

  # ---- lookup --------------------------------------------------------------------------------
  def match(self, keys: Sequence[bytes], n: int) -> int:
    """How many of the first `n` blocks of a chain with these keys are cached (bisection: the
    cache holds every parent of a cached block)."""
    lo, hi = 0, n
    while lo < hi:
      mid = (lo + hi + 1) // 2
      if keys[mid - 1] in self.blocks:
        lo = mid
      else:
        hi = mid - 1
    return lo

  def restorable(self, keys: Sequence[bytes], n: int) -> list[Block]:
    """The longest cached chain of the first `n` blocks of `keys` that ends in a snapshot."""
    m = self.match(keys, n)
    while m and self.blocks[keys[m - 1]].snapshot is None:
      m -= 1
    return [self.blocks[k] for k in keys[:m]]

  def acquire(self, blocks: Sequence[Block]) -> None:
    self._clock += 1
    for b in blocks:
      b.refs += 1
      b.last_used = self._clock

  def release(self, blocks: Sequence[Block]) -> None:
    for b in blocks:
      b.refs -= 1
      if b.refs == 0:
        if b.detached:
          self._drop(b)
        else:
          self._leaves.push(b)
          self._snapped.push(b)
    self._leaves.compact(len(self.blocks))
    self._snapped.compact(len(self.blocks))

  def record(self, queried: int, hit: int) -> None:
    self.queried_tokens += queried
    self.hit_tokens += hit

  @property
  def hit_rate(self) -> float:
    return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

  # ---- insertion -----------------------------------------------------------------------------
  def register(self, parent: Block | None, digest: bytes, index: int, page: int) -> Block | None:
    """Cache the block keyed `digest` (its chain digest after `parent`) on `page`, held by its
    caller (refs 1). None when the same prefix is cached already (the caller keeps its page)."""
    if digest in self.blocks:
      return None
    block = Block(digest, page, parent, index, refs=1, last_used=self._clock,
                  order=next(self._order))
    if parent is not None:
      parent.children += 1
    self.blocks[digest] = block
    return block

  def set_snapshot(self, block: Block, snap: int) -> None:
    """`block` (cached, held or idle) keeps the KDA state after it in snapshot `snap`."""
    block.snapshot = snap
    self._snapped.push(block)

  def alloc_snapshot(self) -> int | None:
    """A free snapshot, taking one from the least recently used block no request holds."""
    if self._snap_free:
      return self._snap_free.pop()
    victim = self._snapped.pop()
    if victim is None:
      return None
    snap, victim.snapshot = victim.snapshot, None
    return snap

  def release_snapshot(self, snap: int) -> None:
    self._snap_free.append(snap)

  # ---- eviction ------------------------------------------------------------------------------
  def evict_one(self) -> bool:
    """Free the least recently used block that no request holds and no block continues."""
    victim = self._leaves.pop()
    if victim is None:
      return False
    del self.blocks[victim.digest]
    victim.detached = True
    self._drop(victim)
    return True

  def _drop(self, block: Block) -> None:
    self.pages.release(block.page)
    if block.snapshot is not None:
      self._snap_free.append(block.snapshot)
      block.snapshot = None
    if block.parent is not None:
      block.parent.children -= 1
      self._leaves.push(block.parent)

  def clear(self) -> None:
    """Forget every block and start the next weights epoch (new weights): idle blocks free
    their pages now, held ones when their last request lets go of them."""
    self.epoch += 1
    self.root = root(self.epoch)
    blocks = list(self.blocks.values())
    self.blocks.clear()
    self._leaves.clear()
    self._snapped.clear()
    for block in blocks:
      block.detached = True
    for block in sorted(blocks, key=lambda b: -b.index):  # children first
      if block.refs == 0:
        self._drop(block)
