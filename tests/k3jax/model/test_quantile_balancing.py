"""Quantile Balancing (docs/model.md#quantile-balancing) on skewed synthetic router scores, against
numpy loops.

"One update balances the batch" is read as the issue states it: with the old per-token
thresholds alpha_i, expert j is picked by token i iff r_ij = alpha_i - s_ij < b_hat_j, and
#{i : r_ij < b_hat_j} must be N k / E (+-1) for every expert.
"""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from k3jax.model.quantile_balancing import (
  expert_load_stats,
  quantile_balancing_bias,
  quantile_bias_targets,
)

E, K, N, DIM = 32, 4, 16384, 16
U32 = 2.0**-24  # float32 unit roundoff


def centring_error(b_hat):
  """Bound on |b - (b_hat - mean(b_hat))| for b = quantile_balancing_bias's fp32 result: the
  float32 sum of E terms in any order is within (E - 1) u sum|b_hat| of the exact sum (Higham
  §4.2), the division by E = 32 is exact, the subtraction rounds once (u |b|)."""
  b_hat = np.abs(np.asarray(b_hat, np.float64))
  return U32 * ((E - 1) * b_hat.mean(-1, keepdims=True) + b_hat + b_hat.mean(-1, keepdims=True))


def order_tolerance(b_hat):
  """|difference| allowed between two fp32 runs of quantile_balancing_bias on the same scores
  (jit or eager, vmapped or not, sharded or not, padded or not). Their b_hat are the same IEEE
  operations on the same values: sorts, order statistics, integer bin counts, exact psums of
  zero-padded rows; only the centring's mean may be summed in another order, and the
  histogram's lo + (bin + frac) * width may or may not be contracted into one fused
  multiply-add (u |b_hat|). Each side is within `centring_error` + u |b_hat| of the exact."""
  return 2 * (centring_error(b_hat) + U32 * np.abs(np.asarray(b_hat, np.float64)))


def assert_same_bias(got, want, b_hat, what=""):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  err, tol = np.abs(got - want), order_tolerance(b_hat)
  assert np.all(err <= tol), (what, err.max(), tol.min())


class SkewedRouter:
  """s = sigmoid(h W + offset): token-dependent scores with a strong per-expert popularity
  skew (offsets from -3 to 1), so bias-free routing leaves some experts dead."""

  def __init__(self, seed=0):
    self.rng = np.random.default_rng(seed)
    self.w = self.rng.normal(size=(DIM, E)) / math.sqrt(DIM)
    self.offset = np.linspace(-3.0, 1.0, E)

  def batch(self, n=N):
    h = self.rng.normal(size=(n, DIM))
    return (1.0 / (1.0 + np.exp(-(h @ self.w + self.offset)))).astype(np.float32)


def route_np(scores, bias, k=K):
  """Top-k experts of s + b per token, numpy."""
  return np.argsort(-(scores + bias), axis=1, kind="stable")[:, :k]


def thresholds_np(scores, bias, k=K):
  """r = alpha - s in float64, alpha the (k+1)-th largest of s + b (numpy sort per row)."""
  biased = scores.astype(np.float64) + bias.astype(np.float64)
  alpha = -np.sort(-biased, axis=1)[:, k]
  return alpha[:, None] - scores.astype(np.float64)


def load_np(topk, e=E):
  counts = np.zeros(e, np.int64)
  for row in topk:
    for j in row:
      counts[j] += 1
  return counts


def test_one_update_gives_each_expert_nk_over_e_against_old_thresholds():
  """K3 thresholds ("k3"): #{i : r_ij < b_hat_j} = N k / E (+-1) for every expert, except
  where the quantile falls on the atom r_ij = b_old_j (the tokens whose (k+1)-th choice is j
  all have exactly that r); there b_hat_j = b_old_j and the atom straddles the target."""
  router = SkewedRouter(1)
  s = router.batch()
  b_old = np.random.default_rng(2).normal(size=E).astype(np.float32) * 0.1
  b_hat = np.asarray(quantile_bias_targets(jnp.asarray(s), jnp.asarray(b_old), K,
                                           thresholds="k3"))
  r = thresholds_np(s, b_old)
  c = math.ceil(N * K / E)
  assert c == N * K / E
  # the pairs selected now are exactly those with r_ij < b_old_j (the direction)
  picked = np.zeros((N, E), bool)
  np.put_along_axis(picked, route_np(s, b_old), True, axis=1)
  np.testing.assert_array_equal(picked, r < b_old[None, :])
  on_atom = np.abs(b_hat - b_old) < 1e-6
  below = (r < b_hat[None, :] - 1e-6 * on_atom).sum(axis=0)
  upto = (r <= b_hat[None, :] + 1e-6 * on_atom).sum(axis=0)
  assert np.all(np.abs(below[~on_atom] - c) <= 1), below
  assert np.all((below <= c) & (c <= upto)), (below, upto)
  print(f"\nk3 thresholds: {on_atom.sum()} of {E} experts' quantile on the b_old atom")
  # exact = midpoint of each expert's c-th and (c+1)-th smallest r (numpy sort per column)
  want = np.array([np.mean(np.sort(r[:, j])[c - 1:c + 1]) for j in range(E)])
  # b_hat's fp32 r = fl(fl(s + b)_alpha - s) is within u (|alpha| + |r|) of the float64 r, an
  # order statistic moves by at most the largest such change (per expert), and the midpoint
  # rounds once more (u |b_hat|): ~2e-7 here, the same on any machine (no sums)
  alpha = r + s.astype(np.float64)
  tol = U32 * (np.abs(alpha).max() + np.abs(r).max(axis=0) + np.abs(want))
  assert np.all(np.abs(b_hat - want) <= tol), (np.abs(b_hat - want) / tol).max()


