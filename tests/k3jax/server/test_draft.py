"""`k3jax serve --draft`: speculative decoding behind the API (the engine's own tests are
tests/k3jax/engine/test_speculative.py). Greedy answers are the float64 full forward's with a
draft model and with prompt lookup; sampled answers report the logprobs of the distribution
each token was drawn from; every bad `--draft` / `--num-draft-tokens` is one line at
start-up, before the server binds."""

import jax
import numpy as np
import pytest

from convert.load import load_any
from k3jax import cli
from k3jax.engine import SamplingParams
from k3jax.execution import NUMERICS
from k3jax.folders import model_folder
from k3jax.server.draft import tokenizer_difference
from k3jax.tokenizer import ByteTokenizer, load_tokenizer
from tests.k3jax.engine.helpers import drawn_from, truth
from tests.k3jax.server import helpers
from tests.k3jax.tokenizer.real_files import assemble

FLAGS = ("--max-model-len", "96")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  root = tmp_path_factory.mktemp("draft")
  return helpers.byte_run(str(root / "target")), helpers.byte_run(str(root / "draft"), seed=7)


@pytest.fixture(scope="module")
def reference(runs):
  with jax.enable_x64(True):
    model, _ = load_any(model_folder(runs[0]).weights, NUMERICS["float64"])
  return model


def test_greedy_and_sampled_answers_with_drafts(runs, reference):
  prompt = "abcabcabcabc ab"  # repetitive: prompt lookup finds drafts
  for draft in (runs[1], "ngram"):
    with helpers.serving(runs[0], *FLAGS, "--draft", draft, "--num-draft-tokens", "3") as server:
      client = helpers.openai_client(server)
      r = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                    extra_body={"return_token_ids": True})
      ids = r.choices[0].model_extra["token_ids"]
      want = list(prompt.encode())
      with jax.enable_x64(True):
        for _ in range(12):
          want.append(int(np.argmax(truth(reference, want)[-1])))
      assert ids == want[len(prompt):], draft
      s = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0.9,
                                    seed=4, extra_body={"return_token_ids": True, "top_k": 12})
      c = s.choices[0].model_extra
      with jax.enable_x64(True):
        lp = truth(reference, list(prompt.encode()) + c["token_ids"])[len(prompt) - 1:-1]
      params = SamplingParams(temperature=0.9, top_k=12)
      want = [drawn_from(row, params)[t] for row, t in zip(lp, c["token_ids"])]
      np.testing.assert_allclose(c["token_logprobs"], want, rtol=0, atol=1e-9)
      metrics = helpers.request(server.url, "GET", "/metrics").text
      assert "k3jax_spec_draft_tokens_total" in metrics


def test_bad_draft_flags_are_one_line_at_start_up(runs, tmp_path, reference_dir, capsys):
  tok_dir = assemble(str(tmp_path / "tok"), reference_dir)
  other_tokenizer = helpers.byte_run(str(tmp_path / "bpe"), tokenizer=tok_dir)  # 256 ids, K2's
  cases = [(["--draft", "ngram", "--num-draft-tokens", "65"], "--num-draft-tokens must be in"),
           (["--draft", "/no/such/draft"], "no such model folder"),
           (["--draft", other_tokenizer], "its tokenizer differs from the model's"),
           (["--draft", "ngram", "--data-shards", "2", "--max-num-seqs", "4"], "--data-shards 1"),
           (["--draft", "ngram", "--mesh", "context=2,tensor=4"], "a mesh with context=2")]
  for flags, words in cases:
    assert cli.main(["serve", runs[0], *helpers.COMMON, *FLAGS, "--port", "0", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
  with pytest.raises(SystemExit) as e:
    cli.main(["serve", runs[0], "--draft", "ngram", "--num-draft-tokens", "0"])
  assert e.value.code == 2
  assert tokenizer_difference(ByteTokenizer(), load_tokenizer("auto", tok_dir)) == (
      "byte against tiktoken")
