"""The process an RL environment runs in (k3jax/rl/env.py starts one per trajectory slot;
standard library only, and run as a file, so it starts without importing jax or k3jax).

Protocol, one JSON object per line: the first line names the class ({"module": "pkg.mod",
"name": "Class"} or {"file": "/abs/path.py", "name": "Class"}) and its keyword arguments
("args"); the worker loads it, checks that it has callable `reset` and `step`, builds one
instance and answers {"ready": true} or {"error": "..."}. Then each request gets one answer:

    {"op": "reset", "row": {...}}        a fresh instance, then reset(row)
                                         -> {"observation": ...}
    {"op": "step", "action": {...}}      step(action) -> {"observation": ..., "reward": ...,
                                         "done": ..., "info": ...}

or {"error": "Type: message"} when the call raises or returns something JSON cannot carry or
that is not (observation, reward, done, info). The values are checked in the parent
(env.py). Answers go to the original stdout; the environment's own prints go to stderr.
"""

import importlib
import importlib.util
import json
import math
import os
import sys
import traceback


def load(spec: dict):
  if "file" in spec:
    module_spec = importlib.util.spec_from_file_location("k3jax_user_env", spec["file"])
    if module_spec is None:
      raise ImportError(f"cannot import {spec['file']}")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = module
    module_spec.loader.exec_module(module)
  else:
    module = importlib.import_module(spec["module"])
  cls = getattr(module, spec["name"], None)
  if not isinstance(cls, type):
    raise AttributeError(f"{module.__name__} has no class {spec['name']!r}")
  missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
  if missing:
    raise TypeError(f"{spec['name']} does not follow the environment protocol: no "
                    f"{' or '.join(missing)} method (reset(row) -> observation, step(action) "
                    "-> (observation, reward, done, info))")
  return cls


def number(x):
  """A reward as JSON carries it: a finite float, or its repr (the parent refuses it)."""
  if isinstance(x, bool) or not isinstance(x, (int, float)):
    try:
      x = float(x)  # numpy scalars
    except (TypeError, ValueError):
      return {"repr": repr(x)[:200]}
  return x if math.isfinite(x) else {"repr": repr(x)}


def answer(env, req: dict) -> dict:
  if req["op"] == "reset":
    return {"observation": env.reset(req["row"])}
  out = env.step(req["action"])
  if not isinstance(out, tuple) or len(out) != 4:
    raise TypeError(f"step returned {type(out).__name__}, not (observation, reward, done, "
                    "info)")
  observation, reward, done, info = out
  return {"observation": observation, "reward": number(reward), "done": done, "info": info}


def main() -> None:
  # run as a file, sys.path[0] is this folder: user modules resolve from the working directory
  sys.path[0] = os.getcwd()
  out = os.fdopen(os.dup(1), "w", buffering=1)
  os.dup2(2, 1)  # the environment's prints go to stderr
  sys.stdout = sys.stderr

  def reply(obj) -> None:
    try:
      line = json.dumps(obj)
    except (TypeError, ValueError) as e:
      line = json.dumps({"error": f"TypeError: returned something JSON cannot carry ({e})"})
    out.write(line + "\n")

  try:
    spec = json.loads(sys.stdin.readline())
    cls = load(spec)
    args = spec.get("args", {})
    env = cls(**args)
  except Exception as e:  # noqa: BLE001 - reported to the parent, which refuses the run
    reply({"error": f"{type(e).__name__}: {e}"})
    return
  reply({"ready": True})
  for line in sys.stdin:
    req = json.loads(line)
    try:
      if req["op"] == "reset":
        env = cls(**args)
      reply(answer(env, req))
    except Exception as e:  # noqa: BLE001 - any failure of the environment ends its trajectory
      tb = traceback.extract_tb(e.__traceback__)[-1]
      reply({"error": f"{type(e).__name__}: {e} ({os.path.basename(tb.filename)}:{tb.lineno})"})


if __name__ == "__main__":
  main()
