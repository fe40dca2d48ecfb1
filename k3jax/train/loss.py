"""Token cross entropy without the [tokens, vocab] logits (SPEC §5).

    nll[b, t] = logsumexp_v(x[b, t] . W[:, v]) - x[b, t] . W[:, target[b, t]]

`token_nll` takes the logits; `chunked_token_nll` takes the final-norm output x [B, T, d] and
the head W [d, V] instead and computes the same numbers over chunks of C positions: a scan over
T / C chunks whose body forms one chunk's logits [B, C, V] in fp32 (fp64 for a float64 model),
their logsumexp and the target's logit. The body is rematerialised (`jax.checkpoint`), so the
backward recomputes a chunk's logits from x and W instead of keeping them: the largest live
buffer is [B, C, V] fp32 rather than three [B, T, V] (logits, softmax, its gradient). At K3's
vocabulary of 163,840 and T = 8192 that is 5 GiB per row of the batch in the forward alone.
The chunks split positions, not rows, so a batch sharded over rows stays sharded, and a
vocabulary sharded over `tensor` is reduced by the partitioner as in the unchunked loss.
The cost is one more head matmul per chunk in the backward (2 N d V FLOPs, a third of the
head's train FLOPs), as with any rematerialisation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def token_nll(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> jax.Array:
  """Per-position NLL [..., T] in fp32, or fp64 for a float64 model (0 where mask is False)."""
  logp = jax.nn.log_softmax(logits.astype(jnp.promote_types(logits.dtype, jnp.float32)),
                            axis=-1)
  nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
  return jnp.where(mask, nll, 0.0)


def chunked_token_nll(x_btd: jax.Array, head_dv: jax.Array, targets_bt: jax.Array,
                      mask_bt: jax.Array, chunk: int,
                      precision: jax.lax.Precision | None = None) -> jax.Array:
  """token_nll(x @ W, targets, mask) [B, T] over chunks of `chunk` positions (see module
  docstring); T is padded up to a multiple of `chunk` (padded positions are dropped)."""
  b, t, d = x_btd.shape
  chunk = min(chunk, t)
  pad = -t % chunk
  if pad:
    x_btd = jnp.pad(x_btd, ((0, 0), (0, pad), (0, 0)))
    targets_bt = jnp.pad(targets_bt, ((0, 0), (0, pad)))
  n = (t + pad) // chunk
  x_nbcd = jnp.moveaxis(x_btd.reshape(b, n, chunk, d), 1, 0)
  tgt_nbc = jnp.moveaxis(targets_bt.reshape(b, n, chunk), 1, 0)
  wide = jnp.promote_types(x_btd.dtype, jnp.float32)
  head = head_dv.astype(x_btd.dtype)

  @jax.checkpoint
  def one(x_bcd, tgt_bc):
    logits = jnp.einsum("bcd,dv->bcv", x_bcd, head, precision=precision).astype(wide)
    picked = jnp.take_along_axis(logits, tgt_bc[..., None], axis=-1)[..., 0]
    return jax.nn.logsumexp(logits, axis=-1) - picked

  def body(_, xs):
    return None, one(*xs)

  _, nll_nbc = jax.lax.scan(body, None, (x_nbcd, tgt_nbc))
  nll = jnp.moveaxis(nll_nbc, 0, 1).reshape(b, n * chunk)[:, :t]
  return jnp.where(mask_bt, nll, 0.0)
