"""The grouped matmul of expert-sorted rows: the reference (reference.py) against a numpy loop
over groups, then every implementation against the reference, forward and gradients: "tiled"
and "ragged_dot" in float64 (to 1e-12: they equal the reference up to summation order), and all
three, "megablox" (Pallas TPU kernels, interpreted; they take bf16 and float32 only) included,
in float32 against the float64 reference on the same values, within the float32 dot product
bound (tests/numerics.py). With empty groups, groups spanning several tiles, a row count that
is no multiple of the tile, and unfilled rows past the last group (zeros out, no gradient in)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.grouped_matmul import grouped_matmul, reference
from tests import numerics

GROUPS = [0, 5, 1, 0, 13, 4, 0, 2]  # E = 8, m = 25; tile 4: groups of 0, 1, 2, 4 rows and 13
DECODE = [0, 2, 1, 0, 0, 3, 0, 1]   # m = 7 <= E: "tiled" gathers each row's expert
H, F = 6, 3


def numpy_grouped(x, w, sizes):
  out, start = [], 0
  for e, n in enumerate(sizes):
    out.append(x[start:start + n] @ w[e])
    start += n
  return np.concatenate(out)


def inputs(groups, extra, seed, dtype=np.float64):
  """x [m, H], w [E, H, F] and the cotangent dy [m, F] of m = sum(groups) + extra rows."""
  rng = np.random.default_rng(seed)
  m = sum(groups) + extra
  x, w, dy = rng.normal(size=(m, H)), rng.normal(size=(len(groups), H, F)), rng.normal(size=(m, F))
  return tuple(jnp.asarray(a, dtype) for a in (x, w, dy))


def value_and_grads(fn, x, w, dy):
  """fn(x, w), and the gradients of sum(fn(x, w) * dy) w.r.t. x and w."""
  y, vjp = jax.vjp(fn, x, w)
  return (y, *vjp(dy))


@pytest.mark.parametrize("groups,extra", [(GROUPS, 0), (GROUPS, 7), (DECODE, 0)])
def test_reference_is_a_loop_over_groups(x64, groups, extra):
  x, w, dy = inputs(groups, extra, seed=0)
  sizes = jnp.asarray(groups, jnp.int32)
  y, dx, dw = value_and_grads(lambda x, w: reference.grouped_matmul(x, w, sizes), x, w, dy)
  x, w, dy = map(np.asarray, (x, w, dy))
  used = sum(groups)
  zeros = lambda n: np.zeros((extra, n))
  np.testing.assert_allclose(y, np.concatenate([numpy_grouped(x[:used], w, groups), zeros(F)]),
                             atol=1e-12, rtol=0)
  # y_i = x_i W_g(i): dx_i = dy_i W_g(i)^T, dW_g = sum over the group's rows x_i^T dy_i
  want_dx = numpy_grouped(dy[:used], np.swapaxes(w, 1, 2), groups)
  np.testing.assert_allclose(dx, np.concatenate([want_dx, zeros(H)]), atol=1e-12, rtol=0)
  bounds = np.cumsum([0] + groups)
  want_dw = np.stack([x[a:b].T @ dy[a:b] for a, b in zip(bounds[:-1], bounds[1:])])
  np.testing.assert_allclose(dw, want_dw, atol=1e-12, rtol=0)


@pytest.mark.parametrize("impl,tile,groups,extra", [
    ("tiled", 4, GROUPS, 0), ("tiled", 128, GROUPS, 0), ("ragged_dot", None, GROUPS, 0),
    ("tiled", 128, DECODE, 0), ("tiled", 4, GROUPS, 7), ("ragged_dot", None, GROUPS, 7)])
def test_float64_matches_the_reference(x64, impl, tile, groups, extra):
  x, w, dy = inputs(groups, extra, seed=1)
  sizes = jnp.asarray(groups, jnp.int32)
  kw = {} if tile is None else {"tile": tile}
  got = value_and_grads(lambda x, w: grouped_matmul(x, w, sizes, impl=impl, **kw), x, w, dy)
  want = value_and_grads(lambda x, w: reference.grouped_matmul(x, w, sizes), x, w, dy)
  for name, a, b in zip(("y", "dx", "dw"), got, want):
    assert a.dtype == jnp.float64, name
    np.testing.assert_allclose(a, b, atol=1e-12, rtol=0, err_msg=name)


@pytest.mark.parametrize("impl", ["tiled", "ragged_dot", "megablox"])
@pytest.mark.parametrize("groups,extra", [(GROUPS, 7), ([130, 0, 3, 0, 0, 140, 1, 0], 0),
                                          ([0] * 7 + [129], 200)])
def test_float32_matches_the_float64_reference(impl, groups, extra):
  """Groups that share a row tile, span several tiles (TILE = 128), are empty, and `extra`
  unfilled rows. Every output element is one float32 dot product: of length H for y, F for dx,
  and the group's row count for dW_g, so |err| <= n u (|a| @ |b|) (numerics.dot_tolerance),
  with |a| @ |b| the reference's own value and gradient on |x|, |w|, |dy|."""
  x, w, dy = inputs(groups, extra, seed=2, dtype=np.float32)
  sizes = jnp.asarray(groups, jnp.int32)
  kw = {"interpret": True} if impl == "megablox" else {}
  got = value_and_grads(lambda x, w: grouped_matmul(x, w, sizes, impl=impl, **kw), x, w, dy)
  ref = lambda x, w, dy: value_and_grads(
      lambda x, w: reference.grouped_matmul(x, w, sizes), x, w, dy)
  want = numerics.float64_truth(ref, x, w, dy)
  abs_y, abs_dx, abs_dw = numerics.float64_truth(ref, *map(jnp.abs, (x, w, dy)))
  rows_e = np.asarray(groups, np.float64)[:, None, None]
  tols = (numerics.dot_tolerance(abs_y, H), numerics.dot_tolerance(abs_dx, F),
          numerics.dot_tolerance(abs_dw, 1) * rows_e)
  for name, a, b, tol in zip(("y", "dx", "dw"), got, want, tols):
    assert a.dtype == jnp.float32, name
    numerics.assert_close(name, a, b, tol)
  assert np.all(np.asarray(got[0])[sum(groups):] == 0)  # rows past the groups: exact zeros
  assert np.all(np.asarray(got[1])[sum(groups):] == 0)


def test_unknown_impl_is_refused():
  with pytest.raises(ValueError, match="grouped matmul"):
    grouped_matmul(jnp.zeros((2, 3)), jnp.zeros((1, 3, 4)), jnp.asarray([2]), impl="loop")
