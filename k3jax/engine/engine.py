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
import logging
import random
from collections.abc import Callable, Iterable, Sequence

import jax
import numpy as np
from flax import nnx

from k3jax.engine import speculative
from k3jax.engine.config import EngineConfig, bucket
from k3jax.engine.drafts import request_limit
from k3jax.engine.processing import RowProcessing, StepProcessing
from k3jax.engine.request import FinishReason, LogprobsMode, RequestOutput, SamplingParams
from k3jax.engine.runner import HELD_STOPS, Runner, SampleRows
from k3jax.engine.scheduler import Chunk, Request, Scheduler
from k3jax.generate.sampling import Sampling
from k3jax.model import paged

log = logging.getLogger("k3jax.engine")


def seed32(seed: int) -> int:
  """A request's seed folded to the 32 bits a PRNG key takes."""
  seed = int(seed) & (2**64 - 1)
  return (seed ^ (seed >> 32)) & 0xFFFFFFFF


class EngineDead(RuntimeError):
  """The engine cannot serve any more (a failed step it could not recover from)."""


class Engine:
  """Continuous batching over `model` (a K3Model, whose graph and current weights it uses).
  `mesh`: run every step on this device mesh (the model's weights placed on it, as
  `sharding.placement` puts them); the caches are placed by the rules table. `runner`: the
  device side to use instead of building one from `model` (whose `cfg` alone is read then):
  what a benchmark of the host side alone passes."""

  def __init__(self, model: nnx.Module, config: EngineConfig | None = None, *,
               eos_token_ids: Iterable[int] = (), detokenize: Callable[[list[int]], str]
               | None = None, seed: int = 0, mesh=None, runner=None,
               max_step_failures: int = 3, drafter=None):
    self.config = config or EngineConfig()
    self.cfg = model.cfg
    self.runner = runner if runner is not None else Runner(model, self.config, mesh)
    self.scheduler = Scheduler(self.config)
    self.drafter = drafter  # speculative decoding (k3jax/engine/drafts.py); None: off
    if drafter is not None:
      if not 0 < self.config.num_draft_tokens <= self.config.page_size:
        raise ValueError(f"num_draft_tokens must be in [1, page_size {self.config.page_size}] "
                         f"with a drafter, got {self.config.num_draft_tokens}")
      if self.config.data_shards != 1:
        raise ValueError("speculative decoding serves one pool (data_shards 1)")
      if hasattr(drafter, "rows_of"):
        drafter.rows_of = self._draft_rows
    self.spec_steps = self.spec_rows = self.spec_drafted = self.spec_emitted = 0
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
    self._processing_arrays = StepProcessing(self.cfg.vocab_size)
    self.max_step_failures = max_step_failures  # failed steps in a row that end the engine
    self.failures = 0
    self.failures_in_a_row = 0
    self.last_error: str | None = None

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
    if hold and sampling.grammar is not None:
      raise ValueError("a held request cannot follow a grammar")
    r = Request(request_id, prompt, len(prompt), sampling, next(self._seq), seed32(seed), stops,
                hold=hold)
    r.state = self._processing(r, sampling)
    self._requests[request_id] = r
    self.scheduler.waiting.append(r)
    self.prompt_tokens += len(prompt)

  def check(self, prompt_ids: Sequence[int], sampling: SamplingParams, *,
            after: int = 0) -> list[int]:
    """The prompt as a list of ints, or ValueError naming what `add` would refuse in it (an
    empty or too long prompt, out-of-range token ids or sampling values). It reads only the
    engine's fixed sizes, so a caller on another thread may check a request before handing it
    to the thread that steps the engine. `after`: tokens the request holds already (a held
    request's next turn: only the new ones are read, the length counts all)."""
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
      raise ValueError("the prompt is empty")
    vocab = self.cfg.vocab_size
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
      raise ValueError(f"prompt token ids {bad[:5]} outside the vocabulary [0, {vocab})")
    limit, n = self.config.max_model_len, after + len(prompt)
    if n > limit or (n == limit and sampling.max_tokens > 0):
      raise ValueError(f"the prompt has {n} tokens; the maximum model length is "
                       f"{limit} (prompt and output together)")
    sampling.check(vocab, self.config.max_top_logprobs)
    if sampling.stop and self.detokenize is None:
      raise ValueError("stop strings need an engine with a detokenizer")
    return prompt

  def _processing(self, r: Request, sampling: SamplingParams) -> RowProcessing | None:
    """The host-side processing state of `r` drawing under `sampling` (None: none)."""
    if not RowProcessing.needed(sampling):
      return None
    return RowProcessing(sampling, r.tokens, self.cfg.vocab_size, r.stop_ids)

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
    if r.hold and sampling.grammar is not None:
      raise ValueError("a held request cannot follow a grammar")
    if tokens:
      new = self.check(tokens, sampling, after=len(r.tokens))
    else:
      sampling.check(self.cfg.vocab_size, self.config.max_top_logprobs)
      new = None
    del self._paused[request_id]
    if new is not None:  # appended in place: the tokens before keep their block keys
      r.tokens.extend(new)
      r.prompt_len = len(r.tokens)
      r.prompt_logprobs = None
    turn = new is not None or sampling is not r.params  # a new turn: its own processing
    r.params, r.stop_ids, r.finish, r.text = sampling, self._stops(sampling), None, ""
    if turn:
      r.state = self._processing(r, sampling)
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
    """Run one step; the outputs of every request that produced tokens or ended in it.

    A step that raises fails the requests it ran (finish reason "error", the message in
    `error`) and gives back everything they held; the other requests go on (`_recover`).
    `EngineDead` when the engine cannot recover (the cache cannot be rebuilt, or
    `max_step_failures` steps failed in a row)."""
    outputs, self._aborted = self._aborted, []
    decode, prefill = self.scheduler.schedule()
    try:
      speculate = decode and not prefill and self.drafter is not None
      steps = self._block_steps(decode) if decode and not prefill and not speculate else 1
      if speculate and self._run_spec(decode):
        pass
      elif steps > 1:
        self._run_block(decode, steps)
        self.block_calls += 1
      elif decode or prefill:
        self._run(decode, prefill)
      self.steps += int(bool(decode or prefill))
      self.failures_in_a_row = 0
    except Exception as e:  # noqa: BLE001 - the step's requests fail; the engine goes on
      self._recover(decode + prefill, e)
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

  def _recover(self, chunks: list[Chunk], error: Exception) -> None:
    """After a step raised: its requests end with "error" and give back their slots and
    pages, the snapshots the step was to save are free again, and when the step's call took
    the cache with it (donated), the cache is rebuilt empty: every request holding state on
    the device then recomputes it (preempted), and the prefix cache starts over."""
    self.failures += 1
    self.failures_in_a_row += 1
    self.last_error = f"{type(error).__name__}: {error}"
    log.error("an engine step failed (%d in a row)", self.failures_in_a_row, exc_info=error)
    for c in chunks:
      if c.save is not None:
        self.scheduler.prefix(c.request).release_snapshot(c.save)
        c.save = None
    for r in dict.fromkeys(c.request for c in chunks):
      if r.finish is None and self._requests.get(r.id) is r:
        r.hold = False
        r.out().error = f"the engine step failed: {self.last_error}"
        self._finish(r, FinishReason.ERROR)
    try:
      draft_lost = self.drafter is not None and self.drafter.cache_lost()
      if self.runner.cache_lost() or draft_lost:
        self.runner.reset_cache()
        if self.drafter is not None:
          self.drafter.reset_cache()
        self.scheduler.drop_device_state()
    except Exception as e:  # reported as the engine's end
      raise EngineDead(f"the engine cannot rebuild its cache after a failed step "
                       f"({self.last_error}): {type(e).__name__}: {e}") from e
    if self.failures_in_a_row >= self.max_step_failures:
      raise EngineDead(f"{self.failures_in_a_row} engine steps failed in a row; the last: "
                       f"{self.last_error}") from error

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
    if self.drafter is not None:  # a draft model reads what the target read (lockstep)
      self.drafter.follow(tuple(parts), table, ctx_pages)
    for i, c in enumerate(rows):
      if c is None:
        continue
      r = c.request
      self.scheduler.advance(c)
      self.computed_tokens += c.end - c.start
      if r.params.prompt_logprobs and r.prompt_logprobs is None and r.prompt_len == 1:
        r.prompt_logprobs = r.out().prompt_logprobs = [None]  # one token: nothing to score
      if c.samples and r.finish is None and r.params.max_tokens > 0:
        self._accept(r, out, i)
    if want_prompt:
      self._prompt_logprobs(laid[-1], out, width)

  def _pages(self, chunks: list[Chunk], extra: int = 0) -> tuple[int, np.ndarray]:
    """(the step's attention context in pages, bucketed; the page table), for `chunks` and
    `extra` positions after each. The scheduler keeps the table as pages come and go; the
    step gets a copy (its fixed size, not the context, sets the cost)."""
    config = self.config
    longest = max([c.end + extra for c in chunks] + [config.min_context])
    ctx_pages = bucket(-(-longest // config.page_size), config.pages_per_seq)
    return ctx_pages, self.scheduler.table.copy()

  def _block_steps(self, decode: list[Chunk]) -> int:
    """How many decode steps the next call may run: up to `decode_steps`, none past a
    request's max_tokens or max_model_len, and pages for all of them (from free pages or idle
    prefix-cache blocks, never by preempting); 1 when a prompt is being read."""
    config = self.config
    if any(c.request.state is not None and c.request.state.per_token for c in decode):
      return 1  # its mask or penalties depend on the token before: one token per step
    steps = min([config.decode_steps]
                + [c.request.params.max_tokens - c.request.output_len for c in decode]
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

  # ---- speculative decoding (k3jax/engine/speculative.py) ------------------------------------
  def _run_spec(self, decode: list[Chunk]) -> bool:
    """A verification step: each decoding request's last token and its drafts in one row;
    False (nothing run) when no request has a draft to verify."""
    config, k = self.config, self.config.num_draft_tokens
    rows = self._decode_layout(decode)
    limits = np.zeros(len(rows), np.int32)
    for i, c in enumerate(rows):
      if c is not None:
        limits[i] = request_limit(c.request, k, config.max_model_len)
        if limits[i] and not self.scheduler.reserve([c], int(limits[i]) + 1):
          limits[i] = 0  # no pages for its drafts: it verifies none
    if not limits.any():
      return False
    ctx_pages, table = self._pages(decode, k)
    drafts = self.drafter.propose(rows, limits, table, ctx_pages)
    counts = np.minimum(drafts.counts, limits)
    if not counts.any() and drafts.states is None:
      return False
    part = self._spec_part(rows, drafts.tokens, counts)
    sample_rows = self._sample_rows(rows, list(range(len(rows))))
    out = speculative.verify(self.runner, part, table, sample_rows, counts, ctx_pages)
    if drafts.states is not None:
      self.drafter.commit(rows, drafts, out.accepted)
    self.spec_steps += 1
    for i, c in enumerate(rows):
      if c is not None:
        self._emit_verified(c, out, i, int(counts[i]))
    return True

  def _emit_verified(self, c: Chunk, out, i: int, drafted: int) -> None:
    """Row i's verified tokens: the drafts kept are in its cache now; each token emitted is
    taken as a one-token step takes it (a stop ends the request there)."""
    r, kept = c.request, int(out.accepted[i])
    self.scheduler.advance(Chunk(r, c.start, c.end + kept))
    self.computed_tokens += kept + 1
    self.spec_rows += int(drafted > 0)
    self.spec_drafted += drafted
    self.spec_emitted += (kept + 1) * int(drafted > 0)
    for j in range(kept + 1):
      if r.finish is not None:
        break
      self._accept(r, _Column(out, j), i)
    if r.finish is None:
      self.scheduler.trim(r)

  def _spec_part(self, rows: list[Chunk | None], drafts: np.ndarray, counts: np.ndarray
                 ) -> paged.Rows:
    """The verification part: each row's last token then its drafts, at the next positions."""
    part = self._rows(rows, 1, decode=True)
    k1 = drafts.shape[1] + 1
    ids = np.concatenate([part.ids, drafts], axis=1)
    positions = part.positions + np.arange(k1, dtype=np.int32)
    valid = part.valid & (np.arange(k1) <= counts[:, None])
    return part._replace(ids=ids, positions=positions, valid=valid)

  def _draft_rows(self, rows: list[Chunk | None]) -> tuple[paged.Rows, SampleRows]:
    """A draft model's inputs for the decoding `rows`: their last tokens and how they draw."""
    sample_rows = self._sample_rows(rows, list(range(len(rows))), processing=False)
    return self._rows(rows, 1, decode=True), sample_rows

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

  def _sample_rows(self, rows: list[Chunk | None], index: list[int],
                   processing: bool = True) -> SampleRows:
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
    states = [c.request.state if c is not None and c.samples and processing else None
              for c in rows]
    return SampleRows(np.asarray(index, np.int32), Sampling(temp, top_k, top_p, min_p), seed,
                      position, logprob_temp, processed, self._processing_arrays(states))

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
    r.tokens.append(tok)
    self.generated_tokens += 1
    o = r.out()
    o.token_ids.append(tok)
    if r.params.logprobs is not None:
      o.logprobs.append(float(out.logprob[i]))
      o.top_logprobs.append(self._top(out.top_ids[i], out.top_logprobs[i], r.params.logprobs))
    if self.detokenize is not None:
      r.text = self.detokenize(r.output)
      o.text = r.text
    if r.state is not None:
      r.state.accept(tok)
      if r.state.error is not None:
        o.error = r.state.error
        r.hold = False
        self._finish(r, FinishReason.ERROR)
        return
    if tok in r.stop_ids:
      self._finish(r, FinishReason.STOP)
    elif r.params.stop and r.output_len > r.params.min_tokens and self._cut_at_stop(r):
      self._finish(r, FinishReason.STOP)
    elif r.output_len >= r.params.max_tokens or len(r.tokens) >= self.config.max_model_len:
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
        if p >= r.prompt_len or p < len(r.prompt_logprobs):
          continue
        k = i * width + j
        r.prompt_logprobs.append((float(out.prompt_logprob[k]),
                                  self._top(out.prompt_top_ids[k], out.prompt_top_logprobs[k], n)))
      if len(r.prompt_logprobs) == r.prompt_len:
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
            "decode_blocks": self.block_calls, "spec_steps": self.spec_steps,
            "spec_drafted_tokens": self.spec_drafted, "spec_emitted_tokens": self.spec_emitted,
            "mean_accepted_length": self.mean_accepted_length}

  @property
  def mean_accepted_length(self) -> float:
    """Tokens emitted per verified row that had drafts (the drafts kept, plus the one drawn
    after them): 1 means no draft was ever kept."""
    return self.spec_emitted / self.spec_rows if self.spec_rows else 0.0


class _Column:
  """Position j of a verification's outputs ([R, K + 1] fields) as a one-token step's ([R])."""

  def __init__(self, out, j: int):
    self.tokens, self.logprob = out.tokens[:, j], out.logprob[:, j]
    self.top_ids, self.top_logprobs = out.top_ids[:, j], out.top_logprobs[:, j]
