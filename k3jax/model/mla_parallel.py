"""MLA attention with the sequence split over `context` (docs/sharding.md#context-parallelism).

Each device holds its positions' queries and compressed latents. The latents (c and k_rot,
kv_lora + rope = 576 values per token at K3, against 96 x (192 + 128) for the per-head keys and
values) are all-gathered over the context axis, and each device attends its queries over the
whole sequence with `pallas_kernels.flash_attention.latent_attention`, which expands one key
block at a time to per-head keys and values (nothing per head exists for the whole sequence).
The backward of the gather is a reduce-scatter of the latents' gradient. Heads stay split over
`tensor`, rows over the batch axes.

Why a gather and not a ring of blocks: docs/sharding.md#mla-over-the-split-sequence.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from k3jax.model.expert_parallel import context_mesh, shard_map_operands
from pallas_kernels.flash_attention import latent_attention
from pallas_kernels.vma import vary_like
from sharding.activations import activation_spec

_Q = ("batch", "length", "heads", "qk_head_dim")


def split_spec(q_bthk: jax.Array) -> P | None:
  """The activation spec of MLA's queries when the context mesh splits their positions (None
  when it does not, or inside a shard_map already)."""
  mesh = context_mesh()
  if mesh is None or jax.sharding.get_abstract_mesh().manual_axes:
    return None
  spec = activation_spec(_Q, q_bthk.shape, mesh)
  return spec if spec[1] is not None else None


def attention(q_nope, q_rot, c, k_rot, w_k, w_v, segment_ids, *, scale: float, block: int,
              precision=None):
  """(o [B, T, H, Dv], row max [B, H, T]) of causal, segment-masked MLA over a sequence whose
  positions the context mesh splits (`split_spec` not None): q_nope [B,T,H,N], q_rot
  [B,T,H,R], c [B,T,C] (normalised latent), k_rot [B,T,R], w_k [C,H,N], w_v [C,H,Dv],
  segment_ids [B,T] or None."""
  mesh = context_mesh()
  q_spec = split_spec(q_nope)
  rows, ctx, heads = q_spec[0], q_spec[1], q_spec[2]
  if segment_ids is None:
    segment_ids = jnp.ones(q_nope.shape[:2], jnp.int32)
  lat, w = P(rows, ctx, None), P(None, heads, None)
  in_specs = (q_spec, q_spec, lat, lat, w, w, P(rows, ctx))

  def body(qn, qr, c, kr, wk, wv, seg):
    # typed as varying over the heads' axes before the gather, not after: the backward then
    # reduce-scatters each tensor rank's latent gradient over `context` first and sums the
    # local slice over the ranks, never the whole sequence's
    gather = lambda x: jax.lax.all_gather(vary_like(x, qn), ctx, axis=1, tiled=True)
    start = jax.lax.axis_index(ctx) * qn.shape[1]
    return latent_attention(qn, qr, gather(c), gather(kr), wk, wv, seg, gather(seg), start,
                            scale=scale, block=block, precision=precision)

  args = shard_map_operands((q_nope, q_rot, c, k_rot, w_k, w_v, segment_ids), in_specs, mesh)
  return jax.shard_map(body, mesh=mesh, in_specs=in_specs,
                       out_specs=(P(rows, ctx, heads, None), P(rows, heads, ctx)))(*args)

