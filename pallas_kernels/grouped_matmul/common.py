"""What the grouped matmul implementations share: the row tile, and padding rows to a multiple."""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Rows per tile ("tiled", "megablox"): the padding waste (< E * TILE rows) buys fewer, larger
# matmuls.
TILE = 128


def filled_rows(m: int, group_sizes_e: jax.Array) -> jax.Array:
  """[m] bool: the rows some group holds (the groups may fill only a prefix of the rows)."""
  return jnp.arange(m) < jnp.sum(group_sizes_e)


def pad_rows(x_mh: jax.Array, multiple: int) -> jax.Array:
  """x with zero rows appended up to a multiple of `multiple` (x itself if it is one)."""
  pad = -x_mh.shape[0] % multiple
  return jnp.pad(x_mh, ((0, pad), (0, 0))) if pad else x_mh
