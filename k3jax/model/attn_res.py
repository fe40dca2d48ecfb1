"""Block Attention Residuals (docs/model.md#layer-schedule-and-block-attnres): softmax over depth
instead of a residual sum.

The model carries `blocks` (sealed block representations) and `partial` (running sum of the
current block). Each read point mixes them with one learned pseudo-query per layer:

    V_i   = stack(blocks + [partial])                 # N candidates [N, B, T, d]
    s_i   = sum_d (V_i * rsqrt(mean_d V_i^2 + eps))_d * gamma_d * w_d
    out   = sum_i softmax_i(s)_i * V_i                # values are not normalised

All in fp32 (fp64 when the model is), cast back to the candidates' dtype.

The sealed blocks and the partial are scored and mixed as two terms (one softmax over
[n + 1] scores, its normaliser summed over both) rather than through a concatenated
[n + 1, B, T, d] copy: a read point then only reads the block buffer, and its backward adds
into the buffer's gradient with no split of a concatenation.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import ModelConfig
from k3jax.execution import Execution
from k3jax.model.layers import annotated, ones_param, rms_normalize, wide_dtype


def attn_res(blocks: jax.Array | Sequence[jax.Array], partial: jax.Array, query_d: jax.Array,
             gain_d: jax.Array, eps: float, valid_n: jax.Array | None = None) -> jax.Array:
  """Mix `blocks` ([N-1, B, T, d] or a list of [B, T, d]) and `partial` [B, T, d] with
  pseudo-query `query_d` and norm gain `gain_d`.

  `valid_n` [N] bool masks candidates out of the softmax; it lets the model carry a fixed-size
  block buffer of which only the first few entries are sealed yet.
  """
  wide = wide_dtype(partial.dtype)
  b_nbtd = jnp.asarray(blocks).reshape(-1, *partial.shape).astype(wide)
  p_btd = partial.astype(wide)
  w_d = gain_d.astype(wide) * query_d.astype(wide)
  hi = jax.lax.Precision.HIGHEST
  s_nbt = jnp.einsum("nbtd,d->nbt", rms_normalize(b_nbtd, eps), w_d, precision=hi)
  s_bt = jnp.einsum("btd,d->bt", rms_normalize(p_btd, eps), w_d, precision=hi)
  if valid_n is not None:
    s_nbt = jnp.where(valid_n[:-1, None, None], s_nbt, -jnp.inf)
    s_bt = jnp.where(valid_n[-1], s_bt, -jnp.inf)
  # softmax over the n + 1 candidates; the shift cancels in the ratio (no gradient through it)
  m_bt = jax.lax.stop_gradient(jnp.maximum(jnp.max(s_nbt, axis=0, initial=-jnp.inf), s_bt))
  e_nbt, e_bt = jnp.exp(s_nbt - m_bt), jnp.exp(s_bt - m_bt)
  z_bt = jnp.sum(e_nbt, axis=0) + e_bt
  out_btd = (jnp.einsum("nbt,nbtd->btd", e_nbt / z_bt, b_nbtd, precision=hi)
             + (e_bt / z_bt)[..., None] * p_btd)
  return out_btd.astype(partial.dtype)


class AttnResQuery(nnx.Module):
  """One AttnRes read point: pseudo-query w [d] (`*_res_proj`, zero-initialised so step 0 is
  a uniform average) and norm gain gamma [d] (`*_res_norm`)."""

  def __init__(self, cfg: ModelConfig, ex: Execution):
    self.eps = cfg.rms_norm_eps
    self.proj = annotated(jnp.zeros((cfg.hidden_size,), ex.jnp_param_dtype), ("embed",))
    self.norm = ones_param((cfg.hidden_size,), ("embed",), ex.jnp_param_dtype)

  def __call__(self, blocks: jax.Array | Sequence[jax.Array], partial: jax.Array,
               valid_n: jax.Array | None = None) -> jax.Array:
    return attn_res(blocks, partial, self.proj[...], self.norm[...], self.eps, valid_n)
