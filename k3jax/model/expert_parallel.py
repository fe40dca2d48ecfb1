"""Dropless expert parallelism: the routed experts of a MoE layer inside `jax.shard_map`
(docs/sharding.md#expert-parallelism).

Under plain `jit`, `ragged_dot` on expert-sharded weights makes the partitioner all-gather the
expert stacks to every device (and the global sort of (token, expert) pairs gathers the tokens).
Here each device keeps its own tokens and its own experts and moves only routed rows:

    (per device; n local tokens, k slots, E experts, EP devices on the expert axes, E/EP local)
    z [n, h]            routed_down(x) (h = latent l; Kimi-Linear: h = d), computed outside
    sort the n*k (token, slot) pairs by expert (= by destination device)
    counts [E] -> all_gather over the expert axes -> G [EP, E]: pairs device i sends expert e
    A = G (dropless) or A[i, e] = clip(cap - sum_{i'<i} G[i', e], 0, G[i, e]) (capacity)
    C[i, j] = sum of A[i, e] over device j's experts: the [EP, EP] sizes and offsets
    ragged_all_to_all of the kept rows to the experts' devices    (TPU / GPU)
      | all_to_all of [EP, S, h] per-destination buffers           (XLA:CPU)
    reorder the received rows expert-major; grouped matmul over the E/EP local experts
    the same exchange back; weight by p (fp32); scatter-add to tokens: u [n, h]
    reduce-scatter of u over the tensor axes (tensor-parallel experts), then RMSNorm_l and
    routed_up outside, on each tensor rank's share of the rows

Dispatch in the latent width is LatentMoE's point: l = d/2 halves the all-to-all payload.

Which path: callers trace under `jax.set_mesh(mesh)` with the `sharding.rules.MESH_AXES` axes.
With such a mesh of more than one device every routed expert call runs here, also when only
data/fsdp/tensor are > 1 (EP = 1: no exchange, each device runs every expert on its own
tokens): under plain jit the partitioner would gather every token to sort the pairs globally.
Without a mesh (or with a mesh of other axes) `moe.RoutedExperts` runs its one-device code,
unchanged; with a capacity factor that code is this function's body on one device.

The axes of the expert weights [E, h, F] follow the one rules table:
  experts -> EP (expert x fsdp when E divides over both, else expert): the exchange above, no
    weight ever leaves its device.
  moe_mlp (F) -> tensor: tensor-parallel experts. Each tensor rank computes its F slice of
    every local expert (the gated activation is elementwise in F) and its partial
    down-projection for all of the device's n rows: z is all-gathered over `tensor` on entry
    and u [n, h] (fp32) reduce-scattered on the way out, the cheapest place: n rows, not n*k
    (the backward's are the same collectives transposed). Outside, the rows stay split over
    `tensor` (`split_rows`): the router, routed_down, RMSNorm_l and routed_up each run on 1/tensor
    of the rows. Tokens replicated over `tensor` there instead would have every tensor rank
    repeat them (K3's plan: docs/plan.md#what-got-it-there). Every
    tensor rank sends the same rows over the expert axes.
  latent (h) -> fsdp, only when E does not divide over expert x fsdp (the table's fallback
    row): FSDP inside the shard_map: each layer all-gathers its E/EP local experts over fsdp
    before use and its backward reduce-scatters their gradient (the transpose of all_gather).
    It moves E/EP * 3hF weights per layer where tensor parallelism moves n*h activations: at
    K3 (h = 3584, F = 3072) with EP = 128 (7 local experts), 462 MB (bf16) per layer against
    59 MB (fp32 u) for n = 4096 tokens. Hence the table's first row, experts -> expert x fsdp:
    the same weight bytes per device, latent stays whole and no weight moves at all. This code
    follows whatever axes the table gives (see `layout`).

MXFP4-packed experts (`ExpertWeights` with codes and scales) follow the same axes: the codes
[E, out, in/2] as their weight, the scales [E, out, in/32] whole along h and split with F
(w2's contraction: each tensor rank dequantises its own groups, so F / tensor must hold whole
groups of 32); an FSDP gather moves the codes (4 bits a weight), never a float copy. LoRA
adapters on packed experts enter as their A [E, in, r] and B [E, r, out] (`expert_weights`).

Buffers are static. Dropless, a device may receive every pair of its group that can reach it:
EP * n * min(k, E/EP) rows (K3, EP = 128, n = 4096: 3.7M rows of 3584, 26 GB bf16; the mean is
n * k). A capacity factor c caps each expert at cap = ceil(c * k * EP * n / E) pairs of its
group, so a device receives at most E/EP * cap (about c * n * k) rows; the pairs past an
expert's cap (later devices, then later tokens) are dropped and counted.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from k3jax.execution import Dispatch, Execution
from k3jax.model import expert_weights
from k3jax.model.expert_weights import ExpertWeights
from k3jax.model.layers import wide_dtype
from k3jax.model.mlp import glu
from pallas_kernels.grouped_matmul import ALIGN as GROUPED_ROWS
from pallas_kernels.grouped_matmul import default_impl
from pallas_kernels.mxfp4 import GROUP
from sharding.activations import pin
from sharding.rules import ACTIVATION_RULES, MESH_AXES, fit_spec, logical_to_spec


def context_mesh() -> jax.sharding.AbstractMesh | None:
  """The mesh the caller traces under (`jax.set_mesh`) when it is a k3jax mesh (axes
  `MESH_AXES`) of more than one device; None otherwise."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not set(MESH_AXES) <= set(mesh.axis_names) or mesh.size == 1:
    return None
  return mesh


