"""Speculative decoding: greedy output is decoding without drafts token for token (float64,
logprobs to 1e-12) whatever proposes the drafts (prompt lookup, another model, the target
itself), with preemption, prefix-cache hits and requests beside each other; sampled output
draws what decoding without drafts draws (each position's draw with its own key, checked
against the target's distribution with a bound from the sample count), and what a sampled
request reports is the full forward's on the tokens it emitted, which only holds if the KDA
state rolled back exactly to the kept tokens.
"""

import dataclasses
import statistics

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.engine.drafts import ModelDrafter, NgramDrafter, NgramIndex
from k3jax.engine.engine import Engine
from k3jax.engine.request import SamplingParams
from k3jax.engine.speculative import DraftRunner
from k3jax.generate.sampling import verify_drafts
from tests.k3jax.engine.helpers import CONFIG, drain, drawn_from, model, truth

TOL = 1e-12
K = 3
SPEC = dataclasses.replace(CONFIG, num_draft_tokens=K)
GREEDY = SamplingParams(max_tokens=14, temperature=0.0, logprobs=2)


@pytest.fixture(scope="module")
def m():
  return model()


@pytest.fixture(scope="module")
def draft():
  return model(seed=3)


@pytest.fixture(scope="module")
def near(m):
  """The target with every weight moved by 5% of itself at random: a draft that agrees with
  the target's draws most of the time, not always (drafts kept and rejected)."""
  with jax.enable_x64(True):
    graph, state = nnx.split(m)
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(11), len(leaves))
    moved = [x * (1 + 0.05 * jax.random.normal(k, x.shape, x.dtype))
             if jnp.issubdtype(x.dtype, jnp.floating) else x for x, k in zip(leaves, keys)]
    return nnx.merge(graph, jax.tree.unflatten(tree, moved))


@pytest.fixture(autouse=True)
def _x64():
  with jax.enable_x64(True):
    yield


