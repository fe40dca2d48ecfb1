"""Kimi Delta Attention in plain jnp (docs/kernels.md#kda-op): the definition every KDA backend is
checked against, written to be read. Nothing here is tuned for speed (xla_cpu.py is the fast jnp
backend; tpu.py / gpu.py are the Pallas kernels).

Shapes: q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H, K] (log decay, <= 0); beta [B, T, H];
state [B, H, K, V]. The recurrence per head, with S the state:

    S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T
    o_t = S_t^T (scale * q_t)                                  # read after the update

`naive_kda` runs it token by token; `chunk_kda` computes the same in chunks of C = 64 tokens
(the form the kernels use); `kda_step` is one decode token.

Math runs in float32 (float64 when the inputs are float64); `o` is returned in v's dtype and the
final state in the compute dtype. `segment_ids` [B, T] marks packed sequences: wherever the id
changes the state restarts from zero, so no token sees another sequence. `initial_state` belongs
to the first segment only.

Raw inputs (docs/kernels.md#raw-inputs): every backend takes `raw: RawInputs` (static: which
transforms) and the gate's parameters A_log [H], dt_bias [H, K] (arrays, differentiated) beside it,
applied by `prepare_inputs` in float32 (float64 for float64 inputs):
  use_qk_l2norm       q, k := x * rsqrt(sum_k x^2 + l2norm_eps)
  use_beta_sigmoid    beta := sigmoid(beta)
  gate="lower_bound"  g := lower_bound * sigmoid(exp(A_log[h]) * (g + dt_bias[h]))   (K3)
  gate="softplus"     g := -exp(A_log[h]) * softplus(g + dt_bias[h])                (Kimi-Linear)
"""

from __future__ import annotations

import dataclasses
import enum

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.vma import vary_like

CHUNK = 64


class Gate(enum.StrEnum):
  """The decay gate's form (module docstring); None: g arrives as the log decay itself."""
  LOWER_BOUND = "lower_bound"  # K3
  SOFTPLUS = "softplus"        # Kimi-Linear


GATES = (None, *(gate.value for gate in Gate))


@dataclasses.dataclass(frozen=True)
class RawInputs:
  """Which raw-input transforms the op applies before the recurrence (module docstring).

  Static (hashable: a jit static argument, a kernel's compile-time choice). The gate's
  parameters A_log and dt_bias are not in here: they are arrays, differentiated and sharded like
  any operand, so they travel beside the bundle as arguments of their own. `RawInputs()`
  (`PREPARED`) means q, k, g, beta arrive prepared.
  """
  gate: Gate | None = None  # or its string, "lower_bound" / "softplus"
  lower_bound: float | None = None  # the lower-bound gate's bound (K3: -5)
  use_qk_l2norm: bool = False
  l2norm_eps: float = 1e-6
  use_beta_sigmoid: bool = False

  def __post_init__(self):
    if self.gate not in GATES:
      raise ValueError(f"unknown gate {self.gate!r}; expected one of {GATES}")
    if self.gate is not None:
      object.__setattr__(self, "gate", Gate(self.gate))
    if self.gate == Gate.LOWER_BOUND and self.lower_bound is None:
      raise ValueError('gate="lower_bound" needs lower_bound (K3 uses -5)')

  def check(self, g: jax.Array, A_log: jax.Array | None, dt_bias: jax.Array | None) -> None:
    """The gate's parameters fit g [..., H, K] (prepare_inputs and the in-kernel gate read
    them alike)."""
    if self.gate is None:
      return
    H, K = g.shape[-2:]
    if A_log is None:
      raise ValueError(f"gate={self.gate.value!r} needs A_log (one value per head)")
    if A_log.size != H:
      raise ValueError(f"A_log must hold one value per head ({H}), got shape {A_log.shape}")
    if dt_bias is not None and dt_bias.size != H * K:
      raise ValueError(f"dt_bias must have H*K = {H * K} values, got shape {dt_bias.shape}")


PREPARED = RawInputs()


def compute_dtype(*xs: jax.Array) -> jnp.dtype:
  """float32 unless an input is float64: the state is too sensitive for bf16 accumulation."""
  return jnp.result_type(jnp.float32, *(x.dtype for x in xs))


def segment_starts(segment_ids: jax.Array | None, batch: int, length: int) -> jax.Array:
  """[B, T] bool, True where a new packed sequence starts (position 0 excluded)."""
  if segment_ids is None:
    return jnp.zeros((batch, length), bool)
  prev = jnp.pad(segment_ids[:, :-1], ((0, 0), (1, 0)), constant_values=0)
  first = jnp.arange(length)[None, :] == 0
  return (segment_ids != prev) & ~first


def start_state(initial_state, shape, dt, *like: jax.Array) -> jax.Array:
  """The state entering the first token: `initial_state` (or zeros) in `dt`, varying like the
  operands `like` (`vary_like`), as a scan carry must keep one type."""
  s0 = jnp.zeros(shape, dt) if initial_state is None else initial_state.astype(dt)
  return vary_like(s0, *like)


