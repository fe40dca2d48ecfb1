"""Next-token choice from logits: greedy, temperature, top-k, top-p (nucleus), in fp32.

Every knob is a traced value, so one compiled decode loop serves any setting:
    temperature 0      argmax (greedy)
    top_k k > 0        keep the k largest logits (ties at the k-th value are kept too)
    top_p p < 1        keep the smallest set of most likely tokens whose probability reaches p
then sample softmax(logits / temperature) over what is kept. Filtering sorts the vocabulary
once per step (negligible next to a decode step of the model).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Sampling(NamedTuple):
  temperature: jax.Array  # [] float32; 0 = greedy
  top_k: jax.Array        # [] int32; 0 = off
  top_p: jax.Array        # [] float32; 1 = off

  @classmethod
  def make(cls, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0) -> "Sampling":
    return cls(jnp.float32(temperature), jnp.int32(top_k), jnp.float32(top_p))


def filtered_logits(logits_bv: jax.Array, s: Sampling) -> jax.Array:
  """logits / temperature with the tokens outside top-k / top-p set to -inf (fp32)."""
  v = logits_bv.shape[-1]
  x = logits_bv.astype(jnp.float32) / jnp.maximum(s.temperature, 1e-6)
  desc = -jnp.sort(-x, axis=-1)                                   # [B, V] largest first
  k = jnp.where((s.top_k > 0) & (s.top_k < v), s.top_k, v)
  kth = jnp.take_along_axis(desc, jnp.broadcast_to(k - 1, desc.shape[:-1])[..., None], -1)
  probs = jax.nn.softmax(desc, axis=-1)
  mass_before = jnp.cumsum(probs, axis=-1) - probs                # mass of strictly larger ones
  keep_sorted = (mass_before < s.top_p) | (jnp.arange(v) == 0)    # the top token always stays
  p_min = jnp.min(jnp.where(keep_sorted, desc, jnp.inf), axis=-1, keepdims=True)
  keep = (x >= kth) & (x >= p_min)
  return jnp.where(keep, x, -jnp.inf)


def sample(logits_bv: jax.Array, key: jax.Array, s: Sampling) -> jax.Array:
  """[B, V] logits -> [B] int32 tokens."""
  greedy = jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
  drawn = jax.random.categorical(key, filtered_logits(logits_bv, s), axis=-1).astype(jnp.int32)
  return jnp.where(s.temperature > 0, drawn, greedy)
