"""The differentiable public wrapper shared by the Pallas KDA backends.

A backend supplies two kernel-layout calls (see tpu.py / gpu.py):
  fwd_call(q, k, v, g, beta, h0, rc, rr, *, scale, save_states, interpret) -> o, ht, states|None
  bwd_call(q, k, v, g, beta, rc, rr, states, do, dht, *, scale, interpret)
      -> dq, dk, dv, dg, dbeta, dh0
and this module turns them into `kda_<backend>(q, k, v, g, beta, *, ...)` with a custom_vjp.
Residuals are the inputs plus the float32 state entering every chunk ([B,H,NT,K,V]), so the
backward kernel recomputes each chunk's intermediates instead of storing them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.kda import _layout


def make_core(fwd_call, bwd_call):
  # jit so that eager callers (tests, decode loops) compile each kernel once per shape.
  fwd_call = jax.jit(fwd_call, static_argnames=("scale", "save_states", "interpret"))
  bwd_call = jax.jit(bwd_call, static_argnames=("scale", "interpret"))

  @functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9))
  def core(q, k, v, g, beta, h0, rc, rr, scale, interpret):
    o, ht, _ = fwd_call(q, k, v, g, beta, h0, rc, rr, scale=scale, save_states=False,
                        interpret=interpret)
    return o, ht

  def core_fwd(q, k, v, g, beta, h0, rc, rr, scale, interpret):
    o, ht, states = fwd_call(q, k, v, g, beta, h0, rc, rr, scale=scale, save_states=True,
                             interpret=interpret)
    return (o, ht), (q, k, v, g, beta, rc, rr, states)

  def core_bwd(scale, interpret, res, cts):
    q, k, v, g, beta, rc, rr, states = res
    do, dht = cts
    grads = bwd_call(q, k, v, g, beta, rc, rr, states, do.astype(v.dtype),
                     dht.astype(jnp.float32), scale=scale, interpret=interpret)
    return (*grads, jnp.zeros_like(rc), jnp.zeros_like(rr))

  core.defvjp(core_fwd, core_bwd)
  return core


def kda_with(core, feature_size, q, k, v, g, beta, *, scale, initial_state, output_final_state,
             segment_ids, interpret, **fused):
  """Preprocess (optional fused inputs), go to kernel layout, run `core`, come back."""
  q, k, g, beta = _layout.preprocess(q, k, g, beta, **fused)
  B, T, H, K = q.shape
  V = v.shape[-1]
  scale = float(K**-0.5 if scale is None else scale)
  qk, kk, vk, gk, bk, h0 = _layout.to_kernel_layout(q, k, v, g, beta, initial_state,
                                                    feature_size=feature_size)
  rc, rr = _layout.reset_counts(segment_ids, B, T, qk.shape[2])
  o, ht = core(qk, kk, vk, gk, bk, h0, rc, rr, scale, interpret)
  o, ht = _layout.from_kernel_layout(o, ht, T=T, V=V, K=K)
  return o, (ht if output_final_state else None)
