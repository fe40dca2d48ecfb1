"""The serving engine: continuous batching over one model.

    engine = Engine(model, EngineConfig(...), eos_token_ids=..., detokenize=...)
    engine.add("a", prompt_ids, SamplingParams(max_tokens=64))
    while engine.has_work():
        for out in engine.step():       # RequestOutput per request that advanced
            ...
    engine.abort("b"); engine.set_params(new_state)
    engine.pause("c"); ...; engine.resume("c")             # a partial rollout, continued
    engine.add("t", ids, params, hold=True)                 # a multi-turn trajectory:
    ...; engine.resume("t", tokens=observation_ids)         #   its next turn, prefilling
                                                            #   only the new tokens

Requests join and leave between steps; each step is one jitted call (k3jax/engine/runner.py)
over the decode tokens of every running request and a chunk of the oldest prompts still being
read (k3jax/engine/scheduler.py). The engine does not own the weights: `set_params` takes a new
parameter state of the same model graph (LoRA adapters included: they apply unmerged, as the
model computes them) and empties the prefix cache, whose entries were computed with the old
ones, and starts the next weights epoch (`weights_epoch`): a request running across the switch
never lets a later one reuse a block it computed. docs/serving.md describes the design and its
guarantees.

Pausing: `pause(id)` takes a request out of the schedule between steps, keeping its slot,
latent pages and KDA state; `resume(id)` continues it where it stopped (the same tokens and
logprobs as if never paused, when the weights did not change; its draws are keyed by seed and
position), or `resume(id, recompute=True)` reads it again from its first token under the
current weights. A request added with `hold=True` pauses instead of ending when it finishes
(its finish is reported as usual), so `resume(id, tokens=...)` can append tokens (a tool's
result) and continue generating: each turn computes only its new tokens. `release(id)` frees a
paused request. When a slot or page is needed and none is free, a paused request gives its own
up first (preempted: it is read again on resume, under the weights of that time).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterable, Sequence

import jax
import numpy as np
from flax import nnx

from k3jax.engine.config import EngineConfig, bucket
from k3jax.engine.request import FinishReason, LogprobsMode, RequestOutput, SamplingParams
from k3jax.engine.runner import HELD_STOPS, Runner, SampleRows
from k3jax.engine.scheduler import Chunk, Request, Scheduler
from k3jax.generate.sampling import Sampling
from k3jax.model import paged


def seed32(seed: int) -> int:
  """A request's seed folded to the 32 bits a PRNG key takes."""
  seed = int(seed) & (2**64 - 1)
  return (seed ^ (seed >> 32)) & 0xFFFFFFFF


