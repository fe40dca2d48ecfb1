"""What an RL harness does to a running server through the `openai` client and plain HTTP:
POST /pause (modes wait, abort, keep), POST /update_weights {"path": CHECKPOINT} (refused
unless paused), POST /resume; the answers after are the new weights' (float64 full forward),
requests that arrive while paused wait for the resume, and every one of these routes wants the
API key."""

import threading
import time

import jax
import numpy as np
import pytest

from convert.load import load_any
from k3jax.execution import NUMERICS
from k3jax.folders import model_folder
from tests.k3jax.engine.helpers import truth
from tests.k3jax.server import helpers

FLAGS = ("--max-model-len", "96")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """(served, the same model with other weights, a model of another config)."""
  root = tmp_path_factory.mktemp("weights")
  return (helpers.byte_run(str(root / "a")), helpers.byte_run(str(root / "b"), seed=5),
          helpers.packable_run(str(root / "c")))


def greedy_ids(model, prompt: list[int], n: int) -> list[int]:
  """The float64 full forward's greedy continuation of `prompt`."""
  ids = list(prompt)
  with jax.enable_x64(True):
    for _ in range(n):
      ids.append(int(np.argmax(truth(model, ids)[-1])))
  return ids[len(prompt):]


def complete(client, prompt="Hello", max_tokens=8, **kw):
  r = client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                temperature=0, extra_body={"return_token_ids": True}, **kw)
  return r.choices[0]


def post(server, path, body=None, **kw):
  return helpers.request(server.url, "POST", path, body or {}, **kw)


def test_pause_update_resume_serves_the_new_weights(runs):
  served, other, foreign = runs
  with jax.enable_x64(True):
    new_model, _ = load_any(model_folder(other).weights, NUMERICS["float64"])
  with helpers.serving(served, *FLAGS) as server:
    client = helpers.openai_client(server)
    before = complete(client).model_extra["token_ids"]
    for path in ("/pause", "/resume", "/update_weights"):
      assert post(server, path, {"path": other}, key=None).status_code == 401
    r = post(server, "/update_weights", {"path": other})
    assert r.status_code == 409 and "pause the server first" in r.json()["error"]["message"]
    # "wait": the request in flight finishes before the pause answers
    flight = {}
    thread = threading.Thread(target=lambda: flight.update(c=complete(client, max_tokens=48)))
    thread.start()
    time.sleep(0.5)
    assert post(server, "/pause", {"mode": "wait"}).json()["paused"] is True
    assert not thread.is_alive() and flight["c"].finish_reason == "length"
    # a request sent while paused waits for the resume
    late = {}
    waiting = threading.Thread(target=lambda: late.update(c=complete(client)))
    waiting.start()
    time.sleep(1.0)
    assert waiting.is_alive()
    bad = [({"path": foreign}, "not the served model's config"),
           ({"path": "/no/such/folder"}, "no such model folder"), ({}, "path")]
    for body, words in bad:
      r = post(server, "/update_weights", body)
      assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    assert post(server, "/pause", {"mode": "later"}).status_code == 400
    r = post(server, "/update_weights", {"path": other})
    assert r.status_code == 200 and r.json()["weights_epoch"] == 1, r.text
    assert post(server, "/resume").json()["paused"] is False
    waiting.join(300)
    want = greedy_ids(new_model, list(b"Hello"), 8)
    assert late["c"].model_extra["token_ids"] == want
    assert complete(client).model_extra["token_ids"] == want != before


def test_abort_ends_the_requests_in_flight_and_keep_continues_them(runs):
  with helpers.serving(runs[0], *FLAGS) as server:
    client = helpers.openai_client(server)
    alone = complete(client, "Hi", max_tokens=40).model_extra["token_ids"]
    for mode in ("abort", "keep"):
      started, result = threading.Event(), {}

      def stream(result=result, started=started):
        ids, finish = [], None
        for chunk in client.completions.create(
            model="tiny", prompt="Hi", max_tokens=40, temperature=0, stream=True,
            extra_body={"return_token_ids": True}):
          started.set()
          c = chunk.choices[0]
          finish = c.finish_reason or finish
          ids = (c.model_extra or {}).get("token_ids") or ids
        result.update(finish=finish, ids=ids)
      thread = threading.Thread(target=stream)
      thread.start()
      assert started.wait(300)
      status = post(server, "/pause", {"mode": mode}).json()
      assert status["paused"] and status["mode"] == mode
      if mode == "keep":
        assert status["kept"] == 1
        time.sleep(0.5)
        assert thread.is_alive()  # held in the engine, state kept
      post(server, "/resume")
      thread.join(300)
      if mode == "abort":
        assert result["finish"] == "abort"
      else:  # continued where it stopped: the tokens of the run never paused
        assert result["finish"] == "length" and result["ids"] == alone
