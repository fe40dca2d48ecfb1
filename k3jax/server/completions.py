"""POST /v1/completions.

Prompts: a string, a list of strings, token ids or a list of token-id lists; `n` choices each
(choice index = prompt index * n + j). A text prompt is encoded as `k3jax generate` encodes it
(special-token text becomes the special token). A completion stops at the model config's EOS
(unless `ignore_eos`), at `stop_token_ids`, at a stop string (the text is cut before it) or at
`max_tokens` (None: the model's maximum length); the stop token's text is not in the text.

`echo` puts the prompt before the text; with `logprobs` the prompt's tokens are scored too (the
first, which has no context, gets None): `echo=true, max_tokens=0, logprobs=1` is how
evaluation harnesses compute log-likelihoods. Logprobs are the model's own log_softmax, before
temperature and filtering.
"""

from __future__ import annotations

import time

from starlette.responses import JSONResponse, StreamingResponse

from k3jax.server.jobs import Choice, Job, events, sse, unless_disconnected
from k3jax.server.protocol import APIError, CompletionRequest, read
from k3jax.server.service import Service


def _prompts(svc: Service, prompt) -> list[tuple[list[int], str | None]]:
  """(ids, text as given or None) of each prompt."""
  if isinstance(prompt, str):
    prompt = [prompt]
  if not prompt:
    raise APIError(400, "prompt: an empty list", param="prompt")
  if isinstance(prompt[0], int):
    return [(list(prompt), None)]
  if isinstance(prompt[0], str):
    return [(svc.encode(p), p) for p in prompt]
  return [(list(p), None) for p in prompt]


def _offsets(data: list[bytes], start: int) -> list[int]:
  """Each token's character offset in the text, from its bytes (a character starts at every
  byte that is not a UTF-8 continuation byte)."""
  out, at = [], start
  for b in data:
    out.append(at)
    at += sum(1 for x in b if x & 0xC0 != 0x80)
  return out


def _logprobs(svc: Service, c: Choice, start: int, echo: bool, lo: int = 0,
              hi: int | None = None) -> dict:
  """OpenAI's completion logprobs of the choice's tokens [lo, hi) (and, with echo, of its
  prompt first); text offsets count from `start`."""
  names = svc.token_string
  tokens, lps, tops = [], [], []
  if echo:
    for j, t in enumerate(c.prompt):
      tokens.append(t)
      entry = c.prompt_logprobs[j] if c.prompt_logprobs else None
      lps.append(None if entry is None else entry[0])
      tops.append(None if entry is None else {names(a): v for a, v in entry[1].items()})
  ids = c.token_ids[lo:hi]
  tokens += ids
  lps += c.logprobs[lo:hi]
  tops += [{names(a): v for a, v in alt.items()} for alt in c.top[lo:hi]]
  data = [svc.token_bytes(t) if svc.token_bytes else b"" for t in tokens]
  return {"tokens": [names(t) for t in tokens], "token_logprobs": lps, "top_logprobs": tops,
          "text_offset": _offsets(data, start)}


async def create(svc: Service, request) -> object:
  svc.authorize(request.headers.get("authorization"))
  req = read(CompletionRequest, await request.body())
  svc.check_model(req.model)
  svc.check_ready()
  if req.suffix:
    raise APIError(400, "suffix is not supported", param="suffix")
  if (req.model_extra or {}).get("response_format") not in (None, {"type": "text"}):
    raise APIError(400, "response_format: structured output is served on /v1/chat/completions",
                   param="response_format")
  if req.best_of not in (None, req.n):
    raise APIError(400, "best_of is not supported (it must equal n)", param="best_of")
  prompts = _prompts(svc, req.prompt)
  limit = svc.config.max_model_len
  choices, job, t0 = [], Job(svc.loop, "cmpl"), int(time.time())
  plans = []
  for ids, text in prompts:
    max_tokens = req.max_tokens if req.max_tokens is not None else max(limit - len(ids), 0)
    params, stop_ids = svc.sampling(req, max_tokens=max_tokens, logprobs=req.logprobs,
                                    prompt_logprobs=req.echo and req.logprobs is not None)
    svc.check(ids, params[0])
    echo = (text if text is not None else svc.decode(ids)) if req.echo else ""
    for p in params:
      choices.append(Choice(len(choices), ids, svc.text_stream(stop_ids, req.stops())))
      plans.append((p, echo))
  for c, (p, _) in zip(choices, plans):
    job.submit(c.index, c.prompt, p)
  echoes = [e for _, e in plans]
  head = {"id": job.id, "object": "text_completion", "created": t0, "model": svc.config.name}
  if req.stream:
    return StreamingResponse(_stream(svc, req, job, choices, echoes, head, prompts),
                             media_type="text/event-stream")

  async def gather():
    while job.open:
      await job.next(choices)
    return JSONResponse({**head, "choices": [_choice(svc, req, c, e)
                                             for c, e in zip(choices, echoes)],
                         "usage": _usage(prompts, choices, req.n)})
  return await unless_disconnected(request.receive, job, gather())


def _choice(svc: Service, req: CompletionRequest, c: Choice, echo: str) -> dict:
  text = c.text.stable(final=True) if c.text is not None else ""
  out = {"index": c.index, "text": echo + text, "finish_reason": c.finish_reason,
         "logprobs": None if req.logprobs is None else _logprobs(svc, c, 0, req.echo)}
  if req.return_token_ids:
    out.update(token_ids=c.token_ids, prompt_token_ids=c.prompt, token_logprobs=c.logprobs)
  return out


def _usage(prompts, choices: list[Choice], n: int) -> dict:
  prompt = sum(len(ids) for ids, _ in prompts)
  completion = sum(len(c.token_ids) for c in choices)
  return {"prompt_tokens": prompt, "completion_tokens": completion,
          "total_tokens": prompt + completion}


def _stream(svc: Service, req: CompletionRequest, job: Job, choices: list[Choice],
            echoes: list[str], head: dict, prompts):
  sent = [0] * len(choices)        # characters of text sent
  scored = [0] * len(choices)      # tokens whose logprobs were sent
  prompt_scored = [False] * len(choices)

  def update(c: Choice):
    i = c.index
    text = c.text.stable(final=c.finished)[sent[i]:] if c.text is not None else ""
    lp = None
    with_prompt = req.echo and c.prompt_logprobs is not None and not prompt_scored[i]
    if req.logprobs is not None and (with_prompt or len(c.token_ids) > scored[i]):
      start = 0 if with_prompt else len(echoes[i]) + sent[i]
      lp = _logprobs(svc, c, start, with_prompt, scored[i])
      scored[i], prompt_scored[i] = len(c.token_ids), prompt_scored[i] or with_prompt
    if not text and lp is None and not c.finished:
      return
    sent[i] += len(text)
    body = {"index": i, "text": text, "logprobs": lp, "finish_reason": c.finish_reason}
    if req.return_token_ids and c.finished:
      body.update(token_ids=c.token_ids, token_logprobs=c.logprobs)
    yield sse({**head, "choices": [body]})

  def end():
    if req.include_usage:
      yield sse({**head, "choices": [], "usage": _usage(prompts, choices, req.n)})

  # the prompt first, as OpenAI's stream sends it
  start = [sse({**head, "choices": [{"index": c.index, "text": e, "logprobs": None,
                                     "finish_reason": None}]})
           for c, e in zip(choices, echoes)] if req.echo else []
  return events(job, choices, start, update, end)
