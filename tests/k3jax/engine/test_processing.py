"""The engine's logits processing against float64 references written from the definitions:
a grammar's token mask (structured output), min_tokens, logit_bias and the presence /
frequency / repetition penalties (vLLM's formulas, applied to the full forward's logits).

Greedy tokens must be the argmax of the processed reference, and "processed" logprobs its
log_softmax (over the temperature) to 1e-12; "raw" logprobs stay the model's own. A request
without processing served beside them is untouched (batch invariance), and decode blocks
give the one-token-per-step engine's tokens.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.engine.engine import Engine
from k3jax.engine.processing import mask_words
from k3jax.engine.request import SamplingParams
from k3jax.generate.sampling import allowed_tokens
from k3jax.tokenizer.grammar import GrammarError, Vocabulary, json_lark
from tests.k3jax.engine import helpers
from tests.k3jax.engine.helpers import CONFIG, _forward, drain, log_softmax, model

TOL = 1e-12
BLOCKS = dataclasses.replace(CONFIG, decode_steps=4, max_model_len=128)
VOCAB = 64
EOS = 63
# a 64-token vocabulary for the tiny model: JSON's characters, words, and an end token
PIECES = (list('{}":, ') + list("0123456789") + list("abcdefghijklmnopqrstuvwxyz")
          + ["true", "false", "null", '{"', '":', '",', '"}', "ab", "cd", "ok", "n", "w", "  ",
             "\n", "xy", "zz", "[", "]", "-", ".", "e"][:VOCAB - 43] + ["<|end|>"])
assert len(PIECES) == VOCAB


class ToyTokenizer:
  """Longest-match over PIECES; token 63 is the special end token."""
  vocab_size = VOCAB
  special_tokens = {"<|end|>": EOS}

  def decode_bytes(self, ids) -> bytes:
    return b"".join(PIECES[int(i)].encode() for i in ids)

  def encode(self, text: str, allow_special: bool = True) -> np.ndarray:
    del allow_special
    out, at = [], 0
    while at < len(text):
      k = max((i for i in range(EOS) if text.startswith(PIECES[i], at)),
              key=lambda i: len(PIECES[i]))
      out.append(k)
      at += len(PIECES[k])
    return np.asarray(out, np.int32)


SCHEMA = {"type": "object", "properties": {
    "n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"},
    "w": {"enum": ["ab", "cd"]}}, "required": ["n", "ok", "w"], "additionalProperties": False,
    "x-guidance": {"whitespace_pattern": "[ ]{0,1}"}}


@pytest.fixture(scope="module")
def m():
  return model()


@pytest.fixture(scope="module")
def vocab():
  return Vocabulary(ToyTokenizer(), VOCAB, [EOS])


@pytest.fixture(autouse=True)
def _x64():
  with jax.enable_x64(True):
    yield


def prompts(seed: int, lengths):
  return helpers.prompts(seed, lengths, vocab=62)


def logits_truth(m, ids) -> np.ndarray:
  """[T, V] float64 logits of the full forward (not normalised: the repetition penalty reads
  their sign)."""
  ids = [int(t) for t in ids]
  padded = ids + [0] * (-len(ids) % 32)
  return np.asarray(_forward(m, jnp.asarray([padded]))[0, :len(ids)], np.float64)


def penalised(x: np.ndarray, params: SamplingParams, prompt, output) -> np.ndarray:
  """vLLM's processing of one row of logits, given what came before."""
  x = x.copy()
  for t, v in params.logit_bias:
    x[t] += v
  counts = np.bincount(np.asarray(output, np.int64), minlength=len(x)).astype(np.float64)
  seen = np.zeros(len(x), bool)
  seen[list(prompt) + list(output)] = True
  r = params.repetition_penalty
  x = np.where(seen, np.where(x > 0, x / r, x * r), x)
  return x - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)


def check(m, prompt, result, params, allowed=None):
  """Every token is the reference's (argmax, or a token it keeps), every logprob its."""
  lg = logits_truth(m, prompt + result.tokens)
  for j, tok in enumerate(result.tokens):
    x = penalised(lg[len(prompt) - 1 + j], params, prompt, result.tokens[:j])
    if allowed is not None:
      x = np.where(allowed[j], x, -np.inf)
    if j < params.min_tokens:
      x[EOS] = -np.inf
    if params.temperature == 0:
      assert tok == int(np.argmax(x)), j
    assert np.isfinite(x[tok])
    if params.logprobs_mode == "processed" and params.temperature > 0:
      want = log_softmax(x / params.temperature)[tok]
    else:
      want = log_softmax(lg[len(prompt) - 1 + j])[tok]
    assert abs(result.logprobs[j] - want) <= TOL, (j, result.logprobs[j], want)


def allowed_along(grammar, tokens) -> list[np.ndarray]:
  """The grammar's allowed set before each of `tokens` (a fresh matcher, replayed)."""
  matcher, out = grammar.matcher(), []
  for t in tokens:
    words = np.full(mask_words(VOCAB), -1, np.int32)
    matcher.fill(words)
    out.append(np.unpackbits(words.view(np.uint8), bitorder="little")[:VOCAB].astype(bool))
    assert matcher.accept(t)
  return out


