"""The train step's semantics on the micro model: packing is exact, Quantile Balancing routes
the next batch with a bias derived from this batch only, gradient accumulation equals one big
batch, QK-clip rescales exactly the MLA heads.

Every test runs the micro model in float64 (docs/correctness.md): each compares two computations
that are the same math in another order (a row packed or alone, two micro-batches or one, the train
program or the forward one), and in float64 (u = 2^-53) those agree to ~1e-15 of their scale on
any machine, so TOL64 = 1e-10 of the scale separates summation order from a real difference
(a token leaking across segments moves an NLL by >= 1e-3). Quantile Balancing itself is fp32 by
design; its bound is derived in `qb_tolerance`. The float32 train step runs in test_run.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from k3jax.execution import Execution
from k3jax.model.quantile_balancing import quantile_balancing_bias
from k3jax.train import data
from k3jax.train import step as step_lib
from k3jax.train.loop import step_config

from .helpers import MICRO, options

T = 32
ROWS = 4


F64 = Execution(dtype="float64", param_dtype="float64")
TOL64 = 1e-10
U32 = 2.0**-24


@pytest.fixture(scope="module")
def steps():
  with jax.enable_x64(True):
    return step_lib.build(MICRO, F64, step_config(options("unused", "unused")))


@pytest.fixture(scope="module")
def params_bias():
  with jax.enable_x64(True):
    params, bias = step_lib.init_params(MICRO, F64, 0)
    # a non-zero starting bias, so "routed with b_t" and "routed with b_t+1" differ
    b = bias["moe"]["gate"]["bias"]
    noise = jax.random.normal(jax.random.key(7), b.shape, b.dtype) * 0.05
    # committed like the train loop's state, so every call here lowers to one program
    return step_lib.place((params, {"moe": {"gate": {"bias": b + noise}}}))


@pytest.fixture(autouse=True)
def _float64():
  with jax.enable_x64(True):
    yield


def qb_tolerance(b_hat, scores):
  """|difference| allowed between two runs of fp32 Quantile Balancing (b = b_hat - mean(b_hat),
  quantile_balancing.py) on float64 router scores that agree to ~1e-15. The fp32 casts of the
  scores then agree but for one ulp where a cast straddles a rounding boundary, and b_hat, an
  order statistic of r = alpha - s (alpha itself one of s + b), moves by at most twice that:
  2 u max|s| per side, plus the roundings of s + b and of r, 2 u (max|s| + max|b_hat|); the
  centring's fp32 mean of E terms, summed in another order, adds (E - 1) u sum|b_hat| / E per
  side, and the final subtraction u |b|. u = 2^-24; ~1e-6 for this model's O(1) biases."""
  b_hat, s = np.abs(np.asarray(b_hat, np.float64)), np.max(np.abs(np.asarray(scores)))
  E = b_hat.shape[-1]
  per_side = 4 * s + 2 * b_hat.max() + (E - 1) * b_hat.mean(-1, keepdims=True) + b_hat
  return 2 * U32 * per_side


def copy(tree):
  return jax.tree.map(jnp.copy, tree)  # the train step donates its input


def rows_batch(rows, micro_batches=1):
  """Rows of (tokens, segment ids) of length T+1 -> a model batch [A, b, T]."""
  tokens = np.stack([r[0] for r in rows])
  seg = np.stack([r[1] for r in rows])
  return data.rows_to_batch(tokens, seg, micro_batches)


def random_rows(seed, n=ROWS):
  rng = np.random.default_rng(seed)
  rows = []
  for _ in range(n):
    tokens = rng.integers(0, 256, T + 1)
    cut = int(rng.integers(5, T - 5))
    seg = np.r_[np.ones(cut), np.full(T + 1 - cut - 3, 2), np.zeros(3)].astype(np.int32)
    rows.append((np.where(seg > 0, tokens, 0), seg))
  return rows


def test_packed_row_equals_the_sequences_alone(steps, params_bias):
  """Two sequences packed in one row (then padding) give, position by position, the NLL each
  gets alone at the start of its own row: KDA state and conv, MLA and AttnRes keep them apart
  given the segment ids, and no position predicts across the boundary."""
  rng = np.random.default_rng(0)
  a, b = rng.integers(0, 256, 11), rng.integers(0, 256, 14)
  pad = lambda x, seg: (np.r_[x, np.zeros(T + 1 - len(x), int)],
                        np.r_[seg, np.zeros(T + 1 - len(seg), int)])
  rows = [pad(np.r_[a, b], np.r_[np.ones(11), np.full(14, 2)]),   # packed
          pad(a, np.ones(11)),                                      # a alone
          pad(b, np.ones(14)),                                      # b alone
          pad(np.r_[b, a], np.r_[np.ones(14), np.full(11, 2)])]   # packed the other way
  batch = jax.tree.map(lambda x: x[0], rows_batch(rows))
  params, bias = params_bias
  nll, _, _ = steps.forward(params, bias, batch["inputs"], batch["targets"],
                            batch["segment_ids"], batch["loss_mask"])
  nll, mask = np.asarray(nll), batch["loss_mask"]
  assert mask[0].sum() == 10 + 13 and mask[0, 10] == 0  # a's last token does not predict b
  assert nll.dtype == np.float64
  close = lambda a, b: np.testing.assert_allclose(a, b, atol=TOL64, rtol=0)
  close(nll[0, :10], nll[1, :10])
  close(nll[0, 11:24], nll[2, :13])
  close(nll[3, :13], nll[2, :13])
  close(nll[3, 14:24], nll[1, :10])
  packed_loss = nll[0].sum() / mask[0].sum()
  separate_loss = (nll[1].sum() + nll[2].sum()) / (mask[1].sum() + mask[2].sum())
  close(packed_loss, separate_loss)
  assert np.all(nll[~mask] == 0) and np.all(nll[mask] > 0)


