"""A request's logits processing that the host keeps: its grammar's token mask (structured
output), `min_tokens`, `logit_bias` and the presence / frequency / repetition penalties, and
the arrays a step's sampled rows carry to the device for them (`generate.sampling.Processing`).

Per request (`RowProcessing`), made when it is added: the grammar's matcher (advanced by every
token it draws), its output token counts and the tokens of its prompt (for the penalties),
updated in place per token. Per step (`StepProcessing`), for the rows that draw: the mask
words of every row (all bits set for a row without a mask) when any row has one, and the
penalty arrays of the rows that have penalties or a logit bias (bucketed to a power of two of
rows). A step with no such row carries nothing (and runs the program without them).

The mask is computed on the host for the token about to be drawn, so a row with a grammar, a
penalty or `min_tokens` still to reach draws one token per step: a step where such a row
decodes runs one token, not a decode block (docs/serving.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from k3jax.engine.config import bucket
from k3jax.engine.request import SamplingParams
from k3jax.generate.sampling import Penalties, Processing


def mask_words(vocab: int) -> int:
  return (vocab + 31) // 32


def clear_bits(words: np.ndarray, tokens) -> None:
  """Disallow `tokens` in one row of mask words."""
  bits = words.view(np.uint32)
  for t in tokens:
    bits[t // 32] &= np.uint32(~(1 << (t % 32)) & 0xFFFFFFFF)


class RowProcessing:
  """One request's host-side processing state (see the module docstring)."""

  def __init__(self, params: SamplingParams, prompt: Sequence[int], vocab: int,
               stop_ids: frozenset[int]):
    self.vocab, self.params = vocab, params
    self.matcher = params.grammar.matcher() if params.grammar is not None else None
    self.stops = sorted(stop_ids)
    self.penalized = bool(params.presence_penalty or params.frequency_penalty
                          or params.repetition_penalty != 1.0 or params.logit_bias)
    self.counts = np.zeros(vocab, np.int32) if self.penalized else None
    self.prompt_seen = np.zeros(vocab, bool) if self.penalized else None
    if self.penalized and params.repetition_penalty != 1.0:
      self.prompt_seen[np.asarray(prompt, np.int64)] = True
    bias = sorted(dict(params.logit_bias).items())
    self.bias_ids = np.asarray([t for t, _ in bias], np.int32)
    self.bias_values = np.asarray([v for _, v in bias], np.float64)
    self.drawn = 0  # tokens drawn so far (min_tokens)
    self.error: str | None = None

  @staticmethod
  def needed(params: SamplingParams) -> bool:
    return bool(params.grammar is not None or params.min_tokens or params.presence_penalty
                or params.frequency_penalty or params.repetition_penalty != 1.0
                or params.logit_bias)

  @property
  def masks(self) -> bool:
    """Whether the next draw is masked (a grammar, or stop tokens before min_tokens)."""
    return self.matcher is not None or self.drawn < self.params.min_tokens

  @property
  def per_token(self) -> bool:
    """Whether the next token's processing depends on the one before (no decode block)."""
    return self.masks or self.penalized

  def fill_mask(self, words: np.ndarray, address: int | None = None) -> None:
    """The allowed tokens of the next draw into one row of mask words (all set on entry;
    `address`: the row's data pointer)."""
    if self.matcher is not None:
      self.matcher.fill(words, address)
    if self.drawn < self.params.min_tokens:
      kept = words.copy()
      clear_bits(words, self.stops)
      if not words.any():  # the grammar allows nothing but a stop: it wins over min_tokens
        words[:] = kept

  def accept(self, token: int) -> None:
    """`token` was drawn: advance the grammar and the counts. A token the grammar refuses
    (it cannot be drawn through its mask) sets `error`."""
    self.drawn += 1
    if self.counts is not None:
      self.counts[token] += 1
    if self.matcher is not None and not self.matcher.accept(token):
      self.error = f"the grammar refused token {token}: {self.matcher.error()}"


class StepProcessing:
  """Builds each step's `Processing` for its sampled rows, reusing one mask buffer per row
  count (a step writes only its masked rows' words; the rows it wrote before are set back to
  all-allowed), so a masked row costs the step its mask computation and little else."""

  def __init__(self, vocab: int):
    self.vocab = vocab
    self._masks: dict[int, tuple[np.ndarray, int, list[int]]] = {}  # rows -> (buffer, its
    # data pointer, the rows written last)

  def __call__(self, states: list[RowProcessing | None]) -> Processing:
    """`states[i]`: row i's processing (None: none)."""
    masked = [i for i, s in enumerate(states) if s is not None and s.masks]
    mask = self._mask(states, masked) if masked else None
    rows = [i for i, s in enumerate(states) if s is not None and s.penalized]
    return Processing(mask, _penalties(states, rows, self.vocab) if rows else None)

  def _mask(self, states: list[RowProcessing | None], masked: list[int]) -> np.ndarray:
    m = len(states)
    if m not in self._masks:
      buffer = np.full((m, mask_words(self.vocab)), -1, np.int32)
      self._masks[m] = (buffer, buffer.ctypes.data, [])
    buffer, address, dirty = self._masks[m]
    for i in dirty:
      buffer[i] = -1
    for i in masked:
      states[i].fill_mask(buffer[i], address + i * buffer.strides[0])
    self._masks[m] = (buffer, address, masked)
    return buffer


def _penalties(states: list[RowProcessing | None], rows: list[int], vocab: int) -> Penalties:
  p = bucket(len(rows), len(states))
  b = bucket(max(len(states[i].bias_ids) for i in rows) or 1, 1 << 30)
  out = Penalties(rows=np.full(p, len(states), np.int32), bias_ids=np.zeros((p, b), np.int32),
                  bias_values=np.zeros((p, b), np.float64),
                  counts=np.zeros((p, vocab), np.int32), prompt_seen=np.zeros((p, vocab), bool),
                  presence=np.zeros(p, np.float64), frequency=np.zeros(p, np.float64),
                  repetition=np.ones(p, np.float64))
  for k, i in enumerate(rows):
    s, params = states[i], states[i].params
    out.rows[k] = i
    n = len(s.bias_ids)
    out.bias_ids[k, :n], out.bias_values[k, :n] = s.bias_ids, s.bias_values
    out.counts[k], out.prompt_seen[k] = s.counts, s.prompt_seen
    out.presence[k], out.frequency[k] = params.presence_penalty, params.frequency_penalty
    out.repetition[k] = params.repetition_penalty
  return out
