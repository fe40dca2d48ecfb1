"""The memory of fine-tuning state, LoRA vs full, computed from a config (nothing allocated).

    python -m k3jax.plan.memory --config k3 [--lora 16] [--lora-targets ...] [--markdown]

Bytes per parameter of what a step holds besides activations (which depend on the batch and
remat; `k3jax plan` sizes those):

  full fine-tuning   fp32 master 4 + fp32 gradient 4 + optimizer (Per-Head Muon: momentum 4;
                     the AdamW group: two moments 8) + the bf16 compute copy 2
                     = 14 per Muon parameter, 18 per AdamW parameter
  LoRA               frozen base: bf16 2 per parameter, routed experts as MXFP4 codes and
                     E8M0 scales 0.5 + 1/32 = 0.53125 (`--base-experts mxfp4`; 2 with
                     `float`), no gradient, no optimizer state; adapters: fp32 master 4 +
                     gradient 4 + AdamW 8 = 16
                     + transient, under expert QAT only (`qat=True`): one MoE layer's experts
                     dequantised to bf16 to be rounded with their adapters (divided over the
                     devices of the expert axis); without it the grouped matmuls dequantise
                     packed experts a tile at a time (pallas_kernels/mxfp4/ops.py)
"""

from __future__ import annotations

import argparse
import math

from flax import nnx

import configs
from k3jax.config import ModelConfig
from k3jax.execution import Execution
from k3jax.model import lora
from k3jax.optim.groups import dimension_numbers
from k3jax.train.step import make_model

FULL_MUON, FULL_ADAM = 4 + 4 + 4 + 2, 4 + 4 + 8 + 2
BASE_BF16, BASE_MXFP4, ADAPTER = 2.0, 0.5 + 1 / 32, 4 + 4 + 8
HBM = {"H200 (141 GB)": 141e9, "TPU v5p (95 GB)": 95e9}


def _counts(cfg: ModelConfig, spec) -> dict[str, int]:
  abstract = nnx.eval_shape(lambda: make_model(cfg, Execution(), 0, spec))  # shapes only
  out = {"muon": 0, "adam": 0, "experts": 0, "adapters": 0}
  for path, v in nnx.to_flat_state(nnx.state(abstract, nnx.Param)):
    n = math.prod(v.shape)
    names = tuple(v.get_metadata().get("out_sharding") or ())
    if isinstance(v, nnx.LoRAParam):
      out["adapters"] += n
    elif tuple(str(p) for p in path[:2]) == ("moe", "experts"):
      out["experts"] += n
    elif dimension_numbers(names) is not None:
      out["muon"] += n
    else:
      out["adam"] += n
  return out


def budget(cfg: ModelConfig, *, lora_rank: int = 16, lora_targets: tuple[str, ...] | None = None,
           base_experts: str = "mxfp4", qat: bool = False) -> dict:
  """Parameter counts and bytes of full fine-tuning and of LoRA for `cfg`."""
  base = _counts(cfg, None)
  spec = lora.AdaptSpec(rank=lora_rank, targets=tuple(lora_targets or lora.DEFAULT_TARGETS))
  adapters = _counts(cfg, spec)["adapters"]
  expert_param = (cfg.moe_intermediate_size * (cfg.latent_size or cfg.hidden_size) * 3
                  * cfg.num_experts)
  full = (base["muon"] + base["experts"]) * FULL_MUON + base["adam"] * FULL_ADAM
  per_expert = BASE_MXFP4 if base_experts == "mxfp4" else BASE_BF16
  frozen = (base["muon"] + base["adam"]) * BASE_BF16 + base["experts"] * per_expert
  transient = expert_param * BASE_BF16 if base_experts == "mxfp4" and qat else 0
  lora_total = frozen + adapters * ADAPTER + transient
  return {
      "total_params": sum(base.values()), "expert_params": base["experts"],
      "adapter_params": adapters, "lora_rank": lora_rank, "base_experts": base_experts,
      "full_bytes": full, "lora_frozen_bytes": frozen, "lora_adapter_bytes": adapters * ADAPTER,
      "lora_transient_bytes": transient, "lora_bytes": lora_total,
      "chips": {name: {"full": math.ceil(full / hbm), "lora": math.ceil(lora_total / hbm)}
                for name, hbm in HBM.items()},
  }


def markdown(b: dict) -> str:
  tb = lambda x: f"{x / 1e12:.2f} TB" if x >= 1e11 else f"{x / 1e9:.1f} GB"
  rows = [
      "| | full fine-tuning (Per-Head Muon) | LoRA r={} over a frozen base ({} experts) |".format(
          b["lora_rank"], b["base_experts"].upper() if b["base_experts"] == "mxfp4" else "bf16"),
      "|---|---|---|",
      f"| trainable parameters | {b['total_params'] / 1e9:,.0f} B | "
      f"{b['adapter_params'] / 1e9:,.2f} B |",
      f"| weights | {tb(b['full_bytes'])} (master, grad, optimizer, bf16 copy) | "
      f"{tb(b['lora_frozen_bytes'])} frozen + {tb(b['lora_adapter_bytes'])} adapters |",
      f"| per-layer dequantised experts (transient) | - | {tb(b['lora_transient_bytes'])} |",
      f"| total (before activations) | **{tb(b['full_bytes'])}** | **{tb(b['lora_bytes'])}** |",
  ]
  for name, c in b["chips"].items():
    rows.append(f"| {name} chips to hold it | {c['full']:,} | {c['lora']:,} |")
  return "\n".join(rows)


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--config", default="k3")
  p.add_argument("--lora", type=int, default=16)
  p.add_argument("--lora-targets", nargs="+", default=None)
  p.add_argument("--base-experts", choices=("float", "mxfp4"), default="mxfp4")
  args = p.parse_args(argv)
  b = budget(configs.resolve(args.config), lora_rank=args.lora, lora_targets=args.lora_targets,
             base_experts=args.base_experts)
  print(markdown(b))


if __name__ == "__main__":
  main()
