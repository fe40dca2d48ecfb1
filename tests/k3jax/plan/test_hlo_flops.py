"""k3jax/plan/hlo.matmul_flops: the matmul FLOPs of a compiled program with loops counted by
their trip counts (XLA's cost_analysis counts a loop body once), on XLA:CPU and, compiled
ahead of time with libtpu, on TPU; and the grouped matmul's row alignment that keeps TPU's
ragged_dot off its dense fallback, measured with it; flash attention's, exactly its causal
blocks'."""

import os

import jax
import jax.numpy as jnp
import pytest

from k3jax.plan import hlo
from k3jax.plan.hlo import matmul_flops
from pallas_kernels.flash_attention import flash_attention
from pallas_kernels.grouped_matmul import ROWS, grouped_matmul

M, D, STEPS = 512, 256, 10
ONE = 2 * M * D * D  # one [M, D] @ [D, D]


def _scan(n):
  def f(x, w):
    return jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), x, None, length=n)[0]
  return f


def _xla_flops(compiled) -> float:
  cost = compiled.cost_analysis()
  return (cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"]


def _tpu_device():
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  pytest.importorskip("libtpu", reason="libtpu compiles for TPU ahead of time")
  from k3jax import plan
  return jax.sharding.SingleDeviceSharding(plan.topology_devices("v5e:2x2")[0])


def test_loops_count_by_trip_count_on_cpu():
  x, w = jnp.ones((M, D)), jnp.ones((D, D))
  one = jax.jit(_scan(1)).lower(x, w).compile()
  ten = jax.jit(_scan(STEPS)).lower(x, w).compile()
  assert matmul_flops(one.as_text()) == ONE
  assert matmul_flops(ten.as_text()) == STEPS * ONE
  assert _xla_flops(ten) < 1.01 * _xla_flops(one)  # why the count exists: the body once
  by = {}
  assert matmul_flops(ten.as_text(), by) == sum(by.values()) == STEPS * ONE
  assert all("dot_general" in k for k in by)


def test_loops_count_by_trip_count_on_tpu():
  sh = _tpu_device()
  sx = jax.ShapeDtypeStruct((M, D), jnp.float32, sharding=sh)
  sw = jax.ShapeDtypeStruct((D, D), jnp.float32, sharding=sh)
  for n in (1, STEPS):  # TPU writes the matmul as a convolution, the loop bound in its cond
    compiled = jax.jit(_scan(n)).trace(sx, sw).lower(lowering_platforms=("tpu",)).compile()
    assert matmul_flops(compiled.as_text()) == n * ONE
    assert _xla_flops(compiled) < 1.01 * ONE


@pytest.mark.parametrize("rows", [4100, 4096])
def test_grouped_matmul_keeps_tpu_ragged_dot_off_its_dense_fallback(rows):
  """XLA:TPU's ragged_dot takes row counts that are multiples of 8; at 4100 rows the raw op
  multiplies every row by all 8 experts (8x the FLOPs), grouped_matmul pads to a multiple of
  ROWS and does one expert's work per row."""
  sh = _tpu_device()
  e, k, f = 8, 1024, 512
  x = jax.ShapeDtypeStruct((rows, k), jnp.bfloat16, sharding=sh)
  w = jax.ShapeDtypeStruct((e, k, f), jnp.bfloat16, sharding=sh)
  gs = jax.ShapeDtypeStruct((e,), jnp.int32, sharding=sh)
  need = 2 * rows * k * f
  padded = 2 * (-(-rows // ROWS) * ROWS) * k * f

  def compiled_flops(fn):
    return matmul_flops(jax.jit(fn).trace(x, w, gs).lower(lowering_platforms=("tpu",))
                        .compile().as_text())

  ours = compiled_flops(lambda x, w, g: grouped_matmul(x, w, g, impl="ragged_dot"))
  assert ours == padded and ours < 1.01 * need
  raw = compiled_flops(jax.lax.ragged_dot)
  assert raw == (need if rows % 8 == 0 else e * need)


def test_megablox_compiles_for_tpu_and_counts_at_its_buffer_size():
  """grouped_matmul's "megablox" impl compiled ahead of time for TPU (forward and both
  gradients): three Pallas kernels (gmm, the input gradient's gmm, the weight gradient's
  tgmm), each counted by its static cost estimate at the whole buffer, 2 m k f, and each
  under grouped_matmul's scope, where `k3jax plan` finds them to count the rows they skip."""
  sh = _tpu_device()
  e, m, k, f = 8, 4096, 1024, 384
  x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16, sharding=sh)
  w = jax.ShapeDtypeStruct((e, k, f), jnp.bfloat16, sharding=sh)
  gs = jax.ShapeDtypeStruct((e,), jnp.int32, sharding=sh)

  def loss(x, w, g):
    return jnp.sum(grouped_matmul(x, w, g, impl="megablox").astype(jnp.float32) ** 2)

  text = jax.jit(jax.grad(loss, (0, 1))).trace(x, w, gs).lower(
      lowering_platforms=("tpu",)).compile().as_text()
  assert text.count('custom_call_target="tpu_custom_call"') == 3
  by = {}
  assert matmul_flops(text, by) == 3 * 2 * m * k * f
  assert len(by) == 3 and all(hlo.is_grouped_matmul(op) for op in by)
  assert {op.split("/")[-2] for op in by} == {"jit(gmm)", "jit(tgmm)"}


def test_base_dilated_window_counts_real_taps_only():
  """XLA:TPU (tpu7x) writes AttnRes's batched contraction over 8192 positions as a
  base-dilated convolution: window 8192, stride 8191, lhs_dilate 8192. Each output position
  meets one real input element; the other 8191 taps fall in dilation holes and are not work
  (counting them made the full K3 step 8.2x its model FLOPs on tpu7x instead of 1.69x)."""
  window = "size=8192 stride=8191 lhs_dilate=8192"
  assert hlo._window_taps(window, [8192], [8192]) == 8192
  # and a plain window: 3 taps over 10 inputs with padding 1 on each side
  assert hlo._window_taps("size=3 pad=1_1", [10], [10]) == 3 * 10 - 2


def test_conditional_attributes_its_widest_branch_once():
  """A loop over a lax.cond whose branches multiply once and twice: the total counts the wider
  branch per trip, and `by_op` sums to the same total (sizing the branches records nothing)."""
  def f(x, w):
    def body(c, i):
      return jax.lax.cond(i % 2 == 0, lambda c: jnp.tanh(c @ w),
                          lambda c: jnp.tanh((c @ w) @ w), c), None
    return jax.lax.scan(body, x, jnp.arange(STEPS))[0]
  text = jax.jit(f).lower(jnp.ones((M, D)), jnp.ones((D, D))).compile().as_text()
  by_op: dict = {}
  assert matmul_flops(text, by_op) == STEPS * 2 * ONE
  assert sum(by_op.values()) == STEPS * 2 * ONE, by_op


@pytest.mark.parametrize("t", [32, 28, 30])  # block 4: n = 8, 7, 8 (padded) blocks
def test_flash_flops_are_the_causal_blocks(t):
  b, h, dk, dv, block = 1, 2, 8, 4, 4
  n = -(-t // block)
  pairs = n * (n + 1) // 2
  qk, pv = 2 * block * block * h * dk, 2 * block * block * h * dv  # one block pair's S, P V
  ks = jax.random.split(jax.random.key(0), 4)
  q, k = (jax.random.normal(kk, (b, t, h, dk)) for kk in ks[:2])
  v, w = (jax.random.normal(kk, (b, t, h, dv)) for kk in ks[2:])

  def attend(q, k, v):
    return flash_attention(q, k, v, scale=dk**-0.5, block=block)

  loss = lambda q, k, v, w: jnp.sum(w * attend(q, k, v)[0])
  forward = jax.jit(attend).lower(q, k, v).compile().as_text()
  both = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(q, k, v, w).compile().as_text()
  assert matmul_flops(forward) == pairs * (qk + pv)
  # backward per block pair: S recomputed (qk), dV = P^T dO (pv), dP = dO V^T (pv), dK = dS^T Q
  # (qk), dQ = dS K (qk). D = rowsum(dO * O) is a product and a sum, no matmul.
  assert matmul_flops(both) == pairs * (qk + pv) + pairs * (3 * qk + 2 * pv)
  assert " conditional(" not in forward and " conditional(" not in both  # no branch per step
