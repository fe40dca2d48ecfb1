"""The K3 decoder stack (docs/model.md#layer-schedule-and-block-attnres): embeddings, layer
schedule, Block AttnRes, head.

Parameters of each kind are stacked along a leading `layers` axis (one stack of KDA mixers,
one of MLA mixers, one of dense MLPs, one of MoEs, one of per-layer norms), so the tree has
the same shape whatever the depth and a scanned stack needs no re-layout (`schedule.py` maps
layers to stack entries and decides what is scanned). Data flow with AttnRes (S = block size):

    partial = embed(ids); blocks = []
    for l in range(L):
        h = partial if not blocks else AttnRes(blocks, partial; attn_res[l])
        if l % S == 0: blocks.append(partial); partial = None     # seal the finished block
        partial = Attn_l(RMSNorm(h)) (+ partial)
        h = AttnRes(blocks, partial; mlp_res[l])
        partial = partial + MLP_l(RMSNorm(h))
    logits = lm_head(RMSNorm(AttnRes(blocks, partial; output_res)))

`blocks` is carried as a fixed buffer [n_seals, B, T, d] plus a count, and AttnRes masks the
slots not sealed yet: the same numbers (a masked candidate gets weight exactly 0; only the
float summation order can differ by an ulp), and a layer
whose index is only known at run time (inside a scan) can seal with one slot update.
Without AttnRes (Kimi-Linear) `partial` is an ordinary residual stream.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import ModelConfig
from k3jax.execution import Execution, Remat
from k3jax.model import block_scan, context_parallel, expert_parallel, saved_attention, schedule
from k3jax.model.attn_res import AttnResQuery
from k3jax.model.kda import KDA
from k3jax.model.layers import RMSNorm, fan_in_normal, head_logits, make_param
from k3jax.model.mla import MLA
from k3jax.model.mlp import MLP
from k3jax.model.moe import MoE, Routing
from sharding import constrain


class LayerNorms(nnx.Module):
  """A layer's pre-norms and its two AttnRes read points."""

  def __init__(self, cfg: ModelConfig, ex: Execution, *, rngs: nnx.Rngs):
    del rngs  # deterministic init; the argument keeps every stack built the same way
    d, eps = cfg.hidden_size, cfg.rms_norm_eps
    self.input_norm = RMSNorm(ex, d, ("embed",), eps=eps)
    self.post_attention_norm = RMSNorm(ex, d, ("embed",), eps=eps)
    if cfg.attn_res_block_size is not None:
      self.attn_res = AttnResQuery(cfg, ex)
      self.mlp_res = AttnResQuery(cfg, ex)


def stack(n: int, make: Callable[[nnx.Rngs], nnx.Module], rngs: nnx.Rngs) -> nnx.Module | None:
  """n independently initialised copies of a module, stacked on a leading `layers` axis."""
  if n == 0:
    return None

  @nnx.split_rngs(splits=n)
  @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
  def create(r: nnx.Rngs):
    return make(r)

  return create(rngs)


class Carry(NamedTuple):
  """What flows between layers: sealed blocks [n_seals, B, T, d] (None without AttnRes),
  how many are sealed (int32 scalar), and the running block sum / residual [B, T, d]."""
  blocks: jax.Array | None
  n_sealed: jax.Array
  partial: jax.Array


class ModelOutput(NamedTuple):
  logits: jax.Array                      # [B, T, V] wide dtype (float32; float64)
  routing: tuple[Routing, ...]           # one per MoE layer (router scores, choices, weights)
  mla_max_logits: jax.Array | None       # [n_mla, H] max pre-softmax logit (for QK-clip)
  layer_out: tuple[jax.Array, ...] = ()  # `partial` after each layer (return_layer_out=True)
  hidden: jax.Array | None = None        # input of the final norm
  features: jax.Array | None = None      # final-norm output [B, T, d] (the head's input)


