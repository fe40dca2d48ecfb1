"""Speculative decoding on the device: the target's verification step and the draft model's.

    verify(part [R, K + 1]: each decoding request's last token and up to K drafts)
        -> per row the drafts kept and the token drawn after them (`SpecOut`)

A verification step runs every decoding row's last token and its drafts through the model at
once (one row of K + 1 positions), draws at every position and keeps the drafts the target
agrees with (`sampling.verify_drafts`: every position draws what decoding without drafts draws
there, with the same key, and a draft is kept while it equals that draw, so the tokens are
those of decoding without drafts, greedy or sampled). KDA is recurrent:
its state after the row must be the state after the tokens kept, not after all of them.
Snapshots of the state after each position would cost K + 1 states per row (414 MiB each on
full K3); instead the step keeps the start state and each KDA layer's input of the row (a few
MiB: K + 1 tokens of d_model), and once the step knows what it keeps it runs each KDA layer
again from the start state with the rejected tokens masked (`paged.commit`), which leaves the
state as if they had never been read (the masking that pads every prefill row). The MLA
latents of rejected positions stay in their pages until the request writes those positions
again (attention never reads a position past the query's); the pages past a request's tokens
are given back by the scheduler (`Scheduler.trim`).

A draft model (`DraftRunner`) keeps a cache of the target's geometry, in lockstep: it reads
every prompt chunk and decode token the target reads (same rows, slots, pages and snapshots,
so the prefix cache and preemption hold for it too), and before each verification it drafts
K tokens per row in one call (a loop of K + 1 decode steps, the last only to have the state
after every draft), saving its KDA state after each; the verification's result then picks
each row's state (`commit`), so it has read exactly the tokens the target kept.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.engine.runner import (
  Runner,
  SampleRows,
  distribution,
  layer_params,
  reported,
)
from k3jax.generate.sampling import Penalties, Processing, sample, verify_drafts
from k3jax.model import paged
from k3jax.model.kda import KDAState


class SpecOut(NamedTuple):
  accepted: jax.Array      # [R] drafts kept
  tokens: jax.Array        # [R, K + 1] the tokens emitted: [:accepted + 1]
  logprob: jax.Array       # [R, K + 1]
  top_ids: jax.Array       # [R, K + 1, n]
  top_logprobs: jax.Array  # [R, K + 1, n]


def _per_position(rows: SampleRows, k1: int) -> SampleRows:
  """`rows` ([R]) for each of the K + 1 positions of their verification rows ([R * (K + 1)]);
  a row's processing (mask, penalties) applies at its first position only (a row with
  processing drafts nothing)."""
  rep = lambda a: jnp.repeat(jnp.asarray(a), k1, axis=0)
  proc, mask, pen = rows.processing, None, None
  if proc.mask is not None:
    r, w = proc.mask.shape
    mask = jnp.full((r, k1, w), -1, proc.mask.dtype).at[:, 0].set(proc.mask).reshape(-1, w)
  if proc.penalties is not None:
    pen = Penalties(proc.penalties.rows * k1, *proc.penalties[1:])
  return SampleRows(rep(rows.index), type(rows.sampling)(*map(rep, rows.sampling)),
                    rep(rows.seed), rep(rows.position) + jnp.tile(jnp.arange(k1), len(rows.seed)),
                    rep(rows.logprob_temperature), rep(rows.processed), Processing(mask, pen))


def _keys(seed, position):
  return jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seed, position)


@functools.partial(jax.jit, static_argnames=("static", "ctx_pages", "top_n"),
                   donate_argnames=("cache",))
def _verify(static, params, cache: paged.PagedCache, page_table, part: paged.Rows,
            rows: SampleRows, n_drafts, *, ctx_pages: int, top_n: int):
  defs, per_layer = layer_params(static, params)
  features, cache, pending = paged.forward(defs, per_layer, (part,), cache, page_table,
                                           ctx_pages=ctx_pages, deferred=True)
  r, k1 = part.ids.shape
  flat = _per_position(rows, k1)
  drawn_from, filtered, logp = distribution(paged.logits(defs, per_layer, features), flat)
  keys = _keys(flat.seed, flat.position).reshape(r, k1)
  accepted, tokens = verify_drafts(drawn_from.reshape(r, k1, -1), filtered.reshape(r, k1, -1),
                                   part.ids[:, 1:], n_drafts, rows.sampling.temperature, keys)
  keep = (jnp.arange(k1)[None] <= accepted[:, None]) & part.valid
  cache = paged.commit(pending, part, keep, cache)
  lp, top_ids, top_lp = reported(logp, tokens.reshape(-1), top_n)
  return SpecOut(accepted, tokens, lp.reshape(r, k1), top_ids.reshape(r, k1, -1),
                 top_lp.reshape(r, k1, -1)), cache


@functools.partial(jax.jit, static_argnames=("static", "ctx_pages"), donate_argnames=("cache",))
def _follow(static, params, cache: paged.PagedCache, page_table, parts, *, ctx_pages: int):
  defs, per_layer = layer_params(static, params)
  _, cache = paged.forward(defs, per_layer, parts, cache, page_table, ctx_pages=ctx_pages)
  return cache


@functools.partial(jax.jit, static_argnames=("static", "ctx_pages", "k", "max_len"),
                   donate_argnames=("cache",))
def _propose(static, params, cache: paged.PagedCache, page_table, part: paged.Rows,
             rows: SampleRows, limits, *, ctx_pages: int, k: int, max_len: int):
  """K drafts per row of `part` ([R, 1]: each request's last token, not read yet): K + 1 decode
  steps, step i reading the token step i - 1 drew; the KDA state of every row's slot after
  each step is saved (`commit` picks one). A sampled row draws with the key the target draws
  that position with (the same Gumbel noise: the draft is kept where both argmaxes agree). A row
  reads nothing past its `limits[r]` drafts: its pages end there (the page table's entries
  after them name other requests' pages)."""
  defs, per_layer = layer_params(static, params)
  r = part.ids.shape[0]
  states = tuple(KDAState(*(jnp.zeros((k + 1, *a[part.slot].shape), a.dtype) for a in e))
                 for e in cache.kda)
  drafts = jnp.zeros((r, k + 1), jnp.int32)

  def body(i, carry):
    ids, cache, drafts, states = carry
    positions = part.positions + i  # none past the model's length (those steps read nothing)
    valid = part.valid & (positions < max_len) & (i <= limits[:, None])
    step = part._replace(ids=ids, positions=positions, valid=valid)
    features, cache = paged.forward(defs, per_layer, (step,), cache, page_table,
                                    ctx_pages=ctx_pages)
    states = tuple(KDAState(*(s.at[i].set(a[part.slot]) for s, a in zip(saved, entry)))
                   for saved, entry in zip(states, cache.kda))
    drawn_from, filtered, _ = distribution(paged.logits(defs, per_layer, features), rows)
    token = sample(drawn_from, _keys(rows.seed, rows.position + i), rows.sampling, filtered)
    drafts = drafts.at[:, i].set(token)
    return token[:, None], cache, drafts, states

  _, cache, drafts, states = jax.lax.fori_loop(0, k + 1, body,
                                               (part.ids, cache, drafts, states))
  return drafts[:, :k], states, cache


@functools.partial(jax.jit, donate_argnames=("cache",))
def _commit_draft(cache: paged.PagedCache, slots, states, accepted) -> paged.PagedCache:
  rows = jnp.arange(slots.shape[0])
  kda = tuple(KDAState(*(a.at[slots].set(s[accepted, rows]) for a, s in zip(entry, saved)))
              for entry, saved in zip(cache.kda, states))
  return cache._replace(kda=kda)


def verify(runner: Runner, part: paged.Rows, page_table: np.ndarray, rows: SampleRows,
           n_drafts: np.ndarray, ctx_pages: int) -> SpecOut:
  """The target's verification step (one jitted call; the cache updated in place)."""
  def run():
    out, runner.cache = _verify(
        runner.static, runner.params, runner.cache, jnp.asarray(page_table),
        paged.Rows(*(None if a is None else jnp.asarray(a) for a in part)),
        jax.tree.map(jnp.asarray, rows), jnp.asarray(n_drafts), ctx_pages=ctx_pages,
        top_n=min(runner.config.max_top_logprobs, runner.cfg.vocab_size))
    return jax.tree.map(np.asarray, out)
  return runner.on_mesh(run)


class DraftRunner(Runner):
  """A draft model's device side: a cache of the target engine's geometry, kept in lockstep
  with the target's (module docstring)."""

  def follow(self, parts, page_table: np.ndarray, ctx_pages: int) -> None:
    """Read the tokens of a step the target ran (its rows, slots, pages and snapshots)."""
    def run():
      self.cache = _follow(self.static, self.params, self.cache, jnp.asarray(page_table),
                           tuple(paged.Rows(*(None if a is None else jnp.asarray(a) for a in p))
                                 for p in parts), ctx_pages=ctx_pages)
    self.on_mesh(run)

  def propose(self, part: paged.Rows, page_table: np.ndarray, rows: SampleRows,
              limits: np.ndarray, k: int, ctx_pages: int):
    """(drafts [R, K] on the host, the saved states on the device); row r drafts
    `limits[r]` tokens (the rest of its K are not read)."""
    def run():
      drafts, states, self.cache = _propose(
          self.static, self.params, self.cache, jnp.asarray(page_table),
          paged.Rows(*(None if a is None else jnp.asarray(a) for a in part)),
          jax.tree.map(jnp.asarray, rows), jnp.asarray(limits, jnp.int32), ctx_pages=ctx_pages,
          k=k,
          max_len=self.config.max_model_len)
      return np.asarray(drafts), states
    return self.on_mesh(run)

  def commit(self, slots: np.ndarray, states, accepted: np.ndarray) -> None:
    """Each row's slot gets its state after the tokens the target kept."""
    self.cache = _commit_draft(self.cache, jnp.asarray(slots), states, jnp.asarray(accepted))
