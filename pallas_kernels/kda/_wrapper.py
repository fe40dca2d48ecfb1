"""The differentiable public wrapper shared by the Pallas KDA backends.

A backend supplies two kernel-layout calls (see tpu.py / gpu.py):
  fwd_call(q, k, v, g, beta, h0, rc, rr, alog, dtb, *, scale, save_states, interpret, fused)
      -> o, ht, states|None
  bwd_call(q, k, v, g, beta, rc, rr, alog, dtb, states, do, dht, *, scale, interpret, fused)
      -> dq, dk, dv, dg, dbeta, dh0
and this module turns them into `kda_<backend>(q, k, v, g, beta, *, ...)` (ops.kda's backend
signature) with a custom_vjp.
Residuals are the inputs plus the float32 state entering every chunk ([B,H,NT,K,V]), so the
backward kernel recomputes each chunk's intermediates instead of storing them.

`fused` (_chunk_math.Fused) says which raw-input transforms the kernels apply in-kernel; the
inputs are then raw and so are the gradients the backward kernel returns. alog / dtb [H,1,K]
(per-head A_log repeated along the lanes, dt_bias) are None unless the gate is fused.

`step_call` is the fused one-token decode both backends share (their `kda_step_<backend>`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda import _chunk_math as cm
from pallas_kernels.kda import _layout, reference


def make_core(fwd_call, bwd_call):
  # jit so that eager callers (tests, decode loops) compile each kernel once per shape.
  fwd_call = jax.jit(fwd_call, static_argnames=("scale", "save_states", "interpret", "fused"))
  bwd_call = jax.jit(bwd_call, static_argnames=("scale", "interpret", "fused"))

  @functools.partial(jax.custom_vjp, nondiff_argnums=(10, 11, 12))
  def core(q, k, v, g, beta, h0, rc, rr, alog, dtb, scale, interpret, fused):
    o, ht, _ = fwd_call(q, k, v, g, beta, h0, rc, rr, alog, dtb, scale=scale,
                        save_states=False, interpret=interpret, fused=fused)
    return o, ht

  def core_fwd(q, k, v, g, beta, h0, rc, rr, alog, dtb, scale, interpret, fused):
    o, ht, states = fwd_call(q, k, v, g, beta, h0, rc, rr, alog, dtb, scale=scale,
                             save_states=True, interpret=interpret, fused=fused)
    return (o, ht), (q, k, v, g, beta, rc, rr, alog, dtb, states)

  def core_bwd(scale, interpret, fused, res, cts):
    q, k, v, g, beta, rc, rr, alog, dtb, states = res
    do, dht = cts
    dq, dk, dv, dg, dbeta, dh0 = bwd_call(
        q, k, v, g, beta, rc, rr, alog, dtb, states, do.astype(v.dtype),
        dht.astype(jnp.float32), scale=scale, interpret=interpret, fused=fused)
    dalog = ddtb = None
    if fused.gate:
      # z = exp(A_log[h]) (x + dt_bias[h]) and dg is already dL/dx = dL/dz exp(A_log[h]), so
      # dL/d dt_bias = sum dx and dL/dA_log = sum dL/dz z = sum dx (x + dt_bias), over batch and
      # time here and over the lanes by the transpose of A_log's broadcast (_layout.gate_rows;
      # padding has dx = 0). Both pairwise: a running float32 sum of B*T terms drifts.
      ddtb = _layout.tree_sum(dg, (0, 2))[:, None, :]
      dalog = _layout.tree_sum(dg * (g + dtb), (0, 2))[:, None, :]
    return (dq, dk, dv, dg, dbeta, dh0, jnp.zeros_like(rc), jnp.zeros_like(rr), dalog, ddtb)

  core.defvjp(core_fwd, core_bwd)
  return core


def kda_with(core, feature_size, q, k, v, g, beta, *, scale, initial_state, output_final_state,
             segment_ids, A_log, dt_bias, raw: reference.RawInputs, interpret, in_kernel):
  """Go to kernel layout, run `core`, come back. The raw-input transforms (`raw`) run in-kernel
  if `in_kernel`, except the softplus gate; else here with reference.prepare_inputs (JAX
  differentiates it)."""
  raw.check(g, A_log, dt_bias)
  if not in_kernel or raw.gate == reference.Gate.SOFTPLUS:
    q, k, g, beta = reference.prepare_inputs(q, k, g, beta, A_log=A_log, dt_bias=dt_bias,
                                             raw=raw)
    raw = reference.PREPARED
  B, T, H, K = q.shape
  V = v.shape[-1]
  scale = float(K**-0.5 if scale is None else scale)
  fused = cm.Fused(l2norm_eps=float(raw.l2norm_eps) if raw.use_qk_l2norm else None,
                   use_beta_sigmoid=bool(raw.use_beta_sigmoid),
                   lower_bound=None if raw.gate is None else float(raw.lower_bound), T=T, K=K)
  if not fused.active:
    fused = cm.Fused()  # one compilation for every prepared-input shape's T, K
  qk, kk, vk, gk, bk, h0 = _layout.to_kernel_layout(q, k, v, g, beta, initial_state,
                                                    feature_size=feature_size)
  rc, rr = _layout.reset_counts(segment_ids, B, T, qk.shape[2])
  alog = dtb = None
  if raw.gate is not None:
    alog, dtb = _layout.gate_rows(A_log, dt_bias, H, K, qk.shape[-1])
  # Inside shard_map: give the operands one varying type out here, where JAX differentiates
  # the cast (replicated A_log / dt_bias then get their gradients summed over the mesh).
  args, _ = _layout.match_vma(*(x for x in (qk, kk, vk, gk, bk, h0, rc, rr, alog, dtb)
                                if x is not None))
  if alog is not None:
    *args, alog, dtb = args
  o, ht = core(*args, alog, dtb, scale, interpret, fused)
  o, ht = _layout.from_kernel_layout(o, ht, T=T, V=V, K=K)
  return o, (ht if output_final_state else None)


def _step_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, s_ref, o_ref, s_out_ref, *, scale):
  o, s = cm.decode_step(q_ref[...].astype(jnp.float32), k_ref[...].astype(jnp.float32),
                        v_ref[...].astype(jnp.float32), g_ref[...].astype(jnp.float32),
                        beta_ref[...], s_ref[...], scale)
  o_ref[...] = o.astype(o_ref.dtype)
  s_out_ref[...] = s


def step_call(q, k, v, g, beta, state, *, scale, heads, compiler_params, interpret, name):
  """One fused decode token: q, k, g [B,H,K]; v [B,H,V]; beta [B,H]; state [B,H,K,V] float32
  -> (o [B,H,V] in v's dtype, new state). The state is updated in place (aliased). The grid is
  (B, H / heads), `heads` heads of one batch row per step (None: one, its axis squeezed);
  q/k/g arrive as columns [K,1] so they scale the state's rows without a relayout, and the step
  is elementwise math in float32 (_chunk_math.decode_step)."""
  B, H, K = q.shape
  V = v.shape[-1]
  scale = float(K**-0.5 if scale is None else scale)
  hb = pl.squeezed if heads is None else heads
  block = lambda *shape: pl.BlockSpec((pl.squeezed, hb, *shape), lambda b, h: (b, h, 0, 0))
  col, row, one, st = block(K, 1), block(1, V), block(1, 1), block(K, V)
  args = (q[..., None], k[..., None], v[:, :, None, :], g.astype(jnp.float32)[..., None],
          beta.astype(jnp.float32)[..., None, None], state.astype(jnp.float32))
  args, mat = _layout.match_vma(*args)
  o, state = pl.pallas_call(
      functools.partial(_step_kernel, scale=scale),
      grid=(B, H // (heads or 1)),
      in_specs=[col, col, row, col, one, st],
      out_specs=[row, st],
      out_shape=[_layout.out_struct((B, H, 1, V), v.dtype, mat),
                 _layout.out_struct((B, H, K, V), jnp.float32, mat)],
      input_output_aliases={5: 1},
      compiler_params=compiler_params,
      interpret=interpret,
      name=name,
  )(*args)
  return o[:, :, 0, :], state
