"""The serving engine's sizes and switches (frozen: one engine, one compiled set of shapes)."""

from __future__ import annotations

import dataclasses
import math

from sharding.placement import batch_rows_ways
from sharding.rules import CONTEXT_AXIS

DEFAULT_MAX_MODEL_LEN = 8192


def bucket(n: int, cap: int) -> int:
  """The smallest power of two >= n, at most cap (a compiled shape)."""
  return min(cap, 1 << max(0, n - 1).bit_length())


def check_shards(data_shards: int, mesh, context_shards: int = 1) -> None:
  """ValueError unless `data_shards` pool shards divide over `mesh`'s batch axes (data x fsdp
  x expert), as they are placed: each device holds whole shards; and unless the pages'
  `context_shards` stripes are the mesh's `context` axis, one per device."""
  ways = batch_rows_ways(mesh)
  if data_shards > 1 and data_shards % ways:
    raise ValueError(f"data_shards {data_shards} do not divide over the mesh's {ways} devices "
                     "along data x fsdp x expert")
  context = dict(mesh.shape).get(CONTEXT_AXIS, 1)
  if context_shards != context:
    raise ValueError(f"context_shards {context_shards} must be the mesh's context axis "
                     f"({context} devices): a request's pages spread over it by position")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
  """Sizes of an engine; every shape it compiles derives from them.

  Attributes:
    max_num_seqs: request slots: the most requests running at once (each holds a KDA state).
    max_model_len: the most positions a request may reach (prompt + output).
    page_size: tokens per MLA latent page, and per prefix-cache block.
    num_pages: latent pages in the pool (None: enough for every slot at max_model_len).
    prefill_chunk: tokens per prefill row (a long prompt is fed in chunks of this size, so it
      never stalls the running requests for more than one chunk per step).
    prefill_rows: the most prompts (or chunks of them) per step beside the decode tokens (per
      shard, with data_shards); the step's token budget is max_num_seqs + data_shards *
      prefill_rows * prefill_chunk. A step compiles as
      many prefill rows as the prompts it reads, rounded up to a power of two (at most
      prefill_rows), so one waiting prompt does not pay for prefill_rows rows of padding.
    prefix_cache: reuse the latent pages and KDA states of full prompt blocks seen before.
    prefix_state_every: keep a KDA state snapshot every this many cached blocks (plus the last
      full block of each prompt): a hit restarts from the nearest snapshot at or before it.
    prefix_snapshots: KDA state snapshots held (each costs one slot's KDA state).
    max_top_logprobs: the most alternatives a request may ask for per token.
    min_decode_rows: the fewest decode rows a step compiles for (more, in powers of two up to
      max_num_seqs, as more requests decode): fewer programs for a small batch.
    min_context: the shortest attention context (positions) a step compiles for (longer ones
      in powers of two of pages, up to max_model_len).
    decode_steps: the most decode steps one call runs when a step reads no prompt (one jitted
      loop, no host round trip between its tokens; the static batch's decode block). It runs
      fewer when a request would reach its max_tokens or max_model_len sooner; tokens drawn
      after a request's stop are discarded. 1: one token per step.
    prefill_widths: how many prefill row widths the step compiles: prefill_chunk, and halves of
      it down to prefill_chunk / 2**(prefill_widths - 1); a step's prefill rows take the
      narrowest that holds its longest chunk, so a short prompt (or a prompt's last piece) does
      not pay for a whole chunk of padding. 1: always prefill_chunk.
    data_shards: the slot, snapshot and page pools split into this many equal shards, each
      with its own scratch slot, snapshot and page; a request lives on one shard, and a step's
      rows are laid out shard by shard (each shard's block padded alike), so under a mesh the
      mixers run under shard_map over the batch axes, every device reading only its own
      shards' pools (docs/serving.md, "Pools split over the batch axes"). max_num_seqs,
      num_pages and prefix_snapshots must divide by it. 1: one pool, whole on every device.
    context_shards: each shard's latent pages split by position over this many devices (the
      mesh's `context` axis): a request's page of block j lives on device j mod
      context_shards, each device attends over its own pages and the partial softmaxes merge
      by log-sum-exp, so one request may hold more positions than one device's pages
      (docs/serving.md, "Long requests"). num_pages must divide by data_shards x
      context_shards. 1: every page on every device of its shard.
    num_draft_tokens: speculative decoding (an engine with a drafter): the most draft tokens a
      request verifies per step (at most page_size).
    layout: "unstacked" holds per-layer weights (a copy of the model's stacks, made once; XLA:CPU
      copies a stacked weight's slice on every read) or "stacked" slices the caller's stacks
      inside the step (no copy: what RL needs, where the optimizer owns the arrays); None picks
      unstacked on CPU, stacked elsewhere.
  """

  max_num_seqs: int = 8
  max_model_len: int = DEFAULT_MAX_MODEL_LEN
  page_size: int = 64
  num_pages: int | None = None
  prefill_chunk: int = 256
  prefill_rows: int = 1
  prefix_cache: bool = True
  prefix_state_every: int = 4
  prefix_snapshots: int | None = None
  max_top_logprobs: int = 20
  min_decode_rows: int = 8
  min_context: int = 1024
  decode_steps: int = 1
  prefill_widths: int = 1
  data_shards: int = 1
  context_shards: int = 1
  num_draft_tokens: int = 0
  layout: str | None = None

  def __post_init__(self):
    for name in ("max_num_seqs", "max_model_len", "page_size", "prefill_chunk", "prefill_rows",
                 "prefix_state_every", "max_top_logprobs", "min_decode_rows", "min_context",
                 "decode_steps", "prefill_widths", "data_shards", "context_shards"):
      if getattr(self, name) <= 0:
        raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
    if self.num_pages is not None and self.num_pages < self.pages_per_seq:
      raise ValueError(f"num_pages {self.num_pages} cannot hold one request of max_model_len "
                       f"{self.max_model_len} ({self.pages_per_seq} pages of {self.page_size})")
    if self.prefix_snapshots is not None and self.prefix_snapshots < 0:
      raise ValueError(f"prefix_snapshots must be >= 0, got {self.prefix_snapshots}")
    d = self.data_shards
    for name, n in (("max_num_seqs", self.max_num_seqs), ("num_pages", self.pool_pages),
                    ("prefix_snapshots", self.snapshots)):
      if n % d:
        raise ValueError(f"{name} {n} does not divide into data_shards {d} equal shards")
    if self.pool_pages % (d * self.context_shards):
      raise ValueError(f"num_pages {self.pool_pages} does not divide into data_shards {d} x "
                       f"context_shards {self.context_shards} equal stripes")
    if d > 1 and self.pool_pages // d < self.pages_per_seq:
      raise ValueError(f"a shard's {self.pool_pages // d} pages (num_pages {self.pool_pages} / "
                       f"data_shards {d}) cannot hold one request of max_model_len "
                       f"{self.max_model_len}")
    if not 0 <= self.num_draft_tokens <= self.page_size:
      raise ValueError(f"num_draft_tokens must be in [0, page_size {self.page_size}], got "
                       f"{self.num_draft_tokens}")
    if self.layout not in (None, "stacked", "unstacked"):
      raise ValueError(f"unknown layout {self.layout!r}; choose stacked or unstacked")

  def prefill_width(self, longest: int) -> int:
    """The prefill row width of a step whose longest chunk has `longest` tokens."""
    width = self.prefill_chunk
    for _ in range(self.prefill_widths - 1):
      if width % 2 or width // 2 < longest:
        break
      width //= 2
    return width

  def prefill_row_count(self, prompts: int) -> int:
    """The prefill rows of a step that reads `prompts` prompts (a compiled shape)."""
    return bucket(prompts, self.prefill_rows)

  @property
  def prefill_row_counts(self) -> tuple[int, ...]:
    """Every prefill row count a step may compile: 1, 2, 4, ... up to prefill_rows."""
    return tuple(sorted({self.prefill_row_count(n) for n in range(1, self.prefill_rows + 1)}))

  @property
  def pages_per_seq(self) -> int:
    return math.ceil(self.max_model_len / self.page_size)

  @property
  def pool_pages(self) -> int:
    """Pages that hold tokens (the pool has one more: the scratch page 0)."""
    return self.num_pages if self.num_pages is not None else self.max_num_seqs * self.pages_per_seq

  @property
  def snapshots(self) -> int:
    if not self.prefix_cache:
      return 0
    return self.prefix_snapshots if self.prefix_snapshots is not None else 2 * self.max_num_seqs

  @property
  def shard_slots(self) -> int:
    """Request slots per shard (each shard has one more: its scratch slot)."""
    return self.max_num_seqs // self.data_shards

  @property
  def shard_pages(self) -> int:
    """Token pages per shard (each shard has one more: its scratch page 0)."""
    return self.pool_pages // self.data_shards

  @property
  def shard_snapshots(self) -> int:
    """KDA snapshots per shard (each shard has one more: its scratch snapshot)."""
    return self.snapshots // self.data_shards

  @property
  def token_budget(self) -> int:
    return self.max_num_seqs + self.data_shards * self.prefill_rows * self.prefill_chunk
