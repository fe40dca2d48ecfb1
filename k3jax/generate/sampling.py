"""Next-token choice from logits: greedy, temperature, top-k, top-p (nucleus), min-p, in fp32.

Every knob is a traced value, a scalar for the whole batch or one value per row ([B]), so one
compiled program serves any setting and any mix of requests:
    temperature 0      argmax (greedy)
    top_k k > 0        keep the k largest logits (ties at the k-th value are kept too)
    top_p p < 1        keep the smallest set of most likely tokens whose probability reaches p
    min_p m > 0        keep the tokens whose probability is at least m times the largest one
then sample softmax(logits / temperature) over what is kept. Filtering sorts the vocabulary;
a step in which no row filters skips the sort, and a step of greedy rows only skips the draw
too (both under `lax.cond`): with K3's 163,840-token vocabulary the sort and the noise cost more
than a small model's decode step on a CPU.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Sampling(NamedTuple):
  temperature: jax.Array  # [] or [B] float32; 0 = greedy
  top_k: jax.Array        # [] or [B] int32; 0 = off
  top_p: jax.Array        # [] or [B] float32; 1 = off
  min_p: jax.Array = 0.0  # [] or [B] float32; 0 = off

  @classmethod
  def make(cls, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
           min_p: float = 0.0) -> Sampling:
    return cls(jnp.float32(temperature), jnp.int32(top_k), jnp.float32(top_p),
               jnp.float32(min_p))


def _column(x) -> jax.Array:
  """A per-row knob ([] or [B]) as a column that broadcasts against [B, V]."""
  return jnp.asarray(x)[..., None]


def filtered_logits(logits_bv: jax.Array, s: Sampling) -> jax.Array:
  """logits / temperature with the tokens outside top-k / top-p / min-p set to -inf (fp32)."""
  v = logits_bv.shape[-1]
  x = logits_bv.astype(jnp.float32) / jnp.maximum(_column(s.temperature), 1e-6)
  top_k = jnp.asarray(s.top_k)
  filters = (jnp.any((top_k > 0) & (top_k < v)) | jnp.any(jnp.asarray(s.top_p) < 1)
             | jnp.any(jnp.asarray(s.min_p) > 0))
  return jax.lax.cond(filters, lambda x: _filter(x, s), lambda x: x, x)


def _filter(x: jax.Array, s: Sampling) -> jax.Array:
  v = x.shape[-1]
  desc = -jnp.sort(-x, axis=-1)                                   # [B, V] largest first
  top_k = _column(s.top_k)
  k = jnp.where((top_k > 0) & (top_k < v), top_k, v)
  kth = jnp.take_along_axis(desc, jnp.broadcast_to(k - 1, desc.shape[:-1] + (1,)), -1)
  probs = jax.nn.softmax(desc, axis=-1)
  mass_before = jnp.cumsum(probs, axis=-1) - probs                # mass of strictly larger ones
  keep_sorted = (mass_before < _column(s.top_p)) | (jnp.arange(v) == 0)  # the top one stays
  p_min = jnp.min(jnp.where(keep_sorted, desc, jnp.inf), axis=-1, keepdims=True)
  # min-p: p(x) >= m p(top)  <=>  x >= top + log m  (in the tempered logits)
  floor = desc[..., :1] + jnp.log(jnp.maximum(_column(s.min_p), 1e-30))
  keep = (x >= kth) & (x >= p_min) & ((_column(s.min_p) <= 0) | (x >= floor))
  return jnp.where(keep, x, -jnp.inf)


def sample(logits_bv: jax.Array, key: jax.Array, s: Sampling,
           filtered: jax.Array | None = None) -> jax.Array:
  """[B, V] logits -> [B] int32 tokens. `key`: one key for the batch, or [B] keys (one per
  row, so a row's draw does not depend on the other rows). `filtered`: filtered_logits(
  logits_bv, s) when the caller has it already (the engine reports logprobs under it)."""
  greedy = jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
  hot = jnp.asarray(s.temperature) > 0

  def draw(logits_bv):
    kept = filtered if filtered is not None else filtered_logits(logits_bv, s)
    return jnp.where(hot, _categorical(key, kept), greedy)

  return jax.lax.cond(jnp.any(hot), draw, lambda _: greedy, logits_bv)


def _categorical(key: jax.Array, filtered: jax.Array) -> jax.Array:
  if key.shape:  # one key per row
    return jax.vmap(jax.random.categorical)(key, filtered).astype(jnp.int32)
  return jax.random.categorical(key, filtered, axis=-1).astype(jnp.int32)

