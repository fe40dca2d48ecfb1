"""What `k3jax plan` is asked: one frozen `PlanRequest`, built by the command from its flags
(k3jax/commands/plan.py) or by a script, and read by every mode of the plan."""

from __future__ import annotations

import dataclasses
import enum

from k3jax.execution import Attention, Remat


class Mode(enum.StrEnum):
  """The program planned."""
  TRAIN = "train"    # the full train step of `k3jax train`
  LORA = "lora"      # LoRA fine-tuning over a frozen base (`k3jax train --lora`)
  DECODE = "decode"  # serving: the prefill and decode programs of `k3jax generate`


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanRequest:
  """One plan's question. The defaults are the command's."""
  config: str                          # preset, HF config.json or k3jax config JSON
  topology: str                        # as get_topology_desc takes it: v5e:2x2, v5p:8x8x16
  mode: Mode = Mode.TRAIN
  mesh: str | None = None              # data=..,fsdp=..,expert=..,tensor=..; None: search
  batch: int | None = None             # global rows per step; None: one row per device
  seq: int = 8192                      # positions per row (decode: the cache's)
  grad_accum: int = 1                  # micro-batches per step (train, lora)
  analytic: bool = False               # hand count, no compile
  max_compiles: int = 3                # without a mesh: compile at most this many candidates
  capacity_factor: float | None = None  # the routed experts'; None: dropless
  # train and lora: how the step runs (None: the Execution default)
  remat: Remat | None = None
  loss_chunk: int | None = None        # positions per loss chunk; 0 or None: whole logits
  attention: Attention | None = None
  # lora
  lora_rank: int = 16
  lora_targets: tuple[str, ...] | None = None  # None: lora.DEFAULT_TARGETS
  base_experts: str = "mxfp4"          # float | mxfp4: the frozen routed experts' storage
  # decode
  prefill_chunk: int = 512             # prompt tokens per prefill call
  block: int = 8                       # decode steps per jitted call

  def __post_init__(self):
    # values read from flags or JSON arrive as strings
    object.__setattr__(self, "mode", Mode(self.mode))
    if self.remat is not None:
      object.__setattr__(self, "remat", Remat(self.remat))
    if self.attention is not None:
      object.__setattr__(self, "attention", Attention(self.attention))
    if self.lora_targets is not None:
      object.__setattr__(self, "lora_targets", tuple(self.lora_targets))

  def replace(self, **changes) -> PlanRequest:
    return dataclasses.replace(self, **changes)
