"""The options of a training run (`k3jax train`'s flags) and the train step they configure.

A resume must keep RESUME_KEYS (they fix what a checkpoint and its data position mean); the
path options in PATHS are recorded absolute (a later command may run elsewhere).
"""

from __future__ import annotations

import dataclasses

from k3jax.errors import UserError
from k3jax.folders import absolute, absolute_tokenizer
from k3jax.train import step as step_lib

RESUME_KEYS = ("data", "data_mix", "data_format", "tokenizer", "seq_len", "batch_size",
               "seed", "init_from", "data_shards", "lora_rank", "lora_alpha", "lora_targets",
               "base_experts", "experts_qat")
PATHS = {"data": absolute, "data_mix": absolute, "init_from": absolute,
         "tokenizer": absolute_tokenizer}


@dataclasses.dataclass(frozen=True)
class RunOptions:
  out: str
  config: str | None = None          # preset or config file (default "tiny"); not with init_from
  init_from: str | None = None       # converted Orbax checkpoint or official-layout HF folder
  steps: int = 300
  data: str | None = None            # text file / folder, or a prepared dataset; None: stdlib
  data_mix: str | None = None        # mix.json: a mixture of prepared datasets (not with data)
  data_workers: int = 0              # Grain worker processes packing prepared data (0: a thread)
  data_format: str = "text"          # text | chat (JSONL conversations, assistant tokens only)
  skip_bad_rows: bool = False        # chat: train on the good rows (else bad rows refuse the run)
  tokenizer: str = "auto"            # auto | byte | tiktoken | a folder holding tiktoken.model
  batch_size: int = 4                # rows per optimizer step
  grad_accum: int = 1                # micro-batches per step (batch_size % grad_accum == 0)
  seq_len: int = 128
  learning_rate: float = 1e-2
  adam_learning_rate: float | None = None
  warmup_steps: int = 20
  decay_steps: int | None = None     # the schedule's horizon; default: steps
  end_lr_ratio: float = 0.1
  schedule: str = "cosine"           # cosine | wsd | constant (step.Schedule)
  decay_frac: float = 0.2            # wsd: the last fraction of the horizon that decays
  z_loss: float = 0.0                # W: + W * logsumexp(logits)^2 per loss token (0: off)
  weight_decay: float = 0.1
  clip_norm: float | None = 1.0
  qb: bool = True
  qb_method: str = "exact"
  qb_rule: str = "k3"                # QB thresholds: "k3" (the K3 report's) | "per_expert"
  qk_clip: float | None = None       # MuonClip threshold (K2: 100); None: off
  remat: str = "none"  # none | full | save-attention | save-dots | offload (execution.Remat)
  loss_chunk: int | None = None      # positions per loss chunk (None: whole logits)
  attention: str | None = None       # MLA's training attention (None: dense)
  capacity_factor: float | None = None  # routed experts' capacity (None: dropless)
  dtype: str = "auto"                # compute dtype; auto: bfloat16 on TPU/GPU, float32 on CPU;
                                     #   float64: float64 weights and compute (exactness checks)
  mesh: str | None = None            # device mesh spec, e.g. "data=2,expert=2,tensor=2"
  data_shards: int = 1               # data pipelines of the run (never the process count)
  coordinator: str | None = None     # multi-process: HOST:PORT of process 0, or "auto"
  num_processes: int | None = None
  process_id: int | None = None
  startup_timeout: float = 3600.0    # seconds a process waits for the others to compile
  step_timeout: float | None = None  # watchdog: seconds a step may take (None: derived)
  eval_every: int = 50
  eval_batches: int = 4
  save_every: int = 100
  save_every_minutes: float | None = None  # also save when this much time passed (process 0's)
  keep: int = 3
  log_every: int = 1
  seed: int = 0
  new_stage: bool = False            # a resume that changes --seq-len, --batch-size, --data or
                                     #   the schedule on purpose (stages.py)
  peak_tflops: float | None = None   # for MFU; None: the chip table's, else measured
  profile_steps: tuple[int, int] | None = None  # A, B: a jax.profiler trace of steps A..B
  progress: bool = True
  tensorboard: bool = True
  plots: bool = True
  compile_cache: str | None = None   # persistent XLA compilation cache folder
  # fine-tuning (docs/training.md#fine-tuning; model/lora.py)
  lora_rank: int | None = None       # LoRA adapters of this rank, the base frozen; None: off
  lora_alpha: float | None = None    # adapter update scale alpha / rank (default: rank)
  lora_targets: tuple[str, ...] | None = None  # projection path patterns (default: lora.py)
  base_experts: str = "float"        # float | mxfp4: routed experts held as MXFP4 codes
  experts_qat: bool = False          # routed experts forward with MXFP4-rounded weights


def step_config(opts: RunOptions) -> step_lib.StepConfig:
  if opts.batch_size % opts.grad_accum:
    raise UserError(f"--batch-size {opts.batch_size} is not a multiple of --grad-accum "
                    f"{opts.grad_accum}")
  if not opts.z_loss >= 0:
    raise UserError(f"--z-loss must be >= 0, got {opts.z_loss}")
  try:
    return step_lib.StepConfig(
        learning_rate=opts.learning_rate, adam_learning_rate=opts.adam_learning_rate,
        warmup_steps=opts.warmup_steps, decay_steps=opts.decay_steps or opts.steps,
        end_lr_ratio=opts.end_lr_ratio, weight_decay=opts.weight_decay,
        clip_norm=opts.clip_norm, qb=opts.qb, qb_method=opts.qb_method, qb_rule=opts.qb_rule,
        schedule=opts.schedule, decay_frac=opts.decay_frac)
  except ValueError as e:
    raise UserError(f"--{str(e).replace('_', '-')}") from None


def objective(opts: RunOptions) -> step_lib.TokenNLL:
  """What the run minimises: next-token NLL (+ the z-loss when --z-loss > 0)."""
  return step_lib.TokenNLL(z_loss=float(opts.z_loss))