class K3Model(nnx.Module):
  """Kimi K3 / Kimi-Linear causal LM `cfg`, computed as `ex` says (default: the reference
  numbers, float32). `model(ids)` -> ModelOutput."""

  def __init__(self, cfg: ModelConfig, ex: Execution = Execution(), *, rngs: nnx.Rngs):
    self.cfg, self.ex = cfg, ex
    d, pd = cfg.hidden_size, ex.jnp_param_dtype
    self.embed = make_param(rngs, nnx.initializers.normal(1.0), (cfg.vocab_size, d),
                            ("vocab", "embed"), pd)
    self.kda = stack(len(cfg.kda_layers), lambda r: KDA(cfg, ex, rngs=r), rngs)
    self.mla = stack(len(cfg.mla_layers), lambda r: MLA(cfg, ex, rngs=r), rngs)
    self.dense_mlp = stack(len(cfg.dense_layers),
                           lambda r: MLP(cfg, ex, cfg.intermediate_size, rngs=r), rngs)
    self.moe = stack(len(cfg.moe_layers), lambda r: MoE(cfg, ex, rngs=r), rngs)
    self.layers = stack(cfg.num_layers, lambda r: LayerNorms(cfg, ex, rngs=r), rngs)
    self.final_norm = RMSNorm(ex, d, ("embed",), eps=cfg.rms_norm_eps)
    if cfg.attn_res_block_size is not None:
      self.output_res = AttnResQuery(cfg, ex)
    if not cfg.tie_word_embeddings:
      self.lm_head = make_param(rngs, fan_in_normal(d), (d, cfg.vocab_size),
                                ("embed", "vocab"), pd)

  def __call__(self, input_ids: jax.Array | None = None, *,
               inputs_embeds: jax.Array | None = None,
               segment_ids: jax.Array | None = None,
               return_layer_out: bool = False, logits: bool = True) -> ModelOutput:
    """input_ids [B, T] int (or inputs_embeds [B, T, d]); segment_ids [B, T] int marks packed
    sequences / padding: tokens interact only within equal ids (MLA mask, KDA state and conv
    resets). `return_layer_out` disables layer scanning (per-layer outputs are for debugging).
    `logits=False` skips the head: `features` carries its input (for a chunked loss)."""
    cfg, ex = self.cfg, self.ex
    mesh = expert_parallel.context_mesh()
    context_parallel.check(mesh, (input_ids if inputs_embeds is None else inputs_embeds).shape[1],
                           ex.kda_backend)
    if inputs_embeds is None:
      table = self.embed[...]
      if context_parallel.size(mesh) > 1:
        # gathered over its width's FSDP axes first: `context` splits both the table's width
        # and the ids' positions, and the lookup's output split twice over it is resolved by
        # XLA by replicating the whole sequence's embeddings
        table = constrain(table, ("vocab", "embed"))
      inputs_embeds = table[input_ids]
    x = constrain(inputs_embeds.astype(ex.jnp_dtype), ("batch", "length", "embed"))
    stacks = {name: nnx.split(getattr(self, name))
              for name in schedule.STACKS
              if getattr(self, name) is not None}
    carry = initial_carry(cfg, x)
    routings: list[Routing] = []
    max_logits: list[jax.Array] = []
    layer_out: list[jax.Array] = []
    for run in schedule.runs(cfg, scan=ex.scan_layers and not return_layer_out):
      carry, run_routing, run_logits = run_layers(cfg, ex, run, stacks, carry, segment_ids)
      routings.extend(run_routing)
      max_logits.extend(run_logits)
      if return_layer_out:
        layer_out.append(carry.partial)
    if cfg.attn_res_block_size is not None:
      h = self.output_res(carry.blocks, carry.partial, _valid(carry))
    else:
      h = carry.partial
    features = self.final_norm(h)
    out = None
    if logits:
      out = head_logits("btd,dv->btv", features.astype(ex.jnp_dtype), self.head(),
                        ex.precision)
      out = constrain(out, ("batch", "length", "vocab"))
    return ModelOutput(out, tuple(routings), jnp.stack(max_logits) if max_logits else None,
                       tuple(layer_out), h, features)

  def head(self) -> jax.Array:
    """The output head [d, V] (the embedding transposed when tied)."""
    return self.embed[...].T if self.cfg.tie_word_embeddings else self.lm_head[...]


