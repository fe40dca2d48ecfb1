"""KDA on a mesh: the op inside `jax.shard_map`, each device running its own rows and heads.

KDA is independent per (row, head): its chunked recurrence never mixes batch rows or heads, so
on a mesh every device can run the op on its shard with no collective at all. Two reasons to
say so with a shard_map instead of leaving it to the SPMD partitioner:

- a Pallas kernel (Mosaic TPU, Triton, Mosaic GPU) is a custom call the partitioner cannot
  split: outside a shard_map XLA would gather every operand onto each device (or refuse to
  lower); inside one it sees the local [B/dp, T, H/tp, K] blocks it was written for;
- the jnp backends keep the same layout under any mesh, so the partitioner never reshards the
  chunk reshapes of `reference.chunk_kda` (the layout is pinned at the boundary here).

Layouts follow the activation rules (`sharding.rules`): rows over the batch mesh axes, heads
over `tensor`, time and features whole; `fit_spec` drops an axis that does not divide (a
2-row batch on 4 data devices). A_log [H] and dt_bias [H, K] enter split by head; inside the
shard_map they are replicated over the batch axes, so their gradients are summed over those
axes by the transpose of that replication (shard_map's varying-type rules), as the one-device
op's gradients are summed over rows.

Without a k3jax context mesh (`expert_parallel.context_mesh`), or inside a shard_map already,
both functions call the op directly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from k3jax.model import context_parallel
from k3jax.model.expert_parallel import context_mesh, shard_map_operands
from pallas_kernels.kda import ops as kda_ops
from sharding.activations import activation_spec

_ROWS = ("batch", "length", "heads", "head_dim")


def _mesh():
  mesh = context_mesh()
  if mesh is None or jax.sharding.get_abstract_mesh().manual_axes:
    return None
  return mesh


def kda(op, q, k, v, g, beta, *, initial_state=None, segment_ids=None, A_log=None,
        dt_bias=None, **static):
  """`op(q, k, v, g, beta, initial_state=..., segment_ids=..., A_log=..., dt_bias=...,
  **static)` (pallas_kernels.kda.ops.kda) run per shard on the context mesh. q, k, g
  [B,T,H,K]; v [B,T,H,V]; beta [B,T,H]; initial_state [B,H,K,V]; segment_ids [B,T]; A_log
  [H]; dt_bias [H,K]; `static` the op's other arguments (raw=RawInputs(...), backend=, ...).
  Returns what op returns: (o [B,T,H,V], final state [B,H,K,V] or None).

  With the positions split over `context`, each device runs its range through
  `ops.kda_range` with the op's options (`range_op`; `composition` says how the ranges' maps
  are composed: context_parallel.Composition, None to choose by size) and completes its
  outputs from the state its range enters with (`_range_body`)."""
  range_op = static.pop("range_op", kda_ops.kda_range)
  composition = static.pop("composition", None)
  mesh = _mesh()
  if mesh is None:
    return op(q, k, v, g, beta, initial_state=initial_state, segment_ids=segment_ids,
              A_log=A_log, dt_bias=dt_bias, **static)
  x_spec = activation_spec(_ROWS, q.shape, mesh)
  rows, ctx, heads = x_spec[0], x_spec[1], x_spec[2]
  # the batch and head splits must be the same for every operand: take q's, check the rest
  v_spec = P(rows, ctx, heads, None)
  state_spec = P(rows, heads, None, None)
  for x, spec in ((v, v_spec), (beta, P(rows, ctx, heads))):
    if activation_spec(_ROWS[:x.ndim], x.shape, mesh) != spec:
      raise ValueError(f"KDA operands split differently on mesh {dict(mesh.shape)}: "
                       f"{x.shape} vs q {q.shape}")
  operands = dict(initial_state=(initial_state, state_spec),
                  segment_ids=(segment_ids, P(rows, ctx)),
                  A_log=(A_log, P(heads)), dt_bias=(dt_bias, P(heads, None)))
  names = [n for n, (x, _) in operands.items() if x is not None]
  want_state = bool(static.get("output_final_state"))

  def body(q, k, v, g, beta, *rest):
    if ctx is not None:
      o, s = _range_body(range_op, composition, q, k, v, g, beta, **dict(zip(names, rest)),
                         **static)
    else:
      o, s = op(q, k, v, g, beta, **dict(zip(names, rest)), **static)
    return (o, s) if want_state else o

  in_specs = (x_spec, x_spec, v_spec, x_spec, P(rows, ctx, heads),
              *(operands[n][1] for n in names))
  args = shard_map_operands((q, k, v, g, beta, *(operands[n][0] for n in names)), in_specs,
                            mesh)
  out = jax.shard_map(body, mesh=mesh, in_specs=in_specs,
                      out_specs=(v_spec, state_spec) if want_state else v_spec)(*args)
  return out if want_state else (out, None)


def _range_body(range_op, composition, q, k, v, g, beta, *, initial_state=None,
                segment_ids=None, output_final_state=False, **static):
  """One device's range of a sequence split over `context` (inside the shard_map): its map
  from `range_op`, the state it enters with from every device's map, its outputs completed
  (o = o_zero + S_in^T read) and, if asked, the state after the sequence's last position
  (the last device's) on every device."""
  r = range_op(q, k, v, g, beta, segment_ids=segment_ids, **static)
  b, _, h, kk = q.shape
  s0 = (jnp.zeros((b, h, kk, v.shape[-1]), r.offset.dtype) if initial_state is None
        else initial_state.astype(r.offset.dtype))
  transition = r.transition
  restart = None
  if segment_ids is not None:  # a segment starting at this range's first position: S_in = 0
    before = context_parallel.from_previous(segment_ids[:, -1], segment_ids[:, 0])
    restart = (segment_ids[:, 0] != before)[:, None, None, None]
    transition = jnp.where(restart, 0.0, transition)
  s_in = context_parallel.entering_states(transition, r.offset, s0, composition=composition)
  if restart is not None:
    s_in = jnp.where(restart, 0.0, s_in)
  o = r.o + jnp.einsum("bthk,bhkv->bthv", r.read, s_in, precision=jax.lax.Precision.HIGHEST)
  final = None
  if output_final_state:
    final = context_parallel.from_last(
        jnp.einsum("bhij,bhjv->bhiv", transition, s_in, precision=jax.lax.Precision.HIGHEST)
        + r.offset)
  return o.astype(v.dtype), final


def kda_step(op, q, k, v, g, beta, state, **static):
  """`op(q, k, v, g, beta, state, **static)` (ops.kda_step, one decode token on prepared
  inputs: q, k, g [B,H,K], v [B,H,V], beta [B,H], state [B,H,K,V]) run per shard."""
  mesh = _mesh()
  if mesh is None:
    return op(q, k, v, g, beta, state, **static)
  x_spec = activation_spec(("batch", "heads", "head_dim"), q.shape, mesh)
  rows, heads = x_spec[0], x_spec[1]
  in_specs = (x_spec, x_spec, P(rows, heads, None), x_spec, P(rows, heads),
              P(rows, heads, None, None))
  args = shard_map_operands((q, k, v, g, beta, state), in_specs, mesh)
  return jax.shard_map(
      lambda *a: op(*a, **static), mesh=mesh, in_specs=in_specs,
      out_specs=(P(rows, heads, None), P(rows, heads, None, None)))(*args)


def causal_conv(conv, x, w, tail, segment_ids):
  """`conv(x, w, tail, segment_ids[, tail_segment_ids])` (kda.causal_conv: x [B,T,H,C], w
  [H,C,taps], tail [B,taps-1,H,C] or None, segment_ids [B,T] or None -> (y, new tail)) on the
  context mesh. Only a split of the positions needs a shard_map: each device then reads the
  previous device's last taps-1 inputs and their segment ids (device 0 the given tail), and
  the tail after the sequence is the last device's."""
  mesh = _mesh()
  spec = None if mesh is None else activation_spec(_ROWS, x.shape, mesh)
  if spec is None or spec[1] is None:
    return conv(x, w, tail, segment_ids)
  rows, ctx, heads = spec[0], spec[1], spec[2]
  taps = w.shape[-1]
  tail_spec = P(rows, None, heads, None)
  if tail is None:
    tail = jnp.zeros((x.shape[0], taps - 1, *x.shape[2:]), x.dtype)
  operands = [(x, spec), (w, P(heads, None, None)), (tail, tail_spec)]
  if segment_ids is not None:
    operands.append((segment_ids, P(rows, ctx)))

  def body(x, w, tail, seg=None):
    edge = x[:, -(taps - 1):]
    prev = context_parallel.from_previous(edge, tail.astype(x.dtype))
    prev_seg = None
    if seg is not None:
      first = jnp.repeat(seg[:, :1], taps - 1, axis=1)
      prev_seg = context_parallel.from_previous(seg[:, -(taps - 1):], first)
    y, _ = conv(x, w, prev, seg, prev_seg)
    return y, context_parallel.from_last(edge)

  specs = tuple(s for _, s in operands)
  args = shard_map_operands(tuple(a for a, _ in operands), specs, mesh)
  return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(spec, tail_spec))(*args)
