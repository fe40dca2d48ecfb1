"""The trajectory driver on the engine, with environments in real worker processes, on a float64
model over a small BPE vocabulary with the K2-shaped chat template and tool-call tokens
(tests/k3jax/tokenizer/release.py). Against independent references:

  * token in, token out: a trajectory is the encoding of the whole conversation's render when
    the turns are what the template writes (host only, scripted turns);
  * multi-turn on the engine: every sampled token's logprob is the full forward's on the final
    sequence (float64, 1e-12), each turn runs only its new tokens through the model (the whole
    trajectory is computed once: len(ids) - 1 tokens, less what the prefix cache restored),
    observations are not sampled;
  * partial rollouts: a budget pauses trajectories; resumed with no weight change they are
    the uninterrupted ones (1e-12); after new weights, `recompute` continues as a fresh engine
    on the new weights reads them (the full forward), and every token keeps the version that
    drew it;
  * packing: the trainer's logprobs of packed trajectories are the engine's (1e-12).
"""

import dataclasses
import textwrap

import jax
import numpy as np
import pytest
from flax import nnx

from k3jax.engine import Engine, EngineConfig
from k3jax.model.transformer import K3Model
from k3jax.rl import batch as batch_lib
from k3jax.rl.data import Prompt
from k3jax.rl.driver import Driver, DriverConfig, Trajectory
from k3jax.rl.env import EnvPool, env_spec
from k3jax.rl.objectives import LossAgg
from k3jax.rl.render import Renderer
from k3jax.rl.step import logprob_fn
from k3jax.tokenizer import load_tokenizer
from k3jax.train import step as step_lib
from tests.k3jax.engine.helpers import EX, log_softmax, truth
from tests.k3jax.model.helpers import randomize, tiny_cfg
from tests.k3jax.tokenizer import release

TOL = 1e-12
TEMPERATURE = 0.9
ENV = """
class Chat:
  def __init__(self, turns=3):
    self.turns, self.seen = turns, 0

  def reset(self, row):
    return [{"role": "user", "content": row["q"]}]

  def step(self, action):
    self.seen += 1
    if self.seen >= self.turns:
      return [], 1.0, True, {}
    return [{"role": "user", "content": f"go on ({self.seen})"}], 0.25, False, {}
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  """(tokenizer, float64 model whose <|im_end|> is likely, its stop id, env file)."""
  root = tmp_path_factory.mktemp("driver")
  added = release.build(str(root / "tok"))
  tok = load_tokenizer("auto", str(root / "tok"))
  stop = added["<|im_end|>"]
  with jax.enable_x64(True):
    cfg = tiny_cfg(vocab_size=tok.vocab_size, num_layers=2, mla_layers=(1,))
    m = randomize(K3Model(cfg, EX, rngs=nnx.Rngs(0)), seed=3)
    ids = np.random.default_rng(0).integers(0, tok.vocab_size, (4, 32))
    f = np.asarray(m(jax.numpy.asarray(ids)).features, np.float64).reshape(-1, cfg.hidden_size)
    mean = f.mean(0)
    head = np.array(m.lm_head[...])
    head[:, stop] = 1.5 * mean / (mean @ mean)  # the stop token likely enough: turns end
    m.lm_head.set_value(jax.numpy.asarray(head))
  (root / "chat_env.py").write_text(textwrap.dedent(ENV))
  return tok, m, stop, str(root / "chat_env.py")


@pytest.fixture(autouse=True)
def _x64():
  with jax.enable_x64(True):
    yield


CONFIG = EngineConfig(max_num_seqs=4, max_model_len=160, page_size=8, prefill_chunk=16,
                      prefix_state_every=2, max_top_logprobs=1, decode_steps=4)


def trajectories(n: int, rows) -> list[Trajectory]:
  return [Trajectory(f"t{i}", Prompt(i, (), "", rows[i]), i, 0, seed=100 + i, slot=i)
          for i in range(n)]


def check_logprobs(m, t: Trajectory) -> None:
  """Every sampled token's logprob is the full forward's (softmax(logits / T))."""
  lp = log_softmax(truth(m, t.ids) / TEMPERATURE)
  at = [i for i, s in enumerate(t.sampled) if s]
  np.testing.assert_allclose([t.logprobs[i] for i in at], [lp[i - 1, t.ids[i]] for i in at],
                             rtol=0, atol=TOL)


def test_a_trajectory_is_the_encoding_of_its_conversation(setup):
  """Scripted turns written as the template writes answers: the ids built turn by turn equal
  the encoding of the whole conversation's render (up to the last end-of-turn token), and the
  sampled ids are exactly the answers' tokens."""
  tok, _, stop, _ = setup
  r = Renderer(tok)
  messages = [{"role": "user", "content": "What is 12 + 30?"}]
  tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
  prompt, ids = r.start(messages, tools)
  answers = [({"role": "assistant", "content": "", "tool_calls": [
      {"id": "functions.add:0", "type": "function",
       "function": {"name": "add", "arguments": '{"a": 12, "b": 30}'}}]},
      [{"role": "tool", "tool_call_id": "functions.add:0", "content": "42"}]),
      ({"role": "assistant", "content": "It is 42."}, [{"role": "user", "content": "Thanks"}]),
      ({"role": "assistant", "content": "You are welcome."}, None)]
  sampled = []
  for assistant, obs in answers:
    written = r.render(messages + [assistant], tools, gen=False)[len(prompt):]
    turn = r.encode(written[:written.rfind("<|im_end|>") + len("<|im_end|>")])
    assert turn[-1] == stop
    ids += turn
    sampled += turn
    if obs is None:
      messages.append(assistant)
      break
    prompt, more = r.observation(prompt, messages, tools, assistant, obs, "<|im_end|>")
    messages += [assistant, *obs]
    ids += more
  whole = r.render(messages, tools, gen=False)
  whole = whole[:whole.rfind("<|im_end|>") + len("<|im_end|>")]
  assert tok.decode(ids) == whole and ids == r.encode(whole)


