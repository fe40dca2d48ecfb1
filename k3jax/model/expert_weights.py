"""A routed expert weight as the grouped matmuls take it: dense, or MXFP4-packed (+ LoRA).

    ExpertWeights(dense=w)                          w [E, in, out]
    ExpertWeights(codes=c, scales=s)                c [E, out, in/2], s [E, out, in/32] (uint8)
    ExpertWeights(codes=c, scales=s, lora_a=a, lora_b=b)   a [E, in, r], b [E, r, out]

    matmul(ex, x, w, group_sizes) = x W  (+ (x a) b)

A packed weight stays packed: `grouped_matmul_mxfp4` dequantises it a tile at a time inside
the product (pallas_kernels/mxfp4/ops.py), never a whole float copy of a layer's stack. LoRA
adapters on a packed expert run beside it as two low-rank grouped matmuls, x W + (x A)(s B)
with the scale folded into b, which keeps the base packed (the dense forms fold the update
into the weight first: W + s A B). Those are the same product in exact arithmetic; in floats
the low-rank path rounds the update on its own instead of into W (in bf16 a small update
folded into W would be lost to W's rounding).

A NamedTuple of arrays (absent parts None): a pytree that `jax.shard_map` and the layer scan
carry like a single array.
"""

from __future__ import annotations

from typing import NamedTuple

import jax

from k3jax.execution import Execution
from pallas_kernels.grouped_matmul import grouped_matmul
from pallas_kernels.mxfp4.ops import grouped_matmul_mxfp4

# the packed product's implementation for each of grouped_matmul's: the Pallas kernel where
# megablox runs (TPU), else the tile loop (ragged_dot has no packed form)
PACKED_IMPL = {"megablox": "pallas", "tiled": "tiled", "ragged_dot": "tiled"}


class ExpertWeights(NamedTuple):
  dense: jax.Array | None = None
  codes: jax.Array | None = None
  scales: jax.Array | None = None
  lora_a: jax.Array | None = None
  lora_b: jax.Array | None = None  # already times the LoRA scale

  @property
  def packed(self) -> bool:
    return self.codes is not None

  def shape(self) -> tuple[int, int, int]:
    """[E, in, out] of the weight."""
    if self.dense is not None:
      return tuple(self.dense.shape)
    e, out, half = self.codes.shape
    return e, 2 * half, out


def matmul(ex: Execution, x_mk: jax.Array, w: ExpertWeights, group_sizes_e: jax.Array
           ) -> jax.Array:
  """y [m, out] = x [m, in] W_g(row) (+ the adapters' product): the routed experts' grouped
  matmul, rows sorted by expert, `group_sizes_e` of them per expert (rows past the last group
  give zeros)."""
  impl, precision = ex.moe_grouped_matmul, ex.precision
  if not w.packed:
    return grouped_matmul(x_mk, w.dense, group_sizes_e, impl=impl, precision=precision)
  y = grouped_matmul_mxfp4(x_mk, w.codes, w.scales, group_sizes_e,
                           impl=PACKED_IMPL.get(impl), precision=precision)
  if w.lora_a is not None:
    xa = grouped_matmul(x_mk, w.lora_a, group_sizes_e, impl=impl, precision=precision)
    y = y + grouped_matmul(xa, w.lora_b, group_sizes_e, impl=impl, precision=precision)
  return y


def cast(w: ExpertWeights | jax.Array, dtype) -> ExpertWeights:
  """w with its float parts in `dtype` (the codes and scales stay as they are); a bare array
  is a dense weight."""
  if not isinstance(w, ExpertWeights):
    w = ExpertWeights(dense=w)
  return w._replace(**{f: getattr(w, f).astype(dtype) for f in ("dense", "lora_a", "lora_b")
                       if getattr(w, f) is not None})
