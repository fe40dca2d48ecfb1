"""The options of an RL run (`k3jax rl`, docs/rl.md), their checks, and what they configure:
the objective, the optimizer and the engine."""

from __future__ import annotations

import dataclasses
import enum
from typing import ClassVar

from k3jax.engine import EngineConfig
from k3jax.engine.config import bucket
from k3jax.errors import UserError
from k3jax.folders import absolute
from k3jax.rl import objectives as obj_lib
from k3jax.train import step as step_lib


class PartialRollout(enum.StrEnum):
  KEEP = "keep"            # continue the state the engine kept (Kimi's partial rollouts)
  RECOMPUTE = "recompute"  # read it again under the new weights


@dataclasses.dataclass(frozen=True)
class RLOptions:
  init_from: str
  data: str
  reward: tuple[str, ...]
  group_size: int
  steps: int
  out: str
  prompts_per_step: int = 8
  max_new_tokens: int = 64           # per turn
  temperature: float = 1.0
  updates_per_step: int = 1
  # the objective (objectives.py)
  algorithm: str = "grpo"
  loss_agg: str | None = None        # None: the algorithm's own
  clip_eps: float | None = None      # None: the algorithm's own
  clip_higher: float | None = None   # DAPO's eps_high (None: symmetric)
  kl_coef: float = 0.0
  dynamic_sampling: bool = False     # DAPO: groups whose rewards are all equal do not train
  mask_truncated: bool = False       # DAPO: truncated completions do not train
  reward_timeout: float = 30.0
  is_correction: str = "none"        # rollout importance sampling: none | tis | mis
  is_cap: float = 2.0
  # environments and trajectories (env.py, driver.py)
  env: str | None = None             # None: one turn scored by --reward
  env_args: tuple[str, ...] = ()
  env_timeout: float = 60.0
  max_turns: int | None = None       # None: 1 without --env, 32 with
  max_trajectory_tokens: int | None = None  # None: the context
  # partial rollouts
  rollout_budget: int | None = None  # generated tokens a step; None: every trajectory ends
  partial_rollout: str = PartialRollout.KEEP
  max_staleness: int = 2             # policy versions a trajectory may span
  # on-policy distillation
  teacher: tuple[str, ...] = ()      # NAME=MODEL_FOLDER_OR_URL
  distill_weight: float = 1.0
  distill_baseline: bool = False     # teacher - student less its group mean (objectives.py)
  # the optimizer (the train step's: Per-Head Muon + AdamW; AdamW on LoRA adapters)
  learning_rate: float = 1e-6
  adam_learning_rate: float | None = None
  warmup_steps: int = 0
  weight_decay: float = 0.0
  clip_norm: float | None = 1.0
  grad_accum: int = 1
  # fine-tuning
  lora_rank: int | None = None
  lora_alpha: float | None = None
  lora_targets: tuple[str, ...] | None = None
  base_experts: str = "float"
  experts_qat: bool = False          # routed experts forward MXFP4-rounded; the engine serves
                                     #   them packed (the model export --merge-lora writes)
  # numerics, devices, engine
  dtype: str = "auto"
  remat: str = "none"
  # how the train step computes, as `k3jax train` takes them (run.options.execution reads them)
  loss_chunk: int | None = None
  attention: str | None = None
  capacity_factor: float | None = None  # refused: every pass that scores rollouts is dropless
  mesh: str | None = None
  # several processes on one mesh (sharding/distributed.py), as `k3jax train` takes them
  coordinator: str | None = None
  num_processes: int | None = None
  process_id: int | None = None
  startup_timeout: float = 3600.0
  max_model_len: int | None = None   # the context (default: the folder's, else 8192)
  max_num_seqs: int | None = None    # engine slots (default: every rollout of a step at once)
  # run
  seed: int = 0
  save_every: int = 50
  keep: int = 2
  tensorboard: bool = True
  plots: bool = True
  progress: bool = True
  compile_cache: str | None = None
  # what k3jax.run.options.adapt_spec also reads: RL does not QK-clip
  qk_clip: ClassVar[None] = None

  @property
  def turns(self) -> int:
    return self.max_turns or (32 if self.env else 1)


# a resume must keep what fixes the meaning of a checkpoint and of its data position
RESUME_KEYS = ("init_from", "data", "group_size", "prompts_per_step", "seed", "lora_rank",
               "lora_alpha", "lora_targets", "base_experts", "experts_qat", "grad_accum")
PATHS = {"init_from": absolute, "data": absolute}
# options that count something: each must be at least 1 (None: the default)
COUNTS = ("steps", "prompts_per_step", "max_new_tokens", "updates_per_step", "grad_accum",
          "save_every", "keep", "max_model_len", "max_num_seqs", "max_turns",
          "max_trajectory_tokens", "rollout_budget")


