"""Config: presets, both HF layouts, refusal of unknown fields, round trip; the execution
(dtypes, remat, ...) apart from it, and older config files that held both."""

import json

import pytest

import configs
from k3jax.config import ModelConfig
from k3jax.errors import ConfigError
from k3jax.execution import FIELDS, Execution, Remat, recorded
from k3jax.hf_config import from_hf_config, to_hf_config


def test_k3_preset_schedule_matches_spec():
  cfg = configs.get("k3")
  assert cfg.mla_layers == tuple(range(3, 92, 4)) + (92,)
  assert len(cfg.kda_layers) == 69 and len(cfg.mla_layers) == 24
  assert cfg.dense_layers == (0,) and len(cfg.moe_layers) == 92
  assert cfg.qk_head_dim == 192 and cfg.shared_intermediate_size == 6144


def test_reference_k3_layout(reference_dir):
  cfg = from_hf_config(f"{reference_dir}/k3_tiny_a")
  assert cfg.mla_layers == (3, 7, 8)          # 1-based [4, 8, 9] in the file
  assert cfg.kda_layers == (0, 1, 2, 4, 5, 6)
  assert (cfg.latent_size, cfg.latent_norm, cfg.attn_res_block_size) == (32, True, 3)
  assert (cfg.kda_gate, cfg.gate_lower_bound, cfg.kda_full_rank_output_gate) == (
      "lower_bound", -5.0, True)
  assert (cfg.hidden_act, cfg.situ_beta, cfg.situ_linear_beta) == ("situ", 4.0, 25.0)
  assert cfg.mla_output_gate and cfg.q_lora_rank == 32 and cfg.num_shared_experts == 2


def _kimi_linear_flat():
  return {
      "model_type": "kimi_linear", "vocab_size": 163840, "hidden_size": 2304,
      "num_hidden_layers": 27, "num_attention_heads": 32, "num_key_value_heads": 32,
      "head_dim": 72, "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
      "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True,
      "intermediate_size": 9216, "moe_intermediate_size": 1024, "num_experts": 256,
      "num_experts_per_token": 8, "num_shared_experts": 1, "first_k_dense_replace": 1,
      "moe_layer_freq": 1, "moe_renormalize": True, "moe_router_activation_func": "sigmoid",
      "routed_scaling_factor": 2.446, "use_grouped_topk": True, "num_expert_group": 1,
      "topk_group": 1, "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
      "tie_word_embeddings": False, "bos_token_id": 163584, "eos_token_id": 163586,
      "pad_token_id": 163839, "torch_dtype": "bfloat16", "model_max_length": 1048576,
      "linear_attn_config": {
          "full_attn_layers": [4, 8, 12, 16, 20, 24, 27], "head_dim": 128,
          "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25,
                         26],
          "num_heads": 32, "short_conv_kernel_size": 4},
  }


def test_kimi_linear_flat_layout_equals_preset():
  assert from_hf_config(_kimi_linear_flat()) == configs.get("kimi_linear_48b")


def test_transformers_save_pretrained_layout(tmp_path):
  """transformers writes derived fields (layer_types, mlp_layer_types, linear_*) and drops
  first_k_dense_replace: they must be read, and checked against each other."""
  transformers = pytest.importorskip("transformers")
  hf = transformers.KimiLinearConfig(
      vocab_size=128, hidden_size=32, num_hidden_layers=5, num_attention_heads=2,
      q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
      moe_intermediate_size=16, intermediate_size=64, num_local_experts=8,
      num_experts_per_tok=2, linear_attn_config={
          "head_dim": 8, "num_heads": 2, "short_conv_kernel_size": 4,
          "full_attn_layers": [4, 5], "kda_layers": [1, 2, 3]})
  hf.save_pretrained(tmp_path)
  cfg = from_hf_config(tmp_path)
  assert cfg.mla_layers == (3, 4) and cfg.kda_head_dim == 8 and cfg.kda_num_heads == 2
  assert cfg.first_k_dense_replace == 1 and cfg.moe_layers == (1, 2, 3, 4)
  assert cfg.kda_gate == "softplus" and not cfg.kda_full_rank_output_gate
  assert cfg.routed_scaling_factor == pytest.approx(2.446) and cfg.hidden_act == "silu"
  raw = json.loads((tmp_path / "config.json").read_text())
  raw["layer_types"][0] = "full_attention"
  with pytest.raises(ConfigError, match="layer_types"):
    from_hf_config(raw)


