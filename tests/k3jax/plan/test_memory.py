"""The LoRA vs full fine-tuning memory budget (k3jax/plan/memory.py) counts what the model
holds: its parameters as `k3jax info` counts them, and the adapters LoRA attaches."""

import math

import configs
from k3jax.info import param_breakdown
from k3jax.plan import memory


def test_budget_counts_the_model_and_its_adapters():
  cfg = configs.get("tiny")
  b = memory.budget(cfg, lora_rank=4, lora_targets=("mla.*",))
  assert b["total_params"] == sum(param_breakdown(cfg).values())
  # rank 4 on every MLA projection: 4 * (fan_in + fan_out) per layer
  from flax import nnx

  from k3jax.model.transformer import K3Model
  model = nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0)))
  want = 0
  for name in ("q_a_proj", "q_b_proj", "q_proj", "kv_a_proj", "k_b_proj", "v_b_proj",
               "g_proj", "o_proj"):
    proj = getattr(model.mla, name, None)
    if proj is None:
      continue
    n, *shape = proj.kernel.shape
    n_in = 2 if name == "o_proj" else 1
    want += n * 4 * (math.prod(shape[:n_in]) + math.prod(shape[n_in:]))
  assert b["adapter_params"] == want
  experts = b["expert_params"]
  assert experts == len(cfg.moe_layers) * cfg.num_experts * 3 * cfg.moe_intermediate_size * (
      cfg.latent_size or cfg.hidden_size)
  # MXFP4 experts: 4.25 bits each instead of 14-18 bytes of full fine-tuning state
  assert b["lora_frozen_bytes"] == (b["total_params"] - experts) * 2 + experts * 0.53125
  assert b["lora_bytes"] < b["full_bytes"] / 4
