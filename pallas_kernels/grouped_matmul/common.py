"""What the grouped matmul implementations share: the row tile, and padding rows to a multiple."""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Rows per tile ("tiled", "megablox"): the padding waste (< E * TILE rows) buys fewer, larger
# matmuls.
TILE = 128
MIN_TILE = 8


def tile_for(m: int, e: int, tile: int = TILE) -> int:
  """The row tile of a tiled grouped matmul over m rows and e groups: `tile`, halved (not below
  MIN_TILE) while the padding it may cost, up to e * tile rows, exceeds m. A prefill step of a
  few hundred rows over 16 experts otherwise computes 16 tiles of 128 rows, mostly zeros."""
  while tile > MIN_TILE and tile % 2 == 0 and e * tile > m:
    tile //= 2
  return tile


def filled_rows(m: int, group_sizes_e: jax.Array) -> jax.Array:
  """[m] bool: the rows some group holds (the groups may fill only a prefix of the rows)."""
  return jnp.arange(m) < jnp.sum(group_sizes_e)


def pad_rows(x_mh: jax.Array, multiple: int) -> jax.Array:
  """x with zero rows appended up to a multiple of `multiple` (x itself if it is one)."""
  pad = -x_mh.shape[0] % multiple
  return jnp.pad(x_mh, ((0, pad), (0, 0))) if pad else x_mh
