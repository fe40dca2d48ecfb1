"""Kimi Delta Attention layer (docs/model.md#kda-layer): projections, short convs, gates, the KDA
op, output.

    q, k, v = silu(conv(x W_q)), silu(conv(x W_k)), silu(conv(x W_v))        [B,T,H,K|V]
    g    = lb * sigmoid(exp(A_h) * (x W_fa W_fb + dt_bias))      (K3; fp32)
         = -exp(A_h) * softplus(x W_fa W_fb + dt_bias)           (Kimi-Linear)
    beta = sigmoid(x W_b)
    o    = KDA(l2norm(q), l2norm(k), v, g, beta)
    y    = W_o[ RMSNorm_head(o) * o_norm * sigmoid(gate(x)) ]

The gate, beta sigmoid and q/k l2norm are handed to the op as raw inputs so a kernel can fuse
them. The conv is causal and depthwise (weights [H, K, taps], the last tap on the current
token) and does not read across packed-sequence boundaries. `KDAState` carries what decoding
needs: the last taps-1 projected inputs of q, k, v and the recurrent state [B, H, K, V] fp32.

Decoding (docs/inference.md): with a state, a chunk of any length continues it through the chunked
op; one token (T = 1) takes the fused single-step path `kda_step` instead (Pallas on TPU/GPU),
never the chunked op padded to 64. `token_mask` [B, T] marks positions that are not part of
the row's sequence: left padding (a static batch's shorter prompts), right padding (a serving
engine's prefill chunk shorter than its row, a decode row with no request). A masked token
changes nothing: its projected q, k, v are zeroed before the conv (so the conv reads zeros
there exactly as it reads the zero left edge of an unpadded row), its log decay and beta are
zeroed (so the state passes through it unchanged, exp(0) = 1 and k = v = 0 add nothing), and
the conv tail returned is the one after the row's last unmasked token.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.config import ModelConfig
from k3jax.execution import Execution
from k3jax.model import kda_parallel
from k3jax.model.layers import Projection, make_param, ones_param, rms_normalize, wide_dtype
from pallas_kernels.kda import ops as kda_ops
from pallas_kernels.kda.ops import RawInputs, prepare_inputs
from pallas_kernels.kda.reference import PREPARED


class KDAState(NamedTuple):
  conv_q: jax.Array     # [B, taps-1, H, K] last projected inputs, oldest first
  conv_k: jax.Array     # [B, taps-1, H, K]
  conv_v: jax.Array     # [B, taps-1, H, V]
  recurrent: jax.Array  # [B, H, K, V] fp32


def causal_conv(x_bthc: jax.Array, w_hct: jax.Array, tail: jax.Array | None,
                segment_ids: jax.Array | None, tail_segment_ids: jax.Array | None = None
                ) -> tuple[jax.Array, jax.Array]:
  """Depthwise causal conv over time as a sum of shifted taps; returns (y, new tail).

  Written as taps-many shifted multiplies rather than lax.conv: with 4 taps this is what XLA
  fuses best, and the segment mask is one compare per tap. The tail (the taps-1 inputs before
  x) belongs to x's first segment unless `tail_segment_ids` [B, taps-1] say otherwise (the
  previous device's positions under context parallelism).
  """
  taps = w_hct.shape[-1]
  b, t = x_bthc.shape[:2]
  if tail is None:
    tail = jnp.zeros((b, taps - 1, *x_bthc.shape[2:]), x_bthc.dtype)
  full = jnp.concatenate([tail.astype(x_bthc.dtype), x_bthc], axis=1)   # [B, taps-1+T, H, C]
  if segment_ids is not None:
    if tail_segment_ids is None:
      tail_segment_ids = jnp.repeat(segment_ids[:, :1], taps - 1, axis=1)
    seg_full = jnp.concatenate([tail_segment_ids.astype(segment_ids.dtype), segment_ids], 1)
  y = jnp.zeros_like(x_bthc)
  for j in range(taps):  # tap j reads the token (taps-1-j) steps back
    shifted = jax.lax.dynamic_slice_in_dim(full, j, t, axis=1)
    if segment_ids is not None:
      same = jax.lax.dynamic_slice_in_dim(seg_full, j, t, axis=1) == segment_ids
      shifted = jnp.where(same[..., None, None], shifted, 0)
    y = y + shifted * w_hct[..., j].astype(x_bthc.dtype)
  return y, full[:, t:]


class KDA(nnx.Module):

  def __init__(self, cfg: ModelConfig, ex: Execution, *, rngs: nnx.Rngs):
    d, h, k = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim
    taps = cfg.conv_kernel_size
    wide = wide_dtype(ex.jnp_param_dtype)  # the checkpoint's F32 exceptions never drop below fp32
    self.cfg, self.ex = cfg, ex
    self.q_proj = Projection(ex, "btd,dhk->bthk", (d, h, k), ("embed", "q_heads", "head_dim"),
                             fan_in=d, rngs=rngs)
    self.k_proj = Projection(ex, "btd,dhk->bthk", (d, h, k), ("embed", "kv_heads", "head_dim"),
                             fan_in=d, rngs=rngs)
    self.v_proj = Projection(ex, "btd,dhk->bthk", (d, h, k), ("embed", "kv_heads", "head_dim"),
                             fan_in=d, rngs=rngs)
    conv_init = _symmetric_uniform(1 / np.sqrt(taps))  # torch Conv1d's default bound
    self.q_conv = make_param(rngs, conv_init, (h, k, taps), ("heads", "head_dim", "conv"), wide)
    self.k_conv = make_param(rngs, conv_init, (h, k, taps), ("heads", "head_dim", "conv"), wide)
    self.v_conv = make_param(rngs, conv_init, (h, k, taps), ("heads", "head_dim", "conv"), wide)
    self.f_a_proj = Projection(ex, "btd,dr->btr", (d, k), ("embed", "gate_rank"),
                               fan_in=d, rngs=rngs)
    self.f_b_proj = Projection(ex, "btr,rhk->bthk", (k, h, k), ("gate_rank", "heads", "head_dim"),
                               fan_in=k, rngs=rngs)
    # A in [1, 16] and dt in [1e-3, 0.1] as the official initialisers draw them.
    self.A_log = make_param(rngs, _uniform_log(1.0, 16.0), (h,), ("heads",), wide)
    self.dt_bias = make_param(rngs, _inverse_softplus_dt, (h, k), ("heads", "head_dim"), wide)
    self.b_proj = Projection(ex, "btd,dh->bth", (d, h), ("embed", "heads"), fan_in=d, rngs=rngs)
    if cfg.kda_full_rank_output_gate:
      self.g_proj = Projection(ex, "btd,dhv->bthv", (d, h, k), ("embed", "heads", "head_dim"),
                               fan_in=d, rngs=rngs)
    else:
      self.g_a_proj = Projection(ex, "btd,dr->btr", (d, k), ("embed", "gate_rank"),
                                 fan_in=d, rngs=rngs)
      self.g_b_proj = Projection(ex, "btr,rhv->bthv", (k, h, k),
                                 ("gate_rank", "heads", "head_dim"), fan_in=k, rngs=rngs)
    self.o_norm = ones_param((k,), ("head_dim",), wide)
    self.o_proj = Projection(ex, "bthv,hvd->btd", (h, k, d), ("heads", "head_dim", "embed"),
                             fan_in=h * k, rngs=rngs)

  def output_gate(self, x: jax.Array) -> jax.Array:
    if self.cfg.kda_full_rank_output_gate:
      return self.g_proj(x)
    return self.g_b_proj(self.g_a_proj(x))

  def __call__(self, x: jax.Array, *, segment_ids: jax.Array | None = None,
               state: KDAState | None = None, token_mask: jax.Array | None = None
               ) -> tuple[jax.Array, KDAState]:
    """x [B, T, d] -> (y [B, T, d], state after the last token). `state` continues a
    sequence; `token_mask` [B, T] bool is False at positions outside the row's sequence
    (padding on either side; see the module doc)."""
    cfg = self.cfg
    wide = wide_dtype(x.dtype)
    convs = []
    for proj, w, tail in ((self.q_proj, self.q_conv, None if state is None else state.conv_q),
                          (self.k_proj, self.k_conv, None if state is None else state.conv_k),
                          (self.v_proj, self.v_conv, None if state is None else state.conv_v)):
      u = proj(x)
      if token_mask is not None:
        u = jnp.where(token_mask[..., None, None], u, jnp.zeros((), u.dtype))
      # fp32 taps and silu, one rounding at the end, as the official conv1d + silu compute
      # them in bf16 (per-tap bf16 rounding would be a second, avoidable noise source)
      y, new_tail = kda_parallel.causal_conv(causal_conv, u.astype(wide), w[...], tail,
                                             segment_ids)
      convs.append((jax.nn.silu(y).astype(u.dtype), new_tail.astype(u.dtype),
                    _with_tail(u, tail, w.shape[-1])))
    (q, tq, _), (k, tk, _), (v, tv, _) = convs
    g, beta = self.f_b_proj(self.f_a_proj(x)).astype(wide), self.b_proj(x).astype(wide)
    gate_params = dict(A_log=self.A_log[...].astype(wide), dt_bias=self.dt_bias[...].astype(wide))
    raw = RawInputs(gate=cfg.kda_gate, lower_bound=cfg.gate_lower_bound, use_qk_l2norm=True,
                    l2norm_eps=cfg.l2norm_eps, use_beta_sigmoid=True)
    if token_mask is not None:
      # masked tokens must leave the state as it is: prepare the gate here and zero their log
      # decay and beta (the raw gate of a masked token is not zero decay), and keep the conv
      # tail of the last real token
      q, k, g, beta = prepare_inputs(q, k, g, beta, **gate_params, raw=raw)
      g = jnp.where(token_mask[..., None, None], g, jnp.zeros((), g.dtype))
      beta = jnp.where(token_mask[..., None], beta, jnp.zeros((), beta.dtype))
      gate_params, raw = {}, PREPARED
      ends = _last_real(token_mask)
      tq, tk, tv = (_tail_at(full, ends, taps=self.q_conv.shape[-1]) for _, _, full in convs)
    if state is not None and x.shape[1] == 1 and segment_ids is None:
      # one decode token: the fused step on prepared inputs (unit q/k, log decay, beta)
      q, k, g, beta = prepare_inputs(q, k, g, beta, **gate_params, raw=raw)
      o, s_final = kda_parallel.kda_step(kda_ops.kda_step, q[:, 0], k[:, 0], v[:, 0], g[:, 0],
                                         beta[:, 0], state.recurrent,
                                         backend=self.ex.kda_backend)
      o = o[:, None]
    else:
      # per shard on a mesh: a Pallas kernel only lowers on its local rows and heads
      o, s_final = kda_parallel.kda(kda_ops.kda, q, k, v, g, beta, **gate_params, raw=raw,
                                     initial_state=None if state is None else state.recurrent,
                                     output_final_state=True, segment_ids=segment_ids,
                                     backend=self.ex.kda_backend)
    # FusedRMSNormGated: the gain and the gate multiply in fp32, one cast at the end.
    gate = jax.nn.sigmoid(self.output_gate(x).astype(wide))
    o = (rms_normalize(o, cfg.rms_norm_eps) * self.o_norm[...].astype(wide) * gate).astype(o.dtype)
    return self.o_proj(o), KDAState(tq, tk, tv, s_final)


def _with_tail(u_bthc: jax.Array, tail: jax.Array | None, taps: int) -> jax.Array:
  """[B, taps-1+T, H, C]: the conv's input with the previous tail in front (zeros if none)."""
  if tail is None:
    tail = jnp.zeros((u_bthc.shape[0], taps - 1, *u_bthc.shape[2:]), u_bthc.dtype)
  return jnp.concatenate([tail.astype(u_bthc.dtype), u_bthc], axis=1)


