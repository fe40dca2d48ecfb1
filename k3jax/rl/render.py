"""Token in, token out: how a multi-turn trajectory's tokens are made (docs/rl.md#trajectories).

A trajectory is one token sequence that only grows. It starts as the chat template's render of
the environment's first messages with the generation prompt, P_0 = render(m_0, gen=True),
encoded. Each turn appends the ids the engine sampled, S_k (up to and including the stop token
that ended the turn), then the ids of the observation's rendered text:

    A   = render(m_k + [assistant_k], gen=False)         the conversation with the answer
    F   = render(m_k + [assistant_k] + obs_k, gen=True)  ... and the observation, ready for
                                                          the next answer
    obs = A[len(P_k) + c:] + F[len(A):]                  c: where the template's rendering of
                                                          the answer ends its end-of-turn
                                                          token (what it writes after it, a
                                                          newline, was never sampled)

and P_{k+1} = F. Earlier text is never encoded again, and the sampled ids are kept as they
were drawn (their text may render differently: a template that writes JSON arguments its own
way). When the model's turns are what the template writes, the trajectory is the encoding of
the whole conversation's render (tests/k3jax/rl/test_driver.py checks it). This needs a template
whose render of a conversation starts with its render of every earlier point of it: one that
rewrites earlier turns once later ones follow (drops old reasoning) is refused in one line,
as chat SFT refuses it (k3jax/tokenizer/chat.py).
"""

from __future__ import annotations

from k3jax.errors import UserError
from k3jax.tokenizer import chat


class Renderer:
  """The chat template of `tokenizer`, applied turn by turn (module docstring)."""

  def __init__(self, tokenizer):
    self.tok = tokenizer

  def render(self, messages, tools, gen: bool) -> str:
    try:
      return chat.render(self.tok, messages, tools, add_generation_prompt=gen)
    except chat.ChatError as e:
      raise UserError(f"rendering a trajectory: {e}") from None

  def encode(self, text: str) -> list[int]:
    return [int(i) for i in self.tok.encode(text)]

  def start(self, messages, tools) -> tuple[str, list[int]]:
    """(P_0, its ids)."""
    text = self.render(messages, tools, gen=True)
    return text, self.encode(text)

  def observation(self, prompt: str, messages, tools, assistant: dict, obs: list[dict],
                  stop_text: str | None) -> tuple[str, list[int]]:
    """(P_{k+1}, the observation's ids) after an answer that ended with `stop_text` (the
    text of its stop token; None when it did not end on one)."""
    answered = self.render(messages + [assistant], tools, gen=False)
    if not answered.startswith(prompt):
      raise UserError("the chat template does not render an answer after its own generation "
                      "prompt: multi-turn trajectories cannot be extended token by token")
    full = self.render(messages + [assistant] + obs, tools, gen=True)
    if not full.startswith(answered):
      raise UserError("the chat template renders earlier turns differently once later ones "
                      "follow (it rewrites them, e.g. drops old reasoning): multi-turn "
                      "trajectories need a template that only appends")
    turn = answered[len(prompt):]
    at = turn.rfind(stop_text) if stop_text else -1
    after = turn[at + len(stop_text):] if at >= 0 else ""
    text = after + full[len(answered):]
    return full, self.encode(text)
