"""The MXFP4 format (pallas_kernels/mxfp4/format.py): the host numpy quantise / dequantise
against the OCP MX rules, checked by brute force (every E2M1 value times the group's power of
two, nearest wins, ties to the even code), and the device jnp functions against the numpy ones,
bit for bit."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels import mxfp4


def brute_force_code(v: float, exp: int) -> int:
  """Nearest E2M1 code for v / 2^exp (saturating), ties to the even code, sign kept."""
  grid = mxfp4.E2M1[:8].astype(np.float64) * 2.0**exp
  err = np.abs(abs(v) - grid)
  best = np.flatnonzero(err == err.min())
  code = int(best[0]) if len(best) == 1 else int(next(c for c in best if c % 2 == 0))
  return code | (8 if np.signbit(v) else 0)


def test_dequantize_reads_low_nibble_first():
  packed = np.zeros((1, 16), np.uint8)
  packed[0, 0] = 0x7 | (0xA << 4)      # element 0 = +6, element 1 = -1
  scale = np.array([[127 + 3]], np.uint8)  # x 8
  w = mxfp4.dequantize_np(packed, scale)
  assert w.shape == (1, 32) and w[0, 0] == 48.0 and w[0, 1] == -8.0 and not w[0, 2:].any()


def test_quantize_matches_brute_force():
  rng = np.random.default_rng(0)
  # log-uniform magnitudes over a wide range, random signs, some exact ties and zeros
  w = (rng.choice([-1, 1], (8, 64)) * 2.0 ** rng.uniform(-12, 12, (8, 64))).astype(np.float32)
  w[0, :32] = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4   # ties at every midpoint, amax 6
  w[1, :32] = 0.0
  w[1, 5] = -0.0
  packed, scale = mxfp4.quantize_np(w)
  codes = np.stack([packed & 0xF, packed >> 4], -1).reshape(8, 64)
  for r in range(8):
    for g in range(2):
      block = w[r, 32 * g: 32 * g + 32].astype(np.float64)
      amax = np.abs(block).max()
      exp = int(np.floor(np.log2(amax))) - 2 if amax > 0 else -127
      assert scale[r, g] == exp + 127
      for c in range(32):
        assert codes[r, 32 * g + c] == brute_force_code(block[c], exp), (r, g, c)
  # ties round to even: 0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2.0, 2.5->2.0, 3.5->4.0, 5->4
  assert list(codes[0, :7]) == [0, 2, 2, 4, 4, 6, 6]
  assert codes[1, 5] == 8 and scale[1, 0] == 0  # -0 keeps its sign; all-zero group: scale 0


def test_saturates_and_clamps():
  w = np.full((1, 32), 7.9, np.float32)   # amax 7.9 -> exponent 0, 7.9 saturates to 6
  w[0, 0] = 4.0
  packed, scale = mxfp4.quantize_np(w)
  assert scale[0, 0] == 127 and (mxfp4.dequantize_np(packed, scale)[0, 1:] == 6.0).all()
  huge = np.full((1, 32), 2.0**130)
  assert mxfp4.quantize_np(huge)[1][0, 0] == 254  # E8M0 tops out at 2^127 (255 is NaN)
  with pytest.raises(ValueError):
    mxfp4.quantize_np(np.full((1, 32), np.nan))


def test_codes_survive_dequantize_quantize():
  """What a quantiser wrote (every group's largest magnitude is 4 or 6) comes back bit for bit,
  through bf16 as the converter stores it."""
  rng = np.random.default_rng(1)
  codes = rng.integers(0, 16, (16, 128), dtype=np.uint8)
  codes[:, ::32] = rng.choice([6, 7, 14, 15], (16, 4))  # +-4 or +-6 in each group
  packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
  scale = rng.integers(100, 150, (16, 4), dtype=np.uint8)
  w = mxfp4.dequantize_np(packed, scale, dtype=ml_dtypes.bfloat16)
  again = mxfp4.quantize_np(w)
  np.testing.assert_array_equal(again[0], packed)
  np.testing.assert_array_equal(again[1], scale)
  np.testing.assert_array_equal(mxfp4.dequantize_np(*again), w.astype(np.float32))


def test_dequantize_every_scale_and_byte_matches_the_formula():
  """All 256 E8M0 scales x all 256 code bytes against the spec formula in float64."""
  packed = np.tile(np.arange(256, dtype=np.uint8), (256, 1))       # row r: every byte
  scale = np.repeat(np.arange(256, dtype=np.uint8)[:, None], 16, 1)  # row r: scale r
  codes = np.stack([packed & 0xF, packed >> 4], -1).reshape(256, 512)
  want = mxfp4.E2M1[codes].astype(np.float64) * 2.0 ** (np.arange(256)[:, None] - 127.0)
  for dtype in (ml_dtypes.bfloat16, np.float32):
    got = mxfp4.dequantize_np(packed, scale, dtype=dtype).astype(np.float64)
    assert np.isnan(got[255]).all()  # scale 255 is E8M0's NaN
    finite = np.abs(want[:255]) <= np.finfo(np.float32).max
    np.testing.assert_array_equal(got[:255][finite], want[:255][finite])
    # beyond float32 (scales 253, 254 with large codes): signed infinity
    np.testing.assert_array_equal(got[:255][~finite], np.sign(want[:255][~finite]) * np.inf)


def tricky_weights(dtype, seed=0):
  """[in=128, out=24]: random groups over many binades, all-zero groups, -0, and values
  exactly on the E2M1 midpoints (ties) and past the saturation point."""
  rng = np.random.default_rng(seed)
  binade = np.repeat(rng.integers(-20, 20, (24, 4)), 32, axis=1)  # one per group of 32
  w = rng.standard_normal((24, 128)) * np.exp2(binade)
  w[0, :32] = 0.0
  w[1, :32] = -0.0
  mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
  w[2, :32] = np.concatenate([mids, -mids, [6.0, -6.0, 4.0], rng.uniform(-6, 6, 15)])
  w[3, :32] = w[2, :32] * 2.0 ** -30
  w[4, 32:64] = np.concatenate([[7.99], rng.uniform(-7.99, 7.99, 31)])  # amax just under 8
  return w.T.astype(dtype)  # k3jax layout [in, out]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_jax_mxfp4_matches_the_numpy_quantiser_bit_for_bit(dtype):
  with jax.enable_x64(dtype == np.float64):
    w_io = tricky_weights(dtype)
    codes, scales = mxfp4.quantize_np(w_io.T)
    got_codes, got_scales = jax.jit(mxfp4.quantize)(jnp.asarray(w_io))
    np.testing.assert_array_equal(np.asarray(got_codes), codes)
    np.testing.assert_array_equal(np.asarray(got_scales), scales)
    truth = mxfp4.dequantize_np(codes, scales, np.float64).T
    rounded = np.asarray(jax.jit(mxfp4.round_mxfp4)(jnp.asarray(w_io)), np.float64)
    np.testing.assert_array_equal(rounded, truth)
    np.testing.assert_array_equal(np.signbit(rounded), np.signbit(truth))  # -0 kept
    deq = np.asarray(mxfp4.dequantize(jnp.asarray(codes), jnp.asarray(scales), dtype), np.float64)
    np.testing.assert_array_equal(deq, truth)
    # straight-through: the gradient of sum(c * round(w)) is c
    c = jnp.asarray(np.arange(w_io.size, dtype=dtype).reshape(w_io.shape))
    g = jax.grad(lambda w: jnp.sum(c * mxfp4.round_mxfp4(w)))(jnp.asarray(w_io))
    np.testing.assert_array_equal(np.asarray(g), np.asarray(c))
