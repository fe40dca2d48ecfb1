"""Timing shared by the benchmark scripts."""

from __future__ import annotations

import statistics
import time

import jax


def median_seconds(call, reps: int) -> float:
  """Median wall seconds of `call()` (which blocks until its results are ready) over `reps`
  calls, after one warm-up call (which also compiles)."""
  call()
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    call()
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def timed(fn, *args, reps):
  """Median wall seconds of fn(*args) after one warm-up call (which also compiles)."""
  return median_seconds(lambda: jax.block_until_ready(fn(*args)), reps)
