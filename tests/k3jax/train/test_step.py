"""The train step's semantics on the micro model: packing is exact, Quantile Balancing routes
the next batch with a bias derived from this batch only, gradient accumulation equals one big
batch."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from k3jax.model.quantile_balancing import quantile_balancing_bias
from k3jax.train import data
from k3jax.train import step as step_lib
from k3jax.train.loop import step_config

from tests import numerics

from .helpers import MICRO, options

T = 32
ROWS = 4


@pytest.fixture(scope="module")
def steps():
  return step_lib.build(MICRO, step_config(options("unused", "unused")))


@pytest.fixture(scope="module")
def params_bias():
  params, bias = step_lib.init_params(MICRO, 0)
  # a non-zero starting bias, so "routed with b_t" and "routed with b_t+1" differ
  noise = jax.random.normal(jax.random.key(7), bias["moe"]["gate"]["bias"].shape) * 0.05
  # committed like the train loop's state, so every call here lowers to one program
  return step_lib.place((params, {"moe": {"gate": {"bias": bias["moe"]["gate"]["bias"] + noise}}}))


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
  pad = lambda x, seg: (np.r_[x, np.zeros(T + 1 - len(x), int)],  # noqa: E731
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
  np.testing.assert_allclose(nll[0, :10], nll[1, :10], atol=1e-5, rtol=0)
  np.testing.assert_allclose(nll[0, 11:24], nll[2, :13], atol=1e-5, rtol=0)
  np.testing.assert_allclose(nll[3, :13], nll[2, :13], atol=1e-5, rtol=0)
  np.testing.assert_allclose(nll[3, 14:24], nll[1, :10], atol=1e-5, rtol=0)
  packed_loss = nll[0].sum() / mask[0].sum()
  separate_loss = (nll[1].sum() + nll[2].sum()) / (mask[1].sum() + mask[2].sum())
  np.testing.assert_allclose(packed_loss, separate_loss, atol=1e-5, rtol=0)
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
  return np.asarray(want), float(np.sum(nll) / flat["loss_mask"].sum())


def test_qb_bias_for_the_next_step_comes_from_this_batch(steps, params_bias):
  params, bias = params_bias
  b0 = np.asarray(bias["moe"]["gate"]["bias"])
  x, y = rows_batch(random_rows(1)), rows_batch(random_rows(2))
  want_b1, want_loss_x = expected_bias(steps, params, bias, x)

  state = step_lib.place(steps.init(copy(params), copy(bias), step_lib.new_rng(0)))
  state, mx = steps.train(state, x, step_lib.NO_QK_CLIP)
  b1 = np.asarray(state["router_bias"]["moe"]["gate"]["bias"])
  # batch x was routed with b_t (its loss is the forward loss under b_t) ...
  # two float32 forwards in different programs (no float64 train step): 1e-5 of the loss's
  # scale (tests/numerics.py), ~7 u apart measured
  np.testing.assert_allclose(float(mx["loss"]), want_loss_x, atol=numerics.tolerance(want_loss_x))
  # ... and b_t+1 is QB of x's own router scores under (theta_t, b_t)
  np.testing.assert_allclose(b1, want_b1, atol=1e-6, rtol=0)
  assert np.abs(b1 - b0).max() > 1e-3
  np.testing.assert_allclose(b1.mean(axis=-1), 0.0, atol=1e-6)  # centred
  # QB improves this batch's balance: the choices b_t+1 makes are more even than b_t's
  assert np.all(mx["load_max_mean_after"] <= mx["load_max_mean_before"] + 1e-6)

  # step t+1 routes y with b_t+1 and theta_t+1, and derives b_t+2 from y alone
  theta1 = copy(state["params"])
  want_b2, want_loss_y = expected_bias(steps, theta1, {"moe": {"gate": {"bias": b1}}}, y)
  state, my = steps.train(state, y, step_lib.NO_QK_CLIP)
  np.testing.assert_allclose(float(my["loss"]), want_loss_y, atol=numerics.tolerance(want_loss_y))
  np.testing.assert_allclose(np.asarray(state["router_bias"]["moe"]["gate"]["bias"]), want_b2,
                             atol=1e-6, rtol=0)
  assert int(state["step"]) == 2


def test_accumulation_equals_one_batch(steps, params_bias):
  """A=2 micro-batches of 2 rows against one batch of 4 rows: the same loss, gradient norm,
  router bias, and gradient. The gradient is read from the optimizer state: after one step
  every first moment is (1 - b1) * clipped gradient and Adam's second moment its square, so
  equal moments are equal gradients. (The parameters themselves are not compared at 1e-5:
  Newton-Schulz amplifies directions of small singular value by up to ~3.4^5, so fp32
  summation-order noise of 1e-7 in a gradient legitimately shows as ~1e-5 in its Muon update.)"""
  params, bias = params_bias
  rows = random_rows(3)
  outs = []
  for a in (1, 2):
    state = step_lib.place(steps.init(copy(params), copy(bias), step_lib.new_rng(0)))
    state, metrics = steps.train(state, rows_batch(rows, micro_batches=a), step_lib.NO_QK_CLIP)
    outs.append((jax.device_get(state), jax.device_get(metrics)))
  (s1, m1), (s2, m2) = outs
  for key in ("loss", "grad_norm", "loss_tokens"):
    np.testing.assert_allclose(m1[key], m2[key], rtol=1e-5, atol=0, err_msg=key)
  np.testing.assert_allclose(s1["router_bias"]["moe"]["gate"]["bias"],
                             s2["router_bias"]["moe"]["gate"]["bias"], atol=1e-5, rtol=0)
  (first1, second1), (first2, second2) = moments(s1["opt_state"]), moments(s2["opt_state"])
  assert len(first1) == len(jax.tree.leaves(s1["params"]))  # one moment per parameter
  # 1e-5 of the gradient's scale (the largest moment), as for the loss and the norm: an entry
  # that is a sum of cancelling per-token terms carries the rounding of the terms, not of the
  # (smaller) result. Seen: a 96-entry moment whose entries span 1e-22..1e-4 differed by 1.3e-9
  # (1.4e-5 of its own largest entry) between the two summation orders.
  for kind in (zip(first1, first2), zip(second1, second2)):
    pairs = list(kind)
    scale = max(float(np.abs(g2).max()) for _, g2 in pairs)
    for g1, g2 in pairs:
      np.testing.assert_allclose(g1, g2, rtol=0, atol=1e-5 * scale)


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