def prepare_inputs(q, k, g, beta, *, A_log=None, dt_bias=None, raw: RawInputs = PREPARED):
  """Raw inputs -> core inputs (g = log decay, beta in (0, 1), q/k unit-norm if asked).

  Everything runs in float32 (float64 when an input is float64); untouched inputs keep their
  dtype. Plain jnp, so JAX differentiates it, including into A_log and dt_bias.
  """
  raw.check(g, A_log, dt_bias)
  wide = lambda *xs: jnp.result_type(jnp.float32, *(x.dtype for x in xs if x is not None))
  if raw.use_qk_l2norm:
    def l2norm(x):
      x = x.astype(wide(x))
      return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + raw.l2norm_eps)
    q, k = l2norm(q), l2norm(k)
  if raw.use_beta_sigmoid:
    beta = jax.nn.sigmoid(beta.astype(wide(beta)))
  if raw.gate is not None:
    H, K = g.shape[-2:]
    dt = wide(g, A_log, dt_bias)
    a_h1 = jnp.exp(A_log.astype(dt).reshape(H, 1))
    x = g.astype(dt)
    if dt_bias is not None:
      x = x + dt_bias.astype(dt).reshape(H, K)
    if raw.gate == Gate.LOWER_BOUND:
      g = raw.lower_bound * jax.nn.sigmoid(a_h1 * x)
    else:
      g = -a_h1 * jax.nn.softplus(x)
  return q, k, g, beta


def _begin(q, k, v, g, beta, scale, initial_state, A_log, dt_bias, raw):
  """What both references start with: the prepared inputs, the compute dtype, the scale and
  the state entering the first token."""
  q, k, g, beta = prepare_inputs(q, k, g, beta, A_log=A_log, dt_bias=dt_bias, raw=raw)
  B, _, H, K = q.shape
  dt = compute_dtype(q, k, v, g, beta)
  s0 = start_state(initial_state, (B, H, K, v.shape[-1]), dt, q, k, v, g, beta)
  return (q, k, g, beta), dt, K**-0.5 if scale is None else scale, s0


def naive_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
              segment_ids=None, A_log=None, dt_bias=None, raw: RawInputs = PREPARED):
  """Token-by-token recurrence. Slow to differentiate; the readable definition of KDA.
  Returns (o [B, T, H, V] in v's dtype, final state [B, H, K, V] or None)."""
  (q, k, g, beta), dt, scale, s0 = _begin(q, k, v, g, beta, scale, initial_state, A_log,
                                          dt_bias, raw)
  B, T = q.shape[:2]
  reset = segment_starts(segment_ids, B, T)

  def step(s_bhkv, xs):
    q_bhk, k_bhk, v_bhv, g_bhk, beta_bh, reset_b = xs
    s_bhkv = jnp.where(reset_b[:, None, None, None], 0.0, s_bhkv)
    s_bhkv = s_bhkv * jnp.exp(g_bhk)[..., None]
    pred_bhv = jnp.einsum("bhk,bhkv->bhv", k_bhk, s_bhkv)
    delta_bhv = beta_bh[..., None] * (v_bhv - pred_bhv)
    s_bhkv = s_bhkv + k_bhk[..., None] * delta_bhv[:, :, None, :]
    o_bhv = jnp.einsum("bhk,bhkv->bhv", q_bhk * scale, s_bhkv)
    return s_bhkv, o_bhv

  time_major = lambda x: jnp.moveaxis(x.astype(dt), 1, 0)
  xs = tuple(map(time_major, (q, k, v, g, beta))) + (jnp.moveaxis(reset, 1, 0),)
  s_final, o_tbhv = jax.lax.scan(step, s0, xs)
  o = jnp.moveaxis(o_tbhv, 0, 1).astype(v.dtype)
  return o, (s_final if output_final_state else None)


def kda_step(q, k, v, g, beta, state, *, scale=None):
  """One decode token: q, k, g [B, H, K]; v [B, H, V]; beta [B, H]; state [B, H, K, V].

  Returns (o [B, H, V] in v's dtype, new state in the compute dtype). Same update as one step
  of `naive_kda`, kept separate so decoding does not pay for a scan of length 1.
  """
  dt = compute_dtype(q, k, v, g, beta)
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  q, k, v, g, beta = (x.astype(dt) for x in (q, k, v, g, beta))
  s_bhkv = state.astype(dt) * jnp.exp(g)[..., None]
  pred_bhv = jnp.einsum("bhk,bhkv->bhv", k, s_bhkv)
  delta_bhv = beta[..., None] * (v - pred_bhv)
  s_bhkv = s_bhkv + k[..., None] * delta_bhv[:, :, None, :]
  o_bhv = jnp.einsum("bhk,bhkv->bhv", q * scale, s_bhkv)
  return o_bhv.astype(v.dtype), s_bhkv