def _last_real(token_mask_bt: jax.Array) -> jax.Array:
  """[B] int32: one past the last unmasked position of each row (0 when none is)."""
  t = token_mask_bt.shape[1]
  return jnp.max(jnp.where(token_mask_bt, jnp.arange(1, t + 1), 0), axis=1).astype(jnp.int32)


def _tail_at(full_bshc: jax.Array, ends_b: jax.Array, *, taps: int) -> jax.Array:
  """The taps-1 conv inputs before position ends_b[b] of each row (full: tail + inputs)."""
  take = lambda row, end: jax.lax.dynamic_slice_in_dim(row, end, taps - 1, axis=0)
  return jax.vmap(take)(full_bshc, ends_b)


def initial_state(cfg: ModelConfig, ex: Execution, batch: int) -> KDAState:
  """The state of an empty sequence: zero conv tails (compute dtype) and a zero fp32 state
  (float64 when the model computes in float64)."""
  dt = ex.jnp_dtype
  h, k, taps = cfg.kda_num_heads, cfg.kda_head_dim, cfg.conv_kernel_size
  tail = jnp.zeros((batch, taps - 1, h, k), dt)
  return KDAState(tail, tail, tail, jnp.zeros((batch, h, k, k), wide_dtype(dt)))


def _symmetric_uniform(bound: float):
  def init(key, shape, dtype):
    return jax.random.uniform(key, shape, jnp.float32, -bound, bound).astype(dtype)
  return init


def _uniform_log(lo: float, hi: float):
  def init(key, shape, dtype):
    return jnp.log(jax.random.uniform(key, shape, jnp.float32, lo, hi)).astype(dtype)
  return init


def _inverse_softplus_dt(key, shape, dtype, lo=1e-3, hi=0.1):
  dt = jnp.exp(jax.random.uniform(key, shape, jnp.float32, np.log(lo), np.log(hi)))
  return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)
