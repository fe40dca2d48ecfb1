"""Flash attention over compressed latents (latent.py) equals the dense masked softmax attention
over keys and values expanded from the latents (written out here), in float64: outputs, the
row max QK-clip reads, and the gradients of every input (queries, latents, k_rot and both
expansion weights), for queries at an offset into the keys (a device's positions of a split
sequence), packed segments starting mid-block and padding, block sizes that divide Tq and Tk
or not."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.flash_attention import latent_attention

# float64; every value is a softmax-weighted sum of O(1) terms over <= 96 keys
TOL = 1e-12
B, TK, H, N, R, C, DV = 2, 96, 3, 8, 4, 16, 8


def dense(q_nope, q_rot, c, k_rot, w_k, w_v, seg_q, seg_k, q_start, *, scale):
  k_nope = jnp.einsum("bkc,chn->bkhn", c, w_k)
  v = jnp.einsum("bkc,chv->bkhv", c, w_v)
  s = (jnp.einsum("bqhn,bkhn->bhqk", q_nope, k_nope)
       + jnp.einsum("bqhr,bkr->bhqk", q_rot, k_rot)) * scale
  q_pos = q_start + jnp.arange(q_nope.shape[1])
  k_pos = jnp.arange(c.shape[1])
  visible = (q_pos[:, None] >= k_pos[None, :])[None, None] & (
      seg_q[:, None, :, None] == seg_k[:, None, None, :])
  s = jnp.where(visible, s, -jnp.inf)
  return jnp.einsum("bhqk,bkhv->bqhv", jax.nn.softmax(s, -1), v), jnp.max(s, -1)


def inputs():
  ks = jax.random.split(jax.random.key(0), 7)
  normal = lambda k, shape, s=1.0: s * jax.random.normal(k, shape, jnp.float64)
  c, k_rot = normal(ks[0], (B, TK, C)), normal(ks[1], (B, TK, R))
  w_k, w_v = normal(ks[2], (C, H, N), 0.25), normal(ks[3], (C, H, DV), 0.25)
  seg = np.ones((B, TK), np.int32)
  seg[0, 30:], seg[0, 50:] = 2, 3        # documents starting mid-block
  seg[1, 64:], seg[1, 90:] = 2, 0        # one on a block edge; padding at the end
  return c, k_rot, w_k, w_v, jnp.asarray(seg), ks[4:]


@pytest.mark.parametrize("q_start,tq,block", [(0, 96, 16), (40, 24, 8), (40, 24, 5),
                                              (72, 24, 512), (48, 48, 32)])
def test_latent_attention_equals_dense(x64, q_start, tq, block):
  c, k_rot, w_k, w_v, seg, ks = inputs()
  q_nope = jax.random.normal(ks[0], (B, tq, H, N), jnp.float64)
  q_rot = jax.random.normal(ks[1], (B, tq, H, R), jnp.float64)
  seg_q = seg[:, q_start:q_start + tq]
  w = jax.random.normal(ks[2], (B, tq, H, DV), jnp.float64)  # upstream gradient
  args = (q_nope, q_rot, c, k_rot, w_k, w_v)

  def run(fn, **kw):
    def loss(*a):
      o, m = fn(*a, seg_q, seg, q_start, scale=0.3, **kw)
      return jnp.sum(w * o), (o, m)
    return jax.jit(jax.grad(loss, argnums=tuple(range(6)), has_aux=True))(*args)

  grads, (o, m) = run(latent_attention, block=block)
  grads_ref, (o_ref, m_ref) = run(dense)
  np.testing.assert_allclose(o, o_ref, rtol=0, atol=TOL)
  np.testing.assert_allclose(m, m_ref, rtol=0, atol=TOL)
  for name, a, r in zip(("dq_nope", "dq_rot", "dc", "dk_rot", "dw_k", "dw_v"), grads, grads_ref):
    assert float(jnp.max(jnp.abs(r))) > 1e-2, name
    np.testing.assert_allclose(a, r, rtol=0, atol=TOL * max(1.0, float(jnp.max(jnp.abs(r)))),
                               err_msg=name)