def expected_bias(steps, params, bias, batch):
  """QB of every MoE layer from a forward of `batch` with (params, bias); and its loss."""
  flat = jax.tree.map(lambda x: x.reshape(-1, T), batch)
  params, bias = step_lib.place((params, bias))
  nll, scores, _ = steps.forward(params, bias, flat["inputs"], flat["targets"],
                                 flat["segment_ids"], flat["loss_mask"])
  mask = jnp.asarray(flat["segment_ids"].reshape(-1) != 0)
  b_t = bias["moe"]["gate"]["bias"]
  want = jax.vmap(lambda s, b: quantile_balancing_bias(
      s, b, MICRO.num_experts_per_token, mask=mask))(scores, b_t)
  return np.asarray(want), float(np.sum(nll) / flat["loss_mask"].sum()), np.asarray(scores)


def test_qb_bias_for_the_next_step_comes_from_this_batch(steps, params_bias):
  params, bias = params_bias
  b0 = np.asarray(bias["moe"]["gate"]["bias"])
  x, y = rows_batch(random_rows(1)), rows_batch(random_rows(2))
  want_b1, want_loss_x, scores_x = expected_bias(steps, params, bias, x)

  state = step_lib.place(steps.init(copy(params), copy(bias), step_lib.new_rng(0)))
  state, mx = steps.train(state, x, step_lib.NO_QK_CLIP)
  b1 = np.asarray(state["router_bias"]["moe"]["gate"]["bias"])
  # batch x was routed with b_t (its loss is the forward loss under b_t) ...
  np.testing.assert_allclose(float(mx["loss"]), want_loss_x, atol=TOL64 * want_loss_x, rtol=0)
  # ... and b_t+1 is QB of x's own router scores under (theta_t, b_t)
  assert np.all(np.abs(b1 - want_b1) <= qb_tolerance(want_b1, scores_x)), np.abs(b1 - want_b1)
  assert np.abs(b1 - b0).max() > 1e-3
  # centred: the fp32 mean's and subtraction's roundings, <= (E + 1) u mean|b| ~ 3e-7 here
  np.testing.assert_allclose(b1.mean(axis=-1), 0.0, atol=1e-6)
  # QB improves this batch's balance: the choices b_t+1 makes are more even than b_t's
  assert np.all(mx["load_max_mean_after"] <= mx["load_max_mean_before"] + 1e-6)

  # step t+1 routes y with b_t+1 and theta_t+1, and derives b_t+2 from y alone
  theta1 = copy(state["params"])
  want_b2, want_loss_y, scores_y = expected_bias(steps, theta1, {"moe": {"gate": {"bias": b1}}},
                                                 y)
  state, my = steps.train(state, y, step_lib.NO_QK_CLIP)
  np.testing.assert_allclose(float(my["loss"]), want_loss_y, atol=TOL64 * want_loss_y, rtol=0)
  b2 = np.asarray(state["router_bias"]["moe"]["gate"]["bias"])
  assert np.all(np.abs(b2 - want_b2) <= qb_tolerance(want_b2, scores_y)), np.abs(b2 - want_b2)
  assert int(state["step"]) == 2


