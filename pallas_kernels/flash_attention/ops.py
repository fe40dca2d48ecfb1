"""Blockwise causal attention with an online softmax (flash attention) in jnp, for MLA training.

    o[q] = sum_s softmax_s(scale * q . k[s] + mask[q, s]) v[s]

computed over query blocks i and key blocks j without the [T, T] scores: per (i, j) the block
scores S_ij, the running row max m, the running sum l = sum exp(S - m) and the running output
acc = sum exp(S - m) V, rescaled whenever m grows; o = acc / l, lse = m + log l.
The loops hold only the causal blocks (j <= i), with no branch, so the compiled program's
FLOPs (loop bodies times trip counts, as `k3jax.plan.hlo.matmul_flops` reads them) are the work
done: loops over all n blocks that skipped the upper ones with `lax.cond` counted n^2 blocks.
Query block i needs key blocks 0..i, so query blocks p and n-1-p together need n + 1: the
forward scans the n // 2 pairs, each a scan of n + 1 steps through a static table of (query
block, key block) carrying both query blocks' statistics; the middle block of an odd n runs
alone. The backward pairs key blocks the same way (key block j needs query blocks j..n-1).
The backward (custom VJP, as in FlashAttention-2) keeps only o and lse and recomputes each
block's probabilities P_ij = exp(S_ij - lse_i):
    dV_j = sum_i P_ij^T dO_i,   dS_ij = P_ij * (dO_i V_j^T - D_i),   D_i = rowsum(dO_i * O_i)
    dQ_i = scale sum_j dS_ij K_j,   dK_j = scale sum_i dS_ij^T Q_i
Masks: causal, and equal segment ids (packing, padding). Every query sees at least itself, so
no row is empty. Scores and softmax statistics in fp32 (fp64 for float64 inputs), as the dense
definition (reference.attention, with the [T, T] scores) computes them. Also returns the
per-row max of the masked scaled scores (QK-clip's max logit), not differentiated.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


def flash_attention(q_bthd, k_bthd, v_bthv, segment_ids_bt=None, *, scale: float,
                    block: int = 512, precision=None, with_lse: bool = False, saved=None):
  """(o [B, T, H, Dv] in v's dtype, row max [B, H, T] fp32): see the module docstring.
  T is padded up to a multiple of `block` (padded keys are masked, padded queries dropped).
  with_lse: also return each row's log-sum-exp [B, H, T] (wide). saved: the (o, row max, lse)
  of an earlier `with_lse` call on the same inputs: returned as they are, and the backward
  starts from them with no forward loop (a remat that keeps the attention's output)."""
  b, t, h, _ = q_bthd.shape
  block = min(block, t)
  pad = -t % block
  seg = jnp.ones((b, t), jnp.int32) if segment_ids_bt is None else segment_ids_bt
  if pad:
    q_bthd, k_bthd, v_bthv = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0)))
                              for x in (q_bthd, k_bthd, v_bthv))
    seg = jnp.pad(seg, ((0, 0), (0, pad)), constant_values=-1)  # padded keys: no segment
  seg = seg.astype(jnp.int32)
  if saved is not None:
    o, row_max, lse = saved
    # padded queries: no output and an lse of +inf (they saw no key)
    o = jnp.pad(o, ((0, 0), (0, pad), (0, 0), (0, 0)))
    lse = jnp.pad(lse, ((0, 0), (0, 0), (0, pad)), constant_values=jnp.inf)
    return _flash_saved(q_bthd, k_bthd, v_bthv, seg, o, lse, scale, block,
                        precision)[:, :t], row_max
  o, row_max, lse = _flash(q_bthd, k_bthd, v_bthv, seg, scale, block, precision)
  o, row_max, lse = o[:, :t], row_max[:, :, :t], lse[:, :, :t]
  return (o, row_max, lse) if with_lse else (o, row_max)


