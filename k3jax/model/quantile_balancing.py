"""Quantile Balancing of the router bias (the K3 report §2.3.3; docs/model.md#quantile-balancing).

Once per optimizer step and MoE layer, from the router scores s [N, E] of the global batch
that was routed with bias b:

    alpha_i = (k+1)-th largest of (s_i + b)       # token i's threshold
    r_ij    = alpha_i - s_ij                      # token i picks j iff s_ij + b_j > alpha_i
                                                  #   <=>  b_j > r_ij
    b_hat_j = the value with #{i : r_ij < b_hat_j} = c,  c = ceil(N k / E)
            = the k/E quantile of r_{:, j}        # against the old thresholds, expert j
                                                  # would be picked by c tokens
    b_new   = b_hat - mean(b_hat)                 # top-k is shift invariant; keep it centred

b_new is used from the next step on: a batch is never routed with a bias derived from itself.
The direction: raising b_j lowers every r-comparison's bar, so an overloaded expert (more than
c of its r below b_j) gets b_hat_j < b_j and an underloaded one b_hat_j > b_j.

Two threshold rules (`thresholds=`), agreeing on every pair selected now:
  * "k3" (the default: the recipe as written): alpha_i, the (k+1)-th biased score, is every
    pair's threshold. "b_j > r_ij" is exact for the pairs selected now (j stays in the top-k
    iff it stays above the (k+1)-th).
  * "per_expert": for an unselected pair the bias j really needs is set by the k-th score it
    would displace, not the (k+1)-th; this exact per-pair threshold is the one for which "one
    update brings every expert to N k / E tokens (+-1)" holds (the K3 formula's atom at the
    old bias can keep an expert's bias unchanged for a step).

Two estimators of b_hat:
  * "exact": sort each expert's column of r; b_hat_j is the midpoint of its c-th and
    (c+1)-th smallest values, so exactly c entries lie below it (ties aside). With
    `axis_name` it all-gathers the scores (N_global x E per device: for one host or tests).
  * "histogram": per-expert histogram of r with `bins` bins; the bin that reaches c is read and
    b_hat interpolated linearly inside it (error < one bin width). Scalable: across data
    parallel devices the only large reduction is one psum of the [E, bins] int32 counts. The
    bin edges must be the same on every device, so each expert's range [min_i r_ij, max_i
    r_ij] is first reduced with pmin / pmax over `axis_name` (two [E] float vectors; a per
    expert range rather than one global range keeps the full `bins` resolution for every
    expert even when the biases spread the experts' r far apart).

Padding rows (`mask` False) take no part: they neither count towards N nor towards any bin.

In the train step (after the optimizer update, with the scores the forward returned): the
scanned model stacks scores [layers, N, E] and biases [layers, E], so one
`jax.lax.map` over the layers of `quantile_balancing_bias(s, b, k, method="histogram",
axis_name=AXES)` inside a shard_map over the batch mesh axes (AXES = ("data", "fsdp",
"expert"); one all-reduce of [E, bins] per layer), or `axis_name=None` without a mesh, where
the global batch is one array, updates every MoE layer; `expert_load_stats` maps the same way.
One layer at a time, not vmapped: the [N, E] temporaries (thresholds, bin indices) then exist
for one layer, not for all of them at once (K3 on a pod: docs/plan.md#what-got-it-there).
Everything is fp32 and jit-able (`top_k`, `method`, `bins`, `axis_name`, `thresholds` static).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

THRESHOLD_RULES = ("k3", "per_expert")


def _thresholds(scores_ne: jax.Array, bias_e: jax.Array, top_k: int,
                thresholds: str) -> jax.Array:
  """r_ij = threshold_ij - s_ij [N, E] (see `quantile_bias_targets` for the two rules)."""
  if not 0 < top_k < scores_ne.shape[-1]:
    raise ValueError(f"top_k={top_k} must be in [1, E) with E={scores_ne.shape[-1]}")
  scores_ne = scores_ne.astype(jnp.float32)
  biased_ne = scores_ne + bias_e.astype(jnp.float32)
  top_nk1 = jax.lax.top_k(biased_ne, top_k + 1)[0]
  alpha_n1 = top_nk1[:, top_k:]  # (k+1)-th largest
  if thresholds == "k3":
    return alpha_n1 - scores_ne
  if thresholds == "per_expert":
    # k-th largest among the *other* experts: alpha for a selected pair, the current k-th
    # score for an unselected one (it must displace that expert to enter)
    kth_n1 = top_nk1[:, top_k - 1:top_k]
    return jnp.where(biased_ne > alpha_n1, alpha_n1, kth_n1) - scores_ne
  raise ValueError(f"unknown thresholds {thresholds!r} ({' | '.join(THRESHOLD_RULES)})")


def _target_count(n: jax.Array, top_k: int, num_experts: int) -> jax.Array:
  """c = ceil(N k / E) in integers (N k stays far below 2^31 for any real global batch)."""
  nk = n.astype(jnp.int32) * top_k
  return (nk + num_experts - 1) // num_experts


def _gather_rows(x: jax.Array, axis_name) -> jax.Array:
  """All rows of every device, in device order, as a replicated (invariant) value: each device
  writes its rows into a zero global array and a psum fills in the rest. (all_gather's result
  is typed as device-varying inside shard_map, so it could not be returned replicated.)"""
  n = x.shape[0]
  dtype = jnp.int32 if x.dtype == bool else x.dtype  # psum needs numbers
  full = jnp.zeros((jax.lax.axis_size(axis_name) * n,) + x.shape[1:], dtype)
  # int32 indices throughout (a bare 0 would be int64 under jax_enable_x64)
  start = ((jax.lax.axis_index(axis_name) * n).astype(jnp.int32),) + (jnp.int32(0),) * (x.ndim - 1)
  return jax.lax.psum(jax.lax.dynamic_update_slice(full, x.astype(full.dtype), start), axis_name)


def _exact(r_ne: jax.Array, valid_n: jax.Array, top_k: int) -> jax.Array:
  n_valid = jnp.sum(valid_n.astype(jnp.int32))
  c = _target_count(n_valid, top_k, r_ne.shape[1])
  # padding rows sort last, after every real value
  sorted_ne = jnp.sort(jnp.where(valid_n[:, None], r_ne, jnp.inf), axis=0)
  lo = jax.lax.dynamic_index_in_dim(sorted_ne, c - 1, axis=0, keepdims=False)
  hi = jax.lax.dynamic_index_in_dim(sorted_ne, jnp.minimum(c, n_valid - 1), axis=0,
                                    keepdims=False)
  return 0.5 * (lo + hi)


def _histogram(r_ne: jax.Array, valid_n: jax.Array, top_k: int, bins: int,
               axis_name) -> jax.Array:
  n, e = r_ne.shape
  valid = valid_n[:, None]
  lo_e = jnp.min(jnp.where(valid, r_ne, jnp.inf), axis=0)
  hi_e = jnp.max(jnp.where(valid, r_ne, -jnp.inf), axis=0)
  if axis_name is not None:
    lo_e = jax.lax.pmin(lo_e, axis_name)
    hi_e = jax.lax.pmax(hi_e, axis_name)
  # a degenerate range (one distinct value) still needs a non-zero width
  width_e = jnp.maximum(hi_e - lo_e, jnp.finfo(jnp.float32).tiny * bins) / bins
  bin_ne = jnp.clip(jnp.floor((r_ne - lo_e) / width_e), 0, bins - 1).astype(jnp.int32)
  flat = (jnp.arange(e, dtype=jnp.int32)[None, :] * bins + bin_ne).reshape(-1)
  weights = jnp.broadcast_to(valid, (n, e)).reshape(-1).astype(jnp.int32)
  counts_eb = jnp.bincount(flat, weights, length=e * bins).astype(jnp.int32).reshape(e, bins)
  if axis_name is not None:
    counts_eb = jax.lax.psum(counts_eb, axis_name)  # the one [E, B] reduction
  n_total = jnp.sum(counts_eb[0])  # every valid row lands in exactly one bin per expert
  c = _target_count(n_total, top_k, e)
  cum_eb = jnp.cumsum(counts_eb, axis=1)
  bin_e = jnp.argmax(cum_eb >= c, axis=1)  # first bin whose cumulative count reaches c
  in_bin_e = jnp.take_along_axis(counts_eb, bin_e[:, None], axis=1)[:, 0]
  before_e = jnp.take_along_axis(cum_eb, bin_e[:, None], axis=1)[:, 0] - in_bin_e
  frac_e = (c - before_e).astype(jnp.float32) / jnp.maximum(in_bin_e, 1).astype(jnp.float32)
  return lo_e + (bin_e.astype(jnp.float32) + frac_e) * width_e


def quantile_bias_targets(scores: jax.Array, bias: jax.Array, top_k: int, *,
                          method: Literal["exact", "histogram"] = "exact", bins: int = 1000,
                          axis_name=None, mask: jax.Array | None = None,
                          thresholds: Literal["k3", "per_expert"] = "k3"
                          ) -> jax.Array:
  """b_hat [E] (not centred): the k/E quantile of each expert's r = threshold - s, fp32.

  Args:
    scores: router sigmoid scores s [N, E] (this device's rows when `axis_name` is set).
    bias: the bias b [E] those rows were routed with.
    top_k: experts per token k.
    method: "exact" (sort) or "histogram" (see module docstring).
    bins: histogram bins B.
    axis_name: mapped axis (shard_map / pmap) the rows are split over; None for one device.
    mask: optional [N] bool, False for padding rows.
    thresholds: "k3" (default; the K3 report's formula): one threshold per token, alpha_i = (k+1)-th
      largest of s_i + b. Exact for the pairs selected now (j stays iff b_j > r_ij), but for the
      unselected ones it is below the k-th score they would have to displace; in particular
      every token whose (k+1)-th choice is j puts r_ij = b_j exactly, an atom at the old bias,
      so an expert whose quantile falls in it keeps its bias for that step.
      "per_expert": threshold_ij = k-th largest of s_i + b over the experts other
      than j, the exact bias j needs to be in token i's top-k when only b_j changes:
      #{r_ij < b_hat_j} is then the number of tokens that pick j if j alone moves to b_hat_j.
  """
  n = scores.shape[0]
  valid_n = jnp.ones((n,), bool) if mask is None else mask.astype(bool)
  if method == "exact":
    if axis_name is not None:
      scores, valid_n = _gather_rows(scores, axis_name), _gather_rows(valid_n, axis_name) > 0
    return _exact(_thresholds(scores, bias, top_k, thresholds), valid_n, top_k)
  if method == "histogram":
    return _histogram(_thresholds(scores, bias, top_k, thresholds), valid_n, top_k, bins,
                      axis_name)
  raise ValueError(f"unknown method {method!r} (exact | histogram)")


def quantile_balancing_bias(scores: jax.Array, bias: jax.Array, top_k: int, *,
                            method: Literal["exact", "histogram"] = "exact", bins: int = 1000,
                            axis_name=None, mask: jax.Array | None = None,
                            thresholds: Literal["k3", "per_expert"] = "k3"
                            ) -> jax.Array:
  """The next router bias b_new = b_hat - mean(b_hat) [E], fp32, from scores [N, E] routed with
  `bias` [E]. Arguments as `quantile_bias_targets`; `top_k`, `method`, `bins`, `axis_name`,
  `thresholds` are static under jit."""
  b_hat = quantile_bias_targets(scores, bias, top_k, method=method, bins=bins,
                                axis_name=axis_name, mask=mask, thresholds=thresholds)
  return b_hat - jnp.mean(b_hat)


class ExpertLoad(NamedTuple):
  counts: jax.Array         # [E] int32 tokens routed to each expert
  max_over_mean: jax.Array  # max load / mean load (1.0 = perfectly balanced)
  dead_fraction: jax.Array  # fraction of experts that received no token


def expert_load_stats(topk_idx: jax.Array, num_experts: int, *, mask: jax.Array | None = None,
                      axis_name=None) -> ExpertLoad:
  """Load of each expert from the selected experts topk_idx [N, k] (for logging before and
  after a Quantile Balancing update)."""
  n, k = topk_idx.shape
  weights = None if mask is None else jnp.broadcast_to(mask.astype(jnp.int32)[:, None], (n, k))
  counts_e = jnp.bincount(topk_idx.reshape(-1), None if weights is None else weights.reshape(-1),
                          length=num_experts).astype(jnp.int32)
  if axis_name is not None:
    counts_e = jax.lax.psum(counts_e, axis_name)
  mean = jnp.sum(counts_e) / num_experts
  return ExpertLoad(counts=counts_e,
                    max_over_mean=jnp.max(counts_e) / jnp.maximum(mean, 1e-20),
                    dead_fraction=jnp.mean((counts_e == 0).astype(jnp.float32)))
