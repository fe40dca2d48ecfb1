"""Chat SFT data (`k3jax train --format chat`): JSONL rows `{"messages": [...], "tools": [...]}`
rendered with the checkpoint's chat template; the loss covers assistant tokens only
(k3jax/tokenizer/chat.py derives them from the template).

Bad rows are never dropped silently. A row is bad when its line is not valid JSON, fails
validation (not an object, no messages, an unknown role, missing content, malformed tool
calls / tools, no assistant message), the template refuses or cannot delimit it, it has no
assistant token, or it is longer than --seq-len + 1 tokens (a conversation is not cut: the
second half would train answers without their question). By default the run is refused with
one line naming the count and the first few (line: reason), because a data set with bad rows
is usually a data bug that should be fixed at the source; `--skip-bad-rows` trains on the
good rows instead, prints every bad row and writes them all to OUT/bad_rows.jsonl, and the
run's summary counts them.

Rows whose message content holds special-token text are trained as transformers encodes them
(the text becomes the control token); their count and first line numbers are printed.

Held out for eval: rows at positions 8, 24, 40, ... (one in 16); with 8 rows or fewer there is
none to spare and eval runs on the training rows (the start-up line says so).
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from k3jax.corpus.holdout import is_held_out
from k3jax.errors import ChatError, UserError
from k3jax.tokenizer import chat

BAD_ROWS_FILE = "bad_rows.jsonl"
SHOWN = 3  # bad rows named in the refusal line


@dataclasses.dataclass
class ChatCorpus:
  """Tokenized conversations: `tokens[i]`, `weights[i]` (1 on assistant tokens) of the row at
  `lines[i]` ("file:line"); `bad`: [(line, reason)]; `special_text`: lines whose content holds
  special-token text."""
  tokens: list[np.ndarray]
  weights: list[np.ndarray]
  lines: list[str]
  bad: list[tuple[str, str]]
  special_text: list[str]

  def split(self) -> tuple[tuple[list, list], tuple[list, list], bool]:
    """((train tokens, weights), (eval tokens, weights), eval is held out)."""
    held = [is_held_out(i) for i in range(len(self.tokens))]
    if not any(held):
      return (self.tokens, self.weights), (self.tokens, self.weights), False
    pick = lambda xs, keep: [x for x, h in zip(xs, held) if h == keep]
    return ((pick(self.tokens, False), pick(self.weights, False)),
            (pick(self.tokens, True), pick(self.weights, True)), True)


def jsonl_files(path: str) -> list[str]:
  """A .jsonl file, or every *.jsonl under a folder (sorted relative paths)."""
  if os.path.isfile(path):
    return [path]
  if not os.path.isdir(path):
    raise UserError(f"--data {path}: no such file or folder")
  found = sorted(os.path.join(d, n) for d, _, names in os.walk(path) for n in names
                 if n.endswith(".jsonl"))
  if not found:
    raise UserError(f"--data {path}: no .jsonl files (--format chat reads JSONL rows)")
  return found


def encode_row(tokenizer, row, seq_len: int | None):
  """(ids, assistant mask, special texts found) of one parsed row; ChatError if it is bad."""
  messages, tools = chat.validate_row(row)
  enc = chat.encode_with_mask(tokenizer, messages, tools)
  if not enc.assistant.any():
    raise chat.ChatError("no assistant token after rendering (empty answers)")
  if seq_len is not None and len(enc.ids) > seq_len + 1:
    raise chat.ChatError(f"too long: {len(enc.ids)} tokens > --seq-len + 1 = {seq_len + 1}")
  return enc, chat.special_text_in_content(tokenizer, messages)


def read_chat(path: str, tokenizer, seq_len: int) -> ChatCorpus:
  """Every row of the JSONL file(s) at `path`, tokenized, bad ones collected (not raised)."""
  if getattr(tokenizer, "spec", None) is None:
    tokenizer.render_chat([])  # the byte tokenizer: its UserError (no chat format)
  if not tokenizer.spec.chat_templates or tokenizer.spec.remote.chat_override:
    tokenizer.chat_template()  # one error for the folder, not one bad row per line
  corpus = ChatCorpus([], [], [], [], [])
  files = jsonl_files(path)
  for file in files:
    name = os.path.relpath(file, path) if os.path.isdir(path) else os.path.basename(file)
    with open(file, encoding="utf-8", errors="strict") as f:
      try:
        lines = f.read().splitlines()
      except UnicodeDecodeError as e:
        raise UserError(f"{file}: not UTF-8 text (byte {e.start})") from None
    for number, line in enumerate(lines, 1):
      where = f"{name}:{number}"
      if not line.strip():
        continue  # a blank line is no row
      try:
        row = json.loads(line)
      except json.JSONDecodeError as e:
        corpus.bad.append((where, f"invalid JSON ({e.msg}, column {e.colno})"))
        continue
      try:
        enc, special = encode_row(tokenizer, row, seq_len)
      except ChatError as e:
        corpus.bad.append((where, str(e)))
        continue
      corpus.tokens.append(enc.ids)
      corpus.weights.append(enc.assistant.astype(np.uint8))
      corpus.lines.append(where)
      if special:
        corpus.special_text.append(where)
  return corpus


def check_bad_rows(corpus: ChatCorpus, path: str, *, skip: bool,
                   out: str | None) -> str | None:
  """Refuse (UserError) or report the bad rows; returns the bad-rows file written, if any
  (`out` None: listed on stdout only, as processes other than 0 of a multi-process run do)."""
  total = len(corpus.tokens) + len(corpus.bad)
  if corpus.special_text:
    print(f"--data {path}: {len(corpus.special_text)} rows have special-token text inside "
          f"message content, trained as control tokens as transformers encodes them (e.g. "
          f"{', '.join(corpus.special_text[:SHOWN])})", flush=True)
  if not corpus.bad:
    return None
  if not skip:
    shown = "; ".join(f"{w}: {r}" for w, r in corpus.bad[:SHOWN])
    more = f"; and {len(corpus.bad) - SHOWN} more" if len(corpus.bad) > SHOWN else ""
    raise UserError(f"--data {path}: {len(corpus.bad)} of {total} rows are bad ({shown}{more});"
                    " fix them, or pass --skip-bad-rows to train on the others")
  if not corpus.tokens:
    raise UserError(f"--data {path}: all {total} rows are bad (first: {corpus.bad[0][0]}: "
                    f"{corpus.bad[0][1]})")
  report = None if out is None else os.path.join(out, BAD_ROWS_FILE)
  if report is not None:
    with open(report, "w") as f:
      f.writelines(json.dumps({"line": w, "reason": r}) + "\n" for w, r in corpus.bad)
  print(f"--data {path}: skipping {len(corpus.bad)} of {total} bad rows (--skip-bad-rows"
        + (f"; all listed in {report}" if report else "") + "):", flush=True)
  for where, reason in corpus.bad[:20]:
    print(f"  {where}: {reason}", flush=True)
  if len(corpus.bad) > 20:
    print(f"  ... and {len(corpus.bad) - 20} more", flush=True)
  return report
