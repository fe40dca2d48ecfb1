"""Rollouts on the serving engine, and the train batch they become.

Every prompt of a step is sampled `group_size` times by the engine over the policy's current
weights (the optimizer's own arrays: `EngineConfig(layout="stacked")` slices them inside its
step, and `set_params` hands it each update's). A completion keeps what the engine reports:
its tokens, each token's logprob under the distribution it was drawn from (pi_old of the
objective; the tempered policy, as RL sets no filters) and why it ended:

    stop    the policy drew a stop token (EOS / end of turn). The stop token is part of the
            completion: the policy chose to end, so that token is trained like any other
            (its text is not shown to the reward)
    length  max_new_tokens (or the context) ran out first: the completion is truncated. It
            is trained with the reward it got, unless --mask-truncated leaves it out of the
            loss (DAPO's overlong filtering)

A draw's seed is a function of (run seed, step, prompt slot, sample), so a resumed run draws
the same completions (the engine keys each draw by the request's seed and the position).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from k3jax.engine import Engine, FinishReason, LogprobsMode, SamplingParams
from k3jax.rl.data import Prompt


@dataclasses.dataclass
class Completion:
  prompt: Prompt
  tokens: list[int]
  logprobs: list[float]
  finish: str
  text: str = ""

  @property
  def truncated(self) -> bool:
    return self.finish != FinishReason.STOP


def draw_seeds(seed: int, step: int, prompts: int, group_size: int) -> np.ndarray:
  """[prompt slot][sample] draw seeds of a step."""
  return np.random.default_rng([seed, step]).integers(0, 2**32, size=(prompts, group_size))


def rollout(engine: Engine, prompts: Sequence[Prompt], group_size: int, *, max_new_tokens: int,
            temperature: float, stop_ids: Sequence[int], seeds: Sequence[Sequence[int]],
            decode: Callable[[list[int]], str]) -> list[list[Completion]]:
  """[prompt][sample] completions of every prompt (the caller leaves out prompts too long for
  the engine)."""
  for p, prompt in enumerate(prompts):
    for g in range(group_size):
      engine.add(f"{p}:{g}", prompt.ids, SamplingParams(
          max_tokens=max_new_tokens, temperature=temperature, seed=int(seeds[p][g]),
          logprobs=0, logprobs_mode=LogprobsMode.PROCESSED, stop_token_ids=tuple(stop_ids),
          ignore_eos=True))
  out = [[Completion(prompt, [], [], "") for _ in range(group_size)] for prompt in prompts]
  while engine.has_work():
    for o in engine.step():
      p, g = map(int, o.request_id.split(":"))
      c = out[p][g]
      c.tokens += o.token_ids
      c.logprobs += o.logprobs
      if o.finish_reason is not None:
        c.finish = str(o.finish_reason)
  stops = set(stop_ids)
  for group in out:
    for c in group:
      body = c.tokens[:-1] if c.tokens and c.tokens[-1] in stops and not c.truncated else c.tokens
      c.text = decode(body)
  return out


@dataclasses.dataclass
class Batch:
  """Host arrays of a step's train batch, [rows, T] (reshaped to [A, b, T] on the way in),
  and the mask of every completion token (`rollout_mask`: what the step's metrics cover,
  trained or not)."""
  arrays: dict[str, np.ndarray]
  rollout_mask: np.ndarray


def build_batch(rows: Sequence[tuple[Completion, float, bool]], n_rows: int, seq_len: int,
                float_dtype) -> Batch:
  """rows: (completion, advantage, trains) per completion. Row i holds prompt + completion
  shifted by one (inputs / targets), segment 1 on its tokens and 0 on padding; loss_mask,
  old_logp and advantages at the positions whose target is a completion token. Rows past
  len(rows) are padding."""
  shape = (n_rows, seq_len)
  a = {"inputs": np.zeros(shape, np.int32), "targets": np.zeros(shape, np.int32),
       "segment_ids": np.zeros(shape, np.int32), "loss_mask": np.zeros(shape, bool),
       "old_logp": np.zeros(shape, float_dtype), "advantages": np.zeros(shape, float_dtype)}
  rollout_mask = np.zeros(shape, bool)
  for i, (c, adv, trains) in enumerate(rows):
    seq = list(c.prompt.ids) + c.tokens
    n, start = len(seq) - 1, len(c.prompt.ids) - 1
    a["inputs"][i, :n] = seq[:-1]
    a["targets"][i, :n] = seq[1:]
    a["segment_ids"][i, :n] = 1
    span = slice(start, start + len(c.tokens))
    rollout_mask[i, span] = True
    a["old_logp"][i, span] = c.logprobs
    if trains:
      a["loss_mask"][i, span] = True
      a["advantages"][i, span] = adv
  return Batch(a, rollout_mask)
