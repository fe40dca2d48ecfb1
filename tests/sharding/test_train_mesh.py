"""Three train steps on a mesh (fsdp=2, expert=2, tensor=2: every weight axis split) equal
three steps on one device: losses, parameters, router biases, optimizer state (docs/sharding.md,
docs/correctness.md). Both run in float64 with the histogram Quantile Balancing; the compiled
sharded step reduces the QB histograms with exactly one all-reduce of the [MoE layers, E, bins]
counts, runs the routed experts expert-parallel (8 experts over expert x fsdp: 2 per device) and
never all-gathers an expert weight, its gradient or its optimizer state."""

import re

import jax
import numpy as np
import pytest
from flax import nnx

from k3jax.model.transformer import K3Model
from k3jax.plan.hlo import collectives, matmul_flops, summary
from k3jax.train import step as step_lib
from sharding.mesh import make_mesh

from .helpers import (
  ROWS,
  T,
  assert_close,
  model_config,
  random_batch,
  run_options,
  run_steps,
  step_cfg,
)

MESH = "fsdp=2,expert=2,tensor=2"


def three_steps(steps, batches, init):
  """Three steps from `init` (the init on a mesh itself: test_placement.py)."""
  state, losses = run_steps(steps, init, batches)
  return jax.device_get(state), losses


def test_sharded_train_step(runs):
  """One test over the module's one pair of runs: pytest-xdist's load scheduling may hand the
  tests of a module to both workers, which would each compile the two train steps."""
  check_three_sharded_steps_equal_three_one_device_steps(runs)
  check_sharded_step_reduces_qb_histograms_in_one_psum(runs)
  check_sharded_step_keeps_router_scores_split_until_qb(runs)
  check_moe_router_and_latent_projections_run_once_per_row(runs)
  check_sharded_step_never_gathers_expert_weights(runs)


@pytest.fixture(scope="module")
def runs():
  opts = run_options("unused", "unused")
  batches = [random_batch(seed) for seed in range(3)]
  with jax.enable_x64(True):
    (cfg, ex), sc = model_config(opts), step_cfg(opts)
    one_device = step_lib.build(cfg, ex, sc)
    init = one_device.init_params(0)
    one = three_steps(one_device, batches, init)
    sharded_steps = step_lib.build(cfg, ex, sc, make_mesh(MESH))
    sharded = three_steps(sharded_steps, batches, init)
    params, bias = init
    hlo = sharded_steps.train.lower(
        step_lib.abstract_state(sharded_steps, params, bias), batches[0],
        step_lib.NO_QK_CLIP).compile().as_text()
  return one, sharded, cfg, sc, hlo


