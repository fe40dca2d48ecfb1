"""The engine's device side: the cache, the weights, and the one jitted call per step.

    step(parts, page_table, sampling rows) -> per sampled row (token, logprob, top-n ids and
        logprobs), per prefill token (logprob of the next prompt token, top-n) when asked,
        and the cache after the step (donated: updated in place)

One call runs a whole step: the model over every token of the step (k3jax/model/paged.py),
the head at the tokens that sample, the log-softmax and the draws. Its shapes come from a few
buckets (decode rows: a power of two up to the slot count; prefill rows: none, or a power of
two up to prefill_rows, each of one of the prefill widths; attention context: a power of two
of pages), so a run with any mix of prompt lengths compiles a bounded set of programs, once
each.

Draws: a row's key is fold_in(key(seed), position of the token drawn), so a request's tokens
depend on its seed alone, not on which rows run beside it or whether it was preempted.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.engine.config import EngineConfig, check_shards
from k3jax.generate.sampling import (
  Processing,
  Sampling,
  filtered_logits,
  processed_logits,
  sample,
)
from k3jax.model import lora, paged
from k3jax.model.decode import unstack_model
from k3jax.model.layers import wide_dtype

HELD_STOPS = 8  # the most stop token ids of a held request (Engine.add(hold=True))


class SampleRows(NamedTuple):
  """Per sampled row: where its token is in the step (flat index), and how it draws."""
  index: jax.Array     # [M] int32
  sampling: Sampling   # fields [M]
  seed: jax.Array      # [M] uint32
  position: jax.Array  # [M] int32 position of the token being drawn
  logprob_temperature: jax.Array  # [M] the logprobs reported are log_softmax(logits / this)
                                  #   (1: the model's own; in the logits' wide dtype)
  processed: jax.Array  # [M] bool: ... over the tokens the row's filters keep (the
                        #   distribution its token is drawn from)
  processing: Processing = Processing()  # token masks and penalties (None: none this step)


class StepOut(NamedTuple):
  tokens: jax.Array            # [M] int32
  logprob: jax.Array           # [M] of the drawn token
  top_ids: jax.Array           # [M, n]
  top_logprobs: jax.Array      # [M, n]
  prompt_logprob: jax.Array | None   # [Rp * C] logprob of each prefill token's next token
  prompt_top_ids: jax.Array | None   # [Rp * C, n]
  prompt_top_logprobs: jax.Array | None


def layer_params(static, params):
  """(the per-layer graph definitions, their weights) of the engine's weights."""
  layout, defs = static
  if layout == "stacked":  # slice the caller's stacks here, inside the step: no copy kept
    return unstack_model(nnx.merge(defs, params))
  return defs, params


def log_softmax_wide(logits: jax.Array, temperature: jax.Array | None = None) -> jax.Array:
  wide = logits.astype(wide_dtype(logits.dtype))
  if temperature is not None:  # dividing by exactly 1 leaves the model's own logits unchanged
    wide = wide / temperature.astype(wide.dtype)[:, None]
  return jax.nn.log_softmax(wide, axis=-1)


@functools.partial(jax.jit, static_argnames=("static", "ctx_pages", "top_n", "prompt_targets",
                                             "pools"),
                   donate_argnames=("cache",))
def _step(static, params, cache: paged.PagedCache, page_table, parts, rows: SampleRows,
          targets, *, ctx_pages: int, top_n: int, prompt_targets: bool, pools=(1, (), 1)):
  defs, per_layer = layer_params(static, params)
  features, cache = paged.forward(defs, per_layer, parts, cache, page_table, ctx_pages=ctx_pages,
                                  shards=pools[0], axes=pools[1], stripes=pools[2])
  drawn = _draw(defs, per_layer, features[rows.index], rows, rows.position, top_n)
  prompt = (None, None, None)
  if prompt_targets:  # every token of the prefill rows scores its successor
    target_ids, target_index = targets
    p_logp = log_softmax_wide(paged.logits(defs, per_layer, features[target_index]))
    p_top_lp, p_top_ids = jax.lax.top_k(p_logp, top_n)
    prompt = (jnp.take_along_axis(p_logp, target_ids[:, None], axis=1)[:, 0], p_top_ids,
              p_top_lp)
  return StepOut(*drawn, *prompt), cache


def _draw(defs, per_layer, features, rows: SampleRows, position, top_n: int):
  """(tokens, their logprobs, top-n ids and logprobs) of the rows at `features`."""
  logits = paged.logits(defs, per_layer, features)
  drawn_from, filtered, logp = distribution(logits, rows)
  keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(rows.seed, position)
  tokens = sample(drawn_from, keys, rows.sampling, filtered)
  return (tokens, *reported(logp, tokens, top_n))


