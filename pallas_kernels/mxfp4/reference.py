"""The definition of the grouped matmul over MXFP4-packed experts: dequantise, then multiply.

    y = grouped_matmul_mxfp4_reference(x_mk, codes, scales, group_sizes_e)
      = grouped_matmul(x_mk, dequantize(codes, scales), group_sizes_e)

It holds the whole dequantised stack [E, in, out] (what the packed paths exist to avoid); the
tests compare them with it. Differentiable by plain autodiff (the codes are integers: no
gradient reaches them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.grouped_matmul import grouped_matmul
from pallas_kernels.mxfp4.format import dequantize


def grouped_matmul_mxfp4_reference(x_mk: jax.Array, codes: jax.Array, scales: jax.Array,
                                   group_sizes_e: jax.Array, *, transpose: bool = False,
                                   impl: str = "tiled", precision=None) -> jax.Array:
  """x [m, in] @ W_g(row) (transpose: x [m, out] @ W_g(row)^T) for W = dequantize(codes [E,
  out, in/2], scales [E, out, in/32]) in x's dtype, by `grouped_matmul(impl=...)`."""
  w_eio = dequantize(codes, scales, x_mk.dtype)
  if transpose:
    w_eio = jnp.swapaxes(w_eio, 1, 2)
  return grouped_matmul(x_mk, w_eio, group_sizes_e, impl=impl, precision=precision)
