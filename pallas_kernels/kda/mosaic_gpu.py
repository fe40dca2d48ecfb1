"""Chunked KDA for Hopper-class NVIDIA GPUs in Pallas Mosaic GPU (SPEC §2.4, §4).

Split (as fla's chunk_kda): the per-chunk work that needs no state is chunk-parallel and runs
in jnp (`_chunk_math` vmapped over (batch, head, chunk), float32 at Precision.HIGHEST); the
sequential recurrence, where all the state traffic is, is one Mosaic GPU kernel. Per chunk,
with the state carried transposed, S^T [V,K] (every wgmma then has V rows, its M dimension):

    Vp^T = U^T + S0^T Wn^T          Wn = -(I+L)^-1 Diag(beta) Kd,  U = (I+L)^-1 Diag(beta) v
    o^T  = S0^T Qd^T + Vp^T M^T
    S1^T = S0^T Diag(a) + Vp^T Kl

The kernel (`_recurrence`) runs on a grid (B, H, V/64) of one warpgroup each; the state block
[64, K] stays in shared memory in float32 for the whole sequence (the fp32 state of SPEC §4),
and every chunk operand arrives by TMA (`plgpu.copy_gmem_to_smem`) into 128-byte-swizzled
[64, 64] tiles that the warpgroup matmuls (`plgpu.wgmma`) read directly.

Tile sizes, and why:
  * C = 64 tokens per chunk (SPEC §4): the M and contraction size of one warpgroup wgmma.
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

Precision: float32 wgmma runs on TF32 tensor cores (10 mantissa bits), far from SPEC §8's 1e-5.
Every product is therefore 3xTF32: with x = hi + lo split exactly (hi = x truncated to TF32,
`tf32_split`), a b ~ a_hi b_hi + a_hi b_lo + a_lo b_hi, dropping a_lo b_lo (< 2^-20 |a||b|).
Operands are stored as their (hi, lo) planes, so the sum is the same whether the tensor core
or (interpret mode) numpy multiplies them. The chunk operands are split in the jnp prologue;
the state and Vp in-kernel, and the state lives in shared memory as hi + lo (exactly its
float32 value). tf32 wgmma needs both operands K-major, which is why everything is transposed
as above (each B operand is stored [N, contraction] and read through `.T`).

Backward: not a Mosaic GPU kernel yet. The custom_vjp recomputes the forward in jnp and takes
the VJP of `reference.chunk_kda` (the plain chunked form), which is exact in float32 but runs at
XLA speed. Raw-input options (K3 gate, beta sigmoid, q/k l2norm) are applied in the jnp prologue
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
from pallas_kernels.kda import _layout
from pallas_kernels.kda import reference

C = cm.C
BV = 64
BK = 64
MAX_K = 128
_f32 = jnp.float32


def tf32_split(x):
  """x = hi + lo exactly (float32): hi is x truncated to TF32 (what a tensor core would read
  of x), lo the exact remainder (|lo| < 2^-10 |x|)."""
  hi = jax.lax.bitcast_convert_type(
      jax.lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(0xFFFFE000), _f32)
  return hi, x - hi


def _interpret_arg(interpret):
  if interpret is True:
    return plgpu.InterpretGPUParams()
  return interpret or None


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

_TRANSFORMS = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))


def _smem(*shape):
  return plgpu.SMEM(shape, _f32, transforms=_TRANSFORMS)


def _acc(*shape):
  """A zeroed wgmma accumulator; reading it waits for the matmuls in flight."""
  return plgpu.ACC(shape, _f32)


def _recurrence(wn, qd, m, klT, uT, a, h0T, *, interpret):
  """wn, qd [B,H,NT,2,C,K] (TF32 hi and lo planes); m [B,H,NT,2,C,C]; klT [B,H,NT,2,K,C];
  uT [B,H,NT,V,C]; a [B,H,NT,K]; h0T [B,H,V,K] -> oT [B,H,NT,V,C], htT [B,H,V,K]."""
  B, H, NT, _, _, K = wn.shape  # flattened to (B H NT) / (B H) rows: TMA takes <= 5 dims
  V = uT.shape[3]
  NK = K // BK

  def body(wn_g, qd_g, m_g, klT_g, uT_g, a_g, h0T_g, oT_g, htT_g,
           s_s, slo_s, t_s, vp_s, m_s, u_s, a_s, bar):
    b, h, j = (jax.lax.axis_index(n) for n in ("b", "h", "v"))
    rows = pl.ds(j * BV, BV)
    bh = b * H + h

    def load(*pairs):  # TMA copies (src, dst), in flight together, then wait for all
      for i, (src, dst) in enumerate(pairs):
        plgpu.copy_gmem_to_smem(src, dst, bar.at[i])
      for i in range(len(pairs)):
        plgpu.barrier_wait(bar.at[i])

    def split_tile(src, dst):  # the (hi, lo) planes of one operand tile: 2-D copies for TMA
      return (src.at[0], dst.at[0]), (src.at[1], dst.at[1])

    def put_state(kt, s):  # the float32 state tile as its exact TF32 split hi + lo
      s_s[kt], slo_s[kt] = tf32_split(s)

    for kt in range(NK):
      load((h0T_g.at[bh, rows, pl.ds(kt * BK, BK)], u_s))
      put_state(kt, u_s[...])
    plgpu.commit_smem()

    # acc += a b in 3xTF32 (drops a_lo b_lo, 2^-20 |a||b|); b stored [N, contraction]
    def mm3(acc, a_hi, a_lo, b_hi, b_lo):
      plgpu.wgmma(acc, a_hi, b_hi.T)
      plgpu.wgmma(acc, a_hi, b_lo.T)
      plgpu.wgmma(acc, a_lo, b_hi.T)

    def chunk(c, carry):
      i = bh * NT + c
      load((uT_g.at[i, rows], u_s), *split_tile(m_g.at[i], m_s), (a_g.at[i], a_s))

      vp, o = u_s[...], jnp.zeros((BV, C), _f32)
      for kt in range(NK):  # run_state bodies may not start copies: load, then multiply
        cols = pl.ds(kt * BK, BK)
        load(*split_tile(wn_g.at[i, :, :, cols], t_s.at[0:2]),
             *split_tile(qd_g.at[i, :, :, cols], t_s.at[2:4]))

        def phase_a(vp_acc, o_acc, kt=kt):
          mm3(vp_acc, s_s.at[kt], slo_s.at[kt], t_s.at[0], t_s.at[1])
          mm3(o_acc, s_s.at[kt], slo_s.at[kt], t_s.at[2], t_s.at[3])
          return vp_acc[...], o_acc[...]

        dvp, do = pl.run_scoped(phase_a, _acc(BV, C), _acc(BV, C))
        vp, o = vp + dvp, o + do
      vp_s[0], vp_s[1] = tf32_split(vp)
      plgpu.commit_smem()

      def phase_b(o_acc):
        mm3(o_acc, vp_s.at[0], vp_s.at[1], m_s.at[0], m_s.at[1])
        return o_acc[...]

      o = o + pl.run_scoped(phase_b, _acc(BV, C))
      u_s[...] = o
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(u_s, oT_g.at[i, rows])

      for kt in range(NK):
        cols = pl.ds(kt * BK, BK)
        load(*split_tile(klT_g.at[i, :, cols], t_s.at[0:2]))
        a_row = jax.lax.broadcast_in_dim(a_s[cols], (BV, BK), (1,))

        def phase_c(s_acc):
          mm3(s_acc, vp_s.at[0], vp_s.at[1], t_s.at[0], t_s.at[1])
          return s_acc[...]

        s = (s_s[kt] + slo_s[kt]) * a_row + pl.run_scoped(phase_c, _acc(BV, BK))
        put_state(kt, s)
      plgpu.commit_smem()
      plgpu.wait_smem_to_gmem(0)
      return carry

    jax.lax.fori_loop(0, NT, chunk, 0)
    for kt in range(NK):
      u_s[...] = s_s[kt] + slo_s[kt]
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(u_s, htT_g.at[bh, rows, pl.ds(kt * BK, BK)])
      plgpu.wait_smem_to_gmem(0)

  oT, htT = plgpu.kernel(
      body,
      out_type=(jax.ShapeDtypeStruct((B * H * NT, V, C), _f32),
                jax.ShapeDtypeStruct((B * H, V, K), _f32)),
      scratch_types=[_smem(NK, BV, BK), _smem(NK, BV, BK), _smem(4, C, BK), _smem(2, BV, C),
                     _smem(2, C, C), _smem(BV, C), plgpu.SMEM((K,), _f32),
                     plgpu.Barrier(num_barriers=4)],
      grid=(B, H, V // BV), grid_names=("b", "h", "v"),
      interpret=_interpret_arg(interpret),
      kernel_name="kda_fwd_mosaic_gpu",
  )(*(x.reshape((-1,) + x.shape[3:]) for x in (wn, qd, m, klT, uT, a)),
    h0T.reshape((-1,) + h0T.shape[2:]))
  return oT.reshape(B, H, NT, V, C), htT.reshape(B, H, V, K)


def _pair(x):
  """[..., R, N] -> [..., 2, R, N]: x's TF32 split (hi, lo), for the 3xTF32 products."""
  return jnp.stack(tf32_split(x), axis=-3)


