"""The grouped matmul over MXFP4-packed experts (pallas_kernels/mxfp4/ops.py) against its
definition, dequantise-then-`grouped_matmul` (reference.py), forward and input gradient.

  * the kernel's in-VMEM dequantisation equals the format's `dequantize` bit for bit, for every
    (byte, scale) pair and every compute dtype;
  * "tiled" (one expert dequantised per row tile) equals the reference with grouped_matmul's
    "tiled" bit for bit, float32 and float64, forward and dx: the same dots on the same tiles.
    The decode-sized path (rows <= experts, one expert per row) runs XLA's single-row dot
    where the reference batches the rows: its sums may round differently, so it is held to
    the float64 truth instead;
  * "pallas" (the TPU kernel, interpreted) accumulates over contraction tiles and splits each
    tile's dot into even and odd input elements: a different summation order, held to the
    rigorous bound of a float32 dot product (tests/numerics.dot_tolerance) against the float64
    truth, and in float64 (interpreted with a float64 accumulator) to the same bound with
    float64's u. Its dx contracts over whole output tiles like the reference: measured bitwise
    at these sizes, but not claimed.

Layouts exercised: groups that end inside a row tile (tiles shared by two groups), an empty
group, a group spanning several row tiles (the kernel's dequantised-tile cache reused), rows
past the last group (zeros), several contraction and output tiles.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mxfp4 import format as fm
from pallas_kernels.mxfp4.ops import grouped_matmul_mxfp4
from pallas_kernels.mxfp4.tpu import dequantize_tile
from tests.numerics import U32, assert_close

U64 = 2.0**-53
# (experts, in, out, group sizes, rows): "tiles" runs the tile loop, "decode" the row loop
CASES = {"tiles": (3, 64, 96, [100, 0, 120], 256), "decode": (4, 64, 32, [1, 0, 2, 0], 4)}


def _experts(e, k, n, seed=0):
  """Codes and scales of random weights over several binades (scales 120..134)."""
  rng = np.random.default_rng(seed)
  w = rng.standard_normal((e, k, n)) * np.exp2(rng.integers(-5, 5, (e, k // 32, 1, n))
                                               ).repeat(32, axis=1).reshape(e, k, n)
  codes, scales = jax.jit(fm.quantize)(jnp.asarray(w, jnp.float32))
  return codes, scales


def _inputs(case, dtype, seed=1):
  e, k, n, sizes, m = CASES[case]
  codes, scales = _experts(e, k, n)
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((m, k)), dtype)
  dy = jnp.asarray(rng.standard_normal((m, n)), dtype)
  return x, dy, codes, scales, jnp.asarray(sizes, jnp.int32)


def _run(impl, x, dy, codes, scales, sizes, **kw):
  """(y, dx) of `impl`, jitted."""
  def f(x):
    return grouped_matmul_mxfp4(x, codes, scales, sizes, impl=impl, **kw)
  y, vjp = jax.vjp(jax.jit(f), x)
  return np.asarray(y), np.asarray(vjp(dy)[0])


def _truth(x, dy, codes, scales, sizes):
  """(y, dx) and their |x| |W| / |dy| |W|^T magnitudes, in float64 from the dequantised
  weights (exact in float64) by plain per-row products."""
  w = np.asarray(fm.dequantize(codes, scales, jnp.float32), np.float64)  # [E, in, out]
  m = x.shape[0]
  expert = np.full(m, -1)  # past the last group: no expert, zeros
  expert[:int(np.sum(sizes))] = np.repeat(np.arange(len(sizes)), np.asarray(sizes))
  x64, dy64 = np.asarray(x, np.float64), np.asarray(dy, np.float64)
  y, dx = np.zeros((m, w.shape[2])), np.zeros((m, w.shape[1]))
  ay, adx = np.zeros_like(y), np.zeros_like(dx)
  for i in np.flatnonzero(expert >= 0):
    we = w[expert[i]]
    y[i], dx[i] = x64[i] @ we, we @ dy64[i]
    ay[i], adx[i] = np.abs(x64[i]) @ np.abs(we), np.abs(we) @ np.abs(dy64[i])
  return y, dx, ay, adx


def test_in_kernel_dequantisation_is_the_format_bit_for_bit(x64):
  """codes [256 scales, 256 bytes]: row o holds every byte under scale o (E8M0's whole range,
  0 and 255 included: float32's subnormal 2^-127 and 2^128)."""
  codes = np.tile(np.arange(256, dtype=np.uint8), (256, 1))
  scales = np.tile(np.arange(256, dtype=np.uint8)[:, None], (1, 256 // 16))
  for dtype in (jnp.float32, jnp.float64, jnp.bfloat16):
    want = np.asarray(fm.dequantize(jnp.asarray(codes), jnp.asarray(scales), dtype))
    lo, hi = jax.jit(lambda c, s, dtype=dtype: dequantize_tile(c, s.T, dtype))(codes, scales)
    got = np.stack([np.asarray(lo), np.asarray(hi)], axis=1).reshape(want.shape)
    bits = {2: np.uint16, 4: np.uint32, 8: np.uint64}[want.dtype.itemsize]
    np.testing.assert_array_equal(got.view(bits), want.view(bits), err_msg=str(dtype))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_tiled_is_the_reference_bit_for_bit(dtype, x64):
  args = _inputs("tiles", dtype)
  got = _run("tiled", *args)
  want = _run("reference", *args)
  for name, a, b in zip(("y", "dx"), got, want):
    np.testing.assert_array_equal(a, b, err_msg=name)
  assert np.all(got[0][int(np.sum(args[4])):] == 0)  # rows past the last group


@pytest.mark.parametrize("impl", ["tiled", "reference"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_decode_sized_against_the_float64_truth(impl, dtype, x64):
  args = _inputs("decode", dtype)
  y, dx = _run(impl, *args)
  ty, tdx, ay, adx = _truth(*args)
  u = U32 if dtype == np.float32 else U64
  k, n = args[0].shape[1], args[1].shape[1]
  assert_close("y", y, ty, k * u * ay)
  assert_close("dx", dx, tdx, n * u * adx)
  assert np.all(y[3:] == 0) and np.all(dx[3:] == 0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_pallas_interpreted_within_a_dot_products_rounding(dtype, x64):
  """Several tiles each way: in 1024 = 2 contraction tiles of 512 (forward) / 2 output tiles
  (dx), out 640 = 5 tiles of 128; 384 rows = 3 row tiles, group 0 spanning two of them."""
  e, k, n = 3, 1024, 640
  sizes = jnp.asarray([200, 0, 130], jnp.int32)
  codes, scales = _experts(e, k, n, seed=2)
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.standard_normal((384, k)), dtype)
  dy = jnp.asarray(rng.standard_normal((384, n)), dtype)
  y, dx = _run("pallas", x, dy, codes, scales, sizes, interpret=True)
  ty, tdx, ay, adx = _truth(x, dy, codes, scales, sizes)
  u = U32 if dtype == np.float32 else U64
  assert_close("y", y, ty, k * u * ay)
  assert_close("dx", dx, tdx, n * u * adx)
  assert np.all(y[330:] == 0) and np.all(dx[330:] == 0)
  if dtype == np.float32:  # the reference is held to the same bound
    ry, rdx = _run("reference", x, dy, codes, scales, sizes)
    assert_close("reference y", ry, ty, k * u * ay)
    assert_close("reference dx", rdx, tdx, n * u * adx)


def test_no_gradient_for_the_codes_and_bad_input():
  x, _, codes, scales, sizes = _inputs("tiles", np.float32)
  g = jax.grad(lambda x, c: jnp.sum(grouped_matmul_mxfp4(x, c, scales, sizes, impl="tiled")),
               argnums=(0, 1), allow_int=True)(x, codes)
  assert g[1].dtype == jax.dtypes.float0
  with pytest.raises(ValueError, match="unknown MXFP4 grouped matmul"):
    grouped_matmul_mxfp4(x, codes, scales, sizes, impl="nope")
  with pytest.raises(ValueError, match="must be uint8"):
    grouped_matmul_mxfp4(x, codes.astype(jnp.int32), scales, sizes)
  with pytest.raises(ValueError, match="rows of width"):
    grouped_matmul_mxfp4(x[:, :32], codes, scales, sizes)
