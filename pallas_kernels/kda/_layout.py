"""Wrapper-side plumbing shared by the KDA Pallas backends.

The kernels want head-major, chunk-padded blocks ([B,H,Tp,K], Tp a multiple of 64) so a
(b, h, chunk) grid point DMAs one contiguous [64,K] tile, and feature dims optionally padded to a
lane multiple (128 on TPU). Padding is exact: padded tokens have k = v = 0, g = 0, beta = 0, so
they neither read nor change the state; padded feature columns are zero in q, k, v, g and the
state, so they contribute nothing and come back as zeros that we slice off.

Raw inputs (docs/kernels.md#raw-inputs: gate pre-activation, beta logits, un-normalised q/k) are
padded the same way; their transforms are not zero on zero padding, so the kernels mask them
(_chunk_math.Fused).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels.kda import reference
from pallas_kernels.kda._chunk_math import C
from pallas_kernels.vma import vary_like


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def tree_sum(x, axes):
  """Sum over `axes` as a balanced tree of float32 adds (pairwise summation).

  For the gate's parameter gradients, sums of B*T per-token terms t: pairwise, the float32
  rounding is at most ceil(log2 N) u sum|t| whatever the machine, where XLA:CPU's reduce adds
  each vector lane's share in sequence (error up to N/lanes u sum|t|, lanes set by the CPU).
  """
  axes = tuple(a % x.ndim for a in axes)
  x = jnp.moveaxis(x, axes, tuple(range(len(axes))))
  n = math.prod(x.shape[:len(axes)])
  x = x.reshape((n,) + x.shape[len(axes):])
  while x.shape[0] > 1:
    if x.shape[0] % 2:
      x = jnp.concatenate([x, jnp.zeros_like(x[:1])])
    half = x.shape[0] // 2
    x = x[:half] + x[half:]
  return x[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _repeat_lanes(a_h, n: int):
  """[H] -> [H,1,n]; the gradient sums the lanes pairwise (tree_sum)."""
  return jnp.broadcast_to(a_h[:, None, None], a_h.shape + (1, n))


def _repeat_lanes_bwd(n, _, ct):
  return (tree_sum(ct[:, 0, :], (1,)),)


_repeat_lanes.defvjp(lambda a_h, n: (_repeat_lanes(a_h, n), None), _repeat_lanes_bwd)


def gate_rows(A_log, dt_bias, H: int, K: int, Kp: int):
  """A_log [H] and dt_bias [H*K] (or None) -> float32 rows [H,1,Kp] for the in-kernel gate:
  A_log repeated along the lanes (its gradient is then the sum over them), dt_bias zero-padded."""
  alog = _repeat_lanes(A_log.astype(jnp.float32).reshape(H), Kp)
  dtb = (jnp.zeros((H, 1, K), jnp.float32) if dt_bias is None
         else dt_bias.astype(jnp.float32).reshape(H, 1, K))
  return alog, jnp.pad(dtb, ((0, 0), (0, 0), (0, Kp - K)))


def reset_counts(segment_ids, B: int, T: int, Tp: int):
  """Per chunk, how many segment starts up to and including each token.

  -> rc [B,Tp,1] (column layout) and rr [B,NT,1,C] (row layout), float32 so that they can
  ride the kernels' float path. Two tokens of one chunk share a segment iff equal counts.
  """
  starts = reference.segment_starts(segment_ids, B, T).astype(jnp.float32)
  starts = jnp.pad(starts, ((0, 0), (0, Tp - T)))
  counts = jnp.cumsum(starts.reshape(B, Tp // C, C), axis=-1)
  return counts.reshape(B, Tp, 1), counts.reshape(B, Tp // C, 1, C)


def lane_multiple(n: int) -> int:
  """TPU: features padded to a multiple of the 128 lanes."""
  return _round_up(n, 128)


def tile_multiple(n: int) -> int:
  """GPU (Mosaic GPU): features padded to whole 64-wide warpgroup tiles."""
  return _round_up(n, 64)


def power_of_two(n: int) -> int:
  """GPU (Triton): tensor sizes must be powers of two, and tl.dot wants dims >= 16."""
  return max(16, 1 << (n - 1).bit_length())


def to_kernel_layout(q, k, v, g, beta, initial_state, *, feature_size=lambda n: n):
  """[B,T,H,*] -> [B,H,Tp,*'] (time padded to C, features n to feature_size(n))."""
  B, T, H, K = q.shape
  V = v.shape[-1]
  Tp = _round_up(max(T, 1), C)
  Kp, Vp = feature_size(K), feature_size(V)

  def head_major(x, feat):
    x = jnp.pad(x, ((0, 0), (0, Tp - T), (0, 0), (0, feat - x.shape[-1])))
    return jnp.transpose(x, (0, 2, 1, 3))

  h0 = jnp.zeros((B, H, K, V), jnp.float32) if initial_state is None else initial_state
  h0 = jnp.pad(h0.astype(jnp.float32), ((0, 0), (0, 0), (0, Kp - K), (0, Vp - V)))
  beta = jnp.transpose(jnp.pad(beta.astype(jnp.float32), ((0, 0), (0, Tp - T), (0, 0))), (0, 2, 1))
  return (head_major(q, Kp), head_major(k, Kp), head_major(v, Vp),
          head_major(g.astype(jnp.float32), Kp), beta[..., None], h0)


def from_kernel_layout(o, ht, *, T: int, V: int, K: int):
  """[B,H,Tp,Vp] -> [B,T,H,V]; state [B,H,Kp,Vp] -> [B,H,K,V]."""
  return jnp.transpose(o[:, :, :T, :V], (0, 2, 1, 3)), ht[:, :, :K, :V]


def match_vma(*xs):
  """Inside `shard_map` (check_vma), give every kernel operand the union of the operands'
  varying mesh axes (e.g. a zero initial state made inside is not varying while q is), and
  return that union for the kernel's output types. Outside shard_map this is a no-op."""
  out = [vary_like(x, *xs) for x in xs]
  return out, jax.typeof(out[0]).mat


def out_struct(shape, dtype, mat):
  """ShapeDtypeStruct for a pallas_call output with the operands' manual-axis type `mat`."""
  if not mat.varying:
    return jax.ShapeDtypeStruct(shape, dtype)
  return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat)
