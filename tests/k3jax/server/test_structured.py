"""Structured output, enforced tool calls and the OpenAI fields around them, through the
`openai` client against the chat server (conftest.py: the K2-Thinking tokenizer, 163,840
tokens, and the crafted model that answers with reasoning, content and a get_weather call).

Every answer that ends on its own ("stop", or "tool_calls" after calls) must parse and follow
its schema (an independent validator below), greedy and sampled, with n > 1 and streamed.
Bad input gets 400 naming the problem; fields that do not change the output are accepted;
the request bodies lm-evaluation-harness and the openai client send are served.
"""

import json
import types

import httpx2 as httpx  # the openai client's HTTP library
import openai
import pytest
from lm_eval.models.openai_completions import LocalChatCompletion, LocalCompletionsAPI

from tests.k3jax.server import helpers

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "tz": {"enum": ["UTC", "CET"]}, "hour24": {"type": "boolean"}},
        "required": ["tz", "hour24"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMA = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "sunny": {"type": "boolean"}}, "required": ["city", "days", "sunny"],
    "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA,
                                                      "strict": True}}


@pytest.fixture(scope="module")
def client(chat_server):
  return helpers.openai_client(chat_server)


def valid(value, schema) -> bool:
  """Whether `value` follows `schema` (the keywords these tests use)."""
  if "enum" in schema and value not in schema["enum"]:
    return False
  kind = schema.get("type")
  if kind == "object":
    if not isinstance(value, dict) or not set(schema.get("required", ())) <= set(value):
      return False
    props = schema.get("properties", {})
    if schema.get("additionalProperties") is False and set(value) - set(props):
      return False
    return all(valid(v, props.get(k, {})) for k, v in value.items())
  if kind == "integer":
    return (isinstance(value, int) and not isinstance(value, bool)
            and schema.get("minimum", value) <= value <= schema.get("maximum", value))
  if kind == "boolean":
    return isinstance(value, bool)
  if kind == "string":
    return isinstance(value, str)
  return True


def chat(client, **kw):
  return client.chat.completions.create(model="tiny", messages=MESSAGES, **{
      "max_tokens": 96, **kw})


def streamed(client, **kw) -> dict[int, dict]:
  """{index: {content, reasoning, calls, finish}} of a streamed chat."""
  out = {}
  for chunk in chat(client, stream=True, **kw):
    for c in chunk.choices:
      o = out.setdefault(c.index, {"content": "", "reasoning": "", "calls": [], "finish": None})
      o["content"] += c.delta.content or ""
      o["reasoning"] += (c.delta.model_extra or {}).get("reasoning_content") or ""
      o["calls"] += [(t.function.name, t.function.arguments) for t in c.delta.tool_calls or ()]
      o["finish"] = c.finish_reason or o["finish"]
  return out


def test_json_schema_answers_follow_the_schema(client):
  """Greedy, sampled with n=3, and streamed: every answer that stopped is JSON of the
  schema, after the model's reasoning (kept as reasoning_content)."""
  answers = []
  greedy = chat(client, temperature=0, response_format=JSON_SCHEMA)
  sampled = chat(client, temperature=1.0, seed=3, n=3, response_format=JSON_SCHEMA)
  for c in greedy.choices + sampled.choices:
    answers.append((c.finish_reason, c.message.content))
    assert c.message.model_extra["reasoning_content"] == helpers.REASONING
  for o in streamed(client, temperature=1.0, seed=3, n=3, response_format=JSON_SCHEMA).values():
    answers.append((o["finish"], o["content"]))
  stopped = [text for finish, text in answers if finish == "stop"]
  assert len(stopped) >= 4, answers
  for text in stopped:
    assert valid(json.loads(text), SCHEMA), text
  # the stream is the same answers as the whole response (same seeds)
  assert [a[1] for a in answers[4:]] == [c.message.content for c in sampled.choices]


def test_json_object_answers_are_objects(client):
  r = chat(client, temperature=0.8, seed=1, n=2, response_format={"type": "json_object"})
  for c in r.choices:
    if c.finish_reason == "stop":
      assert isinstance(json.loads(c.message.content), dict)


def test_required_tool_choice_keeps_a_valid_call_and_a_named_one_forces_it(client):
  """The crafted answer already calls get_weather correctly: under tool_choice "required" it
  comes out unchanged (the grammar allows it); naming get_time forces one call of it, with
  arguments that follow its parameters (greedy, sampled n=2, streamed)."""
  free = chat(client, temperature=0, tools=TOOLS)
  required = chat(client, temperature=0, tools=TOOLS, tool_choice="required")
  assert required.choices[0].message.tool_calls == free.choices[0].message.tool_calls
  assert required.choices[0].finish_reason == "tool_calls"
  named = {"type": "function", "function": {"name": "get_time"}}
  calls = []
  for r in (chat(client, temperature=0, tools=TOOLS, tool_choice=named),
            chat(client, temperature=1.0, seed=7, n=2, tools=TOOLS, tool_choice=named)):
    for c in r.choices:
      calls.append((c.finish_reason, [(t.function.name, t.function.arguments)
                                      for t in c.message.tool_calls or ()]))
  for o in streamed(client, temperature=1.0, seed=7, n=2, tools=TOOLS,
                    tool_choice=named).values():
    calls.append((o["finish"], o["calls"]))
  done = [c for finish, c in calls if finish == "tool_calls"]
  assert len(done) >= 3, calls
  for c in done:
    assert len(c) == 1 and c[0][0] == "get_time"
    assert valid(json.loads(c[0][1]), TIME["function"]["parameters"]), c


