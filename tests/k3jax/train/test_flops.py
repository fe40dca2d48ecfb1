"""Model FLOPs: the matmul parameters `flops.count` finds in the parameter tree equal a count
done by hand from the config fields and the layer shapes docs/model.md gives, for a tiny config and
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
  # the rest of `k3jax info`'s active parameters (docs/model.md#configuration: 105B) is the
  # embedding table (a lookup) and the elementwise ones (norm gains, conv taps, A_log, dt_bias,
  # AttnRes queries): 15M of them, well under 0.1%
  rest = summary(cfg)["active_params"] - n - cfg.vocab_size * cfg.hidden_size
  assert 0 < rest < 1e-3 * n


def test_newton_schulz_flops_match_xla_cost_analysis():
  """The hand count of one Per-Head Muon update's Newton-Schulz FLOPs equals XLA's own count
  of `newton_schulz` compiled on each parameter's block shape (the tiny model: 2 m n k per
  matmul, the elementwise parts a fraction of a percent); for K3 at a 4M-token step it is the
  ~9% of the model FLOPs the K3 report's recipe implies."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from k3jax.model.transformer import K3Model
  from k3jax.optim.groups import block_shape, dimension_numbers, logical_axes_from_state
  from k3jax.optim.muon import newton_schulz
  cfg = configs.get("tiny")
  params = nnx.state(nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0))), nnx.Param)
  names = jax.tree.leaves(logical_axes_from_state(params), is_leaf=lambda x: isinstance(x, tuple))
  xla = elementwise = 0.0
  for n, v in zip(names, jax.tree.leaves(params)):
    dn = dimension_numbers(n)
    if dn is not None:
      b, m, k = block_shape(tuple(v.shape), dn)
      blocks = jax.ShapeDtypeStruct((b, m, k), jnp.float32)
      xla += jax.jit(newton_schulz).lower(blocks).compile().cost_analysis()["flops"]
      m, k = sorted((m, k))
      # not in the hand count: per iteration b A + c A A (3 m^2) and a X + (.) X (2 m k);
      # the Frobenius normalisation once (~3 m k)
      elementwise += b * (5 * (3 * m * m + 2 * m * k) + 3 * m * k)
  hand = flops.newton_schulz_flops(cfg)
  print(f"\nNewton-Schulz FLOPs, tiny: hand {hand:.4e}, XLA {xla:.4e}, elementwise "
        f"{elementwise:.3e}")
  assert hand <= xla <= hand + 1.5 * elementwise, (xla, hand, elementwise)
  k3 = configs.get("k3")
  ratio = flops.newton_schulz_flops(k3) / (flops.count(k3, 8192).train_per_token * 512 * 8192)
  assert 0.085 <= ratio <= 0.095, ratio
