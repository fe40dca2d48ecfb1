"""When a run stops to save: preemption, and saves every M minutes
(docs/training.md#a-pod-run-step-by-step).

Preemption. A process told to stop (SIGTERM; on Cloud TPU also the maintenance notice JAX's
preemption notifier watches) must not die mid-run: the run finishes the step it is in, saves
it and exits 0, and the same command resumes from there. With several processes every one
must save the same step: JAX's preemption sync manager (`multihost_utils
.reached_preemption_sync_point`, what Orbax's `reached_preemption` calls) catches SIGTERM in
each process, tells the others through the coordination service and names a check, the same
on every process, past every process's current one. One process alone has no coordination
service: a SIGTERM handler sets a flag that the next check reads.

Checks are numbered per process, 1 at start-up (before the first step), then one after every
step, so every process numbers them alike whatever step it resumed from. A notice during
start-up (before any process checked) stops the run at check 1: no step runs, nothing new is
saved (the last checkpoint stands).

Saves every M minutes (`SaveClock`): process 0's clock decides, and every process reads its
decision at the same check (`sharding.distributed.decided_by_main`), so all save one step.
"""

from __future__ import annotations

import signal
import threading
import time

import jax
from jax._src import distributed as _jax_distributed  # the preemption sync manager
from jax.experimental import multihost_utils

from sharding import distributed


class Preemption:
  """Whether the run must stop and save at this check (see the module docstring). Create it
  before the processes join (its SIGTERM handler must come before JAX's notifier, which then
  replaces it in a multi-process run); `close()` restores the previous handler."""

  def __init__(self):
    self.signalled: int | None = None
    self.checks = 0
    self._previous = None
    if threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._on_signal)

  def _on_signal(self, signum, frame) -> None:
    self.signalled = signum

  def reached(self) -> bool:
    """True at the same check on every process once one of them was told to stop."""
    self.checks += 1
    if jax.process_count() > 1:
      if _jax_distributed.global_state.preemption_sync_manager is None:
        return False  # jax_enable_preemption_service off
      return multihost_utils.reached_preemption_sync_point(self.checks)
    return self.signalled is not None

  def close(self) -> None:
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)
      self._previous = None


class SaveClock:
  """--save-every-minutes M: a save is due once M minutes passed since the last save (or the
  start), by process 0's clock, read by every process at the same check."""

  def __init__(self, minutes: float | None):
    self.every_s = None if minutes is None else minutes * 60.0
    self.last = time.monotonic()

  def due(self, timeout_s: float) -> bool:
    """Call at the same point of every process's loop (after each step) when enabled."""
    if self.every_s is None:
      return False
    return distributed.decided_by_main(
        "k3jax-save-clock", lambda: time.monotonic() - self.last >= self.every_s, timeout_s)

  def saved(self) -> None:
    self.last = time.monotonic()
