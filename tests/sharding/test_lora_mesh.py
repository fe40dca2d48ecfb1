"""LoRA fine-tuning on a mesh (fsdp=2, expert=2, tensor=2) equals LoRA on one device: two
float64 steps of adapters on every MLA projection and every routed expert (docs/sharding.md,
docs/training.md#fine-tuning). The adapters follow the rules table through their base projection's
axis names; the optimizer state exists for the adapters only, placed with them, and the frozen base
leaves both runs bit-identical. (MXFP4-packed experts on a mesh: their placement is the same rule,
and `k3jax plan --mode lora` compiles the sharded step with them, tests/k3jax/test_plan.py;
packing them in float64 costs minutes of CPU compile, so not here.)"""

import jax
import numpy as np
import pytest

from k3jax.model import lora
from k3jax.train import step as step_lib
from k3jax.train.loop import execution
from sharding.mesh import make_mesh

from .helpers import TWO_LAYERS, assert_close, random_batch, run_options, run_steps, step_cfg

MESH = "fsdp=2,expert=2,tensor=2"
SPEC = lora.AdaptSpec(rank=4, alpha=8.0, targets=("mla.*", "moe.experts.*"))


@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")
def test_lora_on_a_mesh_equals_one_device():
  opts = run_options("unused", "unused")
  batches = [random_batch(seed) for seed in range(2)]
  with jax.enable_x64(True):
    cfg, ex, sc = TWO_LAYERS, execution(opts), step_cfg(opts)
    init = step_lib.init_params(cfg, ex, 0, SPEC)
    want, want_loss = run_steps(step_lib.build(cfg, ex, sc, spec=SPEC), init, batches)
    sharded_steps = step_lib.build(cfg, ex, sc, make_mesh(MESH), SPEC)
    placed, got_loss = run_steps(sharded_steps, init, batches)
  want, got = jax.device_get(want), jax.device_get(placed)
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-8, atol=0)
  assert want_loss[1] != want_loss[0]
  mask = sharded_steps.trainable
  adapters_want, frozen_want = step_lib.partition(want["params"], mask)
  adapters_got, frozen_got = step_lib.partition(got["params"], mask)
  adapters_init, frozen_init = step_lib.partition(jax.device_get(init[0]), mask)
  assert_close(adapters_got, adapters_want, what="adapters")
  assert_close(got["opt_state"], want["opt_state"], what="opt_state")
  # the adapters moved (B from zero), the base did not, in either run
  assert any(np.abs(np.asarray(a)).max() > 0 for path, a in
             jax.tree_util.tree_flatten_with_path(adapters_got)[0]
             if "lora_b" in jax.tree_util.keystr(path))
  for frozen in (frozen_want, frozen_got):
    for a, b in zip(jax.tree.leaves(frozen), jax.tree.leaves(frozen_init)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # the sharded run's state is where the table puts it: expert stacks (weights and
  # per-expert adapters) split over expert x fsdp, the AdamW moments with their adapters
  experts = placed["params"]["moe"]["experts"]
  for name in ("w1", "w1_lora_a", "w1_lora_b"):
    spec = experts[name].sharding.spec
    assert spec[1] == ("expert", "fsdp"), (name, spec)
  a = experts["w1_lora_a"]
  moments = [x for path, x in jax.tree_util.tree_flatten_with_path(placed["opt_state"])[0]
             if jax.tree_util.keystr(path).endswith("['moe']['experts']['w1_lora_a']")]
  assert len(moments) == 2  # AdamW's mu and nu
  assert all(x.sharding.is_equivalent_to(a.sharding, a.ndim) for x in moments)
