"""Flash attention over compressed latents (MLA with the sequence split: docs/kernels.md#flash-
attention-over-latents), in jnp with its own backward.

Queries q = [q_nope | q_rot] [B, Tq, H, N + R] of a sequence whose keys and values at
positions [0, Tk) are given as MLA's compressed latent c [B, Tk, C] and the shared k_rot
[B, Tk, R]:

    k_s = [c_s W_k | k_rot_s]  (per head)      v_s = c_s W_v
    o[q] = sum_s softmax_s(scale * q . k_s + mask[q, s]) v_s

The queries are P equal ranges of positions, range p at q_start[p] + [0, Tq / P) (P = 1: one
contiguous range; context parallelism's balanced split gives each device two). Masks: causal
by position (s <= the query's position) and equal segment ids. Nothing of size [Tq, Tk] nor a
per-head copy of every key exists: the loop runs over visits (outer), each a key block seen by
one range, and that range's query blocks (inner); each visit expands its key block to per-head
keys and values once, and the running statistics of every query block (row max m, sum l,
output acc) are carried, so a query block's online softmax sees its range's key blocks in
order. o = acc / l, lse = m + log l.

Which key blocks a range visits: all of them (`visits=None`: P x Tk / block visits, the masked
ones included), or only those its causal mask can reach, blocks 0 .. ceil(end_p / block) - 1,
in a loop of a static `visits` steps that the caller sizes to their total (steps beyond the
total are fully masked no-ops). The split is traced (q_start may depend on the device index),
the trip count is not, so the compiled program's matmul count is the work done.

The backward (custom VJP, as in FlashAttention-2) keeps q, the latents, o and lse; per visit it
expands the key block again and, over its range's query blocks, recomputes
P = exp(S - lse) and accumulates
    dV_j = sum_i P_ij^T dO_i     dS_ij = P_ij (dO_i V_j^T - D_i),  D_i = rowsum(dO_i O_i)
    dK_j = scale sum_i dS_ij^T Q_i          dQ_i += scale dS_ij K_j
then takes dK_j and dV_j back through the expansion: dc_j += dK_nope_j W_k^T + dV_j W_v^T,
dk_rot_j += sum over heads of dK_rot_j, dW_k += c_j^T dK_nope_j, dW_v += c_j^T dV_j (a key
block visited by two ranges gets both ranges' terms). Scores and the softmax statistics in
fp32 (fp64 for float64 inputs). Also returns each row's largest masked scaled score (QK-clip's
max logit), not differentiated.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.flash_attention.ops import _blocks, _pick, _put, _unblocks
from pallas_kernels.vma import vary_like

# the first key position given to a visit past the total: beyond every query, so all masked
_NOWHERE = 2**30


def latent_attention(q_nope, q_rot, c, k_rot, w_k, w_v, seg_q, seg_k, q_start, *,
                     scale: float, block: int = 512, precision=None,
                     visits: int | None = None, with_lse: bool = False, saved=None):
  """(o [B, Tq, H, Dv] in q's dtype, row max [B, H, Tq] fp32/fp64): see the module docstring.
  q_nope [B,Tq,H,N], q_rot [B,Tq,H,R], c [B,Tk,C], k_rot [B,Tk,R], w_k [C,H,N], w_v [C,H,Dv],
  seg_q [B,Tq], seg_k [B,Tk] int, q_start int scalar or [P] (may be traced). With one range
  Tq and Tk are padded up to multiples of the block (padded keys are masked, padded queries
  dropped); with P ranges each range's length must be a multiple of min(block, Tq / P).
  visits: the static number of (range, key block) steps; at least the ranges' causal key
  blocks in total (the caller's bound: fewer would drop keys), None for every block.
  with_lse: also return each row's log-sum-exp [B, H, Tq] (wide). saved: the (o, row max,
  lse) of an earlier `with_lse` call on the same inputs: they are returned as they are and the
  backward starts from them, with no forward loop (a remat that keeps the attention's output:
  docs/kernels.md#flash-attention-over-latents)."""
  starts = jnp.atleast_1d(jnp.asarray(q_start, jnp.int32))
  ranges = starts.shape[0]
  tq, tk = q_nope.shape[1], c.shape[1]
  span = tq // ranges
  bq, bk = min(block, span), min(block, tk)
  pad = lambda x, n, value=0: jnp.pad(x, ((0, 0), (0, n)) + ((0, 0),) * (x.ndim - 2),
                                      constant_values=value)
  if ranges > 1 and (tq % ranges or span % bq):
    raise ValueError(f"{tq} queries in {ranges} ranges need ranges of a whole number of "
                     f"{bq}-query blocks")
  pad_q, pad_k = -tq % bq, -tk % bk
  q_nope, q_rot, seg_q = pad(q_nope, pad_q), pad(q_rot, pad_q), pad(seg_q, pad_q, -1)
  c, k_rot, seg_k = pad(c, pad_k), pad(k_rot, pad_k), pad(seg_k, pad_k, -2)
  nk = c.shape[1] // bk
  operands = (q_nope, q_rot, c, k_rot, w_k, w_v, seg_q.astype(jnp.int32),
              seg_k.astype(jnp.int32), starts)
  # Inside shard_map: one varying type for every operand, cast out here where JAX
  # differentiates it (replicated weights then get their gradients summed over the mesh)
  operands = tuple(vary_like(x, *operands) for x in operands)
  loop = (bq, bk, ranges * nk if visits is None else visits)
  if saved is not None:
    o, row_max, lse = saved
    # padded queries: no output, and an lse of +inf (they saw no key)
    o = _latent_saved(*operands, vary_like(pad(o, pad_q), *operands),
                      vary_like(jnp.pad(lse, ((0, 0), (0, 0), (0, pad_q)),
                                        constant_values=jnp.inf), *operands),
                      scale, loop, precision)
    return o[:, :tq], row_max
  o, row_max, lse = _latent(*operands, scale, loop, precision)
  o, row_max, lse = o[:, :tq], row_max[:, :, :tq], lse[:, :, :tq]
  return (o, row_max, lse) if with_lse else (o, row_max)


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


def _query_blocks(q_nope, q_rot, seg_q, starts, bq):
  """The query blocks [nq, ...] of every range in order, with each block's first position."""
  per = q_nope.shape[1] // bq // starts.shape[0]
  first = starts[:, None] + bq * jnp.arange(per, dtype=jnp.int32)
  return _blocks(q_nope, bq), _blocks(q_rot, bq), _blocks(seg_q, bq), first.reshape(-1)


def _visit_table(starts, span, bk, nk, visits):
  """Per visit (range, key block, the block's first position or _NOWHERE past the total):
  range p's causal key blocks 0 .. ceil((start_p + span) / bk) - 1, the ranges in order."""
  counts = jnp.clip(-(-(starts + span) // bk), 0, nk)
  ends = jnp.cumsum(counts)
  v = jnp.arange(visits, dtype=jnp.int32)
  live = v < ends[-1]
  rng = jnp.minimum(jnp.sum(v[:, None] >= ends[None, :], axis=1), starts.shape[0] - 1)
  j = jnp.where(live, v - (ends - counts)[rng], 0).astype(jnp.int32)
  return rng.astype(jnp.int32), j, jnp.where(live, j * bk, _NOWHERE).astype(jnp.int32)


def _loop_tables(q_nope, q_rot, c, k_rot, seg_q, seg_k, starts, loop):
  bq, bk, visits = loop
  qs = _query_blocks(q_nope, q_rot, seg_q, starts, bq)
  ks = (_blocks(c, bk), _blocks(k_rot, bk), _blocks(seg_k, bk))
  per = qs[0].shape[0] // starts.shape[0]
  table = _visit_table(starts, per * bq, bk, ks[0].shape[0], visits)
  return qs, ks, per, table


def _forward(q_nope, q_rot, c, k_rot, w_k, w_v, seg_q, seg_k, starts, scale, loop,
             precision):
  """(o, lse, row max): o [B, Tq, H, Dv] in q's dtype, lse and row max [B, H, Tq] wide."""
  wide = jnp.promote_types(q_nope.dtype, jnp.float32)
  qs, ks, per, table = _loop_tables(q_nope, q_rot, c, k_rot, seg_q, seg_k, starts, loop)
  b, h, dv, bq = q_nope.shape[0], q_nope.shape[2], w_v.shape[-1], loop[0]
  nq = qs[0].shape[0]
  # loop carries keep one type: as varying (inside a shard_map) as every operand
  operands = (q_nope, q_rot, c, k_rot, w_k, w_v, seg_q, seg_k, starts)
  stats = tuple(vary_like(x, *operands) for x in (
      jnp.full((nq, b, h, bq), -jnp.inf, wide), jnp.zeros((nq, b, h, bq), wide),
      jnp.zeros((nq, b, h, bq, dv), wide)))

  def visit(stats, x):
    rng, j, k0 = x
    c_j, kr_j, sk_j = _pick(ks, j)
    kn_j, v_j = _expand(c_j, w_k, w_v, precision)

    def query_block(stats, i):
      at = rng * per + i
      m, l, acc = _pick(stats, at)
      s = _scores((*_pick(qs[:3], at), qs[3][at]), (kn_j, kr_j, sk_j, k0), scale, wide,
                  precision)
      m_new = jnp.maximum(m, jnp.max(s, axis=-1))
      m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
      p = jnp.exp(s - m_safe[..., None])
      alpha = jnp.exp(m - m_safe)
      l = l * alpha + jnp.sum(p, axis=-1)
      acc = acc * alpha[..., None] + jnp.einsum("bhqk,bkhv->bhqv", p.astype(v_j.dtype), v_j,
                                                precision=precision,
                                                preferred_element_type=wide)
      return _put(stats, (m_new, l, acc), at), None

    return jax.lax.scan(query_block, stats, jnp.arange(per, dtype=jnp.int32))[0], None

  (m, l, acc), _ = jax.lax.scan(visit, stats, table)
  seen = l > 0  # padded queries see no key
  o = acc / jnp.where(seen, l, 1.0)[..., None]                       # [nq, B, H, bq, Dv]
  lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), jnp.inf)
  rows = lambda x: jnp.moveaxis(x, 0, 2).reshape(b, h, nq * bq)
  return _unblocks(jnp.moveaxis(o, 2, 3)).astype(q_nope.dtype), rows(lse), rows(m)


@functools.partial(jax.custom_vjp, nondiff_argnums=(9, 10, 11))
def _latent(q_nope, q_rot, c, k_rot, w_k, w_v, seg_q, seg_k, starts, scale, loop,
            precision):
  o, lse, m = _forward(q_nope, q_rot, c, k_rot, w_k, w_v, seg_q, seg_k, starts, scale, loop,
                       precision)
  return o, m, lse


def _latent_fwd(q_nope, q_rot, c, k_rot, w_k, w_v, seg_q, seg_k, starts, scale, loop,
                precision):
  o, lse, m = _forward(q_nope, q_rot, c, k_rot, w_k, w_v, seg_q, seg_k, starts, scale,
                       loop, precision)
  return (o, m, lse), (q_nope, q_rot, c, k_rot, w_k, w_v, seg_q, seg_k, starts, o, lse)


@functools.partial(jax.custom_vjp, nondiff_argnums=(11, 12, 13))
def _latent_saved(q_nope, q_rot, c, k_rot, w_k, w_v, seg_q, seg_k, starts, o, lse, scale,
                  loop, precision):
  return o


def _latent_saved_fwd(q_nope, q_rot, c, k_rot, w_k, w_v, seg_q, seg_k, starts, o, lse, scale,
                      loop, precision):
  return o, (q_nope, q_rot, c, k_rot, w_k, w_v, seg_q, seg_k, starts, o, lse)


def _latent_saved_bwd(scale, loop, precision, res, ct):
  # the saved output and lse are this call's own forward, not inputs to differentiate
  return (*_latent_bwd(scale, loop, precision, res, (ct,)), None, None)


def _latent_bwd(scale, loop, precision, res, cts):
  q_nope, q_rot, c, k_rot, w_k, w_v, seg_q, seg_k, starts, o, lse = res
  wide = jnp.promote_types(q_nope.dtype, jnp.float32)
  qs, ks, per, table = _loop_tables(q_nope, q_rot, c, k_rot, seg_q, seg_k, starts, loop)
  bq, nq = loop[0], qs[0].shape[0]
  do = cts[0].astype(wide)
  row_blocks = lambda x: jnp.moveaxis(x.reshape(x.shape[0], x.shape[1], nq, bq), 2, 0)
  d = jnp.swapaxes(jnp.sum(do * o.astype(wide), axis=-1), 1, 2)      # [B, H, Tq]
  per_query = (_blocks(do, bq), row_blocks(lse), row_blocks(d))
  operands = (q_nope, q_rot, c, k_rot, w_k, w_v, seg_q, seg_k, starts, do)
  zeros = lambda shape: vary_like(jnp.zeros(shape, wide), *operands)
  grads = (zeros(qs[0].shape), zeros(qs[1].shape), zeros(ks[0].shape), zeros(ks[1].shape),
           zeros(w_k.shape), zeros(w_v.shape))

  def visit(grads, x):
    dqn, dqr, dc, dkr, dwk, dwv = grads
    rng, j, k0 = x
    c_j, kr_j, sk_j = _pick(ks, j)
    kn_j, v_j = _expand(c_j, w_k, w_v, precision)
    k = (kn_j, kr_j, sk_j, k0)

    def query_block(carry, i):
      (dkn, dkr_j, dv), dq = carry
      at = rng * per + i
      qn, qr, sq = _pick(qs[:3], at)
      do_i, lse_i, d_i = _pick(per_query, at)
      dqn_i, dqr_i = _pick(dq, at)
      p = jnp.exp(_scores((qn, qr, sq, qs[3][at]), k, scale, wide, precision)
                  - lse_i[..., None])
      dv = dv + jnp.einsum("bhqk,bqhv->bkhv", p, do_i, precision=precision)
      dp = jnp.einsum("bqhv,bkhv->bhqk", do_i, v_j.astype(wide), precision=precision)
      ds = p * (dp - d_i[..., None]) * scale
      dkn = dkn + jnp.einsum("bhqk,bqhn->bkhn", ds, qn.astype(wide), precision=precision)
      dkr_j = dkr_j + jnp.einsum("bhqk,bqhr->bkr", ds, qr.astype(wide), precision=precision)
      dqn_i = dqn_i + jnp.einsum("bhqk,bkhn->bqhn", ds, kn_j.astype(wide), precision=precision)
      dqr_i = dqr_i + jnp.einsum("bhqk,bkr->bqhr", ds, kr_j.astype(wide), precision=precision)
      return ((dkn, dkr_j, dv), _put(dq, (dqn_i, dqr_i), at)), None

    dk = (zeros(kn_j.shape), zeros(kr_j.shape), zeros(v_j.shape))
    ((dkn, dkr_j, dv), (dqn, dqr)), _ = jax.lax.scan(
        query_block, (dk, (dqn, dqr)), jnp.arange(per, dtype=jnp.int32))
    dc_j = (jnp.einsum("bkhn,chn->bkc", dkn, w_k.astype(wide), precision=precision)
            + jnp.einsum("bkhv,chv->bkc", dv, w_v.astype(wide), precision=precision))
    dc, dkr = _put((dc, dkr), (dc_j + dc[j], dkr_j + dkr[j]), j)
    c_w = c_j.astype(wide)
    dwk = dwk + jnp.einsum("bkc,bkhn->chn", c_w, dkn, precision=precision)
    dwv = dwv + jnp.einsum("bkc,bkhv->chv", c_w, dv, precision=precision)
    return (dqn, dqr, dc, dkr, dwk, dwv), None

  (dqn, dqr, dc, dkr, dwk, dwv), _ = jax.lax.scan(visit, grads, table)
  return (_unblocks(dqn).astype(q_nope.dtype), _unblocks(dqr).astype(q_rot.dtype),
          _unblocks(dc).astype(c.dtype), _unblocks(dkr).astype(k_rot.dtype),
          dwk.astype(w_k.dtype), dwv.astype(w_v.dtype), None, None, None)


_latent.defvjp(_latent_fwd, _latent_bwd)
_latent_saved.defvjp(_latent_saved_fwd, _latent_saved_bwd)
