"""A tiny model with every K3 part: KDA and MLA 3:1 plus a trailing MLA, AttnRes blocks, a
dense first layer, LatentMoE with shared experts, SiTU. Trains byte-level on a CPU.

8 experts, top 2: the routed experts' grouped matmuls dominate a CPU train step (padding and
weight gathers, see pallas_kernels/grouped_matmul/ops.py); 8 / 2 keeps routing and Quantile Balancing
meaningful at a fraction of the 16 / 4 cost (`k3jax train`'s embedded default)."""

from k3jax.config import ModelConfig


def config() -> ModelConfig:
  return ModelConfig(
      vocab_size=256,
      hidden_size=128,
      num_layers=9,
      mla_layers=(3, 7, 8),
      kda_num_heads=4,
      kda_head_dim=32,
      conv_kernel_size=4,
      kda_gate="lower_bound",
      gate_lower_bound=-5.0,
      kda_full_rank_output_gate=True,
      mla_num_heads=4,
      q_lora_rank=64,
      kv_lora_rank=32,
      qk_nope_head_dim=32,
      qk_rope_head_dim=16,
      v_head_dim=32,
      mla_output_gate=True,
      first_k_dense_replace=1,
      intermediate_size=256,
      num_experts=8,
      num_experts_per_token=2,
      num_shared_experts=2,
      moe_intermediate_size=64,
      latent_size=64,
      latent_norm=True,
      routed_scaling_factor=1.0,
      hidden_act="situ",
      situ_beta=4.0,
      situ_linear_beta=25.0,
      attn_res_block_size=3,
      rms_norm_eps=1e-5,
      dtype="float32",
      param_dtype="float32",
  )