def test_accumulation_equals_one_batch(steps, params_bias):
  """A=2 micro-batches of 2 rows against one batch of 4 rows: the same loss, gradient norm,
  router bias, gradient and updated parameters. The gradient is read from the optimizer state:
  after one step every first moment is (1 - b1) * clipped gradient and Adam's second moment its
  square, so equal moments are equal gradients. The two differ only in summation order
  (float64: ~1e-15 of each quantity's scale); Newton-Schulz amplifies that noise in the Muon
  update by at most 4^5 (test_muon.py's NS_SLOPE), still ~1e-12, inside TOL64. (In float32 the
  same 1e-7 noise legitimately shows as ~1e-5 in an update.)"""
  params, bias = params_bias
  rows = random_rows(3)
  outs = []
  for a in (1, 2):
    state = step_lib.place(steps.init(copy(params), copy(bias), step_lib.new_rng(0)))
    state, metrics = steps.train(state, rows_batch(rows, micro_batches=a), step_lib.NO_QK_CLIP)
    outs.append((jax.device_get(state), jax.device_get(metrics)))
  (s1, m1), (s2, m2) = outs
  for key in ("loss", "grad_norm", "loss_tokens"):
    np.testing.assert_allclose(m1[key], m2[key], rtol=TOL64, atol=0, err_msg=key)
  b_1, b_2 = (np.asarray(s["router_bias"]["moe"]["gate"]["bias"]) for s in (s1, s2))
  assert np.all(np.abs(b_1 - b_2) <= qb_tolerance(b_2, 1.0)), np.abs(b_1 - b_2)  # scores <= 1
  (first1, second1), (first2, second2) = moments(s1["opt_state"]), moments(s2["opt_state"])
  assert len(first1) == len(jax.tree.leaves(s1["params"]))  # one moment per parameter
  # TOL64 of the gradient's scale (the largest moment), as for the loss and the norm: an entry
  # that is a sum of cancelling per-token terms carries the rounding of the terms, not of the
  # (smaller) result (in float32, a 96-entry moment whose entries span 1e-22..1e-4 differed by
  # 1.4e-5 of its own largest entry between the two summation orders).
  for kind in (zip(first1, first2), zip(second1, second2)):
    pairs = list(kind)
    scale = max(float(np.abs(g2).max()) for _, g2 in pairs)
    for g1, g2 in pairs:
      assert g1.dtype == np.float64
      np.testing.assert_allclose(g1, g2, rtol=0, atol=TOL64 * scale)
  for p1, p2 in zip(jax.tree.leaves(s1["params"]), jax.tree.leaves(s2["params"])):
    np.testing.assert_allclose(p1, p2, rtol=0, atol=TOL64 * max(1.0, np.abs(p2).max()))


def moments(opt_state):
  """(first moments, square roots of Adam's second moments): both linear in |gradient|."""
  from k3jax.optim import ScaleByPerHeadMuonState
  kinds = (optax.ScaleByAdamState, ScaleByPerHeadMuonState)
  first, second = [], []
  for node in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, kinds)):
    if isinstance(node, kinds):
      first += jax.tree.leaves(node.mu)
      if isinstance(node, optax.ScaleByAdamState):
        second += [np.sqrt(v) for v in jax.tree.leaves(node.nu)]
  return first, second


def test_qk_clip_rescales_exactly_the_mla_query_and_key_heads(steps, params_bias):
  """The same step with a threshold below every head's max logit and with none (inf, the same
  compiled program): only MLA q_b and k_b change, each head's block by one factor, with
  gamma = tau / S_max per head: k_b and q_b's nope part by sqrt(gamma), q_b's rope part by
  gamma; the smallest gamma is tau over the largest logit the step reports."""
  params, bias = params_bias
  x = rows_batch(random_rows(4))
  tau = np.float32(1e-3)
  out = []
  for threshold in (step_lib.NO_QK_CLIP, tau):
    state = step_lib.place(steps.init(copy(params), copy(bias), step_lib.new_rng(0)))
    out.append(jax.device_get(steps.train(state, x, threshold)))
  (free, m_free), (clipped, m_clip) = out
  np.testing.assert_array_equal(m_free["mla_max_logit"], m_clip["mla_max_logit"])
  flat_free = jax.tree_util.tree_flatten_with_path(free["params"])[0]
  flat_clip = jax.tree.leaves(clipped["params"])
  nope = MICRO.qk_nope_head_dim
  gammas = {}
  for (path, a), b in zip(flat_free, flat_clip):
    name = jax.tree_util.keystr(path)
    if "mla" in name and ("q_b_proj" in name or "k_b_proj" in name):
      ratio = b / a                                  # [layers, in, heads, out]
      per_head = ratio[:, :1, :, :1]
      if "k_b_proj" in name:
        np.testing.assert_allclose(ratio, np.broadcast_to(per_head, ratio.shape), rtol=1e-5)
        gamma = gammas["k_b"] = per_head[:, 0, :, 0] ** 2  # [layers, heads]
        assert np.all(gamma < 1)
        np.testing.assert_allclose(gamma.min(axis=-1), tau / m_free["mla_max_logit"],
                                   rtol=1e-4)
      else:  # q_b, after k_b in path order
        np.testing.assert_allclose(per_head[:, 0, :, 0] ** 2, gammas["k_b"], rtol=1e-5)
        np.testing.assert_allclose(ratio[..., :nope],
                                   np.broadcast_to(per_head, ratio[..., :nope].shape), rtol=1e-5)
        np.testing.assert_allclose(ratio[..., nope:], np.broadcast_to(
            per_head ** 2, ratio[..., nope:].shape), rtol=1e-5)
    else:
      np.testing.assert_array_equal(a, b, err_msg=name)
