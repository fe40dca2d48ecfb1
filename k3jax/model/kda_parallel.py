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
from jax.sharding import PartitionSpec as P

from k3jax.model.expert_parallel import context_mesh, shard_map_operands
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
  Returns what op returns: (o [B,T,H,V], final state [B,H,K,V] or None)."""
  mesh = _mesh()
  if mesh is None:
    return op(q, k, v, g, beta, initial_state=initial_state, segment_ids=segment_ids,
              A_log=A_log, dt_bias=dt_bias, **static)
  x_spec = activation_spec(_ROWS, q.shape, mesh)
  rows, heads = x_spec[0], x_spec[2]
  # the batch and head splits must be the same for every operand: take q's, check the rest
  v_spec = P(rows, None, heads, None)
  state_spec = P(rows, heads, None, None)
  for x, spec in ((v, v_spec), (beta, P(rows, None, heads))):
    if activation_spec(_ROWS[:x.ndim], x.shape, mesh) != spec:
      raise ValueError(f"KDA operands split differently on mesh {dict(mesh.shape)}: "
                       f"{x.shape} vs q {q.shape}")
  operands = dict(initial_state=(initial_state, state_spec),
                  segment_ids=(segment_ids, P(rows, None)),
                  A_log=(A_log, P(heads)), dt_bias=(dt_bias, P(heads, None)))
  names = [n for n, (x, _) in operands.items() if x is not None]
  want_state = bool(static.get("output_final_state"))

  def body(q, k, v, g, beta, *rest):
    o, s = op(q, k, v, g, beta, **dict(zip(names, rest)), **static)
    return (o, s) if want_state else o

  in_specs = (x_spec, x_spec, v_spec, x_spec, P(rows, None, heads),
              *(operands[n][1] for n in names))
  args = shard_map_operands((q, k, v, g, beta, *(operands[n][0] for n in names)), in_specs,
                            mesh)
  out = jax.shard_map(body, mesh=mesh, in_specs=in_specs,
                      out_specs=(v_spec, state_spec) if want_state else v_spec)(*args)
  return out if want_state else (out, None)


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
