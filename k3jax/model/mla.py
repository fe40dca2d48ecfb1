"""Gated Multi-head Latent Attention without positional encoding (docs/model.md#gated-mla).

    q   = q_b(RMSNorm_1e-6(q_a(x)))  (or q_proj(x))       [B,T,H, nope+rope]
    c, k_rot = kv_a(x);  c = RMSNorm_1e-6(c)               [B,T,kv_lora], [B,T,rope]
    k   = [k_b(c) | k_rot broadcast over heads];  v = v_b(c)
    o   = softmax_fp32(q k^T / sqrt(nope+rope) + mask) v
    y   = o_proj(o * sigmoid(g_proj(x)))                   (gate: K3 only)

The "rope" dims are never rotated (NoPE). The checkpoint's kv_b_proj is held as two per-head
projections, k_b and v_b, so Per-Head Muon sees K and V as separate blocks without slicing.
Masks: causal, and tokens attend only within their own segment (packing and padding both
travel as segment ids). With the positions split over a `context` mesh axis, the attention runs
over the gathered latents (k3jax/model/mla_parallel.py), whatever `attention` says.

Decoding (docs/inference.md) caches per token only the normalised latent c and k_rot (`latent`), and
`attend_latent` attends over that cache. With k_b / v_b absorbed (the standard MLA inference
form), per head:
    scores = q_nope k_b(c)^T + q_rot k_rot^T = (q_nope k_b^T) c^T + q_rot k_rot^T
    o      = probs v_b(c)                    = (probs c) v_b
the same numbers without expanding the cache to per-head keys and values. Which order is
cheaper depends on how many new tokens T meet how many cached S: absorbed costs
~T*S*(2*kv_lora + rope) per head, expanded ~S*kv_lora*(nope + v) + T*S*(nope + rope + v); a
decode step (T = 1) always absorbs, a long prefill chunk at K3 widths expands.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import ModelConfig
from k3jax.execution import Attention, Execution, Remat
from k3jax.model import mla_parallel, saved_attention
from k3jax.model.layers import Projection, RMSNorm, wide_dtype
from pallas_kernels.flash_attention import flash_attention


def attention_mask(segment_ids: jax.Array | None, b: int, t: int) -> jax.Array:
  """[B, 1, T, T] bool: causal, and same segment when segment ids are given."""
  causal = jnp.tril(jnp.ones((t, t), bool))[None, None]
  if segment_ids is None:
    return jnp.broadcast_to(causal, (b, 1, t, t))
  same = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
  return causal & same


class MLA(nnx.Module):

  def __init__(self, cfg: ModelConfig, ex: Execution, *, rngs: nnx.Rngs):
    d, h = cfg.hidden_size, cfg.mla_num_heads
    nope, rope, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    kv = cfg.kv_lora_rank
    self.cfg, self.ex = cfg, ex
    if cfg.q_lora_rank is not None:
      r = cfg.q_lora_rank
      self.q_a_proj = Projection(ex, "btd,dr->btr", (d, r), ("embed", "q_lora"),
                                 fan_in=d, rngs=rngs)
      self.q_a_norm = RMSNorm(ex, r, ("q_lora",), eps=cfg.mla_norm_eps)
      self.q_b_proj = Projection(ex, "btr,rhk->bthk", (r, h, nope + rope),
                                 ("q_lora", "q_heads", "qk_head_dim"), fan_in=r, rngs=rngs)
    else:
      self.q_proj = Projection(ex, "btd,dhk->bthk", (d, h, nope + rope),
                               ("embed", "q_heads", "qk_head_dim"), fan_in=d, rngs=rngs)
    self.kv_a_proj = Projection(ex, "btd,dc->btc", (d, kv + rope), ("embed", "kv_lora"),
                                fan_in=d, rngs=rngs)
    self.kv_a_norm = RMSNorm(ex, kv, ("kv_lora",), eps=cfg.mla_norm_eps)
    self.k_b_proj = Projection(ex, "btc,chk->bthk", (kv, h, nope),
                               ("kv_lora", "kv_heads", "qk_nope_dim"), fan_in=kv, rngs=rngs)
    self.v_b_proj = Projection(ex, "btc,chv->bthv", (kv, h, dv),
                               ("kv_lora", "kv_heads", "head_dim"), fan_in=kv, rngs=rngs)
    if cfg.mla_output_gate:
      self.g_proj = Projection(ex, "btd,dhv->bthv", (d, h, dv), ("embed", "heads", "head_dim"),
                               fan_in=d, rngs=rngs)
    self.o_proj = Projection(ex, "bthv,hvd->btd", (h, dv, d), ("heads", "head_dim", "embed"),
                             fan_in=h * dv, rngs=rngs)

  def query(self, x: jax.Array) -> jax.Array:
    if self.cfg.q_lora_rank is not None:
      return self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
    return self.q_proj(x)

  def latent(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(normalised c [B,T,kv_lora], k_rot [B,T,rope]): what a decode cache stores per token."""
    ckv = self.kv_a_proj(x)
    c, k_rot = jnp.split(ckv, [self.cfg.kv_lora_rank], axis=-1)
    return self.kv_a_norm(c), k_rot

  def output(self, x: jax.Array, o: jax.Array) -> jax.Array:
    """o_proj(o * sigmoid(g_proj(x))); the sigmoid in fp32 with one rounding, as torch's."""
    if self.cfg.mla_output_gate:
      gate = self.g_proj(x)
      o = o * jax.nn.sigmoid(gate.astype(wide_dtype(gate.dtype))).astype(o.dtype)
    return self.o_proj(o)

  def attend_latent(self, x: jax.Array, c_bsc: jax.Array, rot_bsr: jax.Array,
                    q_pos_t: jax.Array, start_b: jax.Array, *, absorb: bool | None = None,
                    heads_major: tuple[jax.Array, jax.Array] | None = None,
                    key_positions: jax.Array | None = None,
                    merge_axis: str | None = None) -> jax.Array:
    """x [B, T, d] at absolute positions q_pos_t [T] (or [B, T], one row of positions per
    batch row) against a latent cache c [B, S, kv_lora],
    k_rot [B, S, rope] that already holds these tokens at their positions. Row b's real tokens
    start at start_b[b] (left padding): keys before it are masked, except that a pad query sees
    itself (so no softmax row is empty). `absorb` None picks the cheaper order.
    `heads_major`: k_b as [H, nope, kv_lora] and v_b as [H, kv_lora, v] (`heads_major_kv_b`),
    the layout a per-head matmul reads without transposing the weights every step.
    `key_positions` [S]: the cache's positions (default 0..S-1). `merge_axis`: this device holds
    only some of the keys (a request's pages split over that manual mesh axis): the softmax
    runs over the keys of every device along it, its maximum a pmax and its sums psums (the
    partial results merged as log-sum-exp would merge them)."""
    cfg = self.cfg
    b, t, _ = x.shape
    s = c_bsc.shape[1]
    if absorb is None:
      absorb = absorbed_is_cheaper(cfg, t, s)
    q_nope, q_rot = jnp.split(self.query(x), [cfg.qk_nope_head_dim], axis=-1)
    dt, prec = q_nope.dtype, self.ex.precision
    c_bsc, rot_bsr = c_bsc.astype(dt), rot_bsr.astype(dt)
    # Scores are laid out key-major [B, S, T, H]: the cache is then the row-major left operand
    # of both products, read as stored (a [B, H, T, S] layout makes XLA transpose the whole
    # cache every step: docs/benchmarks.md#decode).
    k_b_hkc, v_b_hcv = heads_major or heads_major_kv_b(self)
    if absorb:
      q_lat = jnp.einsum("bthk,hkc->bthc", q_nope, k_b_hkc.astype(dt), precision=prec)
      scores = jnp.einsum("bsc,bthc->bsth", c_bsc, q_lat, precision=prec)
    else:
      scores = jnp.einsum("bshk,bthk->bsth", self.k_b_proj(c_bsc), q_nope, precision=prec)
    scores = scores + jnp.einsum("bsr,bthr->bsth", rot_bsr, q_rot, precision=prec)
    scores = scores.astype(wide_dtype(scores.dtype)) * cfg.qk_head_dim**-0.5
    key_s = (jnp.arange(s) if key_positions is None else key_positions)[None, :, None]
    q_pos = q_pos_t[None, None, :] if q_pos_t.ndim == 1 else q_pos_t[:, None, :]
    visible = (key_s <= q_pos) & ((key_s >= start_b[:, None, None]) | (key_s == q_pos))
    scores = jnp.where(visible[..., None], scores, -jnp.inf)   # [B, S, T, H]
    if merge_axis is None:
      probs, total = jax.nn.softmax(scores, axis=1).astype(dt), None
    else:  # exp(s - max) with the max over every device's keys; normalised after the psum
      m = jax.lax.pmax(jax.lax.stop_gradient(jnp.max(scores, axis=1)), merge_axis)
      probs = jnp.exp(scores - jnp.where(jnp.isfinite(m), m, 0.0)[:, None])
      total = jax.lax.psum(jnp.sum(probs, axis=1), merge_axis)[..., None]   # [B, T, H, 1]
      probs = probs.astype(dt)
    if absorb:
      o_lat = jnp.einsum("bsth,bsc->bthc", probs, c_bsc, precision=prec)
      if total is not None:
        o_lat = (jax.lax.psum(o_lat, merge_axis) / total).astype(dt)
      o = jnp.einsum("bthc,hcv->bthv", o_lat, v_b_hcv.astype(dt), precision=prec)
    else:
      o = jnp.einsum("bsth,bshv->bthv", probs, self.v_b_proj(c_bsc), precision=prec)
      if total is not None:
        o = (jax.lax.psum(o, merge_axis) / total).astype(dt)
    return self.output(x, o)

  def _attend(self, run):
    """(o, row max) of a flash kernel call; under save-attention remat kept for the backward."""
    return saved_attention.attend(run) if self.ex.remat == Remat.SAVE_ATTENTION else run()

  def __call__(self, x: jax.Array, *, segment_ids: jax.Array | None = None
               ) -> tuple[jax.Array, jax.Array]:
    """(output [B,T,d], per-head max pre-softmax logit [H]); the latter feeds QK-clip."""
    cfg, ex = self.cfg, self.ex
    b, t, _ = x.shape
    q = self.query(x)
    q_nope, q_rot = jnp.split(q, [cfg.qk_nope_head_dim], axis=-1)
    c, k_rot = self.latent(x)
    if mla_parallel.split_spec(q) is not None:  # positions split over `context`
      dt = q.dtype
      o, row_max = self._attend(functools.partial(
          mla_parallel.attention, q_nope, q_rot, c.astype(dt), k_rot.astype(dt),
          self.k_b_proj.weight().astype(dt), self.v_b_proj.weight().astype(dt), segment_ids,
          scale=cfg.qk_head_dim**-0.5, block=ex.attention_block, precision=ex.precision))
      max_logits_h = jax.lax.stop_gradient(jnp.max(row_max, axis=(0, 2)))
      return self.output(x, o), max_logits_h
    k_nope, v = self.k_b_proj(c), self.v_b_proj(c)
    if ex.attention == Attention.FLASH:  # the same numbers without the [T, T] scores
      k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rot[:, :, None], (*k_nope.shape[:3],
                                                                       k_rot.shape[-1]))], -1)
      o, row_max = self._attend(functools.partial(
          flash_attention, q, k, v, segment_ids, scale=cfg.qk_head_dim**-0.5,
          block=ex.attention_block, precision=ex.precision))
      max_logits_h = jax.lax.stop_gradient(jnp.max(row_max, axis=(0, 2)))
      return self.output(x, o), max_logits_h
    scores = (jnp.einsum("bqhk,bshk->bhqs", q_nope, k_nope, precision=ex.precision)
              + jnp.einsum("bqhr,bsr->bhqs", q_rot, k_rot, precision=ex.precision))
    scores = scores.astype(wide_dtype(scores.dtype)) * cfg.qk_head_dim**-0.5
    scores = jnp.where(attention_mask(segment_ids, b, t), scores, -jnp.inf)
    max_logits_h = jax.lax.stop_gradient(jnp.max(scores, axis=(0, 2, 3)))
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    o = jnp.einsum("bhqs,bshv->bqhv", probs, v, precision=ex.precision)
    return self.output(x, o), max_logits_h


def absorbed_is_cheaper(cfg: ModelConfig, t: int, s: int) -> bool:
  """Multiply-adds per head of T queries against S cached tokens: absorbed vs expanded."""
  kv, rope = cfg.kv_lora_rank, cfg.qk_rope_head_dim
  nope, dv = cfg.qk_nope_head_dim, cfg.v_head_dim
  absorbed = t * s * (2 * kv + rope) + t * kv * (nope + dv)
  expanded = s * kv * (nope + dv) + t * s * (nope + rope + dv)
  return absorbed <= expanded


def heads_major_kv_b(mla: MLA) -> tuple[jax.Array, jax.Array]:
  """(k_b [H, nope, kv_lora], v_b [H, kv_lora, v]): the absorbed products' weights with the
  head axis first, as a batched matmul over heads reads them. LoRA adapters on k_b / v_b are
  folded in (the products never call the projections)."""
  return (jnp.transpose(mla.k_b_proj.weight(), (1, 2, 0)),
          jnp.transpose(mla.v_b_proj.weight(), (1, 0, 2)))
