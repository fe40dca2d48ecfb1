"""Tokenizers: UTF-8 bytes (the embedded default) or a checkpoint folder's own tokenizer (its
tiktoken BPE, special tokens and Jinja chat template, read as transformers reads them).

One interface, used by `k3jax train`, `k3jax tokenize` and `k3jax generate`:

    tok = load_tokenizer("auto", folder)         # folder: HF folder or converted checkpoint
    tok.name, tok.vocab_size, tok.fingerprint   (fingerprint: "byte", or a hash of the BPE)
    tok.encode(text, allow_special=True)  -> np.ndarray int32   (special-token text -> ids)
    tok.decode(ids) -> str                  tok.decode_bytes(ids) -> bytes (streaming)
    tok.token_id("<|im_end|>") -> int       tok.special_tokens: {text: id}
    tok.bos_id, tok.eos_id, tok.stop_ids    (stop_ids: generation_config's eos ids, else eos)
    tok.render_chat(messages, tools=None, add_generation_prompt=None, **vars) -> str
    tok.encode_chat(messages, tools=None, add_generation_prompt=None, **vars) -> ids

`render_chat` / `encode_chat` equal transformers' `apply_chat_template(..., tokenize=False /
True)` on the same folder (chat.py says exactly how). Pass add_generation_prompt explicitly:
None means the folder's default, and K2's remote code defaults it to True. The byte
tokenizer has no chat format and raises UserError. `chat.encode_with_mask` adds the per-token
assistant mask for SFT.
Nothing is downloaded and no code from the folder runs.
"""

from __future__ import annotations

import importlib.util

import numpy as np

from k3jax.errors import UserError
from k3jax.folders import TokenizerSource
from k3jax.tokenizer.bpe import load_folder
from k3jax.tokenizer.folder import TIKTOKEN_FILE, find_tiktoken_file, read_pattern

__all__ = ["ByteTokenizer", "TIKTOKEN_FILE", "find_tiktoken_file", "load_tokenizer",
           "read_pattern", "text_tokenizer"]


class ByteTokenizer:
  """UTF-8 bytes as token ids 0..255; no special tokens, no chat format."""
  name = "byte"
  fingerprint = "byte"
  vocab_size = 256
  special_tokens: dict[str, int] = {}
  bos_id = eos_id = None
  stop_ids = ()

  def encode(self, data: bytes | str, *, allow_special: bool = True) -> np.ndarray:
    del allow_special  # bytes have no special tokens
    if isinstance(data, str):
      data = data.encode("utf-8")
    return np.frombuffer(data, np.uint8).astype(np.int32)

  def decode_bytes(self, ids) -> bytes:
    return bytes(int(i) for i in ids)

  def decode(self, ids) -> str:
    return self.decode_bytes(ids).decode("utf-8", errors="replace")

  def token_id(self, token: str) -> int:
    raise UserError(f"the byte tokenizer has no special token {token!r}")

  def _no_chat(self, *args, **kwargs):
    raise UserError("the byte tokenizer has no chat format: chats need a checkpoint folder's "
                    "tokenizer (tiktoken.model, tokenizer_config.json with a chat_template)")

  render_chat = encode_chat = _no_chat


def load_tokenizer(kind: str, folder: str | None = None):
  """kind: "byte"; "tiktoken" (the folder's BPE, required); "auto" (the folder's BPE when it
  has one, bytes otherwise); or a path: that folder's BPE, whatever `folder` is. A folder is
  an HF model folder or a converted checkpoint (its `hf/`)."""
  if kind == "byte":
    return ByteTokenizer()
  if kind not in ("auto", "tiktoken"):
    if find_tiktoken_file(kind) is None:
      raise UserError(f"--tokenizer {kind}: neither auto, byte, tiktoken nor a folder holding "
                      f"{TIKTOKEN_FILE}")
    kind, folder = "tiktoken", kind
  model_file = find_tiktoken_file(folder)
  if model_file is None:
    if kind == "tiktoken":
      raise UserError(f"--tokenizer tiktoken: no {TIKTOKEN_FILE} in {folder or '(no folder)'}")
    return ByteTokenizer()
  if importlib.util.find_spec("tiktoken") is None:
    raise UserError(f"{model_file}: the checkpoint's tokenizer needs the `tiktoken` package "
                    "(pip install tiktoken), or pass --tokenizer byte to train on bytes")
  return load_folder(model_file)


def text_tokenizer(source: TokenizerSource, vocab_size: int):
  """The tokenizer of a model folder (`k3jax.folders.model_folder(...).tokenizer`) for a model
  of `vocab_size` ids, or None when text cannot be encoded for it (no tokenizer file, and not
  a byte-level model)."""
  tok = load_tokenizer(source.kind, source.folder)
  if isinstance(tok, ByteTokenizer) and vocab_size != ByteTokenizer.vocab_size:
    return None
  return tok
