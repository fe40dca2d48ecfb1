"""The serving engine against the model's full forward, in float64.

Every token the engine serves must be what the full-sequence forward computes for that request
alone: greedy tokens equal, logprobs to 1e-12 (the two differ only in summation order: chunked
vs whole KDA, paged vs contiguous attention). The same holds whatever runs beside a request
and whenever it arrives (batch invariance), with and without prefix-cache hits, through
preemption and aborts.
"""

import dataclasses
import os

import jax
import numpy as np
import pytest
from flax import nnx

from convert.hf_load import load_model
from k3jax.engine import runner
from k3jax.engine.blocks import chain_digest
from k3jax.engine.config import EngineConfig
from k3jax.engine.engine import Engine
from k3jax.engine.request import SamplingParams
from k3jax.model import lora
from tests.k3jax.engine.helpers import CONFIG, drain, drawn_from, model, prompts, truth
from tests.k3jax.model.helpers import F64

TOL = 1e-12
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, logprobs=2)


@pytest.fixture(scope="module")
def m():
  return model()


@pytest.fixture(autouse=True)
def _x64():
  with jax.enable_x64(True):
    yield


def check_against_truth(m, prompt, result, params=GREEDY):
  lp = truth(m, prompt + result.tokens)
  n = len(prompt)
  for j, tok in enumerate(result.tokens):
    row = lp[n - 1 + j]
    if params.logprobs_mode == "processed" and params.temperature > 0:
      row = drawn_from(row, params)
    if params.temperature == 0:
      assert tok == int(np.argmax(row))
    assert np.isfinite(row[tok])  # the token is one the filters keep
    if params.logprobs is not None:
      assert abs(result.logprobs[j] - row[tok]) <= TOL
      best = [b for b in np.argsort(-row, kind="stable")[:params.logprobs] if np.isfinite(row[b])]
      assert sorted(result.top[j]) == sorted(int(b) for b in best)
      np.testing.assert_allclose([result.top[j][int(b)] for b in best], row[best], rtol=0,
                                 atol=TOL)


@pytest.mark.parametrize("config", [CONFIG, dataclasses.replace(CONFIG, data_shards=2)],
                         ids=["one-pool", "shards"])
def test_greedy_tokens_and_logprobs_equal_the_full_forward(m, config):
  ps = prompts(0, (1, 7, 16, 17, 40))
  eng = Engine(m, config)
  arrivals = {0: [("a", ps[0], GREEDY), ("b", ps[1], GREEDY)],
              2: [("c", ps[2], GREEDY), ("d", ps[3], GREEDY)],
              3: [("e", ps[4], SamplingParams(max_tokens=3, temperature=0.0, logprobs=2,
                                              prompt_logprobs=True))]}
  out = drain(eng, arrivals)
  for rid, p in zip("abcde", ps):
    assert out[rid].finish == "length"
    check_against_truth(m, p, out[rid])
  lp = truth(m, ps[4])
  got = out["e"].prompt_logprobs
  assert got[0] is None and len(got) == len(ps[4])
  np.testing.assert_allclose([g[0] for g in got[1:]], [lp[j - 1, ps[4][j]] for j in
                                                       range(1, len(ps[4]))], rtol=0, atol=TOL)
  assert eng.stats()["pages_used"] == eng.stats()["cached_blocks"]  # only cached blocks stay


def test_processed_logprobs_are_the_sampling_distribution(m):
  """logprobs_mode "processed": the drawn tokens' logprobs and alternatives under the
  distribution they are drawn from, softmax(logits / T) (RL's behaviour policy); the same
  request in "raw" mode draws the same tokens and reports the model's own log_softmax."""
  p = prompts(12, (9,))[0]
  processed = SamplingParams(max_tokens=6, temperature=0.7, seed=5, logprobs=2,
                             logprobs_mode="processed")
  raw = dataclasses.replace(processed, logprobs_mode="raw")
  out = drain(Engine(m, CONFIG), {0: [("t", p, processed), ("p", p, raw)]})
  assert out["t"].tokens == out["p"].tokens
  check_against_truth(m, p, out["t"], processed)
  check_against_truth(m, p, out["p"], raw)
  assert max(abs(a - b) for a, b in zip(out["t"].logprobs, out["p"].logprobs)) > 1e-3


