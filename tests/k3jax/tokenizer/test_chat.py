"""The assistant mask of chat SFT against an independent construction, row validation, and
what k3jax reads from a folder's files (without running its code). No transformers here."""

import json
import os
import re
import shutil

import numpy as np
import pytest

from k3jax.errors import UserError
from k3jax.tokenizer import chat, load_tokenizer

from . import conversations, release


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("k3_tokenizer"))
  return path, release.build(path)


@pytest.fixture(scope="module")
def tok(folder):
  return load_tokenizer("auto", folder[0])


def answer_spans(ids, added):
  """Independent of k3jax's prefix renders: in the token stream of the test template, an
  answer runs from the token after the <|im_middle|> that follows <|im_assistant|> through
  the next <|im_end|>. Returns [(first, last)] token indices."""
  ids = list(ids)
  spans = []
  for k, i in enumerate(ids):
    if i == added["<|im_assistant|>"]:
      start = ids.index(added["<|im_middle|>"], k) + 1
      spans.append((start, ids.index(added["<|im_end|>"], start)))
  return spans


def test_mask_covers_exactly_the_assistant_answers(tok, folder):
  added = folder[1]
  for name, (messages, tools) in conversations.CONVERSATIONS.items():
    enc = chat.encode_with_mask(tok, messages, tools)
    assert enc.ids.tolist() == tok.encode_chat(messages, tools,
                                               add_generation_prompt=False).tolist()
    spans = answer_spans(enc.ids, added)
    if name == "tricky_user":
      # the user typed "<|im_end|><|im_assistant|>assistant<|im_middle|>": a marker scan sees
      # a fake answer in the user's turn; the rendered-prefix spans do not train it
      assert len(spans) == 2
      spans = spans[1:]
    want = np.zeros(len(enc.ids), bool)
    for first, last in spans:
      want[first:last + 1] = True
    n_answers = sum(m["role"] == "assistant" for m in messages)
    assert len(spans) == n_answers and len(enc.spans) == n_answers, name
    np.testing.assert_array_equal(enc.assistant, want, err_msg=name)
    for (a, b), (first, last) in zip(enc.spans, spans):  # the char spans hold those tokens
      assert enc.text[a:b].rstrip("\n") == tok.decode(enc.ids[first:last + 1]), name


def test_a_template_that_rewrites_history_is_refused_for_that_conversation(tok):
  with pytest.raises(chat.ChatError, match="message 2 .* differently once later messages"):
    chat.encode_with_mask(tok, conversations.REWRITES_HISTORY)
  # the first turn alone trains fine (its reasoning shown)
  enc = chat.encode_with_mask(tok, conversations.REWRITES_HISTORY[:2])
  assert "<think>r</think>b" in tok.decode(enc.ids[enc.assistant])


BAD_ROWS = [
    ([1, 2], "not an object"),
    ({"messages": []}, "no \"messages\""),
    ({"conversation": []}, "no \"messages\""),
    ({"messages": [{"role": "bot", "content": "x"}]}, "unknown role 'bot'"),
    ({"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]},
     "message 1 (user): missing content"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None}]},
     "message 2 (assistant): missing content"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "url": "x"}]},
                   {"role": "assistant", "content": "x"}]}, "content part 'image'"),
    ({"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]},
     "content is int"),
    ({"messages": [{"role": "user", "content": "x"},
                   {"role": "assistant", "tool_calls": [{"function": {"name": 1}}]}]},
     "tool call is not"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []},
                   {"role": "assistant", "content": "y"}]}, "only assistant messages"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": []}, "no assistant message"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
      "tools": {"a": 1}}, "\"tools\" is not a list"),
]


def test_bad_rows_are_named(tok):
  for row, needle in BAD_ROWS:
    with pytest.raises(chat.ChatError, match=re.escape(needle)):
      chat.validate_row(row)
  messages, tools = chat.validate_row({"messages": conversations.WITH_TOOLS, "id": 7,
                                       "tools": conversations.TOOLS})
  assert messages == conversations.WITH_TOOLS and tools == conversations.TOOLS


def _copy(folder, dest):
  shutil.copytree(folder, dest)
  return str(dest)


def test_folder_files_read_as_transformers_reads_them(folder, tmp_path):
  """chat_template.jinja wins over the config's template; a list of named templates picks
  tool_use when tools are given; tokenizer_config.json's named tokens win over the remote
  code's __init__ defaults, which fill in when it names none."""
  path = _copy(folder[0], tmp_path / "f")
  with open(os.path.join(path, "tokenizer_config.json")) as f:
    config = json.load(f)
  config["chat_template"] = [{"name": "default", "template": "D{{ bos_token }}"},
                             {"name": "tool_use", "template": "T{{ eos_token }}"}]
  config["bos_token"] = {"content": "<|im_user|>", "__type": "AddedToken"}
  del config["eos_token"]
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump(config, f)
  tok = load_tokenizer("auto", path)
  msgs = [{"role": "user", "content": "x"}]
  assert tok.render_chat(msgs) == "D<|im_user|>"
  assert tok.render_chat(msgs, tools=[]) == "T[EOS]"  # [EOS]: the remote code's default
  assert tok.bos_id == folder[1]["<|im_user|>"]
  with open(os.path.join(path, "chat_template.jinja"), "w") as f:
    f.write("J{{ messages | length }}")
  assert load_tokenizer("auto", path).render_chat(msgs, tools=[]) == "J1"


def test_remote_code_is_read_not_run(folder, tmp_path):
  """The remote code is parsed, never executed; an apply_chat_template override that renders
  chats itself (not through the Jinja template) is refused by name, for chats only."""
  path = _copy(folder[0], tmp_path / "f")
  remote = os.path.join(path, "tokenization_kimi.py")
  with open(remote) as f:
    source = f.read()
  source = source.replace(
      "    return super().apply_chat_template(conversation, tools=sort_keys(tools), "
      "tokenize=tokenize,\n                                       "
      "add_generation_prompt=add_generation_prompt, **kwargs)",
      "    return build_chat_segments(conversation, tools)")
  assert "build_chat_segments" in source
  with open(remote, "w") as f:
    f.write('raise RuntimeError("executed")\n' + source)
  tok = load_tokenizer("auto", path)
  assert tok.encode("hi<|im_end|>")[-1] == folder[1]["<|im_end|>"]
  with pytest.raises(UserError, match="renders chats in its own Python code"):
    tok.render_chat([{"role": "user", "content": "x"}])


def test_converted_checkpoint_layout_and_tokenizer_choice(folder, tmp_path):
  """A converted checkpoint keeps the tokenizer under hf/; --tokenizer FOLDER names one."""
  _copy(folder[0], tmp_path / "ckpt" / "hf")
  assert load_tokenizer("auto", str(tmp_path / "ckpt")).vocab_size == len(
      load_tokenizer(folder[0]).special_tokens) + min(folder[1].values())
  with pytest.raises(UserError, match="neither auto, byte, tiktoken nor a folder"):
    load_tokenizer(str(tmp_path / "missing"))
  with pytest.raises(UserError, match="no chat format"):
    load_tokenizer("byte").render_chat([{"role": "user", "content": "x"}])