def distribution(logits, rows: SampleRows):
  """(the logits the rows draw from, after their processing: masks, bias, penalties, in the
  wide dtype; those over the temperature with top-k / top-p / min-p applied, float32; the
  log-probabilities reported). A processed row's logprobs are those of the distribution its
  token is drawn from: the processed wide logits over the temperature, renormalised over the
  tokens its filters keep (the float32 filter decides which, as it does for the draw); a raw
  row's, the model's own log_softmax."""
  proc = rows.processing
  if proc.mask is not None or proc.penalties is not None:
    drawn_from = processed_logits(logits, proc)
  else:
    drawn_from = logits
  filtered = filtered_logits(drawn_from, rows.sampling)
  keep = jnp.isfinite(filtered) | ~rows.processed[:, None]
  source = jnp.where(rows.processed[:, None], drawn_from, logits)
  logp = log_softmax_wide(jnp.where(keep, source, -jnp.inf), rows.logprob_temperature)
  return drawn_from, filtered, logp


def reported(logp, tokens, top_n: int):
  """(the tokens' logprobs, the top-n ids and logprobs) under `logp`."""
  token_lp = jnp.take_along_axis(logp, tokens[:, None], axis=1)[:, 0]
  top_lp, top_ids = jax.lax.top_k(logp, top_n)
  return token_lp, top_ids, top_lp


@functools.partial(jax.jit, static_argnames=("static", "ctx_pages", "top_n", "max_steps",
                                             "pools"),
                   donate_argnames=("cache",))
def _decode_block(static, params, cache: paged.PagedCache, page_table, part: paged.Rows,
                  rows: SampleRows, held_stops, steps, *, ctx_pages: int, top_n: int,
                  max_steps: int, pools=(1, (), 1)):
  """`steps` (<= max_steps) decode steps of the rows of `part` ([R, 1], every row continuing
  its slot: no source, restore or save) in one loop: step i feeds the token step i - 1 drew,
  at the next position, exactly as a one-step call would. held_stops [R, HELD_STOPS]: a held
  request's stop ids (-1: none); once its row draws one, the row's later steps are padding,
  so its slot keeps the state of exactly its tokens before the stop (what it resumes from)."""
  defs, per_layer = layer_params(static, params)
  r, wide = part.ids.shape[0], wide_dtype(defs.ex.jnp_dtype)  # the logprobs' dtype
  out = (jnp.zeros((max_steps, r), jnp.int32), jnp.zeros((max_steps, r), wide),
         jnp.zeros((max_steps, r, top_n), jnp.int32), jnp.zeros((max_steps, r, top_n), wide))

  def body(carry):
    i, ids, cache, out, done = carry
    rows_i = part._replace(ids=ids, positions=part.positions + i,
                           valid=part.valid & ~done[:, None])
    features, cache = paged.forward(defs, per_layer, (rows_i,), cache, page_table,
                                    ctx_pages=ctx_pages, shards=pools[0], axes=pools[1],
                                    stripes=pools[2])
    drawn = _draw(defs, per_layer, features, rows, rows.position + i, top_n)
    out = tuple(o.at[i].set(d) for o, d in zip(out, drawn))
    done = done | jnp.any(drawn[0][:, None] == held_stops, axis=1)
    return i + 1, drawn[0][:, None], cache, out, done

  _, _, cache, out, _ = jax.lax.while_loop(
      lambda c: c[0] < steps, body, (jnp.int32(0), part.ids, cache, out, jnp.zeros(r, bool)))
  return StepOut(*out, None, None, None), cache


def _serving_form(model: nnx.Module):
  """(the graph the engine runs, None or the jitted map from the model's state to its state
  in that graph). A model whose routed experts train under QAT (their forward rounds W +
  scale A B to MXFP4 at every call) is served as that rounded model, packed: each
  `set_params` quantises the experts once into codes and scales (lora.pack_qat_experts), and
  every step multiplies by them as by a released MXFP4 checkpoint's. Its tokens and logprobs
  are the trainer's forward's (the same values, dequantised exactly)."""
  graphdef = nnx.graphdef(model)
  if not lora.has_qat(model):
    return graphdef, None
  packed = lambda state: lora.pack_qat_experts(nnx.merge(graphdef, state))
  served = nnx.graphdef(nnx.eval_shape(lambda: packed(nnx.state(model))))
  return served, jax.jit(lambda state: nnx.state(packed(state)))


