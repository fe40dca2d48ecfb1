"""The one table that maps logical axis names to mesh axes (SPEC §6).

Layers annotate every parameter with logical names only (nnx metadata `out_sharding`); this
table decides placement. Names and what they mean:

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
  batch, length activations

Per-Head Muon reads the same names: `layers`, `experts`, `q_heads`, `kv_heads` are batch axes
of a weight (one orthogonalisation per entry); `heads` is part of the matrix.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.sharding import PartitionSpec

MESH_AXES: tuple[str, ...] = ("data", "fsdp", "expert", "tensor")

# (logical name, mesh axis or tuple of mesh axes or None)
LOGICAL_AXIS_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp", "expert")),
    ("length", None),
    ("layers", None),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("heads", "tensor"),
    ("head_dim", None),
    ("qk_head_dim", None),
    ("qk_nope_dim", None),
    ("q_lora", None),
    ("kv_lora", None),
    ("gate_rank", None),
    ("conv", None),
    ("mlp", "tensor"),
    ("experts", "expert"),
    ("expert_scores", None),
    ("latent", "fsdp"),
    ("moe_mlp", "tensor"),
)

KNOWN_AXES = frozenset(name for name, _ in LOGICAL_AXIS_RULES)


def logical_to_spec(
    names: Sequence[str | None],
    rules: Sequence[tuple[str, str | tuple[str, ...] | None]] = LOGICAL_AXIS_RULES,
    mesh: jax.sharding.Mesh | None = None,
) -> PartitionSpec:
  """PartitionSpec for a tuple of logical names. A mesh axis is used at most once per array;
  axes the mesh lacks (or of size 1 when `mesh` is given) are dropped."""
  table = dict(rules)
  used: set[str] = set()
  out = []
  for name in names:
    if name is not None and name not in table:
      raise KeyError(f"logical axis {name!r} has no sharding rule")
    target = table.get(name) if name is not None else None
    axes = (target,) if isinstance(target, str) else (target or ())
    keep = []
    for ax in axes:
      if ax in used or (mesh is not None and (ax not in mesh.shape or mesh.shape[ax] == 1)):
        continue
      keep.append(ax)
      used.add(ax)
    out.append(None if not keep else keep[0] if len(keep) == 1 else tuple(keep))
  return PartitionSpec(*out)