def test_a_template_that_rewrites_earlier_turns_is_refused(setup):
  from k3jax.errors import UserError
  tok, _, _, _ = setup
  r = Renderer(tok)
  messages = [{"role": "user", "content": "hi"}]
  prompt, _ = r.start(messages, None)
  thinking = {"role": "assistant", "content": "ok", "reasoning_content": "let me think"}
  # the template shows reasoning only after the last user turn: a new user turn drops it
  with pytest.raises(UserError, match="rewrites them"):
    r.observation(prompt, messages, None, thinking, [{"role": "user", "content": "more"}],
                  "<|im_end|>")


def run_driver(m, tok, stop, env_file, rows, budget=None, engine=None, trajs=None,
               version=0, recompute=False):
  pool = EnvPool(env_spec(env_file + ":Chat", ("turns=3",)), len(rows), 30.0)
  try:
    engine = engine or Engine(m, CONFIG)
    driver = Driver(engine, DriverConfig(max_new_tokens=12, temperature=TEMPERATURE,
                                         stop_ids=(stop,), max_turns=5), tok, pool)
    if trajs is None:
      trajs = trajectories(len(rows), rows)
      driver.start(trajs)
    left = driver.run(trajs, version, budget, recompute)
    return engine, trajs, left, pool
  finally:
    if budget is None:
      pool.close()


def test_multi_turn_trajectories_on_the_engine(setup):
  tok, m, stop, env_file = setup
  rows = [{"q": "first question"}, {"q": "a second, longer question here"}]
  engine, trajs, left, _ = run_driver(m, tok, stop, env_file, rows)
  assert not left
  # each id computed once (or restored from the prefix cache: the rows share the system turn)
  hits = engine.scheduler.hit_tokens
  assert engine.computed_tokens + hits == sum(len(t.ids) - 1 for t in trajs)
  assert any(t.turns > 1 for t in trajs)
  for t in trajs:
    check_logprobs(m, t)
    assert t.finish in ("stop", "length")
    if t.finish == "stop":
      assert t.turns == 3 and t.env_reward == 1.5  # 0.25 + 0.25 + 1.0
    # observations are not sampled, and each turn's observation is the template's
    assert tok.decode([i for i, s in zip(t.ids, t.sampled) if not s]).count("go on") == \
        t.turns - 1
  assert engine.stats()["paused"] == 0 and engine.num_running == 0


