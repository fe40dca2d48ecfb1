"""Three train steps on a mesh (fsdp=2, expert=2, tensor=2: every weight axis split) equal
three steps on one device: losses, parameters, router biases, optimizer state (SPEC §6, §8).
Both run in float64 with the histogram Quantile Balancing; the compiled sharded step reduces
the QB histograms with exactly one all-reduce of the [MoE layers, E, bins] counts."""

import jax
import numpy as np
import pytest

from k3jax.train import step as step_lib
from sharding.hlo import collectives
from sharding.mesh import make_mesh

from .helpers import assert_close, model_config, random_batch, run_options, step_cfg

MESH = "fsdp=2,expert=2,tensor=2"


def three_steps(steps, batches, init):
  """Three steps from `init` (params, biases: the one-device init; on a mesh placed in its
  shardings first, as `--init-from` does; the init on a mesh itself: test_placement.py)."""
  params, bias = init
  rng = step_lib.new_rng(0)
  if steps.mesh is not None:
    params = jax.device_put(params, steps.shardings["params"])
    bias = jax.device_put(bias, steps.shardings["router_bias"])
    rng = np.asarray(rng)
  state = steps.init(params, bias, rng)
  if steps.mesh is None:
    state = step_lib.place(state)  # as the train loop does: shares its compiled program
  losses = []
  for batch in batches:
    state, metrics = steps.train(state, batch, step_lib.NO_QK_CLIP)
    losses.append(float(metrics["loss"]))
  return jax.device_get(state), np.array(losses)


@pytest.fixture(scope="module")
def runs():
  opts = run_options("unused", "unused")
  batches = [random_batch(seed) for seed in range(3)]
  with jax.enable_x64(True):
    cfg, sc = model_config(opts), step_cfg(opts)
    one_device = step_lib.build(cfg, sc)
    init = one_device.init_params(0)
    one = three_steps(one_device, batches, init)
    sharded_steps = step_lib.build(cfg, sc, make_mesh(MESH))
    sharded = three_steps(sharded_steps, batches, init)
    params, bias = init
    hlo = sharded_steps.train.lower(
        step_lib.abstract_state(sharded_steps, params, bias), batches[0],
        step_lib.NO_QK_CLIP).compile().as_text()
  return one, sharded, cfg, sc, hlo


def test_three_sharded_steps_equal_three_one_device_steps(runs):
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


def test_sharded_step_reduces_qb_histograms_in_one_psum(runs):
  _, _, cfg, sc, hlo = runs
  counts = f"s32[{len(cfg.moe_layers)},{cfg.num_experts},{sc.qb_bins}]"
  reduces = [c for c in collectives(hlo) if c.op == "all-reduce" and counts in c.result]
  assert len(reduces) == 1, reduces
  # nothing else of that size moves: the histogram counts are never gathered
  assert not [c for c in collectives(hlo) if counts in c.result and c.op != "all-reduce"]
