"""The FastAPI app: OpenAI's routes over one engine loop, and the operational ones.

    GET  /v1/models                 the served model (one)
    POST /v1/completions            k3jax/server/completions.py
    POST /v1/chat/completions       k3jax/server/chat.py
    GET  /health                    200 ready, 503 loading, or failed (the weights did not
                                    load, or the engine died: the process then exits)
    GET  /metrics                   Prometheus text: requests, tokens, cache pages, prefix hits
    GET  /tokenizer_info, POST /tokenize, /detokenize
                                    the tokenizer as vLLM serves it (lm-evaluation-harness's
                                    remote tokenizer reads these)
    POST /pause {"mode": "wait" | "abort" | "keep"}, POST /resume,
    POST /update_weights {"path": CHECKPOINT}
                                    for RL harnesses: new weights without a restart (only
                                    while paused; k3jax/server/loop.py says what each mode
                                    does with the requests in flight)

With an API key, every route but /health and /metrics wants `Authorization: Bearer KEY`.
Every error is OpenAI's body ({"error": {message, type, param, code}}) with its status; one
request's error never touches another's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import traceback

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, PlainTextResponse

from k3jax.errors import UserError
from k3jax.server import chat, completions
from k3jax.server.loop import Refused, State
from k3jax.server.protocol import APIError, ChatRequest, read
from k3jax.server.service import Service

log = logging.getLogger("k3jax.server")

# (name, type, help, engine.stats() key)
METRICS = (
    ("k3jax_requests_running", "gauge", "Requests being computed (each holds a slot).",
     "running"),
    ("k3jax_requests_waiting", "gauge", "Requests waiting for a slot.", "waiting"),
    ("k3jax_generation_tokens_total", "counter", "Tokens generated.", "generated_tokens"),
    ("k3jax_prompt_tokens_total", "counter", "Prompt tokens received.", "prompt_tokens"),
    ("k3jax_cache_pages_used", "gauge", "MLA latent cache pages in use.", "pages_used"),
    ("k3jax_cache_pages_total", "gauge", "MLA latent cache pages in the pool.", "pages_total"),
    ("k3jax_prefix_cache_blocks", "gauge", "Prompt blocks held by the prefix cache.",
     "cached_blocks"),
    ("k3jax_prefix_cache_hit_rate", "gauge",
     "Fraction of prompt tokens served from the prefix cache.", "prefix_hit_rate"),
    ("k3jax_preemptions_total", "counter", "Requests preempted (recomputed later).",
     "preemptions"),
    ("k3jax_engine_steps_total", "counter", "Engine steps run.", "steps"),
    ("k3jax_spec_draft_tokens_total", "counter", "Draft tokens verified (speculative decoding).",
     "spec_drafted_tokens"),
    ("k3jax_spec_mean_accepted_length", "gauge",
     "Tokens emitted per verified row with drafts (drafts kept + 1).", "mean_accepted_length"),
)


def metrics_text(svc: Service) -> str:
  stats, label = svc.loop.stats, f'{{model_name="{svc.config.name}"}}'
  lines = []
  for name, kind, text, key in METRICS:
    lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}",
              f"{name}{label} {float(stats.get(key, 0))!r}"]
  return "\n".join(lines) + "\n"


def _error(e: APIError) -> JSONResponse:
  return JSONResponse(e.body(), status_code=e.status)


def build_app(svc: Service) -> FastAPI:

  @contextlib.asynccontextmanager
  async def lifespan(_):
    svc.loop.start(asyncio.get_running_loop())
    yield
    svc.loop.close()

  app = FastAPI(title="k3jax", lifespan=lifespan, docs_url=None, redoc_url=None,
                openapi_url=None)

  @app.exception_handler(APIError)
  async def api_error(_, e: APIError):
    return _error(e)

  @app.exception_handler(HTTPException)
  async def http_error(_, e: HTTPException):
    message = "no such route" if e.status_code == 404 else str(e.detail)
    return _error(APIError(e.status_code, message))

  @app.exception_handler(Exception)
  async def server_error(_, e: Exception):
    log.error("a request failed:\n%s", traceback.format_exc())
    return _error(APIError(500, f"internal error: {type(e).__name__}: {e}"))

  @app.get("/health")
  async def health():
    state = svc.loop.state
    body = {"status": str(state)}
    if state == State.FAILED:
      body["error"] = svc.loop.failure
    return JSONResponse(body, status_code=200 if state == State.READY else 503)

  @app.get("/metrics")
  async def metrics():
    return PlainTextResponse(metrics_text(svc), media_type="text/plain; version=0.0.4")

  @app.get("/v1/models")
  async def models(request: Request):
    svc.authorize(request.headers.get("authorization"))
    return {"object": "list", "data": [{
        "id": svc.config.name, "object": "model", "created": svc.created, "owned_by": "k3jax",
        "max_model_len": svc.config.max_model_len, "vocab_size": svc.config.vocab_size}]}

  @app.post("/v1/completions")
  async def create_completion(request: Request):
    return await completions.create(svc, request)

  @app.post("/v1/chat/completions")
  async def create_chat_completion(request: Request):
    return await chat.create(svc, request)

  @app.post("/pause")
  async def pause(request: Request):
    body = await _control_body(svc, request)
    mode = body.get("mode", "wait")
    return await _control(svc, "pause", mode if isinstance(mode, str) else repr(mode))

  @app.post("/resume")
  async def resume(request: Request):
    await _control_body(svc, request)
    return await _control(svc, "resume")

  @app.post("/update_weights")
  async def update_weights(request: Request):
    path = (await _control_body(svc, request)).get("path")
    if not isinstance(path, str) or not path:
      raise APIError(400, "path: the checkpoint folder to load", param="path")
    return await _control(svc, "update_weights", path)

  @app.get("/tokenizer_info")
  async def tokenizer_info(request: Request):
    svc.authorize(request.headers.get("authorization"))
    tok = svc.need_tokenizer("/tokenizer_info")
    named = getattr(getattr(tok, "spec", None), "named", {})
    template = tok.chat_template() if getattr(tok, "spec", None) and tok.spec.chat_templates \
        else None
    return {"tokenizer_class": type(tok).__name__, "model_max_length": svc.config.max_model_len,
            "eos_token": named.get("eos_token"), "bos_token": named.get("bos_token"),
            "pad_token": named.get("pad_token"), "chat_template": template}

  @app.post("/tokenize")
  async def tokenize(request: Request):
    svc.authorize(request.headers.get("authorization"))
    body = await _json(request)
    if "messages" in body:
      ids, _ = chat.render(svc, _chat_request(body))
    elif isinstance(body.get("prompt"), str):
      ids = svc.encode(body["prompt"])
    else:
      raise APIError(400, "send {\"prompt\": TEXT} or {\"messages\": [...]}", param="prompt")
    return {"tokens": ids, "count": len(ids), "max_model_len": svc.config.max_model_len}

  @app.post("/detokenize")
  async def detokenize(request: Request):
    svc.authorize(request.headers.get("authorization"))
    tokens = (await _json(request)).get("tokens")
    if not (isinstance(tokens, list) and all(isinstance(t, int) for t in tokens)):
      raise APIError(400, "tokens: a list of token ids", param="tokens")
    svc.need_tokenizer("/detokenize")
    return {"prompt": svc.decode(tokens)}

  return app


async def _control_body(svc: Service, request: Request) -> dict:
  svc.authorize(request.headers.get("authorization"))
  svc.check_ready()
  return await _json(request)


async def _control(svc: Service, name: str, *args) -> dict:
  try:
    return await svc.loop.control(name, *args)
  except Refused as e:
    raise APIError(e.status, str(e), param=e.param) from None
  except UserError as e:  # a checkpoint that cannot be served in place of the model
    raise APIError(400, f"path: {e}", param="path") from None


async def _json(request: Request) -> dict:
  try:
    body = json.loads(await request.body() or b"{}")
  except ValueError as e:
    raise APIError(400, f"the request body is not valid JSON: {e}") from None
  if not isinstance(body, dict):
    raise APIError(400, "the request body must be a JSON object")
  return body


def _chat_request(body: dict) -> ChatRequest:
  return read(ChatRequest, json.dumps(body).encode())
