"""Rewards (`--reward`, repeatable: the terms are summed; docs/rl.md#rewards).

A term is `[WEIGHT*]NAME[:ARG]`, a built-in verifier:

    numeric         1 if the completion's final answer (the last \\boxed{...}, else its last
                    number) equals the row's `answer` as a number, else 0. An answer written
                    GSM8K's way ("... #### 72") is read after its last "####"
    exact           1 if the last \\boxed{...} (else the whole completion), stripped, equals
                    the row's `answer` as a string, else 0
    regex:PATTERN   1 if the whole completion matches PATTERN (re.fullmatch, DOTALL), else 0:
                    a format check
    length:CACHE    DAPO's soft overlong punishment: 0 up to max_new_tokens - CACHE tokens,
                    then falling linearly to -1 at max_new_tokens

or a user function `module:function` or `path/file.py:function` (the path may be absolute;
the spec is split at its last ":"), called as function(prompt, completion, row) -> float with
the prompt text, the completion text (without its stop token) and the data row as read.

A user function runs in a separate process (reward_worker.py): one that raises, returns
something not a finite number, hangs past `timeout` seconds or ends its process gives that
sample reward 0 and an error message (the loop logs and counts it), and the run goes on; a
hung process is killed and a new one started. A spec that cannot be loaded at all refuses the
run before it starts. The built-in verifiers run in this process; their errors (a row without
`answer`, say) are reported the same way.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import selectors
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

from k3jax.errors import UserError

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reward_worker.py")
START_TIMEOUT = 120.0  # seconds for the worker to start and import the user's module
TIMEOUT, ENDED = "timeout", "ended"


@dataclasses.dataclass(frozen=True)
class Sample:
  """What a reward sees of one completion."""
  prompt: str
  completion: str
  row: dict
  tokens: int          # completion tokens, the stop token included


@dataclasses.dataclass(frozen=True)
class Score:
  value: float          # the summed reward; 0 when any term failed
  passed: bool          # the first term scored >= 1 (a verifier's pass: `accuracy`)
  error: str | None = None


# ---- built-in verifiers --------------------------------------------------------------------

_NUMBER = re.compile(r"-?(?:\d[\d,]*(?:\.\d+)?|\.\d+)")


def boxed(text: str) -> str | None:
  """The content of the last \\boxed{...} (braces matched), or None."""
  start = text.rfind("\\boxed")
  while start >= 0:
    i = text.find("{", start)
    if i >= 0 and text[start + len("\\boxed"):i].strip() == "":
      depth = 0
      for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
          return text[i + 1:j]
    start = text.rfind("\\boxed", 0, start)
  return None


def to_number(text: str | None) -> float | None:
  if text is None:
    return None
  t = text.strip().replace(",", "").replace("$", "").rstrip(".")
  try:
    x = float(t)
  except ValueError:
    found = _NUMBER.findall(t)  # "x = 42" in a box
    if len(found) != 1:
      return None
    x = float(found[0].replace(",", ""))
  return x if math.isfinite(x) else None


def final_answer(completion: str) -> str | None:
  b = boxed(completion)
  if b is not None:
    return b
  numbers = _NUMBER.findall(completion)
  return numbers[-1] if numbers else None


def truth(row: dict) -> str:
  if "answer" not in row:
    raise KeyError("the data row has no 'answer' field")
  answer = str(row["answer"])
  return answer.rsplit("####", 1)[-1].strip() if "####" in answer else answer.strip()


def numeric(s: Sample) -> float:
  gold = to_number(truth(s.row))
  if gold is None:
    raise ValueError(f"the row's answer {truth(s.row)!r} is not a number")
  pred = to_number(final_answer(s.completion))
  return float(pred is not None and math.isclose(pred, gold, rel_tol=1e-9, abs_tol=1e-9))


def exact(s: Sample) -> float:
  b = boxed(s.completion)
  return float((b if b is not None else s.completion).strip() == truth(s.row))


def regex(pattern: re.Pattern) -> Callable[[Sample], float]:
  return lambda s: float(pattern.fullmatch(s.completion) is not None)


def overlong(cache: int, max_tokens: int) -> Callable[[Sample], float]:
  free = max_tokens - cache
  return lambda s: 0.0 if s.tokens <= free else max(-1.0, (free - s.tokens) / cache)


BUILTINS = ("numeric", "exact", "regex", "length")


# ---- user functions, in their own process --------------------------------------------------

def user_spec(text: str) -> dict:
  """`module:function` or `path/file.py:function` -> the worker's first line."""
  return user_code_spec("--reward", text, BUILTINS, "function")


def user_code_spec(flag: str, text: str, builtins, what: str) -> dict:
  """A user's `module:NAME` or `path/file.py:NAME` (a reward function, an environment class)
  as a worker process loads it: {"module" or "file", "name"}; UserError naming `flag`."""
  where, sep, name = text.rpartition(":")
  if not sep or not where or not name.isidentifier():
    raise UserError(f"{flag} {text!r}: expected a built-in ({', '.join(builtins)}), "
                    f"module:{what} or path/file.py:{what}")
  if where.endswith(".py") or os.sep in where or "/" in where:
    path = os.path.abspath(where)
    if not os.path.isfile(path):
      raise UserError(f"{flag} {text!r}: no such file {path}")
    return {"file": path, "name": name}
  return {"module": where, "name": name}


