"""What every endpoint shares: the served model's name and sizes, its tokenizer, the engine
loop, and the checks and conversions a request goes through before it reaches the engine."""

from __future__ import annotations

import dataclasses
import hmac
import time

from k3jax.engine import LogprobsMode, SamplingParams
from k3jax.server.loop import EngineLoop, State
from k3jax.server.protocol import APIError, Sampling
from k3jax.server.text import TextStream, token_bytes_of, token_string


def _param(message: str) -> str | None:
  """The request field an engine's message names first ("logit_bias: ...", "top_p must ...")."""
  head = message.split(":")[0].split(" ")[0]
  return head if head in SamplingParams.__dataclass_fields__ else None


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServiceConfig:
  """name: the model name requests must use; max_model_len: prompt + output, at most;
  eos_token_ids: what ends a completion (the model config's EOS, as `k3jax generate`);
  chat_stop_ids: what ends a chat answer besides them (the tokenizer's end-of-turn tokens);
  api_key: the Bearer token every /v1 request must carry (None: open); vocab_size: the
  model's (reported in /v1/models: an RL run checks a teacher's against its own)."""
  name: str
  max_model_len: int
  eos_token_ids: tuple[int, ...] = ()
  chat_stop_ids: tuple[int, ...] = ()
  api_key: str | None = None
  vocab_size: int | None = None


class Service:

  def __init__(self, config: ServiceConfig, loop: EngineLoop, tokenizer=None, grammars=None):
    self.config = config
    self.loop = loop
    self.tokenizer = tokenizer
    self.grammars = grammars  # structured.Grammars (None: structured output unavailable)
    self.token_bytes = token_bytes_of(tokenizer) if tokenizer is not None else None
    self.created = int(time.time())

  # ---- checks ---------------------------------------------------------------------------------
  def authorize(self, header: str | None) -> None:
    key = self.config.api_key
    if key is None:
      return
    scheme, _, token = (header or "").partition(" ")
    if scheme.lower() != "bearer" or not token:
      raise APIError(401, "missing API key: send the header 'Authorization: Bearer KEY'",
                     code="invalid_api_key")
    if not hmac.compare_digest(token.strip().encode(), key.encode()):  # constant time
      raise APIError(401, "invalid API key", code="invalid_api_key")

  def check_model(self, name: str | None) -> None:
    if name is not None and name != self.config.name:
      raise APIError(404, f"the model {name!r} does not exist (this server serves "
                     f"{self.config.name!r})", param="model", code="model_not_found")

  def check_ready(self) -> None:
    if self.loop.state == State.LOADING:
      raise APIError(503, "the model is still loading; try again shortly")
    if self.loop.state == State.FAILED:
      raise APIError(503, self.loop.failure)

  def check(self, prompt: list[int], sampling: SamplingParams) -> None:
    try:
      self.loop.engine.check(prompt, sampling)
    except ValueError as e:
      raise APIError(400, str(e), param=_param(str(e))) from None

  # ---- text -----------------------------------------------------------------------------------
  def need_tokenizer(self, what: str):
    if self.tokenizer is None:
      raise APIError(400, f"{what} needs a tokenizer, and this model has none (send token ids)")
    return self.tokenizer

  def encode(self, text: str) -> list[int]:
    return [int(i) for i in self.need_tokenizer("a text prompt").encode(text)]

  def decode(self, ids) -> str:
    if self.tokenizer is None:
      return ""
    return self.tokenizer.decode_bytes([int(i) for i in ids]).decode("utf-8", errors="replace")

  def token_string(self, token: int) -> str:
    if self.token_bytes is None:
      return f"token_id:{token}"
    return token_string(self.token_bytes(token))

  def text_stream(self, stop_ids, stop: tuple[str, ...]) -> TextStream | None:
    if self.token_bytes is None:
      if stop:
        raise APIError(400, "stop strings need a tokenizer, and this model has none",
                       param="stop")
      return None
    return TextStream(self.token_bytes, skip_ids=stop_ids, stop=stop)

  # ---- sampling -------------------------------------------------------------------------------
  def sampling(self, req: Sampling, *, max_tokens: int, logprobs: int | None,
               prompt_logprobs: bool = False, extra_stops: tuple[int, ...] = (),
               grammar=None) -> tuple[list[SamplingParams], frozenset[int]]:
    """The engine's SamplingParams of each of the request's n choices (seeds seed, seed + 1,
    ...; no seed: the engine draws one each), and the stop ids (which the text leaves out).
    `return_token_ids` (what an RL harness reads) asks the engine for the logprobs of the
    distribution each token was drawn from (after temperature and top-k / top-p / min-p), for
    `token_logprobs` and for `logprobs` alike. `grammar`: what every choice's output follows
    (structured output); logit_bias, the penalties and min_tokens as vLLM defines them."""
    req.refuse_unsupported()
    stops = tuple(req.stop_token_ids)
    if not req.ignore_eos:
      stops += self.config.eos_token_ids + extra_stops
    mode = LogprobsMode.PROCESSED if req.return_token_ids else LogprobsMode.RAW
    if req.return_token_ids and logprobs is None:
      logprobs = 0
    params = [SamplingParams(max_tokens=max_tokens, temperature=req.temperature,
                             top_p=req.top_p, top_k=max(req.top_k, 0), min_p=req.min_p,
                             seed=None if req.seed is None else req.seed + i,
                             stop_token_ids=stops, ignore_eos=True, logprobs=logprobs,
                             prompt_logprobs=prompt_logprobs, logprobs_mode=mode,
                             logit_bias=tuple(req.token_bias().items()),
                             presence_penalty=req.presence_penalty,
                             frequency_penalty=req.frequency_penalty,
                             repetition_penalty=req.repetition_penalty,
                             min_tokens=req.min_tokens, grammar=grammar)
              for i in range(req.n)]
    return params, frozenset(stops)