def test_bad_structured_requests_are_400_naming_the_problem(chat_server, client):
  def post(body, path="/v1/chat/completions"):
    return helpers.request(chat_server.url, "POST", path,
                           {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, **body})
  bad_tool = {"type": "function", "function": {"name": "bad", "parameters": {
      "type": "object", "properties": {"d": {"type": "string", "format": "weird"}}}}}
  cases = [
      ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
          "type": "string", "format": "weird"}}}}, "response_format",
       "response_format.json_schema.schema: the grammar library refuses it"),
      ({"tools": [WEATHER, bad_tool], "tool_choice": "required"}, "tools",
       "tools[1].function.parameters"),
      ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
       "tool_choice", "no tool named 'nope'"),
      ({"tool_choice": "required"}, "tool_choice", "requires tools"),
      ({"logit_bias": {"163840": 1}}, "logit_bias", "outside the vocabulary"),
      ({"logit_bias": {"5": 150}}, "logit_bias", "[-100, 100]"),
      ({"logit_bias": {"five": 1}}, "logit_bias", "not a token id"),
      ({"presence_penalty": 3}, "presence_penalty", None),
      ({"prediction": {"type": "content", "content": "x"}}, "prediction", "not supported"),
      ({"modalities": ["text", "audio"]}, "modalities", "only"),
      ({"response_format": JSON_SCHEMA, "tools": TOOLS, "tool_choice": "required"},
       "response_format", "cannot be enforced together"),
  ]
  for body, param, words in cases:
    r = post(body)
    assert r.status_code == 400, (body, r.text)
    err = r.json()["error"]
    assert err["param"] == param and (words is None or words in err["message"]), err
  r = post({"prompt": "x", "response_format": {"type": "json_object"}}, "/v1/completions")
  assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
  ok = chat(client, temperature=0, max_tokens=4, user="u", metadata={"k": "v"}, store=False,
            service_tier="auto", parallel_tool_calls=True, extra_body={"unknown_field": 1})
  assert ok.choices[0].finish_reason == "length"


def captured_bodies() -> list[tuple[str, dict]]:
  """What the openai client and lm-evaluation-harness send: (path, body), recorded by an
  httpx transport (the client) or built by the harness's own payload code."""
  sent = []

  def record(request: httpx.Request) -> httpx.Response:
    sent.append((request.url.path.removeprefix("/v1"), json.loads(request.content)))
    return httpx.Response(500, json={"error": {"message": "recorded"}})
  client = openai.OpenAI(base_url="http://recorder/v1", api_key="k", max_retries=0,
                         http_client=httpx.Client(transport=httpx.MockTransport(record)))
  calls = [
      lambda: client.chat.completions.create(
          model="tiny", messages=MESSAGES, max_completion_tokens=4, temperature=0.5, top_p=0.9,
          n=2, seed=1, stop=["\n\n"], user="u", metadata={"k": "v"}, store=False,
          service_tier="auto", parallel_tool_calls=False, tools=TOOLS, tool_choice="auto",
          frequency_penalty=0.2, presence_penalty=0.1, logit_bias={"5": -1}, logprobs=True,
          top_logprobs=1, extra_body={"top_k": 5, "repetition_penalty": 1.1, "min_tokens": 1}),
      lambda: client.chat.completions.create(
          model="tiny", messages=MESSAGES, max_tokens=4, stream=True,
          stream_options={"include_usage": True}, response_format=JSON_SCHEMA),
      lambda: client.completions.create(
          model="tiny", prompt="Hello", max_tokens=3, echo=True, logprobs=1, best_of=1,
          user="u", seed=2, temperature=0),
  ]
  for call in calls:
    with pytest.raises(openai.APIError):
      call()
  harness = types.SimpleNamespace(model="tiny", _max_gen_toks=4)
  sent += [
      ("/completions", LocalCompletionsAPI._create_payload(
          harness, "Question: 2+2=", generate=True,
          gen_kwargs={"until": ["\n"], "max_gen_toks": 4, "do_sample": False})),
      ("/completions", LocalCompletionsAPI._create_payload(harness, [[1, 2, 3, 4]])),
      ("/chat/completions", LocalChatCompletion._create_payload(
          harness, MESSAGES, generate=True, gen_kwargs={"until": ["\n\n"], "max_gen_toks": 4})),
  ]
  return sent


def test_the_bodies_clients_send_are_served(chat_server):
  bodies = captured_bodies()
  assert {path for path, _ in bodies} == {"/completions", "/chat/completions"}
  for path, body in bodies:
    r = helpers.request(chat_server.url, "POST", "/v1" + path, body)
    assert r.status_code == 200, (body, r.text)
