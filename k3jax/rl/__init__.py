"""Reinforcement learning on the serving engine: `k3jax rl` (docs/rl.md).

  objectives     the GRPO-family losses: advantages, token weights, PPO / GSPO clip, k3 KL
  rewards        `--reward` terms: built-in verifiers and user functions in their own process
  reward_worker  the process a user reward function runs in (standard library only)
  data           JSONL prompts and their seeded, resumable order
  rollout        a step's completions on the engine, and the train batch they become
  step           the policy's logprobs and the train step's policy-gradient objective
  loop           a run: rollouts, rewards, reference logprobs, updates, checkpoints, metrics
"""
