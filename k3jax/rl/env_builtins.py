"""The built-in environments `--env tools` and `--env python` (docs/rl.md#environments).

Standard library only: they run in the environment worker (env_worker.py) like a user's
class. Both follow the protocol of k3jax/rl/env.py; their reward is 0 (the `--reward` terms
score the final answer), and `info` counts `tool_calls` and `tool_errors`.

    tools    --env-arg module=MODULE_OR_FILE.py: the row's `tools` (a list of function names;
             none: every public function of the module) are the model's tools, declared to
             the chat template as OpenAI function schemas read from their signatures and
             docstrings (--env-arg declare=false: not declared; the prompt describes them).
             Each call of a turn is run and answered with a tool message (its result as
             text); a call with arguments that are not a JSON object, an unknown
             name or a function that raises is answered with the error (counted in
             tool_errors). A turn without calls ends the trajectory.
    python   one tool, `python(code)`: the code runs in a sandbox (a separate process, a
             fresh temporary directory as its working directory, `timeout` seconds of wall
             time, `memory_mb` of address space, `max_output` characters of output, no
             network: a new network namespace where the system allows one, else Python's
             socket module refuses to connect) and its output (stdout, then stderr) is the
             tool's answer.
"""

import importlib
import importlib.util
import inspect
import json
import os
import resource
import subprocess
import sys
import tempfile

JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array",
              dict: "object"}


def _messages(row: dict) -> list:
  if isinstance(row.get("messages"), list):
    return list(row["messages"])
  if isinstance(row.get("prompt"), str):
    return [{"role": "user", "content": row["prompt"]}]
  raise ValueError("the row has neither `messages` nor `prompt`")


def _load_module(where: str):
  if where.endswith(".py") or os.sep in where:
    spec = importlib.util.spec_from_file_location("k3jax_user_tools", os.path.abspath(where))
    if spec is None:
      raise ImportError(f"cannot import {where}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
  return importlib.import_module(where)


def schema(name: str, fn) -> dict:
  """An OpenAI function schema from a function's signature and docstring."""
  props, required = {}, []
  for p in inspect.signature(fn).parameters.values():
    if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
      continue
    props[p.name] = {"type": JSON_TYPES.get(p.annotation, "string")}
    if p.default is p.empty:
      required.append(p.name)
  return {"type": "function", "function": {
      "name": name, "description": inspect.getdoc(fn) or "",
      "parameters": {"type": "object", "properties": props, "required": required}}}


class _ToolEnv:
  """Runs a turn's tool calls with `self.functions`; a turn without calls ends. `declare`
  False: the tools are not declared to the chat template (the prompt describes them)."""
  functions: dict = {}
  declare: bool = True

  def reset(self, row: dict):
    messages = _messages(row)
    if not self.declare:
      return messages
    return {"messages": messages, "tools": [schema(n, f) for n, f in self.functions.items()]}

  def step(self, action: dict):
    calls = action.get("tool_calls") or []
    if not calls or not action.get("finished", True):
      return [], 0.0, True, {"tool_calls": 0, "tool_errors": 0}
    out, errors = [], 0
    for call in calls:
      text, ok = self.call(call)
      errors += not ok
      out.append({"role": "tool", "tool_call_id": call["id"], "content": text})
    return out, 0.0, False, {"tool_calls": len(calls), "tool_errors": errors}

  def call(self, call: dict) -> tuple[str, bool]:
    fn = self.functions.get(call["name"])
    if fn is None:
      return (f"Error: unknown tool {call['name']!r} (tools: "
              f"{', '.join(sorted(self.functions))})", False)
    try:
      args = json.loads(call["arguments"] or "{}")
    except json.JSONDecodeError as e:
      return f"Error: the arguments are not JSON ({e.msg})", False
    if not isinstance(args, dict):
      return "Error: the arguments must be a JSON object", False
    try:
      return str(fn(**args)), True
    except Exception as e:  # noqa: BLE001 - the model sees the error and the run goes on
      return f"Error: {type(e).__name__}: {e}", False


class Tools(_ToolEnv):
  """`--env tools --env-arg module=...` (module docstring)."""

  def __init__(self, module: str, declare: bool = True):
    self.module, self.declare = _load_module(module), bool(declare)
    self.all = {n: f for n, f in vars(self.module).items()
                if inspect.isfunction(f) and not n.startswith("_")
                and f.__module__ == self.module.__name__}
    self.functions = dict(self.all)

  def reset(self, row: dict):
    names = row.get("tools")
    if names is not None:
      unknown = [n for n in names if n not in self.all]
      if unknown:
        raise ValueError(f"the row's tools {unknown} are not functions of the module")
      self.functions = {n: self.all[n] for n in names}
    return super().reset(row)


class Python(_ToolEnv):
  """`--env python` (module docstring): one tool, python(code)."""

  def __init__(self, timeout: float = 10.0, memory_mb: int = 512, max_output: int = 4000,
               declare: bool = True):
    self.timeout, self.memory_mb, self.max_output = float(timeout), int(memory_mb), max_output
    self.declare = bool(declare)

    def python(code: str) -> str:
      """Run Python code in a sandbox and return its output (stdout, then stderr)."""
      return run_sandboxed(code, self.timeout, self.memory_mb, self.max_output)
    self.functions = {"python": python}


# the sandbox's child: no network when no namespace could be made, then the code from stdin
_PRELUDE = """\
import socket, sys
if sys.argv[1] == "guard":
  def _refuse(*a, **k):
    raise OSError("the sandbox has no network")
  socket.socket.connect = socket.socket.connect_ex = socket.create_connection = _refuse
  socket.getaddrinfo = _refuse
del socket
exec(compile(sys.stdin.read(), "<tool>", "exec"), {"__name__": "__main__"})
"""


def _limits(memory_mb: int, isolate: bool):
  def apply():
    limit = memory_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if isolate:
      os.unshare(os.CLONE_NEWUSER | os.CLONE_NEWNET)
  return apply


def network_isolation() -> bool:
  """Whether this system lets an unprivileged process enter a new network namespace."""
  try:
    r = subprocess.run([sys.executable, "-c", "0"], preexec_fn=_limits(256, True),
                       capture_output=True, timeout=30)
  except (OSError, subprocess.SubprocessError):
    return False
  return r.returncode == 0


_ISOLATION = None


def run_sandboxed(code: str, timeout: float, memory_mb: int, max_output: int) -> str:
  global _ISOLATION
  if _ISOLATION is None:
    _ISOLATION = network_isolation()
  with tempfile.TemporaryDirectory(prefix="k3jax-python-") as tmp:
    try:
      r = subprocess.run(
          [sys.executable, "-I", "-c", _PRELUDE, "namespace" if _ISOLATION else "guard"],
          input=code, capture_output=True, text=True, timeout=timeout, cwd=tmp,
          env={"PATH": "/usr/bin:/bin", "HOME": tmp, "TMPDIR": tmp},
          preexec_fn=_limits(memory_mb, _ISOLATION))
    except subprocess.TimeoutExpired:
      return f"Error: the code ran past {timeout:g} s and was stopped"
  text = r.stdout + (r.stderr if r.stderr else "")
  if r.returncode and not r.stderr:
    text += f"(exit code {r.returncode})"
  if len(text) > max_output:
    text = text[:max_output] + f"\n... ({len(text) - max_output} more characters cut)"
  return text
