"""TPU KDA kernels (Pallas Mosaic TPU) in interpret mode vs the naive recurrence in float64
(docs/kernels.md, docs/correctness.md; tolerances in tests/numerics.py).

The checks shared with the GPU (Triton) kernels are kda_cases.PallasChecks (TestCommon); K=32,
V=64 exercise the wrapper's padding of K and V to the 128 lanes the kernel tiles use.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda.reference import naive_kda
from pallas_kernels.kda.tpu import kda_tpu
from tests import numerics
from tests.pallas_kernels.kda import kda_cases

kernel = functools.partial(kda_tpu, interpret=True)


class TestCommon(kda_cases.PallasChecks):
  backend, kernel = "pallas_tpu", staticmethod(kernel)


def test_no_state_no_segments_and_custom_scale():
  q, k, v, g, beta, _ = kda_cases.make_inputs(1, 70, 2, 32, 64, seed=7, decay="mild")
  o, ht = kernel(q, k, v, g, beta, scale=0.3)
  o_ref, _ = numerics.float64_truth(lambda *a: naive_kda(*a, scale=0.3), q, k, v, g, beta)
  assert ht is None
  numerics.assert_close("o", o, o_ref)


@pytest.mark.parametrize("T, l2norm_eps", [(63, 1e-6), (130, 1e-6), (63, 0.1)])
def test_fused_raw_inputs_match_naive_on_prepared(T, l2norm_eps):
  """K3's gate (lower bound), beta sigmoid and q/k l2norm prepared in-kernel, and their chain
  rule in the backward kernel: outputs, state and gradients w.r.t. raw q, k, v, gate
  pre-activation, beta logits, A_log, dt_bias and h0. eps=0.1 checks that eps reaches the
  kernel (at 1e-6 it would move o by ~1e-3)."""
  kda_cases.check_fused_against_naive(kernel, B=2, T=T, H=2, K=32, V=64, l2norm_eps=l2norm_eps)


def test_fused_bf16_raw_inputs():
  kda_cases.check_fused_against_naive(kernel, B=2, T=70, H=2, K=32, V=64, dtype=jnp.bfloat16,
                                      seed=9)


def test_inside_shard_map_over_batch():
  """Under shard_map (check_vma on), with a zero initial state made inside the kernel wrapper
  (not varying over the mesh) mixed with varying q/k/v: the kernel's operand and output types
  must agree, and the result equals the unsharded reference."""
  from jax.sharding import PartitionSpec as P
  mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
  q, k, v, g, beta, _ = kda_cases.make_inputs(2, 64, 2, 32, 64, seed=17, decay="mild")
  spec = P("data")
  run = jax.shard_map(lambda *a: kernel(*a, output_final_state=True), mesh=mesh,
                      in_specs=(spec,) * 5, out_specs=(spec, spec))
  put = lambda x: jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))
  o, ht = jax.jit(run)(*map(put, (q, k, v, g, beta)))
  o_ref, ht_ref = numerics.float64_truth(
      lambda *a: naive_kda(*a, output_final_state=True), q, k, v, g, beta)
  numerics.assert_close("o", o, o_ref)
  numerics.assert_close("final_state", ht, ht_ref)


def test_fused_inside_shard_map_over_batch():
  """Fused raw inputs under shard_map with A_log / dt_bias replicated over the batch axis:
  their gradients are the batch-sharded kernel's per-shard sums, summed over the mesh."""
  from jax.sharding import PartitionSpec as P
  mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
  raw = kda_cases.make_raw_inputs(2, 64, 2, 32, 64, seed=19)[:7]
  put = lambda a, spec: jax.device_put(a, jax.sharding.NamedSharding(mesh, spec))
  sharded = [put(a, P("data")) for a in raw[:5]] + [put(a, P()) for a in raw[5:]]
  opts = dict(raw=kda_cases.K3_RAW, output_final_state=True)
  d = P("data")
  run = jax.shard_map(lambda *a: kernel(*a[:5], A_log=a[5], dt_bias=a[6], **opts), mesh=mesh,
                      in_specs=(d,) * 5 + (P(), P()), out_specs=(d, d))
  ref = lambda *a: naive_kda(*a[:5], A_log=a[5], dt_bias=a[6], **opts)
  wo = jax.random.normal(jax.random.key(3), raw[2].shape)

  def loss(fn, *a):
    o, ht = fn(*a)
    return jnp.sum(o * wo) + jnp.sum(ht), (o, ht)

  grad = lambda fn, argnums: jax.grad(functools.partial(loss, fn), argnums, has_aux=True)
  (dA, ddt), (o, ht) = jax.jit(grad(run, (5, 6)))(*sharded)
  (dx_ref, dA_ref, ddt_ref), (o_ref, ht_ref) = numerics.float64_truth(grad(ref, (3, 5, 6)), *raw)
  numerics.assert_close("o", o, o_ref)
  numerics.assert_close("final_state", ht, ht_ref)
  x_dt = np.asarray(raw[3], np.float64) + np.asarray(raw[6], np.float64)
  numerics.assert_close("dA_log", dA, dA_ref, numerics.sum_tolerance(dx_ref * x_dt, (0, 1, 3)))
  numerics.assert_close("ddt_bias", ddt, ddt_ref, numerics.sum_tolerance(dx_ref, (0, 1)))
