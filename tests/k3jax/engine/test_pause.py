"""The engine across weight updates and pauses, in float64 against independent references.

  weights epoch   new weights on a busy engine: a later request never reuses a block that a
                  request running across the switch computed (its state mixes both weights),
                  and equals the full forward under the new weights
  pause / resume  a paused request continues with the tokens and logprobs it draws when never
                  paused; `recompute` reads it again under the current weights, which a
                  fresh full forward on those weights gives; `keep` continues the state it
                  kept, and reports the logprobs of what it draws from (the cached decode path
                  run on the old weights up to the pause, the new ones after)
  hold            a multi-turn request: each turn appends tokens and computes only them, and
                  every turn's tokens and logprobs are the full forward's on the whole sequence
                  (decode blocks included: a row that draws its stop token inside a block
                  stops there, so its slot holds exactly its tokens)
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.engine.engine import Engine
from k3jax.engine.request import SamplingParams
from k3jax.model.cache import init_cache
from k3jax.model.decode import extend
from tests.k3jax.engine.helpers import CONFIG, drain, log_softmax, model, prompts, truth

TOL = 1e-12
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, logprobs=2)
SAMPLED = SamplingParams(max_tokens=9, temperature=0.8, seed=3, logprobs=2,
                         logprobs_mode="processed")


@pytest.fixture(scope="module")
def m():
  return model()


@pytest.fixture(scope="module")
def other():
  return model(seed=2)


@pytest.fixture(autouse=True)
def _x64():
  with jax.enable_x64(True):
    yield


def close(got: list[float], want, tol=TOL) -> None:
  np.testing.assert_allclose(got, want, rtol=0, atol=tol)


def expected(lp: np.ndarray, prompt_len: int, tokens: list[int], params) -> list[float]:
  """The logprobs a request reports for `tokens` after a prompt of `prompt_len`, given the
  full forward's log-probabilities `lp` of the whole sequence."""
  rows = lp[prompt_len - 1:prompt_len - 1 + len(tokens)]
  if params.temperature > 0 and params.logprobs_mode == "processed":
    rows = log_softmax(rows / params.temperature)
  if params.temperature == 0:
    assert tokens == [int(t) for t in rows.argmax(-1)]
  return [float(row[t]) for row, t in zip(rows, tokens)]


def step_until(eng: Engine, done) -> dict[str, list]:
  """Step until `done(collected)`; {id: [tokens, logprobs]} of what was reported."""
  got: dict[str, list] = {}
  while not done(got):
    for o in eng.step():
      g = got.setdefault(o.request_id, [[], []])
      g[0] += o.token_ids
      g[1] += o.logprobs
  return got


def test_new_weights_on_a_busy_engine_never_reuse_a_block_computed_across_them(m, other):
  """A reads a 40-token prompt in chunks of 16; the weights change after its first chunk.
  Its later blocks (16-32, a snapshot at 32) hold a state that mixes both weights. B then
  computes the first 16 tokens under the new weights, and C (A's first 33 tokens) would
  match B's two blocks and, behind them, A's: it must restore B's snapshot at 16 instead and
  equal the full forward under the new weights."""
  a = prompts(1, (40,))[0]
  eng = Engine(m, CONFIG)
  eng.add("a", a, GREEDY)
  eng.step()                                   # A's chunk [0, 16): blocks 0-1, a snapshot
  eng.set_params(nnx.state(other))
  assert eng.weights_epoch == 1
  eng.step()                                   # A's chunk [16, 32), computed on A's old state
  eng.add("b", a[:16] + [7], GREEDY)
  drain(eng)
  c = a[:33]
  out = drain(eng, {0: [("c", c, GREEDY)]})["c"]
  close(out.logprobs, expected(truth(other, c + out.tokens), len(c), out.tokens, GREEDY))
  assert eng.scheduler.hit_tokens >= 16        # C did hit B's blocks


def test_pause_and_resume_give_the_uninterrupted_tokens_and_logprobs(m):
  """A sampled request paused for a few steps while others run, then resumed (in place, and
  after giving its state up to a preemption), draws the tokens and logprobs it draws alone."""
  p, q = prompts(2, (13, 21))
  alone = drain(Engine(m, CONFIG), {0: [("x", p, SAMPLED)]})["x"]
  for config in (CONFIG, dataclasses.replace(CONFIG, decode_steps=4)):
    eng = Engine(m, config)
    eng.add("x", p, SAMPLED)
    got = step_until(eng, lambda g: len(g.get("x", [[]])[0]) >= 3)
    eng.pause("x")
    assert eng.stats()["paused"] == 1 and eng.num_running == 0
    eng.add("y", q, SAMPLED)
    step_until(eng, lambda g, eng=eng: not eng.has_work())
    eng.resume("x")
    rest = step_until(eng, lambda g, eng=eng: not eng.has_work())["x"]
    assert got["x"][0] + rest[0] == alone.tokens
    close(got["x"][1] + rest[1], alone.logprobs)


