"""The server when an engine step fails (tests/k3jax/engine/test_recovery.py has the engine's
side): the request the step ran gets 500 with OpenAI's error body and the next ones are
served as before; when the engine cannot recover, /health answers 503, new requests too, and
`k3jax serve` (Server.run) ends with an error, so that its process exits non-zero and a
supervisor restarts it."""

import threading
import time

import openai
import pytest

from k3jax.cli import build_parser
from k3jax.commands._args import engine_options
from k3jax.errors import UserError
from k3jax.server import build
from tests.k3jax.server import helpers

FLAGS = ("--max-model-len", "64")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  return helpers.byte_run(str(tmp_path_factory.mktemp("byte")))


def fail_steps(server, times: int) -> None:
  """The engine's next `times` device calls raise (before they run: the cache survives)."""
  runner = server.service.loop.engine.runner
  real, left = runner._step, [times]

  def failing(*a, **k):
    if left[0] > 0:
      left[0] -= 1
      raise RuntimeError("injected device failure")
    return real(*a, **k)
  runner._step = failing


def greedy(client, prompt="Hello", **kw):
  return client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0,
                                   **kw)


def test_a_failed_step_is_a_500_and_the_server_goes_on(run):
  with helpers.serving(run, *FLAGS) as server:
    client = helpers.openai_client(server)
    before = greedy(client).choices[0].text
    fail_steps(server, 1)
    with pytest.raises(openai.InternalServerError) as e:
      greedy(client)
    error = e.value.body
    assert error["type"] == "server_error" and "injected device failure" in error["message"]
    assert greedy(client).choices[0].text == before  # the next request: served as before
    assert helpers.request(server.url, "GET", "/health").status_code == 200
    fail_steps(server, 100)  # every step fails from now on: the third in a row ends it
    for _ in range(3):
      with pytest.raises(openai.InternalServerError):
        greedy(client)
    health = helpers.request(server.url, "GET", "/health")
    assert health.status_code == 503 and health.json()["status"] == "failed"
    assert "the engine failed" in health.json()["error"]
    late = helpers.request(server.url, "POST", "/v1/completions",
                           {"model": "tiny", "prompt": "Hi", "max_tokens": 2})
    assert late.status_code == 503 and "the engine failed" in late.json()["error"]["message"]


def test_an_engine_that_dies_ends_the_server_with_an_error(run):
  """Server.run (what `k3jax serve` runs) returns once the engine has died and raises
  UserError, which the command turns into exit status 2."""
  args = build_parser().parse_args(["serve", run, *helpers.COMMON, *FLAGS])
  server = build(engine_options(args, host="127.0.0.1", port=0, api_key=helpers.KEY,
                                served_model_name="tiny"))
  raised = []

  def serve():
    try:
      server.run()
    except UserError as e:
      raised.append(e)
  thread = threading.Thread(target=serve, daemon=True)
  thread.start()
  server.wait_ready(300)
  while not server.uvicorn.started:
    time.sleep(0.01)
  fail_steps(server, 100)
  client = helpers.openai_client(server)
  for _ in range(3):
    with pytest.raises(openai.InternalServerError):
      greedy(client)
  thread.join(60)
  assert not thread.is_alive()
  assert len(raised) == 1 and "the engine failed" in str(raised[0])
  assert "3 engine steps failed in a row" in str(raised[0])
  server.socket.close()
