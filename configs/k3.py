"""Kimi K3 (moonshotai/Kimi-K3), the text model of the released checkpoint
(docs/model.md#configuration)."""

from k3jax.config import ModelConfig


def config() -> ModelConfig:
  return ModelConfig(
      vocab_size=163840,
      hidden_size=7168,
      num_layers=93,
      # 1-based full_attn_layers 4, 8, ..., 92, 93: every fourth layer plus the last.
      mla_layers=tuple(range(3, 92, 4)) + (92,),
      kda_num_heads=96,
      kda_head_dim=128,
      conv_kernel_size=4,
      kda_gate="lower_bound",
      gate_lower_bound=-5.0,
      kda_full_rank_output_gate=True,
      mla_num_heads=96,
      q_lora_rank=1536,
      kv_lora_rank=512,
      qk_nope_head_dim=128,
      qk_rope_head_dim=64,
      v_head_dim=128,
      mla_output_gate=True,
      first_k_dense_replace=1,
      intermediate_size=33792,
      num_experts=896,
      num_experts_per_token=16,
      num_shared_experts=2,
      moe_intermediate_size=3072,
      latent_size=3584,
      latent_norm=True,
      routed_scaling_factor=1.0,
      hidden_act="situ",
      situ_beta=4.0,
      situ_linear_beta=25.0,
      attn_res_block_size=12,
      rms_norm_eps=1e-5,
      bos_token_id=163584,
      eos_token_id=163586,
      pad_token_id=163839,
  )


def reduced(num_layers: int = 4, num_experts: int = 32, **overrides) -> ModelConfig:
  """K3's widths (d 7168, 96 heads, vocab 163840, latent 3584, ...) with few layers and
  experts: a K3-shaped model whose train step compiles quickly (plan tests, before / after memory
  figures). The last layer is MLA, as in K3; AttnRes blocks of 2 layers so that
  blocks seal inside the stack."""
  return config().replace(num_layers=num_layers, mla_layers=(num_layers - 1,),
                          num_experts=num_experts, attn_res_block_size=2, **overrides)
