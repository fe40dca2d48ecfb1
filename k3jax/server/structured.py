"""Structured output for chat requests: the grammar every choice of a request follows.

  response_format {"type": "json_object"}            one JSON object
  response_format {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
                                                     one JSON value of the schema (enforced
                                                     whether or not `strict` is set)
  tool_choice "required"                             one or more calls of the `tools` (one when
                                                     parallel_tool_calls is false), each with
                                                     arguments that follow its parameters
  tool_choice {"type": "function", "function": {"name": NAME}}   one call of NAME

A reasoning model may think first (k3jax/tokenizer/grammar.py); the tool-call grammar is the
format's own (k3jax/tokenizer/tool_calls.py: `grammar`, what `parse` reads back). Grammars are
compiled by llguidance against the served tokenizer, whose vocabulary the library reads once
(in the background from start-up: seconds at 163,840 tokens) and cached by their text, so an
agent that sends the same tools or schema again compiles nothing. A schema or tool the library
cannot compile, an unknown tool name, `required` without tools: 400 naming the problem.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading

from k3jax.server.protocol import APIError, ChatRequest
from k3jax.tokenizer import grammar as grammars
from k3jax.tokenizer import tool_calls

CACHED = 64  # compiled grammars kept (least recently used dropped first)
log = logging.getLogger("k3jax.server")


class Grammars:
  """The served tokenizer as the grammar library sees it, and the grammars compiled for it."""

  def __init__(self, tokenizer, vocab_size: int, eos_ids: tuple[int, ...]):
    self._args = (tokenizer, vocab_size, eos_ids)
    self._vocab: grammars.Vocabulary | None = None
    self._lock = threading.Lock()
    self._cache: collections.OrderedDict[str, grammars.Grammar] = collections.OrderedDict()

  def vocabulary(self) -> grammars.Vocabulary:
    """The vocabulary (GrammarError when it cannot be had: then no request gets a grammar)."""
    with self._lock:
      if self._vocab is None:
        self._vocab = grammars.Vocabulary(*self._args)
      return self._vocab

  def prepare(self) -> None:
    """Read the vocabulary now (at start-up, in the background), so the first structured
    request does not wait for it."""
    try:
      self.vocabulary()
    except grammars.GrammarError as e:
      log.warning("structured output is unavailable: %s", e)

  def compile(self, lark: str) -> grammars.Grammar:
    """The grammar of `lark` (GrammarError naming what the library refuses)."""
    vocab = self.vocabulary()
    with self._lock:
      if lark in self._cache:
        self._cache.move_to_end(lark)
        return self._cache[lark]
    compiled = vocab.compile(lark)
    with self._lock:
      self._cache[lark] = compiled
      while len(self._cache) > CACHED:
        self._cache.popitem(last=False)
    return compiled


def _tools(req: ChatRequest) -> list[tuple[str, dict]]:
  """(name, parameters schema) of each function in `tools` (400 for a malformed one)."""
  out = []
  for k, tool in enumerate(req.tools or ()):
    tool = tool if isinstance(tool, dict) else {}
    function = tool.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if tool.get("type", "function") != "function" or not isinstance(name, str) or not name:
      raise APIError(400, f"tools[{k}]: a function with a name is expected", param="tools")
    schema = function.get("parameters") or {"type": "object"}
    if not isinstance(schema, dict):
      raise APIError(400, f"tools[{k}].function.parameters: a JSON schema object is expected",
                     param="tools")
    if name in dict(out):
      raise APIError(400, f"tools[{k}]: the function name {name!r} is used twice", param="tools")
    out.append((name, schema))
  return out


def _chosen(req: ChatRequest, tools: list[tuple[str, dict]]) -> str | None:
  """The function a named tool_choice asks for (400 unless it is one of `tools`)."""
  choice = req.tool_choice
  function = choice.get("function") if isinstance(choice, dict) else None
  name = function.get("name") if isinstance(function, dict) else None
  if choice.get("type") != "function" or not isinstance(name, str):
    raise APIError(400, 'tool_choice: "none", "auto", "required" or {"type": "function", '
                   '"function": {"name": NAME}}', param="tool_choice")
  if name not in dict(tools):
    raise APIError(400, f"tool_choice: no tool named {name!r} in tools "
                   f"({', '.join(n for n, _ in tools) or 'none given'})", param="tool_choice")
  return name


def lark_of(req: ChatRequest, in_reasoning: bool) -> tuple[str, str] | None:
  """(the grammar text the request's answers follow, the request field it comes from), or
  None when nothing is enforced."""
  forced = req.tool_choice == "required" or isinstance(req.tool_choice, dict)
  fmt = req.response_format.type if req.response_format is not None else "text"
  if forced and fmt != "text":
    raise APIError(400, "response_format: cannot be enforced together with a tool_choice that "
                   "requires a call", param="response_format")
  if forced:
    tools = _tools(req)
    if not tools:
      raise APIError(400, "tool_choice: requires tools", param="tool_choice")
    only = _chosen(req, tools) if isinstance(req.tool_choice, dict) else None
    rules = [(name, grammars.json_rule(schema)) for name, schema in tools]
    lark = tool_calls.grammar(rules, only=only, parallel=req.parallel_tool_calls is not False)
    return lark, "tools"
  if fmt == "json_object":
    return grammars.json_lark(None, in_reasoning=in_reasoning), "response_format"
  if fmt == "json_schema":
    spec = req.response_format.json_schema
    if spec is None or spec.schema_ is None:
      raise APIError(400, "response_format.json_schema.schema: a JSON schema is required",
                     param="response_format")
    return grammars.json_lark(spec.schema_, in_reasoning=in_reasoning), "response_format"
  return None


async def grammar(svc, req: ChatRequest, in_reasoning: bool) -> grammars.Grammar | None:
  """The compiled grammar of the request (None: unconstrained); 400 naming a problem."""
  what = lark_of(req, in_reasoning)
  if what is None:
    return None
  if svc.grammars is None:
    raise APIError(400, f"{what[1]}: structured output needs the model's tokenizer",
                   param=what[1])
  try:
    await asyncio.to_thread(svc.grammars.vocabulary)
  except grammars.GrammarError as e:
    raise APIError(400, f"{what[1]}: {e}", param=what[1]) from None
  try:
    return await asyncio.to_thread(svc.grammars.compile, what[0])
  except grammars.GrammarError as e:
    raise APIError(400, f"{_culprit(svc, req, what[1])}: the grammar library refuses it: {e}",
                   param=what[1]) from None


def _culprit(svc, req: ChatRequest, field: str) -> str:
  """Which part of the request a grammar failed on: the first tool whose parameters do not
  compile alone, else the field."""
  if field != "tools":
    return "response_format.json_schema.schema"
  for k, (_, schema) in enumerate(_tools(req)):
    try:
      svc.grammars.compile(grammars.json_lark(schema))
    except grammars.GrammarError:
      return f"tools[{k}].function.parameters"
  return "tools"
