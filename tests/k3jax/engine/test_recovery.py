"""An engine step that raises: the step's requests fail alone, everything they held comes
back, a cache the failed call took with it (donated) is rebuilt, and the requests after are
served exactly (float64 against the full forward); an engine that cannot recover says so.

The failure is injected in the runner's call: either before the device runs it (the cache is
intact) or after the call took the donated cache and its result is lost too (as when the
device fails mid-step: both the cache passed in and the one it would have returned are gone).
"""

import dataclasses

import jax
import numpy as np
import pytest

from k3jax.engine.engine import Engine, EngineDead
from k3jax.engine.request import SamplingParams
from tests.k3jax.engine.helpers import CONFIG, drain, model, prompts, truth

TOL = 1e-12
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, logprobs=1)
BLOCKS = dataclasses.replace(CONFIG, decode_steps=4)


@pytest.fixture(scope="module")
def m():
  return model()


@pytest.fixture(autouse=True)
def _x64():
  with jax.enable_x64(True):
    yield


def exact(m, prompt, tokens, logprobs) -> None:
  """Greedy tokens and logprobs of the full forward on the whole sequence."""
  lp = truth(m, prompt + tokens)[len(prompt) - 1:len(prompt) - 1 + len(tokens)]
  assert tokens == [int(t) for t in lp.argmax(-1)]
  np.testing.assert_allclose(logprobs, [row[t] for row, t in zip(lp, tokens)], rtol=0, atol=TOL)


def inject(engine: Engine, *, lost: bool, times: int = 1) -> list[int]:
  """The next `times` calls of the runner fail: before the device runs them, or (`lost`)
  after the call took the cache, whose result is then lost too. Returns a call counter."""
  calls = [0]
  for name in ("_step", "decode_block"):
    real = getattr(engine.runner, name)

    def failing(*a, real=real, **k):
      calls[0] += 1
      if calls[0] > times:
        return real(*a, **k)
      if lost:
        real(*a, **k)  # the old cache was donated to the call; drop what it returned
        for x in jax.tree.leaves(engine.runner.cache):
          x.delete()
      raise RuntimeError("injected: the device failed mid-step")
    setattr(engine.runner, name, failing)
  return calls


def leaks(engine: Engine) -> None:
  """Nothing held once idle: every slot free, pages only in cached blocks, no block held,
  every snapshot either free or kept by a cached block."""
  s = engine.scheduler
  assert not s.running and not s.paused and not s.waiting
  assert sorted(s.free_slots) == list(range(engine.config.max_num_seqs))
  for sh in s.shards:
    assert sh.pages.used == len(sh.prefix.blocks)
    assert all(b.refs == 0 for b in sh.prefix.blocks.values())
    kept = [b.snapshot for b in sh.prefix.blocks.values() if b.snapshot is not None]
    free = sh.prefix._snap_free
    assert sorted(kept + free) == list(range(engine.config.shard_snapshots))


@pytest.mark.parametrize("lost,config", [(False, CONFIG), (True, BLOCKS)],
                         ids=["cache-intact", "cache-donated-blocks"])
def test_a_failed_step_fails_its_requests_alone(m, lost, config):
  """A held request paused with its state, a request decoding and one reading its prompt
  (saving a snapshot) when a step fails: the two in the step end with "error" and give back
  their slot, pages and snapshot; the paused one resumes exactly (from its kept state when
  the cache survived, recomputed when it was rebuilt), and requests after are exact."""
  ps = prompts(1, (10, 20, 30, 19))
  eng = Engine(m, config)
  eng.add("a", ps[1], SamplingParams(max_tokens=40, temperature=0.0))
  eng.add("h", ps[0], GREEDY, hold=True)
  while "h" not in eng._paused:
    eng.step()
  assert eng._requests["a"].decodes
  eng.add("b", ps[2], GREEDY)  # its first chunk ends at a snapshot position (16)
  inject(eng, lost=lost)
  failed = {o.request_id: o for o in eng.step()}
  assert {rid for rid, o in failed.items() if o.finish_reason == "error"} == {"a", "b"}
  assert all("injected" in failed[rid].error for rid in "ab")
  assert eng.failures == 1 and eng.runner.cache_lost() is False
  held = eng._paused["h"]
  assert (held.slot is None) == lost  # rebuilt: its state is recomputed on resume
  eng.resume("h", tokens=ps[3][:5])
  after = drain(eng, {0: [("c", ps[3], GREEDY)]})
  h_prompt = held.prompt
  exact(m, h_prompt, after["h"].tokens, after["h"].logprobs)
  exact(m, ps[3], after["c"].tokens, after["c"].logprobs)
  eng.release("h")
  again = drain(eng, {0: [("b2", ps[2], GREEDY)]})["b2"]  # b's prompt, served after all
  exact(m, ps[2], again.tokens, again.logprobs)
  leaks(eng)


def test_an_engine_that_cannot_recover_says_so(m):
  """Steps that keep failing: each fails its requests, and the third in a row raises
  EngineDead; an engine whose cache cannot be rebuilt raises it at once."""
  eng = Engine(m, CONFIG)
  inject(eng, lost=False, times=100)
  for i in range(2):
    eng.add(str(i), [1, 2, 3], GREEDY)
    assert [o.finish_reason for o in eng.step()] == ["error"]
  eng.add("x", [1, 2, 3], GREEDY)
  with pytest.raises(EngineDead, match="3 engine steps failed in a row"):
    eng.step()
  other = Engine(m, CONFIG)
  inject(other, lost=True)
  other.runner.reset_cache = lambda: (_ for _ in ()).throw(MemoryError("no device memory"))
  other.add("y", [1, 2, 3], GREEDY)
  with pytest.raises(EngineDead, match="cannot rebuild its cache.*no device memory"):
    other.step()
