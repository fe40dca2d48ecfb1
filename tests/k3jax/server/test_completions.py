"""`k3jax serve`'s completions API against a live server on a loopback port, through the
official `openai` client: a 2-layer byte-level float64 model (tests/k3jax/server/helpers.py),
one server for the whole file so its programs compile once."""

import concurrent.futures
import json
import threading

import jax
import numpy as np
import openai
import pytest

from convert.load import load_any
from k3jax import cli
from k3jax.engine import SamplingParams
from k3jax.execution import NUMERICS
from k3jax.folders import model_folder
from tests.k3jax.engine.helpers import drawn_from, truth
from tests.k3jax.server import helpers

MAX_LEN = 128
FLAGS = ("--max-model-len", str(MAX_LEN))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  return helpers.byte_run(str(tmp_path_factory.mktemp("byte")))


@pytest.fixture(scope="module")
def server(run):
  with helpers.serving(run, *FLAGS) as server:
    yield server


@pytest.fixture(scope="module")
def client(server):
  return helpers.openai_client(server)


@pytest.fixture(scope="module")
def reference(run):
  """The served weights in float64, for the full forward."""
  with jax.enable_x64(True):
    model, _ = load_any(model_folder(run).weights, NUMERICS["float64"])
  return model


def full_forward(model, ids) -> np.ndarray:
  with jax.enable_x64(True):
    return truth(model, ids)


def greedy(client, prompt, max_tokens=12, **kw):
  return client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                   temperature=0, **kw)


def metrics(server) -> dict[str, float]:
  out = {}
  for line in helpers.request(server.url, "GET", "/metrics").text.splitlines():
    if line and not line.startswith("#"):
      name, value = line.rsplit(" ", 1)
      out[name.split("{")[0]] = float(value)
  return out


def test_prompt_forms_and_usage(client):
  text = greedy(client, "Hello")
  assert text.object == "text_completion" and text.model == "tiny"
  assert text.usage.prompt_tokens == 5 and text.usage.completion_tokens == 12
  assert text.choices[0].finish_reason == "length"
  ids = greedy(client, list(b"Hello"))  # the byte tokenizer: ids are the bytes
  assert ids.choices[0].text == text.choices[0].text
  many = greedy(client, ["Hello", "Hi there"], n=2)
  assert [c.index for c in many.choices] == [0, 1, 2, 3]
  assert many.choices[0].text == many.choices[1].text == text.choices[0].text
  lists = greedy(client, [list(b"Hello"), list(b"Hi there")])
  assert [c.text for c in lists.choices] == [many.choices[0].text, many.choices[2].text]
  assert lists.usage.prompt_tokens == 5 + 8 and lists.usage.completion_tokens == 24


def test_seed_and_n(client):
  def sample(seed, n):
    r = client.completions.create(model="tiny", prompt="Once", max_tokens=10, temperature=1.0,
                                  seed=seed, n=n)
    return [c.text for c in r.choices]
  two = sample(7, 2)
  assert two == sample(7, 2)              # a seed reproduces
  assert two[0] != two[1]                 # choice j samples with seed + j
  assert sample(8, 1) == [two[1]]


def test_stop_strings(client):
  full = greedy(client, "Stop", max_tokens=24).choices[0].text
  # a stop string inside the text: the first character that is not U+FFFD and first occurs
  # past the start
  at = next(i for i in range(3, len(full)) if full[i] != "\ufffd" and full[i] not in full[:i])
  cut = greedy(client, "Stop", max_tokens=24, stop=[full[at], "never-there"]).choices[0]
  assert cut.text == full[:at] and cut.finish_reason == "stop"
  longer = greedy(client, "Stop", max_tokens=24, stop=full[at:at + 2]).choices[0]
  assert longer.text == full[:at]


def _joined(stream):
  texts, finish, lps = {}, {}, {}
  for chunk in stream:
    for c in chunk.choices:
      texts[c.index] = texts.get(c.index, "") + c.text
      if c.logprobs is not None:
        lps.setdefault(c.index, []).extend(c.logprobs.token_logprobs)
      if c.finish_reason is not None:
        finish[c.index] = c.finish_reason
  return texts, finish, lps


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, seed=3, n=2)])
def test_stream_equals_whole(client, sampling):
  kw = dict(model="tiny", prompt="Stream é", max_tokens=16, logprobs=1, **sampling)
  whole = client.completions.create(**kw)
  texts, finish, lps = _joined(client.completions.create(stream=True, **kw))
  assert texts == {c.index: c.text for c in whole.choices}
  assert finish == {c.index: c.finish_reason for c in whole.choices}
  assert lps == {c.index: c.logprobs.token_logprobs for c in whole.choices}


