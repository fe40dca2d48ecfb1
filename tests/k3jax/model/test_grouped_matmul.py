"""The grouped matmul of expert-sorted rows against a numpy loop over groups, forward and
gradients: "tiled" and "ragged_dot" in float64, "megablox" (Pallas TPU kernels, interpreted)
in float32 against the float64 loop; with empty groups, groups spanning several tiles and a
row count that is no multiple of the tile."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.grouped_matmul import grouped_matmul

GROUPS = [0, 5, 1, 0, 13, 4, 0, 2]  # E = 8, m = 25; tile 4: groups of 0, 1, 2, 4 rows and 13
DECODE = [0, 2, 1, 0, 0, 3, 0, 1]   # m = 7 <= E: "tiled" gathers each row's expert


def numpy_grouped(x, w, sizes):
  out, start = [], 0
  for e, n in enumerate(sizes):
    out.append(x[start:start + n] @ w[e])
    start += n
  return np.concatenate(out)


@pytest.mark.parametrize("impl,tile,GROUPS", [("tiled", 4, GROUPS), ("tiled", 128, GROUPS),
                                              ("ragged_dot", None, GROUPS),
                                              ("tiled", 128, DECODE)])
def test_matches_a_loop_over_groups(x64, impl, tile, GROUPS):  # noqa: N803
  rng = np.random.default_rng(0)
  m, h, f = sum(GROUPS), 6, 3
  x, w = rng.normal(size=(m, h)), rng.normal(size=(len(GROUPS), h, f))
  dy = rng.normal(size=(m, f))
  sizes = jnp.asarray(GROUPS, jnp.int32)
  kw = {} if tile is None else {"tile": tile}
  fn = lambda x, w: grouped_matmul(x, w, sizes, impl=impl, **kw)  # noqa: E731
  y, vjp = jax.vjp(fn, jnp.asarray(x), jnp.asarray(w))
  np.testing.assert_allclose(np.asarray(y), numpy_grouped(x, w, GROUPS), atol=1e-12, rtol=0)
  dx, dw = vjp(jnp.asarray(dy))
  # y_i = x_i W_g(i): dx_i = dy_i W_g(i)^T, dW_g = sum over the group's rows x_i^T dy_i
  want_dx = numpy_grouped(dy, np.swapaxes(w, 1, 2), GROUPS)
  bounds = np.cumsum([0] + GROUPS)
  want_dw = np.stack([x[a:b].T @ dy[a:b] for a, b in zip(bounds[:-1], bounds[1:])])
  np.testing.assert_allclose(np.asarray(dx), want_dx, atol=1e-12, rtol=0)
  np.testing.assert_allclose(np.asarray(dw), want_dw, atol=1e-12, rtol=0)


def test_unknown_impl_is_refused():
  with pytest.raises(ValueError, match="grouped matmul"):
    grouped_matmul(jnp.zeros((2, 3)), jnp.zeros((1, 3, 4)), jnp.asarray([2]), impl="loop")


@pytest.mark.parametrize("impl", ["tiled", "ragged_dot"])
def test_rows_past_the_groups_give_zeros(x64, impl):
  """Expert parallelism fills fixed-size buffers only in part: rows past sum(group_sizes)
  give 0 and receive no gradient, the grouped rows are unaffected."""
  rng = np.random.default_rng(1)
  used, m, h, f = sum(GROUPS), sum(GROUPS) + 7, 6, 3
  x, w = rng.normal(size=(m, h)), rng.normal(size=(len(GROUPS), h, f))
  dy = rng.normal(size=(m, f))
  sizes = jnp.asarray(GROUPS, jnp.int32)
  kw = {"tile": 4} if impl == "tiled" else {}
  fn = lambda x, w: grouped_matmul(x, w, sizes, impl=impl, **kw)  # noqa: E731
  y, vjp = jax.vjp(fn, jnp.asarray(x), jnp.asarray(w))
  want = np.concatenate([numpy_grouped(x[:used], w, GROUPS), np.zeros((m - used, f))])
  np.testing.assert_allclose(np.asarray(y), want, atol=1e-12, rtol=0)
  dx, dw = vjp(jnp.asarray(dy))
  want_dx = np.concatenate([numpy_grouped(dy[:used], np.swapaxes(w, 1, 2), GROUPS),
                            np.zeros((m - used, h))])
  bounds = np.cumsum([0] + GROUPS)
  want_dw = np.stack([x[a:b].T @ dy[a:b] for a, b in zip(bounds[:-1], bounds[1:])])
  np.testing.assert_allclose(np.asarray(dx), want_dx, atol=1e-12, rtol=0)
  np.testing.assert_allclose(np.asarray(dw), want_dw, atol=1e-12, rtol=0)


def _float32_bound(a, b, terms):
  """|fl32(a @ b) - a @ b| <= (terms + 3) u (|a| @ |b|), u = 2^-24: the float32 rounding of a
  and b (u each, 2u per product), a sum of `terms` products (gamma_terms), and the rounding
  of the result (u); the standard bound on a computed dot product."""
  return (terms + 3) * 2.0**-24 * (np.abs(a) @ np.abs(b))


@pytest.mark.parametrize("groups,extra", [(GROUPS, 7), ([130, 0, 3, 0, 0, 140, 1, 0], 0),
                                          ([0] * 7 + [129], 200)])
def test_megablox_matches_a_loop_over_groups(groups, extra):
  """The Pallas TPU kernels (interpret mode) in float32 against the float64 loop: groups that
  share a row tile, span several tiles (TILE = 128), are empty, and `extra` unfilled rows past
  the last group (zeros out, no gradient in), with m no multiple of the tile."""
  rng = np.random.default_rng(2)
  used, h, f = sum(groups), 6, 3
  m = used + extra
  x, w = rng.normal(size=(m, h)), rng.normal(size=(len(groups), h, f))
  dy = rng.normal(size=(m, f))
  x32, w32, dy32 = (jnp.asarray(a, jnp.float32) for a in (x, w, dy))
  sizes = jnp.asarray(groups, jnp.int32)
  fn = lambda x, w: grouped_matmul(x, w, sizes, impl="megablox", interpret=True)  # noqa: E731
  y, vjp = jax.vjp(fn, x32, w32)
  dx, dw = vjp(dy32)
  assert y.dtype == dx.dtype == dw.dtype == jnp.float32
  bounds = np.cumsum([0] + groups)
  spans = list(zip(bounds[:-1], bounds[1:]))
  zero = lambda a: np.zeros((extra, a.shape[1]))  # noqa: E731
  want_y = np.concatenate([x[a:b] @ w[g] for g, (a, b) in enumerate(spans)] + [zero(y)])
  tol_y = np.concatenate([_float32_bound(x[a:b], w[g], h) for g, (a, b) in enumerate(spans)]
                         + [zero(y)])
  assert np.all(np.abs(np.asarray(y) - want_y) <= tol_y)
  wt = np.swapaxes(w, 1, 2)
  want_dx = np.concatenate([dy[a:b] @ wt[g] for g, (a, b) in enumerate(spans)] + [zero(dx)])
  tol_dx = np.concatenate([_float32_bound(dy[a:b], wt[g], f) for g, (a, b) in enumerate(spans)]
                          + [zero(dx)])
  assert np.all(np.abs(np.asarray(dx) - want_dx) <= tol_dx)
  for g, (a, b) in enumerate(spans):  # dW_g over the group's rows only; empty groups: 0
    want = x[a:b].T @ dy[a:b]
    assert np.all(np.abs(np.asarray(dw[g]) - want) <= _float32_bound(x[a:b].T, dy[a:b], b - a))
