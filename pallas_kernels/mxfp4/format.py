"""MXFP4: OCP microscaling FP4 (E2M1 elements, E8M0 scales, groups of 32 along the input dim).

One definition of the format, with two array backends: numpy on the host (`quantize_np`,
`dequantize_np`, [out, in] as the checkpoint stores a weight; the converter's streaming path)
and jnp on a device (`quantize`, `dequantize`, `round_mxfp4`, k3jax's [..., in, out] layout;
the model's packed experts and QAT). Both apply the same rule bit for bit (tests compare
them).

    w[o, 2j]   = E2M1[packed[o, j] & 0xF] * 2^(scale[o, 2j // 32] - 127)
    w[o, 2j+1] = E2M1[packed[o, j] >> 4]  * 2^(scale[o, (2j+1) // 32] - 127)

Every MXFP4 value is exactly representable in bf16 (3 significant bits, exponent within bf16's
range), so dequantising to bf16 loses nothing.

Quantising follows the OCP Microscaling Formats spec v1.0 (section 6.3): per group of 32, the
shared exponent is floor(log2(amax)) - 2 (2 = the largest exponent of E2M1, so amax lands in
[4, 8) before rounding), stored biased by 127 as E8M0 and clamped to [-127, 127]; each element
is divided by 2^shared (exact: a power of two) and rounded to the nearest E2M1 value, ties to
the even code, saturating at +-6. An all-zero group gets the smallest scale (code 0). The sign
survives rounding to zero (-0 is code 0x8), so dequantise -> quantise reproduces the codes of
any group whose largest magnitude is 4 or 6 (what a quantiser produces) bit for bit.

`round_mxfp4(w)` is quantise-then-dequantise in JAX with a straight-through gradient (a
`custom_jvp`, so the forward value is exactly the rounded one: `w + stop_gradient(q - w)`
would add a float rounding of its own). A model trained on `round_mxfp4(W)` and exported
through `quantize_np` computes the same numbers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

GROUP = 32
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                 -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
# Midpoints between consecutive E2M1 magnitudes (codes 0..7); a magnitude equal to one is a tie.
_MIDPOINTS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float64)
_EMAX_E2M1 = 2
_SCALE_BIAS = 127


def _check_codes(packed: np.ndarray, scale: np.ndarray) -> None:
  if packed.dtype != np.uint8 or scale.dtype != np.uint8:
    raise ValueError(f"MXFP4 tensors must be uint8, got {packed.dtype} and {scale.dtype}")
  if packed.ndim != 2 or (2 * packed.shape[1]) % GROUP or scale.shape != (
      packed.shape[0], 2 * packed.shape[1] // GROUP):
    raise ValueError(f"MXFP4 scale shape {scale.shape} does not fit codes {packed.shape}")


@functools.cache
def _pair_table() -> np.ndarray:
  """[scale * 256 + byte] -> the byte's two weights (even element first) as bf16 bit pairs.

  Built once from the defining formula, in float32 (exact: an E2M1 value has 2 significant
  bits, 2^(s-127) is a power of two) and rounded to bf16 (exact too, subnormals included;
  products beyond float32's range, at scales 253-254, become inf). Scale 255 is E8M0's NaN.
  A table lookup per byte is several times faster than computing the product per element
  (docs/benchmarks.md#development-measurements).
  """
  with np.errstate(over="ignore", invalid="ignore"):
    factor = np.ldexp(np.float32(1.0), np.arange(256, dtype=np.int32) - _SCALE_BIAS)
    byte = np.arange(256)
    lo, hi = (E2M1[nibble][None, :] * factor.astype(np.float32)[:, None]
              for nibble in (byte & 0xF, byte >> 4))
  lo[255], hi[255] = np.nan, np.nan
  pairs = np.stack([lo, hi], axis=-1).astype(ml_dtypes.bfloat16)  # [256, 256, 2]
  # each pair as one 4-byte word: one gather per byte, and the view back to bf16 restores the
  # memory order (even element first) whatever the machine's endianness
  return np.ascontiguousarray(pairs).view(np.uint32).reshape(-1)


def dequantize_np(packed: np.ndarray, scale: np.ndarray, dtype=np.float32) -> np.ndarray:
  """uint8 codes [out, in/2] and uint8 E8M0 scales [out, in/32] -> weights [out, in]."""
  packed = np.asarray(packed)
  scale = np.asarray(scale)
  _check_codes(packed, scale)
  out, half = packed.shape
  index = np.empty((out, half // (GROUP // 2), GROUP // 2), np.uint16)
  index[...] = (scale.astype(np.uint16) << 8)[:, :, None]  # a group's 16 bytes share a scale
  index |= packed.reshape(index.shape)
  w = _pair_table()[index].view(ml_dtypes.bfloat16).reshape(out, 2 * half)
  return w if np.dtype(dtype) == w.dtype else w.astype(dtype)


def quantize_np(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """weights [out, in] (any float dtype) -> (codes uint8 [out, in/2], E8M0 scales [out, in/32])."""
  w = np.asarray(w)
  if w.ndim != 2 or w.shape[1] % GROUP:
    raise ValueError(f"MXFP4 needs [out, in] with in a multiple of {GROUP}, got {w.shape}")
  x = w.astype(np.float64).reshape(w.shape[0], -1, GROUP)  # exact for bf16/f16/f32 inputs
  if not np.isfinite(x).all():
    raise ValueError("cannot quantise non-finite weights to MXFP4")
  amax = np.abs(x).max(axis=-1)
  with np.errstate(divide="ignore"):
    shared = np.floor(np.log2(amax)) - _EMAX_E2M1   # -inf for an all-zero group
  shared = np.clip(shared, -_SCALE_BIAS, _SCALE_BIAS)
  scale = (shared + _SCALE_BIAS).astype(np.uint8)
  mag = np.abs(x) / np.ldexp(1.0, shared.astype(np.int64))[..., None]
  lo = np.searchsorted(_MIDPOINTS, mag, side="left")    # rounds a tie down
  hi = np.searchsorted(_MIDPOINTS, mag, side="right")   # rounds a tie up
  code = np.where(lo % 2 == 0, lo, hi).astype(np.uint8)  # lo == hi unless a tie: pick even
  code |= np.signbit(x).astype(np.uint8) << 3
  code = code.reshape(w.shape[0], -1)
  packed = code[:, 0::2] | (code[:, 1::2] << 4)
  return packed.astype(np.uint8), scale


# ---- jnp (device) ----------------------------------------------------------------------------

def dequantize(codes: jax.Array, scales: jax.Array, dtype) -> jax.Array:
  """codes [..., out, in/2], scales [..., out, in/32] -> weights [..., in, out] in `dtype`.

  Every value is exact in bf16 and wider (3 significant bits, an E8M0 power of two)."""
  lo, hi = codes & 0xF, codes >> 4
  nib = jnp.stack([lo, hi], axis=-1).reshape(*codes.shape[:-1], 2 * codes.shape[-1])
  table = jnp.asarray(E2M1, jnp.float32)
  exp = jnp.repeat(scales.astype(jnp.int32) - _SCALE_BIAS, GROUP, axis=-1)
  w = jnp.ldexp(table[nib.astype(jnp.int32)], exp)  # exact: a power-of-two scaling
  return jnp.swapaxes(w, -1, -2).astype(dtype)


def _codes(w_io: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(E2M1 codes uint8 [..., out, in], shared exponents int32 [..., out, in/32]) of weights
  [..., in, out], groups of 32 along `in` (quantize_np's rule, bit for bit).

  Computed in the weights' own [in, out] order and only the uint8 codes transposed: packing a
  layer's experts under jit then holds uint8 codes beside them, not a transposed float copy
  and int32 codes (half the temporaries; docs/sharding.md#placement)."""
  *lead, n_in, n_out = w_io.shape
  g = w_io.reshape(*lead, n_in // GROUP, GROUP, n_out)
  amax = jnp.max(jnp.abs(g), axis=-2)      # [..., in/32, out]
  _, e = jnp.frexp(amax)                   # amax = m 2^e, m in [0.5, 1): floor(log2) = e - 1
  shared = jnp.clip(jnp.where(amax > 0, e - 1 - 2, -_SCALE_BIAS), -_SCALE_BIAS, _SCALE_BIAS)
  mag = jnp.ldexp(jnp.abs(g), -shared[..., None, :])  # exact: a power of two
  mids = jnp.asarray(_MIDPOINTS, g.dtype)
  below = jnp.sum(mag[..., None] > mids, axis=-1, dtype=jnp.uint8)   # searchsorted left
  upto = jnp.sum(mag[..., None] >= mids, axis=-1, dtype=jnp.uint8)   # searchsorted right
  code = jnp.where(below % 2 == 0, below, upto)      # ties to the even code
  code = code | (jnp.signbit(g).astype(jnp.uint8) << 3)
  return (jnp.swapaxes(code.reshape(*lead, n_in, n_out), -1, -2),
          jnp.swapaxes(shared, -1, -2))


def quantize(w_io: jax.Array) -> tuple[jax.Array, jax.Array]:
  """weights [..., in, out] -> (codes uint8 [..., out, in/2], scales uint8 [..., out, in/32])."""
  code, shared = _codes(w_io)
  packed = code[..., 0::2] | (code[..., 1::2] << 4)
  return packed.astype(jnp.uint8), (shared + _SCALE_BIAS).astype(jnp.uint8)


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