def test_decode_blocks_serve_what_one_step_serves(client, run):
  """`k3jax serve --decode-steps 4 --prefill-widths 2 --prefill-rows 2 --data-shards 2`:
  streamed, the same text, finish reasons and logprobs as the one-step, one-pool server's whole
  responses, greedy, sampled (two choices: their prompts read in one step, on the two pool
  shards), and with a stop string that completes inside a block."""
  one_step = greedy(client, "Blocks of", max_tokens=16).choices[0].text
  stop = one_step[5:7]
  cases = [dict(temperature=0), dict(temperature=1.0, seed=3, n=2),
           dict(temperature=0, stop=[stop])]
  with helpers.serving(run, *FLAGS, "--decode-steps", "4", "--prefill-widths", "2",
                       "--prefill-rows", "2", "--data-shards", "2") as blocks:
    blocks_client = helpers.openai_client(blocks)
    for kw in cases:
      kw = dict(model="tiny", prompt="Blocks of", max_tokens=16, logprobs=1, **kw)
      whole = client.completions.create(**kw)
      texts, finish, lps = _joined(blocks_client.completions.create(stream=True, **kw))
      assert texts == {c.index: c.text for c in whole.choices}, kw
      assert finish == {c.index: c.finish_reason for c in whole.choices}, kw
      for c in whole.choices:
        np.testing.assert_allclose(lps[c.index], c.logprobs.token_logprobs, rtol=0, atol=1e-9)
  assert texts[0] == one_step[:5] and finish[0] == "stop"


def test_raw_stream_is_server_sent_events(server):
  body = {"model": "tiny", "prompt": "SSE", "max_tokens": 4, "stream": True,
          "stream_options": {"include_usage": True}}
  r = helpers.request(server.url, "POST", "/v1/completions", body)
  assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
  events = [e for e in r.text.split("\n\n") if e]
  assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
  assert json.loads(events[-2][6:])["usage"]["completion_tokens"] == 4


def test_echo_loglikelihoods_equal_the_full_forward(client, reference):
  """echo=true, max_tokens=0, logprobs=1: how lm-evaluation-harness scores a continuation."""
  prompt = "The quick brown fox jumps"
  r = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True,
                                logprobs=1, temperature=0)
  lp = r.choices[0].logprobs
  ids = list(prompt.encode())
  assert r.choices[0].text == prompt and len(lp.token_logprobs) == len(ids)
  assert lp.text_offset == list(range(len(ids)))
  assert lp.token_logprobs[0] is None
  want = full_forward(reference, ids)
  np.testing.assert_allclose(lp.token_logprobs[1:], want[np.arange(len(ids) - 1), ids[1:]],
                             rtol=0, atol=1e-9)
  # with generated tokens: their logprobs and the greedy choice follow the full forward too
  g = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, echo=True,
                                logprobs=1, temperature=0).choices[0]
  out = [ord(t) if len(t) == 1 else int(t[-2:], 16) for t in g.logprobs.tokens[len(ids):]]
  seq = ids + out
  want = full_forward(reference, seq)
  got = g.logprobs.token_logprobs[1:]
  np.testing.assert_allclose(got, want[np.arange(len(seq) - 1), seq[1:]], rtol=0, atol=1e-9)
  assert out == [int(want[len(ids) - 1 + k].argmax()) for k in range(4)]


def test_return_token_ids_reports_the_distribution_each_token_was_drawn_from(client,
                                                                             reference):
  """`return_token_ids` (what an RL harness reads): `token_logprobs` of every generated token
  under the distribution it was drawn from (temperature, then top-k / top-p), float64 against
  the full forward's, whole and streamed; `logprobs` then report the same."""
  prompt = "Once upon a time"
  ask = dict(model="tiny", prompt=prompt, max_tokens=6, temperature=0.8, top_p=0.9, seed=5,
             logprobs=1, extra_body={"top_k": 5, "return_token_ids": True})
  c = client.completions.create(**ask).choices[0]
  ids, got = c.model_extra["token_ids"], c.model_extra["token_logprobs"]
  assert len(ids) == len(got) == 6 and c.logprobs.token_logprobs == got
  lp = full_forward(reference, list(prompt.encode()) + ids)[len(prompt.encode()) - 1:-1]
  want = []
  for row, t in zip(lp, ids):
    drawn = drawn_from(row, SamplingParams(temperature=0.8, top_p=0.9, top_k=5))
    assert np.isfinite(drawn).sum() <= 5
    want.append(drawn[t])
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-9)
  last = list(client.completions.create(**ask, stream=True))[-1].choices[0]
  assert last.model_extra["token_ids"] == ids and last.model_extra["token_logprobs"] == got


def test_greedy_text_equals_generate(client, run, capsys):
  prompts = ["Hello", "ab\u00e9c"]
  code = cli.main(["generate", run, *[a for p in prompts for a in ("--prompt", p)],
                   "--temperature", "0", "--json", "--dtype", "float64", "--max-new-tokens",
                   "20", "--compile-cache", "none", *FLAGS])
  assert code == 0
  rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
  want = {row["index"]: row["text"] for row in rows}
  got = greedy(client, prompts, max_tokens=20)
  assert {c.index: c.text for c in got.choices} == want


