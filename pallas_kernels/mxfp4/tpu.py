"""Grouped matmul over MXFP4-packed experts: a Pallas TPU kernel (megablox's grid, in-kernel
dequantisation).

    y  = grouped_matmul_mxfp4_tpu(x_mk, codes_enk, scales_eng, group_sizes_e)   # x W
    dx = the same kernel with transpose=True                                    # dy W^T

The weights stay in HBM as they are stored: codes uint8 [E, out, in/2] and E8M0 scales
[E, out, in/32] (the format, pallas_kernels/mxfp4/format.py). The grid is megablox's
(jax.experimental.pallas.ops.tpu.megablox): (output tiles, row tiles of the groups, contraction
tiles), with `make_group_metadata` telling each grid step its rows' tile and group, so the
grid stops at the group sizes and rows past the last group are never visited (zeros here).

Per grid step the codes tile [tn_out, tk_in/2] and its scales are DMA'd to VMEM and
dequantised there into the layout the MXU takes, [in/2, out] (even and odd input elements
apart: the low and the high nibbles), then

    forward     acc [tm, tn]   += x_even [tm, tk/2] @ W_lo + x_odd [tm, tk/2] @ W_hi
    transposed  acc_even [tm, tn/2] += dy [tm, tk] @ W_lo^T   (and acc_odd with W_hi)

x's even and odd columns are split outside (one strided copy of the activations), dx's put
back together outside. A dequantised tile is kept in a VMEM cache for the row tiles that follow
in the same group (the grid visits a group's row tiles one after another for each output tile):
each expert's weights are dequantised once per output tile, not once per row tile.

The scales are passed transposed, [E, in/32, out] (a small copy: 1/16 of the codes' bytes), so
that a tile's scales expand to its [in/2, out] elements along sublanes (a layout-preserving
broadcast), and the codes tile is transposed in-kernel (32-bit, on the XLU).

Dequantisation builds each float32 from its bits (E2M1's sign, exponent and mantissa bit) and
multiplies by the tile's power-of-two scale: exact, bit for bit the format's `dequantize` (the
tests compare all 16 x 256 code/scale pairs), then cast to the compute dtype (exact in bf16).
Multiplication runs in the operands' dtype with float32 accumulation, as megablox does.
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp

# jax's private config for `_check_vma` (_unchecked), as grouped_matmul's megablox path does: the
# flag is the one shard_map sets
from jax._src import config
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.mxfp4.format import GROUP
from pallas_kernels.mxfp4.tiled import grouped_matmul_mxfp4_tiled
from pallas_kernels.vma import vary_like

TM = 128  # rows per tile (megablox's: bounds the per-group rounding of the grid)
_HALF = GROUP // 2  # code bytes per scale


def _metadata():
  """megablox's gmm module (the package's `gmm` name is its custom_vjp wrapper)."""
  return importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")


def _tile(d: int, *, packed: bool) -> int:
  """A tile of a dim of size d: the whole dim up to 512 (a block the size of its array dim is
  always legal), else the largest of 512 / 256 (/ 128 for an unpacked dim) dividing it. A packed
  (input) dim's tile holds whole groups of 32 and its half (the codes' bytes) whole lanes."""
  if d <= 512:
    return d
  for t in (512, 256) if packed else (512, 256, 128):
    if d % t == 0:
      return t
  raise ValueError(f"no tile of {'512 / 256' if packed else '512 / 256 / 128'} divides a "
                   f"dim of {d}")


def dequantize_tile(codes_oh: jax.Array, scales_go: jax.Array, dtype) -> tuple[jax.Array,
                                                                                 jax.Array]:
  """codes [out, in/2] (uint8 or int32) and scales [in/32, out] (transposed) -> the weights
  of the even and of the odd input elements, each [in/2, out] in `dtype`; traceable in and out
  of a kernel. Bit for bit `format.dequantize` (see the module docstring)."""
  c = codes_oh.astype(jnp.int32).T                            # [in/2, out]
  g, o = scales_go.shape
  s = jnp.broadcast_to(scales_go.astype(jnp.int32)[:, None, :], (g, _HALF, o)).reshape(
      g * _HALF, o)                                           # one scale per 16 bytes
  # 2^(s - 127) as float32 bits, s clamped to the normal range; the two ends fixed below
  factor = jax.lax.bitcast_convert_type(jnp.clip(s, 1, 254) << 23, jnp.float32)

  def value(nibble):
    e, m = (nibble >> 1) & 3, nibble & 1
    # E2M1: e > 0: 2^(e-1) (1 + m/2); e = 0: m/2 (a subnormal); float32 bits, sign from bit 3
    bits = jnp.where(e > 0, ((e + 126) << 23) | (m << 22), jnp.where(m == 1, 126 << 23, 0))
    v = jax.lax.bitcast_convert_type(bits | ((nibble & 8) << 28), jnp.float32) * factor
    # scale 0 (2^-127) and 255 (2^128) lie outside float32's normal powers of two: one more
    # exact halving / doubling (rounded once, as ldexp rounds, where the result is subnormal)
    v = jnp.where(s == 0, v * 0.5, jnp.where(s == 255, v * 2.0, v))
    return v.astype(dtype)

  return value(c & 0xF), value(c >> 4)


def _store(out_ref, acc, meta, grid_id, tm):
  """Write the rows of the tile that belong to the step's group (a tile shared with the
  previous or next group keeps their rows: the grid visits it consecutively)."""
  offsets, group_ids, m_tile_ids = meta
  g = group_ids[grid_id]
  rows = jax.lax.broadcasted_iota(jnp.int32, acc.shape, 0) + m_tile_ids[grid_id] * tm
  mask = (rows >= offsets[g]) & (rows < offsets[g + 1])
  out_ref[...] = jnp.where(mask, acc, out_ref[...].astype(acc.dtype)).astype(out_ref.dtype)


def _first_of_group(meta, grid_id):
  group_ids = meta[1]
  return (grid_id == 0) | (group_ids[grid_id] != group_ids[jnp.maximum(grid_id - 1, 0)])


def _tile_weights(c_ref, s_ref, cache_ref, meta, grid_id, k_i, dtype):
  """The step's dequantised weights (even, odd inputs), from the cache, filled at the group's
  first row tile."""
  @pl.when(_first_of_group(meta, grid_id))
  def _():
    lo, hi = dequantize_tile(c_ref[...], s_ref[...], dtype)
    cache_ref[0, k_i] = lo
    cache_ref[1, k_i] = hi

  return cache_ref[0, k_i], cache_ref[1, k_i]


def _fwd_kernel(offsets, group_ids, m_tile_ids, xe_ref, xo_ref, c_ref, s_ref, out_ref, acc_ref,
                cache_ref, *, tm, tiles_k):
  meta = (offsets, group_ids, m_tile_ids)
  grid_id, k_i = pl.program_id(1), pl.program_id(2)
  lo, hi = _tile_weights(c_ref, s_ref, cache_ref, meta, grid_id, k_i, xe_ref.dtype)

  @pl.when(k_i == 0)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  dot = functools.partial(jax.lax.dot, preferred_element_type=acc_ref.dtype)
  acc_ref[...] += dot(xe_ref[...], lo) + dot(xo_ref[...], hi)

  @pl.when(k_i == tiles_k - 1)
  def _():
    _store(out_ref, acc_ref[...], meta, grid_id, tm)


def _bwd_kernel(offsets, group_ids, m_tile_ids, dy_ref, c_ref, s_ref, dxe_ref, dxo_ref,
                acc_ref, cache_ref, *, tm, tiles_k):
  meta = (offsets, group_ids, m_tile_ids)
  grid_id, k_i = pl.program_id(1), pl.program_id(2)
  weights = _tile_weights(c_ref, s_ref, cache_ref, meta, grid_id, k_i, dy_ref.dtype)

  @pl.when(k_i == 0)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  dy = dy_ref[...]
  dims = (((1,), (1,)), ((), ()))  # dy [tm, tk] . W [tn/2, tk] over tk
  for h, w in enumerate(weights):
    acc_ref[h] += jax.lax.dot_general(dy, w, dims, preferred_element_type=acc_ref.dtype)

  @pl.when(k_i == tiles_k - 1)
  def _():
    _store(dxe_ref, acc_ref[0], meta, grid_id, tm)
    _store(dxo_ref, acc_ref[1], meta, grid_id, tm)


def _call(x, codes, scales_t, group_sizes, *, transpose: bool, interpret):
  """One pallas_call. x: [m, in] (forward) or dy [m, out] (transpose); scales_t [E, in/32,
  out]. Returns y [m, out], or dx's even and odd columns [m, in/2] each. Inside shard_map only
  the pallas_call itself is traced unchecked (`_unchecked`): what remat's partial evaluation
  traces again, with the check on, must be typed (the group metadata here)."""
  m = x.shape[0]
  e, n_out, half = codes.shape
  n_in = 2 * half
  if m % TM:
    raise ValueError(f"rows {m} must be a multiple of {TM}")
  dtype = x.dtype
  acc = jnp.promote_types(dtype, jnp.float32)  # float32, or float64 (interpreted) for float64
  meta, active = _metadata().make_group_metadata(
      group_sizes=group_sizes, m=m, tm=TM, start_group=jnp.zeros((), jnp.int32),
      num_nonzero_groups=e, visit_empty_groups=False)
  if not transpose:
    tk, tn = _tile(n_in, packed=True), _tile(n_out, packed=False)
    tiles_k, tiles_n = n_in // tk, n_out // tn
    xe, xo = x[:, 0::2], x[:, 1::2]
    in_specs = [
        pl.BlockSpec((TM, tk // 2), lambda n, i, k, off, gid, mt: (mt[i], k)),
        pl.BlockSpec((TM, tk // 2), lambda n, i, k, off, gid, mt: (mt[i], k)),
        pl.BlockSpec((None, tn, tk // 2), lambda n, i, k, off, gid, mt: (gid[i], n, k)),
        pl.BlockSpec((None, tk // GROUP, tn), lambda n, i, k, off, gid, mt: (gid[i], k, n)),
    ]
    out_specs = pl.BlockSpec((TM, tn), lambda n, i, k, off, gid, mt: (mt[i], n))
    out_shape = jax.ShapeDtypeStruct((m, n_out), dtype)
    scratch = [pltpu.VMEM((TM, tn), acc), pltpu.VMEM((2, tiles_k, tk // 2, tn), dtype)]
    kernel, operands = _fwd_kernel, (xe, xo, codes, scales_t)
    x_bytes = 2 * m * n_in * x.dtype.itemsize
  else:
    tk, tn = _tile(n_out, packed=False), _tile(n_in, packed=True)
    tiles_k, tiles_n = n_out // tk, n_in // tn
    in_specs = [
        pl.BlockSpec((TM, tk), lambda n, i, k, off, gid, mt: (mt[i], k)),
        pl.BlockSpec((None, tk, tn // 2), lambda n, i, k, off, gid, mt: (gid[i], k, n)),
        pl.BlockSpec((None, tn // GROUP, tk), lambda n, i, k, off, gid, mt: (gid[i], n, k)),
    ]
    half_spec = pl.BlockSpec((TM, tn // 2), lambda n, i, k, off, gid, mt: (mt[i], n))
    out_specs = [half_spec, half_spec]
    out_shape = [jax.ShapeDtypeStruct((m, half), dtype)] * 2
    scratch = [pltpu.VMEM((2, TM, tn // 2), acc), pltpu.VMEM((2, tiles_k, tn // 2, tk), dtype)]
    kernel, operands = _bwd_kernel, (x, codes, scales_t)
    x_bytes = m * n_out * x.dtype.itemsize
  # megablox's figures: every row of the buffer (the grid stops earlier; `k3jax plan` counts
  # the rows it runs), the activations once per output tile, one expert's packed weights per
  # active tile at most
  max_tiles = meta[1].size
  w_bytes = n_in * n_out // 2 + n_in * n_out // GROUP
  cost = pl.CostEstimate(flops=2 * m * n_in * n_out, transcendentals=0,
                         bytes_accessed=x_bytes * tiles_n + w_bytes * max_tiles
                         + m * (n_in if transpose else n_out) * x.dtype.itemsize)
  call = pl.pallas_call(
      functools.partial(kernel, tm=TM, tiles_k=tiles_k),
      out_shape=out_shape,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=3, in_specs=in_specs, out_specs=out_specs,
          grid=(tiles_n, active, tiles_k), scratch_shapes=scratch),
      # the cache is filled at a group's first row tile and read by the next ones: the row
      # tiles run in order on one core, output tiles may split over cores
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "arbitrary", "arbitrary")),
      interpret=interpret, cost_estimate=cost,
      name="mxfp4_grouped_matmul_t" if transpose else "mxfp4_grouped_matmul")
  return _unchecked(call, *meta, *operands)


def _unchecked(fn, *args):
  """fn(*args) inside `jax.shard_map` too: a pallas_call gives its output no manual-axis type,
  which shard_map's check_vma refuses; traced with the check off, the result takes the
  operands' varying axes (ops.py makes them alike). Each device computes its own values either
  way, and the call sits inside ops.py's custom_vjp: autodiff never transposes the cast."""
  with config._check_vma(False):
    out = fn(*args)
  return jax.tree.map(lambda y: vary_like(y, *args), out)


