"""Causal attention written plainly, with the [T, T] scores: the definition flash attention
(ops.py) is tested against.

    attention(q_bthd, k_bthd, v_bthv, segment_ids_bt=None, *, scale, precision=None)
        -> (o [B, T, H, Dv] in v's dtype, row max [B, H, T])

    o[q] = sum_s softmax_s(scale * q . k[s] + mask[q, s]) v[s]

Masks: causal, and equal segment ids (packing, padding). Scores, softmax and the weighted sum
of v in fp32 (fp64 for float64 inputs). The row max is that of the masked scaled scores (what
QK-clip reads). The same arguments as `flash_attention` but its `block`, which only says how
flash attention walks the scores.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def attention(q_bthd, k_bthd, v_bthv, segment_ids_bt=None, *, scale: float, precision=None):
  b, t = q_bthd.shape[:2]
  wide = jnp.promote_types(q_bthd.dtype, jnp.float32)
  s_bhqk = jnp.einsum("bqhd,bkhd->bhqk", q_bthd, k_bthd, precision=precision,
                      preferred_element_type=wide) * scale
  visible_bqk = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
  if segment_ids_bt is not None:
    visible_bqk = visible_bqk & (segment_ids_bt[:, :, None] == segment_ids_bt[:, None, :])
  s_bhqk = jnp.where(visible_bqk[:, None], s_bhqk, -jnp.inf)
  p_bhqk = jax.nn.softmax(s_bhqk, axis=-1)
  o_bthv = jnp.einsum("bhqk,bkhv->bqhv", p_bhqk, v_bthv.astype(wide), precision=precision)
  return o_bthv.astype(v_bthv.dtype), jnp.max(s_bhqk, axis=-1)
