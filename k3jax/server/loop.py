"""The engine loop: one thread owns the engine, the HTTP side talks to it through a queue.

    loop = EngineLoop(build_engine, x64=True); loop.start(asyncio_loop)
    loop.submit(request_id, prompt_ids, sampling, sink)   # from the event loop; never blocks
    loop.abort(request_id)

The thread builds the engine (loading the weights: the server answers 503 meanwhile), then
repeats: take every queued add / abort, run one engine step, hand each output to its request's
`sink` on the event loop (`call_soon_threadsafe`, once per step for all of them). It waits for
commands only when the engine is idle, so HTTP work never holds up a step, and it runs the
engine under the thread's own x64 setting (JAX keeps that per thread).

A request's sink receives RequestOutputs until one is finished, or a ValueError if the engine
refused it, or an EngineFailure if a step failed (every request then in the engine gets one and
is dropped; the loop goes on). An aborted request gets nothing more.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import queue
import threading
import traceback
from collections.abc import Callable

import jax

from k3jax.engine import Engine, SamplingParams

log = logging.getLogger("k3jax.server")
Sink = Callable[[object], None]


class State(enum.StrEnum):
  LOADING = "loading"
  READY = "ready"
  FAILED = "failed"


class EngineFailure(RuntimeError):
  """A step raised: the requests in the engine at the time cannot be completed."""


_STOP = object()


class EngineLoop:

  def __init__(self, build: Callable[[], Engine], *, x64: bool = False,
               on_state: Callable[[State], None] | None = None):
    self.build = build
    self.x64 = x64
    self.on_state = on_state
    self.state = State.LOADING
    self.error: BaseException | None = None
    self.engine: Engine | None = None
    self.stats: dict[str, float] = {}
    self.ready = threading.Event()  # set once the state is READY or FAILED
    self._commands: queue.SimpleQueue = queue.SimpleQueue()
    self._sinks: dict[str, Sink] = {}
    self._loop: asyncio.AbstractEventLoop | None = None
    self._thread = threading.Thread(target=self._main, name="k3jax-engine", daemon=True)

  # ---- the event loop's side ------------------------------------------------------------------
  def start(self, loop: asyncio.AbstractEventLoop) -> None:
    self._loop = loop
    self._thread.start()

  def submit(self, request_id: str, prompt: list[int], sampling: SamplingParams,
             sink: Sink) -> None:
    self._commands.put(("add", request_id, prompt, sampling, sink))

  def abort(self, request_id: str) -> None:
    self._commands.put(("abort", request_id))

  def close(self, timeout: float = 30.0) -> None:
    if self._thread.is_alive():
      self._commands.put(_STOP)
      self._thread.join(timeout)

  # ---- the engine thread ------------------------------------------------------------------------
  def _main(self) -> None:
    with jax.enable_x64(self.x64):
      try:
        self.engine = self.build()
      except BaseException as e:  # noqa: BLE001 - reported by the server: health, 503, exit
        self.error = e
        log.error("loading the model failed:\n%s", traceback.format_exc())
        self._set_state(State.FAILED)
        return
      self.stats = self.engine.stats()
      self._set_state(State.READY)
      while self._serve_commands():
        if self.engine.has_work():
          self._step()
        self.stats = self.engine.stats()

  def _set_state(self, state: State) -> None:
    self.state = state
    self.ready.set()
    if self.on_state is not None:
      self.on_state(state)

  def _serve_commands(self) -> bool:
    """Apply the queued commands (waiting for one when the engine is idle); False on close."""
    block = not self.engine.has_work()
    while True:
      try:
        command = self._commands.get(block=block)
      except queue.Empty:
        return True
      block = False
      if command is _STOP:
        return False
      if command[0] == "add":
        _, rid, prompt, sampling, sink = command
        try:
          self.engine.add(rid, prompt, sampling)
          self._sinks[rid] = sink
        except ValueError as e:
          self._deliver([(sink, e)])
      else:
        self._sinks.pop(command[1], None)
        self.engine.abort(command[1])

  def _step(self) -> None:
    try:
      outputs = self.engine.step()
    except Exception as e:  # noqa: BLE001 - the server keeps serving the next requests
      log.error("an engine step failed:\n%s", traceback.format_exc())
      failure = EngineFailure(f"the engine failed: {type(e).__name__}: {e}")
      batch = [(sink, failure) for sink in self._sinks.values()]
      for rid in list(self._sinks):
        self.engine.abort(rid)
      self._sinks.clear()
      self._deliver(batch)
      return
    batch = []
    for out in outputs:
      sink = self._sinks.get(out.request_id)
      if sink is None:  # aborted by its caller
        continue
      if out.finished:
        del self._sinks[out.request_id]
      batch.append((sink, out))
    self._deliver(batch)

  def _deliver(self, batch: list) -> None:
    if not batch:
      return
    try:
      self._loop.call_soon_threadsafe(_run_sinks, batch)
    except RuntimeError:  # the event loop has closed: nobody is listening any more
      pass


def _run_sinks(batch) -> None:
  for sink, item in batch:
    sink(item)
