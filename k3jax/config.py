"""Model configuration: one frozen dataclass for Kimi K3 and Kimi-Linear
(docs/model.md#configuration).

`ModelConfig` holds the architecture, what a checkpoint's config says, named the way the model
computes it (0-based layer lists, explicit gate kinds). How a run computes it (dtypes, kernels,
remat, ...) is `k3jax.execution.Execution`; the Hugging Face config layouts are read and
written by `k3jax.hf_config`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

from k3jax.errors import ConfigError
from k3jax.execution import split_fields


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
  """Architecture of a K3-family model.

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

  def replace(self, **changes: Any) -> ModelConfig:
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d["mla_layers"] = list(self.mla_layers)
    return d

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> ModelConfig:
    """The config of a k3jax config dict. Files written before architecture and execution were
    separated hold both in one dict: the execution fields are dropped here (their reader is
    `k3jax.execution.recorded`)."""
    d, _ = split_fields(d)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
      raise ConfigError(f"unknown k3jax config fields: {', '.join(unknown)}")
    d = dict(d)
    d["mla_layers"] = tuple(d["mla_layers"])
    return cls(**d)
