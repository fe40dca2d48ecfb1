"""Gated Multi-head Latent Attention without positional encoding (SPEC §2.5).

    q   = q_b(RMSNorm_1e-6(q_a(x)))  (or q_proj(x))       [B,T,H, nope+rope]
    c, k_rot = kv_a(x);  c = RMSNorm_1e-6(c)               [B,T,kv_lora], [B,T,rope]
    k   = [k_b(c) | k_rot broadcast over heads];  v = v_b(c)
    o   = softmax_fp32(q k^T / sqrt(nope+rope) + mask) v
    y   = o_proj(o * sigmoid(g_proj(x)))                   (gate: K3 only)

The "rope" dims are never rotated (NoPE). The checkpoint's kv_b_proj is held as two per-head
projections, k_b and v_b, so Per-Head Muon sees K and V as separate blocks without slicing.
Masks: causal, and tokens attend only within their own segment (packing and padding both
travel as segment ids).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import ModelConfig
from k3jax.model.layers import Projection, RMSNorm, wide_dtype


def attention_mask(segment_ids: jax.Array | None, b: int, t: int) -> jax.Array:
  """[B, 1, T, T] bool: causal, and same segment when segment ids are given."""
  causal = jnp.tril(jnp.ones((t, t), bool))[None, None]
  if segment_ids is None:
    return jnp.broadcast_to(causal, (b, 1, t, t))
  same = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
  return causal & same


class MLA(nnx.Module):

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    d, h = cfg.hidden_size, cfg.mla_num_heads
    nope, rope, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    kv = cfg.kv_lora_rank
    self.cfg = cfg
    if cfg.q_lora_rank is not None:
      r = cfg.q_lora_rank
      self.q_a_proj = Projection(cfg, "btd,dr->btr", (d, r), ("embed", "q_lora"),
                                 fan_in=d, rngs=rngs)
      self.q_a_norm = RMSNorm(cfg, r, ("q_lora",), eps=cfg.mla_norm_eps)
      self.q_b_proj = Projection(cfg, "btr,rhk->bthk", (r, h, nope + rope),
                                 ("q_lora", "q_heads", "qk_head_dim"), fan_in=r, rngs=rngs)
    else:
      self.q_proj = Projection(cfg, "btd,dhk->bthk", (d, h, nope + rope),
                               ("embed", "q_heads", "qk_head_dim"), fan_in=d, rngs=rngs)
    self.kv_a_proj = Projection(cfg, "btd,dc->btc", (d, kv + rope), ("embed", "kv_lora"),
                                fan_in=d, rngs=rngs)
    self.kv_a_norm = RMSNorm(cfg, kv, ("kv_lora",), eps=cfg.mla_norm_eps)
    self.k_b_proj = Projection(cfg, "btc,chk->bthk", (kv, h, nope),
                               ("kv_lora", "kv_heads", "qk_nope_dim"), fan_in=kv, rngs=rngs)
    self.v_b_proj = Projection(cfg, "btc,chv->bthv", (kv, h, dv),
                               ("kv_lora", "kv_heads", "head_dim"), fan_in=kv, rngs=rngs)
    if cfg.mla_output_gate:
      self.g_proj = Projection(cfg, "btd,dhv->bthv", (d, h, dv), ("embed", "heads", "head_dim"),
                               fan_in=d, rngs=rngs)
    self.o_proj = Projection(cfg, "bthv,hvd->btd", (h, dv, d), ("heads", "head_dim", "embed"),
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

  def __call__(self, x: jax.Array, *, segment_ids: jax.Array | None = None
               ) -> tuple[jax.Array, jax.Array]:
    """(output [B,T,d], per-head max pre-softmax logit [H]); the latter feeds QK-clip."""
    cfg = self.cfg
    b, t, _ = x.shape
    q = self.query(x)
    q_nope, q_rot = jnp.split(q, [cfg.qk_nope_head_dim], axis=-1)
    c, k_rot = self.latent(x)
    k_nope, v = self.k_b_proj(c), self.v_b_proj(c)
    scores = (jnp.einsum("bqhk,bshk->bhqs", q_nope, k_nope, precision=cfg.precision)
              + jnp.einsum("bqhr,bsr->bhqs", q_rot, k_rot, precision=cfg.precision))
    scores = scores.astype(wide_dtype(scores.dtype)) * cfg.qk_head_dim**-0.5
    scores = jnp.where(attention_mask(segment_ids, b, t), scores, -jnp.inf)
    max_logits_h = jax.lax.stop_gradient(jnp.max(scores, axis=(0, 2, 3)))
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    o = jnp.einsum("bhqs,bshv->bqhv", probs, v, precision=cfg.precision)
    if cfg.mla_output_gate:
      o = o * jax.nn.sigmoid(self.g_proj(x))
    return self.o_proj(o), max_logits_h