@pytest.mark.parametrize("filters", [{"top_k": 3}, {"top_p": 0.5}, {"min_p": 0.5},
                                     {"top_k": 4, "top_p": 0.8, "min_p": 0.05}],
                         ids=["top_k", "top_p", "min_p", "all"])
def test_processed_logprobs_are_those_of_the_filtered_distribution(m, filters):
  """With top-k / top-p / min-p, "processed" logprobs are those of the renormalised kept set
  (float64 against the full forward, 1e-12), every drawn token is one the filters keep, and
  the alternatives are the kept tokens alone; decode blocks report the same."""
  p = prompts(13, (11,))[0]
  params = SamplingParams(max_tokens=8, temperature=1.3, seed=9, logprobs=4,
                          logprobs_mode="processed", **filters)
  for config in (CONFIG, dataclasses.replace(CONFIG, decode_steps=4)):
    out = drain(Engine(m, config), {0: [("f", p, params)]})
    check_against_truth(m, p, out["f"], params)
  lp = truth(m, p + out["f"].tokens)[len(p) - 1:-1]
  kept = [int(np.isfinite(drawn_from(row, params)).sum()) for row in lp]
  assert min(kept) < m.cfg.vocab_size  # the filters removed tokens


def test_max_tokens_zero_scores_the_prompt_only(m):
  p = prompts(1, (21,))[0]
  eng = Engine(m, CONFIG)
  out = drain(eng, {0: [("x", p, SamplingParams(max_tokens=0, prompt_logprobs=True,
                                                logprobs=1))]})
  assert out["x"].tokens == [] and out["x"].finish == "length"
  lp = truth(m, p)
  np.testing.assert_allclose([g[0] for g in out["x"].prompt_logprobs[1:]],
                             [lp[j - 1, p[j]] for j in range(1, len(p))], rtol=0, atol=TOL)


def test_prefix_cache_hits_serve_the_same_logits(m):
  """Hits at a block boundary (8), one token before and after it, a prompt equal to a cached
  one in full, two requests with a common prefix in one step, and a hit on blocks that were
  evicted and computed again: each equal to the same request on an engine without the cache."""
  base = prompts(2, (40,))[0]
  cached = Engine(m, CONFIG)
  plain = Engine(m, EngineConfig(**{**CONFIG.__dict__, "prefix_cache": False}))
  drain(cached, {0: [("base", base, GREEDY)]})
  cases = {"at16": base[:16] + [1, 2, 3], "at15": base[:15] + [4], "at17": base[:17] + [5],
           "full": base, "at33": base[:33]}
  for rid, p in cases.items():
    got = drain(cached, {0: [(rid, p, GREEDY)]})[rid]
    want = drain(plain, {0: [(rid, p, GREEDY)]})[rid]
    assert got.tokens == want.tokens, rid
    np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=0, atol=TOL, err_msg=rid)
  assert cached.stats()["prefix_hit_rate"] > 0.3
  # two requests sharing a prefix, added in the same step
  pair = [base[:24] + [7, 8], base[:24] + [9]]
  got = drain(cached, {0: [("p0", pair[0], GREEDY), ("p1", pair[1], GREEDY)]})
  for rid, p in zip(("p0", "p1"), pair):
    check_against_truth(m, p, got[rid])
  # evict everything (a long stream of other prompts), then hit the rebuilt blocks
  others = prompts(3, (64,) * 6)
  drain(cached, {0: [(f"o{i}", p, GREEDY) for i, p in enumerate(others)]})
  prefix = cached.scheduler.shards[0].prefix
  while prefix.evict_one():  # the traffic evicted the oldest leaves; evict the rest too
    pass
  assert chain_digest(prefix.root, base[:8]) not in prefix.blocks
  again = drain(cached, {0: [("again1", base[:30], GREEDY)]})["again1"]
  check_against_truth(m, base[:30], again)
  hits = prefix.hit_tokens
  rebuilt = drain(cached, {0: [("again2", base[:30] + [11], GREEDY)]})["again2"]
  check_against_truth(m, base[:30] + [11], rebuilt)
  assert prefix.hit_tokens >= hits + 16  # the rebuilt blocks served the second one


