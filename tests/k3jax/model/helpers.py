"""Small helpers shared by the model tests: tiny configs and random parameters."""

import jax
import numpy as np
from flax import nnx

import configs
from k3jax.execution import Execution

F64 = Execution(dtype="float64", param_dtype="float64")  # exactness tests (under x64)


def tiny_cfg(**overrides):
  """A very small K3-shaped config (every part present) for module tests."""
  base = dict(vocab_size=64, hidden_size=32, kda_num_heads=2, kda_head_dim=8, mla_num_heads=2,
              q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4,
              v_head_dim=8, intermediate_size=48, num_experts=8, num_experts_per_token=3,
              moe_intermediate_size=16, latent_size=16, num_shared_experts=2)
  base.update(overrides)
  return configs.get("tiny", **base)


def kimi_linear_cfg(**overrides):
  base = dict(vocab_size=64, hidden_size=32, num_layers=5, mla_layers=(3, 4), kda_num_heads=2,
              kda_head_dim=8, mla_num_heads=2, kv_lora_rank=8, qk_nope_head_dim=8,
              qk_rope_head_dim=4, v_head_dim=8, intermediate_size=48, num_experts=8,
              num_experts_per_token=2, moe_intermediate_size=16, num_shared_experts=1)
  base.update(overrides)
  return configs.get("kimi_linear_48b", **base)


def randomize(module: nnx.Module, seed: int = 0, scale: float = 0.5) -> nnx.Module:
  """Overwrite every parameter with N(0, scale^2 / fan) values (fan = last dim), so zero-init
  weights (AttnRes queries) and unit gains get exercised too."""
  rng = np.random.default_rng(seed)
  for _, var in nnx.to_flat_state(nnx.state(module, nnx.Param)):
    value = var.get_value()
    fan = value.shape[-2] if value.ndim >= 2 else 1
    noise = rng.standard_normal(value.shape) * scale / np.sqrt(fan)
    if value.ndim == 1 or value.shape[-1] == 1:
      noise = 1.0 + noise  # gains around 1
    var.set_value(jax.numpy.asarray(noise, value.dtype))
  return module


def np64(x):
  return np.asarray(x, np.float64)
