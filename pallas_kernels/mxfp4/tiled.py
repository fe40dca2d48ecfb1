"""Grouped matmul over MXFP4-packed experts, tile by tile in XLA (CPU, and GPU where no packed
kernel exists): at most one expert's weights dequantised at a time.

The rows are laid out as grouped_matmul's "tiled" lays them out (every group padded to a
multiple of `tile` rows, so each row tile belongs to one expert), then a loop runs over the
tiles the groups fill (a trip count known at run time: no work for the padding tiles past
the last group): each step dequantises its tile's expert, [in, out] from codes [out, in/2]
and scales [out, in/32], and multiplies the tile by it. With no more rows than experts
(decoding) the loop runs over the rows instead, one expert per row.

Every step computes what grouped_matmul's "tiled" computes for the same tile (the same
operands, the same dot), so the result is the dequantise-then-multiply reference's, bit for
bit on XLA:CPU (the tests check it). Temporaries: the padded rows (as "tiled" has them) and
one expert's dequantised weights, never the stack.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.grouped_matmul import TILE
from pallas_kernels.grouped_matmul.common import tile_for
from pallas_kernels.mxfp4.format import dequantize
from pallas_kernels.vma import vary_like


def _weight(codes, scales, g, dtype) -> jax.Array:
  """Expert g's weights [in, out]."""
  return dequantize(codes[g], scales[g], dtype)


def grouped_matmul_mxfp4_tiled(x_mk: jax.Array, codes: jax.Array, scales: jax.Array,
                               group_sizes_e: jax.Array, *, transpose: bool = False,
                               tile: int = TILE, precision=None) -> jax.Array:
  """x [m, in] @ W_g(row) (transpose: x [m, out] @ W_g(row)^T); codes [E, out, in/2], scales
  [E, out, in/32]. Rows past the last group give zeros. Not differentiable itself (ops.py's
  custom_vjp calls it both ways)."""
  m, e = x_mk.shape[0], codes.shape[0]
  n = 2 * codes.shape[2] if transpose else codes.shape[1]
  dtype = x_mk.dtype
  expert_m = jnp.repeat(jnp.arange(e), group_sizes_e, total_repeat_length=m)
  filled = jnp.sum(group_sizes_e)
  like = (x_mk, codes, scales, group_sizes_e)
  # the einsums grouped_matmul's "tiled" runs, on a batch of one (transpose: the ones its
  # autodiff runs for the input's gradient)
  def dot(eq, a, b):
    if transpose:
      x, w, y = eq.replace("->", ",").split(",")
      eq = f"{y},{w}->{x}"
    return jnp.einsum(eq, a, b, precision=precision)

  if m <= e:  # decode-sized: one expert per row, as "tiled" gathers them
    def row(i, y_mn):
      w = _weight(codes, scales, expert_m[i], dtype)
      y_1n = dot("mh,mhf->mf", jax.lax.dynamic_slice_in_dim(x_mk, i, 1), w[None])
      return jax.lax.dynamic_update_slice_in_dim(y_mn, y_1n.astype(dtype), i, 0)
    return jax.lax.fori_loop(0, filled, row, vary_like(jnp.zeros((m, n), dtype), *like))

  tile = tile_for(m, e, tile)  # as "tiled" picks it: the same tiles, the same dots
  n_tiles = -(-m // tile) + e
  padded_e = (group_sizes_e + tile - 1) // tile * tile
  padded_end_e = jnp.cumsum(padded_e)
  start_e = jnp.cumsum(group_sizes_e) - group_sizes_e
  # row i of group g goes to (padded start of g) + (i - start of g); rows past the groups go
  # nowhere (an out-of-range position, dropped on write, read back as 0)
  live_m = jnp.arange(m) < filled
  pos_m = padded_end_e[expert_m] - padded_e[expert_m] + jnp.arange(m) - start_e[expert_m]
  pos_m = jnp.where(live_m, pos_m, n_tiles * tile)
  x_pad = jnp.zeros((n_tiles * tile, x_mk.shape[1]), dtype).at[pos_m].set(
      x_mk, mode="drop", unique_indices=True)
  expert_j = jnp.searchsorted(padded_end_e, jnp.arange(n_tiles) * tile, side="right")

  def step(j, y_pad):
    x_th = jax.lax.dynamic_slice_in_dim(x_pad, j * tile, tile)
    w = _weight(codes, scales, expert_j[j], dtype)
    y_tn = dot("jth,jhf->jtf", x_th[None], w[None])[0]
    return jax.lax.dynamic_update_slice_in_dim(y_pad, y_tn.astype(dtype), j * tile, 0)

  y_pad = jax.lax.fori_loop(0, padded_end_e[-1] // tile, step,
                            vary_like(jnp.zeros((n_tiles * tile, n), dtype), *like))
  return y_pad.at[pos_m].get(mode="fill", fill_value=0)