@pytest.mark.parametrize("shards", [1, 2])
def test_requests_arriving_together_share_the_prefix_one_computes(m, shards):
  """Three prompts with a common 33-token prefix added in one step: the first computes it,
  the others wait until its blocks (with their KDA snapshots) are cached and restore them;
  every one still gets the tokens and logprobs of the full forward. With two pool shards of
  two slots, the second joins the first's shard (where the blocks are) and hits; the third
  finds that shard full and computes the prefix on the other."""
  shared = prompts(12, (33,))[0]
  ps = [shared + [1, 2], shared + [3], shared + [4, 5, 6]]
  eng = Engine(m, dataclasses.replace(CONFIG, data_shards=shards, num_pages=24 * shards))
  got = drain(eng, {0: [(str(i), p, GREEDY) for i, p in enumerate(ps)]})
  for i, p in enumerate(ps):
    check_against_truth(m, p, got[str(i)])
  # the later ones restored the 32 cached positions (the snapshot at the last full block)
  assert eng.scheduler.hit_tokens == (2 if shards == 1 else 1) * 32
  blocks = [len(sh.prefix.blocks) for sh in eng.scheduler.shards]
  assert all(n == 4 for n in blocks), blocks  # each shard cached the prefix's 4 full blocks


# decode blocks (several decode steps per call), narrower prefill rows and up to two prompts
# per step (one or two rows compiled) must not change a token or a logprob: the same
# requests, served one token per step and one prompt per step, are the reference
BLOCKS = dataclasses.replace(CONFIG, decode_steps=4, prefill_widths=2, prefill_rows=2)
# the pools in two shards on one device: rows laid out shard by shard, ids local to a shard
# (a shorter max_model_len: a shard of 2 slots must hold one longest request only)
SHARDED = dataclasses.replace(BLOCKS, data_shards=2, max_model_len=56, num_pages=14)


@pytest.mark.parametrize("config", [CONFIG, BLOCKS, SHARDED], ids=["one-step", "blocks",
                                                                    "shards"])
def test_batch_invariance_arrivals_aborts_preemption(m, config):
  """Each request served among others (staggered arrivals, an abort, a pool so small that
  requests are preempted) gets the tokens and logprobs it gets alone, one token per step.
  Sampled requests too: a request's draws depend on its seed and positions only."""
  ps = prompts(4, (9, 30, 18, 45, 5))
  params = [GREEDY, SamplingParams(max_tokens=12, temperature=0.9, top_k=20, seed=7,
                                   logprobs=1),
            SamplingParams(max_tokens=10, temperature=1.3, top_p=0.8, min_p=0.05, seed=3,
                           logprobs=0),
            GREEDY, SamplingParams(max_tokens=20, temperature=0.7, seed=11, logprobs=0)]
  alone = {}
  for i, (p, sp) in enumerate(zip(ps, params)):
    alone[str(i)] = drain(Engine(m, CONFIG), {0: [(str(i), p, sp)]})[str(i)]
  # max_model_len positions for all (per shard): requests are preempted
  tight = dataclasses.replace(config, num_pages=config.pages_per_seq * config.data_shards)
  eng = Engine(m, tight)
  arrivals = {0: [("0", ps[0], params[0]), ("1", ps[1], params[1])],
              1: [("2", ps[2], params[2]), ("x", ps[3], GREEDY)],
              3: [("3", ps[3], params[3])], 5: [("4", ps[4], params[4])]}
  together = drain(eng, arrivals, aborts={4: ["x"]})
  assert together["x"].finish == "abort"
  assert eng.scheduler.preemptions > 0
  assert all(sh.prefix.queried_tokens > 0 for sh in eng.scheduler.shards)  # each shard served
  for rid in alone:
    assert together[rid].tokens == alone[rid].tokens, rid
    np.testing.assert_allclose(together[rid].logprobs, alone[rid].logprobs, rtol=0, atol=TOL)
    for mine, theirs in zip(together[rid].top, alone[rid].top, strict=True):
      assert mine.keys() == theirs.keys() and all(abs(mine[t] - theirs[t]) <= TOL for t in mine)
  if config.decode_steps > 1:  # blocks ran: fewer calls than tokens after the prompts
    assert eng.steps < sum(len(r.tokens) for r in together.values())
    assert eng.block_calls > 0
  for rid, p in zip("03", (ps[0], ps[3])):
    check_against_truth(m, p, together[rid])


