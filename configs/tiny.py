"""A tiny model with every K3 part: KDA and MLA 3:1 plus a trailing MLA, AttnRes blocks, a
dense first layer, LatentMoE with shared experts, SiTU. Trains byte-level on a CPU.

8 experts, top 2: the routed experts' grouped matmuls dominate a CPU train step (padding and
weight gathers, see pallas_kernels/grouped_matmul/ops.py); 8 / 2 keeps routing and Quantile
Balancing meaningful at a fraction of the 16 / 4 cost (`k3jax train`'s embedded default)."""

from configs import k3
from k3jax.config import ModelConfig


def config() -> ModelConfig:
  """K3 (configs/k3.py) at CPU size: its layer pattern, gates and activations, small widths, a
  byte vocabulary and no special tokens."""
  return k3.config().replace(
      vocab_size=256,
      hidden_size=128,
      num_layers=9,
      mla_layers=(3, 7, 8),
      kda_num_heads=4,
      kda_head_dim=32,
      mla_num_heads=4,
      q_lora_rank=64,
      kv_lora_rank=32,
      qk_nope_head_dim=32,
      qk_rope_head_dim=16,
      v_head_dim=32,
      intermediate_size=256,
      num_experts=8,
      num_experts_per_token=2,
      moe_intermediate_size=64,
      latent_size=64,
      attn_res_block_size=3,
      bos_token_id=None,
      eos_token_id=None,
      pad_token_id=None,
  )
