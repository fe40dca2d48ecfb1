"""Grouped matmul as one batched matmul over row tiles ("tiled"; the default on CPU).

Every group is padded to a multiple of `tile` rows, so each tile of rows belongs to one expert;
the tiles then run as one batched matmul against their experts' weights (gathered per tile).
Static shapes: at most ceil(m / tile) + E tiles, so padding costs at most E * tile rows, and
every tile is a plain matmul that XLA:CPU's dot emitter handles well. `tile` is the largest
tile: fewer rows take a smaller one (`tile_for`), so the padding stays about m rows.

With no more rows than experts (decoding: batch x k rows) it instead gathers each row's expert
matrix: a decode step then reads only the k selected experts per token, not a padded tile of
every expert.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.grouped_matmul.common import TILE, filled_rows, tile_for


def grouped_matmul(x_mh: jax.Array, w_ehf: jax.Array, group_sizes_e: jax.Array, *,
                   precision=None, tile: int = TILE) -> jax.Array:
  m, e = x_mh.shape[0], w_ehf.shape[0]
  expert_m = jnp.repeat(jnp.arange(e), group_sizes_e, total_repeat_length=m)
  filled_m = filled_rows(m, group_sizes_e)
  if m <= e:  # decode-sized: m expert matrices read, never more than the E + 1 tiles below
    y_mf = jnp.einsum("mh,mhf->mf", x_mh, w_ehf[expert_m], precision=precision)
    return jnp.where(filled_m[:, None], y_mf, 0)
  tile = tile_for(m, e, tile)
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
