"""Shared set-up of the corpus tests: a tiny BPE model folder with an end-of-document token,
and a source folder of text, JSONL and parquet files holding good and bad rows."""

import base64
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq

EOS_TEXT = "<|eos|>"
EOS_ID = 259


def tiny_bpe(folder) -> str:
  """A BPE folder in the checkpoint layout: 256 byte tokens, merges "de", "def", " x", and
  <|eos|> (id 259) named as tokenizer_config's eos_token."""
  os.makedirs(folder, exist_ok=True)
  ranks = [bytes([i]) for i in range(256)] + [b"de", b"def", b" x"]
  with open(os.path.join(folder, "tiktoken.model"), "w") as f:
    f.write("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(ranks)))
  with open(os.path.join(folder, "tokenization_kimi.py"), "w") as f:
    f.write('pat_str = "|".join([r"""[a-z]+""", r""" ?[a-z]+""", r"""[^a-z]"""])\n')
  with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
    json.dump({"added_tokens_decoder": {str(EOS_ID): {"content": EOS_TEXT}},
               "eos_token": EOS_TEXT}, f)
  return str(folder)


# (file, good documents' texts in order, rejected rows as (place, reason))
def write_sources(root) -> tuple[list[str], list[dict]]:
  """Text, JSONL and parquet sources under `root` (read in this order: sorted paths); returns
  the texts of the good documents in reading order and the rejected rows rejected.jsonl must
  hold."""
  root = str(root)
  os.makedirs(os.path.join(root, "sub"), exist_ok=True)
  os.makedirs(os.path.join(root, ".hidden"), exist_ok=True)
  files = {
      "a.txt": "def x def\n" * 3,
      "b.bin": "skipped: not a text suffix",
      ".hidden/c.txt": "skipped: hidden",
      "sub/d.md": f"special text {EOS_TEXT} stays text",
  }
  for name, text in files.items():
    with open(os.path.join(root, name), "w") as f:
      f.write(text)
  with open(os.path.join(root, "bad.txt"), "wb") as f:
    f.write(b"ok \xff not utf-8")
  rows = [json.dumps({"text": "row one", "id": 1}), "{not json", json.dumps({"body": "x"}),
          "", json.dumps({"text": 7}), json.dumps(["a"]), json.dumps({"text": "row two"}),
          b"{\"text\": \"\xc3\x28\"}"]
  with open(os.path.join(root, "rows.jsonl"), "wb") as f:
    for r in rows:
      f.write((r if isinstance(r, bytes) else r.encode()) + b"\n")
  table = pa.table({"text": ["p zero", None, "p two", "p three", "p four"],
                    "n": [0, 1, 2, 3, 4]})
  pq.write_table(table, os.path.join(root, "sub", "t.parquet"), row_group_size=2)
  good = [files["a.txt"], "row one", "row two", files["sub/d.md"], "p zero", "p two",
          "p three", "p four"]
  j = os.path.join(root, "rows.jsonl")
  rejected = [
      {"source": os.path.join(root, "bad.txt"), "reason": "not UTF-8 (byte 3)"},
      {"source": j, "line": 2, "reason": "not JSON (Expecting property name enclosed in "
                                         "double quotes)"},
      {"source": j, "line": 3, "reason": "no field 'text'"},
      {"source": j, "line": 5, "reason": "field 'text' is a number, not a string"},
      {"source": j, "line": 6, "reason": "not a JSON object but an array"},
      {"source": j, "line": 8, "reason": "not UTF-8 (byte 10)"},
      {"source": os.path.join(root, "sub", "t.parquet"), "row": 1, "reason": "null value"},
  ]
  return good, rejected
