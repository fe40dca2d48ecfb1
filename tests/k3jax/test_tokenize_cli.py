"""`k3jax tokenize`: ids of text, and of a conversation its rendering and loss mask, equal to
what the library (and so `k3jax train`) computes; user mistakes exit 2 with one line."""

import json
import os

import pytest

from k3jax.cli import main
from k3jax.tokenizer import chat, load_tokenizer
from tests.runs import fake_run

from .tokenizer import conversations, release


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("k3_tokenizer"))
  release.build(path)
  return path


def _json(capsys, *args):
  assert main(["tokenize", *args, "--json"]) == 0
  return json.loads(capsys.readouterr().out)


def test_text_and_document(folder, capsys):
  tok = load_tokenizer("auto", folder)
  text = "Hi <|im_end|> 12345 中文\n"
  got = _json(capsys, folder, "--text", text)
  assert got["ids"] == tok.encode(text).tolist()
  # each token's text; a token holding part of a character (中 is 3 byte tokens in this BPE)
  # shows its bytes escaped
  assert "".join(got["tokens"]).replace("\\n", "\n") == (
      "Hi <|im_end|> 12345 " + "".join(f"\\x{b:02x}" for b in "中文".encode()) + "\n")
  doc = _json(capsys, folder, "--text", text, "--document")
  assert doc["ids"] == tok.encode(text, allow_special=False).tolist() != got["ids"]
  assert main(["tokenize", folder, "--text", text]) == 0
  out = capsys.readouterr().out
  assert out.startswith(f"{len(got['ids'])} tokens:\n") and " | <|im_end|> | " in out


def test_chat_row_rendering_ids_and_mask(folder, tmp_path, capsys):
  tok = load_tokenizer("auto", folder)
  messages, tools = conversations.CONVERSATIONS["tools"]
  row = tmp_path / "row.json"
  row.write_text(json.dumps({"messages": messages, "tools": tools}))
  got = _json(capsys, folder, "--chat", str(row))
  want = chat.encode_with_mask(tok, messages, tools)
  assert got["text"] == want.text and got["ids"] == want.ids.tolist()
  assert got["mask"] == want.assistant.astype(int).tolist()
  assert len(got["trained"]) == 3 and got["trained"][-1].endswith("14:05.<|im_end|>")
  # a JSONL data set, one line of it; a bare message list
  rows = tmp_path / "d.jsonl"
  rows.write_text("\n".join(json.dumps({"messages": m}) for m in
                            (conversations.SIMPLE, conversations.MULTI_TURN)) + "\n")
  line2 = _json(capsys, folder, "--chat", str(rows), "--line", "2")
  assert line2["ids"] == chat.encode_with_mask(tok, conversations.MULTI_TURN).ids.tolist()
  bare = tmp_path / "bare.json"
  bare.write_text(json.dumps(conversations.SIMPLE))
  assert _json(capsys, folder, "--chat", str(bare))["text"] == tok.render_chat(
      conversations.SIMPLE, add_generation_prompt=False)
  prompt = _json(capsys, folder, "--chat", str(bare), "--add-generation-prompt")
  assert prompt["text"].endswith("<|im_assistant|>assistant<|im_middle|>")
  assert prompt["mask"] is None
  assert main(["tokenize", folder, "--chat", str(row)]) == 0
  out = capsys.readouterr().out
  assert "mask (1 = assistant token" in out and "trained text:\n  1: " in out


def test_user_mistakes_exit_2_with_one_line(folder, tmp_path, capsys):
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"messages": [{"role": "bot", "content": "x"}]}\n{"messages": [\n')
  cases = [
      ([str(tmp_path), "--text", "x"], "no tiktoken.model"),
      ([folder, "--chat", str(bad)], "pick a row with --line"),
      ([folder, "--chat", str(bad), "--line", "1"], "bad.jsonl:1: message 1: unknown role"),
      ([folder, "--chat", str(bad), "--line", "2"], "invalid JSON"),
      ([folder, "--chat", str(bad), "--line", "9"], "has 2 lines"),
      ([folder, "--chat", str(tmp_path / "missing.json")], "No such file"),
  ]
  for args, needle in cases:
    assert main(["tokenize", *args]) == 2, args
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1, err
  with pytest.raises(SystemExit) as e:
    main(["tokenize", "--help"])
  assert e.value.code == 0 and "--chat" in capsys.readouterr().out


def test_a_train_output_by_a_relative_path(folder, tmp_path, capsys, monkeypatch):
  """A `k3jax train` output folder stands for the tokenizer it trained with (here its
  --init-from folder's, recorded relative to the working directory)."""
  monkeypatch.chdir(tmp_path)
  fake_run("runs/ft", init_from=os.path.relpath(folder))
  text = "Hi <|im_end|> 12345"
  assert _json(capsys, "runs/ft", "--text", text) == _json(capsys, folder, "--text", text)
