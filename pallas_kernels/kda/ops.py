"""The public KDA op (SPEC §2.4, §4): input preparation, backend dispatch, and the chunked
backend's custom backward.

    o, s = kda(q, k, v, g, beta, scale=..., initial_state=..., output_final_state=...,
               segment_ids=..., backend=None | "naive" | "chunked" | "pallas_tpu" | "pallas_gpu")

Layouts: q, k [B,T,H,K]; v [B,T,H,V]; g [B,T,H,K]; beta [B,T,H]; state [B,H,K,V] float32.
Optional raw-input preparation, in float32 (float64 for float64 inputs), differentiable; the
Pallas backends fuse it into their kernels (except the softplus gate), the others apply it here
in jnp (`prepare_inputs`, also the reference for the kernels' in-kernel version):
  use_qk_l2norm     q, k := x * rsqrt(sum_k x^2 + l2norm_eps)
  use_beta_sigmoid  beta := sigmoid(beta)
  gate="lower_bound"  g := lower_bound * sigmoid(exp(A_log[h]) * (g + dt_bias[h]))   (K3)
  gate="softplus"     g := -exp(A_log[h]) * softplus(g + dt_bias[h])                (Kimi-Linear)

Why the chunked backend has its own backward: autodiff of a scan stores every intermediate of
every step (the per-token recurrence's backward runs ~500x slower than its forward on a CPU).
The custom VJP keeps only the state entering each chunk and recomputes each chunk's intra-chunk
work inside one reverse scan that carries dS; only that recomputed intra-chunk part (no
sequential dependence, a few batched matmuls) goes through jax.vjp.
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp

from pallas_kernels.kda import _layout, reference
from pallas_kernels.kda.reference import (CHUNK, Intra, chunk_apply, chunk_inputs, chunk_intra,
                                          from_chunks, heads_major, naive_kda, to_chunks,
                                          transposed)

BACKENDS = ("naive", "chunked", "pallas_tpu", "pallas_gpu")
GATES = _layout.GATES


def default_backend() -> str:
  """The fastest backend for the default JAX platform."""
  return {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}.get(jax.default_backend(), "chunked")


def _pallas(backend: str, op: str):
  """The Pallas kernel `<op>_tpu` / `<op>_gpu` for `backend`, or None if its module cannot be
  imported here."""
  kind = backend.removeprefix("pallas_")
  try:
    module = importlib.import_module(f"pallas_kernels.kda.{kind}")
  except ImportError:
    return None
  return getattr(module, f"{op}_{kind}")


def _resolve(backend: str | None, op: str):
  """(backend name, its Pallas kernel or None for the jnp backends)."""
  if backend is None:
    backend = default_backend()
    if backend.startswith("pallas") and _pallas(backend, op) is None:
      backend = "chunked"
  if backend not in BACKENDS:
    raise ValueError(f"unknown KDA backend {backend!r}; expected one of {BACKENDS}")
  if not backend.startswith("pallas"):
    return backend, None
  impl = _pallas(backend, op)
  if impl is None:
    raise ImportError(f"KDA backend {backend!r} is not available in this installation")
  return backend, impl


def kda_step(q, k, v, g, beta, state, *, scale=None, backend=None, interpret=False):
  """One decode token: q, k, g [B,H,K] (prepared: unit q/k, log decay g); v [B,H,V]; beta
  [B,H]; state [B,H,K,V] -> (o [B,H,V] in v's dtype, new state float32).

  The Pallas backends run one fused kernel that updates the state in place (aliased), so a
  decode step reads and writes the state once; "naive" and "chunked" (no chunk to form for
  one token) both use the jnp step.
  """
  _, impl = _resolve(backend, "kda_step")
  if impl is None:
    return reference.kda_step(q, k, v, g, beta, state, scale=scale)
  return impl(q, k, v, g, beta, state, scale=scale, interpret=interpret)


def prepare_inputs(q, k, g, beta, *, A_log=None, dt_bias=None, gate=None, lower_bound=None,
                   use_qk_l2norm=False, l2norm_eps=1e-6, use_beta_sigmoid=False):
  """Raw inputs -> core inputs (g = log decay, beta in (0, 1), q/k unit-norm if asked).

  Everything runs in float32 (float64 when an input is float64); untouched inputs keep their
  dtype. Plain jnp, so JAX differentiates it, including into A_log and dt_bias.
  """
  _layout.check_gate(g, A_log, dt_bias, gate, lower_bound)
  wide = lambda *xs: jnp.result_type(jnp.float32, *(x.dtype for x in xs if x is not None))
  if use_qk_l2norm:
    def l2norm(x):
      x = x.astype(wide(x))
      return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + l2norm_eps)
    q, k = l2norm(q), l2norm(k)
  if use_beta_sigmoid:
    beta = jax.nn.sigmoid(beta.astype(wide(beta)))
  if gate is not None:
    H, K = g.shape[-2:]
    dt = wide(g, A_log, dt_bias)
    a_h1 = jnp.exp(A_log.astype(dt).reshape(H, 1))
    x = g.astype(dt)
    if dt_bias is not None:
      x = x + dt_bias.astype(dt).reshape(H, K)
    if gate == "lower_bound":
      g = lower_bound * jax.nn.sigmoid(a_h1 * x)
    else:
      g = -a_h1 * jax.nn.softplus(x)
  return q, k, g, beta


def kda(
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
    backend: str | None = None,
    interpret: bool = False,
    A_log: jax.Array | None = None,
    dt_bias: jax.Array | None = None,
    gate: str | None = None,
    lower_bound: float | None = None,
    use_qk_l2norm: bool = False,
    l2norm_eps: float = 1e-6,
    use_beta_sigmoid: bool = False,
) -> tuple[jax.Array, jax.Array | None]:
  """Kimi Delta Attention. Returns (o [B,T,H,V] in v's dtype, final state [B,H,K,V] or None).

  backend=None picks "pallas_tpu" on TPU, "pallas_gpu" on GPU and "chunked" elsewhere, falling
  back to "chunked" when the Pallas module cannot be imported. `interpret` is passed to the
  Pallas kernels (to run them on a CPU).
  """
  backend, impl = _resolve(backend, "kda")
  prepare = dict(A_log=A_log, dt_bias=dt_bias, gate=gate, lower_bound=lower_bound,
                 use_qk_l2norm=use_qk_l2norm, l2norm_eps=l2norm_eps,
                 use_beta_sigmoid=use_beta_sigmoid)
  if impl is not None:
    # K3's gate, beta sigmoid and q/k l2norm go to the kernel raw: the TPU kernels prepare
    # them in-kernel, the GPU wrapper with prepare_inputs (see gpu.py). The softplus gate
    # (Kimi-Linear) is prepared here. Checked here because the backends read "gate" off A_log.
    if gate == "softplus":
      q, k, g, beta = prepare_inputs(q, k, g, beta, **prepare)
      A_log = dt_bias = gate = None
      use_qk_l2norm = use_beta_sigmoid = False
    _layout.check_gate(g, A_log, dt_bias, gate, lower_bound)
    return impl(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, segment_ids=segment_ids,
                interpret=interpret, A_log=A_log if gate else None,
                dt_bias=dt_bias if gate else None, lower_bound=lower_bound,
                use_qk_l2norm=use_qk_l2norm, l2norm_eps=l2norm_eps,
                beta_is_logits=use_beta_sigmoid)
  q, k, g, beta = prepare_inputs(q, k, g, beta, **prepare)
  scale = q.shape[-1] ** -0.5 if scale is None else float(scale)

  if backend == "naive":
    return naive_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                     output_final_state=output_final_state, segment_ids=segment_ids)
  B, _, H, K = q.shape  # "chunked"
  s0 = initial_state
  if s0 is None:
    s0 = jnp.zeros((B, H, K, v.shape[-1]), reference.compute_dtype(q, k, v, g, beta))
  o, s_final = _chunked(q, k, v, g, beta, s0, segment_ids, scale)
  return o, (s_final if output_final_state else None)


# ----------------------------------------------------------------------------------------------
# Chunked backend: forward = reference.chunk_kda's scan; backward = one reverse scan over chunks.
# ----------------------------------------------------------------------------------------------


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
