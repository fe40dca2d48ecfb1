"""Grouped matmul of expert-sorted rows: y[i] = x[i] @ w[expert of row i] (dropless MoE).

    grouped_matmul(x_mh, w_ehf, group_sizes_e, impl=None) -> y_mf

Rows arrive sorted by expert, `group_sizes` [E] of them per expert. The groups may fill only
a prefix of the rows (sum <= m, as in the fixed-size buffers of expert parallelism): rows past
the last group give zeros. Two implementations, equal up to float summation order:

  "ragged_dot"  jax.lax.ragged_dot: XLA's grouped matmul (MXU / tensor-core kernels on TPU and
                GPU). XLA:CPU lowers it without tiling by group, far slower than a dense
                matmul of the same FLOPs (benchmarks/grouped_matmul.py measures it).
  "tiled"       every group is padded to a multiple of `tile` rows, so each tile of rows
                belongs to one expert; the tiles then run as one batched matmul against their
                experts' weights (gathered per tile). Static shapes: at most ceil(m / tile) + E
                tiles, so padding costs at most E * tile rows, and every tile is a plain
                matmul that XLA:CPU's dot emitter handles well.

impl=None picks "tiled" on CPU and "ragged_dot" elsewhere. With no more rows than experts
(decoding: batch x k rows), "tiled" instead gathers each row's expert matrix: a decode step
then reads only the k selected experts per token, not a padded tile of every expert.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

IMPLS = ("ragged_dot", "tiled")
# ragged_dot's rows are padded to a multiple of this: XLA:TPU's ragged_dot kernel takes row
# counts that are multiples of 8, any other count a dense fallback that multiplies every row
# by every expert (E times the FLOPs). Callers that size their buffers (sharding/
# expert_parallel.py) align them already and pay no copy.
ROWS = 32
TILE = 128  # rows per tile; the padding waste (< E * TILE rows) buys fewer, larger matmuls


def default_impl() -> str:
  return "tiled" if jax.default_backend() == "cpu" else "ragged_dot"


def grouped_matmul(x_mh: jax.Array, w_ehf: jax.Array, group_sizes_e: jax.Array, *,
                   impl: str | None = None, precision=None, tile: int = TILE) -> jax.Array:
  impl = impl or default_impl()
  if impl == "ragged_dot":
    m = x_mh.shape[0]
    pad = -m % ROWS
    if pad:  # (rows past the last group give zeros either way)
      x_mh = jnp.pad(x_mh, ((0, pad), (0, 0)))
    y = jax.lax.ragged_dot(x_mh, w_ehf, group_sizes_e, precision=precision)
    return y[:m] if pad else y
  if impl != "tiled":
    raise ValueError(f"unknown grouped matmul {impl!r}; expected one of {IMPLS}")
  m, e = x_mh.shape[0], w_ehf.shape[0]
  expert_m = jnp.repeat(jnp.arange(e), group_sizes_e, total_repeat_length=m)
  filled_m = jnp.arange(m) < jnp.sum(group_sizes_e)
  if m <= e:  # decode-sized: m expert matrices read, never more than the E + 1 tiles below
    y_mf = jnp.einsum("mh,mhf->mf", x_mh, w_ehf[expert_m], precision=precision)
    return jnp.where(filled_m[:, None], y_mf, 0)
  n_tiles = -(-m // tile) + e
  padded_e = (group_sizes_e + tile - 1) // tile * tile
  padded_end_e = jnp.cumsum(padded_e)
  start_e = jnp.cumsum(group_sizes_e) - group_sizes_e
  # row i of group g goes to (padded start of g) + (i - start of g); rows past the groups
  # go nowhere (an out-of-range position, dropped on write, read back as 0)
  pos_m = padded_end_e[expert_m] - padded_e[expert_m] + jnp.arange(m) - start_e[expert_m]
  pos_m = jnp.where(filled_m, pos_m, n_tiles * tile)
  x_pad = jnp.zeros((n_tiles * tile, x_mh.shape[1]), x_mh.dtype).at[pos_m].set(
      x_mh, mode="drop", unique_indices=True)
  # tiles past the last group hold only zeros; any expert index will do for them
  expert_j = jnp.minimum(
      jnp.searchsorted(padded_end_e, jnp.arange(n_tiles) * tile, side="right"), e - 1)
  y_jtf = jnp.einsum("jth,jhf->jtf", x_pad.reshape(n_tiles, tile, -1), w_ehf[expert_j],
                     precision=precision)
  return y_jtf.reshape(n_tiles * tile, -1).at[pos_m].get(mode="fill", fill_value=0)