def test_partial_rollouts_pause_and_continue(setup):
  tok, m, stop, env_file = setup
  rows = [{"q": "first question"}, {"q": "a second, longer question here"}]
  _, whole, _, _ = run_driver(m, tok, stop, env_file, rows)
  engine, trajs, left, pool = run_driver(m, tok, stop, env_file, rows, budget=10)
  try:
    assert left and all(not t.done for t in left)
    assert engine.stats()["paused"] == len(left)
    driver = Driver(engine, DriverConfig(max_new_tokens=12, temperature=TEMPERATURE,
                                         stop_ids=(stop,), max_turns=5), tok, pool)
    assert not driver.run(trajs, 1)
  finally:
    pool.close()
  for t, w in zip(trajs, whole):
    assert t.ids == w.ids
    np.testing.assert_allclose(t.logprobs, w.logprobs, rtol=0, atol=TOL)
    assert set(t.versions) - {-1} <= {0, 1} and max(t.versions) >= 0


def test_a_paused_trajectory_recomputed_under_new_weights(setup):
  tok, m, stop, env_file = setup
  other = randomize(nnx.clone(m), seed=9)
  other.lm_head.set_value(m.lm_head[...])  # the same likely stop token
  rows = [{"q": "first question"}]
  engine, trajs, left, pool = run_driver(m, tok, stop, env_file, rows, budget=5)
  try:
    (t,) = left
    before = len(t.ids)
    engine.set_params(nnx.state(other))
    driver = Driver(engine, DriverConfig(max_new_tokens=12, temperature=TEMPERATURE,
                                         stop_ids=(stop,), max_turns=5), tok, pool)
    assert not driver.run(trajs, 1, recompute=True)
  finally:
    pool.close()
  lp = log_softmax(truth(other, t.ids) / TEMPERATURE)
  later = [i for i in range(before, len(t.ids)) if t.sampled[i]]
  assert later and all(t.versions[i] == 1 for i in later)
  assert all(t.versions[i] == 0 for i in range(before) if t.sampled[i])
  np.testing.assert_allclose([t.logprobs[i] for i in later], [lp[i - 1, t.ids[i]] for i in later],
                             rtol=0, atol=TOL)


def test_packed_trajectories_score_as_the_engine_drew_them(setup):
  """The trainer's logprobs of trajectories packed several to a row (segment ids) are the
  behaviour logprobs the engine recorded: packing changes nothing a trajectory computes."""
  tok, m, stop, env_file = setup
  rows = [{"q": "q one"}, {"q": "q two is longer"}, {"q": "three"}]
  _, trajs, _, _ = run_driver(m, tok, stop, env_file, rows)
  seq_len = 8 * -(-max(len(t.ids) for t in trajs) // 8) * 2
  b = batch_lib.build(trajs, [True] * 3, [[1.0] * len(t.ids) for t in trajs], seq_len, 1, 4,
                      LossAgg.TOKEN_MEAN, 12, np.float64)
  assert b.rows < len(trajs)  # at least two shared a row
  sc = step_lib.StepConfig(learning_rate=1e-3, warmup_steps=0, decay_steps=10,
                           end_lr_ratio=1.0, weight_decay=0.0, qb=False)
  from k3jax.rl.objectives import ObjectiveConfig
  from k3jax.rl.step import PolicyGradient
  steps = step_lib.build(m.cfg, EX, sc, None, None, PolicyGradient(ObjectiveConfig(),
                                                                   TEMPERATURE))
  _, params, bias = step_lib.split_model(m)
  dev = {k: v[None] for k, v in b.arrays.items()}
  got = np.asarray(logprob_fn(steps, TEMPERATURE, adapters_off=False)(params, bias, dev))[0]
  mask = b.rollout_mask
  assert mask.sum() == sum(t.generated for t in trajs)
  np.testing.assert_allclose(got[mask], b.arrays["old_logp"][mask], rtol=0, atol=TOL)
  assert np.isclose(b.arrays["weights"].sum(), 1.0)  # token-mean over the trained tokens
  assert dataclasses.is_dataclass(b)