def test_one_token_left_from_a_snapshot_or_zeros_is_read_as_a_prefill_row(m):
  """Decode rows only continue their slots (the engine's decode parts index no snapshot): a
  request with one token left that starts from a prefix-cache snapshot (a prompt cached up
  to its last token) or from zeros (a one-token prompt) is read in a prefill row, then decodes
  in blocks. Tokens and logprobs are the full forward's; served one token per step they are
  the same."""
  base = prompts(2, (40,))[0]
  cases = {"at33": base[:33], "one": [5]}
  results = {}
  for config in (BLOCKS, CONFIG):
    eng = Engine(m, config)
    drain(eng, {0: [("base", base, GREEDY)]})
    calls, hits = eng.block_calls, eng.scheduler.hit_tokens
    for rid, p in cases.items():
      eng.add(rid, p, GREEDY)
    seen = []  # what the next step runs
    eng.scheduler.schedule = lambda f=eng.scheduler.schedule, seen=seen: (
        seen.append(f()) or seen[-1])
    first = eng.step()
    decode, prefill = seen[0]
    # the oldest prefill_rows of them (both with BLOCKS, at33 alone with CONFIG's one row)
    assert not decode
    assert [c.request.id for c in prefill] == ["at33", "one"][:config.prefill_rows]
    assert all(c.end - c.start == 1 for c in prefill)
    assert eng.scheduler.hit_tokens == hits + 32  # at33 restored the snapshot at 32
    got = drain(eng)
    for o in first:  # the first step's tokens before the rest
      r = got[o.request_id]
      r.tokens, r.logprobs, r.top = (o.token_ids + r.tokens, o.logprobs + r.logprobs,
                                     o.top_logprobs + r.top)
    results[config.decode_steps] = got
    if config is BLOCKS:
      assert eng.block_calls > calls  # the rest ran in decode blocks
    for rid, p in cases.items():
      assert len(got[rid].tokens) == GREEDY.max_tokens
      check_against_truth(m, p, got[rid])
  for rid in cases:
    assert results[4][rid].tokens == results[1][rid].tokens
    np.testing.assert_allclose(results[4][rid].logprobs, results[1][rid].logprobs, rtol=0,
                               atol=TOL)


def test_stacked_layout_equals_unstacked(m):
  ps = prompts(5, (12, 25))
  out = {}
  for layout in ("stacked", "unstacked"):
    eng = Engine(m, EngineConfig(**{**CONFIG.__dict__, "layout": layout}))
    out[layout] = drain(eng, {0: [("a", ps[0], GREEDY), ("b", ps[1], GREEDY)]})
  for rid in "ab":
    assert out["stacked"][rid].tokens == out["unstacked"][rid].tokens
    np.testing.assert_allclose(out["stacked"][rid].logprobs, out["unstacked"][rid].logprobs,
                               rtol=0, atol=TOL)


