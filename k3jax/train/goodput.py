"""Goodput: how much of a run's wall time, since its first start, went into productive steps,
and where the rest went (docs/training.md#where-a-steps-time-goes).

Running totals in seconds, as of a step:
  productive_s   the steps' own time (step_time_s less the wait for data; a start's first
                 step counts as the median step, the rest of it is compile_s)
  compile_s      tracing and compiling: a start's first step beyond a median step
  data_wait_s    waiting for the input pipeline
  checkpoint_s   saves blocking the loop
  lost_s         steps done after the checkpoint a restart resumed from: computed twice

The totals travel in every checkpoint's meta (as of its step) and in OUT/goodput.json (process
0, as of the last step, with the first start's time). A restart resumes the checkpoint's
totals; what goodput.json holds beyond them was lost and moves to lost_s. The summary's
`goodput` is productive_s over the wall seconds since the first start; `badput_s` splits the
rest by cause, `other` being start-up, evals and the time between starts.
"""

from __future__ import annotations

import json
import os
import time

FILE = "goodput.json"
KEYS = ("productive_s", "compile_s", "data_wait_s", "checkpoint_s", "lost_s")
# the work a restart can lose (a checkpoint's meta is written before its own save's time
# is added, so saves stay out of it)
WORK = ("productive_s", "compile_s", "data_wait_s")


class Goodput:
  """The totals of one run, continued across its starts."""

  def __init__(self, out: str, meta: dict | None):
    self.path = os.path.join(out, FILE)
    saved = _read(self.path)
    self.first_start = saved.get("first_start", time.time())
    self.totals = {k: float((meta or {}).get("goodput", {}).get(k, 0.0)) for k in KEYS}
    done_since = sum(float(saved.get(k, 0.0)) for k in WORK) - sum(self.totals[k] for k in WORK)
    self.totals["lost_s"] += max(done_since, 0.0)  # work past the checkpoint, done again
    self._first: float | None = None  # this start's first step, until a step is measured

  def step(self, seconds: float, data_wait: float, first: bool) -> None:
    """A step's time: a start's first step is compile time until a later step's time says
    how much of it was the step itself."""
    self.totals["data_wait_s"] += data_wait
    work = max(seconds - data_wait, 0.0)
    if first:
      self.totals["compile_s"] += work
      self._first = work
      return
    self.totals["productive_s"] += work
    if self._first is not None:
      moved, self._first = min(work, self._first), None
      self.totals["compile_s"] -= moved
      self.totals["productive_s"] += moved

  def add(self, key: str, seconds: float) -> None:
    self.totals[key] += seconds

  def as_meta(self) -> dict:
    return dict(self.totals)

  def write(self) -> None:
    """OUT/goodput.json as of now (process 0)."""
    tmp = self.path + ".tmp"
    with open(tmp, "w") as f:
      json.dump({"first_start": self.first_start, **self.totals}, f)
    os.replace(tmp, self.path)

  def summary(self) -> dict:
    wall = max(time.time() - self.first_start, 1e-9)
    t = self.totals
    other = wall - sum(t.values())
    return {"goodput": t["productive_s"] / wall, "wall_s": wall,
            "badput_s": {"compile": t["compile_s"], "data_wait": t["data_wait_s"],
                         "checkpoint": t["checkpoint_s"], "lost_to_restarts": t["lost_s"],
                         "other": max(other, 0.0)}}


def _read(path: str) -> dict:
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return {}
