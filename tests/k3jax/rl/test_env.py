"""Environments in real worker processes: the protocol, the built-ins, and every way an
environment can fail costing only its trajectory (an error reply, reward 0) while the others
go on; a class that cannot be used refuses the run before it starts."""

import textwrap

import pytest

from k3jax.errors import UserError
from k3jax.rl import env
from k3jax.rl.env import EnvPool, env_spec

USER = """
import os
import time

class Counter:
  def __init__(self, limit=2, mode="ok"):
    self.limit, self.mode, self.turns = limit, mode, 0

  def reset(self, row):
    self.mode = row.get("mode", self.mode)
    return [{"role": "user", "content": row["q"]}]

  def step(self, action):
    self.turns += 1
    mode = self.mode if self.turns == 1 else "ok"
    if mode == "raise":
      raise ValueError("broken step")
    if mode == "nan":
      return [], float("nan"), True, {}
    if mode == "not-a-list":
      return "text", 1.0, False, {}
    if mode == "bad-role":
      return [{"role": "robot", "content": "x"}], 1.0, False, {}
    if mode == "hang":
      time.sleep(600)
    if mode == "exit":
      os._exit(3)
    done = self.turns >= self.limit
    obs = [] if done else [{"role": "user", "content": f"again {self.turns}"}]
    return obs, 0.5, done, {"echo": action["content"]}

class NoStep:
  def reset(self, row):
    return []

class NeedsArg:
  def __init__(self, size):
    self.size = size

  def reset(self, row):
    return []

  def step(self, action):
    return [], 0.0, True, {}
"""

TOOLS = """
def add(a: int, b: int) -> int:
  \"\"\"Add two integers.\"\"\"
  return a + b

def fail(x: str) -> str:
  raise RuntimeError("tool failed: " + x)
"""


@pytest.fixture(scope="module")
def user(tmp_path_factory):
  root = tmp_path_factory.mktemp("env")
  (root / "user_env.py").write_text(textwrap.dedent(USER))
  (root / "calc.py").write_text(textwrap.dedent(TOOLS))
  return root


def act(content="", calls=(), finished=True) -> dict:
  return {"text": content, "content": content, "reasoning": None, "finished": finished,
          "tool_calls": [{"id": f"functions.{n}:{i}", "name": n, "arguments": a}
                         for i, (n, a) in enumerate(calls)]}


def test_a_user_environment_runs_its_turns(user):
  pool = EnvPool(env_spec(f"{user}/user_env.py:Counter", ("limit=2",)), 2, 10.0)
  try:
    r = pool.reset({0: {"q": "first"}, 1: {"q": "second"}})
    assert [r[i].observation for i in (0, 1)] == [[{"role": "user", "content": "first"}],
                                                  [{"role": "user", "content": "second"}]]
    s = pool.step({0: act("a"), 1: act("b")})
    assert s[0].reward == 0.5 and not s[0].done and s[0].info == {"echo": "a"}
    assert s[1].observation == [{"role": "user", "content": "again 1"}]
    s = pool.step({0: act("c")})
    assert s[0].done and s[0].observation == [] and 1 not in s
    # a fresh instance at every reset: the turn count starts again
    pool.reset({0: {"q": "third"}})
    assert not pool.step({0: act("d")})[0].done
  finally:
    pool.close()


@pytest.mark.parametrize("mode, error", [
    ("raise", "step: ValueError: broken step"),
    ("nan", "step: TypeError: step returned the reward nan, not a finite number"),
    ("not-a-list", "step: TypeError: step returned str, not a list of messages"),
    ("bad-role", "role 'robot'"),
    ("hang", "step: TimeoutError: no answer within 1s"),
    ("exit", "step: the environment process ended (exit code 3"),
])
def test_a_failing_environment_costs_its_trajectory_alone(user, mode, error):
  """Slot 0 fails at its first step while slot 1 steps in the same call and is answered; slot
  0 works again at its next trajectory (a restarted process when it was killed)."""
  pool = EnvPool(env_spec(f"{user}/user_env.py:Counter", ("limit=2",)), 2, 1.0)
  try:
    pool.reset({0: {"q": "x", "mode": mode}, 1: {"q": "y"}})
    replies = pool.step({0: act("a"), 1: act("b")})
    bad, ok = replies[0], replies[1]
    assert bad.error is not None and error in bad.error, bad.error
    assert ok.error is None and ok.reward == 0.5 and ok.info == {"echo": "b"}
    r = pool.reset({0: {"q": "again"}})[0]
    assert r.error is None and r.observation == [{"role": "user", "content": "again"}]
    assert pool.step({0: act("c")})[0].error is None
  finally:
    pool.close()


