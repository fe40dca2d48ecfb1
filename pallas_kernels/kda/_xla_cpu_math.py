"""Per-chunk math of the XLA:CPU KDA backend (xla_cpu.py): the chunked form
(docs/kernels.md#kda-chunked-form) with the factorings and layouts that make it fast on
XLA:CPU. reference.chunk_kda is the same math written plainly; this file is the tuned version,
tested against it and the float64 recurrence.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.kda.reference import CHUNK, compute_dtype, segment_starts

# ----------------------------------------------------------------------------------------------
# Chunked form (docs/kernels.md#kda-chunked-form), chunk C = 64. Per chunk, with G the
# inclusive cumsum of g inside the chunk and S the entering state:
#   Akk[i,j] = beta_i sum_c k_ic k_jc e^{G_ic - G_jc}      j < i   (same segment)
#   Aqk[i,j] = sum_c q~_ic k_jc e^{G_ic - G_jc}            j <= i  (same segment), q~ = scale q
#   M = (I + Akk)^-1;  W = M (beta e^G k);  U = M (beta v)
#   V' = U - W S;  O = (q~ e^G) S + Aqk V';  S <- e^{G_last} S + (k e^{G_last - G})^T V'
#
# One lax.scan over chunks (xla_cpu.py) does all of a chunk's work in its body. On XLA:CPU that
# is much faster than batching the intra-chunk math over all chunks first: every chunk-sized
# temporary stays in cache and its buffer is reused, where the batched form writes (and
# page-faults) a fresh T-sized array per intermediate. The helpers work on any leading dims.
# ----------------------------------------------------------------------------------------------


def _dot(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
  """einsum at full float32 precision (the default on CPU; not on TPU/GPU)."""
  return jnp.einsum(spec, a, b, precision=jax.lax.Precision.HIGHEST)


def small_sum(x: jax.Array, axis: int) -> jax.Array:
  """Sum over a short axis as explicit adds: XLA:CPU runs a reduce over a size-2..8 axis as a
  generic reduction that is many times slower than the adds."""
  return functools.reduce(jnp.add, [jax.lax.index_in_dim(x, i, axis % x.ndim, keepdims=False)
                                    for i in range(x.shape[axis])])


def transposed(x: jax.Array) -> jax.Array:
  """x with its last two axes swapped *in memory*. XLA folds a plain transpose into the dot
  that consumes it, and a dot contracting both operands' row axes runs slower on XLA:CPU
  than one fed a materialized transpose (docs/benchmarks.md#development-measurements); the
  barrier keeps the copy."""
  return jax.lax.optimization_barrier(jnp.swapaxes(x, -1, -2))


BAND = 8   # rows that share one factoring point in decayed_pairs; decay sums restart per band


def max_step_decay(dtype) -> float:
  """Largest per-token |g| the chunked form represents exactly; larger decays are clamped.

  decayed_pairs factors pairs through a point up to BAND/2 = 4 tokens away, so a factor can
  reach e^{+-4 max}. In float32 that must leave headroom below exp's range (e^88) and above the
  flush-to-zero threshold (e^-87) for the vectors it multiplies: 4 * 17 = 68 leaves e^19.
  The clamp itself is invisible: one such token already scales the carried state by
  e^-17 ~ 4e-8 (below float32 rounding of what it is added to; e^-120 for float64), and the
  true gradient there is as negligible.
  """
  return 17.0 if jnp.finfo(dtype).bits <= 32 else 120.0


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def prefix_sum(x: jax.Array, axis: int, reverse: bool = False) -> jax.Array:
  """Inclusive cumsum along a short axis (16 here) as an unrolled chain of adds.

  XLA:CPU lowers `lax.cumsum` to an O(n^2) reduce-window and a matmul with a triangle of ones
  runs a 16-deep contraction at a few GFLOP/s; the add chain is cheap. Its own VJP (the reverse
  cumsum) keeps autodiff from turning the chain into pads and slices.
  """
  axis = axis % x.ndim
  n = x.shape[axis]
  x = jax.lax.optimization_barrier(x)  # else XLA fuses x's producer into every slice
  acc, outs = None, [None] * n
  for i in (reversed(range(n)) if reverse else range(n)):
    xi = jax.lax.index_in_dim(x, i, axis, keepdims=False)
    acc = xi if acc is None else acc + xi
    outs[i] = acc
  return jnp.stack(outs, axis=axis)


prefix_sum.defvjp(lambda x, axis, reverse: (prefix_sum(x, axis, reverse), None),
                  lambda axis, reverse, _, ct: (prefix_sum(ct, axis, not reverse),))


class Decays(NamedTuple):
  """Decay bookkeeping per chunk, built only from *sums* of g over token intervals.

  Every factor e^{x} must carry x to full relative precision wherever e^{x} is not negligible.
  A difference of two cumsums does not: the chunk cumsum reaches ~-320 with the -5 lower
  bound, and ulp(320) ~ 3e-5 would become a relative error of every e^{G_i - G_j} made from
  it. Sums of g (all <= 0) never cancel, so each interval is summed directly: inside a band of
  BAND tokens by short prefix sums, across bands from band totals. Shapes [..., C, K] unless
  noted; NB = C / BAND; m is a band's middle row (its factoring point in decayed_pairs).
  """
  local: jax.Array    # sum of g over [band start, i]
  rest: jax.Array     # sum of g over (i, band end]
  own: jax.Array      # G_i - G_m for i in m's band: sum over (m, i], or minus that over (i, m]
  before: jax.Array   # [..., NB, 1, K] sum over all earlier bands
  after: jax.Array    # [..., NB, 1, K] sum over all later bands
  between: jax.Array  # [..., NB, NB, K] between[I, J] = sum over bands J+1..I-1 (0 if J >= I-1)


def _interval_masks(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """0/1 matrices over band totals: earlier bands, later bands, bands strictly between."""
  i, j, c = np.ogrid[:n, :n, :n]
  return (np.tril(np.ones((n, n)), -1), np.triu(np.ones((n, n)), 1),
          ((j < c) & (c < i)).reshape(n * n, n).astype(np.float64))


def chunk_decays(g: jax.Array) -> Decays:
  lead, (length, feat) = g.shape[:-2], g.shape[-2:]
  n_band, mid = length // BAND, BAND // 2
  gb = g.reshape(lead + (n_band, BAND, feat))
  zero = jnp.zeros_like(gb[..., :1, :])
  local = prefix_sum(gb, -2)
  rest = prefix_sum(jnp.concatenate([gb[..., 1:, :], zero], -2), -2, True)
  own = jnp.concatenate([-prefix_sum(gb[..., 1:mid + 1, :], -2, True), zero,
                         prefix_sum(gb[..., mid + 1:, :], -2)], -2)
  # Sums of band totals, as a 0/1 matmul: exact up to the rounding of a same-sign sum.
  earlier, later, between = (m.astype(g.dtype) for m in _interval_masks(n_band))
  total = local[..., -1, :]                                         # [..., NB, K]
  over = lambda m: _dot("pc,...ck->...pk", m, total)
  return Decays(local.reshape(g.shape), rest.reshape(g.shape), own.reshape(g.shape),
                over(earlier)[..., None, :], over(later)[..., None, :],
                over(between).reshape(lead + (n_band, n_band, feat)))


def chunk_exponents(d: Decays) -> tuple[jax.Array, jax.Array]:
  """(G_i, G_last - G_j), [..., C, K]: decay from the chunk start through token i, and from
  after token j to the chunk end."""
  shape = d.local.shape
  banded = lambda x: x.reshape(d.before.shape[:-2] + (BAND, shape[-1]))
  g_incl = d.before + banded(d.local)
  g_to_end = banded(d.rest) + d.after
  return g_incl.reshape(shape), g_to_end.reshape(shape)


class BandExponents(NamedTuple):
  """The exponents decayed_pairs factors its decays through ([..., NB, ., K]); m is a band's
  middle row, b the band of the rows, a an earlier band of the columns."""
  own: jax.Array   # [..., NB, BAND, K]  G_i - G_m for the band's own tokens
  rest: jax.Array  # [..., NB, BAND, K]  G_end(a) - G_j: sum of g over (j, end of its band]
  pair: jax.Array  # [..., NB, NB, K]    G_m(b) - G_end(a): bands between, then start of b..m


def band_exponents(d: Decays) -> BandExponents:
  lead, (length, feat) = d.local.shape[:-2], d.local.shape[-2:]
  banded = lambda x: x.reshape(lead + (length // BAND, BAND, feat))
  local_m = banded(d.local)[..., BAND // 2:BAND // 2 + 1, :]        # sum over [start of b, m]
  return BandExponents(banded(d.own), banded(d.rest), d.between + local_m)


def _band_factors(e: BandExponents) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(e^{G_i - G_m} for each band's rows [..., NB, BAND, K],
      e^{G_m(b) - G_j} for all columns j [..., NB(b), NB(a), BAND, K], zero for a > b,
      the mask a < b [NB, NB, 1]).

  Across bands the exponent is rest_j + pair[b, a]: a per-token and a per-(band, band) part,
  both <= 0, so their product is safe and only ~C*K + NB*NB*K exponentials are needed.
  """
  n_band = e.own.shape[-3]
  bands = np.arange(n_band)
  earlier = (bands[None, :] < bands[:, None])[:, :, None]           # [NB(b), NB(a), 1]
  pair_f = jnp.exp(jnp.where(earlier, e.pair, -jnp.inf))
  col_f = pair_f[..., :, :, None, :] * jnp.exp(e.rest)[..., None, :, :, :]
  diag = np.eye(n_band, dtype=bool)[:, :, None, None]
  col_f = jnp.where(diag, jnp.exp(-e.own)[..., :, None, :, :], col_f)
  return jnp.exp(e.own), col_f, earlier


@jax.custom_vjp
def decayed_pairs(x_wck: jax.Array, y_ck: jax.Array, e: BandExponents) -> jax.Array:
  """P[w,i,j] = sum_c x[w,i,c] y[j,c] e^{G_ic - G_jc} for j < i (zero elsewhere), per chunk.

  x_wck: [..., W, C, K] (W stacked left operands, e.g. q and k); y_ck: [..., C, K]; e: the
  chunk's band exponents (|g| <= max_step_decay). Returns [..., W, C, C].

  e^{G_i - G_j} must never be formed as e^{G_i} / e^{G_j}: a 64-token chunk decays to ~e^-320
  with the -5 lower bound. Rows are grouped in bands of BAND; every pair of band b factors
  through the band's middle row m:
      e^{G_i - G_j} = e^{G_i - G_m} * e^{G_m - G_j}
  so each band is one matmul (x e^{G - G_m}) (y e^{G_m - G})^T over all columns up to the band
  end. The row factor spans at most BAND/2 tokens each way, the column factor is <= 1 for j < m
  and spans at most BAND/2 - 1 tokens for j > m; with |g| <= max_step_decay neither leaves
  exp's range. Entries on and above the diagonal are garbage (possibly inf) and are zeroed:
  the diagonal (e^0 = 1) would pair a factor e^{4 max} with e^{-4 max}, the one product where
  flush-to-zero of the small factor could lose an O(1) term.

  The VJP returns cotangents of the exponents themselves, which autodiff then carries into g
  through the interval sums that define them. (Summing each pair's term into dG_i and -dG_j
  and reverse-cumsumming is shorter but telescopes: every pair is added and cancelled again
  at all earlier tokens, and the float32 residue of those cancellations reaches 1e-5 in dg.)
  """
  return _pairs_fwd(x_wck, y_ck, e)[0]


def _banded_rows(a: jax.Array, n_band: int) -> jax.Array:
  """[..., W, C, N] -> [..., NB, W * BAND, N]: each band's rows of all W stacked."""
  lead, n_w = a.shape[:-3], a.shape[-3]
  a = a.reshape(lead + (n_w, n_band, BAND, a.shape[-1]))
  return jnp.moveaxis(a, -4, -3).reshape(lead + (n_band, n_w * BAND, a.shape[-1]))


def _unband_rows(a: jax.Array, n_w: int) -> jax.Array:
  """Inverse of _banded_rows: [..., NB, W * BAND, N] -> [..., W, C, N]."""
  lead, n_band = a.shape[:-3], a.shape[-3]
  a = jnp.moveaxis(a.reshape(lead + (n_band, n_w, BAND, a.shape[-1])), -3, -4)
  return a.reshape(lead + (n_w, n_band * BAND, a.shape[-1]))


def _pairs_fwd(x_wck, y_ck, e):
  lead, (n_w, length, feat) = y_ck.shape[:-2], x_wck.shape[-3:]
  n_band = length // BAND
  row_f, col_f, _ = _band_factors(e)
  xr = _banded_rows(x_wck, n_band) * jnp.tile(row_f, (1,) * (row_f.ndim - 2) + (n_w, 1))
  yc = y_ck.reshape(lead + (1, n_band, BAND, feat)) * col_f         # [..., NB, NB, BAND, K]
  yc = yc.reshape(lead + (n_band, length, feat))
  p = _unband_rows(_dot("...bik,...bjk->...bij", xr, yc), n_w)
  below = np.tril(np.ones((length, length), bool), -1)
  return jnp.where(below, p, 0), (x_wck, y_ck, e)


def _pairs_bwd(res, dp):
  x_wck, y_ck, e = res
  lead, (n_w, length, feat) = y_ck.shape[:-2], x_wck.shape[-3:]
  n_band = length // BAND
  row_f, col_f, earlier = _band_factors(e)
  row_f_w = jnp.tile(row_f, (1,) * (row_f.ndim - 2) + (n_w, 1))
  xr = _banded_rows(x_wck, n_band) * row_f_w                        # [..., NB, W*BAND, K]
  yc = (y_ck.reshape(lead + (1, n_band, BAND, feat)) * col_f).reshape(
      lead + (n_band, length, feat))
  dpb = _banded_rows(jnp.where(np.tril(np.ones((length, length), bool), -1), dp, 0), n_band)
  # Rows: P_b = xr_b yc_b^T, so dxr_b = dP_b yc_b; xr = x * e^{own}.
  dxr = _dot("...bij,...bjk->...bik", dpb, yc)
  dx = _unband_rows(dxr * row_f_w, n_w)
  d_own = small_sum((dxr * xr).reshape(lead + (n_band, n_w, BAND, feat)), -3)
  # Columns: dyc_b = dP_b^T xr_b, per band; yc = y * col_f.
  dyc = _dot("...bij,...bik->...bjk", dpb, xr).reshape(lead + (n_band, n_band, BAND, feat))
  y_b = y_ck.reshape(lead + (1, n_band, BAND, feat))
  dy = small_sum(dyc * col_f, -4).reshape(y_ck.shape)
  d_col = dyc * col_f * y_b                                         # d(column exponent)
  diag = np.eye(n_band, dtype=bool)[:, :, None, None]
  d_own = d_own - small_sum(jnp.where(diag, d_col, 0), -4)          # own band: -own
  d_far = jnp.where(earlier[..., None], d_col, 0)                   # earlier: rest + pair
  d_rest = small_sum(d_far, -4)
  d_pair = small_sum(d_far, -2)
  return dx, dy, BandExponents(d_own, d_rest, d_pair)


decayed_pairs.defvjp(_pairs_fwd, _pairs_bwd)


def unit_lower_inverse(l_cc: jax.Array) -> jax.Array:
  """(I + L)^-1 for strictly lower-triangular L [..., n, n] (n a power of two).

  Recursive halving instead of a per-row forward substitution (n sequential steps): with the
  inverses A^-1, D^-1 of the two diagonal halves (found together, batched),
      [[A, 0], [X, D]]^-1 = [[A^-1, 0], [-D^-1 X A^-1, D^-1]],
  so log2(n) levels of batched matmuls build the whole inverse.
  """
  n = l_cc.shape[-1]
  if n == 1:
    return jnp.ones_like(l_cc)
  h = n // 2
  halves = unit_lower_inverse(jnp.stack([l_cc[..., :h, :h], l_cc[..., h:, h:]], axis=-3))
  a_inv, d_inv = halves[..., 0, :, :], halves[..., 1, :, :]
  if h <= 4:  # tiny blocks: a multiply-sum beats a batched GEMM call per block on XLA:CPU
    mm = lambda a, b: small_sum(a[..., :, :, None] * b[..., None, :, :], -2)
  else:
    mm = lambda a, b: _dot("...ij,...jk->...ik", a, b)
  low = -mm(mm(d_inv, l_cc[..., h:, :h]), a_inv)
  return jnp.concatenate([jnp.concatenate([a_inv, jnp.zeros_like(low)], -1),
                          jnp.concatenate([low, d_inv], -1)], -2)


class Segments(NamedTuple):
  """Per-chunk segment masks (leading [B, 1] or [N, B, 1], broadcasting over heads).

  A segment start acts like an infinitely strong decay at that token: pairs across it vanish
  (`same`), the entering state reaches only the tokens before the first start in the chunk
  (`first`), only tokens after the last start write the leaving state (`last`), and the carried
  state survives the chunk only if the chunk has no start (`keep`). None = one sequence.
  """
  same: jax.Array   # [..., C, C] bool
  first: jax.Array  # [..., C] bool
  last: jax.Array   # [..., C] bool
  keep: jax.Array   # [...] bool


def chunk_segments(segment_ids: jax.Array | None, length: int, n_chunks: int) -> Segments | None:
  """[B, T] ids -> Segments with leading [N, B, 1] (scanned over N)."""
  if segment_ids is None:
    return None
  B = segment_ids.shape[0]
  starts = segment_starts(segment_ids, B, length)
  starts = jnp.pad(starts, ((0, 0), (0, n_chunks * CHUNK - length)))  # padding continues
  starts = jnp.moveaxis(starts.reshape(B, n_chunks, 1, CHUNK), 1, 0)  # [N, B, 1, C]
  seg = jnp.cumsum(starts, axis=-1)  # segment number inside the chunk
  return Segments(same=seg[..., :, None] == seg[..., None, :], first=seg == 0,
                  last=seg == seg[..., -1:], keep=seg[..., -1] == 0)


@jax.custom_vjp
def unit_lower_solve(l_cc: jax.Array, x_cn: jax.Array) -> jax.Array:
  """(I + L)^-1 X for strictly lower-triangular L [..., C, C] and X [..., C, N].

  The VJP uses the inverse directly (dX = M^T dY, dL = -dX Y^T on the strict lower triangle)
  instead of differentiating through unit_lower_inverse's recursion: same math, a fraction of
  the ops to compile and run.
  """
  return _solve_fwd(l_cc, x_cn)[0]


def _solve_fwd(l_cc, x_cn):
  m = unit_lower_inverse(l_cc)
  y = _dot("...ij,...jn->...in", m, x_cn)
  return y, (m, y)


def _solve_bwd(res, dy):
  m, y = res
  dx = _dot("...ij,...jn->...in", transposed(m), dy)
  dl = -_dot("...in,...jn->...ij", dx, y)
  return jnp.where(np.tril(np.ones(m.shape[-2:], bool), -1), dl, 0), dx


unit_lower_solve.defvjp(_solve_fwd, _solve_bwd)


def to_chunks(x: jax.Array, n_chunks: int) -> jax.Array:
  """[B, T, H, ...] -> [N, B, C, H, ...] (zero-padding T up to N * C), the scan's xs.

  Only B and N swap, so for B = 1 this is a free reshape; the per-chunk H <-> C swap happens on
  small, cached tiles inside the scan body.
  """
  B, T = x.shape[:2]
  if n_chunks * CHUNK != T:
    x = jnp.pad(x, [(0, 0), (0, n_chunks * CHUNK - T)] + [(0, 0)] * (x.ndim - 2))
  return jnp.moveaxis(x.reshape((B, n_chunks, CHUNK) + x.shape[2:]), 1, 0)


def from_chunks(x: jax.Array, length: int) -> jax.Array:
  """[N, B, C, H, ...] -> [B, T, H, ...]; inverse of `to_chunks`."""
  x = jnp.moveaxis(x, 0, 1)
  return x.reshape((x.shape[0], -1) + x.shape[3:])[:, :length]


def heads_major(x: jax.Array) -> jax.Array:
  """One chunk [B, C, H, ...] -> [B, H, C, ...] (and back: it is its own inverse for 4-D)."""
  return jnp.swapaxes(x, 1, 2)


class Intra(NamedTuple):
  """State-independent quantities of one chunk ([B, H, ...]) that meet the state."""
  w: jax.Array      # [.., C, K]  M (beta e^G k): how the entering state is "predicted"
  u: jax.Array      # [.., C, V]  M (beta v)
  qg: jax.Array     # [.., C, K]  q~ e^G: how outputs read the entering state
  kd: jax.Array     # [.., C, K]  k e^{G_last - G}: how tokens write the leaving state
  decay: jax.Array  # [.., K]     e^{G_last}: how the entering state survives the chunk
  aqk: jax.Array    # [.., C, C]  lower-triangular (incl. diagonal) q~.k decayed pairs


def chunk_intra(q, k, v, g, beta, segs: Segments | None, scale: float) -> Intra:
  """q, k, g [..., C, K]; v [..., C, V]; beta [..., C], all in the compute dtype."""
  q = q * scale
  g = jnp.maximum(g, -max_step_decay(g.dtype))
  decays = chunk_decays(g)
  pairs = decayed_pairs(jnp.stack([q, k], axis=-3), k, band_exponents(decays))
  aqk, akk = pairs[..., 0, :, :], pairs[..., 1, :, :]
  eye = np.eye(q.shape[-2], dtype=bool)
  aqk = aqk + jnp.where(eye, jnp.sum(q * k, axis=-1)[..., None], 0)
  akk = beta[..., :, None] * akk
  g_incl, g_to_end = chunk_exponents(decays)                        # G_i, G_last - G_j
  e_g = jnp.exp(g_incl)
  kd = k * jnp.exp(g_to_end)
  decay = e_g[..., -1, :]
  if segs is not None:
    aqk = jnp.where(segs.same, aqk, 0)
    akk = jnp.where(segs.same, akk, 0)
    e_g = jnp.where(segs.first[..., None], e_g, 0)
    kd = jnp.where(segs.last[..., None], kd, 0)
    decay = jnp.where(segs.keep[..., None], decay, 0)
  # W and U in one solve: (I + Akk)^-1 [beta e^G k | beta v].
  wu = unit_lower_solve(akk, beta[..., None] * jnp.concatenate([e_g * k, v], -1))
  K = k.shape[-1]
  return Intra(w=wu[..., :K], u=wu[..., K:], qg=q * e_g, kd=kd, decay=decay, aqk=aqk)


def chunk_apply(intra: Intra, s_kv: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Meet the entering state: returns (o [..., C, V], v' = U - W S, leaving state).

  Matmuls that share an operand are stacked ([W; Qg] S and [Aqk; Kd^T] V'): fewer, taller
  matmuls run markedly faster on XLA:CPU than several [64, .] ones.
  """
  C = intra.w.shape[-2]
  p = _dot("...ck,...kv->...cv", jnp.concatenate([intra.w, intra.qg], -2), s_kv)
  vp = intra.u - p[..., :C, :]
  kd_t = jnp.swapaxes(intra.kd, -1, -2)
  r = _dot("...ij,...jv->...iv", jnp.concatenate([intra.aqk, kd_t], -2), vp)
  o = p[..., C:, :] + r[..., :C, :]
  s_next = intra.decay[..., None] * s_kv + r[..., C:, :]
  return o, vp, s_next


def chunk_inputs(q, k, v, g, beta, segment_ids):
  """Shared set-up of the chunked paths: compute dtype, [N, B, C, H, ...] xs, segment masks."""
  T = q.shape[1]
  dt = compute_dtype(q, k, v, g, beta)
  n = -(-T // CHUNK)
  xs = tuple(to_chunks(x.astype(dt), n) for x in (q, k, v, g, beta))
  return dt, xs, chunk_segments(segment_ids, T, n)
