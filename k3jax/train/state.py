"""The TrainState a run (train, rl) starts from, and its checkpoints' frozen base
(docs/training.md#checkpoints-and-outputs).

A run in OUT with a complete checkpoint resumes from the last one: its target is the abstract
TrainState in the run's shardings (the trainable leaves alone when the checkpoint keeps a
frozen base out: frozen_base.py), and a frozen base is checked against the reference the
checkpoint carries, then rebuilt as the run first built it. Otherwise the state starts from
the initial parameters (k3jax/run/placement.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from k3jax.config import ModelConfig
from k3jax.execution import Execution
from k3jax.model.lora import AdaptSpec
from k3jax.train import frozen_base
from k3jax.train import step as step_lib
from k3jax.train.checkpoint import Checkpointer


@dataclasses.dataclass(frozen=True)
class ResumePoint:
  step: int | None          # the last complete checkpoint; None: a new run
  frozen: bool              # the run keeps a frozen base out of its checkpoints
  base: dict | None         # the reference to the base its checkpoints carry (frozen only)
  saved_base: bool          # the checkpoint to resume holds such a reference


def resume_point(ckpt: Checkpointer, steps: step_lib.Steps, base_folder: str | None,
                 seed: int, out: str) -> ResumePoint:
  """Where the run in `out` continues. Refuses a base that is not the one the checkpoint
  refers to, before anything is loaded or compiled. `base_folder`: the weights a new run's
  frozen base comes from (None: initialised from `seed`)."""
  step = ckpt.latest_step()
  frozen = frozen_base.has_frozen(steps.trainable)
  # (a checkpoint without a reference holds the whole state: plain training, older runs)
  saved = None if step is None else ckpt.base_reference(step)
  if saved is not None:
    frozen_base.check(saved, f"checkpoint {step} of {out}")
    return ResumePoint(step, frozen, saved, True)
  base = frozen_base.reference(base_folder, seed) if frozen else None
  return ResumePoint(step, frozen, base, False)


def restore(ckpt: Checkpointer, point: ResumePoint, steps: step_lib.Steps, cfg: ModelConfig,
            ex: Execution, spec: AdaptSpec | None, seed: int, read_shards,
            base_params: Any = None) -> tuple[dict, dict, dict]:
  """(state, data states, meta) of checkpoint `point.step`, each array restored into its
  shards; `base_params` (the run's initial params, rebuilt) completes a state saved without
  its frozen base."""
  params, bias = jax.eval_shape(lambda: step_lib.init_params(cfg, ex, seed, spec))
  target = step_lib.abstract_state(steps, params, bias)
  if point.saved_base:
    target = frozen_base.trainable_state(target, steps.trainable)
  state, data_state, meta = ckpt.restore(point.step, target, read_shards)
  if point.saved_base:  # the frozen leaves, rebuilt as the run first built them
    state = frozen_base.with_base(state, base_params, steps.trainable)
  return state, data_state, meta


def fresh(steps: step_lib.Steps, params: Any, bias: Any, seed: int) -> dict:
  """The TrainState of step 0 over the initial (placed) params."""
  rng = step_lib.new_rng(seed)
  if steps.mesh is not None:
    rng = np.asarray(rng)  # the same value on every process: replicated by the jit
  return steps.init(params, bias, rng)


def save(ckpt: Checkpointer, point: ResumePoint, steps: step_lib.Steps, step: int, state: dict,
         data_states: dict, meta: dict) -> None:
  """Checkpoint `step` (async): the whole state, or its trainable leaves and the reference to
  the frozen base."""
  if point.frozen:
    state = frozen_base.trainable_state(state, steps.trainable)
  ckpt.save(step, state, data_states, meta, base=point.base if point.frozen else None)