@pytest.mark.parametrize("spec, args, message", [
    ("{user}/user_env.py:Missing", (), "has no class 'Missing'"),
    ("{user}/user_env.py:NoStep", (), "does not follow the environment protocol: no step"),
    ("{user}/user_env.py:NeedsArg", (), "missing 1 required positional argument: 'size'"),
    ("{user}/nowhere.py:Counter", (), "no such file"),
    ("no_colon", (), "expected a built-in"),
    ("{user}/user_env.py:Counter", ("limit",), "expected KEY=VALUE"),
    ("tools", ("module=no_such_module_here",), "No module named 'no_such_module_here'"),
])
def test_an_environment_that_cannot_be_used_refuses_the_run(user, spec, args, message):
  with pytest.raises(UserError, match=message):
    EnvPool(env_spec(spec.format(user=user), args), 1, 5.0)


def test_env_arg_needs_env():
  with pytest.raises(UserError, match="--env-arg needs --env"):
    env_spec(None, ("a=1",))
  assert env_spec(None).one_turn


def test_the_tools_environment(user, monkeypatch):
  monkeypatch.chdir(user)  # the module resolves from the working directory, as --reward's
  pool = EnvPool(env_spec("tools", ("module=calc",)), 1, 10.0)
  try:
    r = pool.reset({0: {"messages": [{"role": "user", "content": "2+3?"}], "tools": ["add"]}})[0]
    (schema,) = r.tools
    assert schema["function"]["name"] == "add"
    assert schema["function"]["description"] == "Add two integers."
    assert schema["function"]["parameters"]["properties"] == {"a": {"type": "integer"},
                                                              "b": {"type": "integer"}}
    s = pool.step({0: act(calls=[("add", '{"a": 2, "b": 3}'), ("add", "{bad json"),
                                 ("mul", "{}"), ("add", "[1, 2]")])})[0]
    assert not s.done and s.info == {"tool_calls": 4, "tool_errors": 3}
    texts = [m["content"] for m in s.observation]
    assert texts[0] == "5" and texts[1].startswith("Error: the arguments are not JSON")
    assert texts[2].startswith("Error: unknown tool 'mul'") and "object" in texts[3]
    assert [m["tool_call_id"] for m in s.observation] == [
        "functions.add:0", "functions.add:1", "functions.mul:2", "functions.add:3"]
    s = pool.step({0: act("the answer is 5")})[0]
    assert s.done and s.reward == 0.0 and s.observation == []
    pool.reset({0: {"prompt": "p", "tools": ["fail"]}})
    s = pool.step({0: act(calls=[("fail", '{"x": "y"}')])})[0]
    assert s.observation[0]["content"] == "Error: RuntimeError: tool failed: y"
    bad = pool.reset({0: {"prompt": "p", "tools": ["nope"]}})[0]
    assert "not functions of the module" in bad.error
  finally:
    pool.close()


def test_the_python_sandbox(user):
  pool = EnvPool(env_spec("python", ("timeout=2", "max_output=200")), 1, 30.0)
  try:
    r = pool.reset({0: {"prompt": "compute"}})[0]
    assert r.tools[0]["function"]["name"] == "python"

    def run(code):
      s = pool.step({0: act(calls=[("python", json_code(code))])})[0]
      assert s.error is None and not s.done
      return s.observation[0]["content"]

    assert run("print(6 * 7)") == "42\n"
    assert run("import os; open('f', 'w').write('x'); print(sorted(os.listdir('.')))") == \
        "['f']\n"
    assert run("import os; print(os.listdir('.'))") == "[]\n"  # a fresh directory each call
    assert "network" in run("import socket\n"
                            "try:\n  socket.create_connection(('1.1.1.1', 80), timeout=2)\n"
                            "except OSError as e:\n  print('no network:', e)")
    assert run("while True: pass") == "Error: the code ran past 2 s and was stopped"
    assert run("print('a' * 1000)").endswith("(801 more characters cut)")
    assert "MemoryError" in run("x = bytearray(4 * 1024 ** 3)")
  finally:
    pool.close()


def json_code(code: str) -> str:
  import json
  return json.dumps({"code": code})


def test_an_action_carries_the_parsed_turn():
  from k3jax.tokenizer.tool_calls import parse
  text = ("<think>sum</think>Let me add.<|tool_calls_section_begin|><|tool_call_begin|>"
          'functions.add:0<|tool_call_argument_begin|>{"a": 1}<|tool_call_end|>'
          "<|tool_calls_section_end|>")
  a = env.action(text, parse(text, final=True), True)
  assert a["reasoning"] == "sum" and a["content"] == "Let me add." and a["finished"]
  assert a["tool_calls"] == [{"id": "functions.add:0", "name": "add", "arguments": '{"a": 1}'}]
