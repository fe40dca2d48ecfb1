"""Grammars that constrain what a model may write (structured output), as token masks.

The library is llguidance (https://github.com/guidance-ai/llguidance): a Rust Earley parser
over a lexer whose masks come from a token trie, with no dependency (xgrammar needs torch,
triton and transformers at install), numpy bit masks, Lark grammars that name special tokens
(`<|tool_call_begin|>`) and embed JSON schemas (`%json {...}`): what Kimi's tool-call format
needs, and JSON Schema (draft 2020-12, with errors naming what it does not support).

    vocab = Vocabulary(tokenizer, vocab_size, eos_ids)      # once per tokenizer (seconds)
    grammar = vocab.compile(json_lark(schema))               # GrammarError naming the problem
    m = grammar.matcher()                                    # one per request
    m.fill(words)          # int32 [ceil(V / 32)]: bit t % 32 of word t // 32 = token t allowed
    m.accept(token)        # False when the grammar refuses it (error() says why)

A grammar ends with one of `eos_ids` (the tokens that end a turn): once its text is complete,
only they are allowed. JSON is written with at most 16 whitespace characters at each place
JSON allows them (the language of a finite schema stays finite). A reasoning model may first
think: an answer may open with a `<think> ... </think>` block (or, when its prompt ends inside
one, starts inside it) before what the grammar constrains.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np

try:  # a dependency (pyproject.toml); without it structured output is refused, nothing else
  import llguidance
except ImportError:  # pragma: no cover - the installs of the project have it
  llguidance = None

from k3jax.errors import UserError
from k3jax.tokenizer.tool_calls import THINK_CLOSE, THINK_OPEN

JSON_OPTIONS = {"whitespace_pattern": "[\\x20\\x0A\\x0D\\x09]{0,16}"}


class GrammarError(ValueError):
  """A grammar (or JSON schema) the library cannot compile; the message says why."""


def json_rule(schema: dict) -> str:
  """`%json {...}` of `schema` with our whitespace rule (the schema's own x-guidance wins)."""
  options = {**JSON_OPTIONS, **(schema.get("x-guidance") or {})}
  return "%json " + json.dumps({**schema, "x-guidance": options})


def reasoning_rules(in_reasoning: bool) -> tuple[str, list[str]]:
  """(what starts an answer's rule: an optional reasoning block, the rules it needs)."""
  close = THINK_CLOSE.replace("/", "\\/")
  if in_reasoning:
    return "think ", [f"think[lazy]: /(.|\\n)*{close}/"]
  return "think? ", [f"think[lazy]: /{THINK_OPEN}(.|\\n)*{close}/"]


def json_lark(schema: dict | None, *, in_reasoning: bool = False) -> str:
  """An answer that is one JSON value of `schema` (None: any JSON object), after optional
  reasoning and up to 4 newlines or spaces."""
  head, rules = reasoning_rules(in_reasoning)
  body = json_rule(schema if schema is not None else {"type": "object"})
  return "\n".join([f"start: {head}WS? answer", "WS: /[ \\n]{1,4}/", f"answer: {body}", *rules])


class Vocabulary:
  """A tokenizer's tokens as the grammar library sees them (built once: seconds for a vocabulary
  of 163,840). Ids past the tokenizer's, up to `vocab_size`, are never allowed."""

  def __init__(self, tokenizer, vocab_size: int, eos_ids: Sequence[int]):
    if llguidance is None:
      raise GrammarError("structured output needs the llguidance package (pip install "
                         "llguidance)")
    eos = [int(t) for t in eos_ids]
    if not eos:
      raise GrammarError("a grammar needs at least one token that ends the answer")
    special = set(getattr(tokenizer, "special_tokens", {}).values())
    tokens = []
    for i in range(vocab_size):  # ids the tokenizer does not know: special, never allowed
      data = _token_bytes(tokenizer, i) if i < tokenizer.vocab_size else None
      if data is None:
        data = f"<|k3jax_unused_{i}|>".encode()
        special.add(i)
      tokens.append(data)
    self.vocab_size = vocab_size
    self.library = llguidance.LLTokenizer(
        llguidance.TokenizerWrapper(_Wrapped(tokenizer, tokens, sorted(special), eos[0])),
        n_vocab=vocab_size, eos_token=eos)

  def compile(self, lark: str) -> Grammar:
    return Grammar(self, lark)


def _token_bytes(tokenizer, token: int) -> bytes | None:
  try:
    return tokenizer.decode_bytes([token])
  except (KeyError, ValueError, UserError):
    return None


class _Wrapped:
  """What llguidance.TokenizerWrapper reads of a tokenizer."""

  def __init__(self, tokenizer, tokens: list[bytes], special: list[int], eos: int):
    self.tokens, self.special_token_ids = tokens, special
    self.eos_token_id, self.bos_token_id = eos, None
    self._tok = tokenizer

  def __call__(self, text) -> list[int]:
    if isinstance(text, bytes):
      text = text.decode("utf-8", errors="replace")
    return [int(t) for t in self._tok.encode(text, allow_special=False)]


class Grammar:
  """A compiled grammar; `matcher()` gives a request its own state (a copy: cheap)."""

  def __init__(self, vocab: Vocabulary, lark: str):
    self.lark, self.words = lark, (vocab.vocab_size + 31) // 32
    text = llguidance.LLMatcher.grammar_from_lark(lark)
    problem = llguidance.LLMatcher.validate_grammar(text, vocab.library)
    if problem and not problem.startswith("WARNING"):
      raise GrammarError(problem)
    self._matcher = llguidance.LLMatcher(vocab.library, text, log_level=0)
    if self._matcher.is_error():
      raise GrammarError(self._matcher.get_error())

  def matcher(self) -> Matcher:
    return Matcher(self._matcher.deep_copy(), self.words)


class Matcher:
  """One request's position in its grammar."""

  def __init__(self, matcher, words: int):
    self._m, self._words = matcher, words

  def fill(self, words: np.ndarray, address: int | None = None) -> None:
    """The tokens allowed next, as bits, into `words` (int32 [ceil(V / 32)], contiguous);
    `address`: its data pointer when the caller knows it (numpy's costs microseconds)."""
    if words.dtype != np.int32 or words.shape != (self._words,) or not words.flags.c_contiguous:
      raise ValueError(f"mask words must be contiguous int32 [{self._words}]")
    self._m.unsafe_compute_mask_ptr(words.ctypes.data if address is None else address,
                                    words.nbytes)

  def accept(self, token: int) -> bool:
    return self._m.consume_token(int(token))

  def rollback(self, tokens: int) -> None:
    self._m.rollback(tokens)

  def error(self) -> str:
    return self._m.get_error()

  @property
  def done(self) -> bool:
    """The grammar is complete: only a token that ends the answer may follow."""
    return self._m.is_stopped()
