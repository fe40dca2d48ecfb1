"""KDA test helpers, shared by every KDA test (references, xla_cpu, Pallas kernels): inputs,
the float64 truth, and the checks.

Every backend runs in float32 (or on bf16 q, k, v) and is compared with `reference.naive_kda`
(the token-by-token recurrence) run in float64 on the very same input values (tests/numerics.py):
outputs, final state, and gradients of a random linear functional of both with respect to q,
k, v, g, beta and the initial state.

Tolerances (derived in tests/numerics.py): docs/correctness.md's 1e-5 of each tensor's scale for
every float32 result; bf16 results (o, dq, dk, dv of bf16 inputs) add one rounding to bf16, 2^-8 of
the value; the gate's parameter gradients (dA_log, d dt_bias), sums over batch, time (and
features) of per-token terms, get `sum_tolerance` of those terms.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda.ops import kda, kda_step
from pallas_kernels.kda.reference import RawInputs, naive_kda
from tests import numerics
from tests.numerics import assert_close

# Log decays g of the inputs, from the gate pre-activation x ~ N(0, 1):
DECAYS = {
    "k3": lambda x: -5.0 * jax.nn.sigmoid(2.0 * x),  # K3's lower-bound gate: channels near -5
    "mild": lambda x: -0.1 * jax.nn.sigmoid(x),      # long memory: the state matters across chunks
    "strong": lambda x: -5.0 + 0.01 * x,             # every token ~e^-5: e^-320 per chunk
    "extreme": lambda x: -30.0 + x,                  # beyond what xla_cpu factors (it clamps)
}


def make_inputs(B, T, H, K, V, *, seed=0, decay="k3", dtype=jnp.float32):
  """(q, k, v, g, beta, h0): l2-normed q, k (as in the model), g from DECAYS[decay], beta in
  (0, 1), an initial state. q, k, v in `dtype`; g, beta and h0 float32, or float64 with it."""
  ks = jax.random.split(jax.random.key(seed), 8)
  unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  q = unit(jax.random.normal(ks[0], (B, T, H, K)))
  k = unit(jax.random.normal(ks[1], (B, T, H, K)))
  v = jax.random.normal(ks[2], (B, T, H, V))
  g = DECAYS[decay](jax.random.normal(ks[3], (B, T, H, K)))
  beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H)))
  h0 = 0.5 * jax.random.normal(ks[5], (B, H, K, V))
  wide = jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32
  return (*(a.astype(dtype) for a in (q, k, v)), *(a.astype(wide) for a in (g, beta, h0)))


def two_segments(B, T):
  """Row 0: a new segment starts mid-sequence; row 1: one starts on a chunk boundary (64)."""
  t = np.arange(T)
  ids = np.stack([(t >= T // 2), (t >= 64)] + [np.zeros(T, bool)] * (B - 2)).astype(np.int32)
  return jnp.asarray(ids[:B])


def cotangents(args, seed=1):
  """Weights (wo, wh) of the linear functional sum(o wo) + sum(ht wh) for inputs `args` (v is
  args[2], the initial state args[-1]). wo is rounded to o's dtype (v's), as the kernel's
  backward receives it (do = the cotangent of o, in o's dtype)."""
  v, h0 = args[2], args[-1]
  wo = jax.random.normal(jax.random.key(seed), v.shape).astype(v.dtype)
  return wo.astype(jnp.result_type(jnp.float32, h0.dtype)), jax.random.normal(
      jax.random.key(seed + 1), h0.shape, h0.dtype)


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


def check_against_naive(kernel, B, T, H, K, V, *, decay="mild", dtype=jnp.float32,
                        segments=True, seed=0):
  args = make_inputs(B, T, H, K, V, decay=decay, dtype=dtype, seed=seed)
  seg = two_segments(B, T) if segments else None
  cot = cotangents(args)
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
  q, k, v, g, beta, h0 = make_inputs(B, steps, H, K, V, decay="k3", dtype=dtype, seed=13)
  o_ref, ht_ref = numerics.float64_truth(
      lambda *a: naive_kda(*a[:5], initial_state=a[5], output_final_state=True),
      q, k, v, g, beta, h0)
  s = h0
  for t in range(steps):
    o, s = step_fn(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], s)
    assert o.dtype == v.dtype and s.dtype == jnp.float32
    assert_close(f"o[{t}]", o, o_ref[:, t])
  assert_close("state", s, ht_ref)


# --- raw inputs (docs/kernels.md): K3's gate, beta logits and q/k l2norm prepared in-kernel ---

LOWER_BOUND = -5.0
K3_RAW = RawInputs(gate="lower_bound", lower_bound=LOWER_BOUND, use_qk_l2norm=True,
                   use_beta_sigmoid=True)
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


def via_op(backend):
  """The public op with `backend`, in the kernels' signature."""
  return lambda *a, **kw: kda(*a, backend=backend, interpret=backend.startswith("pallas"), **kw)


