"""Grouped matmul over MXFP4-packed experts: the weights stay packed, dequantised a tile at a
time inside the product.

    grouped_matmul_mxfp4(x_mk, codes_eoh, scales_eog, group_sizes_e, impl=None) -> y_mo

y[i] = x[i] @ W_g(i) for rows sorted by expert, `group_sizes` [E] of them per expert (as
`grouped_matmul`: the groups may fill only a prefix of the rows, the rest give zeros), with
W = dequantize(codes [E, out, in/2], scales [E, out, in/32]) (the format, format.py: the
checkpoint's orientation, k3jax's [in, out] weights once dequantised). Three
implementations:

  "reference"  dequantise the whole stack, then `grouped_matmul` (reference.py): the
               definition, and the float copy of the stack the other two never make.
  "tiled"      XLA, a loop over row tiles (tiled.py), one expert dequantised at a time: bit
               for bit the reference with grouped_matmul's "tiled" (same tiles, same dots).
  "pallas"     a Pallas TPU kernel on megablox's grid that dequantises codes tiles in VMEM
               (tpu.py). Its float32 accumulation runs over contraction tiles: within a dot
               product's rounding of the reference, not bitwise. Lowered for another platform
               it runs "tiled" instead (interpret=None), or the kernel in Pallas's interpret
               mode (interpret=True: the tests; not inside shard_map, see tpu.py).

impl=None picks "pallas" on TPU and "tiled" elsewhere. The gradient is the input's only,
dx = dy W^T (the same implementation on the transposed tiles); the codes and scales are frozen
integers and get none. `precision` applies to "reference" and "tiled"; the kernel multiplies
in the operands' dtype with float32 accumulation, as megablox does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.grouped_matmul import SCOPE, TILE
from pallas_kernels.mxfp4.reference import grouped_matmul_mxfp4_reference
from pallas_kernels.mxfp4.tiled import grouped_matmul_mxfp4_tiled
from pallas_kernels.mxfp4.tpu import grouped_matmul_mxfp4_tpu
from pallas_kernels.vma import vary_like

IMPLS = ("reference", "tiled", "pallas")


def default_impl() -> str:
  return "pallas" if jax.default_backend() == "tpu" else "tiled"


def grouped_matmul_mxfp4(x_mk: jax.Array, codes: jax.Array, scales: jax.Array,
                         group_sizes_e: jax.Array, *, impl: str | None = None, precision=None,
                         tile: int = TILE, interpret: bool | None = None) -> jax.Array:
  """y [m, out] = x [m, in] @ W_g(row), W the MXFP4 experts codes [E, out, in/2] (uint8),
  scales [E, out, in/32] (uint8 E8M0), in x's dtype. See the module docstring."""
  impl = impl or default_impl()
  if impl not in IMPLS:
    raise ValueError(f"unknown MXFP4 grouped matmul {impl!r}; expected one of {IMPLS}")
  if codes.dtype != jnp.uint8 or scales.dtype != jnp.uint8:
    raise ValueError(f"MXFP4 codes and scales must be uint8, got {codes.dtype}, {scales.dtype}")
  if x_mk.shape[1] != 2 * codes.shape[2]:
    raise ValueError(f"rows of width {x_mk.shape[1]} against codes {codes.shape} (in/2 = "
                     f"{codes.shape[2]})")
  if impl == "reference":
    return grouped_matmul_mxfp4_reference(x_mk, codes, scales, group_sizes_e,
                                          precision=precision)
  # one varying type for all four (inside shard_map): the casts stay outside the custom_vjp,
  # where autodiff transposes them (x replicated where the experts are split: dx summed)
  args = (x_mk, codes, scales, group_sizes_e.astype(jnp.int32))
  args = tuple(vary_like(a, *args) for a in args)
  if impl == "tiled":
    return _packed(("tiled", tile, precision), *args)
  with jax.named_scope(SCOPE):  # where `k3jax plan` finds the grouped matmuls' FLOPs
    return _packed(("pallas", interpret), *args)


def _product(how: tuple, x, codes, scales, group_sizes, transpose: bool):
  if how[0] == "tiled":
    return grouped_matmul_mxfp4_tiled(x, codes, scales, group_sizes, transpose=transpose,
                                      tile=how[1], precision=how[2])
  return grouped_matmul_mxfp4_tpu(x, codes, scales, group_sizes, transpose=transpose,
                                  interpret=how[1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _packed(how, x, codes, scales, group_sizes):
  return _product(how, x, codes, scales, group_sizes, False)


def _packed_fwd(how, x, codes, scales, group_sizes):
  return _product(how, x, codes, scales, group_sizes, False), (codes, scales, group_sizes)


def _packed_bwd(how, res, dy):
  codes, scales, group_sizes = res
  # dx_i = dy_i W_g(i)^T; nothing for the integer codes, scales and group sizes
  return _product(how, dy, codes, scales, group_sizes, True), None, None, None


_packed.defvjp(_packed_fwd, _packed_bwd)
