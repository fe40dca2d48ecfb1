"""Rollouts on the engine and the trainer's view of them, in float64: the logprobs the engine
reports for its draws (the behaviour policy, softmax(logits / T)) are what the trainer
recomputes from the same weights, so a first update sees ratios of exactly 1."""

import jax
import numpy as np
import pytest
from flax import nnx

from k3jax.engine import Engine
from k3jax.rl.data import Prompt
from k3jax.rl.objectives import ObjectiveConfig, group_advantages, token_weights
from k3jax.rl.rollout import build_batch, rollout
from k3jax.rl.step import PolicyGradient, logprob_fn
from k3jax.train import step as step_lib
from tests.k3jax.engine.helpers import CFG, CONFIG, EX, model

TOL = 1e-12  # as the engine's own tests: only the summation order differs
TEMPERATURE, G, NEW, SEQ = 0.7, 2, 6, 32


@pytest.fixture(autouse=True)
def _x64():
  with jax.enable_x64(True):
    yield


def test_rollout_logprobs_are_the_trainers_and_a_first_update_sees_ratio_one():
  objective = ObjectiveConfig()
  sc = step_lib.StepConfig(learning_rate=1e-3, warmup_steps=0, decay_steps=10,
                           end_lr_ratio=1.0, weight_decay=0.0, qb=False)
  steps = step_lib.build(CFG, EX, sc, None, None, PolicyGradient(objective, TEMPERATURE))
  _, params, bias = step_lib.split_model(model())
  rng = np.random.default_rng(0)
  prompts = [Prompt(i, tuple(int(t) for t in rng.integers(0, 64, n)), "", {})
             for i, n in enumerate((5, 9))]
  engine = Engine(nnx.merge(steps.graphdef, nnx.State(params), nnx.State(bias)), CONFIG)
  groups = rollout(engine, prompts, G, max_new_tokens=NEW, temperature=TEMPERATURE,
                   stop_ids=(), seeds=[[1, 2], [3, 4]], decode=lambda ids: "")
  assert all(len(c.tokens) == NEW == len(c.logprobs) and c.truncated for g in groups for c in g)

  adv = group_advantages(np.array([[1.0, 0.0], [0.0, 1.0]]), objective.normalize_std)
  rows = [(c, adv[p, g], True) for p, group in enumerate(groups) for g, c in enumerate(group)]
  batch = build_batch(rows, len(rows), SEQ, np.float64)
  batch.arrays["weights"] = token_weights(batch.arrays["loss_mask"], objective.loss_agg, NEW)
  dev = {k: v[None] for k, v in batch.arrays.items()}  # one micro-batch
  trainer = np.asarray(logprob_fn(steps, TEMPERATURE, adapters_off=False)(params, bias, dev))[0]
  mask = batch.rollout_mask
  assert mask.sum() == len(rows) * NEW
  np.testing.assert_allclose(trainer[mask], batch.arrays["old_logp"][mask], rtol=0, atol=TOL)

  dev["ref_logp"] = trainer[None]
  state = steps.init(params, bias, step_lib.new_rng(0))
  before = jax.tree.map(np.array, state["params"])  # a copy: the step donates the state
  state, metrics = steps.train(state, dev, step_lib.NO_QK_CLIP)
  assert float(metrics["max_abs_log_ratio"]) <= TOL
  assert float(metrics["clipped"]) == 0 and float(metrics["tokens"]) == mask.sum()
  assert abs(float(metrics["kl_ref"])) <= TOL and np.isfinite(float(metrics["loss"]))
  assert float(metrics["grad_norm"]) > 0
  moved = jax.tree.map(lambda a, b: bool(np.any(a != np.asarray(b))), before, state["params"])
  assert any(jax.tree.leaves(moved))
