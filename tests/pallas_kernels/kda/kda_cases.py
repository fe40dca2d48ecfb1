"""Shared cases for the KDA kernel tests: inputs, the float64 truth, and the checks.

Every kernel runs in float32 (or on bf16 q, k, v) and is compared with `reference.naive_kda`
(the token-by-token recurrence) run in float64 on the very same input values (tests/numerics.py):
outputs, final state, and gradients of a random linear functional of both with respect to q,
k, v, g, beta and the initial state.

Tolerances (derived in tests/numerics.py): SPEC §8's 1e-5 absolute for every float32 result;
bf16 results (o, dq, dk, dv of bf16 inputs) add one rounding to bf16, 2^-8 of the value; the
gate's parameter gradients (dA_log, d dt_bias), sums over batch, time (and features) of
per-token terms, get `sum_tolerance` of those terms.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.kda.reference import naive_kda
from tests import numerics


def make_inputs(B, T, H, K, V, *, seed=0, gate="mild", dtype=jnp.float32):
  ks = jax.random.split(jax.random.key(seed), 8)
  unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # l2-normed q, k as in K3
  q = unit(jax.random.normal(ks[0], (B, T, H, K)))
  k = unit(jax.random.normal(ks[1], (B, T, H, K)))
  v = jax.random.normal(ks[2], (B, T, H, V))
  x = jax.random.normal(ks[3], (B, T, H, K))
  # "strong": the K3 gate with lower bound -5 (a chunk's decay reaches e^-160 and beyond);
  # "mild": slow decay so the state and the initial state matter across many chunks.
  g = -5.0 * jax.nn.sigmoid(x) if gate == "strong" else -0.1 * jax.nn.sigmoid(x)
  beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H)))
  h0 = 0.5 * jax.random.normal(ks[5], (B, H, K, V))
  q, k, v = (a.astype(dtype) for a in (q, k, v))
  return q, k, v, g, beta, h0


def two_segments(B, T):
  """Row 0: a new segment starts mid-sequence; row 1: one starts on a chunk boundary (64)."""
  t = np.arange(T)
  ids = np.stack([(t >= T // 2), (t >= 64)] + [np.zeros(T, bool)] * (B - 2)).astype(np.int32)
  return jnp.asarray(ids[:B])


def cotangents(o_shape, state_shape, o_dtype, seed=1):
  """Weights (wo, wh) of the linear functional sum(o wo) + sum(ht wh). wo is rounded to o's
  dtype, as the kernel's backward receives it (do = the cotangent of o, in o's dtype)."""
  wo = jax.random.normal(jax.random.key(seed), o_shape).astype(o_dtype).astype(jnp.float32)
  return wo, jax.random.normal(jax.random.key(seed + 1), state_shape)


def run_with_grads(fn, args, segment_ids, cot, argnums=(0, 1, 2, 3, 4, 5), **kw):
  """o, final state, and grads of sum(o wo) + sum(ht wh) w.r.t. args[argnums]; the initial
  state is args[-1]."""
  wo, wh = cot

  def loss(*a):
    o, ht = fn(*a[:-1], initial_state=a[-1], output_final_state=True,
               segment_ids=segment_ids, **kw)
    return jnp.sum(o.astype(wo.dtype) * wo) + jnp.sum(ht * wh), (o, ht)

  grads, (o, ht) = jax.grad(loss, argnums=argnums, has_aux=True)(*args)
  return o, ht, grads


def truth_with_grads(fn, args, segment_ids, cot, argnums=(0, 1, 2, 3, 4, 5), **kw):
  """`run_with_grads` in float64 on the same values: the truth every float32 run is judged by."""
  return numerics.float64_truth(
      lambda a, c: run_with_grads(fn, a, segment_ids, c, argnums, **kw), args, cot)


def assert_close(name, got, want):
  """SPEC §8 for `got`'s dtype against the float64 truth `want`."""
  numerics.assert_close(name, got, want, numerics.tolerance_for(got.dtype, want))


def check_against_naive(kernel, B, T, H, K, V, *, gate="mild", dtype=jnp.float32, segments=True,
                        seed=0):
  args = make_inputs(B, T, H, K, V, gate=gate, dtype=dtype, seed=seed)
  seg = two_segments(B, T) if segments else None
  cot = cotangents((B, T, H, V), (B, H, K, V), dtype)
  o, ht, grads = run_with_grads(kernel, args, seg, cot)
  o_ref, ht_ref, grads_ref = truth_with_grads(naive_kda, args, seg, cot)
  assert o.dtype == args[2].dtype and ht.dtype == jnp.float32
  assert_close("o", o, o_ref)
  assert_close("final_state", ht, ht_ref)
  for n, a, b, x in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads, grads_ref, args):
    assert a.dtype == x.dtype, (n, a.dtype, x.dtype)
    assert_close(n, a, b)
  # The truth itself is not trivial here: the outputs and every gradient are nonzero.
  assert np.abs(o_ref).max() > 1e-2
  for n, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads_ref):
    assert np.abs(b).max() > 1e-3, n


