"""POST /v1/chat/completions.

The messages (and `tools`) are rendered with the model folder's chat template exactly as
`k3jax tokenize --chat ROW --add-generation-prompt` renders them (k3jax/tokenizer/chat.py:
transformers' `apply_chat_template`), then encoded with special tokens recognised. An answer
ends at the model config's EOS, the tokenizer's end-of-turn tokens (`<|im_end|>`), a stop
string or `max_tokens` / `max_completion_tokens` (None: the model's maximum length). Its text
is split into `reasoning_content` (a leading <think> block), `content` and `tool_calls`
(k3jax/tokenizer/tool_calls.py, shared with RL's environments); finish_reason is "tool_calls"
when it ended on its own after calls. `response_format` (JSON) and a `tool_choice` that
requires a call are enforced by a grammar (k3jax/server/structured.py).
"""

from __future__ import annotations

import json
import time

from starlette.responses import JSONResponse, StreamingResponse

from k3jax.errors import UserError
from k3jax.server import structured
from k3jax.server.jobs import Choice, Job, events, sse, unless_disconnected
from k3jax.server.protocol import APIError, ChatRequest, read
from k3jax.server.service import Service
from k3jax.tokenizer.tool_calls import THINK_OPEN, Parsed, parse

# the roles of OpenAI's chat messages; a template renders any role it is given, so an unknown
# one (a typo) would become a turn the caller never meant
ROLES = ("system", "developer", "user", "assistant", "tool")


def render(svc: Service, req: ChatRequest) -> tuple[list[int], str]:
  """(prompt ids, rendered text) of the request's conversation."""
  tok = svc.need_tokenizer("a chat")
  for k, m in enumerate(req.messages):
    if m.get("role") not in ROLES:
      raise APIError(400, f"messages[{k}].role: must be one of {', '.join(ROLES)}, got "
                     f"{json.dumps(m.get('role'))[:40]}", param="messages")
  try:
    text = tok.render_chat(req.messages, req.tools, add_generation_prompt=req.add_generation_prompt,
                           **(req.chat_template_kwargs or {}))
  except (UserError, TypeError) as e:  # ChatError is a UserError
    raise APIError(400, f"messages: {e}", param="messages") from None
  return [int(i) for i in tok.encode(text)], text


def _finish(c: Choice, parsed: Parsed) -> str | None:
  if c.finish_reason == "stop" and parsed.tool_calls:
    return "tool_calls"
  return c.finish_reason


def _logprobs(svc: Service, c: Choice, lo: int = 0) -> dict:
  def entry(token: int, lp: float) -> dict:
    data = svc.token_bytes(token) if svc.token_bytes else b""
    return {"token": svc.token_string(token), "logprob": lp, "bytes": list(data)}
  return {"content": [
      {**entry(t, lp), "top_logprobs": [entry(a, v) for a, v in sorted(
          alt.items(), key=lambda kv: -kv[1])]}
      for t, lp, alt in zip(c.token_ids[lo:], c.logprobs[lo:], c.top[lo:])]}


async def create(svc: Service, request) -> object:
  svc.authorize(request.headers.get("authorization"))
  req = read(ChatRequest, await request.body())
  svc.check_model(req.model)
  svc.check_ready()
  ids, text = render(svc, req)
  in_reasoning = text.rstrip().endswith(THINK_OPEN)
  grammar = await structured.grammar(svc, req, in_reasoning)
  limit = svc.config.max_model_len
  max_tokens = next((m for m in (req.max_completion_tokens, req.max_tokens) if m is not None),
                    max(limit - len(ids), 0))
  logprobs = (req.top_logprobs or 0) if req.logprobs else None
  params, stop_ids = svc.sampling(req, max_tokens=max_tokens, logprobs=logprobs,
                                  extra_stops=svc.config.chat_stop_ids, grammar=grammar)
  svc.check(ids, params[0])
  how = {"in_reasoning": in_reasoning, "tools": bool(req.tools) and req.tool_choice != "none"}
  choices = [Choice(i, ids, svc.text_stream(stop_ids, req.stops())) for i in range(req.n)]
  job = Job(svc.loop, "chatcmpl")
  for c, p in zip(choices, params):
    job.submit(c.index, ids, p)
  head = {"id": job.id, "created": int(time.time()), "model": svc.config.name}
  if req.stream:
    return StreamingResponse(_stream(svc, req, job, choices, head, how),
                             media_type="text/event-stream")

  async def gather():
    while job.open:
      await job.next(choices)
    return JSONResponse({**head, "object": "chat.completion",
                         "choices": [_choice(svc, req, c, how) for c in choices],
                         "usage": _usage(ids, choices)})
  return await unless_disconnected(request.receive, job, gather())


def _choice(svc: Service, req: ChatRequest, c: Choice, how: dict) -> dict:
  parsed = parse(c.text.stable(final=True), final=True, **how)
  message = {"role": "assistant",
             "content": None if parsed.tool_calls and not parsed.content else parsed.content}
  if parsed.reasoning is not None:
    message["reasoning_content"] = parsed.reasoning
  if parsed.tool_calls:
    message["tool_calls"] = [call.to_json() for call in parsed.tool_calls]
  out = {"index": c.index, "message": message, "finish_reason": _finish(c, parsed),
         "logprobs": _logprobs(svc, c) if req.logprobs else None}
  if req.return_token_ids:
    out.update(token_ids=c.token_ids, prompt_token_ids=c.prompt, token_logprobs=c.logprobs)
  return out


def _usage(ids: list[int], choices: list[Choice]) -> dict:
  completion = sum(len(c.token_ids) for c in choices)
  return {"prompt_tokens": len(ids), "completion_tokens": completion,
          "total_tokens": len(ids) + completion}


def _stream(svc: Service, req: ChatRequest, job: Job, choices: list[Choice], head: dict,
            how: dict):
  head = {**head, "object": "chat.completion.chunk"}
  sent = [Parsed(None, "") for _ in choices]
  scored = [0] * len(choices)

  def chunk(index: int, delta: dict, finish=None, logprobs=None, **extra) -> str:
    return sse({**head, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                     "finish_reason": finish, **extra}]})

  def update(c: Choice):
    i, old = c.index, sent[c.index]
    now = parse(c.text.stable(final=c.finished), final=c.finished, **how)
    delta = {}
    if now.reasoning and now.reasoning != old.reasoning:
      delta["reasoning_content"] = now.reasoning[len(old.reasoning or ""):]
    if now.content != old.content:
      delta["content"] = now.content[len(old.content):]
    if len(now.tool_calls) > len(old.tool_calls):
      delta["tool_calls"] = [call.to_json(k) for k, call in enumerate(now.tool_calls)
                             if k >= len(old.tool_calls)]
    sent[i] = now
    lp = None
    if req.logprobs and len(c.token_ids) > scored[i]:
      lp, scored[i] = _logprobs(svc, c, scored[i]), len(c.token_ids)
    if delta or lp is not None:
      yield chunk(i, delta, logprobs=lp)
    if c.finished:
      ids = ({"token_ids": c.token_ids, "token_logprobs": c.logprobs} if req.return_token_ids
             else {})
      yield chunk(i, {}, finish=_finish(c, now), **ids)

  def end():
    if req.include_usage:
      yield sse({**head, "choices": [], "usage": _usage(choices[0].prompt, choices)})

  start = [chunk(c.index, {"role": "assistant", "content": ""}) for c in choices]
  return events(job, choices, start, update, end)
