"""One RL step: the seam between rollout and learning.

    rollouts (rollout.py, driver.py: the engine and the environments)
      -> scores (process 0: the --reward terms on each trajectory's last turn, plus its
         environment's rewards; the others take its values)
      -> the learner (learner.py: batch, logprob passes, updates)
      -> the engine gets the new weights (`set_params`: the next policy version)

`Iteration(s, state)` -> (new state, the step's metrics record, generated tokens).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time

import numpy as np
from flax import nnx

from k3jax.engine import Engine
from k3jax.rl.learner import Learner
from k3jax.rl.rewards import Reward, Sample
from k3jax.rl.rollout import Rollouts, StepRollouts
from sharding import distributed

# what every metrics.jsonl line holds (all finite): docs/rl.md#metrics
METRICS = ("step", "reward_mean", "reward_std", "accuracy", "kl", "clip_fraction",
           "reward_errors", "entropy", "completion_len", "truncated", "empty_completions",
           "groups_uniform", "groups_dropped", "prompts_too_long", "trained_tokens",
           "mismatch_kl", "mismatch_max", "loss", "grad_norm", "lr", "updates", "rollout_s",
           "reward_s", "reference_s", "train_s", "step_time_s", "tokens_per_s",
           "turns", "tool_calls", "tool_errors", "env_errors", "overlong", "staleness_mean",
           "is_weight_mean", "stale_dropped", "carried", "distill_kl")


class ErrorLog:
  """Errors of one kind (reward, env): every one to OUT/<kind>_errors.jsonl, the first few of
  a step to stderr."""
  SHOWN = 5

  def __init__(self, out: str, kind: str):
    self.kind, self.path = kind, os.path.join(out, f"{kind}_errors.jsonl")

  def write(self, step: int, errors: list[tuple[int, int, str]]) -> None:
    if not errors:
      return
    with open(self.path, "a") as f:
      f.writelines(json.dumps({"step": step, "row": row, "sample": sample, "error": error})
                   + "\n" for row, sample, error in errors)
    for row, sample, error in errors[:self.SHOWN]:
      print(f"k3jax rl: step {step}: {self.kind} error, data row {row} sample {sample} "
            f"(reward 0): {error}", file=sys.stderr, flush=True)
    if len(errors) > self.SHOWN:
      print(f"k3jax rl: step {step}: {len(errors) - self.SHOWN} more {self.kind} errors in "
            f"{self.path}", file=sys.stderr, flush=True)


@dataclasses.dataclass
class Scores:
  rewards: np.ndarray         # [groups, G] (an environment's error scores 0)
  passed: np.ndarray          # [groups, G] the first --reward term scored >= 1
  reward_errors: int
  env_errors: int


@dataclasses.dataclass
class Iteration:
  rollouts: Rollouts
  learner: Learner
  engine: Engine
  policy: object              # state -> the model the engine serves (loop._policy)
  reward: Reward | None       # None: no --reward terms
  logs: tuple[ErrorLog, ErrorLog] | None  # (reward, env); None off process 0: it does not score
  group_size: int

  def __call__(self, s: int, state: dict) -> tuple[dict, dict, int]:
    t0 = time.perf_counter()
    version = s - 1  # the updates the engine's weights have had
    ro = self.rollouts(s, version)
    t_rollout = time.perf_counter()
    scores = self.score(s, ro)
    t_reward = time.perf_counter()
    learned = self.learner.learn(state, ro.complete, scores.rewards, version)
    if learned.trained:
      self.engine.set_params(nnx.state(self.policy(learned.state)))
    t_train = time.perf_counter()
    record = _record(s, ro, scores, learned.metrics, learned.reference_s,
                     (t0, t_rollout, t_reward, t_train))
    return learned.state, record, ro.generated

  def score(self, s: int, ro: StepRollouts) -> Scores:
    """Process 0 scores (a user function may time out on one host and not on another) and
    logs the errors; the others take its values."""
    G = self.group_size
    rewards = np.zeros((len(ro.complete), G))
    passed = np.zeros((len(ro.complete), G), np.int32)
    reward_errors, env_errors = [], []
    if self.logs is not None:
      for p, group in enumerate(ro.complete):
        for g, t in enumerate(group.members):
          if t.error is not None:
            env_errors.append((t.prompt.index, g, t.error))
            continue
          value, ok = t.env_reward, t.env_reward >= 1.0
          if self.reward is not None:
            sc = self.reward.score(Sample(t.prompt.text, t.text, t.prompt.row, t.generated))
            value, ok = (0.0, False) if sc.error is not None else (value + sc.value, sc.passed)
            if sc.error is not None:
              reward_errors.append((t.prompt.index, g, sc.error))
          rewards[p, g], passed[p, g] = value, ok
      for log, errors in zip(self.logs, (reward_errors, env_errors)):
        log.write(s, errors)
    rewards, passed, n_errors = distributed.from_main(
        (rewards, passed, np.asarray([len(reward_errors), len(env_errors)], np.int32)))
    return Scores(rewards, passed.astype(bool), int(n_errors[0]), int(n_errors[1]))


def _record(s: int, ro: StepRollouts, scores: Scores, learned: dict, reference_s: float,
            times: tuple[float, float, float, float]) -> dict:
  t0, t_rollout, t_reward, t_train = times
  trajs = [t for g in ro.complete for t in g.members]
  r, ok = scores.rewards, scores.passed

  def mean(xs, default=0.0):
    return float(np.mean(xs)) if len(xs) else default

  record = {
      "step": s,
      "reward_mean": mean(r), "reward_std": float(r.std()) if r.size else 0.0,
      "accuracy": mean(ok), "reward_errors": scores.reward_errors,
      "completion_len": mean([t.generated for t in trajs]),
      "truncated": mean([t.truncated for t in trajs]),
      "empty_completions": sum(1 for t in trajs if not t.text.strip()),
      "prompts_too_long": ro.prompts_too_long,
      "turns": mean([t.turns for t in trajs]),
      "tool_calls": sum(t.tool_calls for t in trajs),
      "tool_errors": sum(t.tool_errors for t in trajs),
      "env_errors": scores.env_errors,
      "overlong": sum(t.finish == "overlong" for t in trajs),
      "stale_dropped": ro.stale_dropped, "carried": ro.carried,
      **learned,
      "rollout_s": t_rollout - t0, "reward_s": t_reward - t_rollout,
      "reference_s": reference_s, "train_s": t_train - t_reward - reference_s,
      "step_time_s": t_train - t0,
      "tokens_per_s": ro.generated / max(t_rollout - t0, 1e-9),
  }
  for key in METRICS:  # finite by construction; a failure here is a bug, not bad input
    assert key in record and math.isfinite(record[key]), (key, record.get(key))
  return record