@pytest.mark.parametrize("config", [CONFIG, BLOCKS], ids=["one-step", "blocks"])
def test_stop_tokens_and_strings(m, config):
  """A stop token or string ends a request where it appears, also inside a decode block
  (the block's later tokens are dropped)."""
  p = prompts(6, (10,))[0]
  text = lambda ids: "".join(chr(97 + t % 26) for t in ids)
  first = drain(Engine(m, CONFIG, detokenize=text), {0: [("a", p, GREEDY)]})["a"]
  # the first token not produced before it ends the request as EOS
  j = next(j for j in range(1, 5) if first.tokens[j] not in first.tokens[:j])
  stop = text(first.tokens[1:3])
  k = next(k for k in range(1, 6) if stop in text(first.tokens[:k]))  # completes the string
  eng = Engine(m, config, detokenize=text, eos_token_ids=[first.tokens[j]])
  out = drain(eng, {0: [("eos", p, GREEDY),
                        ("ign", p, SamplingParams(max_tokens=5, temperature=0.0,
                                                  ignore_eos=True)),
                        ("str", p, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True,
                                                  stop=[stop]))]})
  assert out["eos"].tokens == first.tokens[:j + 1] and out["eos"].finish == "stop"
  assert out["ign"].tokens == first.tokens and out["ign"].finish == "length"
  assert out["str"].finish == "stop" and out["str"].tokens == first.tokens[:k]
  full = text(first.tokens[:k])
  assert out["str"].text == full[:full.find(stop)]


def test_set_params_serves_the_new_weights_and_empties_the_prefix_cache(m):
  p = prompts(7, (30,))[0]
  eng = Engine(m, CONFIG)
  drain(eng, {0: [("a", p, GREEDY)]})
  assert eng.stats()["cached_blocks"] > 0
  other = model(seed=2)
  from flax import nnx
  eng.set_params(nnx.state(other))
  assert eng.stats()["cached_blocks"] == 0 and eng.stats()["pages_used"] == 0
  check_against_truth(other, p, drain(eng, {0: [("b", p, GREEDY)]})["b"])


def test_bad_requests_are_refused_alone(m):
  eng = Engine(m, CONFIG)
  eng.add("ok", prompts(8, (6,))[0], GREEDY)
  bad = [("ok", [1], GREEDY, "already in use"), ("e", [], GREEDY, "empty"),
         ("long", [1] * 97, GREEDY, "maximum model length"),
         ("vocab", [64], GREEDY, "outside the vocabulary"),
         ("t", [1], SamplingParams(temperature=-1.0), "temperature"),
         ("p", [1], SamplingParams(top_p=0.0), "top_p"),
         ("k", [1], SamplingParams(top_k=-3), "top_k"),
         ("mp", [1], SamplingParams(min_p=2.0), "min_p"),
         ("n", [1], SamplingParams(max_tokens=-1), "max_tokens"),
         ("lp", [1], SamplingParams(logprobs=99), "logprobs"),
         ("s", [1], SamplingParams(stop=["x"]), "detokenizer")]
  for rid, prompt, params, message in bad:
    with pytest.raises(ValueError, match=message):
      eng.add(rid, prompt, params)
  eng.abort("nobody")
  out = drain(eng)
  assert list(out) == ["ok"] and out["ok"].finish == "length"


@pytest.mark.parametrize("shards", [1, 2])
def test_no_page_or_slot_leaks_after_random_traffic(m, shards):
  rng = np.random.default_rng(9)
  eng = Engine(m, dataclasses.replace(CONFIG, num_pages=16 * shards, data_shards=shards))
  live, n = set(), 0
  for _ in range(1000):
    action = rng.integers(3)
    if action == 0 or not live:
      rid = f"r{n}"
      n += 1
      eng.add(rid, [int(t) for t in rng.integers(0, 64, rng.integers(1, 30))],
              SamplingParams(max_tokens=int(rng.integers(0, 6)), temperature=0.0))
      live.add(rid)
    elif action == 1:
      eng.abort(str(rng.choice(sorted(live))))
    for o in eng.step():
      if o.finished:
        live.discard(o.request_id)
  drain(eng)
  s = eng.scheduler
  assert not s.running and not s.waiting
  assert sorted(s.free_slots) == list(range(CONFIG.max_num_seqs))
  for sh in s.shards:  # every shard served requests, and holds only cached blocks now
    assert sh.prefix.queried_tokens > 0
    assert sh.pages.used == len(sh.prefix.blocks)
    assert all(b.refs == 0 for b in sh.prefix.blocks.values())
    sh.prefix.clear()
    assert sh.pages.used == 0


