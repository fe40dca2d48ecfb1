"""Flash attention equals the dense masked softmax attention (reference.attention; float64:
outputs, the row max QK-clip reads, and gradients of q, k, v), with packed segments, odd and
even numbers of blocks and a T that is not a multiple of the block; so do the log-sum-exp it
returns and the backward from a kept (o, row max, lse) (remat's saved attention). (Its
compiled matmul FLOPs are checked in tests/k3jax/plan/test_hlo_flops.py, MLA's flash path in
tests/k3jax/model/test_mla.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.flash_attention import flash_attention
from pallas_kernels.flash_attention.reference import attention

# float64; every value is a softmax-weighted sum of O(1) terms over <= T = 20 keys
TOL = 1e-12


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
  o_ref, m_ref = attention(q, k, v, seg, scale=scale)
  np.testing.assert_allclose(o, o_ref, rtol=0, atol=TOL)
  np.testing.assert_allclose(m, m_ref, rtol=0, atol=TOL)
  kept = flash_attention(q, k, v, seg, scale=scale, block=block, with_lse=True)
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
  visible = jnp.tril(jnp.ones((t, t), bool))[None, None] & (seg[:, None, :, None]
                                                            == seg[:, None, None, :])
  lse_ref = jax.nn.logsumexp(jnp.where(visible, s, -jnp.inf), -1)
  np.testing.assert_allclose(kept[2], lse_ref, rtol=0, atol=TOL)
  ref = jax.grad(lambda *a: jnp.sum(w * attention(*a, seg, scale=scale)[0]),
                 argnums=(0, 1, 2))(q, k, v)
  for kw in ({}, {"saved": kept}):
    got = jax.grad(lambda *a, kw=kw: jnp.sum(
        w * flash_attention(*a, seg, scale=scale, block=block, **kw)[0]),
                   argnums=(0, 1, 2))(q, k, v)
    for a, r in zip(got, ref):
      assert float(jnp.max(jnp.abs(r))) > 1e-2
      np.testing.assert_allclose(a, r, rtol=0, atol=TOL)
