"""How a run computes and what it adapts, from its options (train's RunOptions, rl's RLOptions:
any object with the fields read here).

  execution(opts)        dtype, master dtype, remat, loss chunks, MLA attention, capacity
  adapt_spec(opts, cfg)  LoRA / packed MXFP4 experts / expert QAT, checked against the model
"""

from __future__ import annotations

from flax import nnx

from k3jax.config import ModelConfig
from k3jax.errors import ConfigError, UserError
from k3jax.execution import Execution, resolve_dtype
from k3jax.model import lora
from k3jax.model.transformer import K3Model


def master_dtype(dtype: str) -> str:
  """The master weights' dtype of a run computing in `dtype` (--dtype)."""
  return "float64" if dtype == "float64" else "float32"


def execution(opts) -> Execution:
  """How the run computes: bf16 (or fp32) compute over fp32 master weights (fp64 over fp64
  when asked); remat, loss chunks, MLA's attention and the experts' capacity (the knobs
  `k3jax plan` searches and prints as train flags)."""
  knobs = {"loss_chunk": opts.loss_chunk, "attention": opts.attention,
           "moe_capacity_factor": opts.capacity_factor}
  try:
    return Execution(dtype=resolve_dtype(opts.dtype), param_dtype=master_dtype(opts.dtype),
                     remat=opts.remat, **{k: v for k, v in knobs.items() if v})  # 0: off
  except ConfigError as e:
    raise UserError(str(e)) from None


def adapt_spec(opts, cfg: ModelConfig) -> lora.AdaptSpec | None:
  """The AdaptSpec of the run (None: plain training), checked against the model."""
  if opts.lora_rank is None and (opts.lora_alpha is not None or opts.lora_targets):
    raise UserError("--lora-alpha and --lora-targets need --lora RANK")
  if opts.lora_rank is None and opts.base_experts == "float" and not opts.experts_qat:
    return None
  if opts.lora_rank is not None and opts.lora_rank <= 0:
    raise UserError(f"--lora RANK must be > 0, got {opts.lora_rank}")
  if opts.lora_rank is not None and opts.qk_clip is not None:
    raise UserError("--qk-clip rescales base weights, which --lora keeps frozen")
  if opts.base_experts not in ("float", "mxfp4"):
    raise UserError(f"--base-experts {opts.base_experts!r}: expected float or mxfp4")
  if (opts.base_experts == "mxfp4" or opts.experts_qat) and not cfg.moe_layers:
    raise UserError("--base-experts mxfp4 / --experts-qat: the model has no routed experts")
  spec = lora.AdaptSpec(rank=opts.lora_rank, alpha=opts.lora_alpha,
                        targets=tuple(opts.lora_targets or lora.DEFAULT_TARGETS),
                        base_experts=opts.base_experts, qat=opts.experts_qat)
  if spec.lora:
    try:
      lora.matching(spec, nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0))))
    except ValueError as e:
      raise UserError(str(e)) from None
  return spec
