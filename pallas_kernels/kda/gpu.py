"""Chunked KDA forward and backward in Pallas for NVIDIA GPUs (Triton lowering);
docs/kernels.md#kda-backends.

Four kernels, the split fla uses, because one monolithic kernel per (batch, head) needs more
shared memory than an H100 has (the backward asked Triton for 704 KiB of 227):
  intra_fwd  grid (B, H, NT), chunks in parallel: M (masked A_qk), (I+L)^-1, L_raw  [64,64] each
  fwd        grid (B, H, V/BV): one program walks the chunks of a (batch, head, V block) in a
             fori_loop with the [K, BV] float32 state in registers (Triton has no sequential
             grid axis with persistent scratch); writes o, final state, entering states
  bwd        grid (B, H, V/BV), chunks in reverse carrying dS: dv, d initial state and the
             per-V-block partial cotangents of the chunks' state-free intermediates
  intra_bwd  grid (B, H, NT): from the summed partials to dq, dk, dg, dbeta
The backward recomputes intra_fwd rather than keeping three [T,64] float32 residuals.
Chunks are [64, K] tiles of the head-major, chunk-padded layout of `_layout`; K and V are
padded to powers of two (Triton tensor sizes), at least 16 (tl.dot). The per-chunk math is
`_chunk_math`, shared with the TPU kernel, with the sub-chunk row broadcast done as a 0/1
selection matmul and the sub-chunk tail sums as masked reductions (no 3-D values in Triton).
Inputs bf16 or float32; math float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.kda import _chunk_math as cm
from pallas_kernels.kda import _layout, _wrapper
from pallas_kernels.kda.reference import PREPARED, RawInputs

C = cm.C
BV = 64  # V columns per recurrence program: the state block [K, BV] stays in registers
BK = 32  # K columns per intra_bwd program (shared memory)
_f32 = jnp.float32
_PARAMS = pltriton.CompilerParams(num_warps=4, num_stages=1)
sq = pl.squeezed


def _precision(interpret):
  """3xTF32 on the GPU: tensor-core speed at ~fp32 accuracy (IEEE f32 dots become huge FMA
  loops that take Triton minutes to compile). Interpret mode runs on hosts without TF32, where
  float32 dots are exact IEEE anyway."""
  return jax.lax.Precision.HIGHEST if interpret else jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3


def _call(kernel, grid, in_specs, out_specs, out_shape, name, interpret, *args):
  args, mat = _layout.match_vma(*args)
  with cm.backend_options(precision=_precision(interpret), scan_cumsum=True):
    return pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_specs,
        out_shape=[_layout.out_struct(s, d, mat) for s, d in out_shape],
        compiler_params=_PARAMS, interpret=interpret, name=name)(*args)


# --- chunk-parallel kernels: grid (B, H, NT), one chunk per program --------------------------

def _chunk_specs(K):
  tile = lambda n: pl.BlockSpec((sq, sq, C, n), lambda b, h, c: (b, h, c, 0))
  return dict(k=tile(K), cc=tile(C), beta=tile(1),
              rc=pl.BlockSpec((sq, C, 1), lambda b, h, c: (b, c, 0)),
              rr=pl.BlockSpec((sq, sq, 1, C), lambda b, h, c: (b, c, 0, 0)),
              da=pl.BlockSpec((sq, sq, sq, 1, K), lambda b, h, c: (b, h, c, 0, 0)))


def _intra_fwd_kernel(q_ref, k_ref, g_ref, beta_ref, rc_ref, rr_ref, M_ref, Linv_ref, Lraw_ref,
                      *, scale):
  f = lambda r: r[...].astype(_f32)
  M, L_inv, L_raw = cm.intra_fwd(f(q_ref), f(k_ref), f(g_ref), beta_ref[...], rc_ref[...],
                                 rr_ref[...], scale, cm.MASK_OPS)
  M_ref[...], Linv_ref[...], Lraw_ref[...] = M, L_inv, L_raw


def _intra_fwd(q, k, g, beta, rc, rr, *, scale, interpret):
  B, H, Tp, K = q.shape
  s = _chunk_specs(K)
  shape = ((B, H, Tp, C), _f32)
  return _call(functools.partial(_intra_fwd_kernel, scale=scale), (B, H, Tp // C),
               [s["k"], s["k"], s["k"], s["beta"], s["rc"], s["rr"]], [s["cc"]] * 3, [shape] * 3,
               "kda_intra_fwd_gpu", interpret, q, k, g, beta, rc, rr)


def _intra_bwd_kernel(q_ref, k_ref, g_ref, beta_ref, rc_ref, rr_ref, Linv_ref, Lraw_ref, dQd_ref,
                      dM_ref, dKl_ref, dKd_ref, dT_ref, da_ref, dq_ref, dk_ref, dg_ref, dbeta_ref,
                      *, scale):
  f = lambda r: r[...].astype(_f32)
  partials = tuple(r[...] for r in (dQd_ref, dM_ref, dKl_ref, dKd_ref, dT_ref, da_ref))
  dq, dk, dg, dbeta = cm.intra_bwd(f(q_ref), f(k_ref), f(g_ref), beta_ref[...], rc_ref[...],
                                   rr_ref[...], Linv_ref[...], Lraw_ref[...], partials, scale,
                                   cm.MASK_OPS)
  for ref, val in ((dq_ref, dq), (dk_ref, dk), (dg_ref, dg), (dbeta_ref, dbeta)):
    ref[...] = val.astype(ref.dtype)


def _intra_bwd(q, k, g, beta, rc, rr, L_inv, L_raw, partials, *, scale, interpret):
  """Grid (B, H, NT, K/BK): everything here is separable over K columns except the small
  [64,64] dL work, which each K block redoes; one program for all of K needs ~400 KiB of
  shared memory on an H100. dbeta is K-free: every K block writes the same values."""
  B, H, Tp, K = q.shape
  bk = min(K, BK)
  tile = lambda n: pl.BlockSpec((sq, sq, C, n), lambda b, h, c, j: (b, h, c, 0))
  ktile = pl.BlockSpec((sq, sq, C, bk), lambda b, h, c, j: (b, h, c, j))
  cc, beta_s = tile(C), tile(1)
  rc_s = pl.BlockSpec((sq, C, 1), lambda b, h, c, j: (b, c, 0))
  rr_s = pl.BlockSpec((sq, sq, 1, C), lambda b, h, c, j: (b, c, 0, 0))
  da_s = pl.BlockSpec((sq, sq, sq, 1, bk), lambda b, h, c, j: (b, h, c, 0, j))
  return _call(functools.partial(_intra_bwd_kernel, scale=scale), (B, H, Tp // C, K // bk),
               [ktile, ktile, ktile, beta_s, rc_s, rr_s, cc, cc, ktile, cc, ktile, ktile, cc, da_s],
               [ktile, ktile, ktile, beta_s],
               [(x.shape, x.dtype) for x in (q, k, g, beta)], "kda_intra_bwd_gpu", interpret,
               q, k, g, beta, rc, rr, L_inv, L_raw, *partials)


# --- recurrence kernels: grid (B, H, V/BV), one program walks all chunks ---------------------

def _seq_specs(NT, Tp, K, bv):
  per_head = lambda *tail: pl.BlockSpec((sq, sq) + tail, lambda b, h, j: (b, h) + (0,) * len(tail))
  vblock = lambda *tail: pl.BlockSpec((sq, sq) + tail,
                                      lambda b, h, j: (b, h) + (0,) * (len(tail) - 1) + (j,))
  partial = lambda *tail: pl.BlockSpec((sq, sq, sq) + tail,
                                       lambda b, h, j: (j, b, h) + (0,) * len(tail))
  return dict(
      k=per_head(Tp, K), cc=per_head(Tp, C), beta=per_head(Tp, 1),
      rc=pl.BlockSpec((sq, Tp, 1), lambda b, h, j: (b, 0, 0)),
      rr=pl.BlockSpec((sq, NT, 1, C), lambda b, h, j: (b, 0, 0, 0)),
      v=vblock(Tp, bv), state=vblock(K, bv), chunk_state=vblock(NT, K, bv),
      p_k=partial(Tp, K), p_cc=partial(Tp, C), p_da=partial(NT, 1, K))


def _load_chunk(c, q_ref, k_ref, v_ref, g_ref, beta_ref, rc_ref, rr_ref, M_ref, Linv_ref):
  rows = pl.ds(pl.multiple_of(c * C, C), C)
  f = lambda r: r[rows, :].astype(_f32)
  return (f(q_ref), f(k_ref), f(v_ref), f(g_ref), f(beta_ref), f(rc_ref), rr_ref[c],
          f(M_ref), f(Linv_ref)), rows


def _state_fwd_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, rc_ref, rr_ref, M_ref, Linv_ref,
                      h0_ref, o_ref, ht_ref, *states_ref, scale, nt):
  def step(c, s0):
    x, rows = _load_chunk(c, q_ref, k_ref, v_ref, g_ref, beta_ref, rc_ref, rr_ref, M_ref,
                          Linv_ref)
    if states_ref:
      states_ref[0][c] = s0
    o, s1 = cm.state_fwd(*x, s0, scale)
    o_ref[rows, :] = o.astype(o_ref.dtype)
    return s1

  ht_ref[...] = jax.lax.fori_loop(0, nt, step, h0_ref[...])


def _fwd_call(q, k, v, g, beta, h0, rc, rr, alog, dtb, *, scale, save_states, interpret, fused):
  assert not fused.active and alog is None, "the GPU kernels take prepared inputs"
  B, H, Tp, K = q.shape
  V = v.shape[-1]
  NT, bv = Tp // C, min(V, BV)
  M, L_inv, _ = _intra_fwd(q, k, g, beta, rc, rr, scale=scale, interpret=interpret)
  s = _seq_specs(NT, Tp, K, bv)
  out_specs = [s["v"], s["state"]] + ([s["chunk_state"]] if save_states else [])
  out_shape = [((B, H, Tp, V), v.dtype), ((B, H, K, V), _f32)]
  out_shape += [((B, H, NT, K, V), _f32)] if save_states else []
  outs = _call(functools.partial(_state_fwd_kernel, scale=scale, nt=NT), (B, H, V // bv),
               [s["k"], s["k"], s["v"], s["k"], s["beta"], s["rc"], s["rr"], s["cc"], s["cc"],
                s["state"]], out_specs, out_shape, "kda_fwd_gpu", interpret,
               q, k, v, g, beta, rc, rr, M, L_inv, h0)
  return outs if save_states else (*outs, None)


def _state_bwd_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, rc_ref, rr_ref, M_ref, Linv_ref,
                      states_ref, do_ref, dht_ref, dv_ref, dh0_ref, dQd_ref, dM_ref, dKl_ref,
                      dKd_ref, dT_ref, da_ref, *, scale, nt):
  def step(i, ds1):
    c = nt - 1 - i
    x, rows = _load_chunk(c, q_ref, k_ref, v_ref, g_ref, beta_ref, rc_ref, rr_ref, M_ref,
                          Linv_ref)
    dv, ds0, (dQd, dM, dKl, dKd, dT, da) = cm.state_bwd(
        *x, states_ref[c], do_ref[rows, :].astype(_f32), ds1, scale)
    dv_ref[rows, :] = dv.astype(dv_ref.dtype)
    for ref, val in ((dQd_ref, dQd), (dM_ref, dM), (dKl_ref, dKl), (dKd_ref, dKd), (dT_ref, dT)):
      ref[rows, :] = val
    da_ref[c] = da
    return ds0

  dh0_ref[...] = jax.lax.fori_loop(0, nt, step, dht_ref[...])


def _bwd_call(q, k, v, g, beta, rc, rr, alog, dtb, states, do, dht, *, scale, interpret,
              fused):
  assert not fused.active and alog is None, "the GPU kernels take prepared inputs"
  B, H, Tp, K = q.shape
  V = v.shape[-1]
  NT, bv = Tp // C, min(V, BV)
  nv = V // bv
  M, L_inv, L_raw = _intra_fwd(q, k, g, beta, rc, rr, scale=scale, interpret=interpret)
  s = _seq_specs(NT, Tp, K, bv)
  part_k, part_cc = ((nv, B, H, Tp, K), _f32), ((nv, B, H, Tp, C), _f32)
  dv, dh0, *partials = _call(
      functools.partial(_state_bwd_kernel, scale=scale, nt=NT), (B, H, nv),
      [s["k"], s["k"], s["v"], s["k"], s["beta"], s["rc"], s["rr"], s["cc"], s["cc"],
       s["chunk_state"], s["v"], s["state"]],
      [s["v"], s["state"], s["p_k"], s["p_cc"], s["p_k"], s["p_k"], s["p_cc"], s["p_da"]],
      [(v.shape, v.dtype), ((B, H, K, V), _f32), part_k, part_cc, part_k, part_k, part_cc,
       ((nv, B, H, NT, 1, K), _f32)],
      "kda_bwd_gpu", interpret, q, k, v, g, beta, rc, rr, M, L_inv, states, do, dht)
  partials = [p.sum(axis=0) for p in partials]  # add up the V column blocks
  dq, dk, dg, dbeta = _intra_bwd(q, k, g, beta, rc, rr, L_inv, L_raw, partials, scale=scale,
                                 interpret=interpret)
  return dq, dk, dv, dg, dbeta, dh0


_kda_core = _wrapper.make_core(_fwd_call, _bwd_call)


def kda_gpu(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
            segment_ids=None, A_log=None, dt_bias=None, raw: RawInputs = PREPARED,
            interpret=False) -> tuple[jax.Array, jax.Array | None]:
  """KDA on NVIDIA GPUs; same contract and options as `tpu.kda_tpu`. `interpret=True` runs
  the Triton-lowered kernels in Pallas interpret mode (any backend, e.g. CPU).

  The raw-input options are applied in the wrapper (reference.prepare_inputs), not in-kernel:
  the K-blocked intra_bwd kernel never sees a whole q/k row, which the l2norm's backward needs."""
  return _wrapper.kda_with(
      _kda_core, _layout.power_of_two, q, k, v, g, beta, scale=scale, initial_state=initial_state,
      output_final_state=output_final_state, segment_ids=segment_ids, A_log=A_log,
      dt_bias=dt_bias, raw=raw, interpret=interpret, in_kernel=False)


def kda_step_gpu(q, k, v, g, beta, state, *, scale=None, interpret=False):
  """Fused single-token decode on GPU, same contract as `tpu.kda_step_tpu`: one program per
  (batch, head), state updated in place (aliased). K and V must be powers of two (Triton)."""
  return _wrapper.step_call(
      q, k, v, g, beta, state, scale=scale, heads=None,
      compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1), interpret=interpret,
      name="kda_step_gpu")
