"""Environments for multi-turn RL (`--env`; docs/rl.md#environments).

The protocol. An environment is a class, built with the `--env-arg k=v` values as keyword
arguments (a value that reads as JSON is passed as that JSON, else as text), with two methods:

    reset(row) -> observation
        `row`: the data row as read. The observation: the messages the trajectory starts
        with (chat messages {role, content, ...}), or {"messages": [...], "tools": [...]} to
        declare tools (OpenAI function schemas) to the chat template as well.
    step(action) -> (observation, reward, done, info)
        `action`: the assistant's turn, {"text": its text (without the end-of-turn token),
        "content", "reasoning" (None when there is none), "tool_calls": [{"id", "name",
        "arguments"}] (the arguments as the model wrote them: JSON text), "finished": False
        when the turn was cut (max tokens) rather than ended by the model}. The observation:
        messages to append (tool results {"role": "tool", "tool_call_id", "content"}, user
        turns); `reward` a finite number (the trajectory's reward is the sum of its steps',
        plus the `--reward` terms on its last turn); `done` ends the trajectory; `info` a
        JSON object (`tool_calls` and `tool_errors` in it are counted in the metrics).

Every trajectory gets a fresh instance at its reset. Each runs in its own worker process
(env_worker.py, standard library only; one process per trajectory slot, reused): a call that
raises, returns something that does not follow the protocol (an observation that is not a
list of messages, a reward that is not a finite number), runs past `--env-timeout` seconds
(its process is killed and a new one started) or ends its process ends that trajectory with
reward 0; the error is counted (`env_errors`) and logged, and the run goes on. A class that
cannot be loaded, that lacks `reset` or `step`, or whose constructor refuses the arguments
refuses the run before it starts.

`--env` is `module:Class`, `path/file.py:Class`, or a built-in (env_builtins.py): `tools`
(a user module's functions as tools), `python` (a sandboxed Python executor). Without
`--env`, a row is one turn scored by `--reward`: the verifiers as a one-turn environment
(`ONE_TURN`, run in this process).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import selectors
import subprocess
import sys
import time
from collections.abc import Mapping

from k3jax.errors import UserError
from k3jax.rl.rewards import user_code_spec
from k3jax.tokenizer.chat import ROLES
from k3jax.tokenizer.tool_calls import Parsed

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "env_worker.py")
BUILTINS = {"tools": "Tools", "python": "Python"}
ONE_TURN = "one-turn"
START_TIMEOUT = 120.0  # seconds for a worker to start, import and build the class
TIMEOUT, ENDED = "timeout", "ended"


@dataclasses.dataclass(frozen=True)
class EnvSpec:
  text: str                # as given (--env)
  load: dict               # the worker's first line: module or file, class name, args

  @property
  def one_turn(self) -> bool:
    return self.text == ONE_TURN


def parse_arg(text: str) -> tuple[str, object]:
  key, sep, value = text.partition("=")
  if not sep or not key.isidentifier():
    raise UserError(f"--env-arg {text!r}: expected KEY=VALUE")
  try:
    return key, json.loads(value)
  except json.JSONDecodeError:
    return key, value


def env_spec(text: str | None, args: tuple[str, ...] = ()) -> EnvSpec:
  """`--env` and its `--env-arg`s as the worker loads them (UserError for a bad spelling)."""
  if text is None:
    if args:
      raise UserError("--env-arg needs --env")
    return EnvSpec(ONE_TURN, {})
  kwargs = dict(parse_arg(a) for a in args)
  if text in BUILTINS:
    return EnvSpec(text, {"file": os.path.join(HERE, "env_builtins.py"),
                          "name": BUILTINS[text], "args": kwargs})
  return EnvSpec(text, {**user_code_spec("--env", text, BUILTINS, "Class"), "args": kwargs})


@dataclasses.dataclass
class Reply:
  """One call's result: what the environment returned, checked, or the error that ends the
  trajectory."""
  observation: list[dict] = dataclasses.field(default_factory=list)
  tools: list[dict] | None = None
  reward: float = 0.0
  done: bool = True
  info: dict = dataclasses.field(default_factory=dict)
  error: str | None = None


def action(text: str, parsed: Parsed, finished: bool) -> dict:
  """The assistant turn as `step` receives it."""
  return {"text": text, "content": parsed.content, "reasoning": parsed.reasoning,
          "tool_calls": [{"id": c.id, "name": c.name, "arguments": c.arguments}
                         for c in parsed.tool_calls], "finished": finished}


def check_messages(obs, what: str) -> list[dict]:
  if not isinstance(obs, list) or not all(isinstance(m, dict) for m in obs):
    raise TypeError(f"{what} returned {type(obs).__name__}, not a list of messages")
  for m in obs:
    if m.get("role") not in ROLES:
      raise TypeError(f"{what} returned a message with role {m.get('role')!r} (expected one "
                      f"of {', '.join(ROLES)})")
    if not isinstance(m.get("content", ""), str) and m.get("content") is not None:
      raise TypeError(f"{what} returned a message whose content is not text")
  return obs


def checked(op: str, reply: dict) -> Reply:
  """The worker's answer as a Reply, or TypeError naming what breaks the protocol."""
  obs = reply["observation"]
  if op == "reset":
    tools = None
    if isinstance(obs, Mapping):
      obs, tools = obs.get("messages"), obs.get("tools")
      if tools is not None and not (isinstance(tools, list)
                                    and all(isinstance(t, dict) for t in tools)):
        raise TypeError("reset returned tools that are not a list of objects")
    return Reply(check_messages(obs, "reset"), tools=tools, done=False)
  reward = reply["reward"]
  if not isinstance(reward, (int, float)) or not math.isfinite(reward):
    shown = reward["repr"] if isinstance(reward, dict) else repr(reward)
    raise TypeError(f"step returned the reward {shown}, not a finite number")
  if not isinstance(reply["done"], bool):
    raise TypeError(f"step returned done={reply['done']!r}, not true or false")
  if not isinstance(reply["info"], dict):
    raise TypeError("step returned info that is not an object")
  return Reply(check_messages(obs, "step"), reward=float(reward), done=reply["done"],
               info=reply["info"])