def objective_config(opts: RLOptions) -> obj_lib.ObjectiveConfig:
  try:
    return obj_lib.ObjectiveConfig(
        algorithm=opts.algorithm, loss_agg=opts.loss_agg, clip_eps=opts.clip_eps,
        clip_eps_high=opts.clip_higher, kl_coef=opts.kl_coef,
        is_correction=opts.is_correction, is_cap=opts.is_cap)
  except ValueError as e:
    raise UserError(str(e)) from None


def step_config(opts: RLOptions) -> step_lib.StepConfig:
  """The optimizer of the train step: constant learning rate after `warmup_steps` (RL's
  usual schedule), no Quantile Balancing (the router bias is part of the policy and of the
  reference: it stays as loaded). The cosine's horizon does not depend on --steps (its end
  ratio is 1): a run and its resume with a larger --steps share one compiled step."""
  return step_lib.StepConfig(
      learning_rate=opts.learning_rate, adam_learning_rate=opts.adam_learning_rate,
      warmup_steps=opts.warmup_steps, decay_steps=opts.warmup_steps + 1,
      end_lr_ratio=1.0, weight_decay=opts.weight_decay, clip_norm=opts.clip_norm, qb=False)


def check(opts: RLOptions) -> None:
  """One line (UserError) for the first option out of range."""
  for key in COUNTS:
    value = getattr(opts, key)
    if value is not None and value < 1:
      raise UserError(f"--{key.replace('_', '-')} must be >= 1, got {value}")
  for key in ("reward_timeout", "env_timeout"):
    if not getattr(opts, key) > 0:
      raise UserError(f"--{key.replace('_', '-')} must be > 0 seconds, got {getattr(opts, key)}")
  for key in ("learning_rate", "adam_learning_rate"):
    value = getattr(opts, key)
    if value is not None and not value > 0:
      raise UserError(f"--{key.replace('_', '-')} must be > 0, got {value}")
  if opts.warmup_steps < 0:
    raise UserError(f"--warmup-steps must be >= 0, got {opts.warmup_steps}")
  if opts.group_size < 2:
    raise UserError("--group-size must be >= 2: group-relative advantages compare "
                    "completions of the same prompt")
  if not opts.temperature > 0:
    raise UserError("--temperature must be > 0: greedy completions of a prompt are all "
                    "the same")
  if opts.capacity_factor:
    raise UserError(f"capacity factor {opts.capacity_factor}: RL scores every rollout dropless "
                    "(under a capacity a token's experts depend on the other tokens of its "
                    "batch, so the engine's and the trainer's logprobs would differ)")
  _check_rollouts(opts)
  rows = opts.prompts_per_step * opts.group_size
  if rows % opts.grad_accum:
    raise UserError(f"--prompts-per-step x --group-size = {rows} rollouts is not a multiple "
                    f"of --grad-accum {opts.grad_accum}")


def _check_rollouts(opts: RLOptions) -> None:
  if not opts.reward and not opts.env and not opts.teacher:
    raise UserError("--reward: give at least one (or --env, --teacher)")
  if opts.partial_rollout not in tuple(PartialRollout):
    raise UserError(f"--partial-rollout {opts.partial_rollout!r}: expected keep or recompute")
  if opts.max_staleness < 0:
    raise UserError(f"--max-staleness must be >= 0, got {opts.max_staleness}")
  if not 0 <= opts.distill_weight <= 1:
    raise UserError(f"--distill-weight must be in [0, 1], got {opts.distill_weight}")
  if opts.distill_weight < 1 and opts.teacher and not (opts.reward or opts.env):
    raise UserError("--distill-weight < 1 mixes in the reward advantage: give --reward or --env")


def engine_config(opts: RLOptions, longest_prompt: int, max_len: int) -> EngineConfig:
  """One engine shape for the run: a slot per rollout of a step (or --max-num-seqs), decode
  rows always that many and, for one-turn rollouts, one attention context (min_decode_rows,
  min_context): a step's rollouts start together and shrink as they finish, so a few programs
  serve the run. Multi-turn trajectories grow turn by turn: their context starts at 512
  positions and doubles as they need. Decode blocks of 8 steps once the prompts are read (no
  host round trip per token)."""
  slots = min(opts.max_num_seqs or 10**9, opts.prompts_per_step * opts.group_size)
  chunk = min(512, max(8, bucket(min(longest_prompt, max_len), 512)))
  page = 16 if max_len <= 256 else 64
  return EngineConfig(max_num_seqs=slots, max_model_len=max_len, page_size=page,
                      prefill_chunk=chunk, prefill_rows=min(slots, max(1, 1024 // chunk)),
                      min_decode_rows=slots,
                      min_context=max_len if opts.env is None else min(max_len, 512),
                      max_top_logprobs=1, decode_steps=8, layout="stacked")
