"""What a request asks for (`SamplingParams`) and what a step reports about it (`RequestOutput`)."""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any


class FinishReason(enum.StrEnum):
  STOP = "stop"      # a stop token (EOS unless ignored, or one of stop_token_ids) or stop string
  LENGTH = "length"  # max_tokens reached, or the model's maximum length
  ABORT = "abort"    # aborted by the caller
  ERROR = "error"    # the request could not be served (the message says why)


class LogprobsMode(enum.StrEnum):
  RAW = "raw"              # the model's own log_softmax(logits)
  PROCESSED = "processed"  # the distribution the token was drawn from (temperature, filters)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
  """How to sample one request's tokens.

  Attributes:
    max_tokens: tokens to generate at most (0: none; with prompt_logprobs, score the prompt).
    temperature: 0 is greedy (argmax); otherwise sample softmax(logits / temperature).
    top_p: nucleus: the smallest set of most likely tokens whose probability reaches top_p.
    top_k: keep the top_k most likely tokens (0: all).
    min_p: keep the tokens at least min_p times as likely as the most likely one (0: off).
    seed: the request's draws depend on this seed and the token's position alone (not on the
      other requests); None lets the engine pick one.
    stop_token_ids: tokens that end the request (besides the model's EOS).
    stop: strings that end the request when they appear in its text (the engine needs a
      detokenizer); the text is cut before the stop string.
    ignore_eos: do not stop at the model's EOS tokens.
    logprobs: None: no logprobs; n >= 0: the sampled token's logprob and the n most likely
      alternatives (with theirs) at every generated position.
    prompt_logprobs: report every prompt token's logprob (and `logprobs` alternatives) given
      the tokens before it; the prompt is then computed, never taken from the prefix cache.
    logprobs_mode: which distribution the reported logprobs (and alternatives) of generated
      tokens are taken under. "raw": the model's own, log_softmax(logits). "processed": the
      distribution each token was actually drawn from: softmax(logits / temperature) over the
      tokens top-k / top-p / min-p keep, renormalised (others have no alternative entry);
      what an RL trainer takes as its behaviour policy. A temperature of 0 (greedy) reports
      the model's own either way. Prompt logprobs are always the model's own.
    logit_bias: {token id: value in [-100, 100]} added to the logits before sampling.
    presence_penalty: in [-2, 2], subtracted from the logit of every token already in the
      output (vLLM's definition, as the penalties below).
    frequency_penalty: in [-2, 2], times the number of times a token is in the output,
      subtracted from its logit.
    repetition_penalty: > 0 (1: off): a token in the prompt or the output has its positive
      logit divided by it and its negative logit multiplied by it.
    min_tokens: stop tokens (EOS, stop_token_ids) cannot be drawn, and stop strings do not
      count, before this many tokens were generated.
    grammar: None, or a compiled grammar (`k3jax.tokenizer.grammar.Grammar`: `matcher()`
      gives each request its own state, which masks the tokens it may draw next): the
      request's output follows it (structured output, enforced tool calls).
    The processing applies in this order: logit_bias, repetition, frequency and presence
    penalties, the grammar's mask (and min_tokens'), then temperature and top-k / top-p /
    min-p. "processed" logprobs are those of the result; "raw" the model's own.
  """

  max_tokens: int = 16
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  min_p: float = 0.0
  seed: int | None = None
  stop_token_ids: tuple[int, ...] = ()
  stop: tuple[str, ...] = ()
  ignore_eos: bool = False
  logprobs: int | None = None
  prompt_logprobs: bool = False
  logprobs_mode: LogprobsMode = LogprobsMode.RAW
  logit_bias: tuple[tuple[int, float], ...] = ()
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  repetition_penalty: float = 1.0
  min_tokens: int = 0
  grammar: Any = None

  def __post_init__(self):
    object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
    stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
    object.__setattr__(self, "stop", stop)
    if self.logprobs_mode in tuple(LogprobsMode):  # a bad value is check()'s to name
      object.__setattr__(self, "logprobs_mode", LogprobsMode(self.logprobs_mode))
    bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
    object.__setattr__(self, "logit_bias", tuple((t, v) for t, v in bias))

  def check(self, vocab_size: int, max_top_logprobs: int) -> None:
    """Raises ValueError naming the first out-of-range value."""
    if not isinstance(self.max_tokens, int) or self.max_tokens < 0:
      raise ValueError(f"max_tokens must be an integer >= 0, got {self.max_tokens!r}")
    if not (math.isfinite(self.temperature) and self.temperature >= 0):
      raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
    if not isinstance(self.top_k, int) or self.top_k < -1:
      raise ValueError(f"top_k must be an integer >= 0 (or -1: off), got {self.top_k!r}")
    if not 0 <= self.min_p <= 1:
      raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
    if self.seed is not None and not isinstance(self.seed, int):
      raise ValueError(f"seed must be an integer, got {self.seed!r}")
    if self.logprobs is not None and not 0 <= self.logprobs <= max_top_logprobs:
      raise ValueError(f"logprobs must be in [0, {max_top_logprobs}], got {self.logprobs!r}")
    if self.logprobs_mode not in tuple(LogprobsMode):
      raise ValueError(f"logprobs_mode must be one of {', '.join(LogprobsMode)}, got "
                       f"{self.logprobs_mode!r}")
    bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
    if bad:
      raise ValueError(f"stop_token_ids {bad} outside the vocabulary [0, {vocab_size})")
    if any(not isinstance(s, str) or not s for s in self.stop):
      raise ValueError(f"stop strings must be non-empty strings, got {list(self.stop)!r}")
    self._check_processing(vocab_size)

  def _check_processing(self, vocab_size: int) -> None:
    for t, v in self.logit_bias:
      if not isinstance(t, int) or not 0 <= t < vocab_size:
        raise ValueError(f"logit_bias: token id {t!r} outside the vocabulary [0, {vocab_size})")
      if not (isinstance(v, (int, float)) and -100 <= v <= 100):
        raise ValueError(f"logit_bias: the value of token {t} must be in [-100, 100], got {v!r}")
    for name in ("presence_penalty", "frequency_penalty"):
      if not -2 <= getattr(self, name) <= 2:
        raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
    if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
      raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
    if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
      raise ValueError(f"min_tokens must be an integer in [0, max_tokens], got "
                       f"{self.min_tokens!r}")


@dataclasses.dataclass
class RequestOutput:
  """What one `Engine.step()` reports about one request: the tokens it produced in that step
  (in order), their logprobs, and its finish reason once it has ended.

  `top_logprobs[i]` maps the most likely token ids at position i to their logprobs (empty
  unless the request asked for logprobs). `prompt_logprobs` comes once, in the request's first
  output: one entry per prompt token (None for the first, which has no context), each
  (logprob of the prompt token, {alternative id: logprob}). `text` is the request's whole output
  text so far when the engine has a detokenizer (cut before a stop string that ended it).
  """
  request_id: str
  token_ids: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  top_logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
  finish_reason: FinishReason | None = None
  prompt_logprobs: list[tuple[float, dict[int, float]] | None] | None = None
  text: str | None = None
  error: str | None = None

  @property
  def finished(self) -> bool:
    return self.finish_reason is not None