class Worker:
  """One environment process: a request at a time, its answer read with a deadline."""

  def __init__(self, load: dict):
    self.load = load
    self.proc: subprocess.Popen | None = None
    self._buf = b""

  def start(self) -> str | None:
    """Start the process; None, or why it could not start."""
    self._buf = b""
    self.proc = subprocess.Popen([sys.executable, "-u", WORKER], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, bufsize=0)
    if not self.send(self.load):
      return f"the environment process ended (exit code {self.stop()})"
    reply = self.wait(time.monotonic() + START_TIMEOUT)
    if isinstance(reply, dict) and "error" not in reply:
      return None
    code = self.stop()
    if isinstance(reply, dict):
      return reply["error"]
    return (f"the environment process did not start within {START_TIMEOUT:g}s"
            if reply == TIMEOUT else f"the environment process ended (exit code {code})")

  @property
  def alive(self) -> bool:
    return self.proc is not None and self.proc.poll() is None

  def send(self, obj: dict) -> bool:
    try:
      self.proc.stdin.write((json.dumps(obj) + "\n").encode())
      return True
    except (BrokenPipeError, OSError):
      return False

  def ready(self) -> dict | None:
    """A complete answer already read, if any."""
    if b"\n" not in self._buf:
      return None
    line, self._buf = self._buf.split(b"\n", 1)
    return json.loads(line)

  def read(self) -> bool:
    """Read what the pipe holds; False when the process has ended."""
    chunk = os.read(self.proc.stdout.fileno(), 65536)
    self._buf += chunk
    return bool(chunk)

  def wait(self, deadline: float) -> dict | str:
    with selectors.DefaultSelector() as sel:
      sel.register(self.proc.stdout.fileno(), selectors.EVENT_READ)
      while (reply := self.ready()) is None:
        left = deadline - time.monotonic()
        if left <= 0 or not sel.select(left):
          return TIMEOUT
        if not self.read():
          return ENDED
    return reply

  def stop(self) -> int | None:
    """End the process (killed unless it has ended); its exit code."""
    if self.proc is None:
      return None
    if self.proc.poll() is None:
      self.proc.kill()
    code = self.proc.wait()
    for f in (self.proc.stdin, self.proc.stdout):
      f.close()
    self.proc = None
    return code


class EnvPool:
  """`size` environment processes, one per trajectory slot; `call` runs one request on each
  of several slots at once, each with its own deadline of `timeout` seconds."""

  def __init__(self, spec: EnvSpec, size: int, timeout: float):
    self.spec, self.timeout = spec, timeout
    self.workers = [Worker(spec.load) for _ in range(size)]
    try:
      for w in self.workers:
        error = w.start()
        if error is not None:
          raise UserError(f"--env {spec.text!r}: {error}")
    except BaseException:
      self.close()
      raise

  def reset(self, rows: Mapping[int, dict]) -> dict[int, Reply]:
    return self.call("reset", {slot: {"op": "reset", "row": row} for slot, row in rows.items()})

  def step(self, actions: Mapping[int, dict]) -> dict[int, Reply]:
    return self.call("step", {slot: {"op": "step", "action": a} for slot, a in actions.items()})

  def call(self, op: str, requests: Mapping[int, dict]) -> dict[int, Reply]:
    out: dict[int, Reply] = {}
    sent = {}
    for slot, req in requests.items():
      w = self.workers[slot]
      error = None if w.alive else w.start()
      if error is None and not w.send(req):
        error = f"the environment process ended (exit code {w.stop()}; it is restarted)"
      if error is not None:
        out[slot] = Reply(error=f"{op}: {error}")
      else:
        sent[slot] = w
    deadline = time.monotonic() + self.timeout
    for slot, reply in self._answers(sent, deadline).items():
      out[slot] = self._reply(op, sent[slot], reply)
    return out

  def _answers(self, sent: dict[int, Worker], deadline: float) -> dict[int, dict | str]:
    """Every sent request's answer, TIMEOUT or ENDED."""
    got: dict[int, dict | str] = {}
    with selectors.DefaultSelector() as sel:
      for slot, w in sent.items():
        sel.register(w.proc.stdout.fileno(), selectors.EVENT_READ, slot)
      while len(got) < len(sent):
        left = deadline - time.monotonic()
        events = sel.select(left) if left > 0 else []
        if not events:
          got.update({s: TIMEOUT for s in sent if s not in got})
          break
        for key, _ in events:
          slot = key.data
          w = sent[slot]
          if not w.read():
            got[slot] = ENDED
            sel.unregister(key.fileobj)
          elif (reply := w.ready()) is not None:
            got[slot] = reply
            sel.unregister(key.fileobj)
    return got

  def _reply(self, op: str, w: Worker, reply: dict | str) -> Reply:
    if reply == TIMEOUT:
      w.stop()
      return Reply(error=f"{op}: TimeoutError: no answer within {self.timeout:g}s (the "
                         "environment process was killed and is restarted)")
    if reply == ENDED:
      return Reply(error=f"{op}: the environment process ended (exit code {w.stop()}; it is "
                         "restarted)")
    if "error" in reply:
      return Reply(error=f"{op}: {reply['error']}")
    try:
      return checked(op, reply)
    except TypeError as e:
      return Reply(error=f"{op}: TypeError: {e}")

  def close(self) -> None:
    for w in self.workers:
      w.stop()
