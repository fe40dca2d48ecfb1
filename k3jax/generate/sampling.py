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



# ---- logits processing: token masks, logit bias and penalties (the serving engine's) ---------

class Penalties(NamedTuple):
  """Per-token adjustments of some rows (vLLM's order: logit_bias, then the repetition,
  frequency and presence penalties). `rows` [P] index the rows of the logits they apply to
  (an index past the last row: padding, dropped)."""
  rows: jax.Array         # [P] int32
  bias_ids: jax.Array     # [P, B] int32 logit_bias token ids (padding: id 0 with value 0)
  bias_values: jax.Array  # [P, B]
  counts: jax.Array       # [P, V] int32 how often each token is in the row's output so far
  prompt_seen: jax.Array  # [P, V] bool whether each token is in the row's prompt
  presence: jax.Array     # [P]
  frequency: jax.Array    # [P]
  repetition: jax.Array   # [P] (1: off)


class Processing(NamedTuple):
  """What the host computed for a step's sampled rows beyond their logits (None: nothing)."""
  mask: jax.Array | None = None        # [M, ceil(V / 32)] int32 bits of the allowed tokens
  penalties: Penalties | None = None


def allowed_tokens(mask_mw: jax.Array, vocab: int) -> jax.Array:
  """[M, V] bool from [M, ceil(V / 32)] int32 bit words (bit j of word w: token 32 w + j)."""
  v = jnp.arange(vocab)
  words = jnp.take(mask_mw, v // 32, axis=1)
  shift = jnp.broadcast_to((v % 32).astype(mask_mw.dtype), words.shape)
  return (jax.lax.shift_right_logical(words, shift) & 1) == 1


def processed_logits(logits_mv: jax.Array, proc: Processing) -> jax.Array:
  """The logits a row draws from after its host-side processing: logit_bias added, the
  repetition penalty (a seen token's positive logit divided by it, a negative one multiplied),
  the frequency and presence penalties subtracted, then the tokens the mask disallows at
  -inf. Neutral settings leave a logit exactly as it was (x + 0, x / 1, x * 1, x - 0)."""
  x = logits_mv
  p = proc.penalties
  if p is not None:
    sub = x[p.rows]                                                      # [P, V]
    sub = sub.at[jnp.arange(sub.shape[0])[:, None], p.bias_ids].add(
        p.bias_values.astype(sub.dtype))
    seen = p.prompt_seen | (p.counts > 0)
    rep = jnp.where(seen, p.repetition[:, None].astype(sub.dtype), 1)
    sub = jnp.where(sub > 0, sub / rep, sub * rep)
    counts = p.counts.astype(sub.dtype)
    sub = (sub - p.frequency[:, None].astype(sub.dtype) * counts
           - p.presence[:, None].astype(sub.dtype) * (counts > 0))
    x = x.at[p.rows].set(sub, mode="drop")
  if proc.mask is not None:
    x = jnp.where(allowed_tokens(proc.mask, x.shape[-1]), x, -jnp.inf)
  return x


# ---- speculative decoding: which draft tokens a target keeps (its own draws) ---------------

def verify_drafts(drawn_from: jax.Array, filtered: jax.Array, drafts: jax.Array,
                  n_drafts: jax.Array, temperature: jax.Array, keys: jax.Array
                  ) -> tuple[jax.Array, jax.Array]:
  """(accepted [R], tokens [R, K + 1]) of R rows that each verified up to K draft tokens.

  drawn_from [R, K + 1, V]: the target's logits at the last token and after each draft (what a
  greedy row takes the argmax of); filtered: the same over the temperature with the filters
  applied (float32: what a sampled row draws from); drafts [R, K]; n_drafts [R] (the drafts
  that are real); keys [R, K + 1]: the draw key of each position (fold_in(key(seed),
  position drawn), as a one-token step draws).

  Every position draws the token decoding without drafts would draw there, from the same
  logits with the same key (the argmax for a greedy row); a draft is kept while it equals that
  draw, and the first draw that differs (or the one after the last draft) is emitted. So the
  tokens are those of decoding without drafts, token for token, greedy or sampled: each is
  distributed as the target's p whatever proposed the drafts, and a request's tokens do not
  depend on which of its steps verified drafts (the other rows, prompts read beside it). A
  draft model that draws its proposals with the same keys (the Gumbel noise of
  `jax.random.categorical`) agrees with the target wherever their argmaxes over the same noise
  agree. tokens[:, j] for j <= accepted are the tokens the row emits."""
  r, k1 = drawn_from.shape[:2]
  k, rows = k1 - 1, jnp.arange(r)
  greedy = jnp.argmax(drawn_from, axis=-1).astype(jnp.int32)               # [R, K + 1]
  hot = jnp.broadcast_to(jnp.asarray(temperature), (r,)) > 0
  drawn = jax.vmap(jax.vmap(jax.random.categorical))(keys, filtered).astype(jnp.int32)
  target = jnp.where(hot[:, None], drawn, greedy)                           # [R, K + 1]
  ok = (target[:, :k] == drafts) & (jnp.arange(k)[None] < n_drafts[:, None])
  accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
  padded = jnp.concatenate([drafts, jnp.zeros((r, 1), drafts.dtype)], axis=1)
  j = jnp.arange(k1)[None]
  tokens = jnp.where(j < accepted[:, None], padded,
                     jnp.where(j == accepted[:, None], target[rows, accepted][:, None], 0))
  return accepted, tokens.astype(jnp.int32)