def _forward(q, k, v, g, beta, h0, rc, rr, *, scale, interpret):
  """Prepared inputs in kernel layout [B,H,Tp,*] -> o [B,H,Tp,V] (v's dtype), ht [B,H,K,V]."""
  B, H, Tp, K = q.shape
  V = v.shape[-1]
  NT = Tp // C
  wn, qd, m, klT, uT, a = _prologue(q, k, v, g, beta, rc, rr, scale)
  oT, htT = _recurrence(_pair(wn), _pair(qd), _pair(m), _pair(klT), uT, a,
                        jnp.swapaxes(h0, -1, -2), interpret=interpret)
  o = jnp.swapaxes(oT, -1, -2).reshape(B, H, Tp, V).astype(v.dtype)
  return o, jnp.swapaxes(htT, -1, -2)


_forward_jit = jax.jit(_forward, static_argnames=("scale", "interpret"))


def kda_mosaic_gpu(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    segment_ids: jax.Array | None = None,
    interpret=False,
    A_log: jax.Array | None = None,
    dt_bias: jax.Array | None = None,
    gate: str | None = None,
    lower_bound: float | None = None,
    use_qk_l2norm: bool = False,
    l2norm_eps: float = 1e-6,
    use_beta_sigmoid: bool = False,
) -> tuple[jax.Array, jax.Array | None]:
  """KDA on Hopper+ GPUs, with reference.naive_kda's contract and raw-input options.
  Differentiable in q, k, v, g, beta, initial_state (and A_log, dt_bias with a gate); the
  gradient is the VJP of reference.chunk_kda (see the module docstring). `interpret=True` runs
  the kernel in Mosaic GPU interpret mode on the CPU."""
  reference.check_gate(g, A_log, dt_bias, gate, lower_bound)
  B, T, H, K = q.shape
  V = v.shape[-1]
  if _layout.tile_multiple(K) > MAX_K:
    raise ValueError(f"pallas_mosaic_gpu supports K <= {MAX_K} (shared memory); got K={K}")
  scale = float(K**-0.5 if scale is None else scale)
  opts = dict(A_log=A_log, dt_bias=dt_bias, gate=gate, lower_bound=lower_bound,
              use_qk_l2norm=use_qk_l2norm, l2norm_eps=l2norm_eps,
              use_beta_sigmoid=use_beta_sigmoid)
  h0 = jnp.zeros((B, H, K, V), _f32) if initial_state is None else initial_state
  # segment ids ride as float32 so that every custom_vjp operand is differentiable-typed.
  seg = (jnp.zeros((B, T), _f32) if segment_ids is None
         else jnp.broadcast_to(segment_ids, (B, T)).astype(_f32))
  params = {n: x for n, x in (("A_log", A_log), ("dt_bias", dt_bias)) if x is not None}

  def reference_fn(q, k, v, g, beta, h0, seg, params):
    o, ht = reference.chunk_kda(q, k, v, g, beta, scale=scale, initial_state=h0,
                                output_final_state=True, segment_ids=seg.astype(jnp.int32),
                                **{**opts, **params})
    return o.astype(v.dtype), ht

  @jax.custom_vjp
  def run(q, k, v, g, beta, h0, seg, params):
    qp, kp, gp, bp = reference.prepare_inputs(q, k, g, beta, **{**opts, **params})
    xs = _layout.to_kernel_layout(qp, kp, v, gp, bp, h0, feature_size=_layout.tile_multiple)
    rc, rr = _layout.reset_counts(seg.astype(jnp.int32), B, T, xs[0].shape[2])
    o, ht = _forward_jit(*xs, rc, rr, scale=scale, interpret=interpret)
    return _layout.from_kernel_layout(o, ht, T=T, V=V, K=K)

  def run_fwd(*args):
    return run(*args), args

  def run_bwd(args, cts):
    return jax.vjp(reference_fn, *args)[1](cts)

  run.defvjp(run_fwd, run_bwd)
  o, ht = run(q, k, v, g, beta, h0.astype(_f32), seg, params)
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
      interpret=_interpret_arg(interpret),
      kernel_name="kda_step_mosaic_gpu",
  )(*(pad(x.astype(_f32), n) for x, n in ((q, Kp), (k, Kp), (v, Vp), (g, Kp))), beta_v, state)
  return o[..., :V].astype(v.dtype), s[:, :, :K, :V]
