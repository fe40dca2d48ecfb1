"""The one table that maps logical axis names to mesh axes (docs/sharding.md#the-rules-table).

Layers annotate every parameter with logical names only (nnx metadata `out_sharding`) and call
`sharding.constrain(x, names)` on activations at layer boundaries; this table decides where
both go. It has two columns: where a parameter axis of that name lives (optimizer state lives
exactly where its parameter does), and where an activation axis of that name lives. They
differ for `batch` (activations split over data x fsdp x expert, the expert axis doubling as
data parallelism as in MaxText), and for the weight-only fsdp axes (`embed`, `latent`): FSDP
splits a weight's model width and gathers it for use, while activations keep their width
whole and are split by batch instead.

Names and what they mean:

  layers        stacking axis of the per-kind layer stacks (one entry per layer of that kind)
  vocab, embed  vocabulary and model width d
  q_heads       heads of a per-head *query* projection (KDA q_proj, MLA q_b_proj / q_proj)
  kv_heads      heads of a per-head key/value projection (KDA k_proj/v_proj, MLA k_b/v_b)
  heads         every other head axis (output gates, o_proj inputs, decay gate, beta, conv)
  head_dim      KDA key/value width per head (128), MLA value width per head
  qk_head_dim   MLA query/key width per head (nope + rope, 192)
  qk_nope_dim   MLA key width per head produced by k_b (128)
  q_lora, kv_lora   MLA low-rank widths (kv_lora also covers the 64 shared rope dims)
  gate_rank     rank of KDA's factorised decay gate (f_a/f_b) and Kimi-Linear's output gate
  conv          taps of the short causal convolution
  mlp           width of dense and shared-expert MLPs
  experts       routed-expert axis of expert weights
  expert_scores router output axis (one score per expert; the router is one whole matrix)
  latent        LatentMoE width l
  moe_mlp       routed-expert intermediate width
  moe_mlp_groups  MXFP4 scale groups (of 32) along moe_mlp (w2's packed scales)
  batch, length activations (rows and positions; positions split over `context`)
  tokens        flattened [batch x length] rows (the MoE's tokens): batch axes, then context

Per-Head Muon reads the same names: `layers`, `experts`, `q_heads`, `kv_heads` are batch axes
of a weight (one orthogonalisation per entry); `heads` is part of the matrix.

Expert weights [E, h, F] take `fsdp` as more expert parallelism: `experts` -> expert x fsdp
when E divides over both, else `expert` alone (a second, fallback row) and then `latent`/`embed`
take `fsdp` as in every other weight. Either way a device holds E h F / (expert fsdp tensor)
of each stack; on the first the weights never move (the expert-parallel layer exchanges tokens
over expert x fsdp; Newton-Schulz runs on whole blocks), on the fallback every layer
all-gathers its local experts over fsdp inside the layer (462 MB bf16 per layer at K3 with
EP = 128) and Muon moves the blocks once per step (k3jax/optim/ns_layout.py). K3's 896
experts take expert x fsdp up to 128 (or 7 x 2^k) devices.

A `context` axis (one sequence's positions split over it: docs/sharding.md#context-parallelism)
splits activations' `length`, and weights like `fsdp` does (`WEIGHT_SHARDS`): its devices hold
parts of one sequence, so without it each would hold every weight the batch axes do not split;
expert stacks take it as more expert parallelism (`experts` -> expert x fsdp x context).

Rows are tried in order: a row applies when its mesh axes are free in the array (Flax's
priority rule, each mesh axis at most once per array) and, given the array's shape, when they
divide the dimension and a later row for the same name exists (the fallback); the last row of
a name always applies, so a mesh that cannot split an array is refused by placement.py.

Flax's own machinery applies the table: `flax.linen.logical_to_mesh_axes` (priority rules in
table order, each mesh axis used at most once per array) for one tuple of names, here in
`logical_to_spec`; placement.py makes every NamedSharding from it. (`nnx.get_partition_spec`
maps names one by one, so [embed, latent] would get (fsdp, fsdp); and neither knows shapes.)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
from flax import linen
from jax.sharding import PartitionSpec

MESH_AXES: tuple[str, ...] = ("data", "fsdp", "expert", "context", "tensor")
BATCH_MESH_AXES: tuple[str, ...] = ("data", "fsdp", "expert")  # what splits the batch
CONTEXT_AXIS = "context"  # what splits a sequence's positions (context parallelism)
# the rows of flattened [batch x length] activations (the MoE's tokens): batch-major, so a
# [B, T] array split (batch, length) flattens to rows split over these axes in this order
TOKEN_MESH_AXES: tuple[str, ...] = BATCH_MESH_AXES + (CONTEXT_AXIS,)
# what splits a weight's model width (FSDP): `fsdp`, and `context`, whose devices hold one
# sequence between them and so would otherwise each hold every weight
WEIGHT_SHARDS: tuple[str, ...] = ("fsdp", CONTEXT_AXIS)

Target = str | tuple[str, ...] | None

# logical name, placement of a parameter axis, placement of an activation axis
TABLE: tuple[tuple[str, Target, Target], ...] = (
    ("batch", None, BATCH_MESH_AXES),
    # context parallelism: a sequence's positions split over `context`; KDA and MLA see the
    # whole sequence through k3jax/model/context_parallel.py (docs/sharding.md)
    ("length", None, CONTEXT_AXIS),
    ("tokens", None, TOKEN_MESH_AXES),
    ("layers", None, None),
    ("vocab", "tensor", "tensor"),
    # before embed/latent: an expert stack's experts take fsdp first (module docstring)
    ("experts", ("expert", "fsdp", CONTEXT_AXIS), ("expert", "fsdp", CONTEXT_AXIS)),
    ("experts", ("expert", "fsdp"), ("expert", "fsdp")),  # E not over expert x fsdp x context
    ("experts", "expert", "expert"),  # when E does not split over expert x fsdp
    ("embed", WEIGHT_SHARDS, None),
    ("q_heads", "tensor", "tensor"),
    ("kv_heads", "tensor", "tensor"),
    ("heads", "tensor", "tensor"),
    ("head_dim", None, None),
    ("qk_head_dim", None, None),
    ("qk_nope_dim", None, None),
    # the low-rank input of a per-head up-projection (MLA q_b/k_b/v_b, KDA f_b/g_b): fsdp,
    # or those stacks sit whole on every fsdp device (K3: 2 GiB per fp32 copy at fsdp=512);
    # the down-projection [embed, rank] keeps fsdp on embed (each mesh axis once per array)
    # (each with a whole fallback row for a rank fsdp does not divide: K3's gate rank 128)
    ("q_lora", WEIGHT_SHARDS, None),
    ("q_lora", None, None),
    ("kv_lora", WEIGHT_SHARDS, None),
    ("kv_lora", None, None),
    ("gate_rank", WEIGHT_SHARDS, None),
    ("gate_rank", None, None),
    ("conv", None, None),
    ("mlp", "tensor", "tensor"),
    ("expert_scores", None, None),
    ("latent", WEIGHT_SHARDS, None),
    ("moe_mlp", "tensor", "tensor"),
    # MXFP4 scales of w2 along moe_mlp (one per group of 32): split with the codes where the
    # groups divide over tensor, else whole (the packed matmul refuses such a mesh when it
    # runs: a rank would hold part of a group)
    ("moe_mlp_groups", "tensor", "tensor"),
    ("moe_mlp_groups", None, None),
    # the serving engine's caches (k3jax/model/paged.py): in one pool every device indexes
    # any request slot and any latent page (the pages hold the MLA latent, which has no head
    # axis to split); pools in shards (EngineConfig.data_shards) split the shards over the
    # batch axes, each device serving its own shards' requests; the KDA state's heads follow
    # `heads`
    ("slots", None, None),
    ("pages", None, None),
    ("pool_shards", None, BATCH_MESH_AXES),
    # a pool's pages split by position over `context` (EngineConfig.context_shards): one
    # stripe per device, after the shards' split over the batch axes when there are shards
    ("page_stripes", None, CONTEXT_AXIS),
    ("pool_shard_stripes", None, TOKEN_MESH_AXES),
    ("page", None, None),
)

# (logical name, mesh axis or tuple of mesh axes or None), Flax's LogicalRules format
LOGICAL_AXIS_RULES: tuple[tuple[str, Target], ...] = tuple((n, p) for n, p, _ in TABLE)
ACTIVATION_RULES: tuple[tuple[str, Target], ...] = tuple((n, a) for n, _, a in TABLE)

KNOWN_AXES = frozenset(name for name, _, _ in TABLE)


def _check_names(names: Sequence[str | None]) -> None:
  for name in names:
    if name is not None and name not in KNOWN_AXES:
      raise KeyError(f"logical axis {name!r} has no sharding rule")


def logical_to_spec(
    names: Sequence[str | None],
    rules: Sequence[tuple[str, Target]] = LOGICAL_AXIS_RULES,
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
    shape: Sequence[int] | None = None,
) -> PartitionSpec:
  """PartitionSpec for a tuple of logical names (Flax's `logical_to_mesh_axes`: a mesh axis is
  used at most once per array). With `mesh`, axes it lacks or has at size 1 are dropped; with
  `mesh` and `shape`, a row whose axes do not divide its dimension gives way to the next row
  for that name (module docstring)."""
  _check_names(names)
  if mesh is not None and shape is not None:
    rules = _fitting_rules(names, shape, rules, dict(mesh.shape))
  spec = linen.logical_to_mesh_axes(tuple(names), tuple(rules))
  if mesh is None:
    return spec
  return PartitionSpec(*(_keep(entry, lambda ax: mesh.shape.get(ax, 1) > 1) for entry in spec))


def _fitting_rules(names, shape, rules, mesh_shape):
  """`rules` without the rows that do not divide their dimension of `shape` when a later row
  for the same name remains to fall back on."""
  if len(names) != len(shape):
    raise ValueError(f"logical names {tuple(names)} for an array of shape {tuple(shape)}")
  dims = {name: size for name, size in zip(names, shape) if name is not None}
  out = []
  for i, (name, target) in enumerate(rules):
    later = any(n == name for n, _ in rules[i + 1:])
    if name in dims and later and dims[name] % axes_size(target, mesh_shape):
      continue
    out.append((name, target))
  return tuple(out)


def _keep(entry, pred):
  axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
  kept = tuple(ax for ax in axes if pred(ax))
  return None if not kept else kept[0] if len(kept) == 1 else kept


def axes_size(entry, mesh_shape: Mapping[str, int]) -> int:
  """How many ways one PartitionSpec entry splits its dimension."""
  axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
  return math.prod(mesh_shape.get(ax, 1) for ax in axes)


def fit_spec(spec: PartitionSpec, shape: Sequence[int],
             mesh_shape: Mapping[str, int]) -> PartitionSpec:
  """`spec` with each entry cut to the longest prefix of its mesh axes whose product divides
  the dimension (activations of a shape the mesh does not divide, e.g. a 2-row reference batch
  on 4 data-parallel devices, are split as far as they can be instead of failing)."""
  out = []
  for entry, size in zip(tuple(spec) + (None,) * (len(shape) - len(spec)), shape):
    axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
    kept: list[str] = []
    for ax in axes:
      if size % (axes_size(tuple(kept) + (ax,), mesh_shape)) != 0:
        break
      kept.append(ax)
    out.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
  return PartitionSpec(*out)
