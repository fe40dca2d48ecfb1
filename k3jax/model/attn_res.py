"""Block Attention Residuals (SPEC §2.2): softmax over depth instead of a residual sum.

The model carries `blocks` (sealed block representations) and `partial` (running sum of the
current block). Each read point mixes them with one learned pseudo-query per layer:

    V_i   = stack(blocks + [partial])                 # N candidates [N, B, T, d]
    s_i   = sum_d (V_i * rsqrt(mean_d V_i^2 + eps))_d * gamma_d * w_d
    out   = sum_i softmax_i(s)_i * V_i                # values are not normalised

All in fp32 (fp64 when the model is), cast back to the candidates' dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import ModelConfig
from k3jax.model.layers import annotated, ones_param, rms_normalize, wide_dtype


def attn_res(blocks: jax.Array | Sequence[jax.Array], partial: jax.Array, query_d: jax.Array,
             gain_d: jax.Array, eps: float, valid_n: jax.Array | None = None) -> jax.Array:
  """Mix `blocks` ([N-1, B, T, d] or a list of [B, T, d]) and `partial` [B, T, d] with
  pseudo-query `query_d` and norm gain `gain_d`.

  `valid_n` [N] bool masks candidates out of the softmax; it lets the model carry a fixed-size
  block buffer of which only the first few entries are sealed yet.
  """
  v_nbtd = jnp.concatenate([jnp.asarray(blocks).reshape(-1, *partial.shape).astype(partial.dtype),
                            partial[None]]).astype(wide_dtype(partial.dtype))
  w_d = gain_d.astype(v_nbtd.dtype) * query_d.astype(v_nbtd.dtype)
  s_nbt = jnp.einsum("nbtd,d->nbt", rms_normalize(v_nbtd, eps), w_d,
                     precision=jax.lax.Precision.HIGHEST)
  if valid_n is not None:
    s_nbt = jnp.where(valid_n[:, None, None], s_nbt, -jnp.inf)
  alpha_nbt = jax.nn.softmax(s_nbt, axis=0)
  out_btd = jnp.einsum("nbt,nbtd->btd", alpha_nbt, v_nbtd, precision=jax.lax.Precision.HIGHEST)
  return out_btd.astype(partial.dtype)


class AttnResQuery(nnx.Module):
  """One AttnRes read point: pseudo-query w [d] (`*_res_proj`, zero-initialised so step 0 is
  a uniform average) and norm gain gamma [d] (`*_res_norm`)."""

  def __init__(self, cfg: ModelConfig):
    self.eps = cfg.rms_norm_eps
    self.proj = annotated(jnp.zeros((cfg.hidden_size,), cfg.jnp_param_dtype), ("embed",))
    self.norm = ones_param((cfg.hidden_size,), ("embed",), cfg.jnp_param_dtype)

  def __call__(self, blocks: jax.Array | Sequence[jax.Array], partial: jax.Array,
               valid_n: jax.Array | None = None) -> jax.Array:
    return attn_res(blocks, partial, self.proj[...], self.norm[...], self.eps, valid_n)
