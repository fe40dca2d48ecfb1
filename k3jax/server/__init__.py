"""`k3jax serve`: an OpenAI-compatible HTTP server on the serving engine (docs/serving.md).

  launch       a server for a model folder: `build(ServeOptions(...))` -> Server (run / start)
  app          the FastAPI app: routes, API key, errors, metrics, tokenizer endpoints
  completions  POST /v1/completions
  chat         POST /v1/chat/completions (chat template, reasoning, tool calls)
  loop         the engine thread: requests in through a queue, outputs back to the event loop
  jobs         one HTTP request's engine requests and their choices
  service      what the endpoints share: the model's name and sizes, tokenizer, checks
  text         a choice's text token by token: UTF-8 across tokens, stop strings
  parse        a chat answer split into reasoning, content and tool calls
  protocol     the request bodies and OpenAI's error body
"""

from k3jax.server.launch import Experts, ServeOptions, Server, build

__all__ = ["Experts", "ServeOptions", "Server", "build"]
