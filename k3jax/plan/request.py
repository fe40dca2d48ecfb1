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
  RL = "rl"          # LoRA RL (`k3jax rl --lora`): the LoRA step beside the engine's cache


class Serving(enum.StrEnum):
  """What `--mode decode` models."""
  ENGINE = "engine"  # the serving engine (k3jax/engine): paged latent, per-slot KDA state
  STATIC = "static"  # the static left-padded batch (k3jax/generate/static_batch.py)


class Experts(enum.StrEnum):
  """How the served routed experts are held."""
  MXFP4 = "mxfp4"              # packed codes + E8M0 scales (4.25 bits a weight)
  DEQUANTIZED = "dequantized"  # in the compute dtype (bf16)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanRequest:
  """One plan's question. The defaults are the command's."""
  config: str                          # preset, HF config.json or k3jax config JSON
  topology: str                        # as get_topology_desc takes it: v5e:2x2, v5p:8x8x16
  mode: Mode = Mode.TRAIN
  mesh: str | None = None              # data=..,fsdp=..,expert=..,tensor=..; None: search
  batch: int | None = None             # global rows per step; None: one row per device
  seq: int = 8192                      # positions per row (decode: the cache's)
  grad_accum: int | None = None        # micro-batches per step (train, lora); None: searched
  analytic: bool = False               # hand count, no compile
  max_compiles: int | None = None      # compile at most this many candidates; None: until
                                       # one fits (settings search), 3 (mesh search)
  capacity_factor: float | None = None  # the routed experts'; 0: dropless; None: searched
                                        # (train, lora), dropless (decode)
  # train and lora: how the step runs (None: searched, k3jax/plan/settings.py)
  remat: Remat | None = None
  loss_chunk: int | None = None        # positions per loss chunk; 0 or None: whole logits
  attention: Attention | None = None
  # lora
  lora_rank: int = 16
  lora_targets: tuple[str, ...] | None = None  # None: lora.DEFAULT_TARGETS
  base_experts: str = "mxfp4"          # float | mxfp4: the frozen routed experts' storage
  # decode
  prefill_chunk: int = 512             # prompt tokens per prefill call
  block: int = 8                       # decode steps per jitted call (static)
  serving: Serving | None = None       # None: the engine with --analytic, else static
  experts: Experts | None = None       # None: mxfp4 for the engine, dequantized for static
  page_size: int = 64                  # engine: positions per latent page
  num_pages: int | None = None         # engine: latent pages; None: every slot at --seq
  prefix_snapshots: int | None = None  # engine: KDA state snapshots; None: 2 per slot
  data_shards: int | None = None       # engine: pool shards; None: the mesh's batch ways
  max_fit: bool = False                # decode --analytic: also the largest batch at --seq

  def __post_init__(self):
    # values read from flags or JSON arrive as strings
    object.__setattr__(self, "mode", Mode(self.mode))
    if self.remat is not None:
      object.__setattr__(self, "remat", Remat(self.remat))
    if self.attention is not None:
      object.__setattr__(self, "attention", Attention(self.attention))
    for name, kind in (("serving", Serving), ("experts", Experts)):
      if getattr(self, name) is not None:
        object.__setattr__(self, name, kind(getattr(self, name)))
    if self.lora_targets is not None:
      object.__setattr__(self, "lora_targets", tuple(self.lora_targets))

  @property
  def serving_resolved(self) -> Serving:
    """The serving model planned: the engine is counted by hand only (its step is not compiled
    yet: docs/plan.md), so a compiled plan models the static batch unless told otherwise."""
    if self.serving is not None:
      return self.serving
    return Serving.ENGINE if self.analytic else Serving.STATIC

  @property
  def experts_resolved(self) -> Experts:
    if self.experts is not None:
      return self.experts
    return Experts.MXFP4 if self.serving_resolved == Serving.ENGINE else Experts.DEQUANTIZED

  def replace(self, **changes) -> PlanRequest:
    return dataclasses.replace(self, **changes)
