"""`k3jax serve`'s chat API against a live server, through the official `openai` client, with
Moonshot's real K2-Thinking tokenizer files (read in place from the shared reference folder)
and a tiny float64 model crafted to answer with reasoning, content and a tool call
(tests/k3jax/server/helpers.py: SCRIPT). One server (conftest.py's, shared with
test_structured.py)."""

import json
import threading

import openai
import pytest

from k3jax import cli
from k3jax.tokenizer import load_tokenizer
from tests.k3jax.server import helpers
from tests.k3jax.tokenizer.real_files import assemble

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def folders(chat_folders):
  return chat_folders


@pytest.fixture(scope="module")
def server(chat_server):
  return chat_server


@pytest.fixture(scope="module")
def client(server):
  return helpers.openai_client(server)


def ask(client, max_tokens=64, **kw):
  return client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS,
                                        max_tokens=max_tokens, **kw)


def check_answer(reasoning, content, calls, finish):
  assert reasoning == helpers.REASONING
  assert content == helpers.CONTENT
  assert calls == [helpers.CALL]
  assert finish == "tool_calls"


# Every decode step of a 163,840-token vocabulary costs the engine a sort and the sampling
# noise over the whole vocabulary per row, so this file asks for few answers: one sampled
# request with two choices (logprobs on), and the same request streamed.
SAMPLED = dict(temperature=1.0, seed=5, n=2, logprobs=True, top_logprobs=2)


@pytest.fixture(scope="module")
def whole(client):
  return ask(client, **SAMPLED)


def test_reasoning_content_and_tool_calls(whole, folders):
  assert whole.object == "chat.completion" and [c.index for c in whole.choices] == [0, 1]
  script = helpers.script_ids(load_tokenizer("auto", folders[1]))
  for choice in whole.choices:
    m = choice.message
    assert m.role == "assistant"
    check_answer(m.model_extra["reasoning_content"], m.content,
                 [(c.id, c.function.name, c.function.arguments) for c in m.tool_calls],
                 choice.finish_reason)
    assert json.loads(m.tool_calls[0].function.arguments) == {"city": "Paris"}
  # both choices' tokens and <|im_end|>, which ends each answer
  assert whole.usage.completion_tokens == 2 * (len(script) + 1)


def test_logprobs(whole):
  content = whole.choices[0].logprobs.content
  assert content[-1].token == "<|im_end|>"
  for t in content:
    assert len(t.top_logprobs) == 2
    assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
    assert t.logprob <= t.top_logprobs[0].logprob + 1e-12
  text = b"".join(bytes(t.bytes) for t in content[:-1]).decode()  # "é" split in two tokens
  assert text.startswith("<think>The user wants") and "caf\u00e9." in text
  assert "bytes:\\xc3" in [t.token for t in content]


def test_stream_equals_whole(client, whole):
  reasoning, content, calls, finish, roles = {}, {}, {}, {}, {}
  for chunk in ask(client, stream=True, **SAMPLED):
    assert chunk.object == "chat.completion.chunk"
    for c in chunk.choices:
      d, i = c.delta, c.index
      roles.setdefault(i, []).extend([d.role] if d.role else [])
      reasoning[i] = reasoning.get(i, "") + ((d.model_extra or {}).get("reasoning_content") or "")
      content[i] = content.get(i, "") + (d.content or "")
      calls.setdefault(i, []).extend(
          (t.id, t.function.name, t.function.arguments) for t in d.tool_calls or ())
      finish[i] = c.finish_reason or finish.get(i)
  assert sorted(roles) == [0, 1]
  for i, choice in enumerate(whole.choices):
    assert roles[i] == ["assistant"]
    check_answer(reasoning[i], content[i], calls[i], finish[i])
    assert content[i] == choice.message.content


def test_prompt_is_rendered_as_k3jax_tokenize_renders_it(client, folders, tmp_path, capsys):
  row = tmp_path / "row.json"
  row.write_text(json.dumps({"messages": MESSAGES, "tools": TOOLS}))
  assert cli.main(["tokenize", folders[0], "--chat", str(row), "--add-generation-prompt",
                   "--json"]) == 0
  want = json.loads(capsys.readouterr().out)["ids"]
  r = ask(client, temperature=0, max_tokens=1, extra_body={"return_token_ids": True})
  assert r.choices[0].model_extra["prompt_token_ids"] == want
  assert r.usage.prompt_tokens == len(want)