def test_per_expert_thresholds_route_exactly_nk_over_e():
  """thresholds="per_expert": moving expert j alone to b_hat_j and re-routing the same batch
  (numpy top-k) gives j exactly N k / E tokens, for every j."""
  router = SkewedRouter(1)
  s = router.batch()
  b_old = np.random.default_rng(2).normal(size=E).astype(np.float32) * 0.1
  b_hat = np.asarray(quantile_bias_targets(jnp.asarray(s), jnp.asarray(b_old), K,
                                           thresholds="per_expert"))
  c = N * K // E
  for j in range(E):
    b = b_old.copy()
    b[j] = b_hat[j]
    got = int(np.sum(route_np(s, b) == j))
    assert abs(got - c) <= 1, (j, got)


@pytest.mark.parametrize("method,thresholds", [("exact", "k3"), ("histogram", "k3"),
                                               ("exact", "per_expert")])
def test_repeated_updates_balance_fresh_batches(method, thresholds):
  router = SkewedRouter(3)
  bias = np.zeros(E, np.float32)
  update = jax.jit(quantile_balancing_bias,
                   static_argnames=("top_k", "method", "bins", "thresholds"))
  max_mean, dead = [], []
  for _ in range(7):
    s = router.batch()  # a fresh batch, routed with the bias of the previous batches
    topk = route_np(s, bias)
    counts = load_np(topk)
    stats = expert_load_stats(jnp.asarray(topk), E)
    np.testing.assert_array_equal(np.asarray(stats.counts), counts)
    np.testing.assert_allclose(float(stats.max_over_mean), counts.max() / counts.mean(),
                               rtol=1e-6)
    np.testing.assert_allclose(float(stats.dead_fraction), np.mean(counts == 0), rtol=1e-6)
    max_mean.append(counts.max() / counts.mean())
    dead.append(np.mean(counts == 0))
    b_hat = np.asarray(quantile_bias_targets(jnp.asarray(s), jnp.asarray(bias), K,
                                             method=method, thresholds=thresholds))
    bias = np.asarray(update(jnp.asarray(s), jnp.asarray(bias), top_k=K, method=method,
                             thresholds=thresholds))
    assert abs(np.mean(bias, dtype=np.float64)) <= np.mean(centring_error(b_hat))  # centred
  print(f"\n{method}/{thresholds}: max/mean load after 0..6 updates "
        + " ".join(f"{x:.3f}" for x in max_mean) + "; dead " + " ".join(f"{x:.3f}" for x in dead))
  assert max_mean[0] > 3.0 and dead[0] > 0.0  # the skew is real
  assert all(x < 1.1 for x in max_mean[4:]), max_mean
  assert all(x == 0.0 for x in dead[1:]), dead


@pytest.mark.parametrize("bins", [100, 1000])
def test_exact_and_histogram_agree_within_one_bin(bins):
  router = SkewedRouter(4)
  s = router.batch()
  b = np.random.default_rng(5).normal(size=E).astype(np.float32) * 0.2
  # the numpy r below is the k3-threshold one; compare both estimators on that r
  exact = np.asarray(quantile_bias_targets(jnp.asarray(s), jnp.asarray(b), K,
                                           thresholds="k3"))
  hist = np.asarray(quantile_bias_targets(jnp.asarray(s), jnp.asarray(b), K,
                                          method="histogram", bins=bins, thresholds="k3"))
  r = thresholds_np(s, b)
  width = (r.max(axis=0) - r.min(axis=0)) / bins
  gap = np.abs(exact - hist)
  print(f"\nbins={bins}: max |exact - histogram| = {gap.max():.2e} "
        f"= {np.max(gap / width):.3f} bin widths")
  assert np.all(gap <= width), gap / width
  # and the histogram value sits where the interpolated count is ceil(N k / E): the true count
  # below it is within the members of one bin of the target
  counts = (r < hist[None, :]).sum(axis=0)
  in_bin = np.array([np.sum(np.abs(r[:, j] - hist[j]) <= width[j]) for j in range(E)])
  assert np.all(np.abs(counts - math.ceil(N * K / E)) <= in_bin)


