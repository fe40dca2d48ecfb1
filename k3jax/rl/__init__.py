"""Reinforcement learning on the serving engine: `k3jax rl` (docs/rl.md).

  options        RLOptions, their checks, and the objective / optimizer / engine they configure
  loop           a run: set-up, the steps, checkpoints, metrics, the final model
  iteration      one step, the seam between rollout and learning: rollouts, scores, learner
  rollout        the groups in flight across steps (partial rollouts, staleness)
  driver         trajectories on the engine and the environments, turn by turn
  render         how a multi-turn trajectory's tokens are made (token in, token out)
  env            the environment protocol, environments in worker processes
  env_worker     the process an environment runs in (standard library only)
  env_builtins   the built-in environments: tools, a sandboxed python
  learner        completed groups -> the packed batch, logprob passes, updates
  batch          trajectories packed into train rows with segment ids
  teacher        teachers of on-policy distillation (a model folder, or a k3jax serve URL)
  objectives     the GRPO-family losses, rollout importance sampling, distillation advantages
  rewards        `--reward` terms: built-in verifiers and user functions in their own process
  reward_worker  the process a user reward function runs in (standard library only)
  data           JSONL rows and their seeded, resumable order
  step           the policy's logprobs and the train step's policy-gradient objective
"""