def _device_rows(part: paged.Rows) -> paged.Rows:
  return paged.Rows(*(None if a is None else jnp.asarray(a) for a in part))


class Runner:
  """Holds the device cache and the weights; runs steps."""

  def __init__(self, model: nnx.Module, config: EngineConfig, mesh=None):
    if mesh is not None:
      check_shards(config.data_shards, mesh, config.context_shards)
    self.cfg, self.ex, self.config = model.cfg, model.ex, config
    layout = config.layout or ("unstacked" if jax.default_backend() == "cpu" else "stacked")
    self.layout = layout
    self.graphdef, self._serving = _serving_form(model)
    self.set_params(nnx.state(model))
    self.mesh = mesh
    self.reset_cache()

  def reset_cache(self) -> None:
    """An empty cache (every slot, page and snapshot zero), placed as the steps expect it."""
    config, mesh = self.config, self.mesh
    shards, stripes = config.data_shards, config.context_shards
    self.cache = paged.init_cache(self.cfg, self.ex, slots=config.max_num_seqs,
                                  pages=config.pool_pages, page_size=config.page_size,
                                  snapshots=config.snapshots, shards=shards, stripes=stripes)
    # (shards, the mesh axes they split over, the pages' stripes over `context`): static, one
    # program per engine
    self.pools = (shards, paged.shard_axes(self.cache, mesh, shards) if mesh else (), stripes)
    if mesh is not None:
      self.cache = paged.place(self.cache, mesh, shards, stripes)
    else:  # committed, as each step's (donated) output is: an uncommitted first cache made
      # every program compile twice, once for the first step and once for the rest
      self.cache = jax.device_put(self.cache, jax.devices()[0])

  def on_mesh(self, run):
    """`run()` with the engine's mesh set (the model's constraints and expert parallelism
    see it), or as it is without one."""
    if self.mesh is None:
      return run()
    with jax.set_mesh(self.mesh):
      return run()

  def cache_lost(self) -> bool:
    """Whether the cache's buffers are gone: a step that failed after its call took them
    (the cache is donated to every step, which updates it in place)."""
    return any(x.is_deleted() for x in jax.tree.leaves(self.cache))

  def set_params(self, state) -> None:
    """New weights (an nnx.State of the model graph the engine was built with): stacked, used
    as they are; unstacked, split once per layer here. Routed experts under QAT are packed
    here, once (`_serving_form`)."""
    if self._serving is not None:
      state = self._serving(state)
    if self.layout == "stacked":
      self.static, self.params = ("stacked", self.graphdef), state
    else:
      defs, self.params = unstack_model(nnx.merge(self.graphdef, state))
      self.static = ("unstacked", defs)

  def step(self, parts: tuple[paged.Rows, ...], page_table: np.ndarray, rows: SampleRows,
           targets: tuple[np.ndarray, np.ndarray] | None, ctx_pages: int) -> StepOut:
    if self.mesh is None:
      return self._step(parts, page_table, rows, targets, ctx_pages)
    with jax.set_mesh(self.mesh):  # the model's constraints and expert parallelism see it
      return self._step(parts, page_table, rows, targets, ctx_pages)

  def decode_block(self, part: paged.Rows, page_table: np.ndarray, rows: SampleRows,
                   held_stops: np.ndarray, steps: int, max_steps: int, ctx_pages: int
                   ) -> StepOut:
    """`steps` decode steps in one call (compiled once per `max_steps`): fields [steps, R]."""
    def run():
      out, self.cache = _decode_block(
          self.static, self.params, self.cache, jnp.asarray(page_table),
          _device_rows(part), jax.tree.map(jnp.asarray, rows), jnp.asarray(held_stops),
          jnp.int32(steps), ctx_pages=ctx_pages,
          top_n=min(self.config.max_top_logprobs, self.cfg.vocab_size), max_steps=max_steps,
          pools=self.pools)
      return jax.tree.map(lambda a: np.asarray(a)[:steps], out)
    if self.mesh is None:
      return run()
    with jax.set_mesh(self.mesh):
      return run()

  def _step(self, parts, page_table, rows, targets, ctx_pages) -> StepOut:
    out, self.cache = _step(
        self.static, self.params, self.cache, jnp.asarray(page_table),
        tuple(map(_device_rows, parts)),
        jax.tree.map(jnp.asarray, rows),
        None if targets is None else tuple(map(jnp.asarray, targets)),
        ctx_pages=ctx_pages, top_n=min(self.config.max_top_logprobs, self.cfg.vocab_size),
        prompt_targets=targets is not None, pools=self.pools)
    return jax.tree.map(np.asarray, out)
