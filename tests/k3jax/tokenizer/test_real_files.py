"""`k3jax tokenize` on Moonshot's real K2 tokenizer files (real_files.py) against transformers
loading the same folder: ids of tricky strings, and every test conversation rendered and
encoded with K2-Instruct's tool-call template and K2-Thinking's <think> template, through the
command itself. One AutoTokenizer per template for the whole file (loading 163,584 ranks)."""

import json

import pytest

from k3jax.cli import main
from k3jax.tokenizer import load_tokenizer

from . import conversations
from .real_files import assemble
from .test_vs_transformers import tricky_strings


@pytest.fixture(scope="module", params=["instruct", "thinking"])
def pair(request, tmp_path_factory, reference_dir):
  from transformers import AutoTokenizer  # slow import: once per module
  folder = assemble(str(tmp_path_factory.mktemp(request.param)), reference_dir,
                    thinking=request.param == "thinking")
  return folder, load_tokenizer("auto", folder), AutoTokenizer.from_pretrained(
      folder, trust_remote_code=True, local_files_only=True)


def test_ids_and_decoding_match_transformers(pair):
  _, ours, hf = pair
  assert ours.vocab_size == len(hf) == 163840
  added = {t.content: t.id for t in ours.spec.added}
  assert added["<|im_end|>"] == 163586 and added["<|tool_call_begin|>"] == 163597
  for text in tricky_strings(added) + ["<think>reason</think>answer", "functions.f:0"]:
    ids = ours.encode(text).tolist()
    assert ids == hf(text, add_special_tokens=False)["input_ids"], repr(text)
    assert ours.decode(ids) == hf.decode(ids), repr(text)


def test_tokenize_renders_conversations_as_transformers(pair, tmp_path, capsys):
  folder, _, hf = pair
  for name, (messages, tools) in conversations.CONVERSATIONS.items():
    row = tmp_path / f"{name}.json"
    row.write_text(json.dumps({"messages": messages, "tools": tools}))
    for prompt in (False, True):
      capsys.readouterr()
      flags = ["--add-generation-prompt"] if prompt else []
      rc = main(["tokenize", folder, "--chat", str(row), "--json", *flags])
      got = json.loads(capsys.readouterr().out)
      want = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=prompt,
                                    tokenize=False)
      ids = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=prompt,
                                   tokenize=True)["input_ids"]
      assert rc == 0 and got["text"] == want and got["ids"] == ids, (name, prompt)
