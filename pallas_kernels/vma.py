"""Typing helpers for kernels traced inside `shard_map` (jax's varying-manual-axes check)."""

from __future__ import annotations

import jax


def vary_like(x: jax.Array, *like: jax.Array) -> jax.Array:
  """Inside `shard_map` (check_vma): x made varying over every mesh axis any of `like` varies
  over (a zero state made inside, or a replicated operand, is not varying while q is).
  Outside shard_map, x itself."""
  varying = frozenset().union(*(jax.typeof(y).mat.varying for y in like))
  missing = tuple(sorted(varying - jax.typeof(x).mat.varying))
  return jax.lax.pcast(x, missing, to="varying") if missing else x
