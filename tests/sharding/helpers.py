"""Shared set-up of the sharding tests: the smallest model with every part (layer 0: KDA and
the dense MLP; layer 1: MLA and the LatentMoE with shared experts and QB; AttnRes), whose
dimensions the test meshes divide (2 heads, 8 experts, even widths), trained in float64 so that a
sharded run and the one-device run differ only by float64 summation order."""

import dataclasses

import numpy as np

from k3jax.train import data
from k3jax.train.loop import RunOptions, execution, step_config
from tests.k3jax.train.helpers import MICRO

# latent 24 and expert width 22 (11 per tensor rank) appear side by side in no other array of
# this model (nor in its activations): an expert weight in a compiled program is recognisable
# by its shape (test_train_mesh.py reads the step's all-gathers for them)
TWO_LAYERS = MICRO.replace(num_layers=2, mla_layers=(1,), latent_size=24,
                           moe_intermediate_size=22)
ROWS, T = 8, 32

# float64 relative tolerance of a sharded run against the one-device run after a few steps:
# the two differ only by the order of float64 sums (eps 1.1e-16, reductions of <= ~1e4 terms:
# ~1e-12 relative), which Newton-Schulz may amplify by up to its slope at 0, a^5 = 3.4445^5
# ~ 490, per step: ~5e-10 after one step, well below 1e-8. A sharding bug (a wrong reduction,
# a misplaced row, a block orthogonalised whole instead of per head) moves numbers by 1e-3+.
RTOL_F64 = 1e-8


def run_options(out, config_file, **changes) -> RunOptions:
  base = RunOptions(out=str(out), config=config_file, steps=3, decay_steps=6, batch_size=ROWS,
                    seq_len=T, learning_rate=1e-2, warmup_steps=2, eval_every=100,
                    eval_batches=1, save_every=2, progress=False, peak_tflops=1.0,
                    dtype="float64", qb_method="histogram", tensorboard=False, plots=False)
  return dataclasses.replace(base, **changes)


def model_config(opts: RunOptions):
  """(config, execution) a run with `opts` trains (float64 weights and compute)."""
  return TWO_LAYERS, execution(opts)


def step_cfg(opts: RunOptions):
  return step_config(opts)


def random_batch(seed: int) -> dict[str, np.ndarray]:
  """[1, ROWS, T] packed rows: two sequences per row in half of them, 3 padding positions."""
  rng = np.random.default_rng(seed)
  seg = np.ones((ROWS, T + 1), np.int32)
  seg[::2, 13:] = 2
  seg[:, -3:] = 0
  tokens = np.where(seg > 0, rng.integers(0, 256, (ROWS, T + 1)), 0)
  return data.rows_to_batch(tokens, seg, 1)


def assert_close(got, want, rtol=RTOL_F64, what=""):
  """Every leaf within rtol of the leaf's largest magnitude (a relative bound on the tensor)."""
  import jax
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(want)[0], jax.tree.leaves(got)):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = max(float(np.abs(a).max()), 1e-30)
    np.testing.assert_allclose(b, a, rtol=0, atol=rtol * scale,
                               err_msg=f"{what}{jax.tree_util.keystr(path)}")


def run_steps(steps, init, batches):
  """Train steps from `init` (params, biases: the one-device init; on a mesh placed in its
  shardings first, as `--init-from` does) over `batches`: (final state, on its devices;
  losses)."""
  import jax

  from k3jax.train import step as step_lib
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
  return state, np.array(losses)
