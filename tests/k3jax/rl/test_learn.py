"""`k3jax rl` learns a task that its starting policy cannot do, on a CPU in about two minutes.

The task, digit copy: the prompt is "d=" for a digit d, the policy writes one byte, and the
reward is `exact`: 1 if that byte is d, else 0. The data holds the ten digits and every step
draws all ten, 16 samples each.

The starting policy: a 2-layer byte-level model from scratch, warmed by 60 `k3jax train` steps
on lines "a=b" whose a and b are drawn independently. It learns the format (after "=" comes a
digit) but not the task: b carries no information about a, so the best the warm-up can reach
is uniform over the ten digits, an accuracy of 1/10 on every prompt. RL alone has to make the
answer depend on the prompt.

The threshold: the answers are uniform over the digits, so any policy that ignores the prompt
scores at most 0.1 in expectation. A mean reward >= 0.9 over the last 5 steps (800 samples,
binomial sd <= 0.011 at that level) needs at least 9 of the 10 prompts answered correctly
nearly always: the answer has come to depend on the prompt, which only RL taught. The first
step's reward is that of the warmed-up policy, ~0.1 (sd 0.024 over 160 samples); it must be
<= 0.25.

The run is seeded (weights, the warm-up's data order, every rollout draw); measured figures
(reward by step, seconds) are in docs/rl.md.
"""

import json
import math

import numpy as np

from k3jax import cli
from k3jax.rl.loop import METRICS
from tests.k3jax.model.helpers import tiny_cfg

SFT_STEPS, RL_STEPS, GROUP = 60, 60, 16
START_AT_MOST, END_AT_LEAST, LAST = 0.25, 0.9, 5


def test_rl_learns_to_copy_a_digit(tmp_path, capsys):
  cfg = tiny_cfg(vocab_size=256, num_layers=2, mla_layers=(1,), eos_token_id=None)
  config = tmp_path / "config.json"
  config.write_text(json.dumps({"format": "k3jax", "config": cfg.to_dict()}))
  pairs = np.random.default_rng(0).integers(0, 10, (20000, 2))
  (tmp_path / "pairs.txt").write_text("".join(f"{a}={b}\n" for a, b in pairs))
  sft = tmp_path / "sft"
  assert cli.main(["train", "--config", str(config), "--data", str(tmp_path / "pairs.txt"),
                   "--steps", str(SFT_STEPS), "--out", str(sft), "--batch-size", "8",
                   "--seq-len", "64", "--lr", "1e-2", "--warmup", "5", "--eval-every", "1000",
                   "--save-every", "1000", "--peak-tflops", "1", "--no-progress",
                   "--no-tensorboard", "--no-plots", "--compile-cache", "none"]) == 0

  data = tmp_path / "copy.jsonl"
  data.write_text("".join(json.dumps({"prompt": f"{d}=", "answer": str(d)}) + "\n"
                          for d in range(10)))
  out = tmp_path / "rl"
  capsys.readouterr()
  assert cli.main(["rl", "--init-from", str(sft), "--data", str(data), "--reward", "exact",
                   "--group-size", str(GROUP), "--prompts-per-step", "10",
                   "--max-new-tokens", "1", "--steps", str(RL_STEPS), "--learning-rate", "5e-3",
                   "--out", str(out), "--save-every", "1000", "--compile-cache", "none",
                   "--no-tensorboard", "--json"]) == 0
  summary = json.loads(capsys.readouterr().out.splitlines()[-1])
  with open(out / "metrics.jsonl") as f:
    records = [json.loads(line) for line in f]
  assert [r["step"] for r in records] == list(range(1, RL_STEPS + 1))
  assert all(math.isfinite(r[k]) for r in records for k in METRICS)
  rewards = [r["reward_mean"] for r in records]
  print("rewards by step:", " ".join(f"{x:.2f}" for x in rewards))
  assert rewards[0] <= START_AT_MOST, rewards
  assert np.mean(rewards[-LAST:]) >= END_AT_LEAST, rewards
  assert summary["plots"] and all(r["reward_errors"] == 0 for r in records)
