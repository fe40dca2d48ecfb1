"""The engine loop: one thread owns the engine, the HTTP side talks to it through a queue.

    loop = EngineLoop(build_engine, x64=True); loop.start(asyncio_loop)
    loop.submit(request_id, prompt_ids, sampling, sink)   # from the event loop; never blocks
    loop.abort(request_id)

The thread builds the engine (loading the weights: the server answers 503 meanwhile), then
repeats: take every queued add / abort, run one engine step, hand each output to its request's
`sink` on the event loop (`call_soon_threadsafe`, once per step for all of them). It waits for
commands only when the engine is idle, so HTTP work never holds up a step, and it runs the
engine under the thread's own x64 setting (JAX keeps that per thread).

Pausing (an RL harness swapping the weights: `await loop.control("pause", mode)`, "resume",
"update_weights"): while paused, new requests wait unadmitted until the resume. `mode` says
what happens to the requests in flight: "wait" lets them finish (the pause completes when
the engine is idle), "abort" ends them now (finish reason "abort"), "keep" pauses them in the
engine with their state kept (`Engine.pause`) and continues them on resume, under whatever
weights are loaded then. `update_weights` is refused unless paused; it loads a checkpoint of
the served model's config (the `reload` callable) and hands it to `Engine.set_params`.

A request's sink receives RequestOutputs until one is finished (finish reason "error" when a
step that ran it failed: the engine gives back what it held and goes on), or a ValueError if
the engine refused it. An aborted request gets nothing more. When the engine cannot recover
(`EngineDead`), every request in it gets an EngineFailure, the state becomes FAILED (/health
503; `k3jax serve` exits non-zero so that a supervisor restarts it) and the thread ends.
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


class Refused(ValueError):
  """A control command that cannot be applied now or with these arguments (`status`: the
  HTTP status the server answers with)."""

  def __init__(self, status: int, message: str, param: str | None = None):
    super().__init__(message)
    self.status, self.param = status, param


class PauseMode(enum.StrEnum):
  WAIT = "wait"    # in-flight requests finish first
  ABORT = "abort"  # in-flight requests end now ("abort")
  KEEP = "keep"    # in-flight requests are paused with their state, continued on resume


class EngineFailure(RuntimeError):
  """The engine cannot serve any more: the requests in it at the time cannot be completed."""


_STOP = object()


class EngineLoop:

  def __init__(self, build: Callable[[], Engine], *, x64: bool = False,
               on_state: Callable[[State], None] | None = None,
               reload: Callable[[str], object] | None = None):
    self.build = build
    self.reload = reload  # path -> the model state of a checkpoint (update_weights)
    self.x64 = x64
    self.on_state = on_state
    self.state = State.LOADING
    self.error: BaseException | None = None
    self.engine: Engine | None = None
    self.stats: dict[str, float] = {}
    self.ready = threading.Event()  # set once the state is READY or FAILED
    self._commands: queue.SimpleQueue = queue.SimpleQueue()
    self._sinks: dict[str, Sink] = {}
    self.paused: PauseMode | None = None  # how the loop was paused (None: running)
    self._held: list[tuple] = []  # adds that arrived while paused (or pausing)
    self._kept: list[str] = []    # requests paused in the engine ("keep")
    self._pausing: list[asyncio.Future] = []  # "wait" pauses until the engine is idle
    self._loop: asyncio.AbstractEventLoop | None = None
    self._thread = threading.Thread(target=self._main, name="k3jax-engine", daemon=True)

  # ---- the event loop's side ------------------------------------------------------------------
  def start(self, loop: asyncio.AbstractEventLoop) -> None:
    self._loop = loop
    self._thread.start()

  def submit(self, request_id: str, prompt: list[int], sampling: SamplingParams,
             sink: Sink) -> None:
    if self.state == State.FAILED:  # nobody takes commands any more
      sink(EngineFailure(f"the engine failed: {self.error}"))
      return
    self._commands.put(("add", request_id, prompt, sampling, sink))

  @property
  def failure(self) -> str:
    """Why the state is FAILED: the weights did not load, or the engine died serving."""
    what = "loading the model failed" if self.engine is None else "the engine failed"
    return f"{what}: {type(self.error).__name__}: {self.error}"

  def abort(self, request_id: str) -> None:
    self._commands.put(("abort", request_id))

  def control(self, name: str, *args) -> asyncio.Future:
    """Run `pause(mode)`, `resume()` or `update_weights(path)` on the engine thread; the
    future gets its result (a dict) or a Refused / other exception."""
    future = self._loop.create_future()
    self._commands.put(("control", name, args, future))
    return future

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
        if self.engine.has_work() and not self._step():
          return
        if self._pausing and not self.engine.has_work():
          self._paused_now()
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
        self._add(*command[1:])
      elif command[0] == "control":
        self._control(*command[1:])
      else:
        self._abort(command[1])

  def _add(self, rid: str, prompt: list[int], sampling: SamplingParams, sink: Sink) -> None:
    if self.paused is not None or self._pausing:
      self._held.append((rid, prompt, sampling, sink))
      return
    try:
      self.engine.add(rid, prompt, sampling)
      self._sinks[rid] = sink
    except ValueError as e:
      self._deliver([(sink, e)])

  def _abort(self, rid: str) -> None:
    self._held = [h for h in self._held if h[0] != rid]
    if rid in self._kept:
      self._kept.remove(rid)
    self._sinks.pop(rid, None)
    self.engine.abort(rid)

  # ---- pause / resume / new weights (the engine thread) -------------------------------------
  def _control(self, name: str, args: tuple, future: asyncio.Future) -> None:
    try:
      result = getattr(self, "_" + name)(*args)
    except Exception as e:  # noqa: BLE001 - the caller's answer (400 / 409 / 500)
      self._loop.call_soon_threadsafe(_settle, future, None, e)
      return
    if result is not None:  # None: settled later ("wait" once the engine is idle)
      self._loop.call_soon_threadsafe(_settle, future, result, None)
    else:
      self._pausing.append(future)

  def _pause(self, mode: str) -> dict | None:
    if mode not in tuple(PauseMode):
      raise Refused(400, f"mode must be one of {', '.join(PauseMode)}, got {mode!r}", "mode")
    if self.paused is not None:
      return self._status()
    if mode == PauseMode.ABORT:
      for rid in list(self._sinks):
        self.engine.abort(rid)  # its sink gets the "abort" output from the next step
    elif mode == PauseMode.KEEP:
      for rid in list(self._sinks):
        try:
          self.engine.pause(rid)
          self._kept.append(rid)
        except KeyError:  # finished already: its outputs are on their way
          pass
    if mode != PauseMode.WAIT:
      self.paused = PauseMode(mode)
      return self._status()
    return None if self.engine.has_work() else self._paused_now()

  def _paused_now(self) -> dict:
    self.paused = PauseMode.WAIT
    status = self._status()
    for future in self._pausing:
      self._loop.call_soon_threadsafe(_settle, future, status, None)
    self._pausing = []
    return status

  def _resume(self) -> dict:
    self.paused = None
    for future in self._pausing:  # a "wait" pause still waiting: it ends here, unpaused
      self._loop.call_soon_threadsafe(_settle, future, None,
                                      Refused(409, "resumed before the pause completed"))
    self._pausing = []
    for rid in self._kept:
      self.engine.resume(rid)
    self._kept = []
    held, self._held = self._held, []
    for h in held:
      self._add(*h)
    return self._status()

  def _update_weights(self, path: str) -> dict:
    if self.paused is None:
      raise Refused(409, "update_weights: pause the server first (POST /pause)")
    if self.reload is None:
      raise Refused(400, "this server cannot load other weights")
    self.engine.set_params(self.reload(path))
    return {**self._status(), "path": path}

  def _status(self) -> dict:
    return {"paused": self.paused is not None, "mode": self.paused and str(self.paused),
            "weights_epoch": self.engine.weights_epoch, "kept": len(self._kept),
            "waiting": len(self._held)}

  def _step(self) -> bool:
    """One engine step, its outputs delivered; False when the engine died (state FAILED)."""
    try:
      outputs = self.engine.step()
    except Exception as e:  # noqa: BLE001 - EngineDead, or a failure outside any step
      log.error("the engine cannot go on:\n%s", traceback.format_exc())
      self.error = e
      failure = EngineFailure(f"the engine failed: {type(e).__name__}: {e}")
      batch = [(sink, failure) for sink in self._sinks.values()]
      self._sinks.clear()
      self._deliver(batch)
      self._set_state(State.FAILED)
      self._fail_commands(failure)
      return False
    batch = []
    for out in outputs:
      sink = self._sinks.get(out.request_id)
      if sink is None:  # aborted by its caller
        continue
      if out.finished:
        del self._sinks[out.request_id]
      batch.append((sink, out))
    self._deliver(batch)
    return True

  def _fail_commands(self, failure: EngineFailure) -> None:
    """Answer what is still queued (the HTTP side refuses new requests once FAILED)."""
    while True:
      try:
        command = self._commands.get(block=False)
      except queue.Empty:
        return
      if command is not _STOP and command[0] == "add":
        self._deliver([(command[-1], failure)])

  def _deliver(self, batch: list) -> None:
    if not batch:
      return
    try:
      self._loop.call_soon_threadsafe(_run_sinks, batch)
    except RuntimeError:  # the event loop has closed: nobody is listening any more
      pass


def _settle(future: asyncio.Future, result, error) -> None:
  if future.done():  # its caller went away
    return
  if error is not None:
    future.set_exception(error)
  else:
    future.set_result(result)


def _run_sinks(batch) -> None:
  for sink, item in batch:
    sink(item)
