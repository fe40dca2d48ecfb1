"""Model FLOPs: the matmul parameters `flops.count` finds in the parameter tree equal a count
done by hand from the config fields and the layer shapes SPEC §2 gives, for a tiny config and
for K3 itself."""

import configs
from k3jax.info import summary
from k3jax.train import flops


def hand_count(cfg):
  """Weights that multiply activations per token, routed experts k of E (flops.py's rule)."""
  d, v = cfg.hidden_size, cfg.vocab_size
  h, k = cfg.kda_num_heads, cfg.kda_head_dim
  kda = (3 * d * h * k          # q, k, v projections
         + d * h * k            # full-rank output gate g
         + d * k + k * h * k    # low-rank forget gate f_a [d, K], f_b [K, H K]
         + d * h                # beta
         + h * k * d)           # o_proj
  hm, nope, rope, vd = cfg.mla_num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
  mla = (d * cfg.q_lora_rank + cfg.q_lora_rank * hm * (nope + rope)   # q_a, q_b
         + d * (cfg.kv_lora_rank + rope)                               # kv_a (latent + k_rot)
         + cfg.kv_lora_rank * hm * (nope + vd)                         # k_b, v_b
         + d * hm * vd                                                 # output gate
         + hm * vd * d)                                                # o_proj
  dense = 3 * d * cfg.intermediate_size
  lat, fe = cfg.latent_size, cfg.moe_intermediate_size
  moe = (d * cfg.num_experts                                   # router
         + 2 * d * lat                                         # routed_down, routed_up
         + 3 * d * fe * cfg.num_shared_experts                 # shared experts, one wide MLP
         + cfg.num_experts_per_token * 3 * lat * fe)           # k routed experts
  return (len(cfg.kda_layers) * kda + len(cfg.mla_layers) * mla
          + len(cfg.dense_layers) * dense + len(cfg.moe_layers) * moe + d * v)  # + lm_head


def test_tiny_matmul_params_by_hand():
  cfg = configs.get("tiny")
  assert flops.active_matmul_params(cfg) == hand_count(cfg)
  c = flops.count(cfg, seq_len=64)
  assert c.matmul == 2 * hand_count(cfg) and c.train_per_token == 3 * c.forward_per_token


def test_k3_matmul_params_by_hand():
  cfg = configs.get("k3")
  n = flops.active_matmul_params(cfg)
  assert n == hand_count(cfg)
  # the rest of `k3jax info`'s active parameters (SPEC §2.1: 105B) is the embedding table (a
  # lookup) and the elementwise ones (norm gains, conv taps, A_log, dt_bias, AttnRes queries):
  # 15M of them, well under 0.1%
  rest = summary(cfg)["active_params"] - n - cfg.vocab_size * cfg.hidden_size
  assert 0 < rest < 1e-3 * n
