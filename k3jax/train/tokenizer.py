"""Tokenizers for training: byte-level (the embedded default, vocab 256) or the checkpoint's own
tiktoken BPE (`tiktoken.model` in the model folder), only when the `tiktoken` package is
installed. Nothing is ever downloaded.

Kimi's BPE needs its pre-tokenisation regex, which lives in the folder's
`tokenization_kimi.py`; it is read from that file's syntax tree (the `pat_str = "|".join([...])`
assignment), never executed.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os

import numpy as np

from k3jax.cli import UserError

TIKTOKEN_FILE = "tiktoken.model"


class ByteTokenizer:
  """UTF-8 bytes as token ids 0..255."""
  name = "byte"
  vocab_size = 256

  def encode(self, data: bytes | str) -> np.ndarray:
    if isinstance(data, str):
      data = data.encode("utf-8")
    return np.frombuffer(data, np.uint8).astype(np.int32)

  def decode(self, ids) -> str:
    return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class TiktokenTokenizer:
  """A tiktoken BPE from a model folder (ranks file + the regex of tokenization_kimi.py)."""
  name = "tiktoken"

  def __init__(self, model_file: str, pattern: str, special_tokens: dict[str, int]):
    import tiktoken  # noqa: PLC0415  (optional dependency)
    from tiktoken.load import load_tiktoken_bpe  # noqa: PLC0415
    ranks = load_tiktoken_bpe(model_file)
    self._enc = tiktoken.Encoding(name=os.path.basename(os.path.dirname(model_file)) or "bpe",
                                  pat_str=pattern, mergeable_ranks=ranks,
                                  special_tokens=special_tokens)
    self.vocab_size = self._enc.n_vocab

  def encode(self, data: bytes | str) -> np.ndarray:
    if isinstance(data, bytes):
      data = data.decode("utf-8", errors="replace")
    # special-token text in a training document is ordinary text, not a control token
    return np.asarray(self._enc.encode(data, disallowed_special=()), np.int32)

  def decode(self, ids) -> str:
    return self._enc.decode([int(i) for i in ids])


def find_tiktoken_file(folder: str | None) -> str | None:
  """`tiktoken.model` of an HF folder, or of a converted checkpoint (copied under `hf/`)."""
  if not folder or not os.path.isdir(folder):
    return None
  for candidate in (os.path.join(folder, TIKTOKEN_FILE),
                    os.path.join(folder, "hf", TIKTOKEN_FILE)):
    if os.path.isfile(candidate):
      return candidate
  return None


def read_pattern(folder: str) -> str:
  """The pre-tokenisation regex assigned to `pat_str` in tokenization_*.py next to the ranks."""
  for name in sorted(os.listdir(folder)):
    if not (name.startswith("tokenization") and name.endswith(".py")):
      continue
    with open(os.path.join(folder, name), encoding="utf-8") as f:
      tree = ast.parse(f.read())
    for node in ast.walk(tree):
      if (isinstance(node, ast.Assign) and any(
          getattr(t, "id", getattr(t, "attr", None)) == "pat_str" for t in node.targets)):
        value = node.value
        if (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute)
            and value.func.attr == "join" and isinstance(value.func.value, ast.Constant)):
          return value.func.value.value.join(ast.literal_eval(value.args[0]))
        return ast.literal_eval(value)
  raise UserError(f"{folder}: has {TIKTOKEN_FILE} but no tokenization_*.py defining pat_str "
                  "(the BPE's pre-tokenisation regex); pass --tokenizer byte to train bytes")


def _special_tokens(folder: str) -> dict[str, int]:
  path = os.path.join(folder, "tokenizer_config.json")
  if not os.path.isfile(path):
    return {}
  with open(path) as f:
    added = json.load(f).get("added_tokens_decoder", {})
  return {v["content"]: int(k) for k, v in added.items()}


def load_tokenizer(kind: str, folder: str | None = None):
  """kind: "byte", "tiktoken" (the folder's BPE, required), or "auto" (the folder's BPE when it
  has one, bytes otherwise)."""
  if kind == "byte":
    return ByteTokenizer()
  model_file = find_tiktoken_file(folder)
  if model_file is None:
    if kind == "tiktoken":
      raise UserError(f"--tokenizer tiktoken: no {TIKTOKEN_FILE} in {folder or '(no --init-from)'}")
    return ByteTokenizer()
  if importlib.util.find_spec("tiktoken") is None:
    raise UserError(f"{model_file}: the checkpoint's tokenizer needs the `tiktoken` package "
                    "(pip install tiktoken), or pass --tokenizer byte to train on bytes")
  side = os.path.dirname(model_file)
  return TiktokenTokenizer(model_file, read_pattern(side), _special_tokens(side))
