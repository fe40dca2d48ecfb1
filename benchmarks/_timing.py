"""Timing shared by the benchmark scripts."""

from __future__ import annotations

import statistics
import time

import jax


def timed(fn, *args, reps):
  """Median wall seconds of fn(*args) after one warm-up call (which also compiles)."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)