def shard_map_operands(args, specs, mesh) -> tuple:
  """Under explicit mesh axes shard_map takes operands as they are typed: reshard them to
  `specs` first. Under Auto axes, the operands themselves."""
  if jax.sharding.AxisType.Explicit in mesh.axis_types:
    return tuple(jax.sharding.reshard(a, s) for a, s in zip(args, specs))
  return tuple(args)


@dataclasses.dataclass(frozen=True)
class Layout:
  """Static plan of one routed-experts call on one device (all sizes in rows)."""
  ep_axes: tuple[str, ...]      # mesh axes the experts are split over (the exchange group)
  ep: int                       # devices in the exchange group
  gather_axes: tuple[str, ...]  # axes of the weights' input width h (FSDP: gathered per layer)
  psum_axes: tuple[str, ...]    # axes of the weights' F (tensor-parallel experts: psum of u)
  token_axes: tuple[str, ...]   # axes the tokens are split over
  n: int                        # tokens per device (padded to a multiple of the psum_axes)
  capacity: int | None          # pairs per expert per exchange group; None: dropless
  recv: int                     # rows a device can receive (ragged buffer, expert-major rows)
  slot: int                     # rows per destination in the padded buffers [EP, slot, h]


def _axes(entry) -> tuple[str, ...]:
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def layout(cfg, n_tokens: int, in_name: str, mesh=None,
           capacity_factor: float | None = None) -> Layout:
  """The plan for `n_tokens` tokens (global) on `mesh` (None: one device), dropless or with
  the experts' capacity factor (`Execution.moe_capacity_factor`)."""
  e, k = cfg.num_experts, cfg.num_experts_per_token
  if mesh is None:
    ep_axes = gather_axes = psum_axes = token_axes = ()
  else:  # the expert weights' placement (sharding/placement.py: names and shape)
    h = cfg.hidden_size if in_name == "embed" else cfg.latent_size
    w_spec = logical_to_spec(("experts", in_name, "moe_mlp"), mesh=mesh,
                             shape=(e, h, cfg.moe_intermediate_size))
    ep_axes, gather_axes, psum_axes = (_axes(s) for s in w_spec)
    # a token's row: [B, T] flattened, split over the batch axes then `context`
    token_axes = _axes(logical_to_spec(("tokens",), ACTIVATION_RULES, mesh=mesh)[0])
  size = lambda axes: math.prod(mesh.shape[a] for a in axes) if axes else 1
  ep, shards = size(ep_axes), size(token_axes)
  if e % ep:
    raise ValueError(f"{e} experts do not split over the {ep} devices of mesh axes {ep_axes}")
  f = cfg.moe_intermediate_size
  if f % size(psum_axes):
    raise ValueError(f"moe_intermediate_size {f} does not split over mesh axes {psum_axes}")
  n = -(-n_tokens // shards)
  n = -(-n // size(psum_axes)) * size(psum_axes)  # the rows split over the tensor ranks
  per_dest = n * min(k, e // ep)   # one device's pairs that can reach one destination
  recv = ep * per_dest
  capacity = None
  if capacity_factor is not None:
    capacity = math.ceil(capacity_factor * k * ep * n / e)
    recv = min(recv, e // ep * capacity)
  # aligned: the experts' grouped matmuls run on these rows (a misaligned count would cost
  # grouped_matmul a padded copy; docs/plan.md#what-got-it-there)
  recv = -(-recv // GROUPED_ROWS) * GROUPED_ROWS
  return Layout(ep_axes, ep, gather_axes, psum_axes, token_axes, n, capacity, recv,
                min(per_dest, recv))


def routed_experts(cfg, ex: Execution, route, x_nd: jax.Array, z_nh: jax.Array,
                   router_de: jax.Array, bias_e: jax.Array, w1, w3, w2, *, in_name: str):
  """Router, dispatch and routed experts, expert-parallel on the context mesh (or on one
  device without one). `route(x, router_de, bias_e)` -> (scores, experts, weights) is the
  router; it runs per device too (the partitioner gathers every token for a sharded top_k).
  w1, w3, w2: `ExpertWeights` (dense [E, h, F] / [E, F, h] arrays, or MXFP4 codes and scales
  with optional adapters), or bare dense arrays.

  Returns u = sum_k p_k E_{T_k}(z) [N, h] (fp32), the routing (scores [N, E], experts and
  weights [N, k]) and the dropped pairs (int32 [], summed over the mesh). On a mesh, x, z, u
  and the scores have their rows split as `split_rows` puts them (over tensor too: each
  tensor rank routes its share of the rows), experts and weights as the batch."""
  dt = ex.jnp_dtype
  # an FSDP gather moves compute dtype (or codes)
  w1, w3, w2 = (expert_weights.cast(w, dt) for w in (w1, w3, w2))
  mesh = context_mesh()
  n_tokens = z_nh.shape[0]
  plan = layout(cfg, n_tokens, in_name, mesh, ex.moe_capacity_factor)
  if mesh is None:
    routing = route(x_nd, router_de, bias_e)
    u, dropped = _local(plan, cfg, ex, z_nh, routing[1], routing[2], w1, w3, w2)
    return u, routing[:3], dropped
  r_spec = logical_to_spec(("embed", "expert_scores"), mesh=mesh)
  b_spec = logical_to_spec(("expert_scores",), mesh=mesh)

  split = plan.psum_axes  # x, z, u and the scores: this device's rows, 1/tensor of them

  def body(x, z, live, r, b, w1, w3, w2):
    scores, experts, weights = route(x, _gather(r, r_spec), _gather(b, b_spec))[:3]
    if split:  # every tensor rank sends all of the device's rows (its F slice of each expert)
      experts, weights = (jax.lax.all_gather(a, split, axis=0, tiled=True, to="invarying")
                          for a in (experts, weights))
      z = jax.lax.all_gather(z, split, axis=0, tiled=True)  # backward: reduce-scatter of dz
    experts_v = jnp.where(live[:, None], experts, cfg.num_experts)  # padding: expert E, unsent
    u, dropped = _local(plan, cfg, ex, z, experts_v, weights, w1, w3, w2)
    return u, scores, experts, weights, dropped

  live = jnp.ones((n_tokens,), bool)
  pad = plan.n * math.prod(mesh.shape[a] for a in plan.token_axes) - n_tokens
  if pad:  # e.g. decode: fewer tokens than devices
    x_nd, z_nh, live = (jnp.pad(a, ((0, pad),) + ((0, 0),) * (a.ndim - 1))
                        for a in (x_nd, z_nh, live))
  tok = P(plan.token_axes or None)
  rows = P(plan.token_axes + split or None)
  w13, w2_spec = (weight_specs(plan, w, *roles) for w, roles in ((w1, ("h", "f")),
                                                                    (w2, ("f", "h"))))
  in_specs = (rows, rows, tok, r_spec, b_spec, w13, w13, w2_spec)
  args = (x_nd, z_nh, live, router_de, bias_e, w1, w3, w2)
  args = shard_map_operands(args, in_specs, mesh)
  u, scores, experts, weights, dropped = jax.shard_map(
      body, mesh=mesh, in_specs=in_specs, out_specs=(rows, rows, tok, tok, P()),
      check_vma=not _unchecked_kernels(ex))(*args)
  return u[:n_tokens], (scores[:n_tokens], experts[:n_tokens], weights[:n_tokens]), dropped


def _unchecked_kernels(ex: Execution) -> bool:
  """Whether the grouped matmul is megablox (dense experts) or the packed MXFP4 kernel built
  on its group metadata. Their pallas_calls type their outputs with no mesh axes, so they are
  traced with shard_map's varying-axes check off, leaving a body whose integer metadata mixes
  varying and invariant values. Transformations that re-evaluate the body later (the layer
  scan's linearization, the partial evaluation of a platform_dependent) re-run the check and
  refuse it, unless the shard_map itself is unchecked. Unchecked, shard_map's transpose sums
  each input's cotangent over the mesh axes its spec does not mention (and divides an
  output's over those of its spec), so the gradients stay the same; the tests compare them
  with one device."""
  return (ex.moe_grouped_matmul or default_impl()) == "megablox"


def expert_input_name(cfg) -> str:
  """The logical name of the routed experts' input width: the latent l (LatentMoE) or d."""
  return "latent" if cfg.latent_size is not None else "embed"


def row_split_axes(cfg, mesh) -> tuple[str, ...]:
  """The mesh axes that split each device's rows further in and out of `routed_experts` (the
  tensor ranks of tensor-parallel experts; none without)."""
  return layout(cfg, 1, expert_input_name(cfg), mesh).psum_axes


def split_rows(cfg, x_nd: jax.Array, in_name: str) -> jax.Array:
  """x [N, .] with its rows split as `routed_experts` takes and returns them: over the batch
  axes and then over the tensor ranks of tensor-parallel experts (identity without a mesh).
  What runs on such rows outside (the latent down/up projections, the latent norm) then runs
  once per row, not once per tensor rank."""
  mesh = context_mesh()
  if mesh is None:
    return x_nd
  plan = layout(cfg, x_nd.shape[0], in_name, mesh)
  spec = fit_spec(P(plan.token_axes + plan.psum_axes or None), x_nd.shape, dict(mesh.shape))
  return pin(x_nd, spec, mesh)


def _gather(w: jax.Array, spec: P) -> jax.Array:
  """The whole of a small replicated-by-design weight (the router) inside the shard_map."""
  for dim, entry in enumerate(spec):
    if entry is not None:
      w = jax.lax.all_gather(w, _axes(entry), axis=dim, tiled=True)
  return w


def _dims(part: str, in_role: str, out_role: str) -> tuple:
  """What each dim of an `ExpertWeights` part is: "e" the experts, "h" the input width (l or
  d), "f" moe_mlp, None neither (the adapters' rank). A packed weight's scales follow `in`
  over the tensor ranks (w2's F: each rank contracts its own slice) and are whole along h
  (lora.pack_experts never splits them along `in`)."""
  return {"dense": ("e", in_role, out_role), "codes": ("e", out_role, in_role),
          "scales": ("e", out_role, in_role if in_role == "f" else None),
          "lora_a": ("e", in_role, None), "lora_b": ("e", None, out_role)}[part]


def _role_axes(plan: Layout) -> dict:
  return {"e": plan.ep_axes, "h": plan.gather_axes, "f": plan.psum_axes, None: ()}


def weight_specs(plan: Layout, w: ExpertWeights, in_role: str, out_role: str) -> ExpertWeights:
  """The shard_map specs of an expert weight's parts (None where a part is absent): the
  experts over the exchange group, h over FSDP's gather axes, F over the tensor ranks."""
  axes = _role_axes(plan)
  if w.packed and plan.psum_axes and in_role == "f":  # w2: groups of F split over ranks
    f = w.shape()[1]
    tensor = math.prod(context_mesh().shape[a] for a in plan.psum_axes)
    if f % (GROUP * tensor):
      raise ValueError(f"MXFP4 experts: moe_intermediate_size {f} does not split into whole "
                       f"groups of {GROUP} over the {tensor} devices of mesh axes "
                       f"{plan.psum_axes}")
  return ExpertWeights(**{
      part: P(*(axes[r] or None for r in _dims(part, in_role, out_role)))
      for part in ExpertWeights._fields if getattr(w, part) is not None})


def _gathered(plan: Layout, w: ExpertWeights, in_role: str, out_role: str) -> ExpertWeights:
  """FSDP: the local experts' full h, for this layer only (packed: the codes, 4 bits a
  weight)."""
  parts = {}
  for part in ExpertWeights._fields:
    x = getattr(w, part)
    if x is not None:
      for axis, role in enumerate(_dims(part, in_role, out_role)):
        if role == "h":
          x = jax.lax.all_gather(x, plan.gather_axes, axis=axis, tiled=True)
    parts[part] = x
  return ExpertWeights(**parts)


def _local(plan: Layout, cfg, ex: Execution, z_nh, experts_nk, weights_nk, w1, w3, w2):
  """One device's part: its tokens, its experts (see the module docstring)."""
  if plan.gather_axes:  # FSDP: the local experts' full input width, for this layer only
    w1, w3 = (_gathered(plan, w, "h", "f") for w in (w1, w3))
    w2 = _gathered(plan, w2, "f", "h")
  n, k = experts_nk.shape
  m, e, ep = n * k, cfg.num_experts, plan.ep
  flat_e = experts_nk.reshape(-1)                    # padding pairs carry e: sorted last
  order = jnp.argsort(flat_e, stable=True)           # by expert, then by token
  sorted_e = flat_e[order]
  counts = jnp.zeros(e + 1, jnp.int32).at[flat_e].add(1)[:e]
  g = jax.lax.all_gather(counts, plan.ep_axes) if ep > 1 else counts[None]  # [EP, E]
  if plan.capacity is None:
    a = g
  else:  # earlier devices first, then earlier tokens: every device computes the same A
    a = jnp.clip(plan.capacity - (jnp.cumsum(g, 0) - g), 0, g)
  me = jax.lax.axis_index(plan.ep_axes) if ep > 1 else 0
  clamped = jnp.minimum(sorted_e, e - 1)
  rank = jnp.arange(m) - (jnp.cumsum(counts) - counts)[clamped]  # position in its expert's run
  keep = (sorted_e < e) & (rank < a[me][clamped])
  # kept pairs to the front, still sorted by expert (an expert keeps a prefix of its run)
  pos = jnp.where(keep, jnp.cumsum(keep) - 1, m)
  pair = jnp.zeros(m, jnp.int32).at[pos].set(order.astype(jnp.int32), mode="drop")
  live = jnp.arange(m) < jnp.sum(keep)
  token = pair // k
  x_send = z_nh[token]

  def experts(x, group_sizes):
    gmm = functools.partial(expert_weights.matmul, ex, group_sizes_e=group_sizes)
    return gmm(glu(cfg, gmm(x, w=w1), gmm(x, w=w3)), w=w2)

  if ep == 1:
    y_send = experts(x_send, a[0])
  else:
    args = (x_send, a, flat_e[pair], live, me)
    run = lambda kind: functools.partial(_exchange, kind, plan, experts)
    if ex.moe_dispatch is not None:
      y_send = run(ex.moe_dispatch)(*args)
    else:  # decided when lowered for a platform: XLA:CPU has no ragged_all_to_all
      y_send = jax.lax.platform_dependent(*args, cpu=run(Dispatch.PADDED),
                                          default=run(Dispatch.RAGGED))
  wide = wide_dtype(ex.jnp_dtype)
  p = jnp.where(live, weights_nk.reshape(-1)[pair], 0).astype(wide)
  u = jnp.zeros((n, y_send.shape[-1]), wide).at[token].add(y_send.astype(wide) * p[:, None])
  if plan.psum_axes:  # tensor-parallel experts: partial sums over F, each rank its rows' sum
    u = jax.lax.psum_scatter(u, plan.psum_axes, scatter_dimension=0, tiled=True)
  dropped = jnp.sum(flat_e < e, dtype=jnp.int32) - jnp.sum(keep, dtype=jnp.int32)
  if plan.token_axes:
    dropped = jax.lax.psum(dropped, plan.token_axes)
  return u, dropped


def _exchange(kind, plan: Layout, experts, x_send, a, expert_m, live, me):
  """Send the kept rows x_send [m, h] (expert-sorted, live ones first) to their experts'
  devices, run the local experts, bring the outputs back to the same rows."""
  ep, axes = plan.ep, plan.ep_axes
  m, h = x_send.shape
  e_loc = a.shape[1] // ep
  c = a.reshape(ep, ep, e_loc).sum(-1)         # C[i, j]: rows device i sends device j
  send_off = jnp.cumsum(c[me]) - c[me]         # my chunk for device j starts here in x_send
  recv_n = c[:, me]                            # rows I get from device i
  a_loc = jax.lax.dynamic_slice_in_dim(a, me * e_loc, e_loc, axis=1)  # [EP, E/EP] to my experts
  if kind == Dispatch.RAGGED:
    base = jnp.cumsum(recv_n) - recv_n         # device i's rows start here in my buffer
    land = (jnp.cumsum(c, 0) - c)[me]          # my rows start here in device j's buffer
    recv = jax.lax.ragged_all_to_all(x_send, _zeros_like(x_send, plan.recv),
                                     send_off, c[me], land, recv_n, axis_name=axes)
  elif kind == Dispatch.PADDED:
    base = jnp.arange(ep) * plan.slot
    dest = jnp.minimum(expert_m // e_loc, ep - 1)
    slot = jnp.where(live, dest * plan.slot + jnp.arange(m) - send_off[dest], ep * plan.slot)
    buf = jnp.zeros((ep * plan.slot, h), x_send.dtype).at[slot].set(x_send, mode="drop")
    recv = jax.lax.all_to_all(buf.reshape(ep, plan.slot, h), axes, 0, 0)
    recv = recv.reshape(ep * plan.slot, h)
  else:
    raise ValueError(f"unknown moe_dispatch {kind!r}; expected one of "
                     f"{', '.join(d.value for d in Dispatch)}")

  # received rows come device-major (each device's rows sorted by expert): to expert-major
  sizes = a_loc.T.reshape(-1)                  # (local expert, device) order
  end = jnp.cumsum(sizes)
  t = jnp.arange(plan.recv)
  seg = jnp.minimum(jnp.searchsorted(end, t, side="right"), ep * e_loc - 1)
  dev, loc = seg % ep, seg // ep
  within = jnp.cumsum(a_loc, 1) - a_loc        # local expert's start inside a device's rows
  valid = t < end[-1]
  src = jnp.where(valid, base[dev] + within[dev, loc] + t - (end[seg] - sizes[seg]), 0)
  x_em = jnp.where(valid[:, None], recv[src], 0)
  y_em = experts(x_em, jnp.sum(a_loc, 0))
  y_recv = jnp.zeros((recv.shape[0], y_em.shape[1]), y_em.dtype).at[
      jnp.where(valid, src, recv.shape[0])].set(y_em, mode="drop")

  if kind == Dispatch.RAGGED:
    back_land = (jnp.cumsum(c, 1) - c)[:, me]  # where device i's rows for me sit in its x_send
    return jax.lax.ragged_all_to_all(y_recv, _zeros_like(y_recv, m),
                                     base, recv_n, back_land, c[me], axis_name=axes)
  back = jax.lax.all_to_all(y_recv.reshape(ep, plan.slot, -1), axes, 0, 0)
  return back.reshape(ep * plan.slot, -1).at[slot].get(mode="fill", fill_value=0)


def _zeros_like(x: jax.Array, rows: int) -> jax.Array:
  """Zeros [rows, ...x's other dims] varying over the same mesh axes as x: a collective's
  output buffer takes on the type of its result."""
  zeros = jnp.zeros((rows, *x.shape[1:]), x.dtype)
  vma = tuple(sorted(jax.typeof(x).mat.varying))
  return jax.lax.pcast(zeros, vma, to="varying") if vma else zeros
