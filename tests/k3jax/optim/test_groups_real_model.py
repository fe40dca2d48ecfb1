"""Per-Head Muon's grouping on the real K3Model parameter trees (K3 and Kimi-Linear, abstract:
`nnx.eval_shape`), against docs/training.md: every parameter in exactly one group; per-head blocks
exactly where the spec puts them (KDA q/k/v per head d -> 128; MLA q_b per head 1536 -> 192,
Kimi-Linear's q_proj d -> 192; MLA k_b and v_b per head 512 -> 128; experts per expert); every
other matrix whole (one block per layer); AdamW for embeddings, lm_head, norms, A_log, dt_bias,
convs and AttnRes queries; the router bias is no optimizer parameter."""

import jax
import pytest
from flax import nnx

import configs
from k3jax.model.moe import RouterBias
from k3jax.model.transformer import K3Model
from k3jax.optim import dimension_numbers, logical_axes_from_state, param_labels
from k3jax.optim.groups import block_shape

ADAM_SUFFIXES = ("embed", "lm_head", "weight", "A_log", "dt_bias", "q_conv", "k_conv", "v_conv",
                 "o_norm", "attn_res.norm", "attn_res.proj", "mlp_res.norm", "mlp_res.proj",
                 "output_res.norm", "output_res.proj")


def per_head_blocks(cfg) -> dict[str, tuple[int, int, int]]:
  """path -> (blocks, fan_in, fan_out) of every per-head / per-expert Muon parameter."""
  n_kda, n_mla, n_moe = len(cfg.kda_layers), len(cfg.mla_layers), len(cfg.moe_layers)
  d, h_kda, h_mla = cfg.hidden_size, cfg.kda_num_heads, cfg.mla_num_heads
  width = cfg.latent_size or d
  qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
  out = {f"kda.{p}_proj.kernel": (n_kda * h_kda, d, cfg.kda_head_dim) for p in "qkv"}
  if cfg.q_lora_rank is not None:
    out["mla.q_b_proj.kernel"] = (n_mla * h_mla, cfg.q_lora_rank, qk)
  else:
    out["mla.q_proj.kernel"] = (n_mla * h_mla, d, qk)
  out["mla.k_b_proj.kernel"] = (n_mla * h_mla, cfg.kv_lora_rank, cfg.qk_nope_head_dim)
  out["mla.v_b_proj.kernel"] = (n_mla * h_mla, cfg.kv_lora_rank, cfg.v_head_dim)
  e = n_moe * cfg.num_experts
  out["moe.experts.w1"] = out["moe.experts.w3"] = (e, width, cfg.moe_intermediate_size)
  out["moe.experts.w2"] = (e, cfg.moe_intermediate_size, width)
  return out


@pytest.mark.parametrize("preset", ["k3", "kimi_linear_48b"])
def test_grouping_on_the_real_parameter_tree(preset):
  cfg = configs.get(preset)
  model = nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0)))
  params = nnx.state(model, nnx.Param)
  axes = logical_axes_from_state(params)
  labels = param_labels(axes)
  flat = {".".join(map(str, p)): v for p, v in nnx.to_flat_state(params)}
  flat_labels = dict(zip(flat, jax.tree.leaves(labels)))
  flat_axes = dict(zip(flat, jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))))
  assert len(flat_labels) == len(flat) and set(flat_labels.values()) <= {"muon", "adam"}

  per_head = per_head_blocks(cfg)
  if preset == "k3":  # the numbers docs/training.md names
    assert per_head["kda.q_proj.kernel"][1:] == (7168, 128)
    assert per_head["mla.q_b_proj.kernel"][1:] == (1536, 192)
    assert per_head["mla.k_b_proj.kernel"][1:] == per_head["mla.v_b_proj.kernel"][1:] == (512,
                                                                                         128)
  stacks = {"kda": len(cfg.kda_layers), "mla": len(cfg.mla_layers),
            "dense_mlp": len(cfg.dense_layers), "moe": len(cfg.moe_layers)}
  seen_per_head = set()
  for path, var in flat.items():
    label = flat_labels[path]
    dn = dimension_numbers(flat_axes[path])
    if path in per_head:
      assert label == "muon", path
      assert block_shape(var.shape, dn) == per_head[path], (path, block_shape(var.shape, dn))
      seen_per_head.add(path)
    elif path.endswith(ADAM_SUFFIXES):
      assert label == "adam", path
    else:  # a whole matrix per layer
      assert label == "muon", path
      assert block_shape(var.shape, dn)[0] == stacks[path.split(".")[0]], path
  assert seen_per_head == set(per_head)

  # the router bias is a RouterBias variable: no optimizer ever sees it
  biases = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(model, RouterBias))}
  assert biases == {"moe.gate.bias"} and "moe.gate.bias" not in flat
  with pytest.raises(ValueError, match="not an nnx.Param"):
    logical_axes_from_state(nnx.state(model))
