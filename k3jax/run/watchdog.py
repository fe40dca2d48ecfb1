"""A watchdog for the phases of a run that wait on other processes or on the devices: the
start-up barrier, a step, an eval, a checkpoint save (docs/training.md#a-pod-run-step-by-step).

A process blocked in a collective whose peer is gone, stalled or running another program
waits forever: no error, no exit, a whole slice idle. Each process runs one watchdog thread;
the run arms it with a deadline before a phase and disarms it after. A phase that overruns
ends the process at once with one line on stderr naming the phase and what it waited for, and
exit status EXIT_STALLED (75, EX_TEMPFAIL: start the same command again, it resumes from the
last complete checkpoint). Every process arms the same phases with the same deadlines, so the
processes blocked behind a stalled one end within the same timeout as it does.

Deadlines (`Deadlines`): the start-up phases (compiling, the barrier, the first step) get
--startup-timeout; a step gets --step-timeout when given, else FACTOR x the slowest of the
recent measured steps but at least FLOOR_S (--startup-timeout until a step was measured); an
eval or a save gets the step's deadline times its count of batches or at least SAVE_FLOOR_S.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import sys
import threading
import time

EXIT_STALLED = 75  # EX_TEMPFAIL: a launcher restarts the run
FACTOR = 10.0      # a step's deadline, in slowest recent steps
FLOOR_S = 300.0    # ... but never less (a GC pause, a slow host, a busy file system)
SAVE_FLOOR_S = 600.0


class Watchdog:
  """One thread that ends the process when an armed phase outlives its deadline."""

  def __init__(self, command: str, *, exit_fn=os._exit):
    self.command, self._exit = command, exit_fn
    self._cv = threading.Condition()
    self._phases: list[tuple[str, float, float]] = []  # (what, timeout, deadline), nested
    self._closed = False
    self._thread = threading.Thread(target=self._watch, name="k3jax-watchdog", daemon=True)
    self._thread.start()

  @contextlib.contextmanager
  def phase(self, what: str, timeout_s: float | None):
    """Arm the watchdog for `what` (e.g. "step 5: waiting for its result from the devices")
    for `timeout_s` seconds (None: not watched). Phases nest: each keeps its own deadline."""
    if timeout_s is None:
      yield
      return
    entry = (what, timeout_s, time.monotonic() + timeout_s)
    with self._cv:
      self._phases.append(entry)
      self._cv.notify()
    try:
      yield
    finally:
      with self._cv:
        self._phases.remove(entry)
        self._cv.notify()

  def close(self) -> None:
    with self._cv:
      self._closed = True
      self._cv.notify()
    self._thread.join(5)

  def _watch(self) -> None:
    with self._cv:
      while not self._closed:
        if not self._phases:
          self._cv.wait()
          continue
        what, timeout, deadline = min(self._phases, key=lambda p: p[2])
        remaining = deadline - time.monotonic()
        if remaining > 0:
          self._cv.wait(remaining)
          continue
        print(f"k3jax {self.command}: error: {what}: not done after {timeout:.0f} s; this "
              f"process stops (exit {EXIT_STALLED}) and so does every process waiting on it: "
              "run the same command again to resume from the last complete checkpoint",
              file=sys.stderr, flush=True)
        self._exit(EXIT_STALLED)
        return


@dataclasses.dataclass
class Deadlines:
  """How long each phase of a run may take (see the module docstring)."""
  startup_s: float                   # --startup-timeout
  step_s: float | None = None        # --step-timeout (None: derived from the measured steps)
  recent: collections.deque = dataclasses.field(
      default_factory=lambda: collections.deque(maxlen=20))

  def measured(self, seconds: float) -> None:
    """A step's measured time (compilation excluded)."""
    self.recent.append(seconds)

  def step(self) -> float:
    if self.step_s is not None:
      return self.step_s
    if not self.recent:
      return self.startup_s
    return max(FLOOR_S, FACTOR * max(self.recent))

  def eval(self, batches: int) -> float:
    return self.step() * max(batches, 1)

  def save(self) -> float:
    return self.step_s if self.step_s is not None else max(SAVE_FLOOR_S, self.step())