@pytest.mark.parametrize("config", [CONFIG, BLOCKS], ids=["one-step", "blocks"])
def test_compiled_programs_are_bounded(m, config):
  """Prompts of 20 different lengths: the step compiles for the decode-only shape and the
  mixed shape of each prefill width and prefill row bucket (and the context buckets), the
  decode block once; not per length, per number of prompts read or per block length."""
  before = runner._step._cache_size(), runner._decode_block._cache_size()
  eng = Engine(m, config)
  ps = prompts(10, range(3, 60, 3))
  drain(eng, {i: [(str(i), p, SamplingParams(max_tokens=2 + i % 5, temperature=0.0))]
              for i, p in enumerate(ps)})
  mixed = config.prefill_widths * len(config.prefill_row_counts)
  assert runner._step._cache_size() - before[0] <= 1 + mixed
  assert runner._decode_block._cache_size() - before[1] <= (config.decode_steps > 1)


def test_packed_mxfp4_experts_serve_the_dequantised_model(reference_dir):
  """k3_tiny_a as released (MXFP4 routed experts) served with its experts kept as codes +
  scales, dequantised a tile at a time inside the grouped matmul: the tokens and logprobs of
  the full forward of the model loaded with its experts dequantised once, in float64."""
  dense, _ = load_model(os.path.join(reference_dir, "k3_tiny_a"), F64)
  packed = lora.adapt(nnx.clone(dense), lora.AdaptSpec(base_experts="mxfp4"), nnx.Rngs(0))
  assert lora.expert_paths(packed)["moe.experts"].operands("w1").packed
  rng = np.random.default_rng(7)
  ps = [[int(t) for t in rng.integers(0, dense.cfg.vocab_size, n)] for n in (5, 19)]
  out = drain(Engine(packed, CONFIG), {0: [("a", ps[0], GREEDY), ("b", ps[1], GREEDY)]})
  for rid, p in zip("ab", ps, strict=True):
    check_against_truth(dense, p, out[rid])


def test_qat_experts_are_served_packed_as_the_trained_forward_rounds_them(reference_dir):
  """k3_tiny_a's MXFP4 experts as a frozen base with per-expert adapters trained under QAT
  (the forward multiplies by round_mxfp4(dequant(W) + scale A B)): the engine holds those
  experts as codes and scales, quantised once per set_params, and serves the full forward of
  the merged model (what `k3jax export --merge-lora` writes), float64, 1e-12; after a
  set_params with other adapters too."""
  dense, _ = load_model(os.path.join(reference_dir, "k3_tiny_a"), F64)
  spec = lora.AdaptSpec(rank=2, targets=("moe.experts.*",), base_experts="mxfp4", qat=True)

  def policy(seed):
    adapted = lora.adapt(nnx.clone(dense), spec, nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    for ex in lora.expert_paths(adapted).values():
      for w in lora.EXPERT_WEIGHTS:
        b = getattr(ex, f"{w}_lora_b")
        b.set_value(jax.numpy.asarray(0.3 * rng.standard_normal(b.shape)))
    return adapted

  first, second = policy(1), policy(2)
  eng = Engine(first, CONFIG)
  served = nnx.merge(eng.runner.graphdef, eng.runner._serving(nnx.state(first)))
  for ex in lora.expert_paths(served).values():  # codes and scales, no QAT, no adapters
    assert not ex.qat and ex.operands("w1").packed and not hasattr(ex, "w1_lora_a")
  rng = np.random.default_rng(8)
  p = [int(t) for t in rng.integers(0, dense.cfg.vocab_size, 12)]
  sampled = SamplingParams(max_tokens=5, temperature=0.9, seed=2, logprobs=2,
                           logprobs_mode="processed")
  for adapted in (first, second):
    if adapted is second:
      eng.set_params(nnx.state(second))
    out = drain(eng, {0: [("g", p, GREEDY), ("s", p, sampled)]})
    merged = lora.merge(adapted)
    assert np.any(np.asarray(lora.merge(adapted).moe.experts.w1[...])
                  != np.asarray(dense.moe.experts.w1[...]))  # the adapters moved the experts
    check_against_truth(merged, p, out["g"])
    check_against_truth(merged, p, out["s"], sampled)
