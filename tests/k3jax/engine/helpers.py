"""A small float64 model for the engine tests, its full-forward truth, and a run-to-completion
driver."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.engine.config import EngineConfig
from k3jax.engine.engine import Engine
from k3jax.execution import Execution
from k3jax.model.transformer import K3Model
from tests.k3jax.model.helpers import randomize, tiny_cfg

# Every part of K3 in four layers (KDA, MLA, KDA, MLA; a dense first layer, then LatentMoE;
# AttnRes blocks of two), so the engine's programs compile quickly.
CFG = tiny_cfg(num_layers=4, mla_layers=(1, 3), attn_res_block_size=2)
EX = Execution(dtype="float64", param_dtype="float64", matmul_precision="highest")
CONFIG = EngineConfig(max_num_seqs=4, max_model_len=96, page_size=8, prefill_chunk=16,
                      prefix_state_every=2, num_pages=40, max_top_logprobs=4)


def model(seed: int = 1) -> K3Model:
  with jax.enable_x64(True):
    return randomize(K3Model(CFG, EX, rngs=nnx.Rngs(0)), seed=seed)


def prompts(seed: int, lengths, vocab: int = 64) -> list[list[int]]:
  """Random prompts of `lengths` ids below `vocab`, from `seed`."""
  rng = np.random.default_rng(seed)
  return [[int(t) for t in rng.integers(0, vocab, n)] for n in lengths]


def log_softmax(x: np.ndarray) -> np.ndarray:
  m = x.max(-1, keepdims=True)
  return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def drawn_from(lp_row: np.ndarray, params) -> np.ndarray:
  """The float64 log-distribution a processed request's token is drawn from, given the model's
  own log-probabilities at its position: softmax(logits / T) over the tokens top-k / top-p /
  min-p keep, renormalised (-inf elsewhere). Written from the filters' definitions, sorting
  the float64 distribution (the engine filters in float32; the tests' draws sit far from a
  boundary)."""
  x = lp_row / params.temperature  # logits / T up to a constant
  p = np.exp(log_softmax(x))
  order = np.argsort(-p, kind="stable")
  keep = np.ones(len(p), bool)
  if 0 < params.top_k < len(p):
    keep &= x >= x[order[params.top_k - 1]]
  if params.top_p < 1:
    before = np.cumsum(p[order]) - p[order]
    nucleus = np.zeros(len(p), bool)
    nucleus[order[(before < params.top_p) | (np.arange(len(p)) == 0)]] = True
    keep &= nucleus
  if params.min_p > 0:
    keep &= p >= params.min_p * p.max()
  return log_softmax(np.where(keep, x, -np.inf))


# One jitted forward for every call: a fresh `jax.jit(lambda ...)` per call traced and compiled
# the whole model again each time.
_forward = jax.jit(lambda mm, x: mm(x).logits)
TRUTH_BUCKET = 32


def truth(m: K3Model, ids) -> np.ndarray:
  """[T, V] float64 log-probabilities of the full forward at every position of `ids`.

  The sequence is right-padded to a multiple of TRUTH_BUCKET tokens so that prompts of many
  lengths share a few compiled programs: the model is causal (KDA's recurrence, MLA's mask)
  and its routed experts dropless, so tokens after position t cannot change position t."""
  ids = [int(t) for t in ids]
  padded = ids + [0] * (-len(ids) % TRUTH_BUCKET)
  logits = _forward(m, jnp.asarray([padded]))
  return log_softmax(np.asarray(logits[0, :len(ids)], np.float64))


@dataclasses.dataclass
class Result:
  tokens: list
  logprobs: list
  top: list
  finish: str | None = None
  prompt_logprobs: list | None = None
  text: str | None = None


def drain(engine: Engine, arrivals=None, aborts=None, max_steps: int = 10_000) -> dict:
  """Step until idle. arrivals: {step: [(id, prompt, params)]} added before that step;
  aborts: {step: [id]}. Returns {id: Result}."""
  arrivals, aborts = arrivals or {}, aborts or {}
  out, step = {}, 0
  last = max([*arrivals, *aborts, 0])
  while engine.has_work() or step <= last:
    for rid, prompt, params in arrivals.get(step, ()):
      engine.add(rid, prompt, params)
    for rid in aborts.get(step, ()):
      engine.abort(rid)
    for o in engine.step():
      r = out.setdefault(o.request_id, Result([], [], []))
      r.tokens += o.token_ids
      r.logprobs += o.logprobs
      r.top += o.top_logprobs
      if o.prompt_logprobs is not None:
        r.prompt_logprobs = o.prompt_logprobs
      if o.text is not None:
        r.text = o.text
      if o.finish_reason is not None:
        r.finish = o.finish_reason
    step += 1
    assert step < max_steps, "the engine did not finish"
  return out