def _split(y, transpose: bool):
  """The tile loop's dx [m, in] as the kernel returns it: even and odd columns apart."""
  return (y[:, 0::2], y[:, 1::2]) if transpose else y


def grouped_matmul_mxfp4_tpu(x_mk: jax.Array, codes: jax.Array, scales: jax.Array,
                             group_sizes_e: jax.Array, *, transpose: bool = False,
                             interpret: bool | None = None) -> jax.Array:
  """x [m, in] @ W_g(row) (transpose: x [m, out] @ W_g(row)^T) for the MXFP4 experts codes
  [E, out, in/2], scales [E, out, in/32]. Rows past the last group give zeros. interpret=None
  decides by the platform lowered for: TPU compiles the kernel, any other runs the XLA tile
  loop (tiled.py: the reference's numbers). interpret=True runs the kernel in Pallas's
  interpret mode (the tests), outside shard_map only: Pallas interprets a kernel when it is
  lowered, where shard_map's varying types refuse the kernel's constants and scratch beside
  its blocks. Not differentiable itself (ops.py's custom_vjp calls it both ways)."""
  m = x_mk.shape[0]
  pad = -m % TM  # whole row tiles
  if pad:
    x_mk = jnp.pad(x_mk, ((0, pad), (0, 0)))
  group_sizes_e = group_sizes_e.astype(jnp.int32)
  args = (x_mk, codes, jnp.swapaxes(scales, 1, 2), group_sizes_e)
  def kernel(*a, interpret=interpret):
    return _call(*a, transpose=transpose, interpret=interpret)

  def elsewhere(x, codes, scales_t, sizes):  # plain jnp: typed inside shard_map as it is
    return _split(grouped_matmul_mxfp4_tiled(x, codes, jnp.swapaxes(scales_t, 1, 2), sizes,
                                             transpose=transpose), transpose)

  if interpret is None:  # (only the kernel's branch traced unchecked: remat retraces the rest)
    out = jax.lax.platform_dependent(*args, tpu=functools.partial(kernel, interpret=False),
                                     default=elsewhere)
  else:
    out = kernel(*args)
  if transpose:  # dx's even and odd columns, interleaved again
    out = jnp.stack(out, axis=-1).reshape(x_mk.shape[0], -1)
  live = jnp.arange(out.shape[0]) < jnp.sum(group_sizes_e)  # the grid never writes the rest
  out = jnp.where(live[:, None], out, 0)
  return out[:m] if pad else out