class Engine:
  """Continuous batching over `model` (a K3Model, whose graph and current weights it uses).
  `mesh`: run every step on this device mesh (the model's weights placed on it, as
  `sharding.placement` puts them); the caches are placed by the rules table."""

  def __init__(self, model: nnx.Module, config: EngineConfig | None = None, *,
               eos_token_ids: Iterable[int] = (), detokenize: Callable[[list[int]], str]
               | None = None, seed: int = 0, mesh=None):
    self.config = config or EngineConfig()
    self.cfg = model.cfg
    self.runner = Runner(model, self.config, mesh)
    self.scheduler = Scheduler(self.config)
    self.eos = frozenset(int(t) for t in eos_token_ids)
    self.detokenize = detokenize
    self._requests: dict[str, Request] = {}
    self._paused: dict[str, Request] = {}
    self._aborted: list[RequestOutput] = []
    self._seq = itertools.count()
    self._rng = random.Random(seed)
    self.steps = 0
    self.block_calls = 0  # steps that ran a decode block of more than one token
    self.generated_tokens = 0
    self.prompt_tokens = 0
    self.computed_tokens = 0  # tokens run through the model (prefill and decode rows)

  # ---- requests ------------------------------------------------------------------------------
  def add(self, request_id: str, prompt_ids: Sequence[int], sampling: SamplingParams | None = None,
          *, hold: bool = False) -> None:
    """Queue a request. Raises ValueError (naming the problem) for a duplicate id, an empty or
    too long prompt, out-of-range token ids or sampling values; nothing else is affected.
    `hold`: when it finishes, pause it with its state kept (module docstring) until
    `resume` or `release`."""
    sampling = sampling or SamplingParams()
    if request_id in self._requests or request_id in self._paused:
      raise ValueError(f"request id {request_id!r} is already in use")
    prompt = self.check(prompt_ids, sampling)
    seed = sampling.seed if sampling.seed is not None else self._rng.getrandbits(32)
    stops = self._stops(sampling)
    if hold and len(stops) > HELD_STOPS:
      raise ValueError(f"a held request takes at most {HELD_STOPS} stop token ids, got "
                       f"{len(stops)}")
    r = Request(request_id, prompt, sampling, next(self._seq), seed32(seed), stops, hold=hold)
    self._requests[request_id] = r
    self.scheduler.waiting.append(r)
    self.prompt_tokens += len(prompt)

  def check(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> list[int]:
    """The prompt as a list of ints, or ValueError naming what `add` would refuse in it (an
    empty or too long prompt, out-of-range token ids or sampling values). It reads only the
    engine's fixed sizes, so a caller on another thread may check a request before handing it
    to the thread that steps the engine."""
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
      raise ValueError("the prompt is empty")
    vocab = self.cfg.vocab_size
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
      raise ValueError(f"prompt token ids {bad[:5]} outside the vocabulary [0, {vocab})")
    limit = self.config.max_model_len
    if len(prompt) > limit or (len(prompt) == limit and sampling.max_tokens > 0):
      raise ValueError(f"the prompt has {len(prompt)} tokens; the maximum model length is "
                       f"{limit} (prompt and output together)")
    sampling.check(vocab, self.config.max_top_logprobs)
    if sampling.stop and self.detokenize is None:
      raise ValueError("stop strings need an engine with a detokenizer")
    return prompt

  def _stops(self, sampling: SamplingParams) -> frozenset[int]:
    return frozenset(sampling.stop_token_ids) | (frozenset() if sampling.ignore_eos else self.eos)

  def abort(self, request_id: str) -> None:
    """End a request now, running or paused (its pages and slot are freed); an unknown id is a
    no-op. The next `step()` reports it with finish reason "abort"."""
    r = self._requests.pop(request_id, None) or self._paused.pop(request_id, None)
    if r is None:
      return
    if r in self.scheduler.waiting:
      self.scheduler.waiting.remove(r)
    self.scheduler.release(r)
    out = r.out()
    out.finish_reason = FinishReason.ABORT
    self._aborted.append(out)
    r.pending = None

  def has_work(self) -> bool:
    """Whether a step has anything to run or report (paused requests wait for resume)."""
    return bool(self._requests or self._aborted)

  # ---- pausing -------------------------------------------------------------------------------
  def pause(self, request_id: str) -> None:
    """Take a running or waiting request out of the schedule, its state kept (between steps);
    KeyError for an id that is not running."""
    r = self._requests.pop(request_id, None)
    if r is None:
      raise KeyError(f"no running request {request_id!r}")
    self.scheduler.pause(r)
    self._paused[request_id] = r

  def resume(self, request_id: str, tokens: Sequence[int] = (),
             sampling: SamplingParams | None = None, *, recompute: bool = False) -> None:
    """Put a paused request back. `tokens`: appended after everything it has so far (a held
    request's next turn: they and its last drawn token are read, then it generates anew;
    `max_tokens` then counts this turn's output alone); `sampling`: how it samples from now on
    (default: as before); `recompute`: read it again from its first token under the current
    weights instead of continuing the state it kept. ValueError (nothing changed) for tokens
    outside the vocabulary, a result past max_model_len, or bad sampling values."""
    r = self._paused.get(request_id)
    if r is None:
      raise KeyError(f"no paused request {request_id!r}")
    sampling = sampling or r.params
    if r.hold and len(self._stops(sampling)) > HELD_STOPS:
      raise ValueError(f"a held request takes at most {HELD_STOPS} stop token ids")
    if tokens:
      prompt = self.check(r.tokens + [int(t) for t in tokens], sampling)
    else:
      sampling.check(self.cfg.vocab_size, self.config.max_top_logprobs)
      prompt = None
    del self._paused[request_id]
    if prompt is not None:
      r.prompt, r.output = prompt, []
      r.prompt_logprobs = None
    r.params, r.stop_ids, r.finish, r.text = sampling, self._stops(sampling), None, ""
    self.scheduler.resume(r, recompute)
    self._requests[request_id] = r

  def release(self, request_id: str) -> None:
    """Free a paused request (nothing is reported); an unknown id is a no-op."""
    r = self._paused.pop(request_id, None)
    if r is not None:
      self.scheduler.release(r)

  @property
  def weights_epoch(self) -> int:
    """How many times the weights were replaced (`set_params`)."""
    return self.scheduler.epoch

  def set_params(self, state) -> None:
    """New weights for the same model graph (an nnx.State); empties the prefix cache and
    starts the next weights epoch (module docstring). Requests running or paused keep the
    state they computed so far."""
    self.runner.set_params(state)
    self.scheduler.clear_prefix()

  # ---- one step ------------------------------------------------------------------------------
  def step(self) -> list[RequestOutput]:
    """Run one step; the outputs of every request that produced tokens or ended in it."""
    outputs, self._aborted = self._aborted, []
    decode, prefill = self.scheduler.schedule()
    steps = self._block_steps(decode) if decode and not prefill else 1
    if steps > 1:
      self._run_block(decode, steps)
      self.steps += 1
      self.block_calls += 1
    elif decode or prefill:
      self._run(decode, prefill)
      self.steps += 1
    for r in list(self._requests.values()):
      if r.finish is None and r.to_feed == 0:  # max_tokens 0: the prompt was all it asked for
        self._finish(r, FinishReason.LENGTH)
      if r.pending is not None:
        outputs.append(r.pending)
        r.pending = None
      if r.finish is not None:
        del self._requests[r.id]
        if r.paused:  # held: it waits for its next turn
          self._paused[r.id] = r
    return outputs

  def _layout(self, chunks: list[Chunk], least: int, cap: int) -> list[Chunk | None]:
    """`chunks` as a part's rows: data_shards equal blocks, block s holding shard s's chunks
    in order then padding (None), each of n rows: a power of two, at least `least` and the
    most chunks of any shard, at most `cap` (a compiled shape)."""
    by_shard = [[c for c in chunks if c.request.shard == s]
                for s in range(self.config.data_shards)]
    n = bucket(max([len(b) for b in by_shard] + [least]), cap)
    return [b[i] if i < len(b) else None for b in by_shard for i in range(n)]

  def _decode_layout(self, decode: list[Chunk]) -> list[Chunk | None]:
    # the decode part is always there (a prefill-only step is one more program otherwise)
    config = self.config
    return self._layout(decode, -(-config.min_decode_rows // config.data_shards),
                        config.shard_slots)

  def _run(self, decode: list[Chunk], prefill: list[Chunk]) -> None:
    config = self.config
    laid = [self._decode_layout(decode)]
    parts = [self._rows(laid[0], 1, decode=True)]
    width = config.prefill_width(max((c.end - c.start for c in prefill), default=1))
    if prefill:
      laid.append(self._layout(prefill, 1, config.prefill_rows))
      parts.append(self._rows(laid[1], width))
    ctx_pages, table = self._pages(decode + prefill)
    # where each token's features are (paged.forward: shard by shard, then part by part)
    widths, shards = tuple(part.ids.shape for part in parts), config.data_shards
    rows, index = [], []
    for p, cs in enumerate(laid):
      for i, c in enumerate(cs):
        rows.append(c)
        index.append(paged.token_index(widths, shards, p, i, c.end - c.start - 1 if c else 0))
    sample_rows = self._sample_rows(rows, index)
    want_prompt = [c for c in prefill if c.request.params.prompt_logprobs]
    targets = None
    if want_prompt:  # every prefill position, row-major, and where its features are
      starts = [paged.token_index(widths, shards, 1, i, 0) for i in range(len(laid[-1]))]
      targets = (self._targets(laid[-1], width),
                 (np.asarray(starts, np.int32)[:, None] + np.arange(width, dtype=np.int32))
                 .reshape(-1))
    out = self.runner.step(tuple(parts), table, sample_rows, targets, ctx_pages)
    for i, c in enumerate(rows):
      if c is None:
        continue
      r = c.request
      self.scheduler.advance(c)
      self.computed_tokens += c.end - c.start
      if r.params.prompt_logprobs and r.prompt_logprobs is None and len(r.prompt) == 1:
        r.prompt_logprobs = r.out().prompt_logprobs = [None]  # one token: nothing to score
      if c.samples and r.finish is None and r.params.max_tokens > 0:
        self._accept(r, out, i)
    if want_prompt:
      self._prompt_logprobs(laid[-1], out, width)

  def _pages(self, chunks: list[Chunk], extra: int = 0) -> tuple[int, np.ndarray]:
    """(the step's attention context in pages, bucketed; the page table), for `chunks` and
    `extra` positions after each."""
    config = self.config
    longest = max([c.end + extra for c in chunks] + [config.min_context])
    ctx_pages = bucket(-(-longest // config.page_size), config.pages_per_seq)
    # shard by shard: shard_slots rows of its slots' pages (ids in its pool), then its scratch
    n = config.shard_slots
    table = np.zeros((config.data_shards * (n + 1), config.pages_per_seq), np.int32)
    for r in self.scheduler.running:
      table[r.shard * (n + 1) + r.slot % n, :len(r.pages)] = r.pages
    return ctx_pages, table

  def _block_steps(self, decode: list[Chunk]) -> int:
    """How many decode steps the next call may run: up to `decode_steps`, none past a
    request's max_tokens or max_model_len, and pages for all of them (from free pages or idle
    prefix-cache blocks, never by preempting); 1 when a prompt is being read."""
    config = self.config
    steps = min([config.decode_steps]
                + [c.request.params.max_tokens - len(c.request.output) for c in decode]
                + [config.max_model_len - len(c.request.tokens) for c in decode])
    if steps <= 1 or not self.scheduler.reserve(decode, steps):
      return 1
    return steps

  def _run_block(self, decode: list[Chunk], steps: int) -> None:
    """`steps` decode steps of every decoding request in one call; each token is taken as a
    one-step run would take it, and a request's tokens after it finished are dropped."""
    config = self.config
    rows = self._decode_layout(decode)
    part = self._rows(rows, 1, decode=True)
    ctx_pages, table = self._pages(decode, steps - 1)
    sample_rows = self._sample_rows(rows, list(range(len(rows))))
    held_stops = np.full((len(rows), HELD_STOPS), -1, np.int32)
    for i, c in enumerate(rows):
      if c is not None and c.request.hold:
        stops = sorted(c.request.stop_ids)
        held_stops[i, :len(stops)] = stops
    out = self.runner.decode_block(part, table, sample_rows, held_stops, steps,
                                   config.decode_steps, ctx_pages)
    for j in range(steps):
      out_j = jax.tree.map(lambda a, j=j: a[j], out)
      for i, c in enumerate(rows):
        if c is None or c.request.finish is not None:
          continue
        r = c.request
        self.scheduler.advance(Chunk(r, c.start + j, c.end + j))
        self.computed_tokens += 1
        self._accept(r, out_j, i)
        if r.paused and j < steps - 1 and out_j.tokens[i] not in r.stop_ids:
          # held, ended by a stop string inside the block: its slot has run past its tokens
          # (only stop tokens end a row on the device), so it is read again on resume
          self.scheduler.preempt(r)

  def _rows(self, chunks: list[Chunk | None], width: int, decode: bool = False) -> paged.Rows:
    """A part's arrays for its laid-out rows (`_layout`), with ids local to each row's shard:
    slot (its scratch slot: no request) and snapshots (its scratch snapshot: none saved).
    decode: every row continues its slot and saves nothing (the scheduler's decode chunks),
    so the part carries no source, restore or save and its steps touch no snapshot."""
    n_slots, scratch_snap = self.config.shard_slots, self.config.shard_snapshots
    n_rows = len(chunks)
    ids = np.zeros((n_rows, width), np.int32)
    pos = np.zeros((n_rows, width), np.int32)
    valid = np.zeros((n_rows, width), bool)
    slot = np.full((n_rows,), n_slots, np.int32)
    source = np.full((n_rows,), paged.FROM_SLOT, np.int32)
    restore = np.zeros((n_rows,), np.int32)
    save = np.full((n_rows,), scratch_snap, np.int32)
    for i, c in enumerate(chunks):
      if c is None:
        continue
      r, n = c.request, c.end - c.start
      ids[i, :n] = r.tokens[c.start:c.end]
      pos[i, :n] = np.arange(c.start, c.end)
      valid[i, :n] = True
      slot[i], source[i], restore[i] = r.slot % n_slots, r.source, r.restore
      if c.save is not None:
        save[i] = c.save
    if decode:
      if (source != paged.FROM_SLOT).any() or (save != scratch_snap).any():
        raise RuntimeError("a decode row that does not continue its slot (scheduler bug)")
      return paged.Rows(ids, pos, valid, slot, None, None, None)
    return paged.Rows(ids, pos, valid, slot, source, restore, save)

  def _sample_rows(self, rows: list[Chunk | None], index: list[int]) -> SampleRows:
    m = len(rows)
    temp, top_p, min_p = (np.zeros(m, np.float32), np.ones(m, np.float32),
                          np.zeros(m, np.float32))
    top_k, seed, position = (np.zeros(m, np.int32), np.zeros(m, np.uint32),
                             np.zeros(m, np.int32))
    # float64 on the host: the device rounds it to the logits' wide dtype, as a trainer
    # dividing its own logits by the same temperature does
    logprob_temp, processed = np.ones(m, np.float64), np.zeros(m, bool)
    for i, c in enumerate(rows):
      if c is None:
        continue
      p = c.request.params
      temp[i], top_p[i], min_p[i] = p.temperature, p.top_p, p.min_p
      top_k[i] = max(p.top_k, 0)
      seed[i], position[i] = c.request.seed, c.end
      if p.logprobs_mode == LogprobsMode.PROCESSED and p.temperature > 0:
        logprob_temp[i], processed[i] = p.temperature, True
    return SampleRows(np.asarray(index, np.int32), Sampling(temp, top_k, top_p, min_p), seed,
                      position, logprob_temp, processed)

  def _targets(self, prefill: list[Chunk | None], width: int) -> np.ndarray:
    """The next prompt token of every prefill position (0 where there is none)."""
    out = np.zeros((len(prefill), width), np.int32)
    for i, c in enumerate(prefill):
      if c is None:
        continue
      nxt = c.request.tokens[c.start + 1:c.end + 1]
      out[i, :len(nxt)] = nxt
    return out.reshape(-1)

  # ---- results -------------------------------------------------------------------------------
  def _top(self, ids, lps, n: int | None) -> dict[int, float]:
    """The n most likely ids and their logprobs (those a processed row's filters removed, at
    -inf, are left out)."""
    if not n:
      return {}
    return {int(t): float(v) for t, v in zip(ids[:n], lps[:n]) if np.isfinite(v)}

  def _accept(self, r: Request, out, i: int) -> None:
    tok = int(out.tokens[i])
    r.output.append(tok)
    self.generated_tokens += 1
    o = r.out()
    o.token_ids.append(tok)
    if r.params.logprobs is not None:
      o.logprobs.append(float(out.logprob[i]))
      o.top_logprobs.append(self._top(out.top_ids[i], out.top_logprobs[i], r.params.logprobs))
    if self.detokenize is not None:
      r.text = self.detokenize(r.output)
      o.text = r.text
    if tok in r.stop_ids:
      self._finish(r, FinishReason.STOP)
    elif r.params.stop and self._cut_at_stop(r):
      self._finish(r, FinishReason.STOP)
    elif len(r.output) >= r.params.max_tokens or len(r.tokens) >= self.config.max_model_len:
      self._finish(r, FinishReason.LENGTH)

  def _cut_at_stop(self, r: Request) -> bool:
    hits = [i for i in (r.text.find(s) for s in r.params.stop) if i >= 0]
    if not hits:
      return False
    r.text = r.text[:min(hits)]
    r.out().text = r.text
    return True

  def _prompt_logprobs(self, prefill: list[Chunk | None], out, width: int) -> None:
    for i, c in enumerate(prefill):
      if c is None:
        continue
      r = c.request
      if not r.params.prompt_logprobs:
        continue
      if r.prompt_logprobs is None:
        r.prompt_logprobs = [None]
      n = r.params.logprobs or 0
      for j in range(c.end - c.start):
        p = c.start + j + 1               # the prompt position this row position scores
        if p >= len(r.prompt) or p < len(r.prompt_logprobs):
          continue
        k = i * width + j
        r.prompt_logprobs.append((float(out.prompt_logprob[k]),
                                  self._top(out.prompt_top_ids[k], out.prompt_top_logprobs[k], n)))
      if len(r.prompt_logprobs) == len(r.prompt):
        r.out().prompt_logprobs = r.prompt_logprobs

  def _finish(self, r: Request, reason: FinishReason) -> None:
    r.finish = reason
    r.out().finish_reason = reason
    if r.hold:
      self.scheduler.pause(r)
    else:
      self.scheduler.release(r)

  # ---- state for metrics and tests --------------------------------------------------------------
  @property
  def num_running(self) -> int:
    return len(self.scheduler.running)

  @property
  def num_waiting(self) -> int:
    return len(self.scheduler.waiting)

  def stats(self) -> dict[str, float]:
    s = self.scheduler
    return {"running": len(s.running), "waiting": len(s.waiting),
            "pages_used": s.pages_used, "pages_total": s.pages_total,
            "cached_blocks": len(s.cached_blocks), "prefix_hit_rate": s.hit_rate,
            "preemptions": s.preemptions, "generated_tokens": self.generated_tokens,
            "prompt_tokens": self.prompt_tokens, "computed_tokens": self.computed_tokens,
            "paused": len(self._paused), "weights_epoch": self.weights_epoch, "steps": self.steps,
            "decode_blocks": self.block_calls}
