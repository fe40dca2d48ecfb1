"""`k3jax info`: parameter counts and inference-state sizes, computed abstractly (no allocation).

Counts come from `nnx.eval_shape` of the real model, so they are the model's own numbers, not
a formula that could drift from it. Active parameters per token follow the usual MoE
convention (DeepSeek, Kimi): every parameter except the routed experts a token does not use,
i.e. all dense weights (embedding table included) plus k of the E routed experts per MoE
layer. The router bias is a buffer, not a parameter.
"""

from __future__ import annotations

import math
from collections import defaultdict

import jax.numpy as jnp
from flax import nnx

from k3jax.config import ModelConfig
from k3jax.model.transformer import K3Model

# (top-level attribute, sub-path prefix) -> component label
_COMPONENTS = (
    (("embed",), "embedding"),
    (("lm_head",), "lm_head"),
    (("kda",), "kda"),
    (("mla",), "mla"),
    (("dense_mlp",), "dense_mlp"),
    (("moe", "experts"), "routed_experts"),
    (("moe", "shared_experts"), "shared_experts"),
    (("moe", "gate"), "router"),
    (("moe",), "latent_proj_and_norm"),
    (("layers",), "norms_and_attn_res"),
    (("final_norm",), "norms_and_attn_res"),
    (("output_res",), "norms_and_attn_res"),
)


def param_breakdown(cfg: ModelConfig) -> dict[str, int]:
  abstract = nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0)))
  counts: dict[str, int] = defaultdict(int)
  for path, var in nnx.to_flat_state(nnx.state(abstract, nnx.Param)):
    keys = tuple(str(p) for p in path)
    label = next(lbl for prefix, lbl in _COMPONENTS if keys[: len(prefix)] == prefix)
    counts[label] += math.prod(var.shape)
  return dict(counts)


def summary(cfg: ModelConfig, cache_dtype: str = "bfloat16") -> dict:
  """Parameter counts and per-request decode state of `cfg`, the cache held in `cache_dtype`
  (default bfloat16: what K3 serves in on TPU/GPU)."""
  counts = param_breakdown(cfg)
  total = sum(counts.values())
  n_moe = len(cfg.moe_layers)
  per_expert = 3 * (cfg.latent_size or cfg.hidden_size) * cfg.moe_intermediate_size
  routed = counts.get("routed_experts", 0)
  active = total - routed + n_moe * cfg.num_experts_per_token * per_expert
  n_kda, n_mla = len(cfg.kda_layers), len(cfg.mla_layers)
  kv_bytes = jnp.dtype(cache_dtype).itemsize
  kda_state = n_kda * cfg.kda_num_heads * cfg.kda_head_dim * cfg.kda_head_dim * 4
  conv_state = n_kda * (cfg.conv_kernel_size - 1) * 3 * cfg.kda_num_heads * cfg.kda_head_dim
  mla_token = n_mla * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * kv_bytes
  return {
      "total_params": total,
      "active_params": active,
      "routed_expert_params": routed,
      "params_per_routed_expert": per_expert,
      "components": dict(sorted(counts.items(), key=lambda kv: -kv[1])),
      "layers": {"kda": n_kda, "mla": n_mla, "dense_mlp": len(cfg.dense_layers), "moe": n_moe},
      "kda_state_bytes_per_request": kda_state,
      "kda_conv_state_bytes_per_request": conv_state * kv_bytes,
      "mla_cache_bytes_per_token": mla_token,
      "mla_cache_bytes_per_token_if_all_mla": cfg.num_layers * (
          cfg.kv_lora_rank + cfg.qk_rope_head_dim) * kv_bytes,
      "cache_dtype": cache_dtype,
  }


def _human(n: float, unit: str = "") -> str:
  for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
    if abs(n) >= scale:
      return f"{n / scale:.3f}{suffix}{unit}"
  return f"{n:.0f}{unit}"


def format_summary(name: str, s: dict) -> str:
  mib = 2**20
  lines = [
      f"config: {name}",
      f"layers: {s['layers']['kda']} KDA + {s['layers']['mla']} MLA; "
      f"{s['layers']['dense_mlp']} dense MLP + {s['layers']['moe']} MoE",
      f"total parameters:  {s['total_params']:,} ({_human(s['total_params'])})",
      f"active per token:  {s['active_params']:,} ({_human(s['active_params'])})",
      f"one routed expert: {s['params_per_routed_expert']:,}",
      "per component:",
  ]
  width = max(map(len, s["components"]))
  for label, n in s["components"].items():
    lines.append(f"  {label:<{width}}  {n:>18,}  {100 * n / s['total_params']:6.2f}%")
  lines += [
      f"KDA recurrent state per request: {s['kda_state_bytes_per_request']:,} bytes "
      f"({s['kda_state_bytes_per_request'] / mib:.2f} MiB, fp32) + conv tails "
      f"{s['kda_conv_state_bytes_per_request']:,} bytes",
      f"MLA cache per token: {s['mla_cache_bytes_per_token']:,} bytes ({s['cache_dtype']}); "
      f"{s['mla_cache_bytes_per_token_if_all_mla']:,} if every layer were MLA",
  ]
  return "\n".join(lines)
