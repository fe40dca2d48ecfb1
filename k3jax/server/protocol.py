"""The OpenAI request bodies the server reads, and its error body.

Bodies are validated strictly from the JSON (a string is not a number); fields the server does
not know are ignored, as OpenAI-compatible servers do. Beside OpenAI's fields, a few that
vLLM-style servers accept: `top_k`, `min_p`, `stop_token_ids`, `ignore_eos`,
`return_token_ids`, `chat_template_kwargs`, `add_generation_prompt`.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               404: "not_found_error", 500: "server_error", 503: "service_unavailable_error"}


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


class Sampling(BaseModel):
  """The fields both endpoints share."""
  model_config = ConfigDict(extra="ignore", strict=True)
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
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  logit_bias: dict[str, float] | None = None
  return_token_ids: bool = False

  def stops(self) -> tuple[str, ...]:
    return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

  def refuse_unsupported(self) -> None:
    for name in ("presence_penalty", "frequency_penalty"):
      if getattr(self, name):
        raise APIError(400, f"{name} is not supported (only 0)", param=name)
    if self.logit_bias:
      raise APIError(400, "logit_bias is not supported", param="logit_bias")

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
  tool_choice: Literal["none", "auto"] | dict[str, Any] | None = None
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
