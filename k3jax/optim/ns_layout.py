"""Where Newton-Schulz runs on a mesh: whole blocks on their devices (SPEC §5, §6).

A Muon parameter is a stack of blocks: batch axes (`layers`, `experts`, `q_heads`,
`kv_heads`) index the blocks, the other axes form each block's matrix. On a mesh its
placement comes from the rules table, and Newton-Schulz costs what that placement implies:

  * mesh axes only on batch axes (per-head blocks with heads on `tensor`, experts on
    `expert`, stacked layers): every block is whole on its device, no communication;
  * a mesh axis on a block axis (`embed` / `latent` on `fsdp`, `heads` inside a whole-matrix
    block or `moe_mlp` on `tensor`): the block is split, and XLA's partitioner runs the
    iteration distributed. Measured on the compiled programs: when the split side is the long
    one it all-reduces the [m, m] Gram matrix every iteration (1 + 5 all-reduces); when it is
    the short one it all-gathers X three times per iteration (15 all-gathers, ~15x the
    block's bytes). Either way the m^3 Gram products are computed redundantly on every
    device of the split.

`ns_layout(...)` moves such mesh axes from the block axes onto a batch axis they divide (the
layer stack, the experts, the heads), so each device orthogonalises whole blocks of its own:
one all-to-all of the momentum there and one back, no collective inside the iteration, and
no redundant compute. An axis that no batch axis divides is taken by a batch axis padded with
zero blocks to a multiple of it (`ns_plan`; Newton-Schulz of a zero block is zero, and the
padding is cut off after): K3's 69 KDA layers do not divide fsdp = 2^k, and left to the
partitioner the update of KDA g_proj / o_proj (whole [7168, 96 x 128] blocks) on
fsdp=4,expert=2 all-gathers the blocks every iteration (16 collectives, 292 GiB of results per
device and parameter, benchmarks/muon_sharded.py); padded to 72 layers it is 2 all-to-alls
(11.8 GiB), for 4% more Newton-Schulz work. A stack of one block (K3's layer-0 dense MLP) would
be padded to one zero block per device, every device orthogonalising a whole [7168, 33792]
block: k3jax/optim/muon.py splits such a block's long side over the mesh instead (a psum of
the Gram matrix per iteration). Other stacks that take much padding on a large mesh remain
(K3 on fsdp=128 x tensor=8: the MLA g/o projections 43x, KDA g/o 15x, the shared experts 11x;
together about 3% of the step's model FLOPs in zero blocks).

It does so unless the split is on the long side only and the block is thin: per device and
block of m x n (m <= n) split k ways along n, the partitioner's Gram all-reduces move about
5 iterations x 2 m^2 values, the two all-to-alls about 2 m n / k; the move is made when
n < 5 k m (e.g. K3's KDA q/k/v, 7168 x 128 per head, with embed split over fsdp = 8:
7168 > 5 x 8 x 128 = 5120, so those stay with the partitioner's all-reduces).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from jax.sharding import PartitionSpec
from optax.contrib import MuonDimensionNumbers


def _axes(entry) -> tuple[str, ...]:
  return (entry,) if isinstance(entry, str) else tuple(entry or ())


def _entry(axes: Sequence[str]):
  return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def ns_layout(spec: PartitionSpec, shape: Sequence[int], dn: MuonDimensionNumbers,
              mesh_shape: Mapping[str, int]) -> PartitionSpec:
  """The placement to orthogonalise a parameter of placement `spec` in (`ns_plan`'s)."""
  return ns_plan(spec, shape, dn, mesh_shape)[0]


def ns_plan(spec: PartitionSpec, shape: Sequence[int], dn: MuonDimensionNumbers,
            mesh_shape: Mapping[str, int]) -> tuple[PartitionSpec, tuple[int, ...]]:
  """(placement, shape) to orthogonalise a parameter of placement `spec` and `shape` in: mesh
  axes (of size > 1) on block axes moved onto the first batch axis whose size they still
  divide; when none does, onto the batch axis that needs the least zero-block padding to
  become a multiple (the shape then has that axis padded)."""
  ndim = len(shape)
  shape = list(shape)
  entries = [_axes(e) for e in tuple(spec) + (None,) * (ndim - len(spec))]
  entries = [tuple(a for a in e if mesh_shape.get(a, 1) > 1) for e in entries]
  block = set(dn.reduction_axis) | set(dn.output_axis)
  batch = [i for i in range(ndim) if i not in block]
  if _thin_long_side_split(entries, shape, dn, mesh_shape):
    return PartitionSpec(*(_entry(e) for e in entries)), tuple(shape)
  target = [list(e) if i in batch else [] for i, e in enumerate(entries)]
  for i in sorted(block):
    for ax in entries[i]:
      multiple = lambda j: math.prod(mesh_shape[a] for a in target[j]) * mesh_shape[ax]  # noqa
      fits = [j for j in batch if shape[j] % multiple(j) == 0]
      if not fits and batch:  # pad the batch axis that grows least (zero blocks)
        j = min(batch, key=lambda j: (-(-shape[j] // multiple(j)) * multiple(j) - shape[j]))
        shape[j] = -(-shape[j] // multiple(j)) * multiple(j)
        fits = [j]
      if fits:
        target[fits[0]].append(ax)
      else:  # a single block (no batch axis): it stays split there
        target[i].append(ax)
  return PartitionSpec(*(_entry(t) for t in target)), tuple(shape)


def _thin_long_side_split(entries, shape, dn: MuonDimensionNumbers,
                          mesh_shape: Mapping[str, int]) -> bool:
  """Only the long side of the block is split (k ways) and n >= 5 k m (module docstring)."""
  sides = []
  for axes in (dn.reduction_axis, dn.output_axis):
    size = math.prod(shape[i] for i in axes)
    ways = math.prod(mesh_shape[a] for i in axes for a in entries[i])
    sides.append((size, ways))
  (m, k_short), (n, k_long) = sorted(sides)
  return k_short == 1 and k_long > 1 and n >= 5 * k_long * m


def moves(home: PartitionSpec, there: PartitionSpec, ndim: int) -> list[PartitionSpec]:
  """The placements from `home` to `there` moving one mesh axis at a time (each step is a
  plain all-to-all between two dimensions; XLA lowers a many-axis move in one constraint to
  all-gathers instead). The last entry is `there`."""
  cur = [list(_axes(e)) for e in tuple(home) + (None,) * (ndim - len(home))]
  goal = [list(_axes(e)) for e in tuple(there) + (None,) * (ndim - len(there))]
  steps = []
  for j, axes in enumerate(goal):
    for ax in axes:
      if ax in cur[j]:
        continue
      for i, e in enumerate(cur):
        if ax in e:
          e.remove(ax)
      cur[j].append(ax)
      steps.append(PartitionSpec(*(_entry(e) for e in cur)))
  if not steps or steps[-1] != there:
    steps.append(there)
  return steps
