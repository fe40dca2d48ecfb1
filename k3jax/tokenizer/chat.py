"""Chat rendering with the checkpoint folder's Jinja template, as transformers renders it, and
the assistant-token mask for chat SFT.

Rendering = transformers' `apply_chat_template(messages, tools=..., add_generation_prompt=...,
tokenize=False)` with the folder loaded by `AutoTokenizer(..., trust_remote_code=True)`:

  * the Jinja environment: sandboxed (immutable), `trim_blocks` and `lstrip_blocks` on, the
    `loopcontrols` extension ({% break %}/{% continue %}), a `{% generation %}` block tag; a
    `tojson` filter that is `json.dumps(x, ensure_ascii=False, indent=, separators=,
    sort_keys=)` (Jinja's own escapes HTML and takes no separators); globals
    `raise_exception(msg)` (a TemplateError), `strftime_now(fmt)` (local time), `dict` and a
    `namespace` that refuses underscore-prefixed names;
  * the inputs: message keys whose value is None are dropped; a message carrying
    `reasoning_content`, `thinking` or `reasoning` gets the first of these copied to both
    `thinking` and `reasoning_content`; `tools` is passed as given (None when absent), with
    dict keys sorted recursively when the folder's remote code does that (K2's does);
    `documents=None`; the named special tokens (`bos_token`, `eos_token`, ...) are variables;
    `add_generation_prompt` not given takes the remote code's default (K2's: True).

Special-token text inside message content (a user typing "<|im_end|>"): the rendered text is
encoded like any other with special tokens allowed, so it becomes that control token, which is
exactly what transformers (`apply_chat_template(..., tokenize=True)`) and servers that render
then encode do. transformers' opt-in `sanitize_control_tokens=True` cannot help with Kimi's
remote code (its `_tokenize` always allows special tokens, so transformers raises "Can't
sanitize"); `k3jax train --format chat` reports the rows where this happens instead.

Assistant mask. For each assistant message i the template renders
  P_i = render(messages[:i], add_generation_prompt=True)     (the prompt the model answers)
  F_i = render(messages[:i+1])                                (the same with its answer)
and, when P_i is a prefix of F_i and F_i a prefix of the whole conversation, the answer is the
text F_i[len(P_i):] (content, tool calls, the end-of-turn token: everything the model must
emit). Tokens overlapping these spans are the trained ones, up to the span's last stop token
(generation_config's eos ids, else the eos token): a newline the template writes after
`<|im_end|>` is never generated, so it is not trained. Nothing is guessed from marker
strings; a template for which the prefixes do not line up (one that rewrites earlier turns once
later ones follow, such as dropping old reasoning) is reported for that conversation.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from datetime import datetime

import jinja2
import jinja2.ext
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

from k3jax.errors import ChatError, UserError

ROLES = ("system", "user", "assistant", "tool")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


# ---- the Jinja environment ------------------------------------------------------------------

@functools.cache
def _environment():
  class Generation(jinja2.ext.Extension):
    """{% generation %}...{% endgeneration %}: renders its body (transformers tracks the span
    for its own assistant mask; k3jax derives the mask from prefixes, see module docstring)."""
    tags = {"generation"}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
      return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
      return caller()

  class Namespace(jinja2.utils.Namespace):
    """jinja's namespace() without underscore-prefixed attributes (transformers' sandboxing)."""

    def __init__(*args, **kwargs):  # jinja's own signature trick
      self, args = args[0], args[1:]
      attrs = dict(*args, **kwargs)
      for name in attrs:
        Namespace._check(name)
      jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
      Namespace._check(name)
      jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
      if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"chat templates cannot store underscore-prefixed attributes ({name!r})")

  class Dict:
    def __call__(self, *args, **kwargs):
      return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
      return dict.fromkeys(*args, **kwargs)

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=[Generation, jinja2.ext.loopcontrols])
  env.filters["tojson"] = tojson
  env.globals.update(raise_exception=raise_exception, dict=Dict(), namespace=Namespace,
                     strftime_now=lambda fmt: datetime.now().strftime(fmt))
  return env


@functools.lru_cache(maxsize=8)
def _compile(template: str):
  try:
    return _environment().from_string(template)
  except jinja2.TemplateSyntaxError as e:
    raise UserError(f"the chat template is not valid Jinja: {e.message} (line {e.lineno})") \
        from None


# ---- rendering ------------------------------------------------------------------------------

def _sorted_keys(x):
  if isinstance(x, dict):
    return {k: _sorted_keys(v) for k, v in sorted(x.items())}
  if isinstance(x, list):
    return [_sorted_keys(v) for v in x]
  return x


def _prepare(messages) -> list[dict]:
  """transformers' input normalisation (None-valued keys dropped, reasoning aliased)."""
  out = []
  for m in messages:
    if not isinstance(m, dict):
      raise ChatError(f"a message is {type(m).__name__}, not an object")
    m = {k: v for k, v in m.items() if v is not None}
    reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
    if reasoning is not None:
      m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
    out.append(m)
  return out


