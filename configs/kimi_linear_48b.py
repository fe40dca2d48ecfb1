"""Kimi-Linear-48B-A3B (moonshotai/Kimi-Linear-48B-A3B-Instruct): same family, no AttnRes,
no LatentMoE, SwiGLU, softplus decay gate, low-rank KDA output gate, no MLA output gate."""

from k3jax.config import ModelConfig


def config() -> ModelConfig:
  return ModelConfig(
      vocab_size=163840,
      hidden_size=2304,
      num_layers=27,
      # 1-based full_attn_layers 4, 8, ..., 24, 27
      mla_layers=(3, 7, 11, 15, 19, 23, 26),
      kda_num_heads=32,
      kda_head_dim=128,
      conv_kernel_size=4,
      kda_gate="softplus",
      gate_lower_bound=None,
      kda_full_rank_output_gate=False,
      mla_num_heads=32,
      q_lora_rank=None,
      kv_lora_rank=512,
      qk_nope_head_dim=128,
      qk_rope_head_dim=64,
      v_head_dim=128,
      mla_output_gate=False,
      first_k_dense_replace=1,
      intermediate_size=9216,
      num_experts=256,
      num_experts_per_token=8,
      num_shared_experts=1,
      moe_intermediate_size=1024,
      latent_size=None,
      latent_norm=False,
      routed_scaling_factor=2.446,
      hidden_act="silu",
      situ_linear_beta=None,
      attn_res_block_size=None,
      rms_norm_eps=1e-5,
      bos_token_id=163584,
      eos_token_id=163586,
      pad_token_id=163839,
      dtype="bfloat16",
      param_dtype="bfloat16",
  )
