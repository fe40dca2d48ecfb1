"""Where Newton-Schulz runs on a mesh: whole blocks on their devices (docs/muon.md).

A Muon parameter is a stack of blocks: batch axes (`layers`, `experts`, `q_heads`,
`kv_heads`) index the blocks, the other axes form each block's matrix. On a mesh its
placement comes from the rules table, and Newton-Schulz costs what that placement implies:

  * mesh axes only on batch axes (per-head blocks with heads on `tensor`, experts on
    `expert`, stacked layers): every block is whole on its device, no communication;
  * a mesh axis on a block axis (`embed` / `latent` on `fsdp`, `heads` inside a whole-matrix
    block or `moe_mlp` on `tensor`): the block is split, and XLA's partitioner runs the
    iteration distributed. In the compiled programs, when the split side is the long one it
    all-reduces the [m, m] Gram matrix every iteration; when it is the short one it
    all-gathers X three times per iteration. Either way the m^3 Gram products are computed
    redundantly on every device of the split.

`ns_layout(...)` moves such mesh axes from the block axes onto a batch axis they divide (the
layer stack, the experts, the heads), so each device orthogonalises whole blocks of its own:
one all-to-all of the momentum there and one back, no collective inside the iteration, and
no redundant compute. An axis that no batch axis divides is taken by a batch axis padded with
zero blocks to a multiple of it (`ns_placement`; Newton-Schulz of a zero block is zero, and the
padding is cut off after): K3's 69 KDA layers do not divide fsdp = 2^k, and padded to 72 on
fsdp = 4 their g_proj / o_proj blocks are orthogonalised whole instead of all-gathered every
iteration (benchmarks/muon_sharded.py; the figures are in docs/benchmarks.md).

Padding stops paying when a stack has far fewer blocks than devices: on K3's fsdp=128 x
tensor=8 pod mesh the MLA g/o projections (24 layers) would be padded to 1024 blocks, KDA g/o
(69) and the shared experts (92) too, and layer 0's dense MLP (one block) to 1024 zero-block
copies of itself. So `ns_placement` also tries leaving mesh axes split along each block's long
side (k ways; the Gram matrix psummed every iteration, k3jax/optim/muon.py) and takes the
placement of least `ns_cost`, matmul FLOPs plus the all-reduced bytes priced in FLOPs: K3's g/o
and shared-expert stacks keep `tensor` on their long side and take `fsdp` on the layers
(padded to 128), and the dense MLP splits over both.

It does so unless the split is on the long side only and the block is thin: per device and
block of m x n (m <= n) split k ways along n, the partitioner's Gram all-reduces move about
5 iterations x 2 m^2 values, the two all-to-alls about 2 m n / k; the move is made when
n < 5 k m (e.g. K3's KDA q/k/v, 7168 x 128 per head, with embed split over fsdp = 8:
7168 > 5 x 8 x 128 = 5120, so those stay with the partitioner's all-reduces).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from jax.sharding import PartitionSpec
from optax.contrib import MuonDimensionNumbers

from k3jax.optim.groups import block_shape


def _axes(entry) -> tuple[str, ...]:
  return (entry,) if isinstance(entry, str) else tuple(entry or ())


def _entry(axes: Sequence[str]):
  return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


class NSPlacement(NamedTuple):
  """Where Newton-Schulz runs. `there`: the placement (of the padded parameter) with every mesh
  axis not in `split` moved off the block axes onto a batch axis; `shape`: the parameter's
  shape with that batch axis padded with zero blocks (the parameter's own where no padding
  is needed); `split`: mesh axes over which each block's long side stays split (one psum of
  the [m, m] Gram matrix per iteration, k3jax/optim/muon.py), () for whole blocks."""
  there: PartitionSpec
  shape: tuple[int, ...]
  split: tuple[str, ...] = ()


def ns_layout(spec: PartitionSpec, shape: Sequence[int], dn: MuonDimensionNumbers,
              mesh_shape: Mapping[str, int]) -> PartitionSpec:
  """The placement to orthogonalise a parameter of placement `spec` in (`ns_placement`'s)."""
  return ns_placement(spec, shape, dn, mesh_shape).there


def ns_placement(spec: PartitionSpec, shape: Sequence[int], dn: MuonDimensionNumbers,
                 mesh_shape: Mapping[str, int]) -> NSPlacement:
  """The cheapest `NSPlacement` (by `ns_cost`) for a parameter of placement `spec` and `shape`:
  each subset of the mesh axes on the block axes that divides the long side is tried as the
  split; the other axes move onto the first batch axis whose size they still divide, or,
  where none does, onto the batch axis that needs the least zero-block padding to become a
  multiple."""
  ndim = len(shape)
  entries = [_axes(e) for e in tuple(spec) + (None,) * (ndim - len(spec))]
  entries = [tuple(a for a in e if mesh_shape.get(a, 1) > 1) for e in entries]
  if _thin_long_side_split(entries, list(shape), dn, mesh_shape):
    return NSPlacement(PartitionSpec(*(_entry(e) for e in entries)), tuple(shape))
  block = sorted(set(dn.reduction_axis) | set(dn.output_axis))
  on_blocks = [a for i in block for a in entries[i]]
  long_side = max(math.prod(shape[i] for i in dn.reduction_axis),
                  math.prod(shape[i] for i in dn.output_axis))
  options = []
  for r in range(len(on_blocks) + 1):
    for split in itertools.combinations(on_blocks, r):
      if long_side % math.prod(mesh_shape[a] for a in split) == 0:
        option = _batch_placement(entries, shape, block, split, mesh_shape)
        leftover = [a for i in block for a in _axes(option.there[i]) if a not in split]
        if not (split and leftover):  # a split one holds its blocks whole but for `split`
          options.append(option)
  return min(options, key=lambda p: ns_cost(p, dn, mesh_shape))  # ties: fewest split axes


def _batch_placement(entries, shape, block, split, mesh_shape) -> NSPlacement:
  """The NSPlacement with `split` on the long side and the other block-axis mesh axes on batch
  axes (padded where they divide none)."""
  shape = list(shape)
  batch = [i for i in range(len(shape)) if i not in block]
  target = [list(e) if i in batch else [a for a in e if a in split]
            for i, e in enumerate(entries)]
  for i in block:
    for ax in entries[i]:
      if ax in split:
        continue
      multiple = lambda j: math.prod(mesh_shape[a] for a in target[j]) * mesh_shape[ax]  # noqa: B023 - called in this iteration only
      fits = [j for j in batch if shape[j] % multiple(j) == 0]
      if not fits and batch:  # pad the batch axis that grows least (zero blocks)
        j = min(batch, key=lambda j: (-(-shape[j] // multiple(j)) * multiple(j) - shape[j]))
        shape[j] = -(-shape[j] // multiple(j)) * multiple(j)
        fits = [j]
      if fits:
        target[fits[0]].append(ax)
      else:  # a single block (no batch axis): it stays split there
        target[i].append(ax)
  return NSPlacement(PartitionSpec(*(_entry(t) for t in target)), tuple(shape), tuple(split))


# Newton-Schulz runs at HIGHEST precision (fp32 matmuls, a fraction of a TPU's bf16 peak),
# against what one ring axis of the torus all-reduces per chip: the price of a byte in fp32
# FLOPs, an estimate from published chip figures (docs/muon.md#cost).
FLOPS_PER_ALL_REDUCED_BYTE = 500.0


def ns_cost(placement: NSPlacement, dn: MuonDimensionNumbers,
            mesh_shape: Mapping[str, int]) -> float:
  """Per device and iteration, in FLOPs: `ns_flops` plus FLOPS_PER_ALL_REDUCED_BYTE times the
  bytes of the Gram all-reduces (2 (k-1)/k m^2 fp32 values per block on a ring of k). The
  moves there and back cost about the same for every placement and are not counted."""
  local, m, _, k = _local_blocks(placement, dn, mesh_shape)
  comm = local * 2 * (k - 1) / k * m * m * 4 * FLOPS_PER_ALL_REDUCED_BYTE if k > 1 else 0.0
  return ns_flops(placement, dn, mesh_shape) + comm


def ns_flops(placement: NSPlacement, dn: MuonDimensionNumbers,
             mesh_shape: Mapping[str, int]) -> float:
  """Matmul FLOPs per device and Newton-Schulz iteration under `placement`: this device's blocks
  (zero blocks included) of m x n (m <= n) with the long side split k ways, each
  min(4 m^2 n/k + 2 m^3, 6 m^2 n/k); the second computes A (A X) instead of (A A) X, which
  pays once n/k < m (k3jax/optim/muon.py)."""
  local, m, n, k = _local_blocks(placement, dn, mesh_shape)
  return local * min(4 * m * m * n / k + 2 * m**3, 6 * m * m * n / k)


def _local_blocks(placement: NSPlacement, dn: MuonDimensionNumbers,
                  mesh_shape: Mapping[str, int]):
  """(blocks per device, m, n, k): blocks m x n (m <= n), the long side split k ways."""
  blocks, fan_in, fan_out = block_shape(placement.shape, dn)
  m, n = sorted((fan_in, fan_out))
  ways = math.prod(mesh_shape[a] for e in placement.there for a in _axes(e)
                   if a not in placement.split)
  return blocks / ways, m, n, math.prod(mesh_shape[a] for a in placement.split)


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
      for e in cur:
        if ax in e:
          e.remove(ax)
      cur[j].append(ax)
      steps.append(PartitionSpec(*(_entry(e) for e in cur)))
  if not steps or steps[-1] != there:
    steps.append(there)
  return steps
