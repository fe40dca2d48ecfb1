"""Token cross entropy without the [tokens, vocab] logits (docs/training.md), and the logsumexp
the z-loss squares.

    nll[b, t] = logsumexp_v(x[b, t] . W[:, v]) - x[b, t] . W[:, target[b, t]]

`token_nll` takes the logits; `chunked_token_nll` takes the final-norm output x [B, T, d] and
the head W [d, V] instead and computes the same numbers over chunks of C positions: a scan over
T / C chunks whose body forms one chunk's logits [B, C, V], produced in fp32 by the head's
matmul (fp64 for a float64 model; `layers.head_logits`),
their logsumexp and the target's logit. Only the logsumexp is kept: the backward (its own
custom VJP, d nll / d logits = softmax - onehot(target)) recomputes a chunk's logits from x
and W instead of keeping them: the largest live buffer is [B, C, V] fp32 rather than three
[B, T, V] (logits, softmax, its gradient). At K3's vocabulary of 163,840 and T = 8192 that
is 5 GiB per row of the batch in the forward alone.
The chunks split positions, not rows, so a batch sharded over rows stays sharded, and a
vocabulary sharded over `tensor` is reduced by the partitioner as in the unchunked loss.
The cost is one more head matmul per chunk in the backward (2 N d V FLOPs, a third of the
head's train FLOPs), as with any rematerialisation.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from k3jax.model import context_parallel
from k3jax.model.expert_parallel import context_mesh
from k3jax.model.layers import head_logits


def token_nll(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> jax.Array:
  """Per-position NLL [..., T] in fp32, or fp64 for a float64 model (0 where mask is False)."""
  logp = jax.nn.log_softmax(logits.astype(jnp.promote_types(logits.dtype, jnp.float32)),
                            axis=-1)
  nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
  return jnp.where(mask, nll, 0.0)


def token_nll_lse(logits: jax.Array, targets: jax.Array, mask: jax.Array
                  ) -> tuple[jax.Array, jax.Array]:
  """(token_nll, logsumexp of the logits) per position [..., T], in fp32 (fp64 for a float64
  model), 0 where mask is False: the logsumexp is what the z-loss squares."""
  lse = jax.nn.logsumexp(logits.astype(jnp.promote_types(logits.dtype, jnp.float32)), axis=-1)
  return token_nll(logits, targets, mask), jnp.where(mask, lse, 0.0)


def chunked_token_nll(x_btd: jax.Array, head_dv: jax.Array, targets_bt: jax.Array,
                      mask_bt: jax.Array, chunk: int,
                      precision: jax.lax.Precision | None = None,
                      temperature: float = 1.0, groups: int = 1) -> jax.Array:
  """token_nll(x @ W / temperature, targets, mask) [B, T] over chunks of `chunk` positions
  (see module docstring; the division is in the wide dtype, after the head: RL's tempered
  policy, k3jax/rl); T is padded up to a multiple of `chunk` (padded positions are dropped).
  `groups` g: the positions are g contiguous ranges (a sequence split over g devices of the
  `context` axis), each cut into chunks of its own, and a scan step takes one chunk of every
  range, so no step reads across a device's positions."""
  return chunked_token_nll_lse(x_btd, head_dv, targets_bt, mask_bt, chunk, precision,
                               temperature, groups)[0]


def chunked_token_nll_lse(x_btd: jax.Array, head_dv: jax.Array, targets_bt: jax.Array,
                          mask_bt: jax.Array, chunk: int,
                          precision: jax.lax.Precision | None = None,
                          temperature: float = 1.0,
                          groups: int = 1) -> tuple[jax.Array, jax.Array]:
  """token_nll_lse of x @ W / temperature over chunks of `chunk` positions (see
  chunked_token_nll, its `groups` too): the logsumexp comes with its own gradient (softmax
  per chunk)."""
  b, t, d = x_btd.shape
  if t % groups:
    raise ValueError(f"{t} positions do not split into {groups} ranges")
  g, tl = groups, t // groups
  chunk = min(chunk, tl)
  pad = -tl % chunk
  x = x_btd.reshape(b, g, tl, d)
  tgt = targets_bt.reshape(b, g, tl)
  if pad:
    x = jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0)))
    tgt = jnp.pad(tgt, ((0, 0), (0, 0), (0, pad)))
  n = (tl + pad) // chunk
  x_nrcd = jnp.moveaxis(x.reshape(b, g, n, chunk, d), 2, 0).reshape(n, b * g, chunk, d)
  tgt_nrc = jnp.moveaxis(tgt.reshape(b, g, n, chunk), 2, 0).reshape(n, b * g, chunk)
  nll_nrc, lse_nrc = _chunked_nll(x_nrcd, head_dv.astype(x_btd.dtype), tgt_nrc, precision,
                                  float(temperature))

  def unchunk(a_nrc):
    a = jnp.moveaxis(a_nrc.reshape(n, b, g, chunk), 0, 2).reshape(b, g, n * chunk)
    return jnp.where(mask_bt, a[:, :, :tl].reshape(b, t), 0.0)

  return unchunk(nll_nrc), unchunk(lse_nrc)


