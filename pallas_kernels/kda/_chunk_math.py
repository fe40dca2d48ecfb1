"""Per-chunk KDA math shared by the Pallas kernels (docs/kernels.md#kda-chunked-form).

Everything here works on in-register values of ONE (batch, head, chunk) of C = 64 tokens and is
plain `jnp`, so the TPU (Mosaic) and GPU (Triton) kernels trace the same code; the few
layout-sensitive helpers are passed in as `sub` (`RESHAPE_OPS` on TPU, `MASK_OPS` on GPU).

Notation per chunk (float32): q, k [C,K]; v [C,V]; g [C,K] raw log decay; beta_c [C,1];
rc [C,1] / rr [1,C] = number of segment starts in this chunk up to and including the token
(column and row layouts of the same numbers); s0 [K,V] the state entering the chunk.

    G = cumsum(g)                                  (inclusive, within the chunk)
    L[i,j] = beta_i sum_c k_ic k_jc e^{G_ic-G_jc}   j < i, same segment
    M[i,j] = sum_c (scale q_ic) k_jc e^{G_ic-G_jc}  j <= i, same segment
    T = (I + L)^-1 Diag(beta);  W = T Kd;  U = T v;  V' = U - W s0
    o  = Qd s0 + M V'
    s1 = a * s0 + Kl^T V'
with Kd = first * e^G k, Qd = first * e^G scale q (only the segment that continues the carried
state reads it), Kl = last * e^{G_last-G} k (only the segment still open at the chunk end writes
it), a = e^{G_last} if the chunk has no segment start, else 0.

Decay differences are always taken inside the exponent. Pairs in different 16-token
sub-chunks factor through the first token r of the later sub-chunk: e^{G_i-G_r} e^{G_r-G_j},
both factors <= 1 because G is non-increasing, so nothing overflows whatever the decay.
Pairs inside one sub-chunk are computed exactly, one column offset d at a time.
Every exponent G_i - G_j must be accurate to u |G_i - G_j| (u = 2^-24), not u |G_i|: with
K3's lower bound -5, G reaches -320 by the chunk end, where ulp(320) ~ 3e-5 would be a
relative error of every decay factor. So G is kept as hi + lo (`Cumsum`): hi on a 2^-10 grid,
whose cumsum and differences are exact in float32, and a small remainder lo.

The decay gradient dg_t is assembled from terms that do not cancel (see decay_grams_bwd): a
pair (i, j) depends on g only through G_i - G_j, the sum of g over (j, i], so it adds to dg_t
for j < t <= i only. Adding it at i, subtracting it at j and reverse-cumsumming is shorter, but
then every pair is added and removed again at all earlier tokens of the chunk: the float32
residue of those cancellations is shared by (correlated along) the chunk's tokens, and a
parameter gradient that sums dg over all tokens (dA_log) collected it well above the float32
recurrence's error (docs/benchmarks.md#development-measurements).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

C = 64  # chunk length
SUB = 16  # sub-chunk length
NSUB = C // SUB
# Backend choices, set while a backend traces its kernels (`backend_options(...)`):
#  precision: float32-accurate dots by default; the GPU uses 3xTF32 (tensor cores, ~fp32
#    accuracy) instead of IEEE FMA loops.
#  scan_cumsum: the GPU takes the in-chunk cumsum with lax.cumsum; feeding a matmul's result
#    through the decay math into further matmuls makes Triton's compile time explode
#    (docs/benchmarks.md#development-measurements). Mosaic TPU uses a triangular matmul.
_OPTIONS = contextvars.ContextVar(
    "kda_chunk_options",
    default=dict(precision=jax.lax.Precision.HIGHEST, scan_cumsum=False))  # noqa: B039 - read-only: backend_options sets a new dict


def flops_per_token(K: int, V: int) -> float:
  """Forward FLOPs of the chunked algorithm per token and head (a multiply-add is 2): 6 K V
  inter-chunk (W S, (Q e^G) S, the state update), C (3 K + 2 V) for the lower-triangular
  A_kk, A_qk, T e^G K, T V and A_qk V' products (each half of C^2), C^2 / 3 for the
  triangular solve. The model's FLOP count (k3jax/train/flops.py) and the kernels' cost
  estimates both use it; a backward that recomputes the forward does 3 times this."""
  return 6 * K * V + C * (3 * K + 2 * V) + C * C / 3


@contextlib.contextmanager
def backend_options(**options):
  token = _OPTIONS.set({**_OPTIONS.get(), **options})
  try:
    yield
  finally:
    _OPTIONS.reset(token)


def mm(a, b, ta: bool = False, tb: bool = False):
  """float32 matmul; ta / tb contract over a's rows / b's columns."""
  dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
  return jax.lax.dot_general(a, b, dims, precision=_OPTIONS.get()["precision"],
                             preferred_element_type=jnp.float32)


def _iota(shape, dim):
  return jax.lax.broadcasted_iota(jnp.int32, shape, dim)


def bsub_reshape(x, d):
  """[C,N] -> [C,N]: row i becomes row SUB*(i//SUB) + d (row d of its own sub-chunk)."""
  n = x.shape[-1]
  x3 = x.reshape(NSUB, SUB, n)
  pick = _iota((NSUB, SUB, n), 1) == d
  row = jnp.sum(jnp.where(pick, x3, 0.0), axis=1, keepdims=True)
  return jnp.broadcast_to(row, (NSUB, SUB, n)).reshape(C, n)


def bsub_matmul(x, d):
  """Same as `bsub_reshape` via an exact 0/1 selection matmul (no 3-D values needed)."""
  row, col = _iota((C, C), 0), _iota((C, C), 1)
  sel = jnp.where(col == (row >> 4) * SUB + d, 1.0, 0.0)
  return mm(sel, x)


def btail_reshape(x, d):
  """[C,N] -> [C,N]: row SUB*b + d becomes the sum of rows SUB*b + d .. SUB*b + SUB-1 (rows
  d.. of its own sub-chunk); every other row is 0."""
  n = x.shape[-1]
  x3 = x.reshape(NSUB, SUB, n)
  off = _iota((NSUB, SUB, n), 1)
  tail = jnp.sum(jnp.where(off >= d, x3, 0.0), axis=1, keepdims=True)
  return jnp.where(off == d, jnp.broadcast_to(tail, (NSUB, SUB, n)), 0.0).reshape(C, n)


def btail_masked(x, d):
  """Same as `btail_reshape` with 2-D masked reductions, one per sub-chunk (exact: no 0/1
  matmul, which 3xTF32 would round)."""
  row = _iota(x.shape, 0)
  blk, off = row >> 4, row - ((row >> 4) << 4)
  x = jnp.where(off >= d, x, 0.0)
  out = jnp.zeros(x.shape, jnp.float32)
  for b in range(NSUB):
    tail = jnp.sum(jnp.where(blk == b, x, 0.0), axis=0, keepdims=True)
    out = jnp.where((blk == b) & (off == d), tail, out)
  return out


class SubOps(NamedTuple):
  """Sub-chunk row gathers, in the form a backend lowers well."""
  pick: Callable  # pick(x, d): row i <- row d of i's sub-chunk
  tail: Callable  # tail(x, d): row d of each sub-chunk <- sum of its rows d.., other rows 0


RESHAPE_OPS = SubOps(bsub_reshape, btail_reshape)  # Mosaic TPU: 3-D values are fine
MASK_OPS = SubOps(bsub_matmul, btail_masked)  # Triton: 2-D values only


def pick_row(x, r: int):
  """x[r:r+1, :] as a masked reduction (the Triton lowering has no value slicing)."""
  return jnp.sum(jnp.where(_iota(x.shape, 0) == r, x, 0.0), axis=0, keepdims=True)


def col_to_row(x_c):
  """[N,1] -> [1,N] without a vector transpose (masked sublane reduction)."""
  n = x_c.shape[0]
  eye = _iota((n, n), 0) == _iota((n, n), 1)
  return jnp.sum(jnp.where(eye, x_c, 0.0), axis=0, keepdims=True)


def row_to_col(x_r):
  """[1,N] -> [N,1]."""
  n = x_r.shape[1]
  eye = _iota((n, n), 0) == _iota((n, n), 1)
  return jnp.sum(jnp.where(eye, x_r, 0.0), axis=1, keepdims=True)


class _Masks:
  """Index masks of one chunk; `same` comes from the segment-start counts."""

  def __init__(self, rc, rr):
    self.row, self.col = _iota((C, C), 0), _iota((C, C), 1)
    same = rc == rr
    self.strict = (self.col < self.row) & same
    self.causal = (self.col <= self.row) & same
    self.blk_r, self.blk_c = self.row >> 4, self.col >> 4
    self.blk_tok = _iota((C, 1), 0) >> 4  # [C,1]: each token's sub-chunk
    self.diag_blk = self.blk_r == self.blk_c
    self.first = rc == 0.0  # [C,1]: token continues the carried state
    r_last = pick_row(rc, C - 1)  # [1,1]
    self.last = rc == r_last  # [C,1]: token's segment is open at the chunk end
    self.all_first = r_last == 0.0  # [1,1]

  def diag_col(self, d):
    """[C,C] True at (i, SUB*(i//SUB) + d)."""
    return self.col == self.blk_r * SUB + d


def _ref_factors(G, blk):
  """Row / column factors relative to r = first token of sub-chunk `blk` (clamped <= 1)."""
  Gr = G.map(lambda x: pick_row(x, blk * SUB))
  return jnp.exp(jnp.minimum(G - Gr, 0.0)), jnp.exp(jnp.minimum(Gr - G, 0.0))


def decay_grams(xs, y, G, m: _Masks, sub: SubOps):
  """F_x[i,j] = sum_c x_ic y_jc e^{G_ic-G_jc} for j <= i, one [C,C] per x in `xs` (0 above)."""
  outs = [jnp.zeros((C, C), jnp.float32) for _ in xs]
  for blk in range(1, NSUB):  # pairs (i in sub-chunk blk, j in an earlier one)
    f_row, f_col = _ref_factors(G, blk)
    sel = (m.blk_r == blk) & (m.blk_c < blk)
    yr = y * f_col
    outs = [o + jnp.where(sel, mm(x * f_row, yr, tb=True), 0.0) for o, x in zip(outs, xs)]

  def diag(d, outs):  # pairs inside one sub-chunk, column offset d: exact exponent
    e = sub.pick(y, d) * jnp.exp(jnp.minimum(G - G.map(lambda x: sub.pick(x, d)), 0.0))
    put = m.diag_col(d) & (m.col <= m.row)
    return tuple(o + jnp.where(put, jnp.sum(x * e, axis=1, keepdims=True), 0.0)
                 for o, x in zip(outs, xs))

  return list(jax.lax.fori_loop(0, SUB, diag, tuple(outs)))


def decay_grams_bwd(dFs, xs, y, G, m: _Masks, sub: SubOps):
  """Gradients of F_n[i,j] = sum_c x_n,ic y_jc e^{G_ic-G_jc} (dF_n zero outside j <= i), for
  grams that share y (`decay_grams`' xs) -> (dxs, dy, dg).

  dg is the gradient w.r.t. the per-token decays g (G = cumsum g), already summed over the
  chunk: with P_ij = sum_n dF_n,ij x_n,i y_j e^{G_i-G_j} (per channel) and G_i - G_j the sum of
  g over (j, i], dg_t = sum of P_ij over the pairs with j < t <= i. Every term is added once:
    * pairs in different sub-chunks, row side: sum_j P_ij (= x dx) reaches t <= i of i's
      sub-chunk; it seeds the running row sums R of the in-sub-chunk loop below;
    * same pairs, column side: sum_i P_ij for rows i in sub-chunk blk (= y dy_blk) reaches
      every t in (j, start of blk): an exclusive cumsum over j, kept for t before blk;
    * pairs inside one sub-chunk, one column offset d at a time: R_i = sum of P_ij over the
      columns j < t done so far, and dg_t = sum of R_i over i >= t (`sub.tail`) just before
      column t is added.
  """
  dxs = [jnp.zeros(x.shape, jnp.float32) for x in xs]
  dy = jnp.zeros(y.shape, jnp.float32)
  dg = jnp.zeros(y.shape, jnp.float32)
  for blk in range(1, NSUB):
    f_row, f_col = _ref_factors(G, blk)
    sel = (m.blk_r == blk) & (m.blk_c < blk)
    yr = y * f_col
    dy_b = jnp.zeros(y.shape, jnp.float32)
    for n, (dF, x) in enumerate(zip(dFs, xs)):
      dF_b = jnp.where(sel, dF, 0.0)
      dxs[n] = dxs[n] + f_row * mm(dF_b, yr)
      dy_b = dy_b + mm(dF_b, x * f_row, ta=True)
    dy_b = f_col * dy_b
    dy = dy + dy_b
    dg = dg + jnp.where(m.blk_tok < blk, excl_cumsum_rows(y * dy_b, m), 0.0)
  rows = sum(x * dx for x, dx in zip(xs, dxs))
  dF_ds = [jnp.where(m.diag_blk, dF, 0.0) for dF in dFs]
  dFT_ds = [dF_d.T for dF_d in dF_ds]

  def diag(d, carry):
    dxs, dy, rows, dg = carry
    Gd, yd = G.map(lambda x: sub.pick(x, d)), sub.pick(y, d)
    pick = m.diag_col(d)
    dg = dg + sub.tail(rows, d)  # t at offset d: rows i >= t, columns j < t
    e_row = jnp.exp(jnp.minimum(G - Gd, 0.0))
    e_col = jnp.exp(jnp.minimum(Gd - G, 0.0))
    new_dxs, dy_d = [], jnp.zeros(y.shape, jnp.float32)
    for dx, x, dF_d, dFT_d in zip(dxs, xs, dF_ds, dFT_ds):
      a = jnp.sum(jnp.where(pick, dF_d, 0.0), axis=1, keepdims=True)  # dF[i, j(i,d)]
      b = jnp.sum(jnp.where(pick, dFT_d, 0.0), axis=1, keepdims=True)  # dF[i(j,d), j]
      step = a * yd * e_row
      new_dxs.append(dx + step)
      rows = rows + x * step
      dy_d = dy_d + b * sub.pick(x, d)
    return tuple(new_dxs), dy + dy_d * e_col, rows, dg

  dxs, dy, _, dg = jax.lax.fori_loop(0, SUB, diag, (tuple(dxs), dy, rows, dg))
  return list(dxs), dy, dg


def unit_lower_inverse(L, m: _Masks, sub: SubOps):
  """(I + L)^-1 for strictly lower L [C,C]: forward substitution inside each 16-block, then
  the nilpotent block correction (I+N)^-1 = I - N + N^2 - N^3 with N = D^-1 (L - D)."""
  eye = jnp.where(m.row == m.col, 1.0, 0.0)
  L_d = jnp.where(m.diag_blk, L, 0.0)

  def subst(d, X):  # rows SUB*b + d of X are final here: eliminate them from the rows below
    l_col = jnp.sum(jnp.where(m.diag_col(d), L_d, 0.0), axis=1, keepdims=True)
    return X - l_col * sub.pick(X, d)

  D_inv = jax.lax.fori_loop(0, SUB, subst, eye)
  N = mm(D_inv, L - L_d)
  N2 = mm(N, N)
  return mm(eye - N + N2 - mm(N2, N), D_inv)


class Cumsum(NamedTuple):
  """G = cumsum(g) as hi + lo: g's multiples of 2^-10 and the remainder, each cumsummed.

  The hi cumsum is exact in float32 (and through the GPU's 3xTF32 selection matmuls) while
  |G| < 2^12, so G_i - G_j = (hi_i - hi_j) + (lo_i - lo_j) has one rounding, u |G_i - G_j|,
  plus the lo cumsum's ~u * 64 * 2^-10. Larger |G| degrades to plain float32 cumsums."""
  hi: jax.Array
  lo: jax.Array

  @property
  def value(self):
    return self.hi + self.lo

  def map(self, f):
    return Cumsum(f(self.hi), f(self.lo))

  def __sub__(self, other):
    return (self.hi - other.hi) + (self.lo - other.lo)


def cumsum_decay(g, m: _Masks) -> Cumsum:
  hi = jnp.floor(g * 1024.0) * (1.0 / 1024.0)
  return Cumsum(cumsum_rows(hi, m), cumsum_rows(g - hi, m))


def cumsum_rows(x, m: _Masks):
  if _OPTIONS.get()["scan_cumsum"]:
    return jnp.cumsum(x, axis=0)
  return mm(jnp.where(m.col <= m.row, 1.0, 0.0), x)


def excl_cumsum_rows(x, m: _Masks):
  """sum_{j<i} x_j."""
  if _OPTIONS.get()["scan_cumsum"]:
    return jnp.cumsum(x, axis=0) - x
  return mm(jnp.where(m.col < m.row, 1.0, 0.0), x)


def rev_cumsum_rows(x, m: _Masks):
  if _OPTIONS.get()["scan_cumsum"]:  # Triton has no reverse cumsum: sum_{t>=i} = total - before i
    return jnp.sum(x, axis=0, keepdims=True) - jnp.cumsum(x, axis=0) + x
  return mm(jnp.where(m.col >= m.row, 1.0, 0.0), x)


# The chunk is split in two halves so that a backend may run them as separate kernels (GPU)
# or back to back in one (TPU): the "intra" half needs no state (M, (I+L)^-1, L_raw: parallel
# over chunks), the "state" half is the sequential recurrence that consumes them.


def intra_fwd(q, k, g, beta_c, rc, rr, scale, sub):
  """-> M [C,C] (masked A_qk, scale included), L_inv = (I+L)^-1 [C,C], L_raw [C,C]."""
  m = _Masks(rc, rr)
  G = cumsum_decay(g, m)
  M_raw, L_raw = decay_grams([q * scale, k], k, G, m, sub)
  M = jnp.where(m.causal, M_raw, 0.0)
  L_raw = jnp.where(m.strict, L_raw, 0.0)
  return M, unit_lower_inverse(beta_c * L_raw, m, sub), L_raw


class _Decays:
  """The decayed operands of one chunk that involve the carried state."""

  def __init__(self, q, k, g, beta_c, rc, rr, scale):
    self.m = m = _Masks(rc, rr)
    self.G = G = cumsum_decay(g, m)
    self.eG = eG = jnp.exp(G.value)
    self.beta_r = col_to_row(beta_c)
    self.Kd = jnp.where(m.first, eG * k, 0.0)  # decayed from the chunk start
    self.Qd = jnp.where(m.first, eG * (q * scale), 0.0)
    G_last = G.map(lambda x: pick_row(x, C - 1))
    self.decay_last = jnp.exp(G_last - G)  # to the chunk end
    self.Kl = jnp.where(m.last, k * self.decay_last, 0.0)
    self.a_r = jnp.where(m.all_first, jnp.exp(G_last.value), 0.0)  # [1,K] state decay


def state_fwd(q, k, v, g, beta_c, rc, rr, M, L_inv, s0, scale):
  """-> o [C,V], s1 [K,V]. v and s0 may be a column block of V: columns are independent."""
  d = _Decays(q, k, g, beta_c, rc, rr, scale)
  T = L_inv * d.beta_r
  Vp = mm(T, v) - mm(mm(T, d.Kd), s0)
  o = mm(d.Qd, s0) + mm(M, Vp)
  s1 = row_to_col(d.a_r) * s0 + mm(d.Kl, Vp, ta=True)
  return o, s1


def state_bwd(q, k, v, g, beta_c, rc, rr, M, L_inv, s0, do, ds1, scale):
  """Backward of `state_fwd` -> dv [C,V], ds0 [K,V], and the cotangents of the chunk's
  state-free intermediates (dQd, dM, dKl, dKd [C,K|C], dT [C,C], da [1,K]). With V split
  into column blocks those are partial sums over the blocks: add them up before intra_bwd."""
  d = _Decays(q, k, g, beta_c, rc, rr, scale)
  T = L_inv * d.beta_r
  W = mm(T, d.Kd)
  Vp = mm(T, v) - mm(W, s0)
  dVp = mm(M, do, ta=True) + mm(d.Kl, ds1)
  ds0 = mm(d.Qd, do, ta=True) + row_to_col(d.a_r) * ds1 - mm(W, dVp, ta=True)
  dW = -mm(dVp, s0, tb=True)
  partials = (
      mm(do, s0, tb=True),  # dQd
      jnp.where(d.m.causal, mm(do, Vp, tb=True), 0.0),  # dM
      mm(Vp, ds1, tb=True),  # dKl
      mm(T, dW, ta=True),  # dKd
      mm(dVp, v, tb=True) + mm(dW, d.Kd, tb=True),  # dT
      col_to_row(jnp.sum(s0 * ds1, axis=1, keepdims=True)),  # da
  )
  return mm(T, dVp, ta=True), ds0, partials


def intra_bwd(q, k, g, beta_c, rc, rr, L_inv, L_raw, partials, scale, sub):
  """-> dq, dk, dg [C,K], dbeta [C,1] from the summed `state_bwd` partials.

  dg_t sums, without cancellation, what depends on g_t: the decayed pairs straddling t
  (decay_grams_bwd), Qd_j and Kd_j (e^{G_j}) for j >= t, Kl_j (e^{G_last - G_j}) for j < t, and
  the state decay a (e^{G_last}) for every t.
  """
  dQd, dM, dKl, dKd, dT, da_r = partials
  d = _Decays(q, k, g, beta_c, rc, rr, scale)
  m, G = d.m, d.G
  qs = q * scale
  # T = L_inv Diag(beta), L_inv = (I + L)^-1, L = Diag(beta) L_raw
  dbeta_r = jnp.sum(dT * L_inv, axis=0, keepdims=True)
  dL = jnp.where(m.strict, -mm(mm(L_inv, dT * d.beta_r, ta=True), L_inv, tb=True), 0.0)
  dbeta_c = jnp.sum(dL * L_raw, axis=1, keepdims=True)

  (dqs, dk_l), dk_cols, dg = decay_grams_bwd([dM, beta_c * dL], [qs, k], k, G, m, sub)
  dg = dg + rev_cumsum_rows(d.Qd * dQd + d.Kd * dKd, m) + excl_cumsum_rows(d.Kl * dKl, m)
  dg = dg + d.a_r * da_r
  dq = scale * (dqs + jnp.where(m.first, d.eG * dQd, 0.0))
  dk = dk_cols + dk_l + jnp.where(m.first, d.eG * dKd, 0.0)
  dk = dk + jnp.where(m.last, d.decay_last * dKl, 0.0)
  return dq, dk, dg, dbeta_c + row_to_col(dbeta_r)


def chunk_fwd(q, k, v, g, beta_c, rc, rr, s0, scale, sub):
  """Whole chunk -> o [C,V], s1 [K,V] (float32)."""
  M, L_inv, _ = intra_fwd(q, k, g, beta_c, rc, rr, scale, sub)
  return state_fwd(q, k, v, g, beta_c, rc, rr, M, L_inv, s0, scale)


def chunk_bwd(q, k, v, g, beta_c, rc, rr, s0, do, ds1, scale, sub):
  """Recomputes the chunk forward, then -> dq, dk [C,K], dv [C,V], dg [C,K], dbeta [C,1],
  ds0 [K,V] given do [C,V] and ds1 [K,V] (the gradient reaching the chunk's end state)."""
  M, L_inv, L_raw = intra_fwd(q, k, g, beta_c, rc, rr, scale, sub)
  dv, ds0, partials = state_bwd(q, k, v, g, beta_c, rc, rr, M, L_inv, s0, do, ds1, scale)
  dq, dk, dg, dbeta = intra_bwd(q, k, g, beta_c, rc, rr, L_inv, L_raw, partials, scale, sub)
  return dq, dk, dv, dg, dbeta, ds0


# Optional in-kernel preparation of raw inputs (docs/kernels.md#raw-inputs). The kernels apply
# it in float32 as they load a chunk, the backward recomputes it from the raw inputs and chains
# its gradient through, so raw q/k/logits/gate are the residuals and nothing prepared is ever
# written to HBM.


class Fused(NamedTuple):
  """Which raw-input transforms a kernel applies (static; Fused() = prepared inputs).

  T, K: the unpadded token and feature counts. The prepared padding must stay exact (beta = 0
  on padded tokens, g = 0 on padded tokens and features), but a transform of zero padding is
  not zero (sigmoid(0) = 1/2), so the kernel masks it.
  """
  l2norm_eps: float | None = None  # q, k := x * rsqrt(sum_k x^2 + eps)
  use_beta_sigmoid: bool = False  # beta := sigmoid(beta)
  lower_bound: float | None = None  # g := lb * sigmoid(exp(A_log[h]) * (g + dt_bias[h]))
  T: int = 0
  K: int = 0

  @property
  def gate(self) -> bool:
    return self.lower_bound is not None

  @property
  def active(self) -> bool:
    return self.l2norm_eps is not None or self.use_beta_sigmoid or self.gate


def _sigmoid(x):
  return 1.0 / (1.0 + jnp.exp(-x))  # exp(-x) = inf gives exactly 0


def prepare(f: Fused, q, k, g, beta_c, alog_r, dtb_r, t0):
  """Raw chunk (float32; t0 = index of its first token) -> prepared (q, k, g, beta_c) and what
  `raw_grads` needs. alog_r / dtb_r [1,K]: this head's A_log (repeated) and dt_bias rows."""
  saved = {}
  if f.l2norm_eps is not None:
    for name, x in (("q", q), ("k", k)):
      r = jax.lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) + f.l2norm_eps)
      saved[name] = (x * r, r)
    q, k = saved["q"][0], saved["k"][0]
  if f.use_beta_sigmoid:
    tok = t0 + _iota((C, 1), 0) < f.T
    s = _sigmoid(beta_c)
    saved["beta"] = (tok, s)
    beta_c = jnp.where(tok, s, 0.0)
  if f.gate:
    shape = g.shape
    valid = (t0 + _iota(shape, 0) < f.T) & (_iota(shape, 1) < f.K)
    a = jnp.exp(alog_r)
    s = _sigmoid(a * (g + dtb_r))
    saved["g"] = (valid, a, s)
    g = jnp.where(valid, f.lower_bound * s, 0.0)
  return (q, k, g, beta_c), saved


