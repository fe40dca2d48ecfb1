"""A toy agentic task learned by RL (a `long` test: several minutes on a 2-core CPU): addition
with a calculator tool, on a small model over a BPE vocabulary with the K2-shaped chat template
and its tool-call tokens (tests/k3jax/tokenizer/release.py).

The rows ask "What is A plus B?" (single digits) with one tool, `add(a, b)`, run by the `tools`
environment (not declared to the template: the warm-up taught it, and the prompts stay short);
the reward is `numeric` on the final answer. The starting policy: a 2-layer model
from scratch, warmed up by chat SFT (`k3jax train --format chat`) on conversations of two kinds,
half each: the calculator's (a tool call with the question's numbers, its result, the result as
the answer) and a direct answer with a random number (right about one time in nineteen). The
warm-up teaches the format, the call and the copying; it leaves the choice to call at about
one half. RL has to learn that calling pays: the reward and the tool calls per trajectory rise.
"""

import json
import math
import textwrap

import numpy as np
import pytest

from k3jax import cli
from k3jax.rl.loop import METRICS
from tests.k3jax.model.helpers import tiny_cfg
from tests.k3jax.tokenizer import release

SFT_STEPS, RL_STEPS, GROUP, PROMPTS = 300, 30, 8, 8

CALC = '''
def add(a: int, b: int) -> int:
  """Add two integers."""
  return a + b
'''


def question(a: int, b: int) -> list[dict]:
  return [{"role": "user", "content": f"What is {a} plus {b}?"}]


def sft_rows(n: int, rng) -> list[dict]:
  rows = []
  for i in range(n):
    a, b = (int(x) for x in rng.integers(0, 10, 2))
    if i % 2 == 0:
      call = {"id": "functions.add:0", "type": "function",
              "function": {"name": "add", "arguments": json.dumps({"a": a, "b": b})}}
      answer = [{"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "functions.add:0", "content": str(a + b)},
                {"role": "assistant", "content": str(a + b)}]
    else:
      answer = [{"role": "assistant", "content": str(int(rng.integers(0, 19)))}]
    rows.append({"messages": question(a, b) + answer})
  return rows


@pytest.mark.long
def test_rl_learns_to_use_a_calculator(tmp_path, capsys):
  tok = str(tmp_path / "tok")
  added = release.build(tok)
  (tmp_path / "calc.py").write_text(textwrap.dedent(CALC))
  rng = np.random.default_rng(0)
  (tmp_path / "sft.jsonl").write_text(
      "".join(json.dumps(r) + "\n" for r in sft_rows(4000, rng)))
  cfg = tiny_cfg(vocab_size=max(added.values()) + 1, num_layers=2, mla_layers=(1,),
                 hidden_size=64, eos_token_id=added["<|im_end|>"])
  config = tmp_path / "config.json"
  config.write_text(json.dumps({"format": "k3jax", "config": cfg.to_dict()}))
  sft = tmp_path / "sft"
  assert cli.main(["train", "--config", str(config), "--data", str(tmp_path / "sft.jsonl"),
                   "--format", "chat", "--tokenizer", tok, "--steps", str(SFT_STEPS),
                   "--out", str(sft), "--batch-size", "16", "--seq-len", "160", "--lr", "1e-2",
                   "--warmup", "10", "--eval-every", "1000", "--save-every", "1000",
                   "--peak-tflops", "1", "--no-progress", "--no-tensorboard", "--no-plots",
                   "--compile-cache", "none"]) == 0

  pairs = [(a, b) for a in range(10) for b in range(10)]
  data = tmp_path / "add.jsonl"
  data.write_text("".join(json.dumps({"messages": question(a, b), "tools": ["add"],
                                      "answer": str(a + b)}) + "\n" for a, b in pairs))
  out = tmp_path / "rl"
  capsys.readouterr()
  assert cli.main(["rl", "--init-from", str(sft), "--data", str(data), "--env", "tools",
                   "--env-arg", f"module={tmp_path / 'calc.py'}", "--env-arg",
                   "declare=false", "--reward", "numeric",
                   "--group-size", str(GROUP), "--prompts-per-step", str(PROMPTS),
                   "--max-new-tokens", "48", "--max-turns", "3",
                   "--max-trajectory-tokens", "256", "--steps", str(RL_STEPS),
                   "--learning-rate", "3e-3", "--out", str(out), "--save-every", "1000",
                   "--compile-cache", "none", "--no-tensorboard", "--json"]) == 0
  with open(out / "metrics.jsonl") as f:
    records = [json.loads(line) for line in f]
  assert all(math.isfinite(r[k]) for r in records for k in METRICS)
  n = GROUP * PROMPTS
  rewards = [r["reward_mean"] for r in records]
  calls = [r["tool_calls"] / n for r in records]
  print("rewards by step:", " ".join(f"{x:.2f}" for x in rewards))
  print("tool calls per trajectory:", " ".join(f"{x:.2f}" for x in calls))
  print("tool errors:", sum(r["tool_errors"] for r in records), "env errors:",
        sum(r["env_errors"] for r in records))
  assert np.mean(rewards[:3]) <= 0.7 and np.mean(rewards[-5:]) >= np.mean(rewards[:3]) + 0.2
  assert np.mean(calls[-5:]) > np.mean(calls[:3])
