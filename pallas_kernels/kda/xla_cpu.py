"""The XLA:CPU KDA backend ("xla_cpu", the default where there is no TPU or GPU): the chunked
form (docs/kernels.md#kda-chunked-form, C = 64) in jnp, tuned for XLA:CPU, with its own backward.

    o, s = kda_xla_cpu(q, k, v, g, beta, *, scale=None, initial_state=None,
                       output_final_state=False, segment_ids=None, A_log=None, dt_bias=None,
                       raw=RawInputs(...))

Same contract and options as reference.naive_kda / reference.chunk_kda, which define it; the
raw inputs run through reference.prepare_inputs (JAX differentiates them). The
per-chunk math lives in _xla_cpu_math.py.

Why a backward of its own: autodiff of a scan stores every intermediate of every step (the
per-token recurrence's backward runs orders of magnitude slower than its forward on a CPU:
docs/benchmarks.md#kda). The custom VJP
keeps only the state entering each chunk and recomputes each chunk's intra-chunk work inside one
reverse scan that carries dS; only that recomputed intra-chunk part (no sequential dependence,
a few batched matmuls) goes through jax.vjp.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.kda import reference
from pallas_kernels.kda._xla_cpu_math import (
  CHUNK,
  Intra,
  chunk_apply,
  chunk_inputs,
  chunk_intra,
  from_chunks,
  heads_major,
  to_chunks,
  transposed,
)


def kda_xla_cpu(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                segment_ids=None, A_log=None, dt_bias=None,
                raw: reference.RawInputs = reference.PREPARED):
  """KDA with the XLA:CPU chunked backend; see the module docstring."""
  q, k, g, beta = reference.prepare_inputs(q, k, g, beta, A_log=A_log, dt_bias=dt_bias, raw=raw)
  B, _, H, K = q.shape
  scale = K**-0.5 if scale is None else float(scale)
  dt = (reference.compute_dtype(q, k, v, g, beta) if initial_state is None
        else initial_state.dtype)
  s0 = reference.start_state(initial_state, (B, H, K, v.shape[-1]), dt, q, k, v, g, beta)
  o, s_final = _chunked(q, k, v, g, beta, s0, segment_ids, scale)
  return o, (s_final if output_final_state else None)


def _chunked(q, k, v, g, beta, s0, segment_ids, scale):
  """Pads T to a chunk multiple here, outside the jitted core, so that eager calls with the
  same chunk count (T = 1..64, 65..128, ...) share one compilation. Padded tokens have k = v =
  g = beta = 0: they neither read nor change the state."""
  T = q.shape[1]
  pad = -T % CHUNK
  if pad:
    q, k, v, g, beta = (jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
                        for x in (q, k, v, g, beta))
    if segment_ids is not None:  # the padding continues the last sequence
      segment_ids = jnp.pad(segment_ids, ((0, 0), (0, pad)), mode="edge")
  o, s_final = _chunked_core(q, k, v, g, beta, s0, segment_ids, scale)
  return o[:, :T], s_final


def _chunk_scan(q, k, v, g, beta, s0, segment_ids, scale, *, keep_states):
  """Forward scan. Returns (o, s_final, the state entering every chunk or None)."""
  T = q.shape[1]
  dt, xs, segs = chunk_inputs(q, k, v, g, beta, segment_ids)

  def body(s_bhkv, chunk):
    (q_c, k_c, v_c, g_c, beta_c), seg = chunk
    intra = chunk_intra(*map(heads_major, (q_c, k_c, v_c, g_c, beta_c)), seg, scale)
    o, _, s_next = chunk_apply(intra, s_bhkv)
    return s_next, (heads_major(o), s_bhkv if keep_states else None)

  s_final, (o, s_in) = jax.lax.scan(body, s0.astype(dt), (xs, segs))
  o = from_chunks(o, T).astype(v.dtype)
  return o, s_final, s_in


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _chunked_vjp(q, k, v, g, beta, s0, segment_ids, scale):
  o, s_final, _ = _chunk_scan(q, k, v, g, beta, s0, segment_ids, scale, keep_states=False)
  return o, s_final


def _chunked_fwd(q, k, v, g, beta, s0, segment_ids, scale):
  o, s_final, s_in = _chunk_scan(q, k, v, g, beta, s0, segment_ids, scale, keep_states=True)
  return (o, s_final), ((q, k, v, g, beta, s0), segment_ids, s_in)


def _chunked_bwd(scale, residuals, cotangents):
  """Reverse scan over chunks carrying dS (the gradient w.r.t. the state leaving the chunk).

  Per chunk, with S the entering state (saved by the forward) and the intra-chunk quantities
  recomputed under jax.vjp:
      V' = U - W S;  O = Qg S + Aqk V';  S' = decay * S + Kd^T V'
  so  dV' = Aqk^T dO + Kd dS',   dS = decay * dS' + Qg^T dO - W^T dV',
      dQg = dO S^T,  dAqk = dO V'^T,  dU = dV',  dW = -dV' S^T,  dKd = V' dS'^T,
      ddecay = sum_v dS' * S,
  and the intra-chunk VJP turns (dW, dU, dQg, dKd, ddecay, dAqk) into dq, dk, dv, dg, dbeta.
  """
  inputs, segment_ids, s_in = residuals
  do, ds_final = cotangents
  dt, xs, segs = chunk_inputs(*inputs[:5], segment_ids)
  do = to_chunks(do.astype(dt), s_in.shape[0])

  def body(ds, chunk):
    (x_c, seg, s, do_c) = chunk
    x_c = tuple(map(heads_major, x_c))
    do_c = heads_major(do_c)
    intra, intra_vjp = jax.vjp(lambda *a: chunk_intra(*a, seg, scale), *x_c)
    C = intra.w.shape[-2]
    dot = functools.partial(jnp.einsum, precision=jax.lax.Precision.HIGHEST)
    vp = intra.u - dot("bhck,bhkv->bhcv", intra.w, s)
    # Stacked operands, as in chunk_apply: dV' = [Aqk^T | Kd] [dO; dS'].
    a_t = jnp.concatenate([jnp.swapaxes(intra.aqk, -1, -2), intra.kd], -1)
    dvp = dot("bhij,bhjv->bhiv", a_t, jnp.concatenate([do_c, ds], -2))
    y = jnp.concatenate([do_c, -dvp], -2)                       # [dO; -dV']
    dqw = dot("bhcv,bhkv->bhck", y, s)                          # [dQg; dW] = y S^T
    qw_t = transposed(jnp.concatenate([intra.qg, intra.w], -2))  # [K, 2C]
    ds_prev = intra.decay[..., None] * ds + dot("bhkc,bhcv->bhkv", qw_t, y)
    d_intra = Intra(
        w=dqw[..., C:, :], u=dvp, qg=dqw[..., :C, :],
        kd=dot("bhcv,bhkv->bhck", vp, ds),
        decay=jnp.sum(ds * s, axis=-1),
        aqk=dot("bhiv,bhjv->bhij", do_c, vp))
    return ds_prev, tuple(map(heads_major, intra_vjp(d_intra)))

  ds0, grads = jax.lax.scan(body, ds_final.astype(dt), (xs, segs, s_in, do), reverse=True)
  T = inputs[0].shape[1]
  grads = tuple(from_chunks(d, T).astype(x.dtype) for d, x in zip(grads, inputs))
  return grads + (ds0.astype(inputs[5].dtype), None)


_chunked_vjp.defvjp(_chunked_fwd, _chunked_bwd)
_chunked_core = jax.jit(_chunked_vjp, static_argnums=(7,))
