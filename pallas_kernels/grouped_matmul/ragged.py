"""Grouped matmul by XLA's own op, jax.lax.ragged_dot ("ragged_dot"; the default on GPU).

XLA lowers it to MXU / tensor-core kernels on TPU and GPU. XLA:CPU lowers it without tiling by
group, far slower than a dense matmul of the same FLOPs (benchmarks/grouped_matmul.py measures
it).
"""

from __future__ import annotations

import jax

from pallas_kernels.grouped_matmul.common import pad_rows

# The rows are padded to a multiple of this: XLA:TPU's ragged_dot kernel takes row counts that
# are multiples of 8, any other count a dense fallback that multiplies every row by every expert
# (E times the FLOPs). Callers that size their buffers (sharding/expert_parallel.py) align them
# already and pay no copy.
ROWS = 32


def grouped_matmul(x_mh: jax.Array, w_ehf: jax.Array, group_sizes_e: jax.Array, *,
                   precision=None) -> jax.Array:
  m = x_mh.shape[0]
  # (rows past the last group give zeros either way)
  y = jax.lax.ragged_dot(pad_rows(x_mh, ROWS), w_ehf, group_sizes_e, precision=precision)
  return y[:m] if y.shape[0] != m else y
