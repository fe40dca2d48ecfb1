"""The serving engine's host side alone: what a step costs the CPU that drives the device.

    python benchmarks/serve_host.py                 # both sections
    python benchmarks/serve_host.py --quick --json  # fewer steps
    python benchmarks/serve_host.py --tokenizer K2_FOLDER   # (b) on Kimi's own 163,840 tokens

The device is replaced by a stub runner that returns arrays of the step's shapes at once, so
each `Engine.step()` times the scheduler, the step's host arrays, the outputs' bookkeeping and
(b) the token masks: everything the engine does on the host per step.

  (a) scheduler: 8 requests decoding at 8K and at 512K tokens of context each (prompts read
      first through the prefix cache's chunking and snapshots, then one token per step), the
      median host time per step at each. Goal: within 1.2x (host work per step grows with the
      rows, not with the context).
  (b) token masks at a vocabulary of 163,840: 8 rows decoding, none or one of them under a JSON
      schema (`response_format`) whose mask the grammar library computes on the host each step;
      the median host time per step with and without it. Goal: the masked row adds at most 20%.

The last line with --json is one JSON object (scheduler_host_ratio, mask_host_overhead, ...).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
import types

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np

from k3jax.engine import Engine, EngineConfig, SamplingParams
from k3jax.engine.runner import StepOut
from k3jax.tokenizer import load_tokenizer
from k3jax.tokenizer.grammar import Vocabulary, json_lark

SLOTS = 8
CONTEXTS = (8 * 1024, 512 * 1024)


class StubRunner:
  """The device side of a step, answered at once: every sampled row draws a token from its
  seed and position (never a stop token: no EOS is set) with zero logprobs."""

  def __init__(self, config: EngineConfig, vocab: int):
    self.config, self.vocab = config, vocab
    self.top_n = min(config.max_top_logprobs, vocab)

    self.seconds = 0.0  # time spent here (the device's part: not the host's)

  def _out(self, seed: np.ndarray, position: np.ndarray, mask=None) -> StepOut:
    m = len(seed)
    tokens = ((seed.astype(np.int64) * 7919 + position * 104729) % self.vocab).astype(np.int32)
    if mask is not None:  # a masked row draws one of its allowed tokens, as the device would
      for i in range(m):
        words = np.flatnonzero(mask[i])
        if len(words) < mask.shape[1]:
          w = int(words[tokens[i] % len(words)])
          bits = int(mask[i, w]) & 0xFFFFFFFF
          tokens[i] = 32 * w + (bits & -bits).bit_length() - 1  # its lowest allowed token
    return StepOut(tokens, np.zeros(m), np.zeros((m, self.top_n), np.int32),
                   np.zeros((m, self.top_n)), None, None, None)

  def step(self, parts, page_table, rows, targets, ctx_pages, **_) -> StepOut:
    del parts, page_table, targets, ctx_pages
    t0 = time.perf_counter()
    out = self._out(rows.seed, rows.position, rows.processing.mask)
    self.seconds += time.perf_counter() - t0
    return out

  def decode_block(self, part, page_table, rows, held_stops, steps, max_steps, ctx_pages, **_):
    outs = [self._out(rows.seed, rows.position + j) for j in range(steps)]
    return StepOut(*(np.stack(f) if f[0] is not None else None for f in zip(*outs)))

  def set_params(self, state) -> None:
    del state


def stub_engine(config: EngineConfig, vocab: int) -> Engine:
  model = types.SimpleNamespace(cfg=types.SimpleNamespace(vocab_size=vocab))
  return Engine(model, config, runner=StubRunner(config, vocab))


def step_times(engine: Engine, steps: int, refill=None) -> list[float]:
  """Host seconds of `steps` steps (each step's wall time less the stub device's); `refill`
  is called after each with the step's outputs (to add a request in place of one that
  ended)."""
  times = []
  for _ in range(steps):
    device = engine.runner.seconds
    t0 = time.perf_counter()
    outs = engine.step()
    times.append(time.perf_counter() - t0 - (engine.runner.seconds - device))
    if refill is not None:
      refill(outs)
  return times


def scheduler_section(steps: int) -> dict:
  """(a): the median host seconds of a decode step at each context."""
  vocab = 163_840
  config = EngineConfig(max_num_seqs=SLOTS, max_model_len=max(CONTEXTS) + 4 * steps + 64,
                        page_size=64, prefill_chunk=8192, prefill_rows=SLOTS,
                        prefix_state_every=4, min_context=1024)
  out = {}
  for context in CONTEXTS:
    rng = np.random.default_rng(context)
    engine = stub_engine(config, vocab)
    for i in range(SLOTS):
      prompt = rng.integers(0, vocab, context).tolist()
      engine.add(str(i), prompt, SamplingParams(max_tokens=4 * steps, temperature=0.0))
    t0 = time.perf_counter()
    while any(r.to_feed > 1 for r in engine.scheduler.running) or engine.scheduler.waiting:
      engine.step()
    read_s = time.perf_counter() - t0
    times = step_times(engine, steps)
    out[context] = {"step_s": statistics.median(times), "p90_s": float(np.percentile(times, 90)),
                    "read_prompts_s": read_s, "cached_blocks": engine.stats()["cached_blocks"]}
    print(f"(a) {SLOTS} requests at {context:>7,} tokens: {out[context]['step_s'] * 1e3:.3f} ms "
          f"per step (p90 {out[context]['p90_s'] * 1e3:.3f}); reading the prompts took "
          f"{read_s:.1f} s", flush=True)
  ratio = out[CONTEXTS[1]]["step_s"] / out[CONTEXTS[0]]["step_s"]
  print(f"(a) 512K / 8K host time per step: {ratio:.3f}x (goal <= 1.2x: "
        f"{'met' if ratio <= 1.2 else 'NOT met'})", flush=True)
  return {"scheduler_host_ratio": ratio,
          "scheduler_step_s": {str(k): v for k, v in out.items()}}


class SyntheticTokenizer:
  """163,840 tokens without a tokenizer folder: the 256 bytes, then distinct ASCII strings of
  2-8 characters (letters, digits, spaces, JSON punctuation) drawn from a fixed seed; one
  special end token. Encoding is longest match (what the grammar library asks of it)."""

  def __init__(self, vocab: int):
    rng = np.random.default_rng(0)
    alphabet = np.array(list('abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 '
                             '{}[]":,._-'))
    seen, pieces = set(), [bytes([b]) for b in range(256)]
    while len(pieces) < vocab - 1:
      word = "".join(rng.choice(alphabet, rng.integers(2, 9))).encode()
      if word not in seen:
        seen.add(word)
        pieces.append(word)
    self.pieces, self.vocab_size = pieces + [b"<|end|>"], vocab
    self.special_tokens = {"<|end|>": vocab - 1}
    self.by_bytes = {p: i for i, p in enumerate(self.pieces[:-1])}

  def decode_bytes(self, ids) -> bytes:
    return b"".join(self.pieces[int(i)] for i in ids)

  def encode(self, text, allow_special: bool = True) -> np.ndarray:
    del allow_special
    data, out, at = text.encode() if isinstance(text, str) else text, [], 0
    while at < len(data):
      k = next(k for k in range(min(8, len(data) - at), 0, -1)
               if data[at:at + k] in self.by_bytes)
      out.append(self.by_bytes[data[at:at + k]])
      at += k
    return np.asarray(out, np.int32)


MASK_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "city": {"enum": ["Paris", "Oslo", "Lima"]},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4}},
    "required": ["name", "city", "age", "tags"], "additionalProperties": False}


def masked_run(config: EngineConfig, vocab: int, grammar, end: int, masked: int,
               steps: int) -> float:
  """The median host seconds per step of SLOTS decoding rows, `masked` of them under
  `grammar` (a request that ends is replaced by a new one of its kind)."""
  engine, count = stub_engine(config, vocab), itertools.count()

  def add(with_mask: bool) -> None:
    params = SamplingParams(max_tokens=2000, temperature=0.0, stop_token_ids=(end,),
                            grammar=grammar if with_mask else None)
    engine.add(f"{'m' if with_mask else 'p'}{next(count)}", [1, 2, 3, 4], params)

  for i in range(SLOTS):
    add(i < masked)
  while any(r.to_feed > 1 for r in engine.scheduler.running) or engine.scheduler.waiting:
    engine.step()
  return statistics.median(step_times(engine, steps, lambda outs: [
      add(o.request_id.startswith("m")) for o in outs if o.finished]))


def mask_section(steps: int, tokenizer_dir: str | None) -> dict:
  """(b): host seconds per step of 8 decoding rows with none or one of them masked."""
  vocab = 163_840
  tok = load_tokenizer("tiktoken", tokenizer_dir) if tokenizer_dir else SyntheticTokenizer(vocab)
  end = tok.eos_id if getattr(tok, "eos_id", None) is not None else max(
      tok.special_tokens.values())
  t0 = time.perf_counter()
  grammar = Vocabulary(tok, vocab, [end]).compile(json_lark(MASK_SCHEMA))
  print(f"(b) the grammar library read {vocab:,} tokens and compiled the schema in "
        f"{time.perf_counter() - t0:.1f} s", flush=True)
  config = EngineConfig(max_num_seqs=SLOTS, max_model_len=4096, page_size=64,
                        prefill_chunk=512, prefill_rows=SLOTS, min_context=1024)
  out = {}
  for masked in (0, 1):
    out[masked] = masked_run(config, vocab, grammar, end, masked, steps)
    print(f"(b) {SLOTS} rows, {masked} masked: {out[masked] * 1e3:.3f} ms host time per step",
          flush=True)
  overhead = out[1] / out[0] - 1
  print(f"(b) one masked row adds {overhead:.1%} to the step's host time (goal <= 20%: "
        f"{'met' if overhead <= 0.2 else 'NOT met'})", flush=True)
  return {"mask_host_overhead": overhead, "mask_step_s": {str(k): v for k, v in out.items()}}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--quick", action="store_true", help="fewer timed steps")
  p.add_argument("--json", action="store_true", help="print one JSON object last")
  p.add_argument("--tokenizer", metavar="FOLDER", default=None,
                 help="(b) on this folder's tiktoken tokenizer (e.g. Kimi K2's, 163,840 ids); "
                      "default: a synthetic vocabulary of the same size")
  args = p.parse_args(argv)
  steps = 100 if args.quick else 400
  result = {**scheduler_section(steps), **mask_section(steps, args.tokenizer)}
  if args.json:
    print(json.dumps(result))
  return 0


if __name__ == "__main__":
  sys.exit(main())