def _logits(x_bcd, head_dv, precision, temperature=1.0):
  logits = head_logits("bcd,dv->bcv", x_bcd, head_dv, precision)  # produced wide
  return logits if temperature == 1.0 else logits / jnp.asarray(temperature, logits.dtype)


def _picked(logits_bcv, tgt_bc):
  return jnp.take_along_axis(logits_bcv, tgt_bc[..., None], axis=-1)[..., 0]


def _nll_fwd(x_nbcd, head_dv, tgt_nbc, precision, temperature):
  def body(_, xs):
    x_bcd, tgt_bc = xs
    logits = _logits(x_bcd, head_dv, precision, temperature)
    lse = jax.nn.logsumexp(logits, axis=-1)
    return None, (lse - _picked(logits, tgt_bc), lse)

  _, (nll, lse) = jax.lax.scan(body, None, (x_nbcd, tgt_nbc))
  return (nll, lse), (x_nbcd, head_dv, tgt_nbc, lse)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _chunked_nll(x_nbcd, head_dv, tgt_nbc, precision, temperature):
  return _nll_fwd(x_nbcd, head_dv, tgt_nbc, precision, temperature)[0]


def _nll_bwd(precision, temperature, res, cts):
  """d nll / d logits = softmax - onehot(target) and d lse / d logits = softmax, per chunk
  from the saved logsumexp: one recomputed head matmul per chunk and the two gradient
  matmuls, written in the layouts they are used in (no transposed copy of the [B, C, V]
  cotangent, no scatter for the target)."""
  x_nbcd, head_dv, tgt_nbc, lse_nbc = res
  ct_nbc, ct_lse_nbc = cts
  wide = jnp.promote_types(x_nbcd.dtype, jnp.float32)
  vocab = jnp.arange(head_dv.shape[1])

  def body(dw_dv, xs):
    x_bcd, tgt_bc, lse_bc, ct_bc, ct_lse_bc = xs
    logits = _logits(x_bcd, head_dv, precision, temperature)
    softmax = jnp.exp(logits - lse_bc[..., None])
    g = (softmax * (ct_bc + ct_lse_bc)[..., None].astype(wide)
         - (vocab == tgt_bc[..., None]).astype(wide) * ct_bc[..., None].astype(wide))
    if temperature != 1.0:  # d (z / T) / d z
      g = g / jnp.asarray(temperature, wide)
    g = g.astype(x_bcd.dtype)
    # as [tokens, .] matrices: one contracted dim each (see layers.flat_einsum)
    b, c, d = x_bcd.shape
    g_nv = g.reshape(b * c, -1)
    dx = jnp.einsum("nv,dv->nd", g_nv, head_dv, precision=precision).reshape(b, c, d)
    dw_dv = dw_dv + jnp.einsum("nd,nv->dv", x_bcd.reshape(b * c, d), g_nv, precision=precision,
                               preferred_element_type=wide)
    return dw_dv, dx

  dw, dx = jax.lax.scan(body, jnp.zeros(head_dv.shape, wide),
                        (x_nbcd, tgt_nbc, lse_nbc, ct_nbc, ct_lse_nbc))
  return dx, dw.astype(head_dv.dtype), None


_chunked_nll.defvjp(_nll_fwd, _nll_bwd)


def model_nll(model, inputs: jax.Array, segment_ids: jax.Array | None):
  """Run `model` (a K3Model) on `inputs` the way its execution computes the loss: (its output,
  a function (output, targets, mask) -> per-position NLL). With `model.ex.loss_chunk` the model
  stops at the final norm and the NLL runs over chunks of the head (no [B, T, V] logits);
  without it, over the full logits. The train step and benchmarks/train.py both call this."""
  out, nll_lse_of = model_nll_lse(model, inputs, segment_ids)
  return out, lambda out, targets, mask: nll_lse_of(out, targets, mask)[0]


def model_nll_lse(model, inputs: jax.Array, segment_ids: jax.Array | None):
  """model_nll whose function returns (NLL, logsumexp) per position (the z-loss's input)."""
  ex = model.ex
  if ex.loss_chunk is None:
    return (model(inputs, segment_ids=segment_ids),
            lambda out, targets, mask: token_nll_lse(out.logits, targets, mask))
  out = model(inputs, segment_ids=segment_ids, logits=False)
  head = model.head()
  groups = context_parallel.size(context_mesh())  # chunks within each device's positions
  return out, lambda out, targets, mask: chunked_token_nll_lse(
      out.features, head, targets, mask, ex.loss_chunk, ex.precision, groups=groups)
