"""Kimi-Linear-48B-A3B (moonshotai/Kimi-Linear-48B-A3B-Instruct): same family, no AttnRes,
no LatentMoE, SwiGLU, softplus decay gate, low-rank KDA output gate, no MLA output gate."""

from configs import k3
from k3jax.config import ModelConfig


def config() -> ModelConfig:
  """K3 (configs/k3.py) with what Kimi-Linear does differently; the vocabulary, the MLA
  widths and the special tokens are K3's."""
  return k3.config().replace(
      hidden_size=2304,
      num_layers=27,
      # 1-based full_attn_layers 4, 8, ..., 24, 27
      mla_layers=(3, 7, 11, 15, 19, 23, 26),
      kda_num_heads=32,
      kda_gate="softplus",
      gate_lower_bound=None,
      kda_full_rank_output_gate=False,
      mla_num_heads=32,
      q_lora_rank=None,
      mla_output_gate=False,
      intermediate_size=9216,
      num_experts=256,
      num_experts_per_token=8,
      num_shared_experts=1,
      moe_intermediate_size=1024,
      latent_size=None,
      latent_norm=False,
      routed_scaling_factor=2.446,
      hidden_act="silu",
      situ_beta=1.0,          # SiTU's parameters are unused by SwiGLU: the HF defaults
      situ_linear_beta=None,
      attn_res_block_size=None,
  )
