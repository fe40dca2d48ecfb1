"""MXFP4 in JAX: routed experts dequantised per matmul, and MXFP4 rounding for QAT (SPEC §10).

The format is convert/mxfp4.py's (OCP microscaling: E2M1 codes, E8M0 scales, group 32 along
the input dim). Expert stacks are held as the checkpoint holds them, per expert [out, in]:

    codes  uint8 [..., out, in/2]   (even element in the low nibble)
    scales uint8 [..., out, in/32]
    w[..., i, o] = E2M1[code(o, i)] * 2^(scale(o, i // 32) - 127)      (k3jax layout [in, out])

`round_mxfp4(w)` is quantise-then-dequantise computed in JAX with convert/mxfp4.py's exact
rule (shared exponent floor(log2 amax) - 2, round to nearest E2M1, ties to the even code,
saturating at 6), so a model trained on `round_mxfp4(W)` and exported through
`mxfp4.quantize` computes the same numbers. Its gradient is the identity (straight-through):
a `custom_jvp`, so the forward value is exactly the rounded one (`w + stop_gradient(q - w)`
would add a float rounding of its own).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from convert.mxfp4 import E2M1, GROUP

_MAGNITUDES = np.abs(E2M1[:8])                    # code 0..7
_MIDPOINTS = (_MAGNITUDES[1:] + _MAGNITUDES[:-1]) / 2
_BIAS = 127


def dequantize(codes: jax.Array, scales: jax.Array, dtype) -> jax.Array:
  """codes [..., out, in/2], scales [..., out, in/32] -> weights [..., in, out] in `dtype`.

  Every value is exact in bf16 and wider (3 significant bits, an E8M0 power of two)."""
  lo, hi = codes & 0xF, codes >> 4
  nib = jnp.stack([lo, hi], axis=-1).reshape(*codes.shape[:-1], 2 * codes.shape[-1])
  table = jnp.asarray(E2M1, jnp.float32)
  exp = jnp.repeat(scales.astype(jnp.int32) - _BIAS, GROUP, axis=-1)
  w = jnp.ldexp(table[nib.astype(jnp.int32)], exp)  # exact: a power-of-two scaling
  return jnp.swapaxes(w, -1, -2).astype(dtype)


def _codes(w_io: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(E2M1 codes int32 [..., out, in], shared exponents int32 [..., out, in/32]) of weights
  [..., in, out], groups of 32 along `in` (convert/mxfp4.quantize's rule, bit for bit)."""
  x = jnp.swapaxes(w_io, -1, -2)  # [..., out, in]
  g = x.reshape(*x.shape[:-1], x.shape[-1] // GROUP, GROUP)
  amax = jnp.max(jnp.abs(g), axis=-1)
  _, e = jnp.frexp(amax)                   # amax = m 2^e, m in [0.5, 1): floor(log2) = e - 1
  shared = jnp.clip(jnp.where(amax > 0, e - 1 - 2, -_BIAS), -_BIAS, _BIAS)
  mag = jnp.ldexp(jnp.abs(g), -shared[..., None])  # exact: a power of two
  mids = jnp.asarray(_MIDPOINTS, g.dtype)
  below = jnp.sum(mag[..., None] > mids, axis=-1)    # searchsorted left (a tie rounds down)
  upto = jnp.sum(mag[..., None] >= mids, axis=-1)    # searchsorted right (a tie rounds up)
  code = jnp.where(below % 2 == 0, below, upto)      # ties to the even code
  code = code | (jnp.signbit(g).astype(code.dtype) << 3)
  return code.reshape(x.shape), shared


def quantize(w_io: jax.Array) -> tuple[jax.Array, jax.Array]:
  """weights [..., in, out] -> (codes uint8 [..., out, in/2], scales uint8 [..., out, in/32])."""
  code, shared = _codes(w_io)
  packed = code[..., 0::2] | (code[..., 1::2] << 4)
  return packed.astype(jnp.uint8), (shared + _BIAS).astype(jnp.uint8)


def _round(w_io: jax.Array) -> jax.Array:
  """MXFP4 quantise + dequantise of weights [..., in, out]."""
  code, shared = _codes(w_io)
  exp = jnp.repeat(shared, GROUP, axis=-1)
  q = jnp.ldexp(jnp.asarray(E2M1, w_io.dtype)[code], exp)
  return jnp.swapaxes(q, -1, -2)


@jax.custom_jvp
def round_mxfp4(w_io: jax.Array) -> jax.Array:
  """The MXFP4-rounded weights [..., in, out]; straight-through gradient."""
  return _round(w_io)


@round_mxfp4.defjvp
def _round_jvp(primals, tangents):
  (w,), (dw,) = primals, tangents
  return _round(w), dw
