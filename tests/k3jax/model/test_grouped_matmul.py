"""The grouped matmul of expert-sorted rows: "tiled" and "ragged_dot" against a numpy loop
over groups, forward and gradients, with empty groups, groups spanning several tiles and a
row count that is no multiple of the tile."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.model.grouped_matmul import grouped_matmul

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