def repetitive(seed: int, n: int, period: int = 5) -> list[int]:
  rng = np.random.default_rng(seed)
  base = [int(t) for t in rng.integers(0, 64, period)]
  return (base * (n // period + 1))[:n]


def same(a, b) -> None:
  assert a.tokens == b.tokens
  np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=TOL)
  for x, y in zip(a.top, b.top, strict=True):
    assert x.keys() == y.keys() and all(abs(x[t] - y[t]) <= TOL for t in x)


def drafters(m, draft, config):
  return {"ngram": NgramDrafter(K), "model": ModelDrafter(DraftRunner(draft, config), K),
          "self": ModelDrafter(DraftRunner(m, config), K)}


def test_greedy_speculation_is_decoding_without_drafts(m, draft):
  """Five requests (repetitive and random prompts, staggered, two sharing a prefix, a pool
  that forces preemption) served with each drafter: the tokens and logprobs of the engine
  without drafts. The target as its own draft keeps every draft."""
  ps = [repetitive(1, 23), repetitive(2, 9), repetitive(1, 23)[:17] + [5, 6],
        [int(t) for t in np.random.default_rng(4).integers(0, 64, 30)], repetitive(5, 40)]
  arrivals = {0: [("0", ps[0], GREEDY), ("1", ps[1], GREEDY)],
              2: [("2", ps[2], GREEDY), ("3", ps[3], GREEDY)], 4: [("4", ps[4], GREEDY)]}
  plain = drain(Engine(m, CONFIG), arrivals)
  tight = dataclasses.replace(SPEC, num_pages=SPEC.pages_per_seq)
  for name, drafter in drafters(m, draft, tight).items():
    eng = Engine(m, tight, drafter=drafter)
    got = drain(eng, arrivals)
    for rid in plain:
      same(got[rid], plain[rid])
    stats = eng.stats()
    assert stats["spec_drafted_tokens"] > 0 and eng.scheduler.hit_tokens > 0, name
    assert eng.scheduler.preemptions > 0, name
    if name == "self":
      assert stats["mean_accepted_length"] > K  # every draft kept (bar max_tokens' cuts)
    s = eng.scheduler
    assert not s.running and sorted(s.free_slots) == list(range(tight.max_num_seqs))
    assert s.pages_used == len(s.cached_blocks)  # the drafts' pages were given back


def test_sampled_speculation_reports_the_full_forward_of_what_it_emits(m, near):
  """Sampled requests (with filters, "processed" logprobs) verified against a draft model and
  prompt lookup: every reported logprob is the full forward's, on the tokens emitted so far,
  of the distribution the token is drawn from (a wrong KDA rollback shifts every later one);
  and the tokens are those the engine without drafts draws with the same seeds (each position
  draws with its own key; a draft is kept when it equals that draw), so they do not depend on
  which steps verified drafts or on the requests beside."""
  params = [SamplingParams(max_tokens=12, temperature=0.8, seed=s, logprobs=1, top_k=20,
                           logprobs_mode="processed") for s in (1, 2)]
  ps = [repetitive(7, 20), repetitive(8, 11, period=3)]
  arrivals = {0: [("a", ps[0], params[0]), ("b", ps[1], params[1])]}
  plain = drain(Engine(m, CONFIG), arrivals)
  for name, make in (("model", lambda: ModelDrafter(DraftRunner(near, SPEC), K)),
                     ("ngram", lambda: NgramDrafter(K))):
    eng = Engine(m, SPEC, drafter=make())
    together = drain(eng, arrivals)
    stats = eng.stats()
    assert stats["spec_drafted_tokens"] > 0, name
    if name == "model":  # some drafts kept, some rejected: the rollback ran
      assert 1 < stats["mean_accepted_length"] < K + 1, stats
    for rid, p, sp in (("a", ps[0], params[0]), ("b", ps[1], params[1])):
      r = together[rid]
      lp = truth(m, p + r.tokens)[len(p) - 1:-1]
      want = [drawn_from(row, sp)[t] for row, t in zip(lp, r.tokens)]
      np.testing.assert_allclose(r.logprobs, want, rtol=0, atol=TOL)
      same(r, plain[rid])


def within(counts: np.ndarray, p: np.ndarray, alpha: float = 1e-6) -> bool:
  """Whether empirical `counts` are consistent with probabilities `p`: every cell's frequency
  within z standard errors of its probability, z the two-sided normal quantile of alpha
  spread over the cells (Bonferroni), the standard error sqrt(p (1 - p) / N) of N samples."""
  n = counts.sum()
  z = statistics.NormalDist().inv_cdf(1 - alpha / (2 * len(p)))
  return bool(np.all(np.abs(counts / n - p) <= z * np.sqrt(p * (1 - p) / n) + 1e-12))


def test_verification_draws_what_decoding_without_drafts_draws():
  """verify_drafts on 200,000 rows of a 6-token vocabulary, K = 2, drafts from a q unlike p
  (a draft model's) and deterministic ones (prompt lookup's): every emitted token is the draw
  of its position's key from its logits (what a one-token step draws), so the first follows
  the target's p0 and the one after a kept draft p1 (checked against the sample count's bound;
  q0 fails the same check), and a draft is kept exactly when it equals that draw."""
  rng = np.random.default_rng(0)
  v, n = 6, 200_000
  p = rng.dirichlet(np.ones(v), 3)
  q = rng.dirichlet(np.ones(v) * 0.5, 2)
  keys = jax.random.split(jax.random.key(1), n * 3).reshape(n, 3)
  logits = jnp.log(jnp.broadcast_to(jnp.asarray(p, jnp.float32), (n, 3, v)))
  plain = np.asarray(jax.vmap(jax.vmap(jax.random.categorical))(keys, logits))  # [n, 3]
  for proposal in ("model", "lookup"):
    if proposal == "model":
      drafts = np.stack([rng.choice(v, n, p=q[0]), rng.choice(v, n, p=q[1])], 1)
    else:
      drafts = np.tile([2, 4], (n, 1))
    accepted, tokens = jax.jit(verify_drafts)(
        logits, logits, jnp.asarray(drafts, jnp.int32), jnp.full((n,), 2, jnp.int32),
        jnp.ones((n,), jnp.float32), keys)
    accepted, tokens = np.asarray(accepted), np.asarray(tokens)
    want = (drafts[:, 0] == plain[:, 0]).astype(int) * (1 + (drafts[:, 1] == plain[:, 1]))
    np.testing.assert_array_equal(accepted, want)
    for j in range(3):
      emitted = accepted >= j
      np.testing.assert_array_equal(tokens[emitted, j], plain[emitted, j])
    first = np.bincount(tokens[:, 0], minlength=v)
    assert within(first, p[0]), (proposal, first / n, p[0])
    after = np.bincount(tokens[accepted >= 1, 1], minlength=v)
    assert within(after, p[1]), (proposal, after / after.sum(), p[1])
  assert not within(np.bincount(rng.choice(v, n, p=q[0]), minlength=v), p[0])


def test_prompt_lookup_index():
  idx = NgramIndex(1, 3)
  tokens = [1, 2, 3, 9, 1, 2, 3]
  assert idx.propose(tokens, 2) == [9, 1]       # "1 2 3" was followed by 9
  tokens += [7, 1, 2]
  assert idx.propose(tokens, 3) == [3, 7, 1]    # the latest "1 2": the one before 3 7
  tokens += [8]
  assert idx.propose(tokens, 2) == []           # 8 never came before


def test_bad_speculation_settings_are_refused(m):
  with pytest.raises(ValueError, match="num_draft_tokens"):
    dataclasses.replace(CONFIG, num_draft_tokens=CONFIG.page_size + 1)
  with pytest.raises(ValueError, match="num_draft_tokens must be in \\[1"):
    Engine(m, CONFIG, drafter=NgramDrafter(K))
  with pytest.raises(ValueError, match="data_shards 1"):
    Engine(m, dataclasses.replace(SPEC, data_shards=2), drafter=NgramDrafter(K))
