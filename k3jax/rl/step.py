"""The device side of RL: the policy's token logprobs, the train-step objective, and the jitted
logprob function the reference policy (and checks) run.

The policy (docs/rl.md#the-policy-and-its-logprobs) is the model's next-token distribution at
the sampling temperature T, pi(y | x) = softmax(logits / T), the distribution the engine draws
from (no top-k / top-p filtering in RL). The engine reports the drawn tokens' logprobs under the
distribution it drew them from (`SamplingParams(logprobs_mode="processed")`); here the trainer
computes the same quantity from the same weights: logits produced wide by the head's matmul
(fp32, fp64 for a float64 model; `layers.head_logits`, as the engine's head), divided by T,
log-softmax. The reference policy is the same function of the reference weights.

The train step is `k3jax.train.step.build(..., objective=PolicyGradient(...))`: Per-Head Muon
or AdamW (LoRA), clipping, micro-batches and shardings exactly as `k3jax train`'s step; only
the loss differs. Its batch [A, b, T] holds inputs, targets, segment_ids, loss_mask (the
completion tokens that train), old_logp, ref_logp, advantages and weights (objectives.py), and
behav_logp under --is-correction tis / mis.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.model.layers import head_logits
from k3jax.rl.objectives import ObjectiveConfig, policy_loss
from k3jax.run.placement import OnMesh
from k3jax.train.loss import chunked_token_nll
from k3jax.train.step import Steps

LOGPROB_KEYS = ("inputs", "targets", "segment_ids")


def _entropy(logp_all: jax.Array) -> jax.Array:
  logp_all = jax.lax.stop_gradient(logp_all)  # a metric: no gradient through it
  return -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)


def _chunked_entropy(x_btd, head_dv, chunk: int, precision, temperature: float) -> jax.Array:
  """Entropy [B, T] of softmax(x W / T) over chunks of positions (no [B, T, V] buffer)."""
  b, t, d = x_btd.shape
  chunk = min(chunk, t)
  pad = -t % chunk
  x = jnp.pad(x_btd, ((0, 0), (0, pad), (0, 0))) if pad else x_btd
  x_nbcd = jnp.moveaxis(x.reshape(b, -1, chunk, d), 1, 0)

  def one(x_bcd):
    logits = head_logits("bcd,dv->bcv", x_bcd, head_dv, precision)  # produced wide
    return _entropy(jax.nn.log_softmax(logits / jnp.asarray(temperature, logits.dtype),
                                       axis=-1))

  ent = jax.lax.map(one, jax.lax.stop_gradient(x_nbcd))
  return jnp.moveaxis(ent, 0, 1).reshape(b, -1)[:, :t]


def token_logprobs(model, inputs, targets, segment_ids, temperature: float):
  """(log pi(targets) [b, T], entropy of pi [b, T] (no gradient), ModelOutput) of a K3Model,
  pi = softmax(logits / temperature) in the wide dtype. With `loss_chunk` the head runs over
  chunks of positions (k3jax/train/loss.py), as the train loss does."""
  ex = model.ex
  if ex.loss_chunk is None:
    out = model(inputs, segment_ids=segment_ids)
    wide = jnp.promote_types(out.logits.dtype, jnp.float32)
    logp_all = jax.nn.log_softmax(out.logits.astype(wide) / jnp.asarray(temperature, wide),
                                  axis=-1)
    logp = jnp.take_along_axis(logp_all, targets[..., None], axis=-1)[..., 0]
    return logp, _entropy(logp_all), out
  out = model(inputs, segment_ids=segment_ids, logits=False)
  head = model.head().astype(out.features.dtype)
  everywhere = jnp.ones(targets.shape, bool)
  logp = -chunked_token_nll(out.features, head, targets, everywhere, ex.loss_chunk,
                            ex.precision, temperature)
  entropy = _chunked_entropy(out.features, jax.lax.stop_gradient(head), ex.loss_chunk,
                             ex.precision, temperature)
  return logp, entropy, out


@dataclasses.dataclass(frozen=True)
class PolicyGradient:
  """The RL objective of the train step (k3jax.train.step.TokenNLL describes the contract):
  objectives.policy_loss on the policy's logprobs of a micro-batch; the loss is already
  normalised by the host-computed weights (`per_token` False). Metric sums: those of
  policy_loss, plus `entropy` over the loss tokens."""
  config: ObjectiveConfig
  temperature: float
  per_token = False

  def __call__(self, model, mb):
    logp, entropy, out = token_logprobs(model, mb["inputs"], mb["targets"], mb["segment_ids"],
                                        self.temperature)
    mask = mb["loss_mask"]
    loss, metrics = policy_loss(self.config, logp, mb["old_logp"], mb["ref_logp"],
                                mb["advantages"], mask, mb["weights"], mb.get("behav_logp"))
    metrics["entropy"] = jnp.sum(jnp.where(mask, entropy, 0.0))
    return loss, out, metrics


def zero_adapters(params: Any, trainable: Any) -> Any:
  """LoRA params with every adapter at zero: the base model exactly (x W + s (x A) 0)."""
  return jax.tree.map(lambda x, m: jnp.zeros_like(x) if m else x, params, trainable)


_LOGPROB_FNS: dict[tuple, tuple[Steps, Any]] = {}  # one jitted function per (steps, T, base)


def logprob_fn(steps: Steps, temperature: float, *, adapters_off: bool):
  """Jitted (params, router_bias, batch) -> log pi(targets) [A, b, T] of every position of a
  batch [A, b, T] (one micro-batch at a time), no gradient. `adapters_off`: of the LoRA base
  (the reference policy of a LoRA run: no second copy of the weights). Runs in one process
  with the same (cached) steps share one function, so they compile once."""
  key = (id(steps), float(temperature), adapters_off)
  held = _LOGPROB_FNS.get(key)
  if held is not None and held[0] is steps:
    return held[1]
  _LOGPROB_FNS[key] = (steps, _logprob_fn(steps, float(temperature), adapters_off))
  return _LOGPROB_FNS[key][1]


def _logprob_fn(steps: Steps, temperature: float, adapters_off: bool):
  graphdef, trainable = steps.graphdef, steps.trainable

  def fn(params, bias, batch):
    if adapters_off:
      params = zero_adapters(params, trainable)

    def one(mb):
      model = nnx.merge(graphdef, nnx.State(params), nnx.State(bias))
      return token_logprobs(model, *(mb[k] for k in LOGPROB_KEYS), temperature)[0]

    return jax.lax.map(one, {k: batch[k] for k in LOGPROB_KEYS})

  if steps.mesh is None:
    return jax.jit(fn)
  sh = steps.shardings
  return OnMesh(jax.jit(fn, in_shardings=(sh["params"], sh["router_bias"], steps.batch_sharding),
                        out_shardings=steps.batch_sharding), steps.mesh)
