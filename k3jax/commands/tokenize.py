"""`k3jax tokenize`: how a checkpoint folder's tokenizer and chat template see your data.

  k3jax tokenize MODEL_DIR --text "some text"          ids and the text of every token
  k3jax tokenize MODEL_DIR --chat ROW.json             the rendered conversation, its ids, and
                                                       the loss mask `k3jax train --format chat`
                                                       trains it with
  k3jax tokenize MODEL_DIR --chat DATA.jsonl --line 17 one row of a JSONL data set

MODEL_DIR: an official-layout model folder (tiktoken.model, tokenization_*.py,
tokenizer_config.json), a converted checkpoint (its hf/ copy) or a `k3jax train` output (the
tokenizer it trained with). --text encodes as transformers does (special-token text becomes
the special token); --document encodes as a
`--format text` training document does (special-token text stays text). --chat takes a row
`{"messages": [...], "tools": [...]}` or a bare list of messages; mask[i] = 1 means token i is
an assistant token, trained as a target. --add-generation-prompt renders the prompt a model
would answer instead (no mask).
"""

from __future__ import annotations

import argparse
import json
import sys

from k3jax.errors import UserError
from k3jax.folders import model_folder
from k3jax.tokenizer import TIKTOKEN_FILE, chat, find_tiktoken_file, load_tokenizer


def _token_texts(tok, ids) -> list[str]:
  """Each token's text, escaped as Python escapes it (newlines, tabs); a token holding part of
  a UTF-8 character shows its bytes as backslash-x escapes rather than U+FFFD."""
  out = []
  for i in ids:
    data = tok.decode_bytes([i])
    try:
      out.append(repr(data.decode("utf-8"))[1:-1])
    except UnicodeDecodeError:
      out.append("".join(f"\\x{b:02x}" for b in data))
  return out


def _read_conversation(path: str, line: int | None):
  try:
    with open(path, encoding="utf-8") as f:
      text = f.read()
  except OSError as e:
    raise UserError(f"--chat {path}: {e.strerror}") from None
  where = path
  if line is not None:
    rows = text.splitlines()
    if not 1 <= line <= len(rows):
      raise UserError(f"--line {line}: {path} has {len(rows)} lines")
    text, where = rows[line - 1], f"{path}:{line}"
  try:
    row = json.loads(text)
  except json.JSONDecodeError as e:
    hint = " (a JSONL file? pick a row with --line N)" if line is None else ""
    raise UserError(f"--chat {where}: invalid JSON ({e.msg}, line {e.lineno}){hint}") from None
  return {"messages": row} if isinstance(row, list) else row, where


def run(args: argparse.Namespace) -> int:
  folder = model_folder(args.model_dir).tokenizer.folder  # a run: the one it trained with
  if folder is None or find_tiktoken_file(folder) is None:
    raise UserError(f"{args.model_dir}: no {TIKTOKEN_FILE} (nor hf/{TIKTOKEN_FILE}): not a "
                    "model folder with the checkpoint's tokenizer")
  tok = load_tokenizer("tiktoken", folder)
  if args.text is not None:
    text = sys.stdin.read() if args.text == "-" else args.text
    ids = tok.encode(text, allow_special=not args.document).tolist()
    if args.json:
      print(json.dumps({"ids": ids, "tokens": _token_texts(tok, ids)}, ensure_ascii=False))
    else:
      print(f"{len(ids)} tokens:\n{ids}")
      print(" | ".join(_token_texts(tok, ids)))
    return 0

  row, where = _read_conversation(args.chat, args.line)
  if args.add_generation_prompt:
    if not isinstance(row, dict) or not isinstance(row.get("messages"), list):
      raise UserError(f"--chat {where}: no \"messages\" list")
    text = tok.render_chat(row["messages"], row.get("tools"), add_generation_prompt=True)
    ids, mask, trained = tok.encode(text).tolist(), None, []
  else:
    try:
      messages, tools = chat.validate_row(row)
      enc = chat.encode_with_mask(tok, messages, tools)
    except chat.ChatError as e:
      raise UserError(f"--chat {where}: {e}") from None
    text, ids, mask = enc.text, enc.ids.tolist(), enc.assistant.astype(int).tolist()
    runs, k = [], 0  # maximal runs of trained tokens, decoded
    while k < len(ids):
      if mask[k]:
        end = k
        while end < len(ids) and mask[end]:
          end += 1
        runs.append(tok.decode(ids[k:end]))
        k = end
      else:
        k += 1
    trained = runs
  if args.json:
    print(json.dumps({"text": text, "ids": ids, "mask": mask, "trained": trained},
                     ensure_ascii=False))
    return 0
  print(f"rendered ({len(text)} characters):\n{text}")
  print(f"ids ({len(ids)} tokens{f', {sum(mask)} trained' if mask else ''}):\n{ids}")
  if mask is not None:
    print(f"mask (1 = assistant token, trained as a target):\n{''.join(map(str, mask))}")
    print("trained text:")
    for i, span in enumerate(trained, 1):
      print(f"  {i}: {span!r}")
  return 0


def register(sub) -> None:
  p = sub.add_parser("tokenize", help="show a checkpoint tokenizer's ids, chat rendering and "
                     "loss mask for your data", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("model_dir", metavar="MODEL_DIR",
                 help="model folder with tiktoken.model (or a converted checkpoint, or a "
                      "`k3jax train` output)")
  what = p.add_mutually_exclusive_group(required=True)
  what.add_argument("--text", help="text to encode ('-': read standard input)")
  what.add_argument("--chat", metavar="FILE", help="a conversation: JSON row or message list")
  p.add_argument("--line", type=int, default=None, help="--chat: the row at this line of a "
                 "JSONL file (1-based)")
  p.add_argument("--document", action="store_true",
                 help="--text: encode as a --format text training document (special-token "
                      "text stays text)")
  p.add_argument("--add-generation-prompt", action="store_true",
                 help="--chat: render the prompt a model answers (no mask)")
  p.add_argument("--json", action="store_true", help="one JSON object instead of text")
  p.set_defaults(func=run)
