"""A choice's text, built token by token as the engine reports them, and the token strings of
logprobs.

The text is the choice's bytes decoded as a whole, the way `k3jax generate` decodes them: stop
tokens left out, a UTF-8 character split across tokens decoded once complete, invalid bytes as
U+FFFD. Stop strings are found here (the engine sees token ids only) and the text is cut before
the first one, as the engine's own stop strings cut it.

A stream may send only what no later token can change: `stable()` holds back a trailing
incomplete character (U+FFFD at the end: it may still be completed) and a suffix that could be
the start of a stop string (it may yet be cut), so the pieces streamed join to the final text.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Iterable

from k3jax.tokenizer.tool_calls import held_suffix

REPLACEMENT = "\ufffd"


def token_bytes_of(tokenizer) -> Callable[[int], bytes]:
  """id -> the token's bytes (a token may hold part of a UTF-8 character)."""
  one = getattr(tokenizer, "token_bytes", None)
  return one if one is not None else (lambda t: tokenizer.decode_bytes([t]))


def token_string(data: bytes) -> str:
  """A token as logprobs name it: its text, or `bytes:\\xNN...` when its bytes are not valid
  UTF-8 on their own (so two byte tokens never share a name)."""
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError:
    return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


class TextStream:
  """One choice's output text. `add(ids)` appends tokens and returns how many of them count:
  all of them, or up to the one completing a stop string (the text ends there; later tokens
  are ignored). Each token costs the same however long the text: its bytes go through an
  incremental UTF-8 decoder, and only the text a stop string could end in is searched."""

  def __init__(self, token_bytes: Callable[[int], bytes], *, skip_ids: Iterable[int] = (),
               stop: Iterable[str] = ()):
    self._token_bytes = token_bytes
    self._skip = frozenset(skip_ids)
    self._stop = tuple(stop)
    self._longest = max(map(len, self._stop), default=0)
    self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    self._decoded = ""  # the text of the complete characters so far
    self.stopped = False

  @property
  def text(self) -> str:
    """The bytes so far decoded as a whole (a trailing incomplete character as U+FFFD)."""
    pending = self._decoder.getstate()[0]
    return self._decoded + (REPLACEMENT if pending and not self.stopped else "")

  def add(self, ids: Iterable[int]) -> int:
    taken = 0
    for t in ids:
      if self.stopped:
        break
      taken += 1
      if t in self._skip:
        continue
      before = len(self._decoded)
      self._decoded += self._decoder.decode(self._token_bytes(int(t)))
      if self._stop:
        self._find_stop(max(0, before - self._longest + 1))
    return taken

  def _find_stop(self, start: int) -> None:
    hits = [i for i in (self._decoded.find(s, start) for s in self._stop) if i >= 0]
    if hits:
      self._decoded, self.stopped = self._decoded[:min(hits)], True

  def stable(self, final: bool = False) -> str:
    """The part of the text no later token can change (all of it once `final`)."""
    text = self.text
    if final or self.stopped:
      return text
    text = text.rstrip(REPLACEMENT)
    return text[:len(text) - held_suffix(text, self._stop)]
