"""Flash attention equals the dense masked softmax attention (float64: outputs, the row max
QK-clip reads, and gradients of q, k, v), with packed segments, odd and even numbers of blocks
and a T that is not a multiple of the block; its compiled matmul FLOPs are exactly the causal
blocks'; and MLA with attention="flash" equals MLA's dense path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import configs
from k3jax.execution import Execution
from pallas_kernels.flash_attention import flash_attention
from k3jax.model.mla import MLA, attention_mask
from k3jax.plan.hlo import matmul_flops

# float64; every value is a softmax-weighted sum of O(1) terms over <= T = 20 keys
TOL = 1e-12


def dense(q, k, v, seg, scale):
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
  s = jnp.where(attention_mask(seg, q.shape[0], q.shape[1]), s, -jnp.inf)
  o = jnp.einsum("bhqk,bkhv->bqhv", jax.nn.softmax(s, axis=-1), v)
  return o, jnp.max(s, axis=-1)


# blocks: 3 (T padded to 12), 1, 4 (two pairs), 4 (T padded to 16), 5 (two pairs and the middle)
@pytest.mark.parametrize("t,block", [(11, 4), (11, 11), (16, 4), (13, 4), (20, 4)])
def test_flash_equals_dense(x64, t, block):
  b, h, dk, dv = 2, 3, 6, 5
  ks = jax.random.split(jax.random.key(0), 4)
  q, k = (jax.random.normal(kk, (b, t, h, dk), jnp.float64) for kk in ks[:2])
  v = jax.random.normal(ks[2], (b, t, h, dv), jnp.float64)
  seg = jnp.asarray([[1] * 4 + [2] * (t - 4), [1] * (t - 2) + [0] * 2])  # packed; padding
  w = jax.random.normal(ks[3], (b, t, h, dv), jnp.float64)   # upstream gradient
  scale = dk**-0.5
  o, m = flash_attention(q, k, v, seg, scale=scale, block=block)
  o_ref, m_ref = dense(q, k, v, seg, scale)
  np.testing.assert_allclose(o, o_ref, rtol=0, atol=TOL)
  np.testing.assert_allclose(m, m_ref, rtol=0, atol=TOL)
  got = jax.grad(lambda *a: jnp.sum(w * flash_attention(*a, seg, scale=scale, block=block)[0]),
                 argnums=(0, 1, 2))(q, k, v)
  ref = jax.grad(lambda *a: jnp.sum(w * dense(*a, seg, scale)[0]), argnums=(0, 1, 2))(q, k, v)
  for a, r in zip(got, ref):
    assert float(jnp.max(jnp.abs(r))) > 1e-2
    np.testing.assert_allclose(a, r, rtol=0, atol=TOL)


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

  loss = lambda q, k, v, w: jnp.sum(w * attend(q, k, v)[0])  # noqa: E731
  forward = jax.jit(attend).lower(q, k, v).compile().as_text()
  both = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(q, k, v, w).compile().as_text()
  assert matmul_flops(forward) == pairs * (qk + pv)
  # backward per block pair: S recomputed (qk), dV = P^T dO (pv), dP = dO V^T (pv), dK = dS^T Q
  # (qk), dQ = dS K (qk). D = rowsum(dO * O) is a product and a sum, no matmul.
  assert matmul_flops(both) == pairs * (qk + pv) + pairs * (3 * qk + 2 * pv)
  assert " conditional(" not in forward and " conditional(" not in both  # no branch per step


def test_mla_flash_equals_dense(x64):
  cfg = configs.get("tiny")
  ex = Execution(dtype="float64", param_dtype="float64", matmul_precision="highest")
  mla = MLA(cfg, ex, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (2, 10, cfg.hidden_size), jnp.float64)
  seg = jnp.asarray([[1] * 6 + [2] * 4, [1] * 10])
  flash = MLA(cfg, ex.replace(attention="flash", attention_block=4), rngs=nnx.Rngs(0))
  y_ref, m_ref = mla(x, segment_ids=seg)
  y, m = flash(x, segment_ids=seg)
  np.testing.assert_allclose(y, y_ref, rtol=0, atol=TOL)
  np.testing.assert_allclose(m, m_ref, rtol=0, atol=TOL)
