"""Chunked KDA for Hopper-class NVIDIA GPUs in Pallas Mosaic GPU (docs/kernels.md#kda-backends).

Split (as fla's chunk_kda): the per-chunk work that needs no state is chunk-parallel and runs
in jnp (`_chunk_math` vmapped over (batch, head, chunk), float32 at Precision.HIGHEST); the
sequential recurrence, where all the state traffic is, is one Mosaic GPU kernel. Per chunk,
with the state carried transposed, S^T [V,K] (every wgmma then has V rows, its M dimension):

    Vp^T = U^T + S0^T Wn^T          Wn = -(I+L)^-1 Diag(beta) Kd,  U = (I+L)^-1 Diag(beta) v
    o^T  = S0^T Qd^T + Vp^T M^T
    S1^T = S0^T Diag(a) + Vp^T Kl

The kernel (`_recurrence`) runs on a grid (B, H, V/64) of one warpgroup each; the state block
[64, K] stays in shared memory in float32 for the whole sequence (the op's fp32 state),
and every chunk operand arrives by TMA (`plgpu.copy_gmem_to_smem`) into 128-byte-swizzled
[64, 64] tiles that the warpgroup matmuls (`plgpu.wgmma`) read directly.

Tile sizes, and why:
  * C = 64 tokens per chunk: the M and contraction size of one warpgroup wgmma.
  * BV = 64 V rows per program: one warpgroup's wgmma M tile, so the [64, 64] float32
    accumulators are 32 registers a thread each; a whole V = 128 would not leave registers for
    the three live accumulators, and V blocks are independent (the grid spreads them over SMs).
  * BK = 64 K columns per operand tile: K is walked in 64-wide tiles (static loop) so that one
    [64, 64] float32 tile is 16 KiB and the kernel fits the 227 KiB of shared memory with
    K <= 128 (K3's K): the state block's hi and lo planes 2 x 32 KiB, four chunk tiles (Wn and
    Qd, hi and lo) 64 KiB, Vp^T hi/lo 32 KiB, M hi/lo 32 KiB, one staging tile 16 KiB (U^T in,
    o^T out), a 0.5 KiB: 208.5 KiB. K and V are zero-padded to multiples of 64 (exact, _layout).
  * Swizzle 128 B with (8, 32) tiling: the layout wgmma wants for 4-byte elements (32 floats =
    128 B rows).

Precision: float32 wgmma runs on TF32 tensor cores (10 mantissa bits), far from the 1e-5 of
docs/correctness.md#tolerances.
Every product is therefore 3xTF32: with x = hi + lo split exactly (hi = x truncated to TF32,
`tf32_split`), a b ~ a_hi b_hi + a_hi b_lo + a_lo b_hi, dropping a_lo b_lo (< 2^-20 |a||b|).
Operands are stored as their (hi, lo) planes, so the sum is the same whether the tensor core
or (interpret mode) numpy multiplies them. The chunk operands are split in the jnp prologue;
the state and Vp in-kernel, and the state lives in shared memory as hi + lo (exactly its
float32 value). tf32 wgmma needs both operands K-major, which is why everything is transposed
as above (each B operand is stored [N, contraction] and read through `.T`).

Backward (`mosaic_gpu_bwd`): the recurrence is a custom_vjp (`recurrence`) whose forward kernel
also writes the state entering every chunk; a reverse-time kernel of the same shape carries dS
and writes it per chunk, and every chunk operand's gradient is then chunk-parallel jnp. The jnp
prologue (and the raw-input preparation before it) is differentiated by JAX itself.
Raw-input options (K3 gate, beta sigmoid, q/k l2norm) are applied in the jnp prologue
(`reference.prepare_inputs`, which XLA fuses into the chunk-parallel work), not in the kernel.

Decode (`kda_step_mosaic_gpu`): one warpgroup per (batch, head) holds the [K, V] state in
registers (wgmma layout) for one token's update; no matmul, no shared memory.

Pipelining: the chunk loop waits for each TMA before its matmuls (no double buffering): the
single-buffered working set already fills shared memory at K = 128.

Tested in Mosaic GPU interpret mode on the CPU (plgpu.InterpretGPUParams: numpy matmuls, so it
checks the algebra, the 3xTF32 split and the TMA/SMEM indexing, not TF32 rounding) and by
lowering for CUDA on a CPU-only machine (Mosaic GPU's own lowering checks the wgmma operand
layouts, tile shapes and transforms). Never run on a GPU as of this writing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kda import _chunk_math as cm
from pallas_kernels.kda import _layout, mosaic_gpu_bwd, reference
from pallas_kernels.kda import _mgpu as mg
from pallas_kernels.kda.reference import PREPARED, RawInputs

C = cm.C
BV = BK = mg.TILE
MAX_K = 128
_f32 = jnp.float32
tf32_split = mg.tf32_split


# --- chunk-parallel prologue (jnp) ------------------------------------------------------------

def _chunk_operands(q, k, v, g, beta_c, rc, rr, scale):
  """One chunk -> (Wn, Qd [C,K]; M [C,C]; KlT [K,C]; UT [V,C]; a [K])."""
  M, L_inv, _ = cm.intra_fwd(q, k, g, beta_c, rc, rr, scale, cm.RESHAPE_OPS)
  d = cm._Decays(q, k, g, beta_c, rc, rr, scale)
  T = L_inv * d.beta_r
  return (-cm.mm(T, d.Kd), d.Qd, M, d.Kl.T, cm.mm(T, v).T, d.a_r[0])


def _prologue(q, k, v, g, beta, rc, rr, scale):
  """Kernel-layout inputs [B,H,Tp,*] -> per-chunk operands [B,H,NT,...] (float32)."""
  B, H, Tp, K = q.shape
  NT = Tp // C
  split = lambda x: x.reshape(B, H, NT, C, x.shape[-1]).astype(_f32)
  rc_c = jnp.broadcast_to(rc.reshape(B, 1, NT, C, 1), (B, H, NT, C, 1))
  rr_c = jnp.broadcast_to(rr[:, None], (B, H, NT, 1, C))
  f = functools.partial(_chunk_operands, scale=scale)
  for _ in range(3):
    f = jax.vmap(f)
  return f(split(q), split(k), split(v), split(g), split(beta), rc_c, rr_c)


# --- the recurrence kernel --------------------------------------------------------------------

def _recurrence(wn, qd, m, klT, uT, a, h0T, *, save_states, interpret):
  """wn, qd [B,H,NT,C,K]; m [B,H,NT,C,C]; klT [B,H,NT,K,C]; uT [B,H,NT,V,C]; a [B,H,NT,K];
  h0T [B,H,V,K] (float32; the matmul operands go in as TF32 hi and lo planes) -> oT
  [B,H,NT,V,C], htT [B,H,V,K], and with save_states the state entering every chunk, s0T
  [B,H,NT,V,K] (the backward's residual)."""
  B, H, NT, _, K = wn.shape  # flattened to (B H NT) / (B H) rows: TMA takes <= 5 dims
  V = uT.shape[3]
  NK = K // BK

  def body(wn_g, qd_g, m_g, klT_g, uT_g, a_g, h0T_g, oT_g, htT_g, *rest):
    s0T_g = rest[0] if save_states else None
    s_s, slo_s, t_s, vp_s, m_s, u_s, a_s, bar = rest[1:] if save_states else rest
    b, h, j = (jax.lax.axis_index(n) for n in ("b", "h", "v"))
    rows = pl.ds(j * BV, BV)
    bh = b * H + h
    load = mg.loader(bar)

    mg.load_state(load, lambda kt: h0T_g.at[bh, rows, pl.ds(kt * BK, BK)], s_s, slo_s, u_s)

    def chunk(c, carry):
      i = bh * NT + c
      if save_states:
        mg.store_state(s_s, slo_s, u_s, lambda kt: s0T_g.at[i, rows, pl.ds(kt * BK, BK)])
      load((uT_g.at[i, rows], u_s), *mg.split_tile(m_g.at[i], m_s), (a_g.at[i], a_s))

      vp, o = u_s[...], jnp.zeros((BV, C), _f32)
      for kt in range(NK):  # run_state bodies may not start copies: load, then multiply
        cols = pl.ds(kt * BK, BK)
        load(*mg.split_tile(wn_g.at[i, :, :, cols], t_s.at[0:2]),
             *mg.split_tile(qd_g.at[i, :, :, cols], t_s.at[2:4]))

        def phase_a(vp_acc, o_acc, kt=kt):
          mg.mm3(vp_acc, s_s.at[kt], slo_s.at[kt], t_s.at[0], t_s.at[1])
          mg.mm3(o_acc, s_s.at[kt], slo_s.at[kt], t_s.at[2], t_s.at[3])
          return vp_acc[...], o_acc[...]

        dvp, do = pl.run_scoped(phase_a, mg.acc(BV, C), mg.acc(BV, C))
        vp, o = vp + dvp, o + do
      vp_s[0], vp_s[1] = tf32_split(vp)
      plgpu.commit_smem()

      def phase_b(o_acc):
        mg.mm3(o_acc, vp_s.at[0], vp_s.at[1], m_s.at[0], m_s.at[1])
        return o_acc[...]

      o = o + pl.run_scoped(phase_b, mg.acc(BV, C))
      u_s[...] = o
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(u_s, oT_g.at[i, rows])

      for kt in range(NK):
        cols = pl.ds(kt * BK, BK)
        load(*mg.split_tile(klT_g.at[i, :, cols], t_s.at[0:2]))
        a_row = jax.lax.broadcast_in_dim(a_s[cols], (BV, BK), (1,))

        def phase_c(s_acc):
          mg.mm3(s_acc, vp_s.at[0], vp_s.at[1], t_s.at[0], t_s.at[1])
          return s_acc[...]

        s = (s_s[kt] + slo_s[kt]) * a_row + pl.run_scoped(phase_c, mg.acc(BV, BK))
        s_s[kt], slo_s[kt] = tf32_split(s)
      plgpu.commit_smem()
      plgpu.wait_smem_to_gmem(0)
      return carry

    jax.lax.fori_loop(0, NT, chunk, 0)
    mg.store_state(s_s, slo_s, u_s, lambda kt: htT_g.at[bh, rows, pl.ds(kt * BK, BK)])

  out_type = (jax.ShapeDtypeStruct((B * H * NT, V, C), _f32),
              jax.ShapeDtypeStruct((B * H, V, K), _f32))
  if save_states:
    out_type += (jax.ShapeDtypeStruct((B * H * NT, V, K), _f32),)
  outs = mg.recurrence_kernel(
      body, out_type, mg.smem(2, C, C), B=B, H=H, V=V, K=K, name="kda_fwd_mosaic_gpu",
      interpret=interpret,
  )(*map(mg.rows_of, (mg.pair(wn), mg.pair(qd), mg.pair(m), mg.pair(klT), uT, a)),
    mg.rows_of(h0T, 2))
  oT, htT = outs[0].reshape(B, H, NT, V, C), outs[1].reshape(B, H, V, K)
  return (oT, htT) + ((outs[2].reshape(B, H, NT, V, K),) if save_states else ())


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def recurrence(wn, qd, m, klT, uT, a, h0T, interpret):
  """The chunk recurrence on the prologue's float32 operands (per chunk: wn, qd [C,K], m
  [C,C], klT [K,C], uT [V,C], a [K]; h0T [V,K]) -> (oT [..,NT,V,C], htT [..,V,K]),
  differentiable through mosaic_gpu_bwd's reverse-time kernel."""
  return _recurrence(wn, qd, m, klT, uT, a, h0T, save_states=False, interpret=interpret)


def _recurrence_fwd(wn, qd, m, klT, uT, a, h0T, interpret):
  oT, htT, s0T = _recurrence(wn, qd, m, klT, uT, a, h0T, save_states=True,
                             interpret=interpret)
  return (oT, htT), ((wn, qd, m, klT, uT, a), s0T)


def _recurrence_bwd(interpret, res, cts):
  operands, s0T = res
  d_operands, dh0T = mosaic_gpu_bwd.recurrence_bwd(operands, s0T, *cts, interpret=interpret)
  return (*d_operands, dh0T)


recurrence.defvjp(_recurrence_fwd, _recurrence_bwd)


def _forward(q, k, v, g, beta, h0, rc, rr, *, scale, interpret):
  """Prepared inputs in kernel layout [B,H,Tp,*] -> o [B,H,Tp,V] (v's dtype), ht [B,H,K,V]."""
  B, H, Tp, K = q.shape
  V = v.shape[-1]
  wn, qd, m, klT, uT, a = _prologue(q, k, v, g, beta, rc, rr, scale)
  oT, htT = recurrence(wn, qd, m, klT, uT, a, jnp.swapaxes(h0, -1, -2), interpret)
  o = jnp.swapaxes(oT, -1, -2).reshape(B, H, Tp, V).astype(v.dtype)
  return o, jnp.swapaxes(htT, -1, -2)


_forward_jit = jax.jit(_forward, static_argnames=("scale", "interpret"))


def kda_mosaic_gpu(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                   segment_ids=None, A_log=None, dt_bias=None, raw: RawInputs = PREPARED,
                   interpret=False) -> tuple[jax.Array, jax.Array | None]:
  """KDA on Hopper+ GPUs, with reference.naive_kda's contract and raw-input options.
  Differentiable in q, k, v, g, beta, initial_state (and A_log, dt_bias with a gate): the
  recurrence through mosaic_gpu_bwd's kernel, the rest by JAX (see the module docstring).
  `interpret=True` runs the kernels in Mosaic GPU interpret mode on the CPU."""
  raw.check(g, A_log, dt_bias)
  B, T, H, K = q.shape
  V = v.shape[-1]
  if _layout.tile_multiple(K) > MAX_K:
    raise ValueError(f"pallas_mosaic_gpu supports K <= {MAX_K} (shared memory); got K={K}")
  scale = float(K**-0.5 if scale is None else scale)
  h0 = jnp.zeros((B, H, K, V), _f32) if initial_state is None else initial_state
  seg = (jnp.zeros((B, T), jnp.int32) if segment_ids is None
         else jnp.broadcast_to(segment_ids, (B, T)).astype(jnp.int32))
  qp, kp, gp, bp = reference.prepare_inputs(q, k, g, beta, A_log=A_log, dt_bias=dt_bias,
                                            raw=raw)
  xs = _layout.to_kernel_layout(qp, kp, v, gp, bp, h0.astype(_f32),
                                feature_size=_layout.tile_multiple)
  rc, rr = _layout.reset_counts(seg, B, T, xs[0].shape[2])
  o, ht = _forward_jit(*xs, rc, rr, scale=scale, interpret=interpret)
  o, ht = _layout.from_kernel_layout(o, ht, T=T, V=V, K=K)
  return o, (ht if output_final_state else None)


# --- fused decode step -------------------------------------------------------------------------

_ROWS = plgpu.Layout.WGMMA  # [K, V] state: K on rows (64 per warpgroup tile), V on columns


def _step_body(q_g, k_g, v_g, g_g, beta_g, s_g, o_g, s_out_g, *, scale):
  b, h = jax.lax.axis_index("b"), jax.lax.axis_index("h")
  col = lambda r: plgpu.load(r.at[b, h], layout=_ROWS.reduce(1))  # [K]: one value per row
  row = lambda r: plgpu.load(r.at[b, h], layout=_ROWS.reduce(0))  # [V]: one value per column
  s = plgpu.load(s_g.at[b, h], layout=_ROWS)
  K, V = s.shape
  bc = lambda x: jax.lax.broadcast_in_dim(x, (K, V), (0,))
  br = lambda x: jax.lax.broadcast_in_dim(x, (K, V), (1,))
  k = col(k_g)
  s = s * bc(jnp.exp(col(g_g)))
  pred = jnp.sum(s * bc(k), axis=0)
  s = s + bc(k) * br(row(beta_g) * (row(v_g) - pred))
  o_g[b, h] = jnp.sum(s * bc(col(q_g) * scale), axis=0)
  s_out_g[b, h] = s


def kda_step_mosaic_gpu(q, k, v, g, beta, state, *, scale=None, interpret=False):
  """Fused single-token decode, same contract as `tpu.kda_step_tpu`: q, k, g [B,H,K]; v [B,H,V];
  beta [B,H]; state [B,H,K,V] float32 -> (o [B,H,V] in v's dtype, new state float32).

  One warpgroup per (batch, head) loads the [K, V] state from HBM straight into registers
  (wgmma layout: K rows in 64-row tiles), applies the step (reference.decode_step's math in
  float32, no matmul) and writes the new state: one read and one write of the state. K and V
  are zero-padded to multiples of 64 (exact: zero rows/columns stay zero). The vectors travel
  in float32 (a bf16 [K] vector spread over a warpgroup is 2 bytes a thread, below the 4-byte
  GMEM transfer Mosaic GPU needs); they are tiny next to the state."""
  B, H, K = q.shape
  V = v.shape[-1]
  scale = float(K**-0.5 if scale is None else scale)
  Kp, Vp = _layout.tile_multiple(K), _layout.tile_multiple(V)
  pad = lambda x, n: jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, n - x.shape[-1])])
  state = jnp.pad(state.astype(_f32), ((0, 0), (0, 0), (0, Kp - K), (0, Vp - V)))
  beta_v = jnp.broadcast_to(beta.astype(_f32)[..., None], (B, H, Vp))
  o, s = plgpu.kernel(
      functools.partial(_step_body, scale=scale),
      out_type=(jax.ShapeDtypeStruct((B, H, Vp), _f32),
                jax.ShapeDtypeStruct((B, H, Kp, Vp), _f32)),
      grid=(B, H), grid_names=("b", "h"),
      interpret=mg.interpret_arg(interpret),
      kernel_name="kda_step_mosaic_gpu",
  )(*(pad(x.astype(_f32), n) for x, n in ((q, Kp), (k, Kp), (v, Vp), (g, Kp))), beta_v, state)
  return o[..., :V].astype(v.dtype), s[:, :, :K, :V]
