"""Flash attention over compressed latents (MLA with the sequence split: docs/kernels.md#flash-
attention-over-latents), in jnp with its own backward.

Queries q = [q_nope | q_rot] [B, Tq, H, N + R] at positions q_start + [0, Tq) of a sequence
whose keys and values at positions [0, Tk) are given as MLA's compressed latent c [B, Tk, C]
and the shared k_rot [B, Tk, R]:

    k_s = [c_s W_k | k_rot_s]  (per head)      v_s = c_s W_v
    o[q] = sum_s softmax_s(scale * q . k_s + mask[q, s]) v_s

Masks: causal by position (s <= q_start + q) and equal segment ids. Nothing of size
[Tq, Tk] nor a per-head copy of every key exists: the loops run over key blocks (outer) and
query blocks (inner); each key block is expanded to its per-head keys and values once, and
the running statistics of every query block (row max m, sum l, output acc) are carried, so a
query block's online softmax sees the key blocks in order. o = acc / l, lse = m + log l.

The backward (custom VJP, as in FlashAttention-2) keeps q, the latents, o and lse; per key
block it expands the block again and, over the query blocks, recomputes
P = exp(S - lse) and accumulates
    dV_j = sum_i P_ij^T dO_i     dS_ij = P_ij (dO_i V_j^T - D_i),  D_i = rowsum(dO_i O_i)
    dK_j = scale sum_i dS_ij^T Q_i          dQ_i += scale dS_ij K_j
then takes dK_j and dV_j back through the expansion: dc_j = dK_nope_j W_k^T + dV_j W_v^T,
dk_rot_j = sum over heads of dK_rot_j, dW_k += c_j^T dK_nope_j, dW_v += c_j^T dV_j.

The loops are static: every query block visits every key block, the masked ones included, so
the compiled program's matmul count is Tq x Tk whatever q_start (the cost of the split's
causal imbalance is then visible, not hidden in a data-dependent trip count). Scores and the
softmax statistics in fp32 (fp64 for float64 inputs). Also returns each row's largest masked
scaled score (QK-clip's max logit), not differentiated.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.flash_attention.ops import _blocks, _unblocks
from pallas_kernels.vma import vary_like


def latent_attention(q_nope, q_rot, c, k_rot, w_k, w_v, seg_q, seg_k, q_start, *,
                     scale: float, block: int = 512, precision=None):
  """(o [B, Tq, H, Dv] in q's dtype, row max [B, H, Tq] fp32/fp64): see the module docstring.
  q_nope [B,Tq,H,N], q_rot [B,Tq,H,R], c [B,Tk,C], k_rot [B,Tk,R], w_k [C,H,N], w_v [C,H,Dv],
  seg_q [B,Tq], seg_k [B,Tk] int, q_start int scalar (may be traced). Tq and Tk are padded up
  to multiples of the block (padded keys are masked, padded queries dropped)."""
  tq, tk = q_nope.shape[1], c.shape[1]
  bq, bk = min(block, tq), min(block, tk)
  pad_q, pad_k = -tq % bq, -tk % bk
  pad = lambda x, n, value=0: jnp.pad(x, ((0, 0), (0, n)) + ((0, 0),) * (x.ndim - 2),
                                      constant_values=value)
  q_nope, q_rot, seg_q = pad(q_nope, pad_q), pad(q_rot, pad_q), pad(seg_q, pad_q, -1)
  c, k_rot, seg_k = pad(c, pad_k), pad(k_rot, pad_k), pad(seg_k, pad_k, -2)
  operands = (q_nope, q_rot, c, k_rot, w_k, w_v, seg_q.astype(jnp.int32),
              seg_k.astype(jnp.int32), jnp.asarray(q_start, jnp.int32))
  # Inside shard_map: one varying type for every operand, cast out here where JAX
  # differentiates it (replicated weights then get their gradients summed over the mesh)
  operands = tuple(vary_like(x, *operands) for x in operands)
  o, row_max = _latent(*operands, scale, (bq, bk), precision)
  return o[:, :tq], row_max[:, :, :tq]


def _expand(c_j, w_k, w_v, precision):
  """A key block's per-head keys (nope part) and values from its latent."""
  return (jnp.einsum("bkc,chn->bkhn", c_j, w_k, precision=precision),
          jnp.einsum("bkc,chv->bkhv", c_j, w_v, precision=precision))


def _scores(q, k, scale, wide, precision):
  """Masked scaled scores [B, H, bq, bk] of a query block against a key block: q = (q_nope,
  q_rot, seg, first position), k = (k_nope, k_rot, seg, first position)."""
  (qn, qr, sq, q0), (kn, kr, sk, k0) = q, k
  s = (jnp.einsum("bqhn,bkhn->bhqk", qn, kn, precision=precision, preferred_element_type=wide)
       + jnp.einsum("bqhr,bkr->bhqk", qr, kr, precision=precision,
                    preferred_element_type=wide)) * scale
  qpos = q0 + jnp.arange(qn.shape[1])
  kpos = k0 + jnp.arange(kn.shape[1])
  visible = (qpos[:, None] >= kpos[None, :])[None, None] & (
      sq[:, None, :, None] == sk[:, None, None, :])
  return jnp.where(visible, s, -jnp.inf)


def _query_blocks(q_nope, q_rot, seg_q, q_start, bq):
  nq = q_nope.shape[1] // bq
  return (_blocks(q_nope, bq), _blocks(q_rot, bq), _blocks(seg_q, bq),
          q_start + bq * jnp.arange(nq, dtype=jnp.int32))


def _key_blocks(c, k_rot, seg_k, bk):
  nk = c.shape[1] // bk
  return (_blocks(c, bk), _blocks(k_rot, bk), _blocks(seg_k, bk),
          bk * jnp.arange(nk, dtype=jnp.int32))


def _forward(q_nope, q_rot, c, k_rot, w_k, w_v, seg_q, seg_k, q_start, scale, blocks,
             precision):
  """(o, lse, row max): o [B, Tq, H, Dv] in q's dtype, lse and row max [B, H, Tq] wide."""
  bq, bk = blocks
  wide = jnp.promote_types(q_nope.dtype, jnp.float32)
  qs = _query_blocks(q_nope, q_rot, seg_q, q_start, bq)
  b, h, dv = q_nope.shape[0], q_nope.shape[2], w_v.shape[-1]
  nq = qs[0].shape[0]
  # loop carries keep one type: as varying (inside a shard_map) as every operand
  operands = (q_nope, q_rot, c, k_rot, w_k, w_v, seg_q, seg_k, q_start)
  stats = tuple(vary_like(x, *operands) for x in (
      jnp.full((nq, b, h, bq), -jnp.inf, wide), jnp.zeros((nq, b, h, bq), wide),
      jnp.zeros((nq, b, h, bq, dv), wide)))

  def key_block(stats, kb):
    c_j, kr_j, sk_j, k0 = kb
    kn_j, v_j = _expand(c_j, w_k, w_v, precision)

    def query_block(_, x):
      *q, m, l, acc = x
      s = _scores(q, (kn_j, kr_j, sk_j, k0), scale, wide, precision)
      m_new = jnp.maximum(m, jnp.max(s, axis=-1))
      m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
      p = jnp.exp(s - m_safe[..., None])
      alpha = jnp.exp(m - m_safe)
      l = l * alpha + jnp.sum(p, axis=-1)
      acc = acc * alpha[..., None] + jnp.einsum("bhqk,bkhv->bhqv", p.astype(v_j.dtype), v_j,
                                                precision=precision,
                                                preferred_element_type=wide)
      return None, (m_new, l, acc)

    _, stats = jax.lax.scan(query_block, None, (*qs, *stats))
    return stats, None

  (m, l, acc), _ = jax.lax.scan(key_block, stats, _key_blocks(c, k_rot, seg_k, bk))
  seen = l > 0  # padded queries see no key
  o = acc / jnp.where(seen, l, 1.0)[..., None]                       # [nq, B, H, bq, Dv]
  lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), jnp.inf)
  rows = lambda x: jnp.moveaxis(x, 0, 2).reshape(b, h, nq * bq)
  return _unblocks(jnp.moveaxis(o, 2, 3)).astype(q_nope.dtype), rows(lse), rows(m)


