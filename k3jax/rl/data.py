"""RL prompts: JSONL rows -> token ids, drawn in a seeded order that a checkpoint resumes.

A row is a JSON object with `prompt` (text, encoded as it is) or `messages` (chat messages,
rendered with the model folder's chat template, ready for the assistant's turn), plus whatever
fields the reward reads (`answer` for the built-in verifiers). Under `--env` a row is whatever
the environment's reset reads. Any other row (not JSON, not an
object, neither field, a prompt with no tokens) refuses the run at start, naming its line.

Order: epoch e visits every row once in the permutation of default_rng([seed, e]); the data
position is (epoch, index within it), all a checkpoint needs to continue the same sequence.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from k3jax.errors import UserError


@dataclasses.dataclass(frozen=True)
class Prompt:
  index: int          # row number in the file (0-based, blank lines skipped)
  ids: tuple[int, ...]
  text: str           # the prompt as the reward sees it (messages: the rendered text)
  row: dict


def _render(tokenizer, row: dict, where: str) -> tuple[str, list[int]]:
  if "prompt" in row:
    text = row["prompt"]
    if not isinstance(text, str):
      raise UserError(f"{where}: `prompt` must be a string")
    return text, [int(i) for i in tokenizer.encode(text)]
  messages = row.get("messages")
  if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
    raise UserError(f"{where}: a row needs `prompt` (text) or `messages` (a list of "
                    "{role, content} objects)")
  text = tokenizer.render_chat(messages, add_generation_prompt=True)
  return text, [int(i) for i in tokenizer.encode(text)]


def load_prompts(path: str, tokenizer, rendered: bool = True) -> list[Prompt]:
  """The rows of `path`. `rendered` False (an environment makes the prompt from the row):
  any JSON object is a row, its prompt left empty."""
  try:
    with open(path, encoding="utf-8") as f:
      lines = f.readlines()
  except OSError as e:
    raise UserError(f"--data {path}: {e.strerror or e}") from None
  out = []
  for n, line in enumerate(lines, 1):
    if not line.strip():
      continue
    where = f"--data {path} line {n}"
    try:
      row = json.loads(line)
    except json.JSONDecodeError as e:
      raise UserError(f"{where}: not JSON ({e.msg})") from None
    if not isinstance(row, dict):
      raise UserError(f"{where}: a row must be a JSON object")
    text, ids = _render(tokenizer, row, where) if rendered else ("", [])
    if rendered and not ids:
      raise UserError(f"{where}: the prompt has no tokens")
    out.append(Prompt(len(out), tuple(ids), text, row))
  if not out:
    raise UserError(f"--data {path}: no rows")
  return out


class PromptStream:
  """Batches of prompts in the seeded epoch order; `position` / `state` resume it."""

  def __init__(self, prompts: list[Prompt], seed: int, state: dict | None = None):
    self.prompts, self.seed = prompts, seed
    self.epoch, self.index = (0, 0) if state is None else (int(state["epoch"]),
                                                           int(state["index"]))
    self._order = self._permutation(self.epoch)

  def _permutation(self, epoch: int) -> np.ndarray:
    return np.random.default_rng([self.seed, epoch]).permutation(len(self.prompts))

  def next(self, n: int) -> list[Prompt]:
    out = []
    while len(out) < n:
      if self.index == len(self.prompts):
        self.epoch, self.index = self.epoch + 1, 0
        self._order = self._permutation(self.epoch)
      out.append(self.prompts[int(self._order[self.index])])
      self.index += 1
    return out

  def state(self) -> dict:
    return {"epoch": self.epoch, "index": self.index}
