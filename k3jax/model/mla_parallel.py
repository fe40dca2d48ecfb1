"""MLA attention with the sequence split over `context` (docs/sharding.md#context-parallelism).

Each device holds its positions' queries and compressed latents. The latents (c and k_rot,
kv_lora + rope = 576 values per token at K3, against 96 x (192 + 128) for the per-head keys and
values) are all-gathered over the context axis, and each device attends queries over the
sequence up to them with `pallas_kernels.flash_attention.latent_attention`, which expands one
key block at a time to per-head keys and values (nothing per head exists for the whole
sequence). The backward of the gather is a reduce-scatter of the latents' gradient. Heads stay
split over `tensor`, rows over the batch axes.

Balanced causal work: with contiguous ranges device d's queries see d + 1/2 ranges of keys, so
the last device's work sets the step. Each device's range is cut in two halves; device d keeps
its first half (half 2d of the 2C) and swaps its second half with device C-1-d (one
collective-permute of queries and segment ids in, one of outputs back), so it attends halves
2d and 2C-1-2d, which see 2C + 1 half-ranges of keys together on every device. The kernel's
loop is that static count, split between the two halves by the device index.

Why a gather and not a ring of blocks: docs/sharding.md#mla-over-the-split-sequence.
"""

from __future__ import annotations

import functools
import math

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
              precision=None, with_lse: bool = False, saved=None):
  """(o [B, T, H, Dv], row max [B, H, T]) of causal, segment-masked MLA over a sequence whose
  positions the context mesh splits (`split_spec` not None): q_nope [B,T,H,N], q_rot
  [B,T,H,R], c [B,T,C] (normalised latent), k_rot [B,T,R], w_k [C,H,N], w_v [C,H,Dv],
  segment_ids [B,T] or None. with_lse and saved as `latent_attention` takes them (the lse
  [B, H, T] in position order, split like the row max)."""
  mesh = context_mesh()
  q_spec = split_spec(q_nope)
  rows, ctx, heads = q_spec[0], q_spec[1], q_spec[2]
  if segment_ids is None:
    segment_ids = jnp.ones(q_nope.shape[:2], jnp.int32)
  lat, w, row = P(rows, ctx, None), P(None, heads, None), P(rows, heads, ctx)
  o_spec = P(rows, ctx, heads, None)
  operands = (q_nope, q_rot, c, k_rot, w_k, w_v, segment_ids)
  in_specs = (q_spec, q_spec, lat, lat, w, w, P(rows, ctx))
  if saved is not None:  # the kept output and lse; the row max passes by as it is
    operands, in_specs = operands + (saved[0], saved[2]), in_specs + (o_spec, row)
    out_specs = o_spec
  else:
    out_specs = (o_spec, row, row) if with_lse else (o_spec, row)

  # XLA:CPU with several processes (gloo) hangs in the first step with the balanced split's
  # exchange (some devices wait in an all-gather, the others in a loop's all-reduce; cause
  # not found): there each device keeps its contiguous range (docs/sharding.md)
  balanced = not (jax.process_count() > 1 and jax.default_backend() == "cpu")

  def body(qn, qr, c, kr, wk, wv, seg, *kept):
    # typed as varying over the heads' axes before the gather, not after: the backward then
    # reduce-scatters each tensor rank's latent gradient over `context` first and sums the
    # local slice over the ranks, never the whole sequence's
    gather = lambda x: jax.lax.all_gather(vary_like(x, qn), ctx, axis=1, tiled=True)
    n, d, t = jax.lax.axis_size(ctx), jax.lax.axis_index(ctx), qn.shape[1]
    if t % 2 or not balanced:  # the contiguous range, over every key block
      order, starts, kw = lambda x, axis: x, d * t, dict(block=block)
    else:
      order = functools.partial(_balanced, ctx=ctx, n=n, t=t)
      half = t // 2
      starts = jnp.stack([2 * d * half, (2 * n - 1 - 2 * d) * half])
      blk = math.gcd(block, half)  # whole blocks per half: the visit count is exact
      kw = dict(block=blk, visits=(2 * n + 1) * half // blk)
    if kept:
      kw["saved"] = (order(kept[0], 1), None, order(kept[1], 2))
    out = latent_attention(order(qn, 1), order(qr, 1), gather(c), gather(kr), wk, wv,
                           order(seg, 1), gather(seg), starts, scale=scale, precision=precision,
                           with_lse=with_lse, **kw)
    if kept:
      return order(out[0], 1)
    return tuple(order(x, axis) for x, axis in zip(out, (1, 2, 2)))

  args = shard_map_operands(operands, in_specs, mesh)
  out = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(*args)
  return (out, saved[1]) if saved is not None else out


def _balanced(x, axis, *, ctx, n, t):
  """A device's positions in the balanced order (module docstring) and back: the second half
  swapped with device n-1-d's (an involution)."""
  half = t // 2
  swap = [(i, n - 1 - i) for i in range(n)]
  return jnp.concatenate(
      [jax.lax.slice_in_dim(x, 0, half, axis=axis),
       jax.lax.ppermute(jax.lax.slice_in_dim(x, half, t, axis=axis), ctx, swap)], axis=axis)
