"""The static batch: left-padded prompts, chunked prefill, a jitted decode loop in blocks.

Every request of a batch waits for the slowest and a new one waits for the batch to end; the
serving engine (k3jax/engine/) does not. This stays as the engine benchmark's baseline and a
second, independent path for the tests.

    prompts --left-pad--> ids [B, P], start [B]      (further left-padded to whole chunks)
    prefill:  extend(ids[:, chunk]) chunk by chunk                   -> logits of position P-1
    decode:   decode_block (one jit: lax.while_loop of up to `block` steps of
              sample -> record -> extend(token)), stopping early once every row is done

Why blocks rather than a host callback per token: the device runs `block` steps without a host
round trip; between blocks the host prints what arrived (streaming at block granularity, a
few tokens), decides nothing the device needs, and calls again with the carried state. A
callback (`io_callback`) would sync the host on every token and, under a mesh, fire once per
process/shard; the block loop is the same program on one device or many.

Compiled shapes are bounded: prefill runs one chunk shape (a power of two from 64 up to
`prefill_chunk`), the cache length is rounded up to a multiple of `LEN_BUCKET`, so prompts of
different lengths share the compilations, and the jitted functions are module-level (keyed on
the model's graph definition), so a second model of the same config reuses them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.generate.sampling import Sampling, sample
from k3jax.model import cache as cache_lib
from k3jax.model.cache import Cache, init_cache
from k3jax.model.decode import extend, extend_unstacked, unstack_model

LEN_BUCKET = 256
MIN_CHUNK = 64


def pad_prompts(prompts: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """(ids [B, P] left-padded with pad_id, start [B] = number of pads per row)."""
  if not prompts or any(len(p) == 0 for p in prompts):
    raise ValueError("every prompt needs at least one token")
  longest = max(len(p) for p in prompts)
  ids = np.full((len(prompts), longest), pad_id, np.int32)
  start = np.zeros(len(prompts), np.int32)
  for b, p in enumerate(prompts):
    ids[b, longest - len(p):] = p
    start[b] = longest - len(p)
  return ids, start


def cache_len(needed: int) -> int:
  return -(-needed // LEN_BUCKET) * LEN_BUCKET


def _extend(static, params, ids, cache):
  """`decode.extend` (static = ("stacked", graphdef)) or `decode.extend_unstacked` (static =
  ("unstacked", defs)) on the model's arrays `params`."""
  layout, defs = static
  if layout == "stacked":
    return extend(nnx.merge(defs, params), ids, cache)
  return extend_unstacked(defs, params, ids, cache)


extend_jit = jax.jit(_extend, static_argnums=0, donate_argnums=3)
extend_jit.__doc__ = """(logits [B, T, V], cache) of `_extend`, jitted. The cache passed in is
donated (updated in place): use the one returned."""


@partial(jax.jit, static_argnums=(0, 1), donate_argnums=(3,))
def decode_block(static, block: int, params, cache: Cache, logits_bv, key, done_b, count_b,
                 max_new, stop_ids, sampling: Sampling):
  """Up to `block` decode steps. A row is done after a stop token or `max_new` tokens; done
  rows record -1. Returns (tokens [B, block], steps run, cache, logits, key, done, count)."""
  b = logits_bv.shape[0]

  def cond(c):
    i, _, _, _, _, done, _ = c
    return (i < block) & ~jnp.all(done)

  def body(c):
    i, out, cache, logits, key, done, count = c
    key, sub = jax.random.split(key)
    tok = sample(logits, sub, sampling)
    out = out.at[:, i].set(jnp.where(done, -1, tok))
    count = count + (~done).astype(jnp.int32)
    done = done | jnp.isin(tok, stop_ids) | (count >= max_new)
    new_logits, cache = _extend(static, params, tok[:, None], cache)
    return i + 1, out, cache, new_logits[:, -1].astype(logits.dtype), key, done, count

  init = (jnp.int32(0), jnp.full((b, block), -1, jnp.int32), cache, logits_bv, key, done_b,
          count_b)
  i, out, cache, logits, key, done, count = jax.lax.while_loop(cond, body, init)
  return out, i, cache, logits, key, done, count


