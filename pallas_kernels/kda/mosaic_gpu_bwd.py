"""Backward of the Mosaic GPU KDA recurrence (docs/kernels.md#kda-backends): a reverse-time Mosaic
GPU kernel for the state gradient, then chunk-parallel jnp for every chunk operand's gradient.

The forward kernel (`mosaic_gpu._recurrence`) maps per-chunk operands to outputs through the
state S [K,V]; per chunk, untransposed,

    Vp = U + Wn S0        o = Qd S0 + M Vp        S1 = Diag(a) S0 + Kl^T Vp.

Given dO and dS1 (the gradient w.r.t. the state leaving the chunk):

    dVp = M^T dO + Kl dS1                                         (1)
    dS0 = Diag(a) dS1 + Qd^T dO + Wn^T dVp                        (2)
    dU = dVp,  dWn = dVp S0^T,  dQd = dO S0^T,  dM = dO Vp^T,
    dKl = Vp dS1^T,  da = rowsum(S0 * dS1).                       (3)

Only (2) is sequential, and it needs no forward state. So the kernel (`_recurrence_bwd`) walks
the chunks backwards carrying dS^T [V,K] in shared memory exactly as the forward carries S^T
(same grid (B, H, V/64), same 3xTF32 products on TMA-loaded 128-byte-swizzled [64,64] tiles,
same 208.5 KiB shared-memory plan; see the forward's docstring for the tile sizes) and writes
dS1 for every chunk. (1)'s M^T dO term has no state either: it is computed chunk-parallel
beforehand and arrives like the forward's U, so M never enters the kernel. (3) is then
chunk-parallel jnp (batched matmuls at Precision.HIGHEST) from the forward's saved entering
states S0, recomputing Vp from them. With the state transposed (every wgmma has V rows):

    dVp^T = (dO^T M) + dS1^T Kl^T        dS0^T = dS1^T Diag(a) + dO^T Qd + dVp^T Wn

so the kernel's operand tiles are Kl [C,K], Qd^T and Wn^T [K,C] (each stored [N, contraction]
as tf32 wgmma wants), and dO^T [V,C] as an A operand.

Saved for the backward: the entering state of every chunk, [B,H,NT,V,K] float32 (written by
the forward kernel when differentiated), as fla's chunk_kda saves its per-chunk h.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kda import _chunk_math as cm
from pallas_kernels.kda import _mgpu as mg

C = cm.C
BV = BK = mg.TILE
_f32 = jnp.float32


def _recurrence_bwd(xT, do, kl, qdT, wnT, a, dhtT, *, interpret):
  """xT = dO^T M [B,H,NT,V,C]; do [B,H,NT,2,V,C], kl [B,H,NT,2,C,K], qdT, wnT [B,H,NT,2,K,C]
  (TF32 hi and lo planes); a [B,H,NT,K]; dhtT [B,H,V,K] -> (dS1^T of every chunk
  [B,H,NT,V,K], dh0^T [B,H,V,K])."""
  B, H, NT, _, _, K = kl.shape
  V = xT.shape[3]
  NK = K // BK

  def body(xT_g, do_g, kl_g, qdT_g, wnT_g, a_g, dhtT_g, ds1T_g, dh0T_g,
           s_s, slo_s, t_s, vp_s, do_s, u_s, a_s, bar):
    b, h, j = (jax.lax.axis_index(n) for n in ("b", "h", "v"))
    rows = pl.ds(j * BV, BV)
    bh = b * H + h
    load = mg.loader(bar)
    mg.load_state(load, lambda kt: dhtT_g.at[bh, rows, pl.ds(kt * BK, BK)], s_s, slo_s, u_s)

    def chunk(c, carry):
      i = bh * NT + (NT - 1 - c)
      mg.store_state(s_s, slo_s, u_s, lambda kt: ds1T_g.at[i, rows, pl.ds(kt * BK, BK)])
      load((xT_g.at[i, rows], u_s), *mg.split_tile(do_g.at[i, :, rows], do_s), (a_g.at[i], a_s))

      dvp = u_s[...]
      for kt in range(NK):  # (1): dVp^T = dO^T M + dS1^T Kl^T
        load(*mg.split_tile(kl_g.at[i, :, :, pl.ds(kt * BK, BK)], t_s.at[0:2]))

        def phase_a(acc, kt=kt):
          mg.mm3(acc, s_s.at[kt], slo_s.at[kt], t_s.at[0], t_s.at[1])
          return acc[...]

        dvp = dvp + pl.run_scoped(phase_a, mg.acc(BV, C))
      vp_s[0], vp_s[1] = mg.tf32_split(dvp)
      plgpu.commit_smem()

      for kt in range(NK):  # (2): dS0^T = dS1^T Diag(a) + dO^T Qd + dVp^T Wn, tile by tile
        cols = pl.ds(kt * BK, BK)
        load(*mg.split_tile(qdT_g.at[i, :, cols], t_s.at[0:2]),
             *mg.split_tile(wnT_g.at[i, :, cols], t_s.at[2:4]))
        a_row = jax.lax.broadcast_in_dim(a_s[cols], (BV, BK), (1,))

        def phase_b(acc):
          mg.mm3(acc, do_s.at[0], do_s.at[1], t_s.at[0], t_s.at[1])
          mg.mm3(acc, vp_s.at[0], vp_s.at[1], t_s.at[2], t_s.at[3])
          return acc[...]

        s = (s_s[kt] + slo_s[kt]) * a_row + pl.run_scoped(phase_b, mg.acc(BV, BK))
        s_s[kt], slo_s[kt] = mg.tf32_split(s)
      plgpu.commit_smem()
      return carry

    jax.lax.fori_loop(0, NT, chunk, 0)
    mg.store_state(s_s, slo_s, u_s, lambda kt: dh0T_g.at[bh, rows, pl.ds(kt * BK, BK)])

  ds1T, dh0T = mg.recurrence_kernel(
      body, (jax.ShapeDtypeStruct((B * H * NT, V, K), _f32),
             jax.ShapeDtypeStruct((B * H, V, K), _f32)),
      mg.smem(2, BV, C), B=B, H=H, V=V, K=K, name="kda_bwd_mosaic_gpu", interpret=interpret,
  )(*map(mg.rows_of, (xT, do, kl, qdT, wnT, a)), mg.rows_of(dhtT, 2))
  return ds1T.reshape(B, H, NT, V, K), dh0T.reshape(B, H, V, K)


def _mm(spec, x, y):
  return jnp.einsum(spec, x, y, precision=jax.lax.Precision.HIGHEST)


def recurrence_bwd(operands, s0T, doT, dhtT, *, interpret):
  """The VJP of the forward recurrence: operands (wn, qd [..,C,K]; m [..,C,C]; klT [..,K,C];
  uT [..,V,C]; a [..,K]) per chunk, the entering states s0T [B,H,NT,V,K], cotangents doT
  [B,H,NT,V,C] and dhtT [B,H,V,K] -> the operands' cotangents and dh0T."""
  wn, qd, m, klT, uT, a = operands
  xT = _mm("...vc,...cd->...vd", doT, m)
  sw = lambda x: jnp.swapaxes(x, -1, -2)
  ds1T, dh0T = _recurrence_bwd(xT, mg.pair(doT), mg.pair(sw(klT)), mg.pair(sw(qd)),
                               mg.pair(sw(wn)), a, dhtT, interpret=interpret)
  vpT = uT + _mm("...vk,...ck->...vc", s0T, wn)
  dvpT = xT + _mm("...vk,...kc->...vc", ds1T, klT)
  return ((_mm("...vc,...vk->...ck", dvpT, s0T),   # dWn
           _mm("...vc,...vk->...ck", doT, s0T),    # dQd
           _mm("...vc,...vd->...cd", doT, vpT),    # dM
           _mm("...vc,...vk->...kc", vpT, ds1T),   # dKl^T
           dvpT,                                   # dU^T
           jnp.sum(s0T * ds1T, axis=-2)),          # da
          dh0T)
