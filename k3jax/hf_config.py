"""The Hugging Face config layouts of the K3 family, read into and written from `ModelConfig`.

`from_hf_config` reads K3's `config.json` (top level plus `text_config`, 1-based layer lists)
and Kimi-Linear's flat one (also as written by transformers' `save_pretrained`, which adds
derived fields); `to_hf_config` writes the text model's fields back. Unknown fields are refused
by name, because a field we silently ignore is a computation we silently get wrong. The dtype
fields (`torch_dtype`, `dtype`) say how the weights are stored, not what the model is: they
are read by nobody here (a checkpoint's arrays carry their own dtypes).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from k3jax.config import ModelConfig
from k3jax.errors import ConfigError

# Fields of the HF configs that k3jax reads (mapped below) or that provably do not change the
# computation of the text model (metadata, serving hints, fields derived from others).
_HF_IGNORED = frozenset({
    "architectures", "auto_map", "torch_dtype", "dtype", "transformers_version", "use_cache",
    "initializer_range", "max_position_embeddings", "model_max_length", "output_router_logits",
    "pretraining_tp", "attention_dropout", "rope_theta", "rope_scaling", "rope_parameters",
    "num_nextn_predict_layers", "quantization_config", "_name_or_path", "_commit_hash",
    "return_dict", "output_hidden_states", "output_attentions", "chunk_size_feed_forward",
    "is_encoder_decoder", "tokenizer_class", "id2label", "label2id", "problem_type",
    "tie_encoder_decoder", "add_cross_attention", "use_return_dict", "_attn_implementation",
    "_attn_implementation_autoset",
    # derived by transformers' KimiLinearConfig from other fields (checked for consistency)
    "head_dim", "qk_head_dim", "layer_types", "mlp_layer_types", "linear_head_dim",
    "linear_num_heads", "linear_conv_kernel_dim", "num_key_value_heads",
})
_HF_READ = frozenset({
    "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "linear_attn_config",
    "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
    "v_head_dim", "mla_use_output_gate", "first_k_dense_replace", "moe_layer_freq",
    "intermediate_size", "num_experts", "num_experts_per_token", "num_shared_experts",
    "moe_intermediate_size", "routed_expert_hidden_size", "latent_moe_use_norm",
    "routed_scaling_factor", "moe_renormalize", "moe_router_activation_func", "hidden_act",
    "activation_situ_beta", "activation_situ_linear_beta", "attn_res_block_size",
    "rms_norm_eps", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id",
    "use_grouped_topk", "num_expert_group", "topk_group", "attention_bias", "mla_use_nope",
})
_HF_LINEAR_KEYS = frozenset({
    "num_heads", "head_dim", "short_conv_kernel_size", "use_full_rank_gate",
    "gate_lower_bound", "full_attn_layers", "kda_layers",
})
_HF_TOP_K3 = frozenset({"text_config", "vision_config", "model_type", "architectures",
                        "auto_map", "torch_dtype", "dtype", "transformers_version",
                        "bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings",
                        "media_placeholder_token_id", "ignore_index", "use_cache",
                        "image_token_id", "video_token_id", "quantization_config"})


def load_hf_config(path_or_dict: str | os.PathLike | Mapping[str, Any]) -> dict[str, Any]:
  """The raw text-model dict of an HF config (a file, a folder holding config.json, or a dict)."""
  if isinstance(path_or_dict, Mapping):
    raw = dict(path_or_dict)
  else:
    path = os.fspath(path_or_dict)
    if os.path.isdir(path):
      path = os.path.join(path, "config.json")
    try:
      with open(path) as f:
        raw = json.load(f)
    except FileNotFoundError:
      raise ConfigError(f"{path}: no such config file") from None
    except json.JSONDecodeError as e:
      raise ConfigError(f"{path}: not valid JSON ({e})") from None
  if "text_config" in raw:  # K3 layout: multimodal wrapper, the text model inside
    unknown = sorted(set(raw) - _HF_TOP_K3)
    if unknown:
      raise ConfigError(f"unknown top-level config fields: {', '.join(unknown)}")
    text = dict(raw["text_config"])
    for key in ("tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"):
      text.setdefault(key, raw.get(key))
    return text
  return raw


def from_hf_config(path_or_dict: str | os.PathLike | Mapping[str, Any],
                   **overrides: Any) -> ModelConfig:
  """ModelConfig from an HF config.json (K3 or Kimi-Linear layout). Refuses unknown fields."""
  c = load_hf_config(path_or_dict)
  unknown = sorted(set(c) - _HF_READ - _HF_IGNORED)
  if unknown:
    raise ConfigError(f"unknown config fields: {', '.join(unknown)}")
  lin = dict(c.get("linear_attn_config") or {})
  unknown = sorted(set(lin) - _HF_LINEAR_KEYS)
  if unknown:
    raise ConfigError(f"unknown linear_attn_config fields: {', '.join(unknown)}")

  def need(key, src=c, where=""):
    if key not in src or src[key] is None:
      raise ConfigError(f"config field {where}{key} is missing")
    return src[key]

  n_layers = need("num_hidden_layers")
  if "full_attn_layers" in lin:
    mla = tuple(sorted(int(i) - 1 for i in lin["full_attn_layers"]))  # HF lists are 1-based
    kda = tuple(sorted(int(i) - 1 for i in lin.get("kda_layers", ())))
    if "kda_layers" in lin and sorted(mla + kda) != list(range(n_layers)):
      raise ConfigError("linear_attn_config: full_attn_layers and kda_layers must partition "
                        f"1..{n_layers}")
  elif "layer_types" in c:
    mla = tuple(i for i, t in enumerate(c["layer_types"]) if t == "full_attention")
  else:
    raise ConfigError("config field linear_attn_config.full_attn_layers is missing")
  if "layer_types" in c:
    derived = tuple(i for i, t in enumerate(c["layer_types"]) if t == "full_attention")
    if derived != mla or len(c["layer_types"]) != n_layers:
      raise ConfigError("layer_types disagrees with linear_attn_config.full_attn_layers")

  if c.get("attention_bias"):
    raise ConfigError("attention_bias=true is not part of the K3 family")
  if c.get("num_expert_group", 1) not in (1, None) or c.get("topk_group", 1) not in (1, None):
    raise ConfigError("grouped top-k routing with more than one group is not supported")
  if c.get("mla_use_nope") is False:
    raise ConfigError("mla_use_nope=false (rotary MLA) is not part of the K3 family")

  first_dense = c.get("first_k_dense_replace")
  if "mlp_layer_types" in c:  # transformers writes this instead of first_k_dense_replace
    dense = [i for i, t in enumerate(c["mlp_layer_types"]) if t == "dense"]
    if first_dense is None:
      first_dense = len(dense)
    if dense != list(range(first_dense)) or len(c["mlp_layer_types"]) != n_layers:
      raise ConfigError("mlp_layer_types disagrees with first_k_dense_replace")
  first_dense = 1 if first_dense is None else first_dense
  full_rank = bool(lin.get("use_full_rank_gate", False))
  lower_bound = lin.get("gate_lower_bound")
  act = c.get("hidden_act", "silu")
  kwargs = dict(
      vocab_size=need("vocab_size"),
      hidden_size=need("hidden_size"),
      num_layers=n_layers,
      mla_layers=mla,
      kda_num_heads=lin.get("num_heads", c.get("linear_num_heads")),
      kda_head_dim=lin.get("head_dim", c.get("linear_head_dim")),
      conv_kernel_size=lin.get("short_conv_kernel_size", c.get("linear_conv_kernel_dim", 4)),
      kda_gate="lower_bound" if lower_bound is not None else "softplus",
      gate_lower_bound=None if lower_bound is None else float(lower_bound),
      kda_full_rank_output_gate=full_rank,
      mla_num_heads=need("num_attention_heads"),
      q_lora_rank=c.get("q_lora_rank"),
      kv_lora_rank=need("kv_lora_rank"),
      qk_nope_head_dim=need("qk_nope_head_dim"),
      qk_rope_head_dim=need("qk_rope_head_dim"),
      v_head_dim=need("v_head_dim"),
      mla_output_gate=bool(c.get("mla_use_output_gate", False)),
      first_k_dense_replace=first_dense,
      moe_layer_freq=c.get("moe_layer_freq", 1),
      intermediate_size=need("intermediate_size"),
      num_experts=need("num_experts"),
      num_experts_per_token=need("num_experts_per_token"),
      num_shared_experts=c.get("num_shared_experts") or 0,
      moe_intermediate_size=need("moe_intermediate_size"),
      latent_size=c.get("routed_expert_hidden_size"),
      latent_norm=bool(c.get("latent_moe_use_norm", False)),
      routed_scaling_factor=float(c.get("routed_scaling_factor", 1.0)),
      moe_renormalize=bool(c.get("moe_renormalize", True)),
      router_activation=c.get("moe_router_activation_func", "sigmoid"),
      hidden_act=act,
      situ_beta=float(c.get("activation_situ_beta") or 1.0),
      situ_linear_beta=c.get("activation_situ_linear_beta"),
      attn_res_block_size=c.get("attn_res_block_size"),
      rms_norm_eps=float(c.get("rms_norm_eps", 1e-5)),
      tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
      bos_token_id=c.get("bos_token_id"),
      eos_token_id=_first(c.get("eos_token_id")),
      pad_token_id=c.get("pad_token_id"),
  )
  for key in ("kda_num_heads", "kda_head_dim"):
    if kwargs[key] is None:
      raise ConfigError(f"config field linear_attn_config.{key.removeprefix('kda_')} is missing")
  kwargs.update(overrides)
  return ModelConfig(**kwargs)


def _first(x):
  return x[0] if isinstance(x, (list, tuple)) else x


def to_hf_config(cfg: ModelConfig) -> dict[str, Any]:
  """The HF text-model fields of `cfg` (flat; K3 export nests them under `text_config`)."""
  lin = {
      "num_heads": cfg.kda_num_heads,
      "head_dim": cfg.kda_head_dim,
      "short_conv_kernel_size": cfg.conv_kernel_size,
      "full_attn_layers": [l + 1 for l in cfg.mla_layers],
      "kda_layers": [l + 1 for l in cfg.kda_layers],
  }
  if cfg.kda_full_rank_output_gate:
    lin["use_full_rank_gate"] = True
  if cfg.kda_gate == "lower_bound":
    lin["gate_lower_bound"] = cfg.gate_lower_bound
  out = {
      "model_type": "kimi_linear",
      "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.hidden_size,
      "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.mla_num_heads,
      "num_key_value_heads": cfg.mla_num_heads,
      "q_lora_rank": cfg.q_lora_rank,
      "kv_lora_rank": cfg.kv_lora_rank,
      "qk_nope_head_dim": cfg.qk_nope_head_dim,
      "qk_rope_head_dim": cfg.qk_rope_head_dim,
      "v_head_dim": cfg.v_head_dim,
      "mla_use_nope": True,
      "mla_use_output_gate": cfg.mla_output_gate,
      "intermediate_size": cfg.intermediate_size,
      "moe_intermediate_size": cfg.moe_intermediate_size,
      "num_experts": cfg.num_experts,
      "num_experts_per_token": cfg.num_experts_per_token,
      "num_shared_experts": cfg.num_shared_experts,
      "first_k_dense_replace": cfg.first_k_dense_replace,
      "moe_layer_freq": cfg.moe_layer_freq,
      "moe_renormalize": cfg.moe_renormalize,
      "moe_router_activation_func": cfg.router_activation,
      "routed_scaling_factor": cfg.routed_scaling_factor,
      "hidden_act": cfg.hidden_act,
      "rms_norm_eps": cfg.rms_norm_eps,
      "linear_attn_config": lin,
      "tie_word_embeddings": cfg.tie_word_embeddings,
      "bos_token_id": cfg.bos_token_id,
      "eos_token_id": cfg.eos_token_id,
      "pad_token_id": cfg.pad_token_id,
  }
  if cfg.latent_size is not None:
    out["routed_expert_hidden_size"] = cfg.latent_size
    out["latent_moe_use_norm"] = cfg.latent_norm
  if cfg.hidden_act == "situ":
    out["activation_situ_beta"] = cfg.situ_beta
    out["activation_situ_linear_beta"] = cfg.situ_linear_beta
  if cfg.attn_res_block_size is not None:
    out["attn_res_block_size"] = cfg.attn_res_block_size
  return out