def test_chat_errors_while_a_chat_completes(server, client):
  solo = ask(client, temperature=0)
  result = {}

  def busy_stream():
    result["content"] = "".join(c.choices[0].delta.content or "" for c in ask(
        client, temperature=0, stream=True) if c.choices)
  busy = threading.Thread(target=busy_stream)
  busy.start()
  chat = "/v1/chat/completions"

  def post(body=None, **kw):
    return helpers.request(server.url, "POST", chat, body, **kw)
  cases = [
      (post(content=b'{"model": "tiny", "messages": ['), 400, None),
      (post({"model": "tiny", "messages": []}), 400, "messages"),
      (post({"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]}), 400,
       "messages"),
      (post({"model": "tiny", "messages": MESSAGES, "temperature": -1}), 400, "temperature"),
      (post({"model": "tiny", "messages": [{"role": "user", "content": "word " * 400}]}), 400,
       None),  # 400 tokens and more: past --max-model-len 256
      (post({"model": "tiny", "messages": MESSAGES, "tools": TOOLS,
             "tool_choice": {"type": "function", "function": {"name": "get_time"}}}), 400,
       "tool_choice"),
      (post({"model": "tiny", "messages": MESSAGES}, key=None), 401, None),
      (post({"model": "tiny", "messages": MESSAGES}, key="wrong-key"), 401, None),
      (post({"model": "other", "messages": MESSAGES}), 404, "model"),
  ]
  for r, status, param in cases:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param, err
  assert cases[6][0].json()["error"]["type"] == "authentication_error"
  with pytest.raises(openai.BadRequestError) as e:
    client.chat.completions.create(model="tiny", messages=[], max_tokens=1)
  assert e.value.body["param"] == "messages"
  with pytest.raises(openai.NotFoundError):
    client.chat.completions.create(model="other", messages=MESSAGES, max_tokens=1)
  busy.join(300)
  assert result["content"] == solo.choices[0].message.content == helpers.CONTENT


# a conversation the two templates render differently: K2-Instruct writes a past tool call's
# arguments through tojson (a quoted JSON string), K2-Thinking writes them as given
HISTORY = MESSAGES + [
    {"role": "assistant", "content": "Checking.", "reasoning_content": "The user wants it.",
     "tool_calls": [{"id": "functions.get_weather:0", "type": "function", "function": {
         "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "Sunny, 21 C"},
    {"role": "user", "content": "And tomorrow?"}]


def test_k2_instruct_template(folders, reference_dir, tmp_path, capsys):
  """The same model behind K2-Instruct's own template (its tokenizer_config.json's): the prompt
  is `k3jax tokenize`'s for that template, and the answer is parsed as under K2-Thinking's."""
  instruct = assemble(str(tmp_path / "instruct"), reference_dir)
  row = tmp_path / "row.json"
  row.write_text(json.dumps({"messages": HISTORY, "tools": TOOLS}))
  ids = {}
  for name, folder in (("instruct", instruct), ("thinking", folders[1])):
    assert cli.main(["tokenize", folder, "--chat", str(row), "--add-generation-prompt",
                     "--json"]) == 0
    ids[name] = json.loads(capsys.readouterr().out)["ids"]
  assert ids["instruct"] != ids["thinking"]
  with helpers.serving(folders[0], "--max-model-len", "256", "--tokenizer", instruct) as server:
    r = helpers.openai_client(server).chat.completions.create(
        model="tiny", messages=HISTORY, tools=TOOLS, max_tokens=64, temperature=0,
        extra_body={"return_token_ids": True})
  assert r.choices[0].model_extra["prompt_token_ids"] == ids["instruct"]
  m = r.choices[0].message
  check_answer(m.model_extra["reasoning_content"], m.content,
               [(c.id, c.function.name, c.function.arguments) for c in m.tool_calls],
               r.choices[0].finish_reason)