def initial_carry(cfg: ModelConfig, x: jax.Array) -> Carry:
  if cfg.attn_res_block_size is None:
    return Carry(None, jnp.zeros((), jnp.int32), x)
  n_seals = schedule.num_seals(cfg)
  return Carry(jnp.zeros((n_seals, *x.shape), x.dtype), jnp.zeros((), jnp.int32), x)


def constrain_carry(carry: Carry) -> Carry:
  """Pin the carry at a layer boundary to its activation placement (rows over the batch mesh
  axes; a no-op without a context mesh, see sharding/activations.py)."""
  blocks = None if carry.blocks is None else constrain(carry.blocks,
                                                       (None, "batch", "length", "embed"))
  return Carry(blocks, carry.n_sealed, constrain(carry.partial, ("batch", "length", "embed")))


def _valid(carry: Carry) -> jax.Array:
  """[n_seals + 1] bool: the sealed blocks, and the live partial (always last)."""
  i = jnp.arange(carry.blocks.shape[0] + 1)
  return (i < carry.n_sealed) | (i == carry.blocks.shape[0])


def run_layers(cfg: ModelConfig, ex: Execution, run: schedule.Run, stacks, carry: Carry,
               segment_ids) -> tuple[Carry, list[Routing], list[jax.Array]]:
  """Apply one planned run: a single layer, or `run.count` repeats of a unit under lax.scan,
  each layer rematerialised as `ex.remat` says. Returns the carry, the MoE layers' routing
  and the MLA layers' max logits, in layer order."""
  remat = ex.remat
  graphdefs = [{k: stacks[k][0] for k in stacks} for _ in run.unit]

  def unit_fn(carry: Carry, unit_states, first_layer):
    routings, max_logits = [], []
    for q, (kinds, states) in enumerate(zip(run.unit, unit_states)):
      norms, mixer, mlp = (nnx.merge(graphdefs[q][k], s) for k, s in zip(kinds, states))
      step = layer_step
      if remat != Remat.NONE:
        step = nnx.remat(layer_step, static_argnums=(0,), policy=remat_policy(remat))
      carry, routing, logits = step(cfg, first_layer + q, norms, mixer, mlp, carry, segment_ids)
      if routing is not None:
        routings.append(routing)
      if logits is not None:
        max_logits.append(logits)
    return carry, (routings, max_logits)

  if run.count == 1 and not run.scanned:
    unit_states = [tuple(_take(stacks[k][1], i) for k, i in zip(kinds, idx))
                   for kinds, idx in zip(run.unit, run.indices[0])]
    carry, (routings, max_logits) = unit_fn(carry, unit_states, run.start)
    return carry, routings, max_logits

  if remat in (Remat.FULL, Remat.SAVE_ATTENTION) and cfg.attn_res_block_size is not None:
    # full remat keeps only each layer's `partial`, not the block buffer per unit, and reads
    # the stacks in place (block_scan); save-attention its attention outputs too
    positions = [block_scan.Position(kinds, idx, strides)
                 for kinds, idx, strides in zip(run.unit, run.indices[0], run.strides)]
    used = {k: stacks[k][1] for kinds in run.unit for k in kinds}
    carry, outs = block_scan.scan([_layer_fn(cfg, kinds, graphdefs[q])
                                   for q, kinds in enumerate(run.unit)],
                                  positions, carry, used, run.count, run.start, segment_ids,
                                  save_attention=remat == Remat.SAVE_ATTENTION)
    routings = [r for r, _ in outs if r is not None]
    max_logits = [m for _, m in outs if m is not None]
  else:
    # states of every unit position, sliced from the stacks as [count, ...] scan inputs
    xs = [tuple(_take_strided(stacks[k][1], i, stride, run.count)
                for k, i, stride in zip(kinds, idx, strides))
          for kinds, idx, strides in zip(run.unit, run.indices[0], run.strides)]
    layer_ids = run.start + len(run.unit) * jnp.arange(run.count, dtype=jnp.int32)

    def body(carry, x):
      unit_states, first_layer = x
      return unit_fn(carry, unit_states, first_layer)

    carry, (routings, max_logits) = jax.lax.scan(body, carry, (xs, layer_ids))
  # per-layer outputs come back stacked [count, ...]; unstack to one entry per layer
  unstack = lambda items: [jax.tree.map(lambda a, u=u: a[u], r)
                           for u in range(run.count) for r in items]
  return carry, unstack(routings), unstack(max_logits)