def test_errors_while_a_request_completes(server, client):
  solo = greedy(client, "Busy", max_tokens=48).choices[0].text
  result = {}
  busy = threading.Thread(target=lambda: result.update(
      text="".join(c.choices[0].text for c in greedy(client, "Busy", max_tokens=48,
                                                       stream=True))))
  busy.start()

  def post(path, body=None, **kw):
    return helpers.request(server.url, "POST", path, body, **kw)
  cmpl = "/v1/completions"
  cases = [
      (post(cmpl, content=b"{not json"), 400, None),
      (post(cmpl, {"model": "tiny", "prompt": "x", "temperature": "hot"}), 400, "temperature"),
      (post(cmpl, {"model": "tiny", "prompt": "x", "max_tokens": -1}), 400, "max_tokens"),
      (post(cmpl, {"model": "tiny", "prompt": [1] * (MAX_LEN + 1)}), 400, None),
      (post(cmpl, {"model": "tiny", "prompt": "x", "logit_bias": {"256": 2}}), 400, "logit_bias"),
      (post("/v1/chat/completions", {"model": "tiny", "messages": [  # bytes: no chat template
          {"role": "user", "content": "hi"}]}), 400, "messages"),
      (helpers.request(server.url, "GET", "/v1/models", key=None), 401, None),
      (post(cmpl, {"model": "tiny", "prompt": "x"}, key="wrong-key"), 401, None),
      (post(cmpl, {"model": "gpt-9", "prompt": "x"}), 404, "model"),
      (helpers.request(server.url, "GET", "/v1/no-such-route"), 404, None),
  ]
  for r, status, param in cases:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param, err
  assert cases[6][0].json()["error"]["code"] == "invalid_api_key"
  with pytest.raises(openai.AuthenticationError):
    openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
  with pytest.raises(openai.NotFoundError):
    client.completions.create(model="nope", prompt="x", max_tokens=1)
  with pytest.raises(openai.BadRequestError):
    client.completions.create(model="tiny", prompt="x", max_tokens=1, n=0)
  busy.join(300)
  assert result["text"] == solo
  assert [m.id for m in client.models.list().data] == ["tiny"]
  assert helpers.request(server.url, "GET", "/health").status_code == 200


def test_503_while_loading(run):
  gate = threading.Event()
  loading = helpers.start(run, *FLAGS, gate=gate)
  try:
    health = helpers.request(loading.url, "GET", "/health")
    assert health.status_code == 503 and health.json()["status"] == "loading"
    r = helpers.request(loading.url, "POST", "/v1/completions", {"model": "tiny", "prompt": "x"})
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable_error"
  finally:
    gate.set()
    loading.wait_ready(300)
    loading.stop()


def test_32_concurrent_clients_each_as_if_alone(client):
  prompts = [f"client {i:02d} says" for i in range(32)]
  alone = [greedy(client, p, max_tokens=6, logprobs=1).choices[0] for p in prompts[:4]]

  def one(p):
    return greedy(client, p, max_tokens=6, logprobs=1).choices[0]
  with concurrent.futures.ThreadPoolExecutor(32) as pool:
    together = list(pool.map(one, prompts))
  # every one answered; the first four equal their runs alone, and all equal a batch of
  # four (the requests computed together in other compositions)
  assert all(c.finish_reason == "length" for c in together)
  batch = greedy(client, prompts[4:], max_tokens=6, logprobs=1).choices
  for got, want in zip(together, alone + list(batch)):
    assert got.text == want.text
    np.testing.assert_allclose(got.logprobs.token_logprobs, want.logprobs.token_logprobs,
                               rtol=0, atol=1e-9)


def test_disconnect_mid_stream_frees_the_slot(server):
  before = metrics(server)
  assert before["k3jax_requests_running"] == 0
  body = {"model": "tiny", "prompt": "go", "max_tokens": MAX_LEN - 8, "stream": True,
          "ignore_eos": True}
  conn, r = helpers.connect(server.url, "POST", "/v1/completions", body)
  try:
    assert r.status == 200
    while not r.readline().startswith(b"data: "):
      pass
    during = metrics(server)
    assert during["k3jax_requests_running"] == 1 and during["k3jax_cache_pages_used"] > 0
  finally:
    conn.close()
  # the connection is closed: the server aborts the request and frees its pages
  for _ in range(600):
    now = metrics(server)
    if now["k3jax_requests_running"] == 0:
      break
    threading.Event().wait(0.05)
  assert now["k3jax_requests_running"] == 0 and now["k3jax_requests_waiting"] == 0
  assert now["k3jax_cache_pages_used"] == before["k3jax_cache_pages_used"]
  assert now["k3jax_generation_tokens_total"] < before["k3jax_generation_tokens_total"] + body[
      "max_tokens"]