def check_decode_steps(step_fn, *, steps=5, B=2, H=3, K=32, V=64, dtype=jnp.float32):
  """`steps` fused decode steps from a random state == naive_kda over those tokens."""
  q, k, v, g, beta, h0 = make_inputs(B, steps, H, K, V, gate="strong", dtype=dtype, seed=13)
  o_ref, ht_ref = numerics.float64_truth(
      lambda *a: naive_kda(*a[:5], initial_state=a[5], output_final_state=True),
      q, k, v, g, beta, h0)
  s = h0
  for t in range(steps):
    o, s = step_fn(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], s)
    assert o.dtype == v.dtype and s.dtype == jnp.float32
    assert_close(f"o[{t}]", o, o_ref[:, t])
  assert_close("state", s, ht_ref)


# --- raw inputs (SPEC §4): K3's gate, beta logits and q/k l2norm prepared inside the kernel ---

LOWER_BOUND = -5.0
RAW_NAMES = ("dq", "dk", "dv", "dg_raw", "dbeta_logits", "dA_log", "ddt_bias", "dh0")


def make_raw_inputs(B, T, H, K, V, *, seed=0, dtype=jnp.float32):
  """Un-normalised q/k, the gate pre-activation x, beta logits, A_log [H], dt_bias [H,K], h0.
  x + dt_bias around -4 with exp(A_log) in [1, e]: decays from mild to the lower bound."""
  ks = jax.random.split(jax.random.key(seed), 8)
  q = 2.0 * jax.random.normal(ks[0], (B, T, H, K))
  k = 0.5 * jax.random.normal(ks[1], (B, T, H, K))
  v = jax.random.normal(ks[2], (B, T, H, V))
  x = jax.random.normal(ks[3], (B, T, H, K)) - 4.0
  logits = jax.random.normal(ks[4], (B, T, H))
  A_log = jax.random.uniform(ks[5], (H,))
  dt_bias = 0.5 * jax.random.normal(ks[6], (H, K))
  h0 = 0.5 * jax.random.normal(ks[7], (B, H, K, V))
  q, k, v = (a.astype(dtype) for a in (q, k, v))
  return q, k, v, x, logits, A_log, dt_bias, h0


def naive_on_prepared(q, k, v, x, logits, *, A_log, dt_bias, lower_bound, l2norm_eps,
                      **kw):
  """The reference for the fused kernels: ops.prepare_inputs, then naive_kda."""
  from pallas_kernels.kda import ops
  q, k, g, beta = ops.prepare_inputs(q, k, x, logits, A_log=A_log, dt_bias=dt_bias,
                                     gate="lower_bound", lower_bound=lower_bound,
                                     use_qk_l2norm=True, l2norm_eps=l2norm_eps,
                                     use_beta_sigmoid=True)
  return naive_kda(q, k, v, g, beta, **kw)


def via_op(backend):
  """The public op with K3's options, in check_fused_against_naive's kernel signature."""
  from pallas_kernels.kda import kda

  def fn(q, k, v, x, logits, *, lower_bound, **kw):
    return kda(q, k, v, x, logits, gate="lower_bound", lower_bound=lower_bound,
               use_qk_l2norm=True, use_beta_sigmoid=True, backend=backend,
               interpret=backend.startswith("pallas"), **kw)
  return fn


def check_fused_against_naive(kernel, B, T, H, K, V, *, l2norm_eps=1e-6, dtype=jnp.float32,
                              seed=0, reference=naive_on_prepared):
  """kernel(q, k, v, x, logits, A_log=, dt_bias=, lower_bound=, l2norm_eps=, initial_state=,
  output_final_state=, segment_ids=) on raw inputs vs `reference` (naive_kda on
  ops.prepare_inputs' output) in float64: outputs, final state, and the gradients w.r.t. every
  raw input and parameter.

  dA_log [H] and d dt_bias [H, K] are sums over batch, time (and K for A_log) of the per-token
  terms dL/dx (x + dt_bias) and dL/dx: `sum_tolerance` of the truth's terms.
  """
  args = make_raw_inputs(B, T, H, K, V, seed=seed, dtype=dtype)
  seg = two_segments(B, T)
  cot = cotangents((B, T, H, V), (B, H, K, V), dtype, seed=seed + 1)
  opts = dict(lower_bound=LOWER_BOUND, l2norm_eps=l2norm_eps)

  def raw(fn):  # the initial state last, the parameters as keywords, as run_with_grads wants
    return lambda q, k, v, x, logits, A_log, dt_bias, **kw: fn(
        q, k, v, x, logits, A_log=A_log, dt_bias=dt_bias, **opts, **kw)

  o, ht, grads = run_with_grads(raw(kernel), args, seg, cot, argnums=tuple(range(8)))
  o_ref, ht_ref, grads_ref = truth_with_grads(raw(reference), args, seg, cot,
                                              argnums=tuple(range(8)))
  assert o.dtype == args[2].dtype
  assert_close("o", o, o_ref)
  assert_close("final_state", ht, ht_ref)
  dx_ref = grads_ref[3]
  x_dt = np.asarray(args[3], np.float64) + np.asarray(args[6], np.float64)
  sums = {"dA_log": numerics.sum_tolerance(dx_ref * x_dt, (0, 1, 3)),
          "ddt_bias": numerics.sum_tolerance(dx_ref, (0, 1))}
  for n, a, b, x in zip(RAW_NAMES, grads, grads_ref, args):
    assert a.dtype == x.dtype, (n, a.dtype, x.dtype)
    if n in sums:
      numerics.assert_close(n, a, b, sums[n])
    else:
      assert_close(n, a, b)
    assert np.abs(b).max() > 1e-3, n
