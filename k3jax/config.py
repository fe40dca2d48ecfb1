"""Model configuration: one frozen dataclass for Kimi K3 and Kimi-Linear
(docs/model.md#configuration).

`ModelConfig` names things the way the model computes them (0-based layer lists, explicit gate
kinds); `from_hf_config` reads the Hugging Face layouts: K3's `config.json` (top level plus
`text_config`, 1-based layer lists) and Kimi-Linear's flat one (also as written by transformers'
`save_pretrained`, which adds derived fields). Unknown fields are refused by name, because a
field we silently ignore is a computation we silently get wrong.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any, Literal

import jax
import jax.numpy as jnp

from k3jax.errors import ConfigError


REMAT_POLICIES = ("none", "full", "save-dots", "offload")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
  """Architecture and numerics of a K3-family model.

  Attributes:
    vocab_size: number of token embeddings and logits.
    hidden_size: model width d.
    num_layers: decoder layers L.
    mla_layers: 0-based indices of the gated-MLA layers; every other layer is KDA.
    kda_num_heads: KDA heads H.
    kda_head_dim: KDA key and value width per head (d_k = d_v).
    conv_kernel_size: taps of the causal depthwise conv on KDA q, k, v.
    kda_gate: decay-gate form. "lower_bound" (K3): g = lb * sigmoid(exp(A) * (f + dt_bias));
      "softplus" (Kimi-Linear): g = -exp(A) * softplus(f + dt_bias).
    gate_lower_bound: lb of the "lower_bound" gate (K3: -5.0); None for "softplus".
    kda_full_rank_output_gate: True (K3): output gate g_proj is d -> H*d_v; False
      (Kimi-Linear): low rank g_b(g_a(x)) through kda_head_dim.
    mla_num_heads: MLA heads.
    q_lora_rank: MLA query low rank (K3: 1536); None means a plain q_proj (Kimi-Linear).
    kv_lora_rank: MLA compressed key/value width c.
    qk_nope_head_dim: MLA per-head key/query width produced from c.
    qk_rope_head_dim: MLA shared key width ("rope" dims, never rotated: NoPE).
    v_head_dim: MLA value width per head.
    mla_output_gate: sigmoid output gate g_proj on MLA (K3: True, Kimi-Linear: False).
    first_k_dense_replace: layers [0, k) use the dense MLP instead of the MoE.
    moe_layer_freq: a layer >= first_k_dense_replace is MoE when l % moe_layer_freq == 0.
    intermediate_size: dense MLP width.
    num_experts: routed experts E.
    num_experts_per_token: experts selected per token k.
    num_shared_experts: shared experts, fused into one MLP of width n * moe_intermediate_size.
    moe_intermediate_size: routed-expert MLP width.
    latent_size: LatentMoE width l (`routed_expert_hidden_size`); None runs experts on the
      full width d (Kimi-Linear).
    latent_norm: RMSNorm on the summed latent expert output (`latent_moe_use_norm`).
    routed_scaling_factor: multiplies the routing weights (K3 1.0, Kimi-Linear 2.446).
    moe_renormalize: divide the top-k scores by their sum (+1e-20).
    router_activation: score function of the router ("sigmoid").
    hidden_act: "situ" (SiTU-GLU, K3) or "silu" (SwiGLU, Kimi-Linear).
    situ_beta: SiTU gate clip beta (K3 4.0; the official default 1.0 when absent).
    situ_linear_beta: SiTU clip of the up projection (K3 25.0); None leaves it linear.
    attn_res_block_size: layers per Block AttnRes block (K3 12); None = ordinary residual.
    rms_norm_eps: eps of every RMSNorm except the MLA latent norms.
    mla_norm_eps: eps of q_a_layernorm / kv_a_layernorm (1e-6 in the official code).
    l2norm_eps: eps inside KDA's q/k l2 normalisation x * rsqrt(sum x^2 + eps).
    tie_word_embeddings: share embedding and lm_head (never for K3).
    bos_token_id, eos_token_id, pad_token_id: special tokens, informational.
    dtype: compute dtype of activations and matmuls ("float32", "bfloat16", "float64").
    param_dtype: storage dtype of parameters.
    matmul_precision: jax.lax.Precision name for matmuls ("default" or "highest"); parity
      work wants "highest".
    kda_backend: KDA op backend; None picks by platform (see pallas_kernels.kda.ops).
    moe_grouped_matmul: routed experts' grouped matmul, "ragged_dot", "megablox" (a Pallas
      TPU kernel) or "tiled"; None picks by platform (tiled on CPU, where ragged_dot is slow;
      megablox on TPU, whose work stops at the group sizes; ragged_dot on GPU; see
      pallas_kernels.grouped_matmul).
    moe_capacity_factor: None (default) keeps the routed experts dropless: every selected
      (token, expert) pair is computed and the exchange buffers are sized for the worst case.
      A float c caps every expert at ceil(c * k * n / E) pairs per step, n the tokens of its
      expert-parallel group (the tokens of one device times the `expert` mesh axis; all tokens
      without a mesh): pairs past the cap, later tokens first, are dropped (they add nothing
      to their token's output, the other weights are not renormalised) and counted
      (`Routing.dropped_pairs`). Bounds the exchange buffers and the grouped matmuls to about
      c times the balanced load instead of the worst case (k3jax/model/expert_parallel.py).
    moe_dispatch: expert-parallel exchange, "ragged" (jax.lax.ragged_all_to_all: moves only
      the routed rows) or "padded" (all_to_all of fixed-size per-device buffers, for XLA:CPU,
      which lacks ragged_all_to_all); None picks by the platform the program is lowered for.
    remat: rematerialisation policy of each layer in the backward pass (REMAT_POLICIES):
      "none" keeps every activation; "full" keeps only the layer's input and recomputes the
      layer; "save-dots" keeps the outputs of matmuls without batch dims (the projections)
      and recomputes the rest; "offload" keeps those in host memory (pinned_host) instead of
      HBM. True / False (older configs) read as "full" / "none".
    loss_chunk: None (default) computes the train loss from the whole [B, T, V] logits; an
      int C computes it in chunks of C positions with the head matmul inside and the chunk's
      logits recomputed in the backward (k3jax/train/loss.py): the same numbers, without
      the [tokens, vocab] fp32 buffers.
    attention: MLA's training attention, "dense" (the [B, H, T, T] scores; the reference) or
      "flash" (blockwise online softmax, pallas_kernels/flash_attention/ops.py: the same numbers, no [T, T]
      buffer).
    attention_block: query and key block of the flash attention (positions).
    scan_layers: run the longest stretch of identical repeating layer units under one
      lax.scan (compile time independent of depth); numerically identical to unrolling.
  """

  vocab_size: int
  hidden_size: int
  num_layers: int
  mla_layers: tuple[int, ...]
  # KDA
  kda_num_heads: int
  kda_head_dim: int
  conv_kernel_size: int = 4
  kda_gate: Literal["lower_bound", "softplus"] = "lower_bound"
  gate_lower_bound: float | None = -5.0
  kda_full_rank_output_gate: bool = True
  # MLA
  mla_num_heads: int
  q_lora_rank: int | None
  kv_lora_rank: int
  qk_nope_head_dim: int
  qk_rope_head_dim: int
  v_head_dim: int
  mla_output_gate: bool = True
  # MLP / MoE
  first_k_dense_replace: int = 1
  moe_layer_freq: int = 1
  intermediate_size: int
  num_experts: int
  num_experts_per_token: int
  num_shared_experts: int
  moe_intermediate_size: int
  latent_size: int | None
  latent_norm: bool = True
  routed_scaling_factor: float = 1.0
  moe_renormalize: bool = True
  router_activation: Literal["sigmoid"] = "sigmoid"
  hidden_act: Literal["situ", "silu"] = "situ"
  situ_beta: float = 1.0
  situ_linear_beta: float | None = None
  # residual
  attn_res_block_size: int | None = 12
  rms_norm_eps: float = 1e-5
  mla_norm_eps: float = 1e-6
  l2norm_eps: float = 1e-6
  tie_word_embeddings: bool = False
  bos_token_id: int | None = None
  eos_token_id: int | None = None
  pad_token_id: int | None = None
  # numerics
  dtype: str = "float32"
  param_dtype: str = "float32"
  matmul_precision: Literal["default", "high", "highest"] = "default"
  kda_backend: str | None = None
  moe_grouped_matmul: Literal["ragged_dot", "megablox", "tiled"] | None = None
  moe_capacity_factor: float | None = None
  moe_dispatch: Literal["ragged", "padded"] | None = None
  remat: str = "none"
  loss_chunk: int | None = None
  attention: Literal["dense", "flash"] = "dense"
  attention_block: int = 512
  scan_layers: bool = True

  def __post_init__(self):
    if any(not 0 <= l < self.num_layers for l in self.mla_layers):
      raise ConfigError(f"mla_layers {self.mla_layers} outside [0, {self.num_layers})")
    if tuple(sorted(set(self.mla_layers))) != tuple(self.mla_layers):
      raise ConfigError(f"mla_layers must be sorted and unique, got {self.mla_layers}")
    if self.kda_gate == "lower_bound" and self.gate_lower_bound is None:
      raise ConfigError("kda_gate='lower_bound' needs gate_lower_bound")
    if self.kda_gate not in ("lower_bound", "softplus"):
      raise ConfigError(f"unknown kda_gate {self.kda_gate!r}")
    if self.hidden_act not in ("situ", "silu"):
      raise ConfigError(f"unsupported hidden_act {self.hidden_act!r}")
    if self.router_activation != "sigmoid":
      raise ConfigError(f"unsupported router activation {self.router_activation!r}")
    if self.num_experts_per_token > self.num_experts:
      raise ConfigError("num_experts_per_token exceeds num_experts")
    if self.moe_capacity_factor is not None and not self.moe_capacity_factor > 0:
      raise ConfigError(f"moe_capacity_factor must be > 0, got {self.moe_capacity_factor}")
    if self.moe_dispatch not in (None, "ragged", "padded"):
      raise ConfigError(f"unknown moe_dispatch {self.moe_dispatch!r}")
    if self.loss_chunk is not None and self.loss_chunk <= 0:
      raise ConfigError(f"loss_chunk must be > 0, got {self.loss_chunk}")
    if self.attention not in ("dense", "flash"):
      raise ConfigError(f"unknown attention {self.attention!r}; choose dense or flash")
    if self.attention_block <= 0:
      raise ConfigError(f"attention_block must be > 0, got {self.attention_block}")
    if isinstance(self.remat, bool) or self.remat is None:
      object.__setattr__(self, "remat", "full" if self.remat else "none")
    if self.remat not in REMAT_POLICIES:
      raise ConfigError(f"unknown remat policy {self.remat!r}; choose one of "
                        f"{', '.join(REMAT_POLICIES)}")
    for name in ("dtype", "param_dtype"):
      jnp.dtype(getattr(self, name))  # raises on an unknown dtype name

  # ---- derived schedule -------------------------------------------------------------------
  def is_mla(self, layer: int) -> bool:
    return layer in self.mla_layers

  def is_moe(self, layer: int) -> bool:
    return (self.num_experts > 0 and layer >= self.first_k_dense_replace
            and layer % self.moe_layer_freq == 0)

  @property
  def kda_layers(self) -> tuple[int, ...]:
    return tuple(l for l in range(self.num_layers) if not self.is_mla(l))

  @property
  def moe_layers(self) -> tuple[int, ...]:
    return tuple(l for l in range(self.num_layers) if self.is_moe(l))

  @property
  def dense_layers(self) -> tuple[int, ...]:
    return tuple(l for l in range(self.num_layers) if not self.is_moe(l))

  def stack_index(self, layer: int) -> tuple[int, int]:
    """(index of the layer's mixer in its KDA or MLA stack, index of its MLP in its stack)."""
    mixers = self.mla_layers if self.is_mla(layer) else self.kda_layers
    mlps = self.moe_layers if self.is_moe(layer) else self.dense_layers
    return mixers.index(layer), mlps.index(layer)

  @property
  def qk_head_dim(self) -> int:
    return self.qk_nope_head_dim + self.qk_rope_head_dim

  @property
  def shared_intermediate_size(self) -> int:
    return self.num_shared_experts * self.moe_intermediate_size

  @property
  def jnp_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.dtype)

  @property
  def jnp_param_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.param_dtype)

  @property
  def precision(self) -> jax.lax.Precision:
    return jax.lax.Precision[self.matmul_precision.upper()]

  def replace(self, **changes: Any) -> "ModelConfig":
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d["mla_layers"] = list(self.mla_layers)
    return d

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
      raise ConfigError(f"unknown k3jax config fields: {', '.join(unknown)}")
    d = dict(d)
    d["mla_layers"] = tuple(d["mla_layers"])
    return cls(**d)


# ---- Hugging Face layouts --------------------------------------------------------------------

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
