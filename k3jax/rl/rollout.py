"""A step's rollouts: groups of trajectories drawn from the prompts and advanced by the driver
(driver.py), those still running carried to the next step (partial rollouts), and the groups
whose every trajectory ended, ready to score and learn from.

Each step draws new prompts so that `prompts_per_step` groups are in flight, `group_size`
trajectories each (a draw's seed is a function of (run seed, step, prompt slot, sample), so a
resumed run draws the same ones), and runs the driver over every trajectory in flight, up to
`--rollout-budget` generated tokens when given. A group completes when all its trajectories
ended; groups still running are carried (their trajectories paused in the engine) unless
their oldest token is more than `--max-staleness` policy versions old at the start of a step:
then the group is dropped (its trajectories counted in `stale_dropped`). A prompt with at
least the context's tokens is skipped and counted (one-turn rollouts; an environment's first
render past `--max-trajectory-tokens` ends its trajectory as `overlong`).

A trajectory ends `stop` (the policy drew a stop token: part of the trajectory, trained like any
other), `length` (max_new_tokens or the context ran out: truncated, trained unless
--mask-truncated), `overlong` or `env_error` (reward 0).

In-flight groups live in the engine and the environments' processes: a checkpoint does not
hold them, and a resumed run starts with none.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from k3jax.rl.data import Prompt, PromptStream
from k3jax.rl.driver import Driver, Trajectory


@dataclasses.dataclass
class Group:
  step: int                   # the step that drew it
  version: int                # the policy version then
  prompt: Prompt
  members: list[Trajectory]

  @property
  def done(self) -> bool:
    return all(t.done for t in self.members)


@dataclasses.dataclass
class StepRollouts:
  complete: list[Group]       # groups whose trajectories all ended, in the order drawn
  prompts_too_long: int = 0
  stale_dropped: int = 0      # trajectories dropped with their too stale groups
  carried: int = 0            # trajectories left running for the next step
  generated: int = 0          # tokens the policy sampled in this step


def draw_seeds(seed: int, step: int, prompts: int, group_size: int) -> np.ndarray:
  """[prompt slot][sample] draw seeds of a step."""
  return np.random.default_rng([seed, step]).integers(0, 2**32, size=(prompts, group_size))


class Rollouts:
  """The groups in flight across steps (module docstring)."""

  def __init__(self, driver: Driver, stream: PromptStream, *, prompts_per_step: int,
               group_size: int, seed: int, context: int, budget: int | None = None,
               recompute: bool = False, max_staleness: int = 0, one_turn: bool = True):
    self.driver, self.stream = driver, stream
    self.B, self.G, self.seed, self.context = prompts_per_step, group_size, seed, context
    self.budget, self.recompute, self.max_staleness = budget, recompute, max_staleness
    self.one_turn = one_turn
    self.flight: list[Group] = []
    self.free_slots = list(range(prompts_per_step * group_size - 1, -1, -1))

  def __call__(self, step: int, version: int) -> StepRollouts:
    out = StepRollouts([])
    out.stale_dropped = self._drop_stale(version)
    new = self._draw(step, version, out)
    self.driver.start([t for g in new for t in g.members])
    self.flight += new
    live = [t for g in self.flight for t in g.members if not t.done]
    before = sum(t.generated for t in live)
    self.driver.run(live, version, self.budget, self.recompute)
    out.generated = sum(t.generated for t in live) - before
    out.complete = [g for g in self.flight if g.done]
    self.flight = [g for g in self.flight if not g.done]
    for g in out.complete:
      self.free_slots += [t.slot for t in g.members]
    out.carried = sum(not t.done for g in self.flight for t in g.members)
    return out

  def _drop_stale(self, version: int) -> int:
    stale = [g for g in self.flight if version - g.version > self.max_staleness]
    for g in stale:
      self.driver.release([t for t in g.members if not t.done])
      self.free_slots += [t.slot for t in g.members]
    self.flight = [g for g in self.flight if g not in stale]
    return sum(len(g.members) for g in stale)

  def _draw(self, step: int, version: int, out: StepRollouts) -> list[Group]:
    n = self.B - len(self.flight)
    if n <= 0:
      return []
    prompts = self.stream.next(n)
    seeds = draw_seeds(self.seed, step, n, self.G)
    groups = []
    for p, prompt in enumerate(prompts):
      if self.one_turn and len(prompt.ids) >= self.context:
        out.prompts_too_long += 1
        continue
      members = [Trajectory(f"{step}:{p}:{g}", prompt, p, g, int(seeds[p][g]),
                            slot=self.free_slots.pop()) for g in range(self.G)]
      groups.append(Group(step, version, prompt, members))
    return groups