def render(tok, messages, tools=None, *, add_generation_prompt: bool | None = None,
           chat_template: str | None = None, **template_kwargs) -> str:
  """The conversation as text, exactly as transformers' `apply_chat_template(messages,
  tools=tools, add_generation_prompt=..., tokenize=False, **template_kwargs)` renders it with
  the folder `tok` was loaded from (`chat_template`: another Jinja template, as transformers'
  argument of that name; `add_generation_prompt=None`: the folder's default, which K2's remote
  code sets to True). ChatError when the template refuses the conversation (its
  `raise_exception`, or an error while rendering)."""
  if add_generation_prompt is None:
    add_generation_prompt = tok.spec.remote.generation_prompt_default
  template = _compile(chat_template if chat_template is not None else tok.chat_template(tools))
  if tools is not None and tok.spec.remote.sorts_tools:
    tools = _sorted_keys(tools)
  variables = {**tok.spec.named, **template_kwargs}
  try:
    return template.render(messages=_prepare(messages), tools=tools, documents=None,
                           add_generation_prompt=add_generation_prompt, **variables)
  except jinja2.TemplateError as e:
    raise ChatError(f"the chat template refused it: {e}") from None
  except (TypeError, ValueError, KeyError, AttributeError) as e:
    raise ChatError(f"the chat template failed on it: {type(e).__name__}: {e}") from None


# ---- training examples ----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ChatEncoding:
  """A rendered conversation: `ids` [N] int32; `assistant` [N] bool, True for tokens that lie
  (even partly) inside an assistant answer; `spans`: the answers' [start, end) in `text`
  (characters)."""
  text: str
  ids: np.ndarray
  assistant: np.ndarray
  spans: tuple[tuple[int, int], ...]


def assistant_spans(tok, messages, tools=None, **template_kwargs) -> tuple[str, list]:
  """(the rendered conversation, [start, end) of every assistant answer in it); see the module
  docstring. ChatError when the template's prefixes do not line up."""
  full = render(tok, messages, tools, add_generation_prompt=False, **template_kwargs)
  spans = []
  for i, m in enumerate(messages):
    if m.get("role") != "assistant":
      continue
    prompt = render(tok, messages[:i], tools, add_generation_prompt=True, **template_kwargs)
    answered = render(tok, messages[:i + 1], tools, add_generation_prompt=False,
                      **template_kwargs)
    if not answered.startswith(prompt):
      raise ChatError(f"message {i + 1} (assistant): the template does not render this answer "
                      "after its own generation prompt, so its span cannot be found")
    if not full.startswith(answered):
      raise ChatError(f"message {i + 1} (assistant): the template renders it differently once "
                      "later messages follow (it rewrites earlier turns, e.g. drops old "
                      "reasoning); split the conversation after this message")
    if len(answered) > len(prompt):
      spans.append((len(prompt), len(answered)))
  return full, spans