class UserFunction:
  """A user reward function in a worker process, with a per-call timeout."""

  def __init__(self, text: str, timeout: float):
    self.text, self.spec, self.timeout = text, user_spec(text), timeout
    self.proc: subprocess.Popen | None = None
    self._buf = b""
    error = self._start()
    if error is not None:
      raise UserError(f"--reward {text!r}: {error}")

  def _start(self) -> str | None:
    self._buf = b""
    self.proc = subprocess.Popen([sys.executable, "-u", WORKER], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, bufsize=0)
    reply = self._ask(self.spec, START_TIMEOUT)
    if not isinstance(reply, dict) or "error" in reply:
      if reply == TIMEOUT:
        self.proc.kill()
      code = self._end()
      if isinstance(reply, dict):
        return reply["error"]
      return (f"the reward process did not start within {START_TIMEOUT:g}s" if reply == TIMEOUT
              else f"the reward process ended (exit code {code})")
    return None

  def _ask(self, obj: dict, timeout: float) -> dict | str:
    """Send one request; its reply, or TIMEOUT when the worker hangs past `timeout`, or ENDED
    when its process ends."""
    try:
      self.proc.stdin.write((json.dumps(obj) + "\n").encode())
    except (BrokenPipeError, OSError):
      return ENDED
    deadline = time.monotonic() + timeout
    fd = self.proc.stdout.fileno()
    with selectors.DefaultSelector() as sel:
      sel.register(fd, selectors.EVENT_READ)
      while b"\n" not in self._buf:
        left = deadline - time.monotonic()
        if left <= 0 or not sel.select(left):
          return TIMEOUT
        chunk = os.read(fd, 65536)
        if not chunk:
          return ENDED
        self._buf += chunk
    line, self._buf = self._buf.split(b"\n", 1)
    return json.loads(line)

  def __call__(self, s: Sample) -> float:
    if self.proc is None or self.proc.poll() is not None:
      error = self._start()
      if error is not None:
        raise RuntimeError(f"restarting the reward process: {error}")
    reply = self._ask({"prompt": s.prompt, "completion": s.completion, "row": s.row},
                      self.timeout)
    if reply == TIMEOUT:
      self.proc.kill()
      self._end()
      raise TimeoutError(f"no result within {self.timeout:g}s (the reward process was killed "
                         "and is restarted)")
    if reply == ENDED:
      raise RuntimeError(f"the reward process ended (exit code {self._end()}; it is "
                         "restarted)")
    if "error" in reply:
      raise RuntimeError(reply["error"])
    value = reply["value"]
    if isinstance(value, dict):
      raise TypeError(f"returned {value['repr']} ({value['type']}), not a number")
    return float(value)  # "nan" / "inf" strings: not finite, refused by the caller

  def _end(self) -> int | None:
    """Stop the worker (kill it unless it has ended); its exit code."""
    if self.proc is None:
      return None
    try:  # an ending process closes its pipe just before it can be reaped
      code = self.proc.wait(timeout=1.0)
    except subprocess.TimeoutExpired:
      self.proc.kill()
      code = self.proc.wait()
    for f in (self.proc.stdin, self.proc.stdout):
      f.close()
    self.proc = None
    return code

  def close(self) -> None:
    if self.proc is not None and self.proc.poll() is None:
      self.proc.kill()
    self._end()


# ---- the reward of a run -----------------------------------------------------------------

@dataclasses.dataclass
class Term:
  text: str
  weight: float
  fn: Callable[[Sample], float]


def parse_term(text: str, max_tokens: int, timeout: float) -> Term:
  weight, body = 1.0, text.strip()
  head, star, rest = body.partition("*")
  if star:
    try:
      weight, body = float(head), rest.strip()
    except ValueError:
      pass  # a `*` inside a pattern or a path
  name, _, arg = body.partition(":")
  if name in ("numeric", "exact"):
    if arg:
      raise UserError(f"--reward {text!r}: {name} takes no argument")
    return Term(text, weight, numeric if name == "numeric" else exact)
  if name == "regex":
    try:
      return Term(text, weight, regex(re.compile(arg, re.DOTALL)))
    except re.error as e:
      raise UserError(f"--reward {text!r}: bad pattern: {e}") from None
  if name == "length":
    if not arg.isdigit() or not 0 < int(arg) <= max_tokens:
      raise UserError(f"--reward {text!r}: length:CACHE needs 0 < CACHE <= --max-new-tokens "
                      f"({max_tokens})")
    return Term(text, weight, overlong(int(arg), max_tokens))
  return Term(text, weight, UserFunction(body, timeout))


class Reward:
  """The summed terms of `--reward`, scoring samples so that no failure escapes."""

  def __init__(self, specs: Sequence[str], max_tokens: int, timeout: float):
    if not specs:
      raise UserError("--reward: give at least one")
    self.terms: list[Term] = []
    try:
      for spec in specs:
        self.terms.append(parse_term(spec, max_tokens, timeout))
    except BaseException:
      self.close()
      raise

  def score(self, s: Sample) -> Score:
    total, first = 0.0, 0.0
    for i, term in enumerate(self.terms):
      try:
        value = float(term.fn(s))
        if not math.isfinite(value):
          raise ValueError(f"returned {value}, not a finite number")
      except Exception as e:  # noqa: BLE001 - any failure: this sample scores 0
        return Score(0.0, False, f"{term.text}: {type(e).__name__}: {e}")
      total += term.weight * value
      first = value if i == 0 else first
    return Score(total, first >= 1.0)

  def close(self) -> None:
    for term in self.terms:
      if isinstance(term.fn, UserFunction):
        term.fn.close()