def test_a_paused_request_gives_its_slot_up_to_a_waiting_one(m):
  """Every slot held by paused requests: a new request preempts the longest paused, which on
  resume is read again (same tokens and logprobs to summation order)."""
  ps = prompts(3, (9, 10, 11, 12, 14))
  alone = drain(Engine(m, CONFIG), {0: [("0", ps[0], SAMPLED)]})["0"]
  eng = Engine(m, CONFIG)
  for i, p in enumerate(ps[:4]):
    eng.add(str(i), p, SAMPLED)
  got = step_until(eng, lambda g: all(len(g.get(str(i), [[]])[0]) >= 2 for i in range(4)))
  for i in range(4):
    eng.pause(str(i))
  eng.add("new", ps[4], SAMPLED)
  step_until(eng, lambda g, eng=eng: not eng.has_work())
  assert eng.scheduler.preemptions == 1
  eng.resume("0")
  rest = step_until(eng, lambda g, eng=eng: not eng.has_work())["0"]
  assert got["0"][0] + rest[0] == alone.tokens
  close(got["0"][1] + rest[1], alone.logprobs)


def _mixed_logprobs(old, new, prefix: list[int], tokens: list[int], temperature: float):
  """Log-probabilities (softmax(logits / T)) of `tokens` after `prefix` from the cached decode
  path (k3jax/model/decode.py): `prefix` minus its last token read by `old`, the rest by
  `new` from the cache `old` left: the state a request paused at the end of `prefix` keeps
  and continues under new weights."""
  cache = init_cache(old.cfg, old.ex, batch=1, max_len=128)
  _, cache = extend(old, jnp.asarray([prefix[:-1]]), cache)
  logits, _ = extend(new, jnp.asarray([prefix[-1:] + tokens[:-1]]), cache)
  lp = log_softmax(np.asarray(logits[0], np.float64) / temperature)
  return [float(row[t]) for row, t in zip(lp, tokens)]


def test_new_weights_while_paused_keep_or_recompute(m, other):
  """Paused after 3 tokens, the weights change. `keep` continues the state it kept: the
  logprobs it reports are those of the distribution each token was drawn from (the cached
  decode path: old weights up to the pause, new ones after). `recompute` reads the request
  again: the full forward of the new weights on the whole sequence."""
  p = prompts(4, (15,))[0]
  for recompute in (False, True):
    eng = Engine(m, CONFIG)
    eng.add("x", p, SAMPLED)
    first = step_until(eng, lambda g: len(g.get("x", [[]])[0]) >= 3)["x"]
    eng.set_params(nnx.state(other))
    eng.pause("x")
    eng.resume("x", recompute=recompute)
    rest = step_until(eng, lambda g, eng=eng: not eng.has_work())["x"]
    assert len(first[0]) == 3 and len(first[0]) + len(rest[0]) == SAMPLED.max_tokens
    prefix = p + first[0]
    if recompute:
      want = expected(truth(other, prefix + rest[0]), len(prefix), rest[0], SAMPLED)
    else:
      want = _mixed_logprobs(m, other, prefix, rest[0], SAMPLED.temperature)
    close(rest[1], want)


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_held_turns_compute_only_their_new_tokens_and_equal_the_full_forward(m, decode_steps):
  """Turn 1 stops at a stop token (one the model draws third, from a probe); turn 2 appends an
  observation and generates again. Turn 2 runs exactly its new tokens through the model (the
  stop token, the observation and its own tokens but the last), and both turns' tokens and
  logprobs are the full forward's on the whole sequence."""
  config = dataclasses.replace(CONFIG, decode_steps=decode_steps)
  p, obs = prompts(5, (10, 6))
  probe = drain(Engine(m, config), {0: [("x", p, GREEDY)]})["x"].tokens
  stop = probe[2]
  assert stop not in probe[:2]
  params = dataclasses.replace(GREEDY, max_tokens=8, stop_token_ids=(stop,))
  eng = Engine(m, config)
  eng.add("x", p, params, hold=True)
  turn1 = step_until(eng, lambda g, eng=eng: not eng.has_work())["x"]
  assert turn1[0] == probe[:3] and eng.stats()["paused"] == 1
  before = eng.computed_tokens
  eng.resume("x", tokens=obs, sampling=dataclasses.replace(params, max_tokens=4))
  turn2 = step_until(eng, lambda g, eng=eng: not eng.has_work())["x"]
  assert eng.computed_tokens - before == 1 + len(obs) + len(turn2[0]) - 1
  whole = p + turn1[0] + obs + turn2[0]
  lp = truth(m, whole)
  close(turn1[1], expected(lp, len(p), turn1[0], params))
  close(turn2[1], expected(lp, len(p) + 3 + len(obs), turn2[0], params))
  eng.release("x")
  assert eng.stats()["paused"] == 0 and eng.stats()["pages_used"] == eng.stats()["cached_blocks"]


def test_pause_resume_refusals(m):
  eng = Engine(m, CONFIG)
  with pytest.raises(KeyError, match="no running request"):
    eng.pause("nope")
  with pytest.raises(KeyError, match="no paused request"):
    eng.resume("nope")
  eng.add("x", [1, 2, 3], dataclasses.replace(GREEDY, max_tokens=1), hold=True)
  drain(eng)
  with pytest.raises(ValueError, match="outside the vocabulary"):
    eng.resume("x", tokens=[10**6])
  with pytest.raises(ValueError, match="maximum model length"):
    eng.resume("x", tokens=[1] * CONFIG.max_model_len)
  with pytest.raises(ValueError, match="at most 8 stop token ids"):
    eng.add("y", [1], SamplingParams(stop_token_ids=tuple(range(9))), hold=True)
  eng.resume("x", tokens=[4])  # nothing changed by the refusals
  assert drain(eng)["x"].finish == "length"