def encode_with_mask(tok, messages, tools=None, **template_kwargs) -> ChatEncoding:
  """Render, encode (special tokens allowed, as transformers' tokenize=True) and mark the
  assistant tokens of a conversation."""
  text, spans = assistant_spans(tok, messages, tools, **template_kwargs)
  ids, starts, ends = tok.encode_with_offsets(text)
  mask = np.zeros(len(ids), bool)
  stop = np.isin(ids, tok.stop_ids)
  for a, b in spans:  # a token overlapping an answer is trained (as transformers' mask) ...
    lo, hi = len(text[:a].encode("utf-8")), len(text[:b].encode("utf-8"))
    inside = np.flatnonzero((starts < hi) & (ends > lo))
    stops = inside[stop[inside]]
    # ... up to its last stop token: what a template writes after it (a newline) is never
    # generated, since generation ends at the stop token
    mask[inside[inside <= stops[-1]] if stops.size else inside] = True
  return ChatEncoding(text, np.asarray(ids, np.int32), mask, tuple(spans))


def _check_content(content, where: str) -> None:
  if isinstance(content, str):
    return
  if isinstance(content, list):
    for part in content:
      if not (isinstance(part, dict) and part.get("type") == "text"
              and isinstance(part.get("text"), str)):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        raise ChatError(f"{where}: content part {kind!r} is not {{type: text, text: ...}}")
    return
  raise ChatError(f"{where}: content is {type(content).__name__}, not text")


def _check_tool_calls(calls, where: str) -> None:
  if not isinstance(calls, list):
    raise ChatError(f"{where}: tool_calls is not a list")
  for call in calls:
    fn = call.get("function") if isinstance(call, dict) else None
    if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)
            and isinstance(fn.get("arguments", {}), (str, dict))):
      raise ChatError(f"{where}: a tool call is not {{function: {{name, arguments}}}}")


def validate_row(row) -> tuple[list[dict], list | None]:
  """(messages, tools) of a chat SFT row `{"messages": [...], "tools": [...]}`; ChatError
  naming the first problem: not an object, no messages, an unknown role, missing content
  (an assistant message may instead carry tool_calls), malformed tool calls or tools, or no
  assistant message to train on. Other keys of the row are ignored."""
  if not isinstance(row, dict):
    raise ChatError(f"the row is {type(row).__name__}, not an object")
  messages, tools = row.get("messages"), row.get("tools")
  if not isinstance(messages, list) or not messages:
    raise ChatError("no \"messages\" list (or it is empty)")
  for i, m in enumerate(messages, 1):
    if not isinstance(m, dict):
      raise ChatError(f"message {i} is {type(m).__name__}, not an object")
    role = m.get("role")
    where = f"message {i} ({role})"
    if role not in ROLES:
      raise ChatError(f"message {i}: unknown role {role!r} (expected one of {', '.join(ROLES)})")
    if m.get("tool_calls") is not None:
      if role != "assistant":
        raise ChatError(f"{where}: only assistant messages carry tool_calls")
      _check_tool_calls(m["tool_calls"], where)
    if m.get("content") is None:
      if not (role == "assistant" and m.get("tool_calls")):
        raise ChatError(f"{where}: missing content")
    else:
      _check_content(m["content"], where)
  if tools is not None and not (isinstance(tools, list)
                                and all(isinstance(t, dict) for t in tools)):
    raise ChatError("\"tools\" is not a list of objects")
  if not any(m["role"] == "assistant" for m in messages):
    raise ChatError("no assistant message (nothing to train on)")
  return messages, tools


def special_text_in_content(tok, messages) -> list[str]:
  """Special-token texts found inside message contents (they encode as control tokens)."""
  pattern = _special_pattern(tuple(tok.special_tokens))
  found = set()
  for m in messages:
    content = m.get("content")
    parts = [content] if isinstance(content, str) else [
        p.get("text", "") for p in content or [] if isinstance(p, dict)]
    for text in parts:
      found.update(pattern.findall(text) if isinstance(text, str) else ())
  return sorted(found)


@functools.lru_cache(maxsize=4)
def _special_pattern(tokens: tuple[str, ...]):
  return re.compile("|".join(map(re.escape, sorted(tokens, key=len, reverse=True))) or "(?!)")