def _blocks(x, block):
  """[B, T, ...] -> [T / block, B, block, ...]"""
  b, t = x.shape[:2]
  return jnp.moveaxis(x.reshape(b, t // block, block, *x.shape[2:]), 1, 0)


def _unblocks(x):
  n, b, blk = x.shape[:3]
  return jnp.moveaxis(x, 0, 1).reshape(b, n * blk, *x.shape[3:])


def _scores(q, k, sq, sk, i, j, block, scale, wide, precision):
  """Masked scaled scores [B, H, bq, bk] of query block i against key block j."""
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=precision,
                 preferred_element_type=wide) * scale
  qpos = i * block + jnp.arange(block)
  kpos = j * block + jnp.arange(block)
  visible = (qpos[:, None] >= kpos[None, :])[None, None] & (
      sq[:, None, :, None] == sk[:, None, None, :])
  return jnp.where(visible, s, -jnp.inf)


def _paired(n, visits, run, carry):
  """Runs `carry, outs = run(carry, table, g)` once per group of outer blocks: the pairs
  (p, n-1-p) in one scan, then the middle block of an odd n. `table` [steps, 3] int32 lists
  the group's steps as (slot, outer block o, inner block), o's inner blocks being `visits(o)`
  and slot o's place among the group's g outer blocks; `outs` leaves are [g, ...]. Returns the
  last carry and `outs` in outer-block order, [n, ...]."""
  def table(outer):
    return np.asarray([(slot, o, x) for slot, o in enumerate(outer) for x in visits(o)],
                      np.int32)
  parts = []
  if n // 2:  # every pair has the same number of steps, so the pairs stack into one scan
    pairs = np.stack([table((p, n - 1 - p)) for p in range(n // 2)])
    carry, outs = jax.lax.scan(lambda c, t: run(c, t, 2), carry, pairs)
    parts.append(jax.tree.map(lambda x: x[:, 0], outs))
  if n % 2:
    carry, middle = run(carry, jnp.asarray(table((n // 2,))), 1)
    parts.append(middle)
  if n // 2:
    parts.append(jax.tree.map(lambda x: x[::-1, 1], outs))
  return carry, jax.tree.map(lambda *xs: jnp.concatenate(xs), *parts)


def _pick(stacked, slot):
  return tuple(jax.lax.dynamic_index_in_dim(x, slot, keepdims=False) for x in stacked)


def _put(stacked, values, slot):
  return tuple(jax.lax.dynamic_update_index_in_dim(x, v, slot, 0)
               for x, v in zip(stacked, values))


def _forward(q, k, v, seg, scale, block, precision):
  wide = jnp.promote_types(q.dtype, jnp.float32)
  qb, kb, vb, sb = (_blocks(x, block) for x in (q, k, v, seg))
  n = qb.shape[0]
  bsz, blk, h, dv = vb.shape[1], block, q.shape[2], v.shape[-1]

  def rows(_, table, g):
    init = (jnp.full((g, bsz, h, blk), -jnp.inf, wide), jnp.zeros((g, bsz, h, blk), wide),
            jnp.zeros((g, bsz, h, blk, dv), wide))

    def step(state, x):
      slot, i, j = x
      m, l, acc = _pick(state, slot)
      s = _scores(qb[i], kb[j], sb[i], sb[j], i, j, block, scale, wide, precision)
      m_new = jnp.maximum(m, jnp.max(s, axis=-1))
      m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
      p = jnp.exp(s - m_safe[..., None])
      alpha = jnp.exp(jnp.where(jnp.isfinite(m), m, -jnp.inf) - m_safe)
      l = l * alpha + jnp.sum(p, axis=-1)
      acc = acc * alpha[..., None] + jnp.einsum(
          "bhqk,bkhv->bhqv", p.astype(v.dtype), vb[j], precision=precision,
          preferred_element_type=wide)
      return _put(state, (m_new, l, acc), slot), None

    (m, l, acc), _ = jax.lax.scan(step, init, table)
    o = acc / l[..., None]
    # [g, B, blk, H, Dv], [g, B, H, blk] x 2
    return (), (jnp.moveaxis(o, 2, 3), m + jnp.log(l), m)

  _, (o, lse, m) = _paired(n, lambda i: range(i + 1), rows, ())
  o = _unblocks(o).astype(v.dtype)
  lse = jnp.moveaxis(lse, 0, 2).reshape(bsz, h, n * blk)
  m = jnp.moveaxis(m, 0, 2).reshape(bsz, h, n * blk)
  return o, lse, m


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _flash(q, k, v, seg, scale, block, precision):
  o, lse, m = _forward(q, k, v, seg, scale, block, precision)
  return o, m, lse


def _flash_fwd(q, k, v, seg, scale, block, precision):
  o, lse, m = _forward(q, k, v, seg, scale, block, precision)
  return (o, m, lse), (q, k, v, seg, o, lse)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _flash_saved(q, k, v, seg, o, lse, scale, block, precision):
  return o


def _flash_saved_fwd(q, k, v, seg, o, lse, scale, block, precision):
  return o, (q, k, v, seg, o, lse)


def _flash_saved_bwd(scale, block, precision, res, ct):
  # the saved output and lse are this call's own forward, not inputs to differentiate
  return (*_flash_bwd(scale, block, precision, res, (ct,)), None, None)


def _flash_bwd(scale, block, precision, res, cts):
  q, k, v, seg, o, lse = res
  do = cts[0]
  wide = jnp.promote_types(q.dtype, jnp.float32)
  qb, kb, vb, sb, dob = (_blocks(x, block) for x in (q, k, v, seg, do))
  lseb = jnp.moveaxis(lse.reshape(lse.shape[0], lse.shape[1], -1, block), 2, 0)  # [n,B,H,blk]
  # an elementwise product and a sum (no dot: D is not a matmul, and is not counted as one)
  d = jnp.swapaxes(jnp.sum(do.astype(wide) * o.astype(wide), axis=-1), 1, 2)  # [B, H, T]
  db = jnp.moveaxis(d.reshape(d.shape[0], d.shape[1], -1, block), 2, 0)
  n = qb.shape[0]

  def columns(dq, table, g):
    init = (jnp.zeros((g, *kb.shape[1:]), wide), jnp.zeros((g, *vb.shape[1:]), wide), dq)

    def step(carry, x):
      slot, j, i = x
      *dkv, dq = carry
      dk, dv = _pick(dkv, slot)
      k_j, v_j = kb[j], vb[j]
      s = _scores(qb[i], k_j, sb[i], sb[j], i, j, block, scale, wide, precision)
      p = jnp.exp(s - lseb[i][..., None])                       # [B, H, bq, bk]
      dv = dv + jnp.einsum("bhqk,bqhv->bkhv", p, dob[i].astype(wide), precision=precision)
      dp = jnp.einsum("bqhv,bkhv->bhqk", dob[i].astype(wide), v_j.astype(wide),
                      precision=precision)
      ds = p * (dp - db[i][..., None]) * scale
      dk = dk + jnp.einsum("bhqk,bqhd->bkhd", ds, qb[i].astype(wide), precision=precision)
      dq_i = jnp.einsum("bhqk,bkhd->bqhd", ds, k_j.astype(wide), precision=precision)
      dq = jax.lax.dynamic_update_index_in_dim(dq, dq[i] + dq_i, i, 0)
      return (*_put(dkv, (dk, dv), slot), dq), None

    (dk, dv, dq), _ = jax.lax.scan(step, init, table)
    return dq, (dk, dv)

  dq, (dk, dv) = _paired(n, lambda j: range(j, n), columns, jnp.zeros(qb.shape, wide))
  return (_unblocks(dq).astype(q.dtype), _unblocks(dk).astype(k.dtype),
          _unblocks(dv).astype(v.dtype), None)


_flash.defvjp(_flash_fwd, _flash_bwd)
_flash_saved.defvjp(_flash_saved_fwd, _flash_saved_bwd)
