"""One HTTP request's engine requests (its choices) and what they have produced so far.

A `Job` submits each choice to the engine loop with a sink that puts (choice index, output)
on the job's queue; `next()` takes the next one in arrival order. A `Choice` accumulates one
choice's tokens, logprobs and text. When the request ends early (a stop string, a client that
went away, an error), `abort_open()` aborts whatever is still in the engine, whose pages and
slot are then freed.
"""

from __future__ import annotations

import asyncio
import functools
import json
import uuid

from k3jax.engine import FinishReason, RequestOutput, SamplingParams
from k3jax.server.loop import EngineFailure, EngineLoop
from k3jax.server.protocol import APIError
from k3jax.server.text import TextStream


class Choice:
  """One choice: the tokens that count (up to a stop string), their logprobs, its text."""

  def __init__(self, index: int, prompt: list[int], text: TextStream | None):
    self.index, self.prompt, self.text = index, prompt, text
    self.token_ids: list[int] = []
    self.logprobs: list[float] = []
    self.top: list[dict[int, float]] = []
    self.prompt_logprobs = None
    self.finish_reason: str | None = None

  def add(self, out: RequestOutput) -> int:
    """Take one step's output; returns how many new tokens count. A stop string found in the
    text finishes the choice ("stop"): the caller aborts it in the engine."""
    if self.finish_reason is not None:
      return 0
    ids = out.token_ids
    n = self.text.add(ids) if self.text is not None else len(ids)
    self.token_ids += ids[:n]
    self.logprobs += out.logprobs[:n]
    self.top += out.top_logprobs[:n]
    if out.prompt_logprobs is not None:
      self.prompt_logprobs = out.prompt_logprobs
    if self.text is not None and self.text.stopped:
      self.finish_reason = "stop"
    elif out.finish_reason is not None:
      self.finish_reason = str(out.finish_reason)
    return n

  @property
  def finished(self) -> bool:
    return self.finish_reason is not None


class Job:
  def __init__(self, loop: EngineLoop, prefix: str):
    self.loop = loop
    self.id = f"{prefix}-{uuid.uuid4().hex}"
    self.queue: asyncio.Queue = asyncio.Queue()
    self.open: set[int] = set()

  def rid(self, index: int) -> str:
    return f"{self.id}-{index}"

  def submit(self, index: int, prompt: list[int], sampling: SamplingParams) -> None:
    self.open.add(index)
    self.loop.submit(self.rid(index), prompt, sampling,
                     functools.partial(self._put, index))

  def _put(self, index: int, item) -> None:
    self.queue.put_nowait((index, item))

  async def next(self, choices: list[Choice]) -> tuple[Choice, int]:
    """The next output, added to its choice: (the choice, new tokens that count). Raises
    APIError for a request the engine refused (400) or could not finish (500)."""
    while True:
      index, item = await self.queue.get()
      if index not in self.open:
        continue
      if isinstance(item, ValueError):
        self.abort_open()
        raise APIError(400, str(item))
      if isinstance(item, EngineFailure):
        self.abort_open()
        raise APIError(500, str(item))
      if item.finish_reason == FinishReason.ERROR:  # a step that ran it failed
        self.open.discard(index)
        self.abort_open()
        raise APIError(500, item.error or "the engine could not serve this request")
      choice = choices[index]
      n = choice.add(item)
      if choice.finished:
        self.open.discard(index)
        if not item.finished:  # ended here (a stop string): the engine would go on
          self.loop.abort(self.rid(index))
      return choice, n

  def abort_open(self) -> None:
    for index in sorted(self.open):
      self.loop.abort(self.rid(index))
    self.open.clear()


async def _disconnected(receive) -> None:
  while (await receive())["type"] != "http.disconnect":
    pass


async def unless_disconnected(receive, job: Job, work):
  """Await `work` (a coroutine gathering the job); if the client disconnects first, abort the
  job's requests in the engine (their pages and slots are freed) and return None."""
  task, watch = asyncio.ensure_future(work), asyncio.ensure_future(_disconnected(receive))
  try:
    done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
      return task.result()
    task.cancel()
    job.abort_open()
    return None
  finally:
    watch.cancel()
    if not task.done():
      task.cancel()
      job.abort_open()


async def events(job: Job, choices: list[Choice], start, update, end):
  """A streamed job's server-sent events: `start`, then `update(choice)`'s events for each engine
  output, then `end()`'s and [DONE]. A request the engine refuses or fails sends its error as
  an event and ends the updates there. Whatever way the stream ends (a client gone away
  included), the job's open requests are aborted, which frees their engine slots and pages."""
  try:
    for event in start:
      yield event
    while job.open:
      try:
        choice, _ = await job.next(choices)
      except APIError as e:
        yield sse(e.body())
        break
      for event in update(choice):
        yield event
    for event in end():
      yield event
    yield DONE
  finally:
    job.abort_open()


def sse(obj) -> str:
  """One server-sent event carrying `obj` as JSON."""
  return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


DONE = "data: [DONE]\n\n"
