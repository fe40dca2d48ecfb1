"""The K3 / Kimi tool-call format: an answer's text split the way the OpenAI API returns it
(reasoning, content, tool calls). One definition for everything that reads what the model
writes: the server's chat answers (k3jax/server/chat.py) and RL's environments
(k3jax/rl/env.py).

Kimi models write

    <think>REASONING</think>CONTENT<|tool_calls_section_begin|>
    <|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>{JSON}<|tool_call_end|>
    ...<|tool_calls_section_end|>

(a `<think>` block only at the very start of the answer, or the whole answer up to `</think>`
when the prompt itself ends inside an open `<think>`). A call's id is the text between its
markers (`functions.get_weather:0`), its name the part between `functions.` and the last `:`,
its arguments the JSON text as written.

`grammar(tools, ...)` writes the same format as a grammar (llguidance's Lark dialect) that a
constrained answer follows (`tool_choice` "required" or a named function; the server compiles
it with k3jax/tokenizer/grammar.py): what `parse` reads back, by construction.

`parse(text, final=False)` reads a prefix of an answer still being generated: a marker not yet
complete is held back, and only finished calls are returned, so each field of a prefix's parse
is a prefix of the final one's (what a stream sends joins to the whole response). In an
unterminated tool-call section (the answer was cut short) only the finished calls count.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, CALL_ARGS, CALL_END = ("<|tool_call_begin|>", "<|tool_call_argument_begin|>",
                                   "<|tool_call_end|>")


@dataclasses.dataclass(frozen=True)
class ToolCall:
  id: str
  name: str
  arguments: str

  def to_json(self, index: int | None = None) -> dict:
    out = {"id": self.id, "type": "function",
           "function": {"name": self.name, "arguments": self.arguments}}
    return out if index is None else {"index": index, **out}


@dataclasses.dataclass(frozen=True)
class Parsed:
  reasoning: str | None
  content: str
  tool_calls: tuple[ToolCall, ...] = ()


def held_suffix(text: str, markers) -> int:
  """Characters at the end of `text` that are a proper prefix of one of `markers` (what a
  stream holds back until it knows whether a marker follows)."""
  longest = 0
  for m in markers:
    for k in range(min(len(m) - 1, len(text)), longest, -1):
      if text.endswith(m[:k]):
        longest = k
        break
  return longest


def call_id(name: str, index: int) -> str:
  """The id a call of function `name` is written with (its `index`-th call of the answer)."""
  return f"functions.{name}:{index}"


def call_name(call_id: str) -> str:
  name = call_id.rsplit(":", 1)[0] if ":" in call_id else call_id
  return name.removeprefix("functions.")


def parse(text: str, *, final: bool, in_reasoning: bool = False, tools: bool = True) -> Parsed:
  """Split an answer (see the module docstring). `in_reasoning`: the prompt ended inside an
  open <think> block; `tools`: read tool-call sections (else they stay in the content)."""
  if not in_reasoning and not text.startswith(THINK_OPEN):
    if not final and THINK_OPEN.startswith(text):  # may yet become "<think>"
      return Parsed(None, "")
    return _content(text, final, tools, None)
  body = text if in_reasoning else text[len(THINK_OPEN):]
  end = body.find(THINK_CLOSE)
  if end < 0:
    held = 0 if final else held_suffix(body, (THINK_CLOSE,))
    return Parsed(body[:len(body) - held], "")
  return _content(body[end + len(THINK_CLOSE):], final, tools, body[:end])


def _content(text: str, final: bool, tools: bool, reasoning: str | None) -> Parsed:
  begin = text.find(SECTION_BEGIN) if tools else -1
  if begin < 0:
    held = 0 if final or not tools else held_suffix(text, (SECTION_BEGIN,))
    return Parsed(reasoning, text[:len(text) - held])
  section = text[begin + len(SECTION_BEGIN):]
  end = section.find(SECTION_END)
  calls, after = _calls(section if end < 0 else section[:end]), ""
  if end >= 0:  # text after the section continues the content
    after = section[end + len(SECTION_END):]
    if not final:
      after = after[:len(after) - held_suffix(after, (SECTION_BEGIN,))]
  return Parsed(reasoning, text[:begin] + after, tuple(calls))


def _calls(section: str) -> list[ToolCall]:
  calls, at = [], 0
  while True:
    start = section.find(CALL_BEGIN, at)
    if start < 0:
      return calls
    args = section.find(CALL_ARGS, start)
    stop = section.find(CALL_END, args) if args >= 0 else -1
    if stop < 0:  # not finished yet
      return calls
    call_id = section[start + len(CALL_BEGIN):args].strip()
    calls.append(ToolCall(call_id, call_name(call_id),
                          section[args + len(CALL_ARGS):stop].strip()))
    at = stop + len(CALL_END)


def grammar(tools: Sequence[tuple[str, str]], *, only: str | None = None,
            parallel: bool = True) -> str:
  """Lark text of an answer that calls tools: any text first (reasoning, content; special
  tokens cannot occur in it), then a tool-call section of one call, or several when
  `parallel`, each of a function of `tools` ((name, `%json {...}` rule of its arguments)),
  or of `only` alone (exactly one call). The section ends the answer."""
  names = [name for name, _ in tools]
  if only is not None:
    names, parallel = [only], False
  rules = ["start: TEXT? section", "TEXT: /(.|\\n)+/",
           f"section: {SECTION_BEGIN} {'call+' if parallel else 'call'} {SECTION_END}",
           "call: " + " | ".join(f"call_{i}" for i in range(len(names))),
           "INDEX: /[0-9]{1,3}/"]
  args = dict(tools)
  for i, name in enumerate(names):
    head = json.dumps(call_id(name, 0)[:-1])  # "functions.NAME:" then the index
    rules += [f"call_{i}: {CALL_BEGIN} {head} INDEX {CALL_ARGS} args_{i} {CALL_END}",
              f"args_{i}: {args[name]}"]
  return "\n".join(rules)


def assistant_message(parsed: Parsed) -> dict:
  """The assistant turn as a chat message (what a chat template renders back): content,
  reasoning_content when there is reasoning, tool_calls in OpenAI's form."""
  message = {"role": "assistant", "content": parsed.content}
  if parsed.reasoning is not None:
    message["reasoning_content"] = parsed.reasoning
  if parsed.tool_calls:
    message["tool_calls"] = [call.to_json() for call in parsed.tool_calls]
  return message