def raw_grads(f: Fused, saved, dq, dk, dg, dbeta_c):
  """Chain rule from the prepared inputs' gradients to the raw ones (elementwise per token).

  l2norm: y = x r, r = (|x|^2 + eps)^-1/2  =>  dx = r (dy - y <dy, y>).
  gate: g = lb s(z), z = a (x + dt)  =>  dx = dg lb s (1 - s) a; dz/dA_log and dz/d dt_bias
  are z and a, reductions over tokens that the wrapper takes from dx.
  """
  if f.l2norm_eps is not None:
    def back(dy, y, r):
      return r * (dy - y * jnp.sum(dy * y, axis=1, keepdims=True))
    dq, dk = back(dq, *saved["q"]), back(dk, *saved["k"])
  if f.use_beta_sigmoid:
    tok, s = saved["beta"]
    dbeta_c = jnp.where(tok, dbeta_c * (s * (1.0 - s)), 0.0)
  if f.gate:
    valid, a, s = saved["g"]
    dg = jnp.where(valid, dg * (f.lower_bound * a) * (s * (1.0 - s)), 0.0)
  return dq, dk, dg, dbeta_c


def decode_step(q_c, k_c, v_r, g_c, beta, s, scale):
  """One token of the recurrence, exactly as the naive form (no MXU, all float32).

  q_c, k_c, g_c [..., K, 1] (K on sublanes so they scale the state's rows), v_r [..., 1, V],
  beta [..., 1, 1], s [..., K, V]. -> o [..., 1, V], s_new [..., K, V].
  """
  s = s * jnp.exp(g_c)
  pred = jnp.sum(k_c * s, axis=-2, keepdims=True)
  s = s + k_c * (beta * (v_r - pred))
  return jnp.sum((q_c * scale) * s, axis=-2, keepdims=True), s
