"""The grouped matmul written plainly: the definition every implementation is tested against.

    grouped_matmul(x_mh, w_ehf, group_sizes_e, *, precision=None) -> y_mf

Rows arrive sorted by expert, group_sizes_e[e] of them for expert e, so expert e holds rows
[start_e, start_e + group_sizes_e[e]) with start_e = sum of the sizes before it, and

    y[i] = x[i] @ w[e]   for the expert e whose group holds row i;   y[i] = 0 past the groups.

One dense matmul per expert, masked to its rows: E times the work, no tiling, no kernel. Every
y[i] is one dot product (the other experts add exact zeros), so an implementation may differ
from it only by its summation order; JAX differentiates it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def grouped_matmul(x_mh: jax.Array, w_ehf: jax.Array, group_sizes_e: jax.Array, *,
                   precision=None) -> jax.Array:
  m, e = x_mh.shape[0], w_ehf.shape[0]
  end_e = jnp.cumsum(group_sizes_e)
  start_e = end_e - group_sizes_e
  row_m = jnp.arange(m)
  y_mf = jnp.zeros((m, w_ehf.shape[-1]), jnp.result_type(x_mh, w_ehf))
  for expert in range(e):
    mine_m = (row_m >= start_e[expert]) & (row_m < end_e[expert])
    y_mf = y_mf + jnp.where(mine_m[:, None],
                            jnp.matmul(x_mh, w_ehf[expert], precision=precision), 0)
  return y_mf
