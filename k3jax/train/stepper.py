"""The steps of a training run (loop.py sets the run up and hands it here): each step's batch
read and placed, the step dispatched, its metrics read one step late, evals, checkpoints,
preemption and the profile (docs/training.md#where-a-steps-time-goes).

The host never waits for the devices to log: step s's metrics are read after step s+1 has
been queued, so the device works on s+1 while the host reads s, fetches the next batch and
writes the metrics line. At a step that evaluates, saves, stops or ends a profile the loop
reads that step at once (they need its state anyway).

Timing keys of step s's metrics line (seconds):
  data_wait_s         waiting for batch s from the input pipeline
  host_to_device_s    placing it on the devices as the step's global arrays
  device_s            waiting for step s's result when its metrics were read
  checkpoint_block_s  the part of a save at step s that blocked the loop (0: none)
  step_time_s         from the end of step s-1 (its metrics read) to the end of step s, the
                      time of evals and saves left out; tokens_per_s and mfu divide by it
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import jax

from k3jax.train import state as state_lib
from sharding import distributed

PROFILE_DIR = "profile"


@dataclasses.dataclass
class Pending:
  """A dispatched step whose metrics are not read yet."""
  step: int
  metrics: Any        # device arrays
  times: dict         # data_wait_s, host_to_device_s


def next_batch(run, iterator) -> tuple[dict, dict]:
  """(batch s placed on the devices, {data_wait_s, host_to_device_s})."""
  t0 = time.perf_counter()
  host = next(iterator)
  t1 = time.perf_counter()
  batch = run.to_device(host)
  return batch, {"data_wait_s": t1 - t0, "host_to_device_s": time.perf_counter() - t1}


class Stepper:
  """Runs steps start+1 .. --steps of `run` (loop._Run); `tally` gathers what the summary
  reports."""

  def __init__(self, run, meter, tally, writer, on_step, iterator, bar, qk_threshold):
    self.run, self.meter, self.tally, self.writer = run, meter, tally, writer
    self.on_step, self.iterator, self.bar, self.qk = on_step, iterator, bar, qk_threshold
    self.pending: Pending | None = None
    self.profiling = False

  def run_steps(self) -> None:
    opts = self.run.opts
    self.tally.t_prev = time.perf_counter()
    for s in range(self.run.start + 1, opts.steps + 1):
      self._dispatch(s)
      stop = self.run.preemption.reached()  # every process: the same answer at the same step
      evaluate = s % opts.eval_every == 0 or s == opts.steps
      save = (stop or s % opts.save_every == 0 or s == opts.steps
              or self.run.clock.due(self.run.deadlines.step()))
      if evaluate or save or self._profile_ends(s):
        self._read(self.pending, evaluate=evaluate, save=save, stop=stop)
        self.pending = None
      if stop:
        self.tally.preempted = s
        return

  def close(self) -> None:
    """End a profile left open (a run that failed inside it)."""
    if self.profiling:
      jax.profiler.stop_trace()
      self.profiling = False

  # ---- one step ----------------------------------------------------------------------------

  def _dispatch(self, s: int) -> None:
    """Batch s in, step s queued on the devices, step s-1's metrics read meanwhile; each
    phase watched (a process's first step compiles: the start-up's deadline)."""
    run = self.run
    first = s == run.start + 1
    budget = run.deadlines.startup_s if first else run.deadlines.step()
    with run.watchdog.phase(f"step {s}: waiting for its batch (the input pipeline, then its "
                            "placement on the devices)", budget):
      batch, times = next_batch(run, self.iterator)
    if first and jax.process_count() > 1:
      _compile_then_meet(run, batch, self.qk)
    self._profile_starts(s)
    with run.watchdog.phase(f"step {s}: {'compiling and ' if first else ''}queueing it on the "
                            "devices", budget):
      run.state, metrics = run.steps.train(run.state, batch, self.qk)
    if self.pending is not None:
      self._read(self.pending)
    self.pending = Pending(s, metrics, times)

  def _read(self, p: Pending, *, evaluate=False, save=False, stop=False) -> None:
    """Step p's metrics line: read from the devices, then its eval, its save, written."""
    run = self.run
    t0 = time.perf_counter()
    with run.watchdog.phase(f"step {p.step}: waiting for its result from the devices "
                            "(collectives with every process)", run.deadlines.step()):
      metrics = jax.device_get(p.metrics)
    now = time.perf_counter()
    record = self._record(p, metrics, device_s=now - t0, dt=now - self.tally.t_prev)
    self.tally.t_prev = now
    if evaluate:
      self.tally.eval_loss = record["eval_loss"] = self._eval(p.step)
    record["checkpoint_block_s"] = self._save(p.step, wait=stop) if save else 0.0
    if self._profile_ends(p.step) or stop:
      self.close()
    self._write(p.step, record, must=evaluate or stop)
    self.tally.t_prev = time.perf_counter()  # evals and saves are not step time

  def _record(self, p: Pending, metrics: dict, device_s: float, dt: float) -> dict:
    run, tally, meter = self.run, self.tally, self.meter
    first = tally.compile_s is None
    if first:
      tally.compile_s = dt  # a process's first step: tracing and compilation too
    else:
      tally.step_times.append(dt)
      run.deadlines.measured(dt)
    run.goodput.step(dt, p.times["data_wait_s"], first)
    run.meta["tokens_seen"] += meter.tokens_per_step
    run.meta["train_seconds"] += dt
    loss = float(metrics["loss"])
    tally.first_loss = loss if tally.first_loss is None else tally.first_loss
    tally.last_loss = loss
    record = {"step": p.step, "loss": loss, **metrics, "step_time_s": dt, **p.times,
              "device_s": device_s}
    if not first:
      record["tokens_per_s"] = meter.tokens_per_step / dt
      record["mfu"] = meter.mfu(dt)
    return record

  def _eval(self, s: int) -> float:
    run = self.run
    with run.watchdog.phase(f"the eval at step {s}: waiting for its results from the devices",
                            run.deadlines.eval(len(run.eval_batches))):
      total, tokens = 0.0, 0
      for batch in run.eval_batches:
        nll, n = run.steps.eval(run.state["params"], run.state["router_bias"], batch)
        total, tokens = total + float(nll), tokens + int(n)
    return total / max(tokens, 1)

  def _save(self, s: int, wait: bool) -> float:
    """Checkpoint step `s` (async; `wait`: until committed, then one line: a preempted run)
    with this process's data shards' positions; the seconds it blocked the loop."""
    run = self.run
    t0 = time.perf_counter()
    with run.watchdog.phase(f"checkpoint {s}: saving (and waiting for the save before it)",
                            run.deadlines.save()):
      states = self.iterator.get_state()
      run.meta["goodput"] = run.goodput.as_meta()
      state_lib.save(run.ckpt, run.point, run.steps, s, run.state,
                     {k: v for k, v in states.items() if int(k) in run.write_shards},
                     run.meta)
      if wait:
        run.ckpt.wait()
    run.clock.saved()
    blocked = time.perf_counter() - t0
    run.goodput.add("checkpoint_s", blocked)
    if wait:
      print(f"k3jax train: {who()}{stop_reason()} at step {s}: checkpoint {s} saved in "
            f"{blocked:.1f} s; run the same command to resume", flush=True)
    return blocked

  def _write(self, s: int, record: dict, must: bool) -> None:
    opts = self.run.opts
    if must or s % opts.log_every == 0 or s == opts.steps:
      self.writer.write(record)
      if self.run.main:
        self.run.goodput.write()
      if self.on_step is not None:
        self.on_step(s, record)
    self.bar.update(1)
    eval_loss = self.tally.eval_loss
    self.bar.set_postfix(loss=f"{record['loss']:.3f}",
                         **({"eval": f"{eval_loss:.3f}"} if eval_loss else {}),
                         **({"tok/s": f"{record['tokens_per_s']:.0f}"}
                            if "tokens_per_s" in record else {}))

  # ---- --profile-steps A:B -----------------------------------------------------------------

  def _profile_starts(self, s: int) -> None:
    steps = self.run.opts.profile_steps
    if steps is not None and s == steps[0]:
      jax.profiler.start_trace(os.path.join(self.run.out, PROFILE_DIR,
                                            f"process_{jax.process_index()}"))
      self.profiling = True

  def _profile_ends(self, s: int) -> bool:
    steps = self.run.opts.profile_steps
    return steps is not None and s == steps[1]


def _compile_then_meet(run, batch: dict, qk_threshold) -> None:
  """Compile the train and eval steps (their first calls reuse the executables), then wait for
  every process: a first collective must not start while another process still compiles (on
  CPU gloo gives a peer 30 s to join; docs/sharding.md#multi-host)."""
  steps, state = run.steps, run.state
  with run.watchdog.phase("start-up: compiling the train and eval steps", run.deadlines.startup_s):
    steps.train.lower(state, batch, qk_threshold).compile()
    steps.eval.lower(state["params"], state["router_bias"], run.eval_batches[0]).compile()
  with run.watchdog.phase("start-up: waiting at the barrier for every process to compile the "
                          "train step", run.deadlines.startup_s):
    distributed.barrier("k3jax-train-compiled", run.opts.startup_timeout)


def who() -> str:
  """'process I/N: ' in a multi-process run."""
  return (f"process {jax.process_index()}/{jax.process_count()}: "
          if jax.process_count() > 1 else "")


def stop_reason() -> str:
  if jax.process_count() > 1:
    return "preempted (a preemption notice reached a process)"
  return "preempted (SIGTERM)"