def _layer_fn(cfg: ModelConfig, kinds: schedule.Kinds, graphdefs):
  """One unit position as block_scan takes it: (carry, states, l, segment_ids) ->
  (carry, (routing, max_logits))."""
  def layer(carry: Carry, states, l, segment_ids):
    norms, mixer, mlp = (nnx.merge(graphdefs[k], s) for k, s in zip(kinds, states))
    carry, routing, logits = layer_step(cfg, l, norms, mixer, mlp, carry, segment_ids)
    return carry, (routing, logits)
  return layer


def remat_policy(remat: Remat):
  """jax.checkpoint policy of a remat choice: what a layer's forward keeps for its backward.
  FULL: nothing but the inputs (recompute everything); SAVE_ATTENTION: the flash attention's
  kept output (k3jax/model/saved_attention.py); SAVE_DOTS: the projections' outputs (matmuls
  without batch dims; attention's batched products are recomputed); OFFLOAD: the same, moved
  to host memory."""
  policies = jax.checkpoint_policies
  if remat == Remat.FULL:
    return policies.nothing_saveable
  if remat == Remat.SAVE_ATTENTION:
    return policies.save_only_these_names(saved_attention.KEPT)
  if remat == Remat.SAVE_DOTS:
    return policies.dots_with_no_batch_dims_saveable
  if remat == Remat.OFFLOAD:
    return policies.offload_dot_with_no_batch_dims("device", "pinned_host")
  raise ValueError(f"no remat policy for {remat!r}")


def _take(state: nnx.State, i: int) -> nnx.State:
  return jax.tree.map(lambda a: a[i], state)


def _take_strided(state: nnx.State, start: int, stride: int, count: int) -> nnx.State:
  return jax.tree.map(lambda a: a[start:start + stride * count:stride], state)


def layer_step(cfg: ModelConfig, l, norms: LayerNorms, mixer, mlp, carry: Carry, segment_ids
               ) -> tuple[Carry, Routing | None, jax.Array | None]:
  """One decoder layer. `l` is a Python int (unrolled) or a traced int32 (scanned).
  Returns the carry, the MoE routing (None for a dense MLP) and MLA max logits (None for KDA)."""
  max_logits = None

  def attend(h):
    nonlocal max_logits
    a, aux = mixer(norms.input_norm(h), segment_ids=segment_ids)
    if isinstance(mixer, MLA):
      max_logits = aux  # KDA's aux is its decode state, unused here
    return a

  def feed_forward(h):
    out = mlp(norms.post_attention_norm(h))
    return out if isinstance(out, tuple) else (out, None)

  if cfg.attn_res_block_size is None:  # ordinary pre-norm residual stream
    h = carry.partial + attend(carry.partial)
    m, routing = feed_forward(h)
    return constrain_carry(carry._replace(partial=h + m)), routing, max_logits

  blocks, n, partial = carry
  h = norms.attn_res(blocks, partial, _valid(carry))
  seal = l % cfg.attn_res_block_size == 0
  if isinstance(seal, bool):  # static layer index: no select needed
    if seal:
      blocks = jax.lax.dynamic_update_index_in_dim(blocks, partial, n, 0)
      n, partial = n + 1, jnp.zeros_like(partial)
  else:
    slot = jnp.where(seal, partial, jax.lax.dynamic_index_in_dim(blocks, n, 0, keepdims=False))
    blocks = jax.lax.dynamic_update_index_in_dim(blocks, slot, n, 0)
    n, partial = n + seal.astype(n.dtype), jnp.where(seal, jnp.zeros_like(partial), partial)
  partial = partial + attend(h)
  carry = Carry(blocks, n, partial)
  m, routing = feed_forward(norms.mlp_res(blocks, partial, _valid(carry)))
  return constrain_carry(carry._replace(partial=partial + m)), routing, max_logits
