"""Flash attention over compressed latents (latent.py) equals the dense masked softmax attention
over keys and values expanded from the latents (written out here), in float64: outputs, the
row max QK-clip reads, and the gradients of every input (queries, latents, k_rot and both
expansion weights), for queries at an offset into the keys (a device's positions of a split
sequence), packed segments starting mid-block and padding, block sizes that divide Tq and Tk
or not; for queries given as two ranges of positions (context parallelism's balanced split),
each visiting only the key blocks its causal mask reaches (a loop sized exactly to them, or
longer by masked steps) or every key block; each case also through the returned log-sum-exp
and the backward from a kept (o, row max, lse) (remat's saved attention)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.flash_attention import latent_attention

# float64; every value is a softmax-weighted sum of O(1) terms over <= 96 keys
TOL = 1e-12
B, TK, H, N, R, C, DV = 2, 96, 3, 8, 4, 16, 8


def dense(q_nope, q_rot, c, k_rot, w_k, w_v, seg_q, seg_k, q_start, *, scale):
  s = masked_scores(q_nope, q_rot, c, k_rot, w_k, seg_q, seg_k, q_start, scale=scale)
  v = jnp.einsum("bkc,chv->bkhv", c, w_v)
  return jnp.einsum("bhqk,bkhv->bqhv", jax.nn.softmax(s, -1), v), jnp.max(s, -1)


def masked_scores(q_nope, q_rot, c, k_rot, w_k, seg_q, seg_k, q_start, *, scale):
  k_nope = jnp.einsum("bkc,chn->bkhn", c, w_k)
  s = (jnp.einsum("bqhn,bkhn->bhqk", q_nope, k_nope)
       + jnp.einsum("bqhr,bkr->bhqk", q_rot, k_rot)) * scale
  starts = np.atleast_1d(q_start)
  span = q_nope.shape[1] // len(starts)
  q_pos = jnp.asarray((starts[:, None] + np.arange(span)).reshape(-1))
  k_pos = jnp.arange(c.shape[1])
  visible = (q_pos[:, None] >= k_pos[None, :])[None, None] & (
      seg_q[:, None, :, None] == seg_k[:, None, None, :])
  return jnp.where(visible, s, -jnp.inf)


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
  check(q_start, tq, block=block)


# two 8-query ranges at 16 and 72: causal key blocks of 8 are 3 + 10 = 13 visits
@pytest.mark.parametrize("visits", [13, 16, None])
def test_latent_attention_two_ranges_equals_dense(x64, visits):
  check(np.asarray([16, 72]), 16, block=8, visits=visits)


def check(q_start, tq, **kw):
  c, k_rot, w_k, w_v, seg, ks = inputs()
  starts = np.atleast_1d(q_start)
  span = tq // len(starts)
  q_nope = jax.random.normal(ks[0], (B, tq, H, N), jnp.float64)
  q_rot = jax.random.normal(ks[1], (B, tq, H, R), jnp.float64)
  seg_q = jnp.concatenate([seg[:, s:s + span] for s in starts], axis=1)
  w = jax.random.normal(ks[2], (B, tq, H, DV), jnp.float64)  # upstream gradient
  args = (q_nope, q_rot, c, k_rot, w_k, w_v)

  def run(fn, **kw):
    def loss(*a):
      o, m = fn(*a, seg_q, seg, q_start, scale=0.3, **kw)
      return jnp.sum(w * o), (o, m)
    return jax.jit(jax.grad(loss, argnums=tuple(range(6)), has_aux=True))(*args)

  grads_ref, (o_ref, m_ref) = run(dense)
  # the plain call, and the backward from a kept (o, row max, lse) with no forward loop
  kept = jax.jit(lambda *a: latent_attention(*a, seg_q, seg, q_start, scale=0.3,
                                             with_lse=True, **kw))(*args)
  lse_ref = jax.nn.logsumexp(masked_scores(q_nope, q_rot, c, k_rot, w_k, seg_q, seg, q_start,
                                           scale=0.3), -1)
  np.testing.assert_allclose(kept[2], lse_ref, rtol=0, atol=TOL)
  for kw_run in (kw, dict(kw, saved=kept)):
    grads, (o, m) = run(latent_attention, **kw_run)
    np.testing.assert_allclose(o, o_ref, rtol=0, atol=TOL)
    np.testing.assert_allclose(m, m_ref, rtol=0, atol=TOL)
    for name, a, r in zip(("dq_nope", "dq_rot", "dc", "dk_rot", "dw_k", "dw_v"), grads,
                          grads_ref):
      assert float(jnp.max(jnp.abs(r))) > 1e-2, name
      np.testing.assert_allclose(a, r, rtol=0,
                                 atol=TOL * max(1.0, float(jnp.max(jnp.abs(r)))), err_msg=name)


def test_ranges_of_partial_blocks_are_refused(x64):
  c, k_rot, w_k, w_v, seg, _ = inputs()
  q = jnp.zeros((B, 16, H, N)), jnp.zeros((B, 16, H, R))
  with pytest.raises(ValueError, match="16 queries in 2 ranges need ranges of a whole number "
                                       "of 5-query blocks"):
    latent_attention(*q, c, k_rot, w_k, w_v, seg[:, :16], seg, np.asarray([0, 40]),
                     scale=0.3, block=5)