@dataclasses.dataclass
class StaticBatch:
  """Generation with one model. `stream(prompts, ...)` yields [B, n] token blocks (-1 where a
  row has finished); `generate` collects them.

  layout: "unstacked" (per-layer weights and cache, layers unrolled: XLA:CPU, where slicing a
  stacked weight copies it) or "stacked" (the model's stacks, layers scanned as in training:
  TPU/GPU, and K3 depth); None picks by platform. Both compute the same numbers.
  """
  model: nnx.Module
  prefill_chunk: int = 512
  block: int = 8
  layout: str | None = None

  def __post_init__(self):
    self.cfg = self.model.cfg
    self.layout = self.layout or ("unstacked" if jax.default_backend() == "cpu" else "stacked")
    if self.layout == "stacked":
      graphdef, self.params = nnx.split(self.model)
      self.static = ("stacked", graphdef)
    elif self.layout == "unstacked":
      defs, self.params = unstack_model(self.model)
      self.static = ("unstacked", defs)
    else:
      raise ValueError(f"unknown layout {self.layout!r}")

  def new_cache(self, batch: int, max_len: int, start=None) -> Cache:
    cache = init_cache(self.cfg, self.model.ex, batch, max_len, start)
    return cache if self.layout == "stacked" else cache_lib.unstack(cache)

  def extend(self, ids: jax.Array, cache: Cache) -> tuple[jax.Array, Cache]:
    return extend_jit(self.static, self.params, ids, cache)

  def chunk_for(self, length: int) -> int:
    """Prefill chunk for prompts of `length` tokens: the power of two that holds them, at least
    64 (the KDA op's own chunk: a shorter call costs the same) and at most `prefill_chunk`."""
    return min(self.prefill_chunk, max(MIN_CHUNK, 1 << max(0, length - 1).bit_length()))

  def max_len(self, prompt_len: int, new_tokens: int) -> int:
    """Cache length for prompts of `prompt_len` (padded to whole chunks) + `new_tokens`."""
    return cache_len(prompt_len + -prompt_len % self.chunk_for(prompt_len) + new_tokens)

  def prefill(self, ids: np.ndarray, start: np.ndarray, max_len: int
              ) -> tuple[jax.Array, Cache, int]:
    """Run left-padded prompts ids [B, P] (start [B] pads per row) through an empty cache of
    `max_len` positions, in chunks of `chunk_for(P)`. The prompts are left-padded further to a
    whole number of chunks, so prefill compiles for one chunk shape whatever the lengths (the
    pads are masked; they change no number). Returns (logits [B, P', V], cache, P' - P): the
    logits of every position including the extra pads in front."""
    chunk = self.chunk_for(ids.shape[1])
    extra = -ids.shape[1] % chunk
    ids = np.pad(ids, ((0, 0), (extra, 0)))
    cache = self.new_cache(ids.shape[0], max_len, np.asarray(start) + extra)
    outs = []
    for s in range(0, ids.shape[1], chunk):
      logits, cache = self.extend(jnp.asarray(ids[:, s:s + chunk]), cache)
      outs.append(logits)
    return jnp.concatenate(outs, axis=1), cache, extra

  def stream(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
             sampling: Sampling, seed: int = 0, stop_ids: Sequence[int] = (),
             pad_id: int = 0) -> Iterator[np.ndarray]:
    ids, start = pad_prompts(prompts, pad_id)
    logits, cache, _ = self.prefill(ids, start, self.max_len(ids.shape[1], max_new_tokens))
    b = ids.shape[0]
    logits, key = logits[:, -1], jax.random.key(seed)
    done = jnp.zeros((b,), bool) if max_new_tokens > 0 else jnp.ones((b,), bool)
    count = jnp.zeros((b,), jnp.int32)
    stops = jnp.asarray(list(stop_ids) or [-2], jnp.int32)  # -2: never sampled
    while not bool(jnp.all(done)):
      out, n, cache, logits, key, done, count = decode_block(
          self.static, self.block, self.params, cache, logits, key, done, count,
          jnp.int32(max_new_tokens), stops, sampling)
      yield np.asarray(out)[:, :int(n)]

  def generate(self, prompts, **kw) -> list[list[int]]:
    rows = [[] for _ in prompts]
    for chunk in self.stream(prompts, **kw):
      for b, row in enumerate(chunk):
        rows[b].extend(int(t) for t in row if t >= 0)
    return rows