@functools.partial(jax.custom_vjp, nondiff_argnums=(9, 10, 11))
def _latent(q_nope, q_rot, c, k_rot, w_k, w_v, seg_q, seg_k, q_start, scale, blocks,
            precision):
  o, _, m = _forward(q_nope, q_rot, c, k_rot, w_k, w_v, seg_q, seg_k, q_start, scale, blocks,
                     precision)
  return o, m


def _latent_fwd(q_nope, q_rot, c, k_rot, w_k, w_v, seg_q, seg_k, q_start, scale, blocks,
                precision):
  o, lse, m = _forward(q_nope, q_rot, c, k_rot, w_k, w_v, seg_q, seg_k, q_start, scale,
                       blocks, precision)
  return (o, m), (q_nope, q_rot, c, k_rot, w_k, w_v, seg_q, seg_k, q_start, o, lse)


def _latent_bwd(scale, blocks, precision, res, cts):
  q_nope, q_rot, c, k_rot, w_k, w_v, seg_q, seg_k, q_start, o, lse = res
  bq, bk = blocks
  wide = jnp.promote_types(q_nope.dtype, jnp.float32)
  do = cts[0].astype(wide)
  qs = _query_blocks(q_nope, q_rot, seg_q, q_start, bq)
  nq = qs[0].shape[0]
  row_blocks = lambda x: jnp.moveaxis(x.reshape(x.shape[0], x.shape[1], nq, bq), 2, 0)
  d = jnp.swapaxes(jnp.sum(do * o.astype(wide), axis=-1), 1, 2)      # [B, H, Tq]
  per_query = (*qs, _blocks(do, bq), row_blocks(lse), row_blocks(d))
  operands = (q_nope, q_rot, c, k_rot, w_k, w_v, seg_q, seg_k, q_start, do)
  zeros = lambda shape: vary_like(jnp.zeros(shape, wide), *operands)
  dq = (zeros(qs[0].shape), zeros(qs[1].shape))
  dw = (zeros(w_k.shape), zeros(w_v.shape))

  def key_block(carry, kb):
    dq, dw = carry
    c_j, kr_j, sk_j, k0 = kb
    kn_j, v_j = _expand(c_j, w_k, w_v, precision)
    k = (kn_j, kr_j, sk_j, k0)
    dk = (zeros(kn_j.shape), zeros(kr_j.shape), zeros(v_j.shape))

    def query_block(dk, x):
      qn, qr, sq, q0, do_i, lse_i, d_i, dqn, dqr = x
      p = jnp.exp(_scores((qn, qr, sq, q0), k, scale, wide, precision) - lse_i[..., None])
      dkn, dkr, dv = dk
      dv = dv + jnp.einsum("bhqk,bqhv->bkhv", p, do_i, precision=precision)
      dp = jnp.einsum("bqhv,bkhv->bhqk", do_i, v_j.astype(wide), precision=precision)
      ds = p * (dp - d_i[..., None]) * scale
      dkn = dkn + jnp.einsum("bhqk,bqhn->bkhn", ds, qn.astype(wide), precision=precision)
      dkr = dkr + jnp.einsum("bhqk,bqhr->bkr", ds, qr.astype(wide), precision=precision)
      dqn = dqn + jnp.einsum("bhqk,bkhn->bqhn", ds, kn_j.astype(wide), precision=precision)
      dqr = dqr + jnp.einsum("bhqk,bkr->bqhr", ds, kr_j.astype(wide), precision=precision)
      return (dkn, dkr, dv), (dqn, dqr)

    (dkn, dkr, dv), dq = jax.lax.scan(query_block, dk, (*per_query, *dq))
    dc = (jnp.einsum("bkhn,chn->bkc", dkn, w_k.astype(wide), precision=precision)
          + jnp.einsum("bkhv,chv->bkc", dv, w_v.astype(wide), precision=precision))
    c_w = c_j.astype(wide)
    dw = (dw[0] + jnp.einsum("bkc,bkhn->chn", c_w, dkn, precision=precision),
          dw[1] + jnp.einsum("bkc,bkhv->chv", c_w, dv, precision=precision))
    return (dq, dw), (dc, dkr)

  (dq, dw), (dc, dkr) = jax.lax.scan(key_block, (dq, dw), _key_blocks(c, k_rot, seg_k, bk))
  return (_unblocks(dq[0]).astype(q_nope.dtype), _unblocks(dq[1]).astype(q_rot.dtype),
          _unblocks(dc).astype(c.dtype), _unblocks(dkr).astype(k_rot.dtype),
          dw[0].astype(w_k.dtype), dw[1].astype(w_v.dtype), None, None, None)


_latent.defvjp(_latent_fwd, _latent_bwd)
