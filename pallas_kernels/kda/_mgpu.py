"""Pieces shared by the Mosaic GPU KDA forward and backward kernels: the 3xTF32 split and
products, shared-memory tiles, TMA loads and state stores (see mosaic_gpu's docstring)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

_f32 = jnp.float32
# 128-byte swizzle with (8, 32) tiling: the layout wgmma wants for 4-byte elements.
_TRANSFORMS = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))


def tf32_split(x):
  """x = hi + lo exactly (float32): hi is x truncated to TF32 (what a tensor core would read
  of x), lo the exact remainder (|lo| < 2^-10 |x|)."""
  hi = jax.lax.bitcast_convert_type(
      jax.lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(0xFFFFE000), _f32)
  return hi, x - hi


def pair(x):
  """[..., R, N] -> [..., 2, R, N]: x's TF32 split (hi, lo), for the 3xTF32 products."""
  return jnp.stack(tf32_split(x), axis=-3)


def interpret_arg(interpret):
  """interpret=True -> Mosaic GPU interpret mode (numpy matmuls, simulated TMA and SMEM)."""
  if interpret is True:
    return plgpu.InterpretGPUParams()
  return interpret or None


def smem(*shape):
  return plgpu.SMEM(shape, _f32, transforms=_TRANSFORMS)


def acc(*shape):
  """A zeroed wgmma accumulator; reading it waits for the matmuls in flight."""
  return plgpu.ACC(shape, _f32)


def loader(bar):
  """load(*(src, dst)): TMA copies in flight together, then a wait for all (<= 4)."""
  def load(*pairs):
    for i, (src, dst) in enumerate(pairs):
      plgpu.copy_gmem_to_smem(src, dst, bar.at[i])
    for i in range(len(pairs)):
      plgpu.barrier_wait(bar.at[i])
  return load


def split_tile(src, dst):
  """The (hi, lo) planes of one operand tile as two copies (TMA takes 2-D tiles)."""
  return (src.at[0], dst.at[0]), (src.at[1], dst.at[1])


def load_state(load, src_of, s_s, slo_s, stage):
  """Read the float32 state tile src_of(kt) for each K tile, through `stage`, into its exact
  TF32 split hi + lo (the form the 3xTF32 products read)."""
  for kt in range(s_s.shape[0]):
    load((src_of(kt), stage))
    s_s[kt], slo_s[kt] = tf32_split(stage[...])
  plgpu.commit_smem()


def store_state(s_s, slo_s, stage, dst_of):
  """Write the state held as hi + lo tiles to dst_of(kt) for each K tile, through `stage`."""
  for kt in range(s_s.shape[0]):
    stage[...] = s_s[kt] + slo_s[kt]
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(stage, dst_of(kt))
    plgpu.wait_smem_to_gmem(0)


def mm3(acc_ref, a_hi, a_lo, b_hi, b_lo):
  """acc += a b in 3xTF32 (drops a_lo b_lo, < 2^-20 |a||b|); b is stored [N, contraction]."""
  plgpu.wgmma(acc_ref, a_hi, b_hi.T)
  plgpu.wgmma(acc_ref, a_hi, b_lo.T)
  plgpu.wgmma(acc_ref, a_lo, b_hi.T)


TILE = 64  # C, BV and BK: one warpgroup wgmma's M and contraction (see mosaic_gpu's docstring)


def recurrence_kernel(body, out_type, pair_scratch, *, B: int, H: int, V: int, K: int,
                      name: str, interpret):
  """plgpu.kernel for a chunk recurrence (the forward's, or the backward's reverse one) on the
  grid (B, H, V/64) with their shared-memory plan: the state's hi and lo planes [K/64, 64, 64]
  each, four operand tiles, two [2, 64, 64] pairs (Vp^T, and `pair_scratch`: M or dO^T), one
  staging tile, a [K] vector and four TMA barriers (208.5 KiB at K = 128)."""
  nk = K // TILE
  return plgpu.kernel(
      body, out_type=out_type,
      scratch_types=[smem(nk, TILE, TILE), smem(nk, TILE, TILE), smem(4, TILE, TILE),
                     smem(2, TILE, TILE), pair_scratch, smem(TILE, TILE),
                     plgpu.SMEM((K,), _f32), plgpu.Barrier(num_barriers=4)],
      grid=(B, H, V // TILE), grid_names=("b", "h", "v"),
      interpret=interpret_arg(interpret), kernel_name=name)


def rows_of(x, lead: int = 3):
  """x with its `lead` leading axes merged into one (TMA takes at most 5 dimensions)."""
  return x.reshape((-1,) + x.shape[lead:])