def check_three_sharded_steps_equal_three_one_device_steps(runs):
  (want, want_loss), (got, got_loss), _, _, _ = runs
  assert np.all(np.diff(want_loss) != 0)
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-8, atol=0)
  assert_close(got["params"], want["params"], what="params")
  assert_close(got["opt_state"], want["opt_state"], what="opt_state")
  b_want = np.asarray(want["router_bias"]["moe"]["gate"]["bias"])
  b_got = np.asarray(got["router_bias"]["moe"]["gate"]["bias"])
  assert np.abs(b_want).max() > 1e-3  # QB moved the biases
  # float32 biases from float32 histogram arithmetic on (nearly) equal scores: the same bins
  np.testing.assert_allclose(b_got, b_want, rtol=0, atol=1e-6)
  assert int(got["step"]) == 3
  diff = lambda a, b: max(float(np.abs(np.asarray(x, np.float64) - np.asarray(y)).max())
                          for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
  print(f"\nsharded - one device after 3 steps, max abs: loss {diff(got_loss, want_loss):.2e}, "
        f"params {diff(got['params'], want['params']):.2e}, opt_state "
        f"{diff(got['opt_state'], want['opt_state']):.2e}, router bias "
        f"{np.abs(b_got - b_want).max():.2e}")


def check_sharded_step_reduces_qb_histograms_in_one_psum(runs):
  """One psum of a layer's [E, bins] counts, in the loop over the MoE layers (QB maps over
  them one at a time); no [layers, E, bins] array is built."""
  _, _, cfg, sc, hlo = runs
  counts = f"s32[{cfg.num_experts},{sc.qb_bins}]"
  reduces = [c for c in collectives(hlo) if c.op == "all-reduce" and counts in c.result]
  assert len(reduces) == 1, reduces
  assert f"s32[{len(cfg.moe_layers)},{cfg.num_experts},{sc.qb_bins}]" not in hlo
  # nothing else of that size moves: the histogram counts are never gathered
  assert not [c for c in collectives(hlo) if counts in c.result and c.op != "all-reduce"]


def check_sharded_step_keeps_router_scores_split_until_qb(runs):
  """The MoE layer routes (and keeps the scores of) only its tensor rank's half of the
  device's rows, and QB gathers one layer's whole: one all-gather of [A, rows, E] (A = 1
  micro-batch, this device's rows), which a step that kept the scores whole would not need."""
  _, _, cfg, _, hlo = runs
  scores = f"f64[1,{ROWS * T // 4},{cfg.num_experts}]"  # rows over fsdp x expert
  gathers = [c for c in collectives(hlo) if c.op == "all-gather"]
  assert len([c for c in gathers if scores in c.result]) == 1, gathers


def check_moe_router_and_latent_projections_run_once_per_row(runs):
  """The router and LatentMoE's routed_down / routed_up matmuls, summed over the 8 devices'
  programs, do 3x their forward's hand count (forward, input and weight gradients; no remat
  here): each tensor rank runs them on its share of the rows. With the rows replicated over
  tensor = 2 they were 6x."""
  _, _, cfg, _, hlo = runs
  by_op = {}
  matmul_flops(hlo, by_op)
  n, d, l, e = ROWS * T, cfg.hidden_size, cfg.latent_size, cfg.num_experts
  for einsum, forward in (("nd,de->ne", 2 * n * d * e), ("nd,dl->nl", 2 * n * d * l),
                          ("nl,ld->nd", 2 * n * l * d)):
    got = 8 * sum(f for op, f in by_op.items() if einsum in op)
    print(f"{einsum}: {got / forward:.3f} x forward")
    assert got == pytest.approx(3 * forward, rel=0.02), (einsum, got / forward)


def check_sharded_step_never_gathers_expert_weights(runs):
  """The expert-parallel MoE is live in the step (XLA:CPU: its padded all-to-all of
  [EP, slot, latent] rows there and back, forward and backward) and no all-gather in the
  compiled step carries an expert-weight-shaped array: the experts live on expert x fsdp,
  their latent width whole and F on tensor, and the forward (inside shard_map), the gradient
  and Per-Head Muon (whole per-expert blocks) all use them where they are."""
  _, _, cfg, _, hlo = runs
  ops = collectives(hlo)
  e, l, f = cfg.num_experts, cfg.latent_size, cfg.moe_intermediate_size
  ep = 4  # expert x fsdp
  print(f"\nsharded step collectives: {summary(ops)}")

  def exchanges_rows(c):  # [EP, slot, l] rows: one array, or a tuple of the EP destinations'
    arrays = re.findall(r"f64\[(\d+),(\d+),(\d+)\]", c.result)
    return (c.op == "all-to-all" and arrays and all(int(a[2]) == l for a in arrays)
            and sum(int(a[0]) for a in arrays) == ep)

  dispatch = [c for c in ops if exchanges_rows(c)]
  assert len(dispatch) >= 4, ops  # there and back, in the forward and the backward
  # any slice of an expert stack ([..., experts, l, F or F/tensor] or [..., F, l]), whatever
  # the number of experts it holds; the pair (l, F) appears in no other array of this model
  expert_like = re.compile(rf"f64\[(?:\d+,)*(?:{l},(?:{f}|{f // 2})|(?:{f}|{f // 2}),{l})\]")
  with jax.enable_x64(True):
    params = nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0)))
  matched = {".".join(map(str, p)) for p, v in nnx.to_flat_state(nnx.state(params))
             if expert_like.search(f"f64[{','.join(map(str, v.shape))}]")}
  assert matched == {"moe.experts.w1", "moe.experts.w2", "moe.experts.w3"}, matched
  assert expert_like.search(f"f64[{e // ep},{l},{f // 2}]")  # one device's shard
  gathers = [c for c in ops if c.op == "all-gather"]
  assert not [c for c in gathers if expert_like.search(c.result)], gathers
