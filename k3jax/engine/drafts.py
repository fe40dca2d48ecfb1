"""Where speculative decoding's draft tokens come from (k3jax/engine/speculative.py verifies
them): prompt lookup (`NgramDrafter`, no weights) or a small model (`ModelDrafter`).

    drafter.propose(rows, limits) -> Drafts(tokens [R, K], counts [R], states)
    drafter.follow(parts, table, ctx_pages)   # a step the target ran without verifying
    drafter.commit(rows, drafts, accepted)     # after a verification

Prompt lookup proposes the tokens that followed the latest earlier occurrence of the request's
last n tokens (n from `max_n` down to `min_n`), as vLLM's `ngram` method: free, and strong on
repetitive text (code edits, retrieval, quoting the prompt). Each request keeps an index of
its n-grams, updated as tokens are appended, so a proposal costs the same at any length.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from k3jax.engine.scheduler import Chunk, Request


@dataclasses.dataclass
class Drafts:
  tokens: np.ndarray   # [R, K] int32
  counts: np.ndarray   # [R] int32: how many of a row's tokens are real drafts
  states: object = None  # the draft model's saved states (device), for `commit`


class NgramIndex:
  """A token list's n-grams (min_n <= n <= max_n) -> where the latest occurrence that has a
  token after it ends, extended as tokens are appended (each token costs max_n - min_n + 1
  dictionary writes)."""

  def __init__(self, min_n: int, max_n: int):
    self.min_n, self.max_n = min_n, max_n
    self.seen = 0  # tokens[:seen] are indexed (n-grams ending before seen - 1)
    self.ends: dict[tuple[int, ...], int] = {}

  def update(self, tokens: Sequence[int]) -> None:
    for end in range(max(self.seen - 1, 1), len(tokens)):  # an n-gram ending at end - 1,
      for n in range(self.min_n, min(self.max_n, end) + 1):  # followed by tokens[end]
        self.ends[tuple(tokens[end - n:end])] = end
    self.seen = len(tokens)

  def propose(self, tokens: Sequence[int], k: int) -> list[int]:
    """Up to k tokens after the latest earlier occurrence of the longest matching suffix."""
    self.update(tokens)
    for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
      end = self.ends.get(tuple(tokens[len(tokens) - n:]))
      if end is not None and end < len(tokens):
        return list(tokens[end:end + k])
    return []


class NgramDrafter:
  """Prompt lookup (`k3jax serve --draft ngram`)."""

  def __init__(self, k: int, min_n: int = 1, max_n: int = 4):
    self.k, self.min_n, self.max_n = k, min_n, max_n

  def propose(self, rows: list[Chunk | None], limits: np.ndarray, page_table: np.ndarray,
              ctx_pages: int) -> Drafts:
    del page_table, ctx_pages
    out = Drafts(np.zeros((len(rows), self.k), np.int32), np.zeros(len(rows), np.int32))
    for i, c in enumerate(rows):
      if c is None or limits[i] == 0:
        continue
      r = c.request
      if not isinstance(r.drafter_state, NgramIndex):
        r.drafter_state = NgramIndex(self.min_n, self.max_n)
      found = r.drafter_state.propose(r.tokens, int(limits[i]))
      out.tokens[i, :len(found)], out.counts[i] = found, len(found)
    return out

  def follow(self, parts, page_table, ctx_pages: int) -> None:
    del parts, page_table, ctx_pages

  def commit(self, rows, drafts: Drafts, accepted: np.ndarray) -> None:
    del rows, drafts, accepted

  def cache_lost(self) -> bool:
    return False

  def reset_cache(self) -> None:
    pass


class ModelDrafter:
  """A draft model on a `speculative.DraftRunner` (`k3jax serve --draft MODEL_DIR`): every
  row drafts `limits[i]` tokens of K (the model always drafts K; the rest are not verified)."""

  def __init__(self, runner, k: int):
    self.runner, self.k = runner, k
    self.rows_of = None  # rows -> (decode part, sample rows): the engine's arrays (it sets it)

  def propose(self, rows: list[Chunk | None], limits: np.ndarray, page_table: np.ndarray,
              ctx_pages: int) -> Drafts:
    part, sample_rows = self.rows_of(rows)
    tokens, states = self.runner.propose(part, page_table, sample_rows, limits, self.k,
                                            ctx_pages)
    return Drafts(tokens, np.asarray(limits, np.int32), states)

  def follow(self, parts, page_table, ctx_pages: int) -> None:
    self.runner.follow(parts, page_table, ctx_pages)

  def commit(self, rows: list[Chunk | None], drafts: Drafts, accepted: np.ndarray) -> None:
    slots = np.asarray([self.runner.config.max_num_seqs if c is None else c.request.slot
                        for c in rows], np.int32)
    self.runner.commit(slots, drafts.states, accepted)

  def cache_lost(self) -> bool:
    return self.runner.cache_lost()

  def reset_cache(self) -> None:
    self.runner.reset_cache()


def request_limit(r: Request, k: int, max_model_len: int) -> int:
  """How many drafts `r` may verify now: none for a request whose draws the host processes
  (a grammar, penalties: it cannot see past the next token) or that is held (its slot must
  stop exactly at its stop token); never past its max_tokens or the model's length."""
  if r.state is not None or r.hold:
    return 0
  room = min(r.params.max_tokens - r.output_len - 1, max_model_len - len(r.tokens) - 1)
  return max(0, min(k, room))
