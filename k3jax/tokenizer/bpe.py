"""The checkpoint folder's tiktoken BPE, encoding exactly as transformers does with the folder's
remote code (`AutoTokenizer.from_pretrained(folder, trust_remote_code=True)`).

Special tokens. tiktoken knows ids len(ranks) .. len(ranks) + num_reserved - 1 as specials,
named from `added_tokens_decoder` or `<|reserved_token_{id}|>`; transformers additionally knows
every added token. Text is encoded the way `tokenizer(text, add_special_tokens=False)` (and so
`apply_chat_template(..., tokenize=True)`) encodes it:

  1. split at every added token's text (leftmost, longest first; lstrip / rstrip tokens swallow
     the whitespace beside them); each such piece is that token's id;
  2. cut the text between into chunks of at most `max_chars` characters, each cut so no run of
     whitespace or non-whitespace exceeds `max_run` characters (the release's guards against
     tiktoken's quadratic / panicking cases; they change the ids of very long runs);
  3. encode each chunk with tiktoken, special-token text (reserved names included) allowed.

With `allow_special=False` (a training document) step 1 is skipped and step 3 encodes special
token text as ordinary text, as the remote code's `encode(text, allow_special_tokens=False)`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re

import numpy as np
import tiktoken
from tiktoken.load import load_tiktoken_bpe

from k3jax.errors import UserError
from k3jax.tokenizer import chat
from k3jax.tokenizer.folder import FolderSpec, read_folder


class BpeTokenizer:
  """A tiktoken BPE with the folder's pattern, special tokens and chat template(s)."""
  name = "tiktoken"

  def __init__(self, spec: FolderSpec):
    if spec.remote.pattern is None:
      raise UserError(f"{spec.folder}: has tiktoken.model but no tokenization_*.py defining "
                      "pat_str (the BPE's pre-tokenisation regex); pass --tokenizer byte to "
                      "train bytes")
    self.spec = spec
    try:
      ranks = load_tiktoken_bpe(spec.ranks_file)
    except (ValueError, IndexError) as e:
      raise UserError(f"{spec.ranks_file}: not a tiktoken BPE file ({e})") from None
    base = len(ranks)
    by_id = {t.id: t.content for t in spec.added}
    reserved = {by_id.get(i, f"<|reserved_token_{i}|>"): i
                for i in range(base, base + spec.remote.num_reserved)}
    # a folder without reserved slots (no num_reserved_special_tokens) still knows its added
    # tokens by id
    tiktoken_specials = reserved or {t.content: t.id for t in spec.added}
    self._enc = tiktoken.Encoding(name=os.path.basename(spec.folder) or "bpe",
                                  pat_str=spec.remote.pattern, mergeable_ranks=ranks,
                                  special_tokens=tiktoken_specials)
    self.special_tokens: dict[str, int] = {**tiktoken_specials, **{t.content: t.id
                                                                   for t in spec.added}}
    self._id_to_special = {i: s for s, i in self.special_tokens.items()}
    self.vocab_size = max(self._enc.n_vocab, max(self._id_to_special, default=-1) + 1)
    self._added = {t.content: t for t in spec.added}
    longest_first = sorted(self._added, key=len, reverse=True)
    self._added_re = re.compile("|".join(map(re.escape, longest_first))) if spec.added else None
    # a run longer than max_run, tried only where a run starts (linear, not quadratic, in the
    # length of long runs)
    limit = spec.remote.max_run + 1
    self._long_run_re = re.compile(rf"(?<!\S)\S{{{limit}}}|(?<!\s)\s{{{limit}}}")

  # ---- ids -------------------------------------------------------------------------------

  def token_id(self, token: str) -> int:
    """The id of a special / added token by its text (`"<|im_end|>"`); UserError if unknown."""
    if token not in self.special_tokens:
      raise UserError(f"{self.spec.folder}: no special token {token!r}")
    return self.special_tokens[token]

  @property
  def bos_id(self) -> int | None:
    """Id of tokenizer_config's bos_token (None if it names none)."""
    text = self.spec.named.get("bos_token")
    return self.special_tokens.get(text) if text else None

  @property
  def eos_id(self) -> int | None:
    """Id of tokenizer_config's eos_token (None if it names none)."""
    text = self.spec.named.get("eos_token")
    return self.special_tokens.get(text) if text else None

  @property
  def stop_ids(self) -> tuple[int, ...]:
    """Ids that end a generated turn: generation_config.json's eos_token_id when the folder has
    one (K2: `<|im_end|>`), else the eos token."""
    if self.spec.stop_ids:
      return self.spec.stop_ids
    return () if self.eos_id is None else (self.eos_id,)

  @functools.cached_property
  def fingerprint(self) -> str:
    """What fixes the ids text encodes to and the end-of-document id: the ranks file's bytes,
    the pre-tokenisation regex, the long-text guards and the special tokens (a prepared
    dataset records it; training refuses a dataset of another tokenizer)."""
    h = hashlib.sha256()
    with open(self.spec.ranks_file, "rb") as f:
      h.update(f.read())
    remote = self.spec.remote
    h.update(json.dumps([remote.pattern, remote.max_chars, remote.max_run,
                         sorted(self.special_tokens.items()), self.eos_id]).encode())
    return f"tiktoken:{h.hexdigest()[:32]}"

  # ---- encode / decode ---------------------------------------------------------------------

  def encode(self, data: str | bytes, *, allow_special: bool = True) -> np.ndarray:
    """Token ids [N] int32 of `data`.

    allow_special=True: as transformers' `tokenizer(text, add_special_tokens=False)` and the
    remote code's `encode(text)`: special-token text becomes that special token.
    allow_special=False: special-token text is ordinary text (a training document)."""
    if isinstance(data, bytes):
      data = data.decode("utf-8", errors="replace")
    ids = [i for _, _, piece_ids in self._encoded_pieces(data, allow_special) for i in piece_ids]
    return np.asarray(ids, np.int32)

  def encode_with_offsets(self, text: str, *, allow_special: bool = True
                          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids, starts, ends): each token's [start, end) in `text`'s UTF-8 bytes. Tracked piece by
    piece: whitespace swallowed by an lstrip/rstrip token belongs to no token."""
    ids, starts, ends = [], [], []
    char, byte = 0, 0
    for at_char, piece, piece_ids in self._encoded_pieces(text, allow_special):
      byte += len(text[char:at_char].encode("utf-8"))
      char, at = at_char, byte
      for i in piece_ids:
        ids.append(i)
        starts.append(at)
        at += len(self.token_bytes(i))
        ends.append(at)
      byte, char = at, at_char + len(piece)
    return (np.asarray(ids, np.int32), np.asarray(starts, np.int64),
            np.asarray(ends, np.int64))

  def _encoded_pieces(self, text: str, allow_special: bool):
    """(char start, piece text, its ids) in order: steps 1-3 of the module docstring."""
    for piece, token, at in self._pieces(text, allow_special):
      if token is not None:
        yield at, piece, [token]
        continue
      ids = []
      for chunk in self._chunks(piece):
        ids += (self._enc.encode(chunk, allowed_special="all") if allow_special
                else self._enc.encode(chunk, disallowed_special=()))
      yield at, piece, ids

  def _pieces(self, text: str, allow_special: bool):
    """(text piece, None, char start) and (token text, id, char start) in order (step 1)."""
    if not allow_special or self._added_re is None:
      yield text, None, 0
      return
    pos, swallow_after = 0, False
    matches = list(self._added_re.finditer(text))
    for m in matches:
      tok = self._added[m.group()]
      lo, hi = pos, m.start()
      if swallow_after:  # the previous token is rstrip: the whitespace after it is dropped
        lo = hi - len(text[lo:hi].lstrip())
      if tok.lstrip:     # this token drops the whitespace before it
        hi = lo + len(text[lo:hi].rstrip())
      if lo < hi:
        yield text[lo:hi], None, lo
      yield m.group(), tok.id, m.start()
      pos, swallow_after = m.end(), tok.rstrip
    lo = len(text) - len(text[pos:].lstrip()) if swallow_after else pos
    if lo < len(text) or not matches:
      yield text[lo:], None, lo

  def _chunks(self, text: str):
    """Step 2: chunks of <= max_chars, cut so no run of one class exceeds max_run."""
    size, limit = self.spec.remote.max_chars, self.spec.remote.max_run
    for i in range(0, max(len(text), 1), size):
      chunk = text[i:i + size]
      if self._long_run_re.search(chunk) is None:  # the common case: nothing to cut
        yield chunk
        continue
      start, run, prev = 0, 0, None
      for j, ch in enumerate(chunk):
        space = ch.isspace()  # the same class test the release uses (re's \s agrees)
        run = run + 1 if space == prev else 1
        prev = space
        if run > limit:
          yield chunk[start:j]
          start, run = j, 1
      yield chunk[start:]

  def decode_bytes(self, ids) -> bytes:
    """The exact bytes of `ids` (a token may end inside a UTF-8 character)."""
    return b"".join(self.token_bytes(int(i)) for i in ids)

  def token_bytes(self, token: int) -> bytes:
    if token in self._id_to_special:
      return self._id_to_special[token].encode("utf-8")
    try:
      return self._enc.decode_single_token_bytes(token)
    except KeyError:
      raise UserError(f"token id {token} is outside this tokenizer's vocabulary") from None

  def decode(self, ids) -> str:
    """Text of `ids`; a dangling partial UTF-8 character decodes to U+FFFD (as tiktoken)."""
    return self.decode_bytes(ids).decode("utf-8", errors="replace")

  # ---- chat (k3jax/tokenizer/chat.py) --------------------------------------------------------

  def chat_template(self, tools=None) -> str:
    """The folder's Jinja chat template (transformers' choice among several: `tool_use` when
    tools are given and it has one, else `default`)."""
    templates = self.spec.chat_templates
    if self.spec.remote.chat_override:
      raise UserError(f"{self.spec.folder}: {self.spec.remote.chat_override}; k3jax renders "
                      "only Jinja chat templates")
    if not templates:
      raise UserError(f"{self.spec.folder}: no chat template (tokenizer_config.json "
                      "chat_template or chat_template.jinja)")
    if tools is not None and "tool_use" in templates:
      return templates["tool_use"]
    if "default" not in templates:
      raise UserError(f"{self.spec.folder}: several chat templates "
                      f"({', '.join(sorted(templates))}) and none named default")
    return templates["default"]

  def render_chat(self, messages, tools=None, *, add_generation_prompt: bool | None = None,
                  **template_kwargs) -> str:
    """The conversation as text, exactly as transformers'
    `apply_chat_template(messages, tools=tools, add_generation_prompt=...,
    tokenize=False)` renders it with this folder (see chat.render). `messages`: a list of
    {role, content, ...} dicts (OpenAI style: tool_calls, tool_call_id, reasoning_content);
    `tools`: a list of JSON schemas; extra keyword arguments are template variables.
    add_generation_prompt=None takes the folder's default (True for K2's remote code, whose
    apply_chat_template says so; else False): pass it explicitly."""
    return chat.render(self, messages, tools, add_generation_prompt=add_generation_prompt,
                       **template_kwargs)

  def encode_chat(self, messages, tools=None, *, add_generation_prompt: bool | None = None,
                  **template_kwargs) -> np.ndarray:
    """Ids of the rendered conversation, as transformers' `apply_chat_template(...,
    tokenize=True)`: special-token text anywhere in it (message content included) becomes the
    control token."""
    return self.encode(self.render_chat(messages, tools,
                                        add_generation_prompt=add_generation_prompt,
                                        **template_kwargs))


def load_folder(ranks_file: str) -> BpeTokenizer:
  return BpeTokenizer(read_folder(ranks_file))