def test_padding_rows_are_ignored():
  router = SkewedRouter(6)
  s = router.batch(4096)
  b = np.zeros(E, np.float32)
  junk = np.random.default_rng(7).uniform(size=(512, E)).astype(np.float32) ** 8
  padded = np.concatenate([s[:1000], junk, s[1000:]])
  mask = np.ones(len(padded), bool)
  mask[1000:1512] = False
  for method in ("exact", "histogram"):
    want = quantile_balancing_bias(jnp.asarray(s), jnp.asarray(b), K, method=method)
    got = quantile_balancing_bias(jnp.asarray(padded), jnp.asarray(b), K, method=method,
                                  mask=jnp.asarray(mask))
    b_hat = quantile_bias_targets(jnp.asarray(s), jnp.asarray(b), K, method=method)
    assert_same_bias(got, want, b_hat, method)
  stats = expert_load_stats(jnp.asarray(route_np(padded, b)), E, mask=jnp.asarray(mask))
  np.testing.assert_array_equal(np.asarray(stats.counts), load_np(route_np(s, b)))


def test_bias_is_mean_zero_and_jit_matches_eager():
  s = jnp.asarray(SkewedRouter(8).batch(2048))
  b = jnp.asarray(np.random.default_rng(9).normal(size=E).astype(np.float32))
  for method in ("exact", "histogram"):
    eager = quantile_balancing_bias(s, b, K, method=method, bins=500)
    jitted = jax.jit(quantile_balancing_bias, static_argnames=("top_k", "method", "bins"))(
        s, b, top_k=K, method=method, bins=500)
    assert eager.shape == (E,) and eager.dtype == jnp.float32
    b_hat = quantile_bias_targets(s, b, K, method=method, bins=500)
    assert abs(np.mean(np.asarray(eager, np.float64))) <= np.mean(centring_error(b_hat))
    assert_same_bias(jitted, eager, b_hat, method)
  with pytest.raises(ValueError, match="unknown method"):
    quantile_balancing_bias(s, b, K, method="median")


def test_sharded_over_8_devices_equals_one_device():
  """Rows split over a data axis: the histogram reduces with one psum of [E, B] counts (plus
  pmin / pmax of the [E] ranges) and gives the single-device numbers."""
  devices = jax.devices()
  assert len(devices) == 8
  mesh = jax.make_mesh((8,), ("data",), devices=devices)
  rows, same = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
  s_np = SkewedRouter(10).batch(8 * 1024)
  b_np = np.random.default_rng(11).normal(size=E).astype(np.float32) * 0.1
  s, b = jax.device_put(s_np, rows), jax.device_put(b_np, same)
  topk = jax.device_put(route_np(s_np, b_np), rows)

  def per_device(s_local, b, topk_local):
    hist = quantile_balancing_bias(s_local, b, K, method="histogram", axis_name="data")
    exact = quantile_balancing_bias(s_local, b, K, method="exact", axis_name="data")
    stats = expert_load_stats(topk_local, E, axis_name="data")
    return hist, exact, stats.counts, stats.max_over_mean

  sharded = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P("data"), P(), P("data")),
                                  out_specs=(P(), P(), P(), P())))
  hist, exact, counts, max_mean = sharded(s, b, topk)
  s1, b1, topk1 = jnp.asarray(s_np), jnp.asarray(b_np), jnp.asarray(route_np(s_np, b_np))
  one = expert_load_stats(topk1, E)
  for method, got in (("histogram", hist), ("exact", exact)):
    assert_same_bias(got, quantile_balancing_bias(s1, b1, K, method=method),
                     quantile_bias_targets(s1, b1, K, method=method), method)
  np.testing.assert_array_equal(np.asarray(counts), np.asarray(one.counts))
  np.testing.assert_allclose(float(max_mean), float(one.max_over_mean), rtol=1e-7)

  # the histogram's collectives: pmin and pmax of the [E] ranges, one psum of [E, B] counts
  hist_only = jax.jit(jax.shard_map(
      lambda s, b: quantile_balancing_bias(s, b, K, method="histogram", axis_name="data"),
      mesh=mesh, in_specs=(P("data"), P()), out_specs=P()))
  text = hist_only.lower(s, b).as_text()
  reduced = [re.search(r"\) : \((tensor<[^>]*>)\)", text[m.end():]).group(1)
             for m in re.finditer(r"stablehlo\.all_reduce", text)]
  assert sorted(reduced) == [f"tensor<{E}x1000xi32>", f"tensor<{E}xf32>", f"tensor<{E}xf32>"]


def test_vmap_over_stacked_layers_equals_per_layer_calls():
  """The scanned model stacks router scores [layers, N, E] and biases [layers, E]; one vmapped
  call updates every MoE layer."""
  s = jnp.asarray(np.stack([SkewedRouter(20 + i).batch(2048) for i in range(3)]))
  b = jnp.asarray(np.random.default_rng(21).normal(size=(3, E)).astype(np.float32) * 0.1)
  for method in ("exact", "histogram"):
    got = jax.jit(jax.vmap(lambda s, b: quantile_balancing_bias(s, b, K, method=method)))(s, b)  # noqa: B023 - called at once
    for layer in range(3):
      assert_same_bias(got[layer], quantile_balancing_bias(s[layer], b[layer], K, method=method),
                       quantile_bias_targets(s[layer], b[layer], K, method=method), layer)
