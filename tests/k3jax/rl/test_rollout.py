"""One-turn rollouts on the engine (rollout.py, driver.py) and the trainer's view of them, in
float64: the logprobs the engine reports for its draws (the behaviour policy, softmax(logits /
T)) are what the trainer recomputes from the same weights on the packed batch, so a first
update sees ratios of exactly 1."""

import jax
import numpy as np
import pytest
from flax import nnx

from k3jax.engine import Engine
from k3jax.rl import batch as batch_lib
from k3jax.rl.data import Prompt, PromptStream
from k3jax.rl.driver import Driver, DriverConfig
from k3jax.rl.objectives import ObjectiveConfig, group_advantages
from k3jax.rl.rollout import Rollouts
from k3jax.rl.step import PolicyGradient, logprob_fn
from k3jax.tokenizer import ByteTokenizer
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
  driver = Driver(engine, DriverConfig(max_new_tokens=NEW, temperature=TEMPERATURE,
                                       stop_ids=()), ByteTokenizer())
  rollouts = Rollouts(driver, PromptStream(prompts, 0), prompts_per_step=2, group_size=G,
                      seed=0, context=CONFIG.max_model_len)
  ro = rollouts(1, 0)
  trajs = [t for g in ro.complete for t in g.members]
  assert len(ro.complete) == 2 and ro.generated == 2 * G * NEW
  assert all(t.generated == NEW == len(t.ids) - len(t.prompt.ids) and t.truncated
             for t in trajs)

  adv = group_advantages(np.array([[1.0, 0.0], [0.0, 1.0]]), objective.normalize_std)
  per = [adv[p, g] for p in range(2) for g in range(G)]
  b = batch_lib.build(trajs, [True] * len(trajs), [[a] * len(t.ids) for a, t in
                                                   zip(per, trajs)],
                      SEQ, 1, len(trajs), objective.loss_agg, NEW, np.float64)
  dev = {k: v[None] for k, v in b.arrays.items() if k != "versions"}  # one micro-batch
  trainer = np.asarray(logprob_fn(steps, TEMPERATURE, adapters_off=False)(params, bias, dev))[0]
  mask = b.rollout_mask
  assert mask.sum() == len(trajs) * NEW
  np.testing.assert_allclose(trainer[mask], b.arrays["old_logp"][mask], rtol=0, atol=TOL)

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