@pytest.mark.parametrize("where", ["top", "linear"])
def test_unknown_fields_are_refused_by_name(where):
  raw = _kimi_linear_flat()
  if where == "top":
    raw["sliding_window"] = 4096
  else:
    raw["linear_attn_config"]["expand_v"] = 2
  with pytest.raises(ConfigError, match="sliding_window" if where == "top" else "expand_v"):
    from_hf_config(raw)


def test_k3_top_level_unknown_field_refused(reference_dir):
  raw = json.loads(open(f"{reference_dir}/k3_tiny_a/config.json").read())
  raw["speculative_heads"] = 2
  with pytest.raises(ConfigError, match="speculative_heads"):
    from_hf_config(raw)
  raw = json.loads(open(f"{reference_dir}/k3_tiny_a/config.json").read())
  del raw["text_config"]["kv_lora_rank"]
  with pytest.raises(ConfigError, match="kv_lora_rank"):
    from_hf_config(raw)


@pytest.mark.parametrize("name", configs.PRESETS)
def test_hf_round_trip(name):
  cfg = configs.get(name)
  assert from_hf_config(to_hf_config(cfg)) == cfg


def test_k3jax_dict_round_trip_and_refusal():
  cfg = configs.get("tiny")
  assert ModelConfig.from_dict(cfg.to_dict()) == cfg
  with pytest.raises(ConfigError, match="bogus"):
    ModelConfig.from_dict({**cfg.to_dict(), "bogus": 1})


def test_invalid_schedule_refused():
  with pytest.raises(ConfigError, match="mla_layers"):
    configs.get("tiny", mla_layers=(3, 9))


def test_remat_policy_names():
  """remat takes a policy name; the older bool reads as full / none; unknown names refused."""
  ex = Execution()
  assert ex.remat == "none"
  assert ex.replace(remat=True).remat == "full" and ex.replace(remat=False).remat == "none"
  flash = ex.replace(attention="flash")  # save-attention keeps the flash kernels' output
  for name in Remat:
    assert flash.replace(remat=name.value).remat == name
  with pytest.raises(ConfigError, match="remat save-attention keeps the flash kernels' output: "
                                        "it needs attention flash, not dense"):
    ex.replace(remat="save-attention")
  assert Execution.from_dict({**ex.to_dict(), "remat": True}).remat == "full"
  with pytest.raises(ConfigError, match="remat"):
    ex.replace(remat="sometimes")
  with pytest.raises(ConfigError, match="loss_chunk"):
    ex.replace(loss_chunk=0)
  with pytest.raises(ConfigError, match="attention"):
    ex.replace(attention="sparse")


def test_older_k3jax_config_files_hold_the_execution_too(tmp_path):
  """Config files written before the split (converted checkpoints, `k3jax train` outputs)
  hold dtypes, remat (a bool in the oldest) etc. beside the architecture: the architecture
  reads unchanged, the execution fields are what `recorded` returns."""
  cfg = configs.get("tiny")
  legacy = {**cfg.to_dict(), "dtype": "bfloat16", "param_dtype": "float32",
            "matmul_precision": "default", "kda_backend": None, "moe_grouped_matmul": None,
            "moe_capacity_factor": None, "moe_dispatch": None, "remat": False,
            "loss_chunk": None, "attention": "dense", "attention_block": 512,
            "scan_layers": True}
  assert set(legacy) - set(cfg.to_dict()) == FIELDS
  assert ModelConfig.from_dict(legacy) == cfg
  path = tmp_path / "k3jax_config.json"
  path.write_text(json.dumps({"format": "k3jax", "config": legacy}))
  assert configs.resolve(str(tmp_path)) == cfg
  assert recorded({"format": "k3jax", "config": legacy}) == Execution(
      dtype="bfloat16", param_dtype="float32")
  # as written now: the architecture alone, the dtypes apart
  now = {"format": "k3jax", "config": cfg.to_dict(),
         "execution": {"dtype": "bfloat16", "param_dtype": "float32"}}
  assert recorded(now) == Execution(dtype="bfloat16", param_dtype="float32")
  assert recorded({"format": "k3jax", "config": cfg.to_dict()}) == Execution()
  with pytest.raises(ConfigError, match="bogus"):
    recorded({"config": cfg.to_dict(), "execution": {"bogus": 1}})
