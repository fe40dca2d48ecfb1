"""The process a user reward function runs in (k3jax/rl/rewards.py starts it; standard library
only, and run as a file, so it starts without importing jax or k3jax).

Protocol, one JSON object per line: the first line names the function ({"spec": "module:fn"}
or {"file": "/abs/path.py", "name": "fn"}); the worker answers {"ready": true} or {"error":
"..."}. Then each request {"prompt", "completion", "row"} gets {"value": ...} (whatever the
function returned, as JSON takes it) or {"error": "Type: message"}. Answers go to the
original stdout; the function's own prints go to stderr, so they cannot break the protocol.
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
    module_spec = importlib.util.spec_from_file_location("k3jax_user_reward", spec["file"])
    if module_spec is None:
      raise ImportError(f"cannot import {spec['file']}")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
  else:
    module = importlib.import_module(spec["module"])
  fn = getattr(module, spec["name"], None)
  if not callable(fn):
    raise AttributeError(f"{module.__name__} has no function {spec['name']!r}")
  return fn


def encode(value) -> object:
  """A number as JSON carries it; a non-finite one as its repr (JSON has no NaN), which the
  parent reads as not finite; anything else (None, a string, a list) as its type and repr."""
  if not isinstance(value, str):
    try:  # int, float, bool, numpy scalars, 0-d arrays
      x = float(value)
    except (TypeError, ValueError):
      pass
    else:
      return x if math.isfinite(x) else repr(x)
  return {"type": type(value).__name__, "repr": repr(value)[:200]}


def main() -> None:
  # run as a file, sys.path[0] is this folder: user modules resolve from the working directory
  sys.path[0] = os.getcwd()
  out = os.fdopen(os.dup(1), "w", buffering=1)
  os.dup2(2, 1)  # the function's prints go to stderr
  sys.stdout = sys.stderr

  def reply(obj) -> None:
    out.write(json.dumps(obj) + "\n")

  try:
    fn = load(json.loads(sys.stdin.readline()))
  except Exception as e:  # noqa: BLE001 - reported to the parent, which refuses the run
    reply({"error": f"{type(e).__name__}: {e}"})
    return
  reply({"ready": True})
  for line in sys.stdin:
    req = json.loads(line)
    try:
      value = fn(req["prompt"], req["completion"], req["row"])
    except Exception as e:  # noqa: BLE001 - any failure of the user's function is this sample's error
      tb = traceback.extract_tb(e.__traceback__)[-1]
      reply({"error": f"{type(e).__name__}: {e} ({os.path.basename(tb.filename)}:{tb.lineno})"})
      continue
    reply({"value": encode(value)})


if __name__ == "__main__":
  main()
