"""The learner: a step's completed groups of trajectories -> updates of the policy.

    rewards -> group advantages (objectives.py; DAPO's dynamic sampling and overlong masking)
            -> the packed batch (batch.py)
            -> the reference policy's logprobs (the KL metric, and the loss's KL term)
            -> under --is-correction tis / mis: the trainer's pi_old (the current weights),
               the engine's logprobs becoming the behaviour mu
            -> under --teacher: each trajectory's teacher's logprobs, and the per-token
               distillation advantages
            -> --updates-per-step optimizer steps

Every process builds the same batch from the same trajectories and rewards and places its
shards of it (docs/rl.md#several-processes).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import numpy as np

from k3jax.engine.config import bucket
from k3jax.rl import batch as batch_lib
from k3jax.rl import objectives as obj_lib
from k3jax.rl.options import RLOptions
from k3jax.rl.step import logprob_fn
from k3jax.train import step as step_lib
from sharding import distributed
from sharding.placement import batch_rows_ways


@dataclasses.dataclass
class Learned:
  """What a step's learning reports (zeros when nothing trained)."""
  state: dict
  trained: bool = False
  metrics: dict = dataclasses.field(default_factory=dict)
  reference_s: float = 0.0


@dataclasses.dataclass
class Learner:
  opts: RLOptions
  objective: obj_lib.ObjectiveConfig
  steps: step_lib.Steps
  ref_params: Any             # None under LoRA: the policy's own arrays with adapters off
  lora: bool
  seq_len: int
  wide: Any                   # float dtype of the batch's logprobs and weights
  mesh: Any
  teachers: dict = dataclasses.field(default_factory=dict)
  assign: Any = None          # teacher.Assignment
  met: bool = False           # several processes: compiled and met before the first collective

  def __post_init__(self):
    T = float(self.opts.temperature)
    self.reference = logprob_fn(self.steps, T, adapters_off=self.lora)
    self.policy = logprob_fn(self.steps, T, adapters_off=False)

  # ---- the batch ------------------------------------------------------------------------------
  def batch(self, groups, rewards: np.ndarray, version: int):
    """(trajectories, their Batch, group-advantage per trajectory, uniform groups, dropped
    groups)."""
    opts, objective = self.opts, self.objective
    adv = obj_lib.group_advantages(rewards, objective.normalize_std, objective.std_eps)
    uniform = rewards.max(axis=1) == rewards.min(axis=1) if groups else np.zeros(0, bool)
    dropped = uniform if opts.dynamic_sampling else np.zeros_like(uniform)
    trajs, trains, per_traj = [], [], []
    for p, g in enumerate(groups):
      for i, t in enumerate(g.members):
        trajs.append(t)
        trains.append(not dropped[p] and not (opts.mask_truncated and t.truncated))
        per_traj.append(adv[p, i])
    rows = opts.prompts_per_step * opts.group_size
    multiple = opts.grad_accum * (1 if self.mesh is None else batch_rows_ways(self.mesh))
    # several processes: one shape (each compiles it ahead and meets the others once)
    b = batch_lib.build(trajs, trains, [[a] * len(t.ids) for a, t in zip(per_traj, trajs)],
                        self._positions(trajs), multiple, rows, objective.loss_agg,
                        opts.max_new_tokens * opts.turns, self.wide,
                        one_per_row=objective.algorithm == obj_lib.Algorithm.GSPO,
                        fixed_rows=jax.process_count() > 1)
    return trajs, b, per_traj, uniform, dropped

  def _positions(self, trajs) -> int:
    """A row's positions: the longest trajectory's, in a power of two (a few compiled shapes),
    at most `seq_len`; always `seq_len` with several processes (one shape, compiled ahead)."""
    if jax.process_count() > 1 or not trajs:
      return self.seq_len
    longest = max(len(t.ids) for t in trajs) - 1
    return min(self.seq_len, max(8, bucket(longest, self.seq_len)))

  def _device(self, b) -> dict:
    A = self.opts.grad_accum
    dev = {k: v.reshape(A, b.rows // A, b.seq_len) for k, v in b.arrays.items()
           if k != "versions"}
    if self.mesh is not None:  # every process holds the whole batch: it places its shards
      dev = jax.device_put(dev, self.steps.batch_sharding)
    return dev

  # ---- a step ---------------------------------------------------------------------------------
  def learn(self, state: dict, groups, rewards: np.ndarray, version: int) -> Learned:
    trajs, b, per_traj, uniform, dropped = self.batch(groups, rewards, version)
    out = Learned(state, metrics=_empty(uniform, dropped))
    m = b.rollout_mask
    if not m.any():
      return out
    t0 = time.perf_counter()
    dev = self._device(b)
    ref_params = state["params"] if self.ref_params is None else self.ref_params
    if not self.met and jax.process_count() > 1:
      self._compile_then_meet(state, ref_params, dev)
    ref = self.reference(ref_params, state["router_bias"], dev)
    mu = b.arrays["old_logp"].astype(np.float64)
    out.metrics["kl"] = float(np.mean(obj_lib.k3(self._host(ref, b)[m], mu[m], xp=np)))
    if self.objective.is_correction != obj_lib.ISCorrection.NONE:
      dev["behav_logp"] = dev["old_logp"]
      dev["old_logp"] = self.policy(state["params"], state["router_bias"], dev)
    if self.teachers:
      self._distill(dev, b, trajs, per_traj, mu, out.metrics)
    out.reference_s = time.perf_counter() - t0
    trained = b.arrays["loss_mask"]
    out.metrics["trained_tokens"] = int(trained.sum())
    versions = b.arrays["versions"][trained]
    out.metrics["staleness_mean"] = float(np.mean(version - versions)) if versions.size else 0.0
    if trained.any():
      dev["ref_logp"] = ref
      train = []
      for _ in range(self.opts.updates_per_step):
        out.state, metrics = self.steps.train(out.state, dev, step_lib.NO_QK_CLIP)
        train.append(jax.device_get(metrics))
      out.trained = True
      out.metrics.update(train_metrics(train, self.objective))
    return out

  def _host(self, x, b) -> np.ndarray:
    return distributed.fetch(x).astype(np.float64).reshape(b.rows, b.seq_len)

  def _distill(self, dev, b, trajs, per_traj, mu, metrics) -> None:
    """Per-token advantages lam (teacher - mu) + (1 - lam) A_i from each trajectory's teacher
    (objectives.distill_advantages); distill_kl: the mean of mu - teacher over the sampled
    tokens (an estimate of KL(student || teacher))."""
    scored = {name: t.logprobs(dev, b, trajs) for name, t in self.teachers.items()}
    teacher = np.zeros_like(mu)
    for t, (row, at) in zip(trajs, b.where):
      n = len(t.ids) - 1
      teacher[row, at:at + n] = scored[self.assign.of(t.prompt.row)][row, at:at + n]
    group = b.per_token(trajs, [[a] * (len(t.ids) - 1) for a, t in zip(per_traj, trajs)],
                        np.float64)
    m, loss = b.rollout_mask, b.arrays["loss_mask"]
    baseline = self._baselines(b, trajs, teacher - mu) if self.opts.distill_baseline else 0.0
    adv = np.where(loss, obj_lib.distill_advantages(teacher, mu, group, self.opts.distill_weight,
                                                    baseline), 0.0)
    b.arrays["advantages"] = adv.astype(self.wide)
    A = self.opts.grad_accum
    dev["advantages"] = b.arrays["advantages"].reshape(A, b.rows // A, b.seq_len)
    if self.mesh is not None:
      dev["advantages"] = jax.device_put(dev["advantages"], self.steps.batch_sharding)
    metrics["distill_kl"] = float(np.mean((mu - teacher)[m]))

  def _baselines(self, b, trajs, d: np.ndarray) -> np.ndarray:
    """[rows, T]: the mean of `d` over the sampled tokens of each trajectory's group (the
    batch holds whole groups of group_size trajectories, in order)."""
    G, out = self.opts.group_size, np.zeros_like(d)
    for first in range(0, len(trajs), G):
      spans = [(row, at, len(t.ids) - 1) for t, (row, at) in
               zip(trajs[first:first + G], b.where[first:first + G])]
      vals = np.concatenate([d[r, a:a + n][b.rollout_mask[r, a:a + n]] for r, a, n in spans])
      for r, a, n in spans:
        out[r, a:a + n] = vals.mean() if vals.size else 0.0
    return out

  def _compile_then_meet(self, state: dict, ref_params, dev: dict) -> None:
    """Compile the logprob passes and the train step (their first calls reuse the
    executables), then wait for every process: on CPU gloo gives a peer 30 s to join a first
    collective (docs/sharding.md#multi-host). The engine's programs compile at their first
    call, in step with the other processes (the same program on each)."""
    self.reference.lower(ref_params, state["router_bias"], dev).compile()
    batch = {**dev, "ref_logp": dev["old_logp"]}  # the reference's shape, dtype and sharding
    if self.objective.is_correction != obj_lib.ISCorrection.NONE:
      batch["behav_logp"] = dev["old_logp"]
    self.steps.train.lower(state, batch, step_lib.NO_QK_CLIP).compile()
    distributed.barrier("k3jax-rl-compiled", self.opts.startup_timeout)
    self.met = True


def _empty(uniform, dropped) -> dict:
  return {"kl": 0.0, "trained_tokens": 0, "staleness_mean": 0.0, "distill_kl": 0.0,
          "groups_uniform": int(uniform.sum()), "groups_dropped": int(dropped.sum()),
          **train_metrics([], None)}


def train_metrics(train: list[dict], objective) -> dict:
  """Means over the step's updates (the first update alone for the mismatch and the
  importance weights: its policy is the rollout's); zeros when nothing trained."""
  if not train:
    return {"clip_fraction": 0.0, "entropy": 0.0, "mismatch_kl": 0.0, "mismatch_max": 0.0,
            "loss": 0.0, "grad_norm": 0.0, "lr": 0.0, "is_weight_mean": 0.0, "updates": 0}
  per = "sequences" if objective.algorithm == obj_lib.Algorithm.GSPO else "tokens"

  def ratio(m, key, den):
    return float(m[key]) / max(float(m[den]), 1.0)

  first = train[0]
  return {
      "clip_fraction": float(np.mean([ratio(m, "clipped", per) for m in train])),
      "entropy": ratio(first, "entropy", "tokens"),
      "mismatch_kl": ratio(first, "mismatch_k3", "tokens"),
      "mismatch_max": float(first["max_abs_log_ratio"]),
      "is_weight_mean": ratio(first, "is_weight", "tokens"),
      "loss": float(np.mean([float(m["loss"]) for m in train])),
      "grad_norm": float(np.mean([float(m["grad_norm"]) for m in train])),
      "lr": float(train[-1]["lr"]),
      "updates": len(train),
  }