def test_mask_bits_unpack_as_the_library_packs_them():
  rng = np.random.default_rng(0)
  words = rng.integers(-2**31, 2**31, (3, mask_words(70)), dtype=np.int64).astype(np.int32)
  want = np.unpackbits(words.view(np.uint8), bitorder="little").reshape(3, -1)[:, :70]
  np.testing.assert_array_equal(np.asarray(allowed_tokens(jnp.asarray(words), 70)), want)


@pytest.mark.parametrize("config", [CONFIG, BLOCKS], ids=["one-step", "blocks"])
def test_penalties_and_logit_bias_follow_vllms_definitions(m, config):
  """Greedy and sampled ("processed" logprobs) requests with every penalty and a logit bias,
  served beside a plain request: each token is the reference's, each logprob its; the plain
  request is the full forward's, and gets the same in blocks as one token per step."""
  ps = prompts(3, (12, 7))
  bias = ((5, 3.5), (9, -100.0), (40, 2.0))
  greedy = SamplingParams(max_tokens=10, temperature=0.0, logprobs=0, presence_penalty=0.8,
                          frequency_penalty=0.6, repetition_penalty=1.7, logit_bias=bias)
  sampled = dataclasses.replace(greedy, temperature=0.9, seed=4, logprobs_mode="processed",
                                presence_penalty=-0.5, repetition_penalty=0.6)
  plain = SamplingParams(max_tokens=10, temperature=0.0, logprobs=0)
  out = drain(Engine(m, config), {0: [("g", ps[0], greedy), ("s", ps[1], sampled),
                                      ("p", ps[1], plain)]})
  check(m, ps[0], out["g"], greedy)
  check(m, ps[1], out["s"], sampled)
  check(m, ps[1], out["p"], plain)
  assert out["g"].tokens != drain(Engine(m, CONFIG), {0: [("x", ps[0], plain)]})["x"].tokens


def test_a_grammar_masks_every_draw_and_the_output_follows_it(m, vocab):
  """Requests under a JSON schema, greedy and sampled: each token is the argmax (or one) of
  the tokens the grammar allows there (replayed with a fresh matcher), raw logprobs the
  model's own, processed ones those of the masked distribution; each ends at the end token
  once the JSON is complete, and the text parses and follows the schema. min_tokens keeps
  the end token out of a plain request's first draws."""
  grammar = vocab.compile(json_lark(SCHEMA))
  ps = prompts(5, (9, 14))
  greedy = SamplingParams(max_tokens=40, temperature=0.0, logprobs=0, grammar=grammar,
                          stop_token_ids=(EOS,))
  sampled = dataclasses.replace(greedy, temperature=1.2, seed=8, logprobs_mode="processed")
  eng = Engine(m, BLOCKS)
  out = drain(eng, {0: [("g", ps[0], greedy), ("s", ps[1], sampled)]})
  for rid, p, params in (("g", ps[0], greedy), ("s", ps[1], sampled)):
    r = out[rid]
    assert r.finish == "stop" and r.tokens[-1] == EOS
    check(m, p, r, params, allowed_along(grammar, r.tokens))
    value = json.loads(ToyTokenizer().decode_bytes(r.tokens[:-1]))
    assert set(value) == {"n", "ok", "w"} and 0 <= value["n"] <= 99
    assert isinstance(value["ok"], bool) and value["w"] in ("ab", "cd")
  # min_tokens: the end token a bias makes the most likely is held off
  eos_first = dataclasses.replace(greedy, grammar=None, logit_bias=((EOS, 100.0),),
                                  max_tokens=6, min_tokens=3)
  r = drain(eng, {0: [("min", ps[0], eos_first)]})["min"]
  assert len(r.tokens) == 4 and r.tokens[-1] == EOS and EOS not in r.tokens[:3]
  check(m, ps[0], r, eos_first)


def test_bad_processing_values_are_refused_alone(m, vocab):
  eng = Engine(m, CONFIG)
  eng.add("ok", [1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0))
  bad = [(SamplingParams(logit_bias={VOCAB: 1.0}), "logit_bias: token id 64 outside"),
         (SamplingParams(logit_bias={3: 101.0}), r"logit_bias: the value .* \[-100, 100\]"),
         (SamplingParams(presence_penalty=2.5), "presence_penalty"),
         (SamplingParams(frequency_penalty=-3.0), "frequency_penalty"),
         (SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
         (SamplingParams(max_tokens=2, min_tokens=3), "min_tokens")]
  for i, (params, message) in enumerate(bad):
    with pytest.raises(ValueError, match=message):
      eng.add(str(i), [1], params)
  with pytest.raises(ValueError, match="held request cannot follow a grammar"):
    eng.add("h", [1], SamplingParams(grammar=vocab.compile(json_lark(None))), hold=True)
  with pytest.raises(GrammarError, match="weird"):
    vocab.compile(json_lark({"type": "string", "format": "weird"}))
  assert list(drain(eng)) == ["ok"]
