"""`k3jax serve`'s chat API against a live server, through the official `openai` client, with
Moonshot's real K2-Thinking tokenizer files (read in place from the shared reference folder)
and a tiny float64 model crafted to answer with reasoning, content and a tool call
(tests/k3jax/server/helpers.py: SCRIPT). One server for the whole file."""

import json

import openai
import pytest

from k3jax import cli
from k3jax.tokenizer import load_tokenizer
from tests.k3jax.server import helpers

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def folders(tmp_path_factory, reference_dir):
  return helpers.chat_run(str(tmp_path_factory.mktemp("chat")), reference_dir)


@pytest.fixture(scope="module")
def server(folders):
  server = helpers.start(folders[0], "--max-model-len", "256")
  server.wait_ready(300)
  yield server
  server.stop()


@pytest.fixture(scope="module")
def client(server):
  return openai.OpenAI(base_url=server.url + "/v1", api_key=helpers.KEY, max_retries=0,
                       timeout=300)


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


def test_chat_errors(server, client):
  with pytest.raises(openai.BadRequestError) as e:
    client.chat.completions.create(model="tiny", messages=[], max_tokens=1)
  assert e.value.body["param"] == "messages"
  with pytest.raises(openai.NotFoundError):
    client.chat.completions.create(model="other", messages=MESSAGES, max_tokens=1)
  r = helpers.request(server.url, "POST", "/v1/chat/completions",
                      {"model": "tiny", "messages": MESSAGES, "max_tokens": 1}, key=None)
  assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
