"""Rewards: the built-in verifiers, and user functions in their own process, where an
exception, a value that is not a finite number, a hang or a dead process costs that sample its
reward (0, with an error) and nothing else."""

import os
import sys
import textwrap

import pytest

from k3jax.errors import UserError
from k3jax.rl import rewards
from k3jax.rl.data import load_prompts
from k3jax.rl.rewards import Reward, Sample
from k3jax.tokenizer import ByteTokenizer

GSM8K = os.path.join(os.path.dirname(__file__), "data", "gsm8k_sample.jsonl")


def sample(completion, answer="72", tokens=3, prompt="q"):
  return Sample(prompt, completion, {"answer": answer}, tokens)


def score(spec, s, max_tokens=16, timeout=5.0):
  r = Reward([spec] if isinstance(spec, str) else spec, max_tokens, timeout)
  try:
    return r.score(s)
  finally:
    r.close()


@pytest.mark.parametrize("completion, answer, value", [
    ("so the answer is 72", "72", 1.0),
    ("72 apples, then 3 more: \\boxed{75}", "75", 1.0),
    ("\\boxed{ 1,234 } and 5 more", "1234", 1.0),
    ("the last number wins: 3 then 72.0", "72", 1.0),
    ("no number here", "72", 0.0),
    ("71", "72", 0.0),
    ("-3.5", "#### -3.5", 1.0),                     # GSM8K's answer field
    ("Natalia sold 48/2 = 24 ... 72", "48 + 24 = 72\n#### 72", 1.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", 0.0),          # not a plain number: no match
    ("$1,000.", "1000", 1.0),
])
def test_numeric(completion, answer, value):
  s = score("numeric", sample(completion, answer))
  assert (s.value, s.error) == (value, None) and s.passed == (value == 1.0)


def test_numeric_on_gsm8k_shaped_rows():
  """data/gsm8k_sample.jsonl: rows as GSM8K writes them (`question`; `answer`, the worked
  solution then "#### N") plus the `prompt` that k3jax reads. The solution's steps with the right
  number boxed score 1, with a wrong one 0, and unboxed (the last number of the steps is the
  answer, as in GSM8K) 1; the rows load as written."""
  prompts = load_prompts(GSM8K, ByteTokenizer())
  assert len(prompts) == 6
  reward = Reward(["numeric"], 64, 5.0)
  for p in prompts:
    assert p.text == p.row["prompt"] and p.ids == tuple(p.text.encode())
    steps, gold = p.row["answer"].rsplit("####", 1)
    wrong = f"{float(gold) + 1:g}"
    got = [reward.score(Sample(p.text, text, p.row, 40)).value
           for text in (f"{steps}So \\boxed{{{gold.strip()}}}.", f"{steps}So \\boxed{{{wrong}}}.",
                        steps)]
    assert got == [1.0, 0.0, 1.0], (p.row["question"], got)


def test_exact_regex_and_length():
  assert score("exact", sample(" cba\n", "cba")).value == 1.0
  assert score("exact", sample("abc", "cba")).value == 0.0
  assert score("exact", sample("it is \\boxed{cba}", "cba")).value == 1.0
  assert score("regex:<think>.*</think>\\d+", sample("<think>\nhm\n</think>42")).value == 1.0
  assert score("regex:\\d+", sample("42 is it")).value == 0.0  # the whole completion
  # DAPO's soft overlong punishment with 16 tokens, cache 4: free up to 12
  assert [score("length:4", sample("x", tokens=n)).value for n in (5, 12, 14, 16)] == [
      0.0, 0.0, -0.5, -1.0]
  # terms add up, with weights; accuracy is the first term's pass
  s = score(["numeric", "0.5*regex:.*72", "2*length:4"], sample("it is 72", tokens=14))
  assert (s.value, s.passed) == (1.0 + 0.5 - 1.0, True)


def test_a_row_without_an_answer_is_that_sample_s_error():
  s = Reward(["numeric"], 16, 5.0).score(Sample("q", "72", {}, 2))
  assert s.value == 0.0 and not s.passed and "answer" in s.error


@pytest.mark.parametrize("spec", ["numeric:3", "regex:(", "length:0", "length:17", "length:x",
                                  "nosuch", "no_module_like_this_anywhere:fn",
                                  "/no/such/file.py:fn", "mod:not-an-identifier"])
def test_bad_specs_refuse_the_run(spec):
  with pytest.raises(UserError, match="--reward"):
    Reward([spec], 16, 5.0)


USER = textwrap.dedent("""
    import math, sys, time

    def reward(prompt, completion, row):
      if completion == "raise":
        raise ValueError("bad completion")
      if completion == "nan":
        return math.nan
      if completion == "inf":
        return float("inf")
      if completion == "none":
        return None
      if completion == "text":
        return "1.0"
      if completion == "hang":
        time.sleep(60)
      if completion == "exit":
        sys.exit(3)
      print("a print in the reward function must not break anything")
      return len(completion) + (row["bonus"] if "bonus" in row else 0)

    def flag(prompt, completion, row):
      return completion.startswith(prompt)
    """)


@pytest.fixture(scope="module")
def user_file(tmp_path_factory):
  path = tmp_path_factory.mktemp("reward") / "my_reward.py"
  path.write_text(USER)
  return str(path)


def test_user_function_failures_cost_one_sample(user_file):
  r = Reward([f"{user_file}:reward"], 16, timeout=2.0)
  try:
    assert r.score(Sample("p", "abc", {"bonus": 10}, 3)) == rewards.Score(13.0, True)
    for bad, words in [("raise", "ValueError: bad completion"), ("nan", "not a finite"),
                       ("inf", "not a finite"), ("none", "None"), ("text", "'1.0'"),
                       ("hang", "no result within 2s"), ("exit", "exit code 3")]:
      s = r.score(Sample("p", bad, {}, 1))
      assert s.value == 0.0 and not s.passed and words in s.error, (bad, s.error)
      # the run goes on: the next sample is scored normally (a new process after a hang/exit)
      assert r.score(Sample("p", "ok", {}, 1)).value == 2.0
  finally:
    r.close()


def test_user_function_by_module_and_by_relative_path(user_file, monkeypatch):
  folder, name = os.path.split(user_file)
  monkeypatch.chdir(folder)
  for spec in ("my_reward:flag", "./my_reward.py:flag", f"{folder}/my_reward.py:flag"):
    s = score(spec, Sample("ab", "abc", {}, 1))
    assert (s.value, s.error) == (1.0, None), spec
  assert "my_reward" not in sys.modules  # it ran in its own process


def test_spec_splits_on_the_last_colon():
  assert rewards.user_spec("pkg.mod:fn") == {"module": "pkg.mod", "name": "fn"}
  spec = rewards.user_spec(f"{rewards.WORKER}:main")
  assert spec == {"file": rewards.WORKER, "name": "main"}
