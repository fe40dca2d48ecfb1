"""The OpenAI request bodies the server reads, and its error body.

Bodies are validated strictly from the JSON (a string is not a number). A field of the OpenAI
(or vLLM) API that would change the output and that this server does not implement is refused
with 400 naming it (`UNSUPPORTED`); fields that do not change the output (`user`, `metadata`,
`store`, `service_tier`, ...) and fields the server does not know are accepted and logged, as
OpenAI-compatible servers do. Beside OpenAI's fields, a few that vLLM-style servers accept:
`top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `stop_token_ids`, `ignore_eos`,
`return_token_ids`, `chat_template_kwargs`, `add_generation_prompt`.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

log = logging.getLogger("k3jax.server")

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               404: "not_found_error", 409: "conflict_error", 500: "server_error",
               503: "service_unavailable_error"}


class APIError(Exception):
  """An error answered with OpenAI's body: {"error": {message, type, param, code}}."""

  def __init__(self, status: int, message: str, *, param: str | None = None,
               code: str | None = None):
    super().__init__(message)
    self.status, self.message, self.param, self.code = status, message, param, code

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "error"),
                      "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
  model_config = ConfigDict(extra="ignore", strict=True)
  include_usage: bool = False


class JsonSchema(BaseModel):
  model_config = ConfigDict(extra="ignore", strict=True)
  name: str = Field(min_length=1)
  schema_: dict[str, Any] | None = Field(None, alias="schema")
  strict: bool | None = None
  description: str | None = None


class ResponseFormat(BaseModel):
  model_config = ConfigDict(extra="ignore", strict=True)
  type: Literal["text", "json_object", "json_schema"]
  json_schema: JsonSchema | None = None


# fields that change what is generated and that this server does not implement: 400 naming them
UNSUPPORTED = {
    "audio": "audio output", "prediction": "predicted outputs",
    "web_search_options": "web search", "functions": "functions (use tools)",
    "function_call": "function_call (use tool_choice)", "reasoning_effort": "reasoning_effort",
    "verbosity": "verbosity", "guided_json": "guided_json (use response_format)",
    "guided_regex": "guided_regex", "guided_choice": "guided_choice",
    "guided_grammar": "guided_grammar", "structured_outputs": "structured_outputs (use "
    "response_format)", "bad_words": "bad_words", "allowed_token_ids": "allowed_token_ids",
    "use_beam_search": "beam search", "length_penalty": "length_penalty",
    "logits_processors": "logits_processors", "truncate_prompt_tokens": "truncate_prompt_tokens",
}


class Sampling(BaseModel):
  """The fields both endpoints share."""
  model_config = ConfigDict(extra="allow", strict=True)
  model: str | None = None
  temperature: float = Field(1.0, ge=0)
  top_p: float = Field(1.0, gt=0, le=1)
  top_k: int = Field(0, ge=-1)  # 0 or -1: off
  min_p: float = Field(0.0, ge=0, le=1)
  n: int = Field(1, ge=1, le=128)
  seed: int | None = None
  stop: str | list[str] | None = None
  stop_token_ids: list[int] = []
  ignore_eos: bool = False
  stream: bool = False
  stream_options: StreamOptions | None = None
  presence_penalty: float = Field(0.0, ge=-2, le=2)
  frequency_penalty: float = Field(0.0, ge=-2, le=2)
  repetition_penalty: float = Field(1.0, gt=0)
  min_tokens: int = Field(0, ge=0)
  logit_bias: dict[str, float] | None = None
  return_token_ids: bool = False
  modalities: list[str] | None = None

  def stops(self) -> tuple[str, ...]:
    return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

  def refuse_unsupported(self) -> None:
    """400 for a field that would change the output and is not implemented; the fields the
    server does not read are logged."""
    extra = self.model_extra or {}
    for name, what in UNSUPPORTED.items():
      if extra.get(name) not in (None, False, [], {}):
        raise APIError(400, f"{name}: {what} is not supported by this server", param=name)
    if self.modalities not in (None, ["text"]):
      raise APIError(400, f"modalities: only [\"text\"] is supported, got {self.modalities}",
                     param="modalities")
    if extra:
      log.info("request fields accepted and not used: %s", ", ".join(sorted(extra)))

  def token_bias(self) -> dict[int, float]:
    """logit_bias with its keys as token ids (400 for a key that is not one)."""
    out = {}
    for key, value in (self.logit_bias or {}).items():
      try:
        out[int(key)] = value
      except ValueError:
        raise APIError(400, f"logit_bias: the key {key!r} is not a token id",
                       param="logit_bias") from None
    return out

  @property
  def include_usage(self) -> bool:
    return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(Sampling):
  prompt: str | list[str] | list[int] | list[list[int]]
  max_tokens: int | None = Field(16, ge=0)
  logprobs: int | None = Field(None, ge=0)
  echo: bool = False
  best_of: int | None = None
  suffix: str | None = None


class ChatRequest(Sampling):
  messages: list[dict[str, Any]] = Field(min_length=1)
  max_tokens: int | None = Field(None, ge=0)
  max_completion_tokens: int | None = Field(None, ge=0)
  logprobs: bool = False
  top_logprobs: int | None = Field(None, ge=0)
  tools: list[dict[str, Any]] | None = None
  tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
  parallel_tool_calls: bool | None = None
  response_format: ResponseFormat | None = None
  chat_template_kwargs: dict[str, Any] | None = None
  add_generation_prompt: bool = True


def read(model: type[BaseModel], body: bytes):
  """The request body as `model`, or APIError 400 naming the first problem."""
  try:
    return model.model_validate_json(body or b"{}")
  except ValidationError as e:
    first = e.errors()[0]
    if first["type"] == "json_invalid":
      raise APIError(400, f"the request body is not valid JSON: {first['msg']}") from None
    where = ".".join(str(x) for x in first["loc"] if not _is_union_tag(x))
    got = first.get("input")
    shown = "" if isinstance(got, dict) else f" (got {json.dumps(got)[:80]})"
    raise APIError(400, f"{where or 'body'}: {first['msg']}{shown}", param=where or None) \
        from None


def _is_union_tag(x) -> bool:
  """pydantic names the union member it tried in `loc` ("str", "list[int]"): not a field."""
  return isinstance(x, str) and ("[" in x or x in ("str", "int", "float", "bool", "dict"))