def check_fused_against_naive(kernel, B, T, H, K, V, *, l2norm_eps=1e-6, dtype=jnp.float32,
                              seed=0, reference=naive_kda):
  """kernel(q, k, v, x, logits, A_log=, dt_bias=, raw=K3_RAW with l2norm_eps, initial_state=,
  output_final_state=, segment_ids=) on raw inputs vs `reference` with the same options in
  float64: outputs, final state, and the gradients w.r.t. every raw input and parameter.

  dA_log [H] and d dt_bias [H, K] are sums over batch, time (and K for A_log) of the per-token
  terms dL/dx (x + dt_bias) and dL/dx: `sum_tolerance` of the truth's terms.
  """
  args = make_raw_inputs(B, T, H, K, V, seed=seed, dtype=dtype)
  seg = two_segments(B, T)
  cot = cotangents(args, seed=seed + 1)

  options = dataclasses.replace(K3_RAW, l2norm_eps=l2norm_eps)

  def raw(fn):  # the initial state last, the parameters as keywords, as run_with_grads wants
    return lambda q, k, v, x, logits, A_log, dt_bias, **kw: fn(
        q, k, v, x, logits, A_log=A_log, dt_bias=dt_bias, raw=options, **kw)

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
      assert_close(n, a, b, sums[n])
    else:
      assert_close(n, a, b)
    assert np.abs(b).max() > 1e-3, n


def cuda_inputs(sharding=None, *, B=1, T=256, H=2, K=128, V=128):
  """Abstract (q, k, v, g, beta, h0) for compiling a GPU kernel: bf16 q/k/v, float32 rest."""
  sds = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
  return [sds((B, T, H, K), jnp.bfloat16), sds((B, T, H, K), jnp.bfloat16),
          sds((B, T, H, V), jnp.bfloat16), sds((B, T, H, K), jnp.float32),
          sds((B, T, H), jnp.float32), sds((B, H, K, V), jnp.float32)]


def forward_and_gradient(kernel):
  """kernel's forward (o, final state) and the gradient of a loss of both w.r.t. all six
  inputs: the two programs a GPU backend must lower."""
  def fwd(q, k, v, g, beta, h0):
    return kernel(q, k, v, g, beta, initial_state=h0, output_final_state=True)

  def loss(*a):
    o, ht = fwd(*a)
    return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(ht)

  return {"forward": fwd, "gradient": jax.grad(loss, argnums=range(6))}


def lower_for_h100(kernel):
  """{"forward"|"gradient": StableHLO text} of `kernel` lowered for an abstract H100: the
  Pallas GPU lowering runs without a GPU (compiling to a cubin needs XLA:GPU)."""
  device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=132, platform="cuda")
  mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
  with jax.sharding.use_abstract_mesh(mesh):  # Pallas reads the GPU kind here
    return {what: jax.jit(fn).trace(*cuda_inputs()).lower(lowering_platforms=("cuda",)).as_text()
            for what, fn in forward_and_gradient(kernel).items()}


class PallasChecks:
  """The checks the Pallas Mosaic TPU and Triton backends share, in interpret mode against the
  float64 recurrence. A test module subclasses it (`class TestCommon(kda_cases.PallasChecks)`)
  with its `backend` name and `kernel`, the backend function with interpret=True.

  K=32, V=64 are below the kernels' tiles (128 lanes on TPU, powers of two for Triton), so the
  wrappers' padding of K and V is exercised too.
  """
  backend: str
  kernel = None  # staticmethod(the backend function, interpret=True)

  @pytest.mark.parametrize("T", [1, 63, 64, 130])
  def test_fp32_matches_naive(self, T):
    check_against_naive(self.kernel, B=2, T=T, H=2, K=32, V=64, decay="mild")

  def test_fp32_strong_gate_matches_naive(self):
    """lb=-5 gate: 64-token cumulative decays far below e^-88 must not overflow or NaN."""
    check_against_naive(self.kernel, B=2, T=130, H=2, K=32, V=64, decay="k3", seed=3)

  def test_bf16_matches_naive_on_same_inputs(self):
    check_against_naive(self.kernel, B=2, T=130, H=1, K=128, V=128, dtype=jnp.bfloat16, seed=5)

  def test_public_op_with_the_lower_bound_gate(self):
    """ops.kda hands K3's raw inputs to the backend (prepared in-kernel on TPU, in the wrapper
    on GPU); same as "naive"."""
    check_fused_against_naive(via_op(self.backend), B=2, T=63, H=2, K=32, V=64,
                              reference=via_op("naive"))

  @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
  def test_decode_step_matches_naive(self, dtype):
    """Through the public decode op, so the dispatch to the fused kernel is covered too."""
    check_decode_steps(lambda *a: kda_step(*a, backend=self.backend, interpret=True),
                       dtype=dtype)