def segment_sums(g_nck):
  """[..., C, K] -> [..., C, C, K]: entry [i, j] = sum of g over tokens (j, i] (0 for i = j),
  -inf above the diagonal, so that exp() of it is the decay from token j to token i.

  Each entry is a sum of its own tokens, never a difference G_i - G_j of two cumsums from the
  chunk start: with the -5 lower bound G reaches -320, where float32 rounding of G alone
  (ulp(320) ~ 3e-5) would be a relative error of every decay factor.
  """
  C = g_nck.shape[-2]
  t, j = np.arange(C)[:, None], np.arange(C)[None, :]
  terms = jnp.where((t > j)[:, :, None], g_nck[..., :, None, :], 0.0)  # [.., t, j, K] = g_t
  sums = jnp.cumsum(terms, axis=-3)                                   # [.., i, j, K]
  return jnp.where((t >= j)[:, :, None], sums, -jnp.inf)


def chunk_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
              segment_ids=None, A_log=None, dt_bias=None, raw: RawInputs = PREPARED):
  """The chunked form (C = 64, any T; docs/kernels.md#kda-chunked-form), same contract as
  `naive_kda`.

  Per chunk of C tokens, with D[i, j] = exp(sum of g over (j, i]) (per feature; `segment_sums`),
  S the state entering the chunk and q~ = scale q:
      A_kk[i, j] = beta_i sum_c k_ic k_jc D_ijc        j < i
      A_qk[i, j] = sum_c q~_ic k_jc D_ijc              j <= i
      T = (I + A_kk)^-1 Diag(beta);   W = T (D_0 * k);   U = T v      (D_0[i] = D[i, start])
      V' = U - W S;   O = (q~ * D_0) S + A_qk V'
      S <- D_0[last] * S + (k * D_end)^T V'                          (D_end[j] = D[last, j])
  where D_0[i] = exp(sum of g over [0, i]) decays from the chunk start and D_end[j] from
  token j to the chunk end. A segment start is a token whose g is -inf: every decay across it
  is 0, so the state restarts there, exactly as in the recurrence.
  """
  (q, k, g, beta), dt, scale, s0 = _begin(q, k, v, g, beta, scale, initial_state, A_log,
                                          dt_bias, raw)
  B, T, H, K = q.shape
  V = v.shape[-1]
  g = jnp.where(segment_starts(segment_ids, B, T)[:, :, None, None], -jnp.inf, g.astype(dt))

  # [B, T, H, .] -> [B, H, N, C, .], zero-padding T (padded tokens neither read nor write)
  N = -(-T // CHUNK)
  def chunks(x):
    x = jnp.pad(x.astype(dt), [(0, 0), (0, N * CHUNK - T)] + [(0, 0)] * (x.ndim - 2))
    return jnp.moveaxis(x.reshape((B, N, CHUNK) + x.shape[2:]), 3, 1)
  q, k, v, g, beta = map(chunks, (q, k, v, g, beta))

  D = jnp.exp(segment_sums(g))                               # [B, H, N, C, C, K]
  D0 = jnp.exp(jnp.cumsum(g, axis=-2))                       # [B, H, N, C, K]
  D_end = D[..., -1, :, :]                                   # [B, H, N, C, K]
  eye = jnp.eye(CHUNK, dtype=dt)
  strictly_lower = jnp.tri(CHUNK, k=-1, dtype=dt)
  A_kk = beta[..., None] * jnp.einsum("...ic,...jc,...ijc->...ij", k, k, D) * strictly_lower
  A_qk = jnp.einsum("...ic,...jc,...ijc->...ij", q * scale, k, D)
  solve = lambda rhs: jax.scipy.linalg.solve_triangular(eye + A_kk, rhs, lower=True)
  W = solve(beta[..., None] * D0 * k)                        # [B, H, N, C, K]
  U = solve(beta[..., None] * v)                             # [B, H, N, C, V]

  def chunk_step(s, xs):                                     # s [B, H, K, V]
    W, U, qD0, A_qk, kD_end, decay = xs
    v_new = U - jnp.einsum("bhck,bhkv->bhcv", W, s)
    o = jnp.einsum("bhck,bhkv->bhcv", qD0, s) + jnp.einsum("bhij,bhjv->bhiv", A_qk, v_new)
    s = decay[..., None] * s + jnp.einsum("bhck,bhcv->bhkv", kD_end, v_new)
    return s, o

  chunk_major = lambda x: jnp.moveaxis(x, 2, 0)
  xs = tuple(map(chunk_major, (W, U, q * scale * D0, A_qk, k * D_end, D0[..., -1, :])))
  s_final, o = jax.lax.scan(chunk_step, s0, xs)              # o [N, B, H, C, V]
  o = jnp.moveaxis(o, 0, 2).reshape(B, H, N * CHUNK, V)[:, :, :T]
  return jnp.moveaxis(o, 1, 2).astype(v.dtype), (s_final if output_final_state else None)
