"""The differentiable public wrapper shared by the Pallas KDA backends.

A backend supplies two kernel-layout calls (see tpu.py / gpu.py):
  fwd_call(q, k, v, g, beta, h0, rc, rr, alog, dtb, *, scale, save_states, interpret, fused)
      -> o, ht, states|None
  bwd_call(q, k, v, g, beta, rc, rr, alog, dtb, states, do, dht, *, scale, interpret, fused)
      -> dq, dk, dv, dg, dbeta, dh0
and this module turns them into `kda_<backend>(q, k, v, g, beta, *, ...)` with a custom_vjp.
Residuals are the inputs plus the float32 state entering every chunk ([B,H,NT,K,V]), so the
backward kernel recomputes each chunk's intermediates instead of storing them.

`fused` (_chunk_math.Fused) says which raw-input transforms the kernels apply in-kernel; the
inputs are then raw and so are the gradients the backward kernel returns. alog / dtb [H,1,K]
(per-head A_log repeated along the lanes, dt_bias) are None unless the gate is fused.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.kda import _chunk_math as cm
from pallas_kernels.kda import _layout
from pallas_kernels.kda import reference


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
             segment_ids, interpret, in_kernel, A_log=None, dt_bias=None, gate=None,
             lower_bound=None, use_qk_l2norm=False, l2norm_eps=1e-6, use_beta_sigmoid=False):
  """Go to kernel layout, run `core`, come back. The raw-input options (reference.prepare_inputs)
  run in-kernel if `in_kernel`, except the softplus gate; else here with prepare_inputs (JAX
  differentiates it)."""
  reference.check_gate(g, A_log, dt_bias, gate, lower_bound)
  if not in_kernel or gate == "softplus":
    q, k, g, beta = reference.prepare_inputs(
        q, k, g, beta, A_log=A_log, dt_bias=dt_bias, gate=gate, lower_bound=lower_bound,
        use_qk_l2norm=use_qk_l2norm, l2norm_eps=l2norm_eps, use_beta_sigmoid=use_beta_sigmoid)
    use_qk_l2norm = use_beta_sigmoid = False
    gate = None
  B, T, H, K = q.shape
  V = v.shape[-1]
  scale = float(K**-0.5 if scale is None else scale)
  fused = cm.Fused(l2norm_eps=float(l2norm_eps) if use_qk_l2norm else None,
                   use_beta_sigmoid=bool(use_beta_sigmoid),
                   lower_bound=None if gate is None else float(lower_bound), T=T, K=K)
  if not fused.active:
    fused = cm.Fused()  # one compilation for every prepared-input shape's T, K
  qk, kk, vk, gk, bk, h0 = _layout.to_kernel_layout(q, k, v, g, beta, initial_state,
                                                    feature_size=feature_size)
  rc, rr = _layout.reset_counts(segment_ids, B, T, qk.shape[2])
  alog = dtb = None
  if gate is not None:
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
