"""The trajectory driver: rollouts on the engine and the environments (docs/rl.md).

A trajectory is one growing token sequence (render.py says how its tokens are made), with per
token: whether the policy sampled it (trained) or it came from the prompt or an observation
(masked out of the loss), the logprob of the distribution the engine drew it from (the
behaviour policy mu), and the policy version that drew it.

`Driver.run(trajectories, version, budget)` advances trajectories on the engine, each as one
engine request held across its turns (`Engine.add(hold=True)`, `resume(tokens=...)`): each
turn computes only its new tokens. A turn that ends goes to the environment (every turn that
ended in an engine step, in one call: each in its own process); its observation is rendered and
appended, or the trajectory ends (the environment says done, the turn was cut at
`max_new_tokens`, `max_turns` turns were taken, the next observation would pass
`max_trajectory_tokens`, or the environment failed: reward 0, the error kept). Without an
environment a trajectory is one turn (the prompt's ids as given; the verifiers score it).

Partial rollouts: with a `budget`, the run stops once that many tokens were generated; the
trajectories still running are paused in the engine (their state kept) and returned, and a
later `run` (after new weights) resumes them, continuing the state they kept or, with
`recompute`, reading them again under the new weights.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from k3jax.engine import Engine, FinishReason, LogprobsMode, SamplingParams
from k3jax.rl.data import Prompt
from k3jax.rl.env import EnvPool, Reply, action
from k3jax.rl.render import Renderer
from k3jax.tokenizer.tool_calls import THINK_OPEN, parse

OVERLONG, ENV_ERROR = "overlong", "env_error"


@dataclasses.dataclass
class Trajectory:
  key: str                   # the engine request id
  prompt: Prompt             # its data row
  group: int                 # the step's group (prompt slot) and sample within it
  sample: int
  seed: int
  slot: int = 0              # its environment process
  ids: list[int] = dataclasses.field(default_factory=list)
  sampled: list[bool] = dataclasses.field(default_factory=list)  # per id: drawn by the policy
  logprobs: list[float] = dataclasses.field(default_factory=list)  # mu at sampled ids, else 0
  versions: list[int] = dataclasses.field(default_factory=list)  # policy version, else -1
  messages: list[dict] = dataclasses.field(default_factory=list)
  tools: list[dict] | None = None
  rendered: str = ""         # the template's text up to the current generation prompt
  turn: list[int] = dataclasses.field(default_factory=list)  # the current turn's ids so far
  turns: int = 0
  tool_calls: int = 0
  tool_errors: int = 0
  env_reward: float = 0.0
  text: str = ""             # the last turn's text (without its stop token)
  finish: str = ""           # stop | length | overlong | env_error ("" while running)
  error: str | None = None
  started: bool = False      # in the engine (running or paused)

  @property
  def done(self) -> bool:
    return bool(self.finish)

  @property
  def truncated(self) -> bool:
    return self.finish != FinishReason.STOP

  @property
  def prompt_len(self) -> int:
    """Ids before the first sampled one."""
    return next((i for i, s in enumerate(self.sampled) if s), len(self.ids))

  @property
  def generated(self) -> int:
    return sum(self.sampled)

  def add(self, ids: Sequence[int], logprobs: Sequence[float], version: int) -> None:
    self.ids += ids
    self.sampled += [True] * len(ids)
    self.logprobs += list(logprobs)
    self.versions += [version] * len(ids)
    self.turn += ids

  def observe(self, ids: Sequence[int]) -> None:
    self.ids += ids
    self.sampled += [False] * len(ids)
    self.logprobs += [0.0] * len(ids)
    self.versions += [-1] * len(ids)


@dataclasses.dataclass(frozen=True)
class DriverConfig:
  max_new_tokens: int            # per turn
  temperature: float
  stop_ids: tuple[int, ...]
  max_turns: int = 1
  max_trajectory_tokens: int | None = None  # None: the engine's max_model_len


class Driver:
  """Runs trajectories on `engine` with the environments of `envs` (None: one turn each)."""

  def __init__(self, engine: Engine, config: DriverConfig, tokenizer,
               envs: EnvPool | None = None):
    self.engine, self.config, self.envs = engine, config, envs
    self.tok = tokenizer
    self.renderer = Renderer(tokenizer) if envs is not None else None
    self.limit = min(config.max_trajectory_tokens or 10**12, engine.config.max_model_len)

  # ---- starting ------------------------------------------------------------------------------
  def start(self, trajs: Sequence[Trajectory]) -> None:
    """Reset the environments of new trajectories and render their first prompt (ids)."""
    if self.envs is None:
      for t in trajs:
        t.observe(t.prompt.ids)
      return
    replies = self.envs.reset({t.slot: t.prompt.row for t in trajs})
    for t in trajs:
      r = replies[t.slot]
      if r.error is not None:
        self._end(t, ENV_ERROR, r.error)
        continue
      t.messages, t.tools = list(r.observation), r.tools
      t.rendered, ids = self.renderer.start(t.messages, t.tools)
      if len(ids) >= self.limit:
        self._end(t, OVERLONG)
        continue
      t.observe(ids)

  def _params(self, t: Trajectory) -> SamplingParams:
    c = self.config
    return SamplingParams(max_tokens=min(c.max_new_tokens, self.limit - len(t.ids)),
                          temperature=c.temperature, seed=t.seed, logprobs=0,
                          logprobs_mode=LogprobsMode.PROCESSED, stop_token_ids=c.stop_ids,
                          ignore_eos=True)

  # ---- running -------------------------------------------------------------------------------
  def run(self, trajs: Sequence[Trajectory], version: int, budget: int | None = None,
          recompute: bool = False) -> list[Trajectory]:
    """Advance `trajs` (new ones started, paused ones resumed) until each is done or `budget`
    tokens were generated; returns those left unfinished, paused in the engine."""
    live = {t.key: t for t in trajs if not t.done}
    for t in live.values():
      if t.started:
        self.engine.resume(t.key, recompute=recompute)
      else:
        self.engine.add(t.key, t.ids, self._params(t), hold=self.envs is not None)
        t.started = True
    generated = 0
    while self.engine.has_work() and (budget is None or generated < budget):
      ended = []
      for o in self.engine.step():
        t = live.get(o.request_id)
        if t is None:
          continue
        t.add(o.token_ids, o.logprobs, version)
        generated += len(o.token_ids)
        if o.finish_reason is not None:
          ended.append((t, o.finish_reason))
      self._end_turns(ended)
    unfinished = [t for t in live.values() if not t.done]
    for t in unfinished:
      self.engine.pause(t.key)
    return unfinished

  def _end_turns(self, ended: list[tuple[Trajectory, FinishReason]]) -> None:
    stops = set(self.config.stop_ids)
    actions = {}
    for t, reason in ended:
      t.turns += 1
      stopped = reason == FinishReason.STOP and bool(t.turn) and t.turn[-1] in stops
      t.text = self.tok.decode(t.turn[:-1] if stopped else t.turn)
      if self.envs is None:
        self._end(t, str(reason))
        continue
      parsed = parse(t.text, final=True, in_reasoning=t.rendered.rstrip().endswith(THINK_OPEN))
      actions[t.slot] = (t, reason, parsed, action(t.text, parsed, stopped))
    if not actions:
      return
    replies = self.envs.step({slot: a[3] for slot, a in actions.items()})
    for slot, (t, reason, parsed, _) in actions.items():
      self._after_step(t, reason, parsed, replies[slot])

  def _after_step(self, t: Trajectory, reason, parsed, reply: Reply) -> None:
    if reply.error is not None:
      self._end(t, ENV_ERROR, reply.error)
      return
    t.env_reward += reply.reward
    t.tool_calls += int(reply.info.get("tool_calls", 0) or 0)
    t.tool_errors += int(reply.info.get("tool_errors", 0) or 0)
    if reply.done or reason != FinishReason.STOP or t.turns >= self.config.max_turns:
      self._end(t, str(reason))
      return
    assistant = {"role": "assistant", "content": parsed.content}
    if parsed.reasoning is not None:
      assistant["reasoning_content"] = parsed.reasoning
    if parsed.tool_calls:
      assistant["tool_calls"] = [c.to_json() for c in parsed.tool_calls]
    stop_text = self.tok.decode([t.turn[-1]])
    t.rendered, ids = self.renderer.observation(t.rendered, t.messages, t.tools, assistant,
                                                reply.observation, stop_text)
    t.messages += [assistant, *reply.observation]
    if len(t.ids) + len(ids) >= self.limit:
      self._end(t, OVERLONG)
      return
    t.observe(ids)
    t.turn = []
    self.engine.resume(t.key, tokens=ids, sampling=self._params(t))

  def _end(self, t: Trajectory, finish: str, error: str | None = None) -> None:
    t.finish, t.error = finish, error
    if error is not None:
      t.env_reward = 0.0
    if t.started:
      self.engine.release(t.key)

  def release(self, trajs: Sequence[Trajectory]) -> None:
    """Let go of paused trajectories (dropped as too stale)."""
    for t in trajs:
      self.engine.release(t.key)
